"""A brainstate user's LIF simulation, under brainstate and ported to taxpr
by the recipe of docs/coming-from-brainstate.md, timed in one process.

The population (``n`` leaky integrate-and-fire neurons with random
recurrent weights, driven by a constant current per neuron) runs ``STEPS``
steps of ``brainstate.transform.for_loop`` under ``brainstate.transform.jit``;
the port keeps the same states with ``tx.get_state`` / ``tx.set_state`` in
a raw ``lax.scan``, through ``tx.uncurry``, under ``jax.jit``. Both give the
same spikes (checked). Figure: the warm-call time ratio taxpr / brainstate
(median over interleaved repetitions, each call blocked on its result).

Run: ``python bench/coming_from.py`` (needs brainstate: ``pip install
-e '.[peers]'``); writes ``bench/results_coming_from.json``, from which the
brainstate page's table (``docs/make_plots.py``'s ``coming_from_table``,
marker ``coming-from-brainstate-bench``) is made. Not a ``bench_*.py``
module: ``bench/run.py`` runs those in every configuration, and this one
needs brainstate.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import taxpr as tx

RESULTS = Path(__file__).resolve().parent / "results_coming_from.json"
SIZES, STEPS, REPEATS = (100, 2000), 1000, 15
TAU, V_TH, DT = 10.0, 1.0, 0.1


def _inputs(n):
    k1, k2 = jax.random.split(jax.random.key(0))
    weights = 0.02 * jax.random.normal(k1, (n, n))
    currents = jax.random.uniform(k2, (n,), minval=0.8, maxval=1.6)
    return weights, currents


def brainstate_simulation(weights, currents):
    """The brainstate program: a Module with a HiddenState and a
    ShortTermState, stepped by ``for_loop`` under ``transform.jit``."""
    import brainstate as bs

    n = currents.shape[0]

    class LIF(bs.nn.Module):
        def __init__(self):
            super().__init__()
            self.v = bs.HiddenState(jnp.zeros(n))
            self.spike = bs.ShortTermState(jnp.zeros(n))

        def update(self, i_ext):
            i_rec = weights @ self.spike.value
            v = self.v.value + DT * (-self.v.value + i_ext + i_rec) / TAU * 10.0
            spike = (v >= V_TH).astype(jnp.float32)
            self.v.value = jnp.where(spike > 0, 0.0, v)
            self.spike.value = spike
            return spike

    pop = LIF()

    @bs.transform.jit
    def simulate(scale):
        return bs.transform.for_loop(lambda s: pop.update(currents * s), scale)

    return simulate


class LIF:
    """The port: the same class, its states kept by taxpr under its scope."""

    def __init__(self, weights, name="lif"):
        self.weights, self.name = weights, name

    def update(self, i_ext):
        with tx.scope(self.name):
            n = self.weights.shape[0]
            v = tx.get_state("v", lambda: jnp.zeros(n))
            spike = tx.get_state("spike", lambda: jnp.zeros(n))
            v = v + DT * (-v + i_ext + self.weights @ spike) / TAU * 10.0
            spike = tx.set_state("spike", (v >= V_TH).astype(jnp.float32))
            tx.set_state("v", jnp.where(spike > 0, 0.0, v))
            return spike


def taxpr_simulation(weights, currents):
    pop = LIF(weights)

    def simulate(scale):
        return jax.lax.scan(lambda _, s: (None, pop.update(currents * s)), None, scale)[1]

    pure, state0 = tx.uncurry(simulate, jnp.ones(STEPS))
    run = jax.jit(pure)
    return lambda scale: run(state0, scale)[0]


def measure(n: int) -> dict:
    """One population size: both programs' warm-call times and their ratio."""
    weights, currents = _inputs(n)
    scale = jnp.ones(STEPS)
    programs = {"brainstate": brainstate_simulation(weights, currents),
                "taxpr": taxpr_simulation(weights, currents)}
    spikes = {k: np.asarray(jax.block_until_ready(f(scale))) for k, f in programs.items()}
    np.testing.assert_array_equal(spikes["brainstate"], spikes["taxpr"])
    times = {k: [] for k in programs}
    for _ in range(REPEATS):
        for k, f in programs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(scale))
            times[k].append(time.perf_counter() - t0)
    median = {k: statistics.median(v) for k, v in times.items()}
    return {"neurons": n, "steps": STEPS, "spikes": int(spikes["taxpr"].sum()),
            "brainstate_ms": 1e3 * median["brainstate"], "taxpr_ms": 1e3 * median["taxpr"],
            "ratio": median["taxpr"] / median["brainstate"]}


def run() -> dict:
    import brainstate
    return {
        "program": "LIF population with recurrent weights, for_loop under transform.jit "
                   "/ lax.scan through tx.uncurry under jax.jit",
        "rows": [measure(n) for n in SIZES], "repeats": REPEATS,
        "python": platform.python_version(), "jax": jax.__version__,
        "brainstate": brainstate.__version__, "backend": jax.default_backend(),
        "machine": f"{platform.machine()} {platform.system()}",
    }


if __name__ == "__main__":
    result = run()
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))

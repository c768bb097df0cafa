"""How taxpr's state pass scales with the number of states.

A program with ``n`` array states, each read and written once per call with
independent updates, made pure two ways in one process:

* ``tx.uncurry(f, x)`` (tracing with tags, the state pass, the initial
  values) and then ``jax.make_jaxpr`` of its pure function;
* ``jax.make_jaxpr`` of the same program with the states threaded through a
  dict by hand (what a user would write instead).

Each time is the best of ``REPEATS`` runs, measured alternately. Reported
per ``n``: both times, their ratio, and the growth of taxpr's time per
doubling of ``n`` (2.0 is linear).

Run: ``PYTHONPATH=. python bench/states_scaling.py [--docs]`` from the
checkout; ``bench/results_states.json`` holds the last run per JAX version,
and the performance page's table (``docs/make_plots.py``'s ``states_table``,
marker ``bench-states-table``) is made from it when the documentation is
built.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import taxpr as tx

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results_states.json"
SIZES = (250, 500, 1000, 2000, 4000)
REPEATS = 3


def stateful(n: int):
    def f(x):
        out = x
        for i in range(n):
            s = tx.get_state(f"s{i}", jnp.zeros(()))
            tx.set_state(f"s{i}", s + x * i)
            out = out + s
        return out
    return f


def by_hand(n: int):
    def f(states, x):
        out, new = x, {}
        for i in range(n):
            s = states[f"s{i}"]
            new[f"s{i}"] = s + x * i
            out = out + s
        return out, new
    return f


def _taxpr(n: int) -> float:
    t0 = time.perf_counter()
    pure, state0 = tx.uncurry(stateful(n), 1.0)
    jax.make_jaxpr(pure)(state0, 1.0)
    return time.perf_counter() - t0


def _hand(n: int) -> float:
    states = {f"s{i}": jnp.zeros(()) for i in range(n)}
    t0 = time.perf_counter()
    jax.make_jaxpr(by_hand(n))(states, 1.0)
    return time.perf_counter() - t0


def measure(sizes=SIZES, repeats: int = REPEATS) -> dict:
    rows = []
    for n in sizes:
        taxpr_s, hand_s = [], []
        for _ in range(repeats):
            taxpr_s.append(_taxpr(n))
            hand_s.append(_hand(n))
        rows.append({"n": n, "taxpr_s": min(taxpr_s), "hand_s": min(hand_s),
                     "ratio": min(taxpr_s) / min(hand_s)})
    for before, row in zip(rows, rows[1:]):
        row["growth"] = row["taxpr_s"] / before["taxpr_s"]
    return {"python": platform.python_version(), "jax": jax.__version__,
            "machine": f"{os.cpu_count()}-core {platform.machine()} "
                       f"{platform.system()} machine, {jax.default_backend().upper()} backend",
            "rows": rows}


def main() -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[jax.__version__] = measure()
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    for row in results[jax.__version__]["rows"]:
        print(row)


if __name__ == "__main__":
    main()

"""How taxpr's passes scale with the number of states, sows and sites.

Four programs with ``n`` effects each, made pure by taxpr and, in the same
process, written by hand as a user would instead (then ``jax.make_jaxpr``):

* ``uncurry``: ``n`` array states, each read and written once per call
  with independent updates; ``tx.uncurry(f, x)`` (tracing with tags, the
  state pass, the initial values) and ``jax.make_jaxpr`` of its pure
  function, against the states threaded through a dict by hand;
* ``make_jaxpr_with_states``: the same program, the pure program in one
  call, against the same hand-threaded program;
* ``reap``: ``n`` sows reaped (``h.reap``), against the program returning
  the ``n`` values in a dict;
* ``capture``: ``n`` sites of an unmodified program captured
  (``tx.capture``), against the program returning those values in a dict.

The example input is an array, as a user's batch is (a Python float would
be a static argument of the trace taxpr caches, and the traced call would
trace again). Each time is the best of ``REPEATS`` runs, measured
alternately. Reported per ``n`` and program: both times, their ratio, and
the growth of taxpr's time per doubling of ``n`` (2.0 is linear).

Run: ``PYTHONPATH=. python bench/states_scaling.py`` from the checkout;
``bench/results_states.json`` holds the last run per JAX version, and the
performance page's table (``docs/make_plots.py``'s ``states_table``, marker
``bench-states-table``) is made from it when the documentation is built.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp

import taxpr as tx
import taxpr.harvest as h

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


def sowing(n: int):
    def f(x):
        out = x
        for i in range(n):
            out = out + h.sow(x * i, tag="values", name=f"v{i}")
        return out
    return f


def plain(n: int):
    def f(x):
        out = x
        for i in range(n):
            out = out + x * i
        return out
    return f


def returning(n: int):
    """``plain`` / ``sowing`` with the ``n`` values returned by hand."""
    def f(x):
        out, values = x, {}
        for i in range(n):
            values[f"v{i}"] = v = x * i
            out = out + v
        return out, values
    return f


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _uncurry(n: int, x) -> float:
    def run():
        pure, state0 = tx.uncurry(stateful(n), x)
        jax.make_jaxpr(pure)(state0, x)
    return _timed(run)


def _hand_states(n: int, x) -> float:
    states = {f"s{i}": jnp.zeros(()) for i in range(n)}
    return _timed(lambda: jax.make_jaxpr(by_hand(n))(states, x))


# program -> (taxpr's time, the hand-written program's time), each a
# function of (n, example input)
PROGRAMS: dict[str, tuple[Callable, Callable]] = {
    "uncurry": (_uncurry, _hand_states),
    "make_jaxpr_with_states": (
        lambda n, x: _timed(lambda: tx.make_jaxpr_with_states(stateful(n))(x)), _hand_states),
    "reap": (lambda n, x: _timed(lambda: jax.make_jaxpr(h.reap(sowing(n), tag="values"))(x)),
             lambda n, x: _timed(lambda: jax.make_jaxpr(returning(n))(x))),
    "capture": (lambda n, x: _timed(lambda: jax.make_jaxpr(tx.capture(plain(n), "mul*"))(x)),
                lambda n, x: _timed(lambda: jax.make_jaxpr(returning(n))(x))),
}


def measure(sizes=SIZES, repeats: int = REPEATS) -> dict:
    x = jnp.ones(())
    programs = {}
    for name, (taxpr_time, hand_time) in PROGRAMS.items():
        taxpr_time(50, x), hand_time(50, x)  # warm JAX's caches
        rows = []
        for n in sizes:
            taxpr_s, hand_s = [], []
            for _ in range(repeats):
                taxpr_s.append(taxpr_time(n, x))
                hand_s.append(hand_time(n, x))
            rows.append({"n": n, "taxpr_s": min(taxpr_s), "hand_s": min(hand_s),
                         "ratio": min(taxpr_s) / min(hand_s)})
        for before, row in zip(rows, rows[1:]):
            row["growth"] = row["taxpr_s"] / before["taxpr_s"]
        programs[name] = rows
    return {"python": platform.python_version(), "jax": jax.__version__,
            "machine": f"{os.cpu_count()}-core {platform.machine()} "
                       f"{platform.system()} machine, {jax.default_backend().upper()} backend",
            "programs": programs}


def main() -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[jax.__version__] = measure()
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    for name, rows in results[jax.__version__]["programs"].items():
        for row in rows:
            print(name, {k: round(v, 3) for k, v in row.items()})


if __name__ == "__main__":
    main()

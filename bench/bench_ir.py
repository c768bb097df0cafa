"""Cost of the taxpr.ir toolchain against ``jax.make_jaxpr``.

The program is a chain of blocks, each with constant work, an identity, a
repeated computation, an ``x + 0.0`` that must stay and dead code (8
equations a block), so every pass has work at every size. Times are thread
CPU time, best of several runs, all in one process:

* ``optimize_jaxpr`` (default passes, 3 iterations) / ``jax.make_jaxpr`` of
  the same program at 10,000 equations (target <= 0.3);
* ``optimize_jaxpr`` time per doubling of the program, 10,000 -> 20,000 ->
  40,000 equations (the worse of the two; target <= 2.2);
* ``to_dot`` / ``jax.make_jaxpr`` at 10,000 equations (target <= 1).

Quick: 1,000 and 2,000 equations, fewer runs.

Run: ``PYTHONPATH=. python bench/bench_ir.py [--quick]`` (from the checkout, so
that its taxpr is imported); ``bench/results_ir.json`` holds its last full run per JAX version.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from taxpr import ir

from _common import timed  # noqa: E402

OPTIMIZE_TARGET = 0.3
DOUBLING_TARGET = 2.2
DOT_TARGET = 1.0
EQNS_PER_BLOCK = 8


def program(n_eqns: int):
    """A fresh function of ``(x, y)`` with about ``n_eqns`` equations."""
    def f(x, y):
        for _ in range(n_eqns // EQNS_PER_BLOCK):
            k = jnp.float32(2.0) * 3.0          # constant
            a = x * 1.0                          # identity
            b = jnp.sin(a) + jnp.sin(a)          # repeated
            _ = jnp.cos(b)                       # dead
            x = (b + 0.0) * k + y                # + 0.0 stays (-0.0)
        return x
    return f


def _best(fn, *args, runs: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(runs):
        t, out = timed(fn, *args, clock=time.thread_time)
        best = min(best, t)
    return best, out


def measure(n_eqns: int, runs: int) -> dict:
    args = (jnp.float32(0.5), jnp.float32(0.25))
    t_make, j = _best(lambda: jax.make_jaxpr(program(n_eqns))(*args), runs=runs)
    t_opt, o = _best(ir.optimize_jaxpr, j, runs=runs)
    t_dot, _ = _best(ir.to_dot, j, runs=runs)
    return {"eqns": len(j.eqns), "optimized_eqns": len(o.eqns), "make_jaxpr_s": t_make,
            "optimize_s": t_opt, "to_dot_s": t_dot,
            "optimize_ratio": t_opt / t_make, "to_dot_ratio": t_dot / t_make}


def run(quick: bool = False) -> dict:
    sizes = (1000, 2000) if quick else (10_000, 20_000, 40_000)
    runs = 1 if quick else 3
    cases = {str(n): measure(n, runs) for n in sizes}
    base = cases[str(sizes[0])]
    doublings = [cases[str(b)]["optimize_s"] / cases[str(a)]["optimize_s"]
                 for a, b in zip(sizes, sizes[1:])]
    worst = max(doublings)
    figures = [
        {"name": f"optimize_jaxpr/make_jaxpr at {sizes[0]} eqns",
         "value": float(base["optimize_ratio"]), "target": f"<= {OPTIMIZE_TARGET}",
         "pass": bool(base["optimize_ratio"] <= OPTIMIZE_TARGET)},
        {"name": "optimize_jaxpr time per doubling (worst)", "value": float(worst),
         "target": f"<= {DOUBLING_TARGET}", "pass": bool(worst <= DOUBLING_TARGET)},
        {"name": f"to_dot/make_jaxpr at {sizes[0]} eqns", "value": float(base["to_dot_ratio"]),
         "target": f"<= {DOT_TARGET}", "pass": bool(base["to_dot_ratio"] <= DOT_TARGET)},
    ]
    return {"jax": jax.__version__, "cases": cases, "doublings": doublings,
            "figures": figures}


if __name__ == "__main__":
    import json
    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))

"""Cost of ``tx.inject``.

Two figures, each measured as a ratio within one process:

* ``straight``: a straight-line program with N tags (1,600 and 10,000),
  ``x = x * 1.0001 + tag(x, op=...)`` with three distinct ``op`` params, so
  the injector is traced three times. Ratio of the ``tx.inject`` time to the
  ``jax.make_jaxpr`` time of the same function. Target: <= 0.25
  (taxpr 0.0.3: about 2.8).
* ``nested_scan``: ``lax.scan`` nested 1..8 deep with 10 tags at each level;
  ``tx.inject`` time at each depth (the jaxpr is made once per depth and not
  timed). Target: t(8)/t(4) <= 2.5, i.e. cost grows at most linearly
  with depth (a tracer that re-traces each loop body twice grows as 2**depth).

Timing: medians over repetitions, the two timed operations interleaved, with
the garbage collector run before and disabled during each timed call (as
``timeit`` does). ``jax.make_jaxpr`` caches its trace per function object, so
each repetition traces a freshly built function; ``tx.inject`` builds a fresh
engine (and re-traces the injector) on every call, so re-injecting the same
jaxpr measures the full cost.

Run: ``python bench/bench_inject.py [--quick]``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

import taxpr as tx

from _common import CTX, OPS, injector, nested_scans, timed  # noqa: E402

STRAIGHT_TARGET = 0.25
DEPTH_TARGET = 2.5







def straight_fn(n: int):
    """A fresh function (so make_jaxpr's cache never hits) with ``n`` tags."""
    def f(x):
        for i in range(n):
            x = x * 1.0001 + tx.tag(x, op=OPS[i % len(OPS)])
        return x
    return f


def bench_straight(n: int, reps: int) -> dict:
    x = jnp.ones((3,), jnp.float32)
    closed = jax.make_jaxpr(straight_fn(n))(x)  # warm-up of both paths
    tx.inject(closed, injector, CTX)
    t_make, t_inject = [], []
    for r in range(reps):
        f = straight_fn(n)
        steps = [("make", lambda: jax.make_jaxpr(f)(x)),
                 ("inject", lambda: tx.inject(closed, injector, CTX))]
        if r % 2:
            steps.reverse()
        for name, step in steps:
            dt, out = timed(step)
            if name == "make":
                t_make.append(dt)
                closed = out  # inject the jaxpr of this repetition's function
            else:
                t_inject.append(dt)
    make_s, inject_s = statistics.median(t_make), statistics.median(t_inject)
    return {"tags": n, "make_jaxpr_s": make_s, "inject_s": inject_s,
            "ratio": inject_s / make_s}


TAGS_PER_LEVEL = 10


def nested_scan_fn(depth: int, length: int, per_level: int = TAGS_PER_LEVEL):
    """``depth`` nested scans of ``length`` steps with ``per_level`` tags at
    every level (outside the outermost scan and inside each body). Several
    tags per level make the walk, not the three injector traces, dominate."""
    def step(d, x):
        for i in range(per_level):
            x = x * 1.0001 + tx.tag(x, op=OPS[(d + i) % len(OPS)])
        return x

    return nested_scans(depth, length, step)


def bench_nested(max_depth: int, length: int, reps: int) -> dict:
    x = jnp.ones((3,), jnp.float32)
    jaxprs = {d: jax.make_jaxpr(nested_scan_fn(d, length))(x)
              for d in range(1, max_depth + 1)}
    for closed in jaxprs.values():  # warm-up
        tx.inject(closed, injector, CTX)
    times: dict[int, list[float]] = {d: [] for d in jaxprs}
    for r in range(reps):
        order = list(jaxprs) if r % 2 == 0 else list(reversed(jaxprs))
        for d in order:
            dt, _ = timed(tx.inject, jaxprs[d], injector, CTX)
            times[d].append(dt)
    med = {d: statistics.median(ts) for d, ts in times.items()}
    out = {"length": length, "tags_per_level": TAGS_PER_LEVEL, "inject_s": {str(d): med[d] for d in med}}
    top, half = max_depth, max_depth // 2
    out["ratio_key"] = f"t{top}/t{half}"
    out["ratio"] = med[top] / med[half]
    return out


def run(quick: bool = False) -> dict:
    """Measure inject costs.

    Returns a dict with ``jax``, ``straight`` (a list of per-size results) and
    ``nested_scan``, plus ``figures``: a list of
    ``{name, value, target, pass}`` rows for ``bench/run.py``'s table.
    """
    if quick:
        sizes, reps, max_depth, nreps = (50,), 1, 4, 1
    else:
        sizes, reps, max_depth, nreps = (1600, 10_000), 7, 8, 11
    out: dict = {"jax": jax.__version__}
    out["straight"] = [bench_straight(n, reps if n < 5000 else max(3, reps - 2))
                       for n in sizes]
    out["nested_scan"] = bench_nested(max_depth, 2, nreps)
    figures = []
    for s in out["straight"]:
        figures.append({"name": f"inject/make_jaxpr, {s['tags']} tags",
                        "value": s["ratio"], "target": f"<= {STRAIGHT_TARGET}",
                        "pass": s["ratio"] <= STRAIGHT_TARGET})
    ns = out["nested_scan"]
    figures.append({"name": f"inject nested scan {ns['ratio_key']}",
                    "value": ns["ratio"], "target": f"<= {DEPTH_TARGET}",
                    "pass": ns["ratio"] <= DEPTH_TARGET})
    out["figures"] = figures
    return out


def main(argv: list[str]) -> None:
    res = run(quick="--quick" in argv)
    print(f"jax {res['jax']}")
    for s in res["straight"]:
        print(f"  straight {s['tags']:6d} tags: make_jaxpr {s['make_jaxpr_s'] * 1e3:8.1f} ms"
              f"   inject {s['inject_s'] * 1e3:8.1f} ms   ratio {s['ratio']:.3f}")
    ns = res["nested_scan"]
    print("  nested scan inject (ms): "
          + "  ".join(f"d{d}={t * 1e3:.2f}" for d, t in ns["inject_s"].items()))
    print(f"  {ns['ratio_key']} = {ns['ratio']:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Peak memory of ``tx.inject`` on a large jaxpr.

Workload: a straight-line program of about 100,000 equations (quick: about
2,000), ``y = tag(x * 1.0001, op=...); x = x + y * 0.5 - 0.25`` repeated:
five equations per step, one of them a tag, with three distinct ``op``
params (``scale`` / ``acc`` / ``id``, as in ``bench_inject``). The actual
equation and tag counts are reported.

Figure: the peak Python memory allocated during ``tx.inject`` of the jaxpr,
divided by the peak during the ``jax.make_jaxpr`` call that produced it.
Target: <= 2.0.

Measurement: ``tracemalloc``, in one process. For each call the garbage
collector is run first, then the peak is reset (``tracemalloc.reset_peak``)
and the figure for the call is ``peak - current`` (memory allocated during
the call over what was live before it: the input jaxpr of ``inject`` is
not counted, its output is). Also reported (no target): the memory each
call leaves allocated (its result and any caches it filled), and the wall
time of each call (slowed by ``tracemalloc``; ``bench_inject`` measures
time properly). ``make_jaxpr`` traces a freshly built function each
repetition (no cache hit); both paths are warmed up on a small program
first, so one-off caches are not charged to either. Memory is nearly
deterministic, so a couple of repetitions suffice; the figure is the
median of the per-repetition ratios. ``tracemalloc`` is stopped at the end
(unless it was already tracing), so it does not slow later benchmarks.

Run: ``python bench/bench_memory.py [--quick]``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import tracemalloc

import jax
import jax.numpy as jnp

import taxpr as tx

from _common import CTX, OPS, injector, print_figures  # noqa: E402

EQNS_PER_STEP = 5
MEMORY_TARGET = 2.0




def straight_fn(steps: int):
    """A fresh function (so make_jaxpr's cache never hits): ``steps`` steps of
    five equations, one a tag."""
    def f(x):
        for i in range(steps):
            y = tx.tag(x * 1.0001, op=OPS[i % len(OPS)])
            x = x + y * 0.5 - 0.25
        return x
    return f


def _measured(fn):
    """``(out, peak_bytes, retained_bytes, seconds)`` of one call of ``fn()``:
    bytes allocated at the peak and left allocated after, over what was live
    before (``tracemalloc`` must be tracing)."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    current, peak = tracemalloc.get_traced_memory()
    return out, peak - before, current - before, seconds


def _count_eqns(closed) -> tuple[int, int]:
    eqns = closed.jaxpr.eqns
    return len(eqns), sum(1 for e in eqns if e.primitive is tx.tag_p)


def bench_memory(steps: int, reps: int) -> dict:
    x = jnp.ones((3,), jnp.float32)
    small = jax.make_jaxpr(straight_fn(50))(x)  # warm-up of both paths
    tx.inject(small, injector, CTX)
    del small
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        rows = []
        for _ in range(reps):
            f = straight_fn(steps)
            closed, m_peak, m_kept, m_s = _measured(lambda: jax.make_jaxpr(f)(x))
            new, i_peak, i_kept, i_s = _measured(lambda: tx.inject(closed, injector, CTX))
            eqns, tags = _count_eqns(closed)
            rows.append({"make_jaxpr_peak_bytes": m_peak, "make_jaxpr_retained_bytes": m_kept,
                         "make_jaxpr_s": m_s, "inject_peak_bytes": i_peak,
                         "inject_retained_bytes": i_kept, "inject_s": i_s,
                         "ratio": i_peak / m_peak, "retained_ratio": i_kept / m_kept})
            del f, closed, new
    finally:
        if started:
            tracemalloc.stop()
        gc.collect()
    out = {"steps": steps, "eqns": eqns, "tags": tags, "reps": reps, "runs": rows}
    for key in ("make_jaxpr_peak_bytes", "inject_peak_bytes", "make_jaxpr_retained_bytes",
                "inject_retained_bytes"):
        out[key] = statistics.median(r[key] for r in rows)
    out["ratio"] = statistics.median(r["ratio"] for r in rows)
    out["retained_ratio"] = statistics.median(r["retained_ratio"] for r in rows)
    return out


def run(quick: bool = False) -> dict:
    """Measure inject's peak memory against make_jaxpr's.

    Returns ``{"jax", "straight", "figures"}``; ``figures`` are
    ``{name, value, target, pass}`` rows for ``bench/run.py``'s table.
    """
    steps, reps = (400, 1) if quick else (20_000, 2)
    out: dict = {"jax": jax.__version__}
    s = out["straight"] = bench_memory(steps, reps)
    out["figures"] = [
        {"name": f"inject/make_jaxpr peak memory, {s['eqns']} eqns ({s['tags']} tags)",
         "value": s["ratio"], "target": f"<= {MEMORY_TARGET}",
         "pass": s["ratio"] <= MEMORY_TARGET},
        {"name": f"inject/make_jaxpr retained memory, {s['eqns']} eqns",
         "value": s["retained_ratio"], "target": None, "pass": None},
    ]
    return out


def main(argv: list[str]) -> None:
    res = run(quick="--quick" in argv)
    s = res["straight"]
    mb = 1 / 2 ** 20
    print(f"jax {res['jax']}: {s['eqns']} equations, {s['tags']} tags")
    for i, r in enumerate(s["runs"]):
        print(f"  rep {i}: make_jaxpr peak {r['make_jaxpr_peak_bytes'] * mb:8.1f} MiB"
              f" (retained {r['make_jaxpr_retained_bytes'] * mb:6.1f}, {r['make_jaxpr_s']:.1f} s)"
              f"   inject peak {r['inject_peak_bytes'] * mb:8.1f} MiB"
              f" (retained {r['inject_retained_bytes'] * mb:6.1f}, {r['inject_s']:.1f} s)"
              f"   ratio {r['ratio']:.3f}")
    print_figures(res["figures"])


if __name__ == "__main__":
    main(sys.argv[1:])

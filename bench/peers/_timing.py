"""Shared by the peer timings: interleaved, GC-controlled medians.

Every figure is a ratio of two medians measured in the same process, so it
holds on a noisy shared machine. Each repetition runs every timed step once,
in a rotated order (so no step always runs first or right after another),
with the garbage collector run before and disabled during each step (as
``timeit`` does).

The clock is the calling thread's CPU time (``time.thread_time``), not wall
time: tracing and jaxpr rewriting are single-threaded Python, and on a
loaded machine a wall-clock sample of a few milliseconds is often inflated
by a whole scheduler time slice (about 4 ms here, at load average 3-6 on 2
cores), which made wall-clock medians of short steps bimodal.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable


def timed(fn: Callable, *args):
    """``(CPU seconds of this thread, result)`` of one call of ``fn(*args)``,
    GC collected first and disabled during the call."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.thread_time()
        out = fn(*args)
        return time.thread_time() - t0, out
    finally:
        if was_enabled:
            gc.enable()


def interleaved(steps: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds of each zero-argument step over ``reps`` repetitions.

    Each step must build whatever it traces afresh (``jax.make_jaxpr`` caches
    its trace per function object)."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        order = names[k:] + names[:k]
        if (r // len(names)) % 2:
            order.reverse()
        for n in order:
            dt, _ = timed(steps[n])
            times[n].append(dt)
    return {n: statistics.median(ts) for n, ts in times.items()}


def count_eqns(jaxpr) -> int:
    """Equations of a (closed) jaxpr, nested jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    n = 0
    for eqn in jaxpr.eqns:
        n += 1
        for p in eqn.params.values():
            for q in (p if isinstance(p, (tuple, list)) else (p,)):
                if hasattr(q, "eqns") or hasattr(getattr(q, "jaxpr", None), "eqns"):
                    n += count_eqns(q)
    return n

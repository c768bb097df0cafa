"""Helpers shared by the benchmarks (not a benchmark: run.py only collects
``bench_*.py``)."""

from __future__ import annotations

import gc
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

OPS = ("scale", "acc", "id")
CTX = {"acc": jax.ShapeDtypeStruct((), jnp.float32)}


def injector(ctx, token, params):
    """``scale`` doubles the token, ``acc`` adds it into ctx, ``id`` passes."""
    op = params["op"]
    if op == "scale":
        return token * 2.0, ctx
    if op == "acc":
        return token, {"acc": ctx["acc"] + jnp.sum(token)}
    return token, ctx


def timed(fn: Callable, *args: Any, clock: Callable[[], float] = time.perf_counter):
    """``(seconds, result)`` of one call of ``fn(*args)``, GC collected first
    and disabled during the call."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = clock()
        out = fn(*args)
        return clock() - t0, out
    finally:
        if was_enabled:
            gc.enable()


def nested_scans(depth: int, length: int, step: Callable[[int, Any], Any]) -> Callable:
    """A fresh function of ``x``: ``step(d, x)`` at level ``d`` (0 = outside
    every scan), then (above ``depth``) a scan of ``length`` steps whose body
    is level ``d + 1``."""
    def level(d, x):
        x = step(d, x)
        if d == depth:
            return x
        return jax.lax.scan(lambda c, _: (level(d + 1, c), None), x, None, length=length)[0]

    return lambda x: level(0, x)


def ratio_figure(name: str, ratio: float, target: float | None) -> dict:
    """A figure of a run-time ratio, with its upper bound (or none)."""
    return {"name": name, "value": ratio,
            "target": None if target is None else f"<= {target}",
            "pass": None if target is None else ratio <= target}


def print_figures(figures: list[dict]) -> None:
    """Print a module's figures, one per line, marked by whether each meets
    its target."""
    for f in figures:
        mark = "    " if f["pass"] is None else ("ok  " if f["pass"] else "MISS")
        print(f"  {mark} {f['name']}: {f['value']:.3f} ({f['target'] or 'no target'})")

"""Shared by the probes: the five programs and how a result is classified.

Each program adds ``x = 1.0`` to a scalar state ``total`` (initially 0)
through ``add``, the library's own read-then-write of the state, inside raw
JAX control flow. The state's final value should be the number of adds.
"""

from __future__ import annotations

import json
import sys

import jax
from jax import lax

CASES = {
    # case: (program(add, x), expected final total)
    "lax.scan": (lambda add, x: lax.scan(lambda c, _: (c, add(x)), 0.0, None, length=4), 4.0),
    "lax.while_loop": (lambda add, x: lax.while_loop(
        lambda i: i < 3, lambda i: (add(x), i + 1)[1], 0), 3.0),
    "lax.cond": (lambda add, x: lax.cond(x > 0, lambda: add(x), lambda: x * 0.0), 1.0),
    "jax.jit": (lambda add, x: jax.jit(add)(x), 1.0),
    "jax.checkpoint": (lambda add, x: jax.checkpoint(add)(x), 1.0),
}


def classify(run, expected: float) -> str:
    """``run()`` returns the final value of the state."""
    try:
        value = run()
    except Exception as e:  # noqa: BLE001 - record whatever the library raises
        first = (str(e).strip().splitlines() or [""])[0][:110]
        return f"error: {type(e).__name__}: {first}"
    leaves = jax.tree_util.tree_leaves(value)
    if any(isinstance(v, jax.core.Tracer) for v in leaves):
        return f"leaked tracer ({type(leaves[0]).__name__} returned as the new state, no error)"
    try:
        got = float(leaves[0])
    except Exception as e:  # noqa: BLE001
        return f"error on use of the result: {type(e).__name__}"
    if got == expected:
        return "correct"
    return f"wrong result silently ({got:g} instead of {expected:g})"


def leaks(state) -> bool:
    """Whether a returned state holds a tracer."""
    return any(isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(state))


def report(library: str, version: str, results: dict, notes: dict | None = None) -> None:
    print(f"{library} {version} (jax {jax.__version__}, python {sys.version.split()[0]})")
    for case, r in results.items():
        note = (notes or {}).get(case)
        print(f"  {case:15s} {r}" + (f"  [{note}]" if note else ""))
    print("JSON " + json.dumps({"library": library, "version": version, "jax": jax.__version__,
                               "results": results, "notes": notes or {}}))

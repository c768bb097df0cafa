"""Helpers shared by the taxpr.ir tests."""

from __future__ import annotations

import jax
import numpy as np
from jax._src import core

from taxpr import _compat, _jaxpr, _traverse


def counts(j) -> tuple[int, int]:
    """``(top-level equations, nested equations)`` of ``j``."""
    top = len(_jaxpr.jaxpr_parts(j).eqns)
    total = sum(1 for _ in _traverse.iter_eqns(j))
    return top, total - top


def total(j) -> int:
    return sum(counts(j))


def run(j, *args, jit: bool = True):
    """Evaluate a Jaxpr / ClosedJaxpr (jitted by default)."""
    if _jaxpr.is_closed(j) or _compat.MERGED_JAXPR:
        jaxpr, consts = _jaxpr.open_with_constvars(j)
    else:
        jaxpr, consts = j, []

    def f(*a):
        return core.eval_jaxpr(jaxpr, consts, *a)

    out = (jax.jit(f) if jit else f)(*args)
    return [np.asarray(o) for o in out]


def assert_bitwise(got, want, what: str = "") -> None:
    """Equal bit for bit, except that any NaN equals any NaN."""
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (what, i, g.dtype, w.dtype, g.shape)
        if g.dtype.kind == "f" or g.dtype.kind == "V" or g.dtype.kind == "c":
            gf, wf = g.astype(np.float64) if g.dtype.kind == "V" else g, \
                w.astype(np.float64) if w.dtype.kind == "V" else w
            gn, wn = np.isnan(gf), np.isnan(wf)
            assert np.array_equal(gn, wn), (what, i, g, w)
            gb = np.where(gn, 0, g.view(f"u{g.dtype.itemsize}") if g.dtype.kind != "c" else 0)
            wb = np.where(wn, 0, w.view(f"u{w.dtype.itemsize}") if w.dtype.kind != "c" else 0)
            assert np.array_equal(gb, wb), (what, i, g, w)
        else:
            assert np.array_equal(g, w), (what, i, g, w)


def check(j) -> None:
    _jaxpr.check_jaxpr(j)

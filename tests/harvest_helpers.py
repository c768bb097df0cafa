"""What the harvest tests (tests/harvest/) share: the tag ``T``, comparisons
(``allclose``, ``assert_tree_allclose``), ``raises`` (an error, then JAX still
works: ``jax_still_works``), ``all_prims`` and the small programs several test
files run (``_basic``, ``_twice``, ``_switch``, ``_scan_fn``, ``_while``, ...).

Every result is compared with a value computed by hand or by plain Python /
NumPy. Error tests also check that JAX still works afterwards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taxpr import harvest as h
from taxpr import _traverse


T = "t"
allclose = np.testing.assert_allclose


def jax_still_works() -> None:
    """JAX's trace state is intact: jit and grad of fresh functions work."""
    assert float(jax.jit(lambda x: x * 2)(1.0)) == 2.0
    assert float(jax.grad(lambda x: x ** 3 + jnp.sin(x))(2.0)) == pytest.approx(12 + np.cos(2.0))
    assert float(jax.vmap(lambda x: x + 1)(jnp.ones(3)).sum()) == 6.0


def raises(exc, match, fn, *args):
    with pytest.raises(exc, match=match):
        fn(*args)
    jax_still_works()


def all_prims(closed) -> list[str]:
    return [e.primitive.name for e, _ in _traverse.iter_eqns(closed)]


def assert_tree_allclose(got, want):
    gl, gt = jax.tree_util.tree_flatten(got)
    wl, wt = jax.tree_util.tree_flatten(want)
    assert gt == wt, (gt, wt)
    for g, w in zip(gl, wl):
        allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def _basic(x):
    a = h.sow(x * 2, tag=T, name="a")
    b = h.sow(a + 1, tag=T, name="b")
    return a * b


def _layer(x):
    return h.sow(x * 2, tag=T, name="h") + 1


def _twice(mode):
    def f(x):
        return h.sow(x, tag=T, name="x", mode=mode) + h.sow(x * 2, tag=T, name="x", mode=mode)
    return f


def _scan_fn(x, xs, reverse=False):
    def body(c, xi):
        y = h.sow(xi * c, tag=T, name="y", mode="append")
        c = h.sow(c + 1, tag=T, name="c", mode="clobber")
        return c, y
    return jax.lax.scan(body, x, xs, reverse=reverse)


def _scan_eager(x, xs, reverse=False):
    c, ys = x, [None] * len(xs)
    order = range(len(xs) - 1, -1, -1) if reverse else range(len(xs))
    for i in order:
        ys[i] = xs[i] * c
        c = c + 1
    return c, np.array(ys)


def _while(x, n, mode="clobber"):
    def body(c):
        i, v = c
        return i + 1, h.sow(v * 2, tag=T, name="v", mode=mode)
    return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]


def _switch(mk):
    def f(p, x):
        return jax.lax.switch(p, [functools.partial(mk, i) for i in range(3)], x)
    return f

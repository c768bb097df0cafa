"""taxpr.harvest._sow: ``sow`` / ``sow_cond`` without a harvest, and each mode's reap and plant."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from taxpr import harvest as h

from harvest_helpers import T, allclose, assert_tree_allclose, raises, _twice


# ---- sow and sow_cond without a harvest -----------------------------------------------

def test_sow_is_identity_without_harvest():
    def f(x):
        return h.sow(x * 2, tag=T, name="a", key=x) + h.sow_cond(x, x > 0, tag=T, name="c")

    allclose(f(3.0), 9.0)
    allclose(jax.jit(f)(3.0), 9.0)
    allclose(jax.grad(f)(3.0), 3.0)
    allclose(jax.vmap(f)(jnp.arange(3.0)), 3 * np.arange(3.0))


def test_invalid_mode():
    raises(ValueError, "mode", lambda: h.sow(1.0, tag=T, name="a", mode="bogus"))


# ---- modes -------------------------------------------------------------------------

def test_clobber_last_wins():
    out, reaps = h.call_and_reap(_twice("clobber"), tag=T)(1.0)
    allclose(out, 3.0)
    assert_tree_allclose(reaps, {"x": 2.0})


def test_clobber_plant_replaces_every_sow():
    allclose(h.plant(_twice("clobber"), tag=T)({"x": 5.0}, 1.0), 10.0)


def test_append_outside_loops_stacks():
    x = jnp.array([1.0, 2.0])
    assert_tree_allclose(h.reap(_twice("append"), tag=T)(x), {"x": np.array([[1, 2], [2, 4.0]])})
    one = h.reap(lambda x: h.sow(x, tag=T, name="x", mode="append"), tag=T)(x)
    assert_tree_allclose(one, {"x": np.array([[1.0, 2.0]])})


def test_append_outside_loops_plant():
    x = jnp.array([1.0, 2.0])
    out = h.plant(_twice("append"), tag=T)({"x": jnp.array([[10.0, 20.0], [30.0, 40.0]])}, x)
    allclose(out, [40.0, 60.0])


def test_cond_clobber_keeps_last_true():
    def f(x):
        h.sow_cond(x, True, tag=T, name="c")
        h.sow_cond(x * 2, x > 5, tag=T, name="c")
        h.sow_cond(x * 3, x > 0, tag=T, name="c")
        return h.sow_cond(x * 4, False, tag=T, name="c")

    for x, want in [(1.0, 3.0), (10.0, 30.0), (-1.0, -1.0)]:
        out, reaps = h.call_and_reap(f, tag=T)(x)
        allclose(out, 4 * x)
        assert_tree_allclose(reaps, {"c": want})


def test_cond_clobber_zeros_if_never_true():
    def f(x):
        return h.sow_cond(x + 1, x > 100, tag=T, name="c")

    assert_tree_allclose(h.reap(f, tag=T)(jnp.ones(3)), {"c": np.zeros(3)})
    assert_tree_allclose(jax.jit(h.reap(f, tag=T))(jnp.full(3, 200.0)), {"c": np.full(3, 201.0)})


def test_clobber_and_cond_clobber_mix():
    def f(x):
        h.sow(x, tag=T, name="m", mode="clobber")
        h.sow_cond(x * 2, x > 5, tag=T, name="m")
        return x

    assert_tree_allclose(h.reap(f, tag=T)(1.0), {"m": 1.0})
    assert_tree_allclose(h.reap(f, tag=T)(10.0), {"m": 20.0})


def test_cond_clobber_plant():
    def f(x):
        return h.sow_cond(x + 1, x > 0, tag=T, name="c") * 2

    allclose(h.plant(f, tag=T)({"c": 7.0}, 1.0), 14.0)
    allclose(h.plant(f, tag=T)({"c": 7.0}, -1.0), 14.0)

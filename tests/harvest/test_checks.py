"""taxpr.harvest._checks: oryx's static checks (strict once, loop modes, cond branches)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from taxpr import harvest as h

from harvest_helpers import (T, allclose, assert_tree_allclose, raises, _layer, _switch, _twice,
                             _while)


# ---- strict sows once per scope; one type per name ------------------------------------

def test_strict_second_sow_raises_on_reap():
    raises(ValueError, "^Variable has already been reaped: x$", h.reap(_twice("strict"), tag=T),
           1.0)
    raises(ValueError, "^Variable has already been reaped: x$",
           h.harvest(_twice("strict"), tag=T), {}, 1.0)


def test_strict_second_sow_raises_on_plant():
    raises(ValueError, "^Variable has already been planted: x$",
           h.plant(_twice("strict"), tag=T), {"x": 1.0}, 1.0)
    raises(ValueError, "^Variable has already been planted: x$",
           h.harvest(_twice("strict"), tag=T), {"x": 1.0}, 1.0)


def test_plant_ignores_strictness_of_unplanted_names():
    allclose(h.plant(_twice("strict"), tag=T)({}, 1.0), 3.0)
    allclose(h.plant(_twice("strict"), tag=T)({"other": 1.0}, 1.0), 3.0)


def test_strict_sows_in_different_scopes_are_fine():
    def f(x):
        return h.nest(_layer, scope="a")(x) + h.nest(_layer, scope="b")(x)

    assert_tree_allclose(h.reap(f, tag=T)(1.0), {"a": {"h": 2.0}, "b": {"h": 2.0}})


def test_strict_twice_in_jit_and_cond_branches():
    g = jax.jit(lambda x: h.sow(x, tag=T, name="x"))
    raises(ValueError, "^Variable has already been reaped: x$",
           h.reap(lambda x: g(x) + g(x), tag=T), 1.0)
    # one sow per branch is one sow
    def f(p, x):
        return jax.lax.cond(p, lambda x: h.sow(x, tag=T, name="x"),
                            lambda x: h.sow(-x, tag=T, name="x"), x)
    assert_tree_allclose(h.reap(f, tag=T)(False, 2.0), {"x": -2.0})


@pytest.mark.parametrize("mode", ["append", "clobber"])
def test_sows_of_one_name_with_different_shapes_are_a_clear_error(mode):
    # One stack needs one row shape (append: it was concatenate's bare
    # TypeError); one carried reap has one type (clobber: in a loop it was an
    # invalid program). A sow that is not reaped or planted is not checked.
    def f(x):
        h.sow(x, tag="t", name="a", mode=mode)
        h.sow(jnp.stack([x, x]), tag="t", name="a", mode=mode)
        return x

    with pytest.raises(ValueError, match=r"^Mismatched shape between sows: 'a'\.$"):
        h.reap(f, tag="t")(1.0)
    assert h.reap(f, tag="t", blocklist=["a"])(1.0) == {}


def test_clobber_sows_of_one_name_with_different_dtypes_are_a_clear_error():
    def f(x):
        h.sow(x, tag="t", name="a", mode="clobber")
        h.sow(x.astype(jnp.bfloat16), tag="t", name="a", mode="clobber")
        return x

    with pytest.raises(ValueError, match=r"^Mismatched dtype between sows: 'a'\.$"):
        h.reap(f, tag="t")(jnp.float32(1.0))


# ---- scan --------------------------------------------------------------------------

def test_scan_strict_raises():
    def f(x):
        return jax.lax.scan(lambda c, _: (h.sow(c, tag=T, name="x"), None), x, None, length=3)[0]

    raises(ValueError, "^Cannot use strict mode for 'x' inside `scan`.$", h.reap(f, tag=T), 1.0)
    raises(ValueError, "^Cannot use strict mode for 'x' inside `scan`.$", h.plant(f, tag=T),
           {"x": 1.0}, 1.0)
    # an unselected strict sow in a scan is fine
    assert h.reap(f, tag="other")(1.0) == {}


# ---- while_loop ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["strict", "append"])
def test_while_requires_clobber(mode):
    f = functools.partial(_while, mode=mode)
    msg = "^Must use clobber or cond_clobber mode for 'v' inside of a `while_loop`.$"
    raises(ValueError, msg, h.reap(f, tag=T), 1.0, 3)
    raises(ValueError, msg, h.plant(f, tag=T), {"v": 1.0}, 1.0, 3)


# ---- cond / switch -------------------------------------------------------------------

def test_cond_missing_sow_names_the_later_branchs_sow_as_oryx():
    # oryx compares each later branch with the first and names the later
    # branch's sow that the first lacks: here branch 1's "b".
    f = _switch(lambda i, x: h.sow(x, tag=T, name="a" if i != 1 else "b"))
    raises(ValueError, "^Missing sow in branch: 'b'.$", h.reap(f, tag=T), 0, 2.0)
    raises(ValueError, "^Missing sow in branch: 'b'.$", h.plant(f, tag=T), {}, 0, 2.0)


def test_cond_missing_sow_names_the_true_branchs_sow_as_oryx():
    # lax.cond's branches are (false, true): the true branch is the later one.
    def f(pred, x):
        return jax.lax.cond(pred, lambda x: h.sow(x, tag=T, name="x") + 1.0,
                            lambda x: h.sow(x, tag=T, name="y") + 2.0, x)
    raises(ValueError, "^Missing sow in branch: 'x'.$", h.reap(f, tag=T), True, 1.0)
    raises(ValueError, "^Missing sow in branch: 'x'.$", h.plant(f, tag=T), {}, True, 1.0)
    raises(ValueError, "^Missing sow in branch: 'x'.$", h.plant(f, tag=T), {"x": 3.0}, True,
           1.0)


def test_cond_mismatching_number():
    f = _switch(lambda i, x: h.sow(x, tag=T, name="a") + (
        h.sow(x, tag=T, name="b") if i == 1 else 0.0))
    raises(ValueError, r"^Mismatching number of `sow`s between branches.$", h.reap(f, tag=T),
           0, 2.0)
    g = _switch(lambda i, x: h.sow(x, tag=T, name="a") if i != 2 else x)
    raises(ValueError, r"^Mismatching number of `sow`s between branches.$", h.reap(g, tag=T),
           0, 2.0)


def test_cond_mismatched_shape():
    f = _switch(lambda i, x: x + h.sow(x if i != 1 else x[0], tag=T, name="a"))
    raises(ValueError, "^Mismatched shape between branches: 'a'.$", h.reap(f, tag=T), 0,
           jnp.ones(2))


def test_cond_mismatched_dtype():
    f = _switch(lambda i, x: x + h.sow(x if i != 1 else x.astype(jnp.int32), tag=T, name="a"))
    raises(ValueError, "^Mismatched dtype between branches: 'a'.$", h.reap(f, tag=T), 0,
           jnp.ones(2))


def test_cond_checks_ignore_unselected_names():
    f = _switch(lambda i, x: h.sow(x, tag=T, name="a") + (
        h.sow(x, tag=T, name="b") if i == 1 else 0.0))
    assert_tree_allclose(h.reap(f, tag=T, blocklist=["b"])(1, 2.0), {"a": 2.0})
    assert_tree_allclose(h.reap(f, tag="other")(1, 2.0), {})

"""taxpr.harvest._run: selected sows, strict names, nest scopes, planted types and retyping."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taxpr import harvest as h

from harvest_helpers import (T, all_prims, allclose, assert_tree_allclose, jax_still_works, raises,
                             _basic, _layer, _switch, _twice, _while)


# ---- filtering ---------------------------------------------------------------------

def _three(x):
    return (h.sow(x, tag=T, name="x") + h.sow(x * 2, tag=T, name="y")
            + h.sow(x * 3, tag=T, name="z"))


def test_allowlist():
    assert_tree_allclose(h.reap(_three, tag=T, allowlist=["x", "z"])(1.0), {"x": 1.0, "z": 3.0})
    allclose(h.plant(_three, tag=T, allowlist=["x"])({"x": 10.0, "y": 10.0}, 1.0), 10 + 2 + 3)


def test_blocklist():
    assert_tree_allclose(h.reap(_three, tag=T, blocklist=["y"])(1.0), {"x": 1.0, "z": 3.0})
    allclose(h.plant(_three, tag=T, blocklist=["y"])({"x": 10.0, "y": 10.0}, 1.0), 10 + 2 + 3)


def test_blocklist_wins_over_allowlist():
    assert_tree_allclose(h.reap(_three, tag=T, allowlist=["x", "y"], blocklist=["y"])(1.0),
                         {"x": 1.0})
    out, reaps = h.harvest(_three, tag=T, allowlist=["x", "y"], blocklist=["x"])(
        {"x": 10.0, "y": 20.0}, 1.0)
    allclose(out, 1 + 20 + 3)
    assert reaps == {}


def test_filtered_names_pass_through_to_outer_reap():
    inner = h.call_and_reap(_three, tag=T, allowlist=["x"], blocklist=["z"])
    (out, reaps), outer = h.call_and_reap(inner, tag=T)(1.0)
    allclose(out, 6.0)
    assert_tree_allclose(reaps, {"x": 1.0})
    assert_tree_allclose(outer, {"y": 2.0, "z": 3.0})


def _two_tags(x):
    return h.sow(x, tag="a", name="x") + h.sow(x * 3, tag="b", name="z")


def test_other_tags_stay_for_outer_harvest():
    (out, inner), outer = h.call_and_reap(h.call_and_reap(_two_tags, tag="a"), tag="b")(1.0)
    allclose(out, 4.0)
    assert_tree_allclose(inner, {"x": 1.0})
    assert_tree_allclose(outer, {"z": 3.0})
    # plant of the outer tag reaches through the inner reap
    out = h.plant(h.call_and_reap(_two_tags, tag="a"), tag="b")({"z": 10.0}, 1.0)
    allclose(out[0], 11.0)


def test_exclusive_removes_other_sows():
    (out, inner), outer = h.call_and_reap(h.call_and_reap(_two_tags, tag="a", exclusive=True),
                                          tag="b")(1.0)
    allclose(out, 4.0)
    assert_tree_allclose(inner, {"x": 1.0})
    assert outer == {}
    # also the filtered names of the same tag
    outer = h.reap(h.reap(_three, tag=T, allowlist=["x"], exclusive=True), tag=T)(1.0)
    assert outer == {}
    # plant / harvest too
    out, outer = h.call_and_reap(h.plant(_two_tags, tag="a", exclusive=True), tag="b")(
        {"x": 5.0}, 1.0)
    allclose(out, 8.0)
    assert outer == {}
    (out, inner), outer = h.call_and_reap(h.harvest(_two_tags, tag="a", exclusive=True),
                                          tag="b")({}, 1.0)
    assert_tree_allclose(inner, {"x": 1.0})
    assert outer == {}
    # no sow left in the jaxpr
    closed = jax.make_jaxpr(h.reap(_two_tags, tag="a", exclusive=True))(1.0)
    assert "tag" not in all_prims(closed)
    closed = jax.make_jaxpr(h.reap(_two_tags, tag="a"))(1.0)
    assert all_prims(closed).count("tag") == 1


def test_plant_keys_matching_no_sow_are_ignored():
    allclose(h.plant(_basic, tag=T)({"nope": 5.0, "a": 1.0}, 3.0), 2.0)
    out, reaps = h.harvest(_basic, tag=T)({"nope": jnp.ones(7)}, 3.0)
    allclose(out, 42.0)
    assert_tree_allclose(reaps, {"a": 6.0, "b": 7.0})


def test_other_tag_plants_ignored():
    allclose(h.plant(_two_tags, tag="a")({"z": 100.0}, 1.0), 4.0)


# ---- strict=True: typos raise --------------------------------------------------------

def test_typos_pass_by_default_as_in_oryx():
    assert_tree_allclose(h.reap(_basic, tag=T, allowlist=["aa"])(3.0), {})
    allclose(h.plant(_basic, tag=T)({"bb": 1.0}, 3.0), 42.0)


def test_strict_reap_raises_on_misspelled_allowlist_name():
    msg = (r"^taxpr.harvest \(strict=True\), tag 't': allowlist names \['aa'\] match no sow. "
           r"Sows of tag 't' in this program: \['a', 'b'\]$")
    raises(ValueError, msg, h.reap(_basic, tag=T, allowlist=["a", "aa"], strict=True), 3.0)
    raises(ValueError, msg, h.call_and_reap(_basic, tag=T, allowlist=["aa"], strict=True), 3.0)
    raises(ValueError, r"blocklist names \['c'\] match no sow",
           h.reap(_basic, tag=T, blocklist=["c"], strict=True), 3.0)


def test_strict_plant_raises_on_a_name_no_sow_has():
    msg = (r"planted names \['bb'\] were never planted \(no selected sow has them\)\. "
           r"Sows of tag 't' in this program: \['a', 'b'\]$")
    raises(ValueError, msg, h.plant(_basic, tag=T, strict=True), {"a": 1.0, "bb": 1.0}, 3.0)
    raises(ValueError, msg, h.harvest(_basic, tag=T, strict=True), {"bb": 1.0}, 3.0)
    # a name that exists but is blocklisted is never planted either
    raises(ValueError, r"planted names \['b'\]",
           h.plant(_basic, tag=T, blocklist=["b"], strict=True), {"b": 1.0}, 3.0)
    # under jit too
    raises(ValueError, msg.rstrip("$"), jax.jit(h.plant(_basic, tag=T, strict=True)), {"bb": 1.0},
           3.0)


def test_strict_accepts_correct_names_and_nest_scopes():
    a, b = 3.0 * 2, 3.0 * 2 + 1
    assert_tree_allclose(h.reap(_basic, tag=T, allowlist=["a"], strict=True)(3.0), {"a": a})
    allclose(h.plant(_basic, tag=T, strict=True)({"a": 1.0}, 3.0), 1.0 * 2.0)
    out, reaps = h.harvest(_basic, tag=T, strict=True)({"b": 5.0}, 3.0)
    allclose(out, a * 5.0)
    assert_tree_allclose(reaps, {"a": a})
    nested = h.nest(_basic, scope="s")
    allclose(h.plant(nested, tag=T, strict=True)({"s": {"a": 1.0}}, 3.0), 2.0)
    assert_tree_allclose(h.reap(nested, tag=T, allowlist=["s"], strict=True)(3.0),
                         {"s": {"a": a, "b": b}})
    raises(ValueError, r"planted names \['s.c'\]", h.plant(nested, tag=T, strict=True),
           {"s": {"c": 1.0}}, 3.0)


# ---- nest ---------------------------------------------------------------------------

def test_nest_reaps_under_scope():
    def f(x):
        y = h.nest(_layer, scope="l1")(x)
        y = h.nest(_layer, scope="l2")(y)
        return h.sow(y, tag=T, name="h")

    out, reaps = h.call_and_reap(f, tag=T)(1.0)
    allclose(out, 7.0)
    assert_tree_allclose(reaps, {"l1": {"h": 2.0}, "l2": {"h": 6.0}, "h": 7.0})


def test_nest_plants_read_from_scope():
    def f(x):
        return h.nest(_layer, scope="l1")(x) + h.sow(x, tag=T, name="h")

    allclose(h.plant(f, tag=T)({"l1": {"h": 10.0}}, 1.0), 11.0 + 1.0)
    allclose(h.plant(f, tag=T)({"h": 10.0}, 1.0), 3.0 + 10.0)
    out, reaps = h.harvest(f, tag=T)({"l1": {"h": 10.0}}, 1.0)
    allclose(out, 12.0)
    assert_tree_allclose(reaps, {"h": 1.0})


def test_nest_nested_scopes():
    def f(x):
        return h.nest(h.nest(_layer, scope="inner"), scope="outer")(x)

    assert_tree_allclose(h.reap(f, tag=T)(1.0), {"outer": {"inner": {"h": 2.0}}})
    allclose(h.plant(f, tag=T)({"outer": {"inner": {"h": 5.0}}}, 1.0), 6.0)


def test_nest_scope_colliding_with_a_name_is_an_error():
    def f(x):
        return h.nest(_layer, scope="s")(x) + h.sow(x, tag=T, name="s")

    raises(ValueError, "already been reaped: s", h.reap(f, tag=T), 1.0)


def test_nest_under_jit_and_scan():
    def f(xs):
        def body(c, x):
            return c + h.nest(lambda v: h.sow(v * c, tag=T, name="p", mode="append"),
                              scope="s")(x), None
        return jax.lax.scan(body, 1.0, xs)[0]

    xs = jnp.array([1.0, 2.0, 3.0])
    # c: 1 -> 1+1=2 -> 2+4=6 -> 6+18=24; p = [1, 4, 18]
    out, reaps = jax.jit(h.call_and_reap(f, tag=T))(xs)
    allclose(out, 24.0)
    assert_tree_allclose(reaps, {"s": {"p": np.array([1.0, 4.0, 18.0])}})


# ---- better than oryx ----------------------------------------------------------------

def test_plant_shape_checked():
    raises(ValueError, r"^Planted value for 'a' has type float32\[3\], but the sow at <top level> "
           r"has type float32\[\] \(weakly typed\);", h.plant(_basic, tag=T),
           {"a": jnp.ones(3)}, 3.0)
    raises(ValueError, r"^Planted value for 'a' has type float32\[2, 2\], but the sow at <top "
           r"level> has type float32\[2\];", h.plant(lambda x: h.sow(x, tag=T, name="a") + 1, tag=T),
           {"a": jnp.ones((2, 2))}, jnp.ones(2))


def test_plant_dtype_checked():
    raises(ValueError, r"^Planted value for 'i' has type float32\[\], but the sow at <top level> "
           r"has type int32\[\];", h.plant(lambda x: h.sow(x, tag=T, name="i") + 1, tag=T),
           {"i": jnp.float32(1.0)}, jnp.int32(1))
    raises(ValueError, r"^Planted value for 'a' has type int32\[\], but the sow at <top level> "
           r"has type float32\[\];", h.plant(lambda x: h.sow(x, tag=T, name="a") + 1, tag=T),
           {"a": jnp.int32(3)}, jnp.float32(1))


def test_plant_python_scalars_accepted():
    allclose(h.plant(lambda x: h.sow(x * 2, tag=T, name="a") + 1, tag=T)({"a": 5.0},
                                                                          jnp.float32(1)), 6.0)
    allclose(h.plant(lambda x: h.sow(x * 2, tag=T, name="a") + 1, tag=T)({"a": 5},
                                                                          jnp.int32(1)), 6)


def _int_sow(x):
    y = h.sow(717, tag=T, name="y")  # a Python int: a weakly typed int32 sow
    x = h.sow(x, tag=T, name="x")
    return x + y


@pytest.mark.parametrize("y", [15.0, 15.5, -3.25])
def test_plant_float_into_sown_python_int_promotes_like_oryx(y):
    # As if the Python float had been written in place of 717 (oryx: 17.0 for 15.0).
    eager = 2.0 + y
    out = h.plant(_int_sow, tag=T)({"x": 2.0, "y": y}, 1.0)
    assert out.dtype == jnp.float32
    allclose(out, eager)
    out = jax.jit(h.plant(_int_sow, tag=T))({"x": 2.0, "y": y}, 1.0)
    allclose(out, eager)
    # a float32 array is accepted too (promotion gives float32)
    allclose(h.plant(_int_sow, tag=T)({"y": jnp.float32(y)}, 1.0), 1.0 + y)
    assert h.plant(_int_sow, tag=T)({}, 1.0) == 718.0


def test_plant_float_into_sown_python_int_composes_with_other_transformations():
    eager = 1.0 + 15.5  # _int_sow with 15.5 written in place of 717
    out, reaps = h.call_and_reap(h.plant(_int_sow, tag=T), tag=T)({"y": 15.5}, 1.0)
    allclose(out, eager)
    assert_tree_allclose(reaps, {"x": 1.0})
    out, reaps = h.plant(h.call_and_reap(_int_sow, tag=T, allowlist=["x"]), tag=T)(
        {"y": 15.5}, 1.0)
    allclose(out, eager)
    assert_tree_allclose(reaps, {"x": 1.0})
    allclose(h.plant(h.nest(_int_sow, scope="s"), tag=T)({"s": {"y": 15.5}}, 1.0), eager)
    allclose(jax.grad(lambda p: h.plant(_int_sow, tag=T)({"y": p}, 1.0))(15.5), 1.0)
    allclose(jax.vmap(lambda p: h.plant(_int_sow, tag=T)({"y": p}, 1.0))(jnp.array([1.5, 2.5])),
             [2.5, 3.5])


def test_plant_into_sown_python_int_keeps_int_arithmetic_for_int_plants():
    f = lambda i: h.sow(3, tag=T, name="k") * i  # an int program
    out = h.plant(f, tag=T)({"k": jnp.int8(2)}, jnp.int8(5))
    assert out.dtype == jnp.int8 and int(out) == 10
    assert int(h.plant(f, tag=T)({"k": 4}, 5)) == 20


def test_plant_python_scalar_converts_to_the_sows_dtype():
    # 2.0 + float16 is float16 in JAX: a Python float planted into a float16 sow
    f = lambda x: h.sow(x * 2, tag=T, name="a") + 1
    out = h.plant(f, tag=T)({"a": 2.0}, jnp.float16(1))
    assert out.dtype == jnp.float16 and float(out) == 3.0
    # 3 into a float32 sow becomes 3.0
    out = h.plant(f, tag=T)({"a": 3}, jnp.float32(1))
    assert out.dtype == jnp.float32 and float(out) == 4.0


def test_plant_refuses_what_promotion_would_change():
    f = lambda x: h.sow(x, tag=T, name="i") + 1
    # 2.5 with int32 promotes to float: the int sow cannot take it
    raises(ValueError, r"'i'.*float32\[\].*int32\[\]", h.plant(f, tag=T), {"i": 2.5},
           jnp.int32(1))
    # a strongly typed value of another dtype into a strongly typed sow
    raises(ValueError, r"'i'.*float16\[\].*int32\[\]", h.plant(f, tag=T),
           {"i": jnp.float16(2)}, jnp.int32(1))
    # a sown Python float cannot become an int (promotion gives float)
    g = lambda x: h.sow(1.0, tag=T, name="w") * x
    raises(ValueError, r"'w'.*int32\[\].*float32\[\] \(weakly typed\)", h.plant(g, tag=T),
           {"w": jnp.int32(2)}, 1.0)
    # shapes are never promoted
    raises(ValueError, r"'y'.*float32\[2\]", h.plant(_int_sow, tag=T), {"y": jnp.ones(2)}, 1.0)


def test_plant_refusals_say_why_under_strict_dtype_promotion():
    """Under ``jax_numpy_dtype_promotion="strict"`` JAX refuses to promote
    across kinds: the plant says which value does not fit which sow (not
    JAX's promotion error), and fitting values plant as before."""
    f = lambda x: h.sow(x, tag=T, name="i") * 2
    with jax.numpy_dtype_promotion("strict"):
        for planted in (jnp.float32(1.0), 2.5, jnp.float16(2)):
            raises(ValueError, r"^Planted value for 'i' has type float\d+\[\], but the sow at "
                   r"<top level> has type int32\[\];", h.plant(f, tag=T), {"i": planted},
                   jnp.int32(1))
        assert int(h.plant(f, tag=T)({"i": jnp.int32(3)}, jnp.int32(1))) == 6
        out = h.plant(f, tag=T)({"i": 3}, jnp.float32(1))  # a weak int into a float sow
        assert out.dtype == jnp.float32 and float(out) == 6.0


def test_errors_leave_jax_working_after_each_error():
    bad = [
        (h.reap(_twice("strict"), tag=T), (1.0,), "^Variable has already been reaped: x"),
        (h.reap(functools.partial(_while, mode="append"), tag=T), (1.0, 3),
         "^Must use clobber or cond_clobber mode for 'v' inside of a `while_loop`."),
        (h.reap(_switch(lambda i, x: h.sow(x, tag=T, name=str(i))), tag=T), (0, 1.0),
         "^Missing sow in branch: '1'."),
        (h.plant(_basic, tag=T), ({"a": jnp.ones(2)}, 1.0),
         r"^Planted value for 'a' has type float32\[2\], but the sow at <top level> has type "
         r"float32\[\]"),
    ]
    for fn, args, msg in bad:
        with pytest.raises(ValueError, match=msg):
            fn(*args)
        with pytest.raises(ValueError, match=msg):
            jax.jit(fn)(*args)
        jax_still_works()
        # harvest itself still works too
        assert_tree_allclose(h.reap(_basic, tag=T)(3.0), {"a": 6.0, "b": 7.0})

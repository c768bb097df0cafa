"""taxpr.harvest: oryx-compatible sow / reap / plant.

Every result is compared with a value computed by hand or by plain Python /
NumPy. Error tests also check that JAX still works afterwards.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import taxpr as tx
from taxpr import harvest as h
from taxpr import _traverse

from helpers import check, cpu_mesh, shard_map

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


def top_prims(closed) -> list[str]:
    j = closed.jaxpr if hasattr(closed, "jaxpr") else closed
    return [e.primitive.name for e in j.eqns]


def all_prims(closed) -> list[str]:
    return [e.primitive.name for e, _ in _traverse.iter_eqns(closed)]


def assert_tree_allclose(got, want):
    gl, gt = jax.tree_util.tree_flatten(got)
    wl, wt = jax.tree_util.tree_flatten(want)
    assert gt == wt, (gt, wt)
    for g, w in zip(gl, wl):
        allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def checked_jaxpr(fn, *args):
    """make_jaxpr(fn)(*args), checked with core.check_jaxpr."""
    closed = jax.make_jaxpr(fn)(*args)
    check(closed)
    return closed


# ---- names and signatures ----------------------------------------------------------

def test_public_names():
    for name in ["sow", "sow_cond", "reap", "call_and_reap", "plant", "harvest", "nest",
                 "sow_p"]:
        assert hasattr(h, name), name
    assert set(h.__all__) >= {"sow", "sow_cond", "reap", "call_and_reap", "plant", "harvest",
                              "nest", "sow_p"}
    assert tx.harvest is h
    # sow_p is the primitive that sow binds.
    closed = jax.make_jaxpr(lambda x: h.sow(x, tag=T, name="a"))(1.0)
    assert [e.primitive for e in closed.jaxpr.eqns] == [h.sow_p]


def _sig(fn):
    return {n: (p.kind, p.default) for n, p in inspect.signature(fn).parameters.items()}


def test_signatures():
    K, E, POS = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty,
                 inspect.Parameter.POSITIONAL_OR_KEYWORD)
    assert _sig(h.sow) == {"value": (POS, E), "tag": (K, E), "name": (K, E),
                           "mode": (K, "strict"), "key": (K, None)}
    s = _sig(h.sow_cond)
    assert list(s)[:2] == ["value", "pred"]
    assert s["tag"] == (K, E) and s["name"] == (K, E)
    for fn in (h.reap, h.call_and_reap, h.plant, h.harvest):
        s = _sig(fn)
        # oryx's signature, plus taxpr's keyword-only ``strict`` last
        assert list(s) == ["f", "tag", "allowlist", "blocklist", "exclusive", "strict"], fn
        assert s["strict"] == (K, False)
        assert s["tag"] == (K, E)
        assert s["allowlist"] == (K, None)
        assert tuple(s["blocklist"][1]) == () and s["blocklist"][0] == K
        assert s["exclusive"] == (K, False)
    s = _sig(h.nest)
    assert list(s) == ["f", "scope"] and s["scope"] == (K, E)


def test_sow_is_identity_without_harvest():
    def f(x):
        return h.sow(x * 2, tag=T, name="a", key=x) + h.sow_cond(x, x > 0, tag=T, name="c")

    allclose(f(3.0), 9.0)
    allclose(jax.jit(f)(3.0), 9.0)
    allclose(jax.grad(f)(3.0), 3.0)
    allclose(jax.vmap(f)(jnp.arange(3.0)), 3 * np.arange(3.0))


def test_invalid_mode():
    raises(ValueError, "mode", lambda: h.sow(1.0, tag=T, name="a", mode="bogus"))


# ---- reap / call_and_reap / plant / harvest --------------------------------------

def _basic(x):
    a = h.sow(x * 2, tag=T, name="a")
    b = h.sow(a + 1, tag=T, name="b")
    return a * b


def test_reap_returns_dict():
    assert_tree_allclose(h.reap(_basic, tag=T)(3.0), {"a": 6.0, "b": 7.0})


def test_call_and_reap():
    out, reaps = h.call_and_reap(_basic, tag=T)(3.0)
    allclose(out, 42.0)
    assert_tree_allclose(reaps, {"a": 6.0, "b": 7.0})


def test_plant():
    allclose(h.plant(_basic, tag=T)({"a": 10.0}, 3.0), 10.0 * 11.0)
    allclose(h.plant(_basic, tag=T)({"b": 10.0}, 3.0), 6.0 * 10.0)
    allclose(h.plant(_basic, tag=T)({"a": 1.0, "b": 5.0}, 3.0), 5.0)
    allclose(h.plant(_basic, tag=T)({}, 3.0), 42.0)


def test_harvest_planted_names_not_reaped():
    out, reaps = h.harvest(_basic, tag=T)({"a": 10.0}, 3.0)
    allclose(out, 110.0)
    assert_tree_allclose(reaps, {"b": 11.0})
    out, reaps = h.harvest(_basic, tag=T)({}, 3.0)
    allclose(out, 42.0)
    assert_tree_allclose(reaps, {"a": 6.0, "b": 7.0})


def test_key_is_accepted():
    f = lambda x: h.sow(x * 2, tag=T, name="a", key=x + 1, mode="clobber") + 1
    out, reaps = h.call_and_reap(f, tag=T)(3.0)
    allclose(out, 7.0)
    assert_tree_allclose(reaps, {"a": 6.0})
    allclose(h.plant(f, tag=T)({"a": 1.0}, 3.0), 2.0)


def test_kwargs_and_pytree_args():
    def f(d, *, scale):
        return h.sow(d["u"] * scale, tag=T, name="a") + d["v"]

    out, reaps = h.call_and_reap(f, tag=T)({"u": 2.0, "v": 1.0}, scale=3.0)
    allclose(out, 7.0)
    assert_tree_allclose(reaps, {"a": 6.0})


def test_array_values_and_dtypes():
    def f(x, i):
        h.sow(i * 2, tag=T, name="i")
        return h.sow(x.T, tag=T, name="xt") @ x

    x = jnp.arange(6.0).reshape(2, 3)
    out, reaps = h.call_and_reap(f, tag=T)(x, jnp.int32(4))
    allclose(out, np.arange(6.0).reshape(2, 3).T @ np.arange(6.0).reshape(2, 3))
    allclose(reaps["xt"], np.arange(6.0).reshape(2, 3).T)
    assert reaps["i"].dtype == jnp.int32 and int(reaps["i"]) == 8


def _pytree_sow(x):
    v = h.sow({"p": x, "q": (x + 1, x + 2)}, tag=T, name="b")
    return v["p"] + v["q"][1]


def test_reap_pytree_value_keeps_structure():
    assert_tree_allclose(h.reap(_pytree_sow, tag=T)(1.0), {"b": {"p": 1.0, "q": (2.0, 3.0)}})


def test_plant_pytree_value():
    out = h.plant(_pytree_sow, tag=T)({"b": {"p": 10.0, "q": (0.0, 5.0)}}, 1.0)
    allclose(out, 15.0)


def test_plant_tuple_value():
    def f(x):
        a, b = h.sow((x, x * 2), tag=T, name="ab")
        return a * b

    allclose(h.plant(f, tag=T)({"ab": (3.0, 4.0)}, 1.0), 12.0)


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

def _layer(x):
    return h.sow(x * 2, tag=T, name="h") + 1


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


# ---- modes -------------------------------------------------------------------------

def _twice(mode):
    def f(x):
        return h.sow(x, tag=T, name="x", mode=mode) + h.sow(x * 2, tag=T, name="x", mode=mode)
    return f


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


def _append_in_wrapper(wrap):
    def f(x):
        inner = wrap(lambda x: h.sow(x, tag=T, name="a", mode="append") * 2)(x)
        return inner + h.sow(x + 1, tag=T, name="a", mode="append")
    return f


@pytest.mark.parametrize("wrap", [jax.jit, jax.checkpoint], ids=["jit", "checkpoint"])
def test_append_inside_jit_and_checkpoint_reap(wrap):
    assert_tree_allclose(h.reap(_append_in_wrapper(wrap), tag=T)(1.0), {"a": np.array([1.0, 2.0])})
    g = jax.jit(lambda x: h.sow(x, tag=T, name="a", mode="append"))
    assert_tree_allclose(h.reap(lambda x: g(x) + g(x * 3), tag=T)(1.0),
                         {"a": np.array([1.0, 3.0])})


_KEY_BUG = ("LEAD: append plant keys collide: a fed key is ('plant', name, occurrence in its "
            "own jaxpr) and jit/checkpoint pass it up unchanged (scan only appends 'scan'), so "
            "sows in different sub-jaxprs (or one cached sub-jaxpr called twice) share one key; "
            "Level.feed dedups it and they all get the same planted row")


@pytest.mark.parametrize("wrap", [jax.jit, jax.checkpoint], ids=["jit", "checkpoint"])
def test_append_inside_jit_and_checkpoint_plant(wrap):
    # rows in program order: the wrapped sow gets 3, the direct one 5
    allclose(h.plant(_append_in_wrapper(wrap), tag=T)({"a": jnp.array([3.0, 5.0])}, 1.0), 11.0)


def test_append_plant_same_jit_called_twice():
    g = jax.jit(lambda x: h.sow(x, tag=T, name="a", mode="append"))
    allclose(h.plant(lambda x: g(x) + g(x) * 10, tag=T)({"a": jnp.array([1.0, 2.0])}, 1.0), 21.0)


def _same_body_twice(x):
    def body(c, _):
        return c + h.sow(c, tag=T, name="a", mode="append"), None
    x = jax.lax.scan(body, x, None, length=2)[0]
    return jax.lax.scan(body, x * 10, None, length=2)[0]


def test_append_reap_same_scan_body_twice():
    out, reaps = h.call_and_reap(_same_body_twice, tag=T)(1.0)
    allclose(out, 160.0)
    assert_tree_allclose(reaps, {"a": np.array([1.0, 2.0, 40.0, 80.0])})


def test_append_plant_same_scan_body_twice():
    # first scan: 1 + 0 + 1 = 2; second: 20 + 2 + 3 = 25
    allclose(h.plant(_same_body_twice, tag=T)({"a": jnp.array([0.0, 1.0, 2.0, 3.0])}, 1.0), 25.0)


def test_cond_clobber_plant():
    def f(x):
        return h.sow_cond(x + 1, x > 0, tag=T, name="c") * 2

    allclose(h.plant(f, tag=T)({"c": 7.0}, 1.0), 14.0)
    allclose(h.plant(f, tag=T)({"c": 7.0}, -1.0), 14.0)


# ---- scan --------------------------------------------------------------------------

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


def test_scan_append_and_clobber():
    xs = np.array([1.0, 2.0, 3.0, 4.0])
    (c, ys), reaps = h.call_and_reap(_scan_fn, tag=T)(2.0, xs)
    c_ref, ys_ref = _scan_eager(2.0, xs)
    allclose(c, c_ref)
    allclose(ys, ys_ref)
    assert_tree_allclose(reaps, {"c": c_ref, "y": ys_ref})


def test_scan_reverse_aligns_with_xs():
    xs = np.array([1.0, 2.0, 3.0, 4.0])
    (c, ys), reaps = h.call_and_reap(functools.partial(_scan_fn, reverse=True), tag=T)(2.0, xs)
    c_ref, ys_ref = _scan_eager(2.0, xs, reverse=True)
    allclose(ys, ys_ref)
    assert_tree_allclose(reaps, {"c": c_ref, "y": ys_ref})


def test_nested_scans_stack_outer_inner():
    def f(x):
        def outer(c, i):
            def inner(c2, j):
                h.sow(c2 * 0 + 10 * i + j, tag=T, name="v", mode="append")
                return c2 + 1, None
            return jax.lax.scan(inner, c, jnp.arange(3.0))[0], None
        return jax.lax.scan(outer, x, jnp.arange(2.0))[0]

    out, reaps = h.call_and_reap(f, tag=T)(0.0)
    allclose(out, 6.0)
    assert reaps["v"].shape == (2, 3)
    allclose(reaps["v"], [[0, 1, 2], [10, 11, 12]])


def test_scan_append_with_multiple_sites_and_outside_sow():
    def f(x):
        h.sow(x, tag=T, name="v", mode="append")
        def body(c, xi):
            h.sow(c, tag=T, name="v", mode="append")
            return c + xi, None
        c = jax.lax.scan(body, x, jnp.array([1.0, 2.0]))[0]
        h.sow(c, tag=T, name="v", mode="append")
        return c

    # one row per direct sow, one block per scan, in program order
    assert_tree_allclose(h.reap(f, tag=T)(1.0), {"v": np.array([1.0, 1.0, 2.0, 4.0])})


def test_scan_strict_raises():
    def f(x):
        return jax.lax.scan(lambda c, _: (h.sow(c, tag=T, name="x"), None), x, None, length=3)[0]

    raises(ValueError, "^Cannot use strict mode for 'x' inside `scan`.$", h.reap(f, tag=T), 1.0)
    raises(ValueError, "^Cannot use strict mode for 'x' inside `scan`.$", h.plant(f, tag=T),
           {"x": 1.0}, 1.0)
    # an unselected strict sow in a scan is fine
    assert h.reap(f, tag="other")(1.0) == {}


def test_zero_length_scan():
    def f(x):
        def body(c, xi):
            return (h.sow(c * xi[0], tag=T, name="c", mode="clobber"),
                    h.sow(xi, tag=T, name="y", mode="append"))
        return jax.lax.scan(body, x, jnp.zeros((0, 2)))

    (c, ys), reaps = h.call_and_reap(f, tag=T)(3.0)
    allclose(c, 3.0)
    assert ys.shape == (0, 2)
    assert reaps["y"].shape == (0, 2) and reaps["y"].dtype == jnp.float32
    allclose(reaps["c"], 0.0)


def test_scan_cond_clobber():
    def f(xs):
        def body(c, x):
            h.sow_cond(x * 10, x > 2, tag=T, name="last_big")
            return c, None
        return jax.lax.scan(body, 0.0, xs)[0]

    assert_tree_allclose(h.reap(f, tag=T)(jnp.array([3.0, 1.0, 4.0, 1.0])), {"last_big": 40.0})
    assert_tree_allclose(h.reap(f, tag=T)(jnp.array([1.0, 1.0])), {"last_big": 0.0})


def test_scan_clobber_plant_every_iteration():
    def f(x):
        def body(c, xi):
            return c + h.sow(xi, tag=T, name="v", mode="clobber"), None
        return jax.lax.scan(body, x, jnp.arange(4.0))[0]

    allclose(f(0.0), 6.0)
    allclose(h.plant(f, tag=T)({"v": 10.0}, 0.0), 40.0)


def test_fori_loop_and_unrolled_scan():
    f = lambda x: jax.lax.fori_loop(0, 3, lambda i, c: c + h.sow(c * i, tag=T, name="a",
                                                                 mode="append"), x)
    # c: 1 -> 1 + 0 = 1 -> 1 + 1 = 2 -> 2 + 4 = 6
    out, reaps = h.call_and_reap(f, tag=T)(1.0)
    allclose(out, 6.0)
    assert_tree_allclose(reaps, {"a": np.array([0.0, 1.0, 4.0])})
    g = lambda x, n: jax.lax.fori_loop(0, n, lambda i, c: c + h.sow(c * i, tag=T, name="a",
                                                                    mode="clobber"), x)
    assert_tree_allclose(h.reap(g, tag=T)(1.0, 3), {"a": 4.0})
    u = lambda xs: jax.lax.scan(lambda c, x: (c + h.sow(x, tag=T, name="a", mode="append"),
                                              None), 0.0, xs, unroll=2)[0]
    assert_tree_allclose(h.reap(u, tag=T)(jnp.arange(5.0)), {"a": np.arange(5.0)})


def test_reap_inside_scan_and_vmap():
    def f(xs):
        def body(c, x):
            out, r = h.call_and_reap(lambda x: h.sow(x * 2, tag=T, name="a") + 1, tag=T)(x)
            return c + r["a"], out
        return jax.lax.scan(body, 0.0, xs)

    c, ys = f(jnp.arange(3.0))
    allclose(c, 6.0)
    allclose(ys, [1.0, 3.0, 5.0])
    r = jax.vmap(h.reap(lambda x: h.sow(x * 2, tag=T, name="a"), tag=T))(jnp.arange(3.0))
    assert_tree_allclose(r, {"a": np.array([0.0, 2.0, 4.0])})


def _deep(depth):
    def f(x):
        def level(d, x):
            if d == 0:
                return h.sow(x, tag=T, name="v", mode="append") + 1.0
            def body(c, _):
                return level(d - 1, c), None
            return jax.lax.scan(body, x, None, length=2)[0]
        return level(depth, x)
    return f


def test_depth8_nested_scans():
    out, reaps = h.call_and_reap(_deep(8), tag=T)(0.0)
    allclose(out, 256.0)
    assert reaps["v"].shape == (2,) * 8
    allclose(np.asarray(reaps["v"]).ravel(), np.arange(256.0))
    check(jax.make_jaxpr(h.reap(_deep(8), tag=T))(0.0))


# ---- while_loop ----------------------------------------------------------------------

def _while(x, n, mode="clobber"):
    def body(c):
        i, v = c
        return i + 1, h.sow(v * 2, tag=T, name="v", mode=mode)
    return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]


def test_while_clobber():
    out, reaps = h.call_and_reap(_while, tag=T)(1.0, 3)
    allclose(out, 8.0)
    assert_tree_allclose(reaps, {"v": 8.0})


def test_while_never_runs_reaps_zeros():
    out, reaps = h.call_and_reap(_while, tag=T)(jnp.full(2, 5.0), 0)
    allclose(out, [5.0, 5.0])
    assert_tree_allclose(reaps, {"v": np.zeros(2)})


@pytest.mark.parametrize("mode", ["strict", "append"])
def test_while_requires_clobber(mode):
    f = functools.partial(_while, mode=mode)
    msg = "^Must use clobber or cond_clobber mode for 'v' inside of a `while_loop`.$"
    raises(ValueError, msg, h.reap(f, tag=T), 1.0, 3)
    raises(ValueError, msg, h.plant(f, tag=T), {"v": 1.0}, 1.0, 3)


def test_while_plant_every_iteration():
    def f(x, n):
        def body(c):
            i, acc = c
            return i + 1, acc + h.sow(x * i, tag=T, name="v", mode="clobber")
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, 0.0))[1]

    allclose(f(1.0, 4), 6.0)
    allclose(h.plant(f, tag=T)({"v": 5.0}, 1.0, 4), 20.0)
    out, reaps = h.harvest(f, tag=T)({}, 1.0, 4)
    allclose(out, 6.0)
    assert_tree_allclose(reaps, {"v": 3.0})


def test_while_cond_clobber():
    def f(x, n):
        def body(c):
            i, v = c
            h.sow_cond(v + i, i % 2 == 1, tag=T, name="odd")
            return i + 1, v
        return jax.lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]

    assert_tree_allclose(h.reap(f, tag=T)(10.0, 5), {"odd": 13.0})
    assert_tree_allclose(h.reap(f, tag=T)(10.0, 1), {"odd": 0.0})


def test_while_sow_in_cond_fn():
    def f(n):
        def cond(c):
            return h.sow(c, tag=T, name="seen", mode="clobber") < n
        return jax.lax.while_loop(cond, lambda c: c + 1, 0)

    out, reaps = h.call_and_reap(f, tag=T)(3)
    assert int(out) == 3 and int(reaps["seen"]) == 3


def test_while_in_scan_clobber():
    def f(xs):
        def body(c, x):
            v = jax.lax.while_loop(lambda v: v < x,
                                   lambda v: h.sow(v + 1, tag=T, name="w", mode="clobber"), 0.0)
            return c + v, h.sow(v, tag=T, name="a", mode="append")
        return jax.lax.scan(body, 0.0, xs)

    (c, ys), reaps = h.call_and_reap(f, tag=T)(jnp.array([2.0, 0.0, 3.0]))
    allclose(c, 5.0)
    assert_tree_allclose(reaps, {"w": 3.0, "a": np.array([2.0, 0.0, 3.0])})


def _while_two_sows(init):
    def body(c):
        i, val, val2 = c
        val = h.sow(val, tag=T, name="x", mode="clobber")
        val2 = h.sow(val2, tag=T, name="y", mode="clobber")
        return i + 1, val + 1.0, val + val2
    return jax.lax.while_loop(lambda c: c[0] < 5, body, init)


def _while_two_sows_eager(x_plant=None):
    """_while_two_sows with a Python loop: (out, last y sown)."""
    i, val, val2, y = 0, 0.0, 0.0, None
    while i < 5:
        val = val if x_plant is None else x_plant
        y = val2
        i, val, val2 = i + 1, val + 1.0, val + val2
    return (i, val, val2), y


@pytest.mark.parametrize("disable_jit", [False, True])
def test_reap_of_plant_reaps_the_unplanted_sow_in_while(disable_jit):
    want_out, want_y = _while_two_sows_eager(x_plant=5.0)
    with jax.disable_jit(disable_jit):
        out, reaps = h.call_and_reap(h.plant(_while_two_sows, tag=T), tag=T)(
            {"x": 5.0}, (0, 0.0, 0.0))
    assert int(out[0]) == want_out[0]
    allclose(out[1:], want_out[1:])
    assert list(reaps) == ["y"]  # the planted "x" is consumed by the plant
    allclose(reaps["y"], want_y)


def test_plant_of_reap_and_nested_plants_compose():
    want_out, want_y = _while_two_sows_eager(x_plant=5.0)
    # reap inside plant: the outer plant replaces "x", the inner reap gets "y"
    out, reaps = h.plant(h.call_and_reap(_while_two_sows, tag=T, allowlist=["y"]), tag=T)(
        {"x": 5.0}, (0, 0.0, 0.0))
    allclose(out[1:], want_out[1:])
    assert_tree_allclose(reaps, {"y": want_y})
    # plant inside plant: each plants its own name
    both = h.plant(h.plant(_while_two_sows, tag=T), tag=T)
    i, val, val2, y = 0, 0.0, 0.0, None
    while i < 5:  # x planted 5.0, y planted 1.0
        i, val, val2 = i + 1, 6.0, 5.0 + 1.0
    out = both({"y": 1.0}, {"x": 5.0}, (0, 0.0, 0.0))
    allclose(out[1:], (val, val2))
    # a harvest of another tag in between does not see or drop ours
    mixed = h.call_and_reap(h.plant(_while_two_sows, tag="other"), tag=T)
    out, reaps = mixed({}, (0, 0.0, 0.0))
    want_out, _ = _while_two_sows_eager()
    allclose(out[1:], want_out[1:])
    assert_tree_allclose(reaps, {"x": 4.0, "y": 6.0})


# ---- cond / switch -------------------------------------------------------------------

def _switch(mk):
    def f(p, x):
        return jax.lax.switch(p, [functools.partial(mk, i) for i in range(3)], x)
    return f


def test_switch_reaps_taken_branch():
    f = _switch(lambda i, x: h.sow(x * (i + 1), tag=T, name="a") + i)
    for i in range(3):
        out, reaps = h.call_and_reap(f, tag=T)(i, 2.0)
        allclose(out, 2.0 * (i + 1) + i)
        assert_tree_allclose(reaps, {"a": 2.0 * (i + 1)})


def test_cond_plant_goes_into_every_branch():
    f = _switch(lambda i, x: h.sow(x * (i + 1), tag=T, name="a") + i)
    for i in range(3):
        allclose(h.plant(f, tag=T)({"a": 7.0}, i, 2.0), 7.0 + i)
    g = lambda p, x: jax.lax.cond(p, lambda x: h.sow(x, tag=T, name="a") * 2,
                                  lambda x: h.sow(x + 1, tag=T, name="a") * 3, x)
    allclose(h.plant(g, tag=T)({"a": 5.0}, True, 1.0), 10.0)
    allclose(h.plant(g, tag=T)({"a": 5.0}, False, 1.0), 15.0)


_OCC_BUG = ("LEAD: append sows in cond branches: _Sites.occurrence is keyed by id(level); "
            "the first branch's Level is freed and its id reused by the next branch, so "
            "branch 2 collects ('reap','a',1) vs ('reap','a',0) -> 'Mismatching number of "
            "`sow`s between branches.'")


def test_cond_append_reap():
    f = _switch(lambda i, x: h.sow(x * (i + 1), tag=T, name="a", mode="append"))
    for i in range(3):
        assert_tree_allclose(h.reap(f, tag=T)(i, 2.0), {"a": np.array([2.0 * (i + 1)])})


def test_cond_append_plant():
    f = _switch(lambda i, x: h.sow(x * (i + 1), tag=T, name="a", mode="append") + i)
    for i in range(3):
        allclose(h.plant(f, tag=T)({"a": jnp.array([9.0])}, i, 2.0), 9.0 + i)


def test_cond_clobber_in_cond_branches():
    g = _switch(lambda i, x: h.sow_cond(x * (i + 1), i == 1, tag=T, name="c"))
    for i in range(3):
        assert_tree_allclose(h.reap(g, tag=T)(i, 2.0), {"c": 4.0 if i == 1 else 0.0})
    k = _switch(lambda i, x: h.sow(x * (i + 1), tag=T, name="k", mode="clobber"))
    for i in range(3):
        assert_tree_allclose(h.reap(k, tag=T)(i, 2.0), {"k": 2.0 * (i + 1)})


def _cond_in_scan(xs):
    def body(c, x):
        y = jax.lax.cond(x > 0, lambda x: h.sow(x, tag=T, name="y", mode="append"),
                         lambda x: h.sow(-x * 10, tag=T, name="y", mode="append"), x)
        return c + y, None
    return jax.lax.scan(body, 0.0, xs)[0]


def test_cond_inside_scan_reap():
    xs = jnp.array([1.0, -2.0, 3.0])
    out, reaps = h.call_and_reap(_cond_in_scan, tag=T)(xs)
    allclose(out, 24.0)
    assert_tree_allclose(reaps, {"y": np.array([1.0, 20.0, 3.0])})


def test_cond_inside_scan_plant():
    xs = jnp.array([1.0, -2.0, 3.0])
    allclose(_cond_in_scan(xs), 24.0)
    allclose(h.plant(_cond_in_scan, tag=T)({"y": jnp.array([1.0, 2.0, 4.0])}, xs), 7.0)


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


# ---- jit -----------------------------------------------------------------------------

def _jit_nested(x):
    @jax.jit
    def inner(x):
        return h.sow(jnp.sin(x), tag=T, name="s") * 2

    @jax.jit
    def outer(x):
        return inner(x) + h.sow(x * 3, tag=T, name="t")

    return outer(x)


def test_reap_through_nested_jit_keeps_jit():
    out, reaps = h.call_and_reap(_jit_nested, tag=T)(0.5)
    allclose(out, 2 * np.sin(0.5) + 1.5, rtol=1e-6)
    assert_tree_allclose(reaps, {"s": np.sin(0.5), "t": 1.5})
    closed = checked_jaxpr(h.reap(_jit_nested, tag=T), 0.5)
    assert set(top_prims(closed)) & {"jit", "pjit"}
    assert all_prims(closed).count("jit") + all_prims(closed).count("pjit") == 2


def test_plant_through_nested_jit():
    allclose(h.plant(_jit_nested, tag=T)({"s": 10.0}, 0.5), 21.5)
    allclose(h.plant(_jit_nested, tag=T)({"t": 10.0}, 0.5), 2 * np.sin(0.5) + 10, rtol=1e-6)


def test_jit_of_reap_plant_harvest():
    x = jnp.arange(3.0)
    xs = np.arange(3.0)
    allclose(jax.jit(h.reap(_scan_fn, tag=T))(2.0, x)["y"], _scan_eager(2.0, xs)[1])
    allclose(jax.jit(h.plant(_basic, tag=T))({"a": 10.0}, 3.0), 110.0)
    out, reaps = jax.jit(h.harvest(_basic, tag=T))({"a": 10.0}, 3.0)
    allclose(out, 110.0)
    assert_tree_allclose(reaps, {"b": 11.0})
    out = jax.jit(h.plant(_scan_fn, tag=T))({"y": jnp.array([7.0, 8.0, 9.0])}, 2.0, x)
    allclose(out[1], [7.0, 8.0, 9.0])


def test_check_jaxpr_of_transforms():
    x = jnp.arange(3.0)
    checked_jaxpr(h.reap(_basic, tag=T), 1.0)
    checked_jaxpr(h.reap(_scan_fn, tag=T), 2.0, x)
    checked_jaxpr(functools.partial(h.plant(_scan_fn, tag=T), {"y": x, "c": 1.0}), 2.0, x)
    checked_jaxpr(h.reap(_while, tag=T), 1.0, 3)
    checked_jaxpr(h.reap(_switch(lambda i, x: h.sow(x * i, tag=T, name="a")), tag=T), 1, 2.0)
    checked_jaxpr(h.reap(jax.checkpoint(_basic), tag=T), 1.0)


# ---- vmap ----------------------------------------------------------------------------

def _vg(x):
    a = h.sow(x ** 2, tag=T, name="a")
    def body(c, xi):
        return c + xi, h.sow(c * x, tag=T, name="b", mode="append")
    c, _ = jax.lax.scan(body, 0.0, jnp.arange(3.0))
    return h.sow_cond(a + c, x > 1, tag=T, name="c")


def test_reap_of_vmap_equals_vmap_of_reap():
    xs = jnp.array([0.5, 1.5, 2.5, -3.0])
    xn = np.asarray(xs)
    got = h.reap(jax.vmap(_vg), tag=T, blocklist=["b"])(xs)
    want = jax.vmap(h.reap(_vg, tag=T, blocklist=["b"]))(xs)
    assert_tree_allclose(got, want)
    # a = x^2; the c-sow only when x > 1 (a + c with c = 0 + 0 + 1 + 2 = 3)
    assert_tree_allclose(got, {"a": xn ** 2, "c": np.where(xn > 1, xn ** 2 + 3, 0.0)})
    assert_tree_allclose(jax.jit(h.reap(jax.vmap(_vg), tag=T, blocklist=["b"]))(xs), want)


def test_reap_of_vmap_append_layout():
    """append under vmap: reap(vmap(g)) stacks the per-sow batched values, so the
    stack axis comes first and the batch axis second (as in oryx); vmap(reap(g))
    has the batch axis first."""
    xs = jnp.array([0.5, 1.5, 2.5, -3.0])
    xn = np.asarray(xs)
    got = h.reap(jax.vmap(_vg), tag=T, allowlist=["b"])(xs)["b"]
    want = jax.vmap(h.reap(_vg, tag=T, allowlist=["b"]))(xs)["b"]
    # b_i = c_i * x with c = 0, 0, 1
    allclose(want, np.outer(xn, [0.0, 0.0, 1.0]))
    allclose(got, np.asarray(want).T)


def test_vmap_of_plant():
    xs = jnp.array([0.5, 1.5])
    out = jax.vmap(lambda x, a: h.plant(_vg, tag=T)({"a": a}, x))(xs, jnp.array([10.0, 20.0]))
    allclose(out, [13.0, 23.0])


# ---- grad ----------------------------------------------------------------------------

def test_int_sow_under_grad():
    def f(x):
        i = h.sow(jnp.int32(3) + jnp.floor(x).astype(jnp.int32), tag=T, name="i")
        return x * i

    out, reaps = h.call_and_reap(jax.grad(f), tag=T)(2.5)
    allclose(out, 5.0)
    assert reaps["i"].dtype == jnp.int32 and int(reaps["i"]) == 5
    allclose(jax.grad(lambda x: h.call_and_reap(f, tag=T)(x)[0])(2.5), 5.0)
    allclose(jax.grad(lambda x: h.plant(f, tag=T)({"i": jnp.int32(7)}, x))(2.5), 7.0)


def test_reap_of_function_calling_grad_reaps_primal():
    def f(x):
        return jax.grad(lambda y: h.sow(y ** 2, tag=T, name="a") * 3)(x)

    out, reaps = h.call_and_reap(f, tag=T)(2.0)
    allclose(out, 12.0)
    assert_tree_allclose(reaps, {"a": 4.0})


def test_reap_of_grad_of_scan():
    def f(x):
        def loss(x):
            def body(c, xi):
                return c * h.sow(x + xi, tag=T, name="v", mode="append"), None
            return jax.lax.scan(body, 1.0, jnp.arange(3.0))[0]
        return jax.grad(loss)(x)

    # loss = x (x+1) (x+2), d/dx = 3x^2 + 6x + 2
    out, reaps = h.call_and_reap(f, tag=T)(2.0)
    allclose(out, 26.0)
    assert_tree_allclose(reaps, {"v": np.array([2.0, 3.0, 4.0])})


def test_grad_of_reaped_value():
    def f(x):
        return h.sow(jnp.sin(x) * x, tag=T, name="a") + 1

    g = jax.grad(lambda x: h.reap(f, tag=T)(x)["a"])(0.7)
    allclose(g, np.cos(0.7) * 0.7 + np.sin(0.7), rtol=1e-6)
    gs = jax.grad(lambda x: h.reap(_scan_fn, tag=T)(x, jnp.arange(3.0))["y"].sum())(2.0)
    allclose(gs, 0 + 1 + 2)


def test_grad_of_plant_wrt_plants():
    def f(x):
        a = h.sow(x * 2, tag=T, name="a")
        return a ** 2 + jnp.sin(h.sow(a * x, tag=T, name="b", mode="clobber"))

    g = jax.grad(lambda p: h.plant(f, tag=T)({"a": p}, 1.5))(3.0)
    allclose(g, 2 * 3.0 + np.cos(3.0 * 1.5) * 1.5, rtol=1e-6)
    gb = jax.grad(lambda p: h.plant(f, tag=T)({"b": p}, 1.5))(0.3)
    allclose(gb, np.cos(0.3), rtol=1e-6)
    # and w.r.t. x: the planted value is a constant
    gx = jax.grad(lambda x: h.plant(f, tag=T)({"a": 3.0}, x))(1.5)
    allclose(gx, np.cos(3.0 * 1.5) * 3.0, rtol=1e-6)


def test_grad_of_plant_append_in_scan():
    def f(x, xs):
        def body(c, xi):
            return c + h.sow(xi * x, tag=T, name="v", mode="append") ** 2, None
        return jax.lax.scan(body, 0.0, xs)[0]

    p = jnp.array([1.0, 2.0, 3.0])
    g = jax.grad(lambda p: h.plant(f, tag=T)({"v": p}, 2.0, jnp.ones(3)))(p)
    allclose(g, 2 * np.array([1.0, 2.0, 3.0]))


# ---- custom_jvp / custom_vjp ----------------------------------------------------------

def _rule_sows(sown=lambda x: x * 2.0):
    """A custom_jvp function whose JVP rule (not its body) sows: the rule
    sows ``sown(x)`` (2x) and scales the tangent by the (possibly planted)
    sown value."""
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        s = h.sow(sown(x), tag=T, name="s")
        return jnp.sin(x), t * s

    return f, f_jvp


def test_sow_in_custom_jvp_rule_is_reaped_when_jax_differentiates_the_call():
    f, f_jvp = _rule_sows()
    (want_out, want_t) = f_jvp((2.0,), (1.0,))  # eager: the rule by hand (sow = identity)
    (out, reaps), (out_t, reaps_t) = jax.jvp(h.call_and_reap(f, tag=T), (2.0,), (1.0,))
    allclose(out, want_out)
    allclose(out_t, want_t)
    assert_tree_allclose(reaps, {"s": 4.0})  # what the rule sowed
    assert_tree_allclose(reaps_t, {"s": 0.0})  # a value sown in the rule is a constant
    # the same under jit, and with the jvp taken inside the reaped function
    (_, reaps), (_, reaps_t) = jax.jit(lambda x, t: jax.jvp(h.call_and_reap(f, tag=T), (x,),
                                                            (t,)))(2.0, 1.0)
    assert_tree_allclose((reaps, reaps_t), ({"s": 4.0}, {"s": 0.0}))
    assert_tree_allclose(h.reap(lambda x, t: jax.jvp(f, (x,), (t,)), tag=T)(2.0, 1.0),
                         {"s": 4.0})


def test_sow_in_custom_jvp_rule_with_array_constants_is_reaped():
    """A rule whose trace has constants (a NumPy array): JAX returns its jaxpr
    open with the constants apart (on JAX 0.12 as leading invars)."""
    w = np.array([1.0, 2.0], np.float32)
    f, _ = _rule_sows(lambda x: jnp.sum(x * w))
    (out, reaps), (out_t, _) = jax.jvp(h.call_and_reap(f, tag=T), (2.0,), (1.0,))
    allclose(out, np.sin(2.0))
    allclose(out_t, 6.0)  # eagerly: t * sum(x * w) = 1 * (2 + 4)
    assert_tree_allclose(reaps, {"s": 6.0})
    # looked into (not run) under vmap: the same rule, batched
    (out, reaps) = jax.vmap(h.call_and_reap(f, tag=T))(jnp.array([2.0, 3.0]))
    allclose(out, np.sin([2.0, 3.0]))
    assert reaps == {}


def test_sow_in_custom_jvp_rule_is_not_reaped_when_the_rule_does_not_run():
    f, _ = _rule_sows()
    out, reaps = h.call_and_reap(f, tag=T)(2.0)
    allclose(out, np.sin(2.0))
    assert reaps == {}  # as oryx: the rule never ran
    assert jax.jit(h.reap(f, tag=T))(2.0) == {}
    # differentiated outside a jit that holds the harvest: the rule runs
    # after the harvest returned, so the name is absent, and the derivative
    # is the rule's
    (out, reaps), (out_t, reaps_t) = jax.jvp(jax.jit(h.call_and_reap(f, tag=T)), (2.0,), (1.0,))
    assert reaps == {} and reaps_t == {}
    allclose(out_t, 4.0)  # t * s with s = 2x = 4


def test_sow_in_custom_jvp_rule_under_grad():
    f, f_jvp = _rule_sows()
    # grad linearizes: the rule runs, the reaped value has derivative zero
    def loss(x):
        out, reaps = h.call_and_reap(f, tag=T)(x)
        return out + reaps["s"]
    allclose(jax.grad(loss)(2.0), f_jvp((2.0,), (1.0,))[1])
    allclose(jax.value_and_grad(loss)(2.0)[0], np.sin(2.0) + 4.0)


def test_plant_into_custom_jvp_rule_when_differentiated():
    f, _ = _rule_sows()
    planted = lambda x: h.plant(f, tag=T)({"s": 10.0}, x)
    out, out_t = jax.jvp(planted, (2.0,), (1.0,))
    allclose(out, np.sin(2.0))
    allclose(out_t, 10.0)  # the rule's tangent uses the planted value
    allclose(jax.grad(planted)(2.0), 10.0)
    allclose(planted(2.0), np.sin(2.0))  # not differentiated: the rule never runs
    bad = lambda x: h.plant(f, tag=T)({"s": jnp.ones(2)}, x)
    raises(ValueError, r"^Planted value for 's' has type float32\[2\], but the sow at "
           r"custom_jvp\[rule\] has type float32\[\]", jax.grad(bad), 2.0)


def test_append_sow_in_custom_jvp_rule_is_a_clear_error():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (jnp.sin(p[0]),
                           t[0] * h.sow(p[0], tag=T, name="a", mode="append")))
    with pytest.raises(NotImplementedError, match=r"custom_jvp\[rule\].*'a'"):
        jax.jvp(h.call_and_reap(f, tag=T), (2.0,), (1.0,))
    jax_still_works()


@jax.custom_jvp
def _cjvp(x):
    return h.sow(jnp.sin(x), tag=T, name="s") * 2


@_cjvp.defjvp
def _cjvp_rule(primals, tangents):
    (x,), (t,) = primals, tangents
    h.sow(t * 3, tag=T, name="jvp_t")  # a tangent: linear, gone under grad (as in oryx)
    h.sow(jnp.cos(x), tag=T, name="jvp_x")  # a primal value
    return _cjvp(x), 10.0 * t  # deliberately not the true derivative


@jax.custom_vjp
def _cvjp(x):
    return h.sow(jnp.sin(x), tag=T, name="s") * 2


def _cvjp_fwd(x):
    return h.sow(jnp.sin(x) * 2, tag=T, name="fwd"), x


def _cvjp_bwd(x, g):
    return (h.sow(7.0 * g, tag=T, name="bwd"),)


_cvjp.defvjp(_cvjp_fwd, _cvjp_bwd)


@pytest.mark.parametrize("fn", [_cjvp, _cvjp], ids=["custom_jvp", "custom_vjp"])
def test_custom_rule_reap_and_rule_kept(fn):
    user_grad = 10.0 if fn is _cjvp else 7.0
    out, reaps = h.call_and_reap(fn, tag=T)(0.5)
    allclose(out, 2 * np.sin(0.5), rtol=1e-6)
    assert_tree_allclose(reaps, {"s": np.sin(0.5)})
    # user rule kept: the derivative of the reaped function's output
    allclose(jax.grad(lambda x: h.call_and_reap(fn, tag=T)(x)[0])(0.5), user_grad)
    allclose(jax.jit(jax.grad(lambda x: h.call_and_reap(fn, tag=T)(x)[0]))(0.5), user_grad)
    # plant: output is the planted value times 2; the rule still gives the gradient in x
    allclose(h.plant(fn, tag=T)({"s": 4.0}, 0.5), 8.0)
    allclose(jax.grad(lambda x: h.plant(fn, tag=T)({"s": 4.0}, x))(0.5), user_grad)
    # ... and the derivative w.r.t. the plant flows through the function body
    allclose(jax.grad(lambda p: h.plant(fn, tag=T)({"s": p}, 0.5))(4.0), 2.0)
    check(jax.make_jaxpr(h.reap(fn, tag=T))(0.5))


def test_custom_jvp_sows_in_jvp_rule_reaped():
    out, reaps = h.call_and_reap(lambda x: jax.jvp(_cjvp, (x,), (2.0,)), tag=T)(0.5)
    allclose(out[0], 2 * np.sin(0.5), rtol=1e-6)
    allclose(out[1], 20.0)
    assert_tree_allclose(reaps, {"jvp_t": 6.0, "jvp_x": np.cos(0.5), "s": np.sin(0.5)})
    out, reaps = h.call_and_reap(jax.grad(_cjvp), tag=T)(0.5)
    allclose(out, 10.0)
    # under grad the tangent sow is transposed away (oryx drops it too)
    assert_tree_allclose(reaps, {"jvp_x": np.cos(0.5), "s": np.sin(0.5)})


def test_custom_jvp_rule_sows_reaped_from_outside_primal_values_only():
    # jvp / grad of call_and_reap: the rule runs; its sow of a primal value
    # ("jvp_x") is reaped, its sow of a tangent ("jvp_t") is not (it would
    # make a primal output depend on the tangents, which reverse mode cannot
    # linearize); the function's own sow "s" is reaped as without the rule.
    (out, reaps), (out_t, reaps_t) = jax.jvp(h.call_and_reap(_cjvp, tag=T), (0.5,), (1.0,))
    allclose(out, 2 * np.sin(0.5), rtol=1e-6)
    allclose(out_t, 10.0)  # the user's rule
    assert_tree_allclose(reaps, {"jvp_x": np.cos(0.5), "s": np.sin(0.5)})
    assert_tree_allclose(reaps_t, {"jvp_x": 0.0, "s": np.cos(0.5)})
    loss = lambda x: (lambda o, r: o + r["jvp_x"] + r["s"])(*h.call_and_reap(_cjvp, tag=T)(x))
    allclose(jax.grad(loss)(0.5), 10.0 + 0.0 + np.cos(0.5), rtol=1e-6)


def test_custom_vjp_sows_in_fwd_and_bwd_reaped():
    out, reaps = h.call_and_reap(jax.grad(_cvjp), tag=T)(0.5)
    allclose(out, 7.0)
    assert_tree_allclose(reaps, {"fwd": 2 * np.sin(0.5), "bwd": 7.0})
    # through jax.vjp too
    def f(x):
        y, vjp = jax.vjp(_cvjp, x)
        return y, vjp(3.0)[0]
    (y, g), reaps = h.call_and_reap(f, tag=T)(0.5)
    allclose(g, 21.0)
    assert_tree_allclose(reaps, {"fwd": 2 * np.sin(0.5), "bwd": 21.0})


def test_unused_sow_in_a_custom_jvp_rule_is_reaped_from_a_function_with_state():
    # The state layer rewrites the custom_jvp (its rule runs in the
    # function's place, threaded); the rule's sow, whose result it does not
    # use, is still there for a harvest of the uncurried function.
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def _(p, t):
        h.sow(p[0] * 2.0, tag=T, name="r", mode="clobber")
        return jax.jvp(jnp.sin, p, t)

    def program(x):
        y = f(x)
        tx.set_state("y", y)
        return y

    one = np.float32(1.0)
    want = {"r": 2.0}  # eagerly: the rule runs once, sowing 2 * x
    assert_tree_allclose(jax.jvp(h.reap(f, tag=T), (one,), (one,))[0], want)
    pure, state0 = tx.uncurry(program, one)
    (out, reaps), (out_t, _) = jax.jvp(
        lambda x: h.call_and_reap(pure, tag=T)(state0, x), (one,), (one,))
    assert_tree_allclose(reaps, want)
    allclose(out[0], np.sin(1.0))
    allclose(out[1]["y"], np.sin(1.0))
    allclose(out_t[0], np.cos(1.0))
    g = jax.grad(lambda x: h.call_and_reap(pure, tag=T)(state0, x)[0][0])(one)
    allclose(g, np.cos(1.0))


def _counting_custom(kind: str):
    """sin as a custom_jvp or custom_vjp function that sows its value as
    "s" and adds 1 to the state "n"; its rule (custom_jvp) or fwd
    (custom_vjp) adds 1 to the state "k" before calling it."""
    def fn(x):
        tx.set_state("n", tx.get_state("n", np.int32(0)) + 1)
        return h.sow(jnp.sin(x), tag=T, name="s", mode="clobber")

    def bump():
        tx.set_state("k", tx.get_state("k", np.int32(0)) + 1)

    if kind == "custom_jvp":
        f = jax.custom_jvp(fn)

        @f.defjvp
        def _(p, t):
            bump()
            return jax.jvp(fn, p, t)
    else:
        f = jax.custom_vjp(fn)

        def fwd(x):
            bump()
            return fn(x), x

        f.defvjp(fwd, lambda x, ct: (jnp.cos(x) * ct,))
    return f


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_a_harvest_of_pure_keeps_the_state_effects_of_a_custom_rule(kind):
    # Differentiated from outside, a harvest of the uncurried function gives
    # the outputs of the rule that runs in the call's place (the state
    # rewrite threads the state through it), as pure alone does.
    f = _counting_custom(kind)

    def program(x):
        tx.set_state("k", tx.get_state("k", np.int32(0)) + 10)
        return f(x)

    one = np.float32(1.0)
    pure, state0 = tx.uncurry(program, one)
    # eagerly: the program adds 10, then the rule runs once, adds 1 and
    # calls the function, which adds 1 to "n"
    (out, fin), _ = jax.vjp(lambda x: pure(state0, x), one)
    assert (int(fin["k"]), int(fin["n"])) == (11, 1)
    ((out2, fin), reaps), _ = jax.vjp(lambda x: h.call_and_reap(pure, tag=T)(state0, x), one)
    assert (int(fin["k"]), int(fin["n"])) == (11, 1)
    assert_tree_allclose(reaps, {"s": np.sin(1.0)})
    allclose(out2, out)

    def loss(x):
        (out, fin), reaps = h.call_and_reap(pure, tag=T)(state0, x)
        return out + reaps["s"], fin

    (value, fin), g = jax.value_and_grad(loss, has_aux=True)(one)
    assert (int(fin["k"]), int(fin["n"])) == (11, 1)
    allclose(value, 2 * np.sin(1.0))
    allclose(g, 2 * np.cos(1.0))  # the function's sow is reaped with its derivative


def _fwd_sows():
    """A custom_vjp of sin whose fwd sows its residual, cos(x), as "r"
    (clobber); the bwd scales the cotangent by the residual it gets."""
    f = jax.custom_vjp(jnp.sin)
    f.defvjp(lambda x: (jnp.sin(x), h.sow(jnp.cos(x), tag=T, name="r", mode="clobber")),
             lambda r, ct: (r * ct,))
    return f


def test_sow_in_custom_vjp_fwd_is_reaped_and_planted_when_jax_differentiates_the_call():
    f, x = _fwd_sows(), 0.5
    # Differentiated from outside the harvest, the fwd runs in the call's
    # place: its sow is reaped (a constant w.r.t. x, as eagerly, where the
    # fwd sees primal values), as when the vjp is taken inside.
    (out, reaps), vjp = jax.vjp(h.call_and_reap(f, tag=T), x)
    allclose(out, np.sin(x))
    assert_tree_allclose(reaps, {"r": np.cos(x)})
    allclose(vjp((1.0, {"r": 1.0}))[0], np.cos(x))
    assert_tree_allclose(h.reap(lambda x: jax.vjp(f, x)[0], tag=T)(x), {"r": np.cos(x)})

    def loss(x):
        out, reaps = h.call_and_reap(f, tag=T)(x)
        return out + reaps["r"]

    for grad in (jax.value_and_grad(loss), jax.jit(jax.value_and_grad(loss))):
        value, g = grad(x)
        allclose(value, np.sin(x) + np.cos(x))
        allclose(g, np.cos(x))
    # Not differentiated, the fwd does not run: the name is absent.
    assert h.reap(f, tag=T)(x) == {}
    # A plant replaces the fwd's residual, so the bwd scales by it.
    planted = lambda x: h.plant(f, tag=T)({"r": 3.0}, x)
    allclose(planted(x), np.sin(x))
    allclose(jax.grad(planted)(x), 3.0)
    allclose(jax.jit(jax.grad(planted))(x), 3.0)
    check(jax.make_jaxpr(jax.grad(planted))(x))


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_append_sow_in_custom_rule_function(kind):
    body = lambda x: h.sow(x * 2, tag=T, name="a", mode="append") + 1
    if kind == "custom_jvp":
        fn = jax.custom_jvp(body)
        fn.defjvp(lambda p, t: (fn(p[0]), t[0]))
    else:
        fn = jax.custom_vjp(body)
        fn.defvjp(lambda x: (fn(x), None), lambda _, g: (g,))
    # eager: the body runs once, sowing 1.0 * 2 in append mode
    assert_tree_allclose(h.reap(fn, tag=T)(1.0), {"a": np.array([2.0])})
    allclose(h.plant(fn, tag=T)({"a": jnp.array([5.0])}, 1.0), 6.0)


def test_custom_vjp_in_scan_reap():
    def f(xs):
        def body(c, x):
            return c + _cvjp(x), None
        return jax.lax.scan(body, 0.0, xs)[0]

    xs = jnp.array([0.1, 0.2])
    with pytest.raises(ValueError, match="Cannot use strict mode for 's' inside `scan`."):
        h.reap(f, tag=T)(xs)
    jax_still_works()


# ---- checkpoint ----------------------------------------------------------------------

def _ckpt(x):
    return jax.checkpoint(lambda x: jnp.sin(h.sow(x * x, tag=T, name="sq")) * 2)(x)


def test_checkpoint_reap_and_plant():
    out, reaps = h.call_and_reap(_ckpt, tag=T)(1.5)
    allclose(out, 2 * np.sin(2.25), rtol=1e-6)
    assert_tree_allclose(reaps, {"sq": 2.25})
    allclose(h.plant(_ckpt, tag=T)({"sq": 0.5}, 1.5), 2 * np.sin(0.5), rtol=1e-6)


def test_checkpoint_under_grad():
    # reap of a function that differentiates through checkpoint
    out, reaps = h.call_and_reap(jax.grad(_ckpt), tag=T)(1.5)
    allclose(out, 2 * np.cos(2.25) * 3.0, rtol=1e-6)
    assert_tree_allclose(reaps, {"sq": 2.25})
    # grad of the reaped output / of the plant
    allclose(jax.grad(lambda x: h.call_and_reap(_ckpt, tag=T)(x)[0])(1.5),
             2 * np.cos(2.25) * 3.0, rtol=1e-6)
    allclose(jax.grad(lambda x: h.reap(_ckpt, tag=T)(x)["sq"])(1.5), 3.0)
    allclose(jax.grad(lambda p: h.plant(_ckpt, tag=T)({"sq": p}, 1.5))(0.5), 2 * np.cos(0.5),
             rtol=1e-6)


def test_nested_checkpoint_in_scan():
    def f(xs):
        def body(c, x):
            inner = jax.checkpoint(lambda c, x: c + h.sow(jnp.sin(x) * c, tag=T, name="v",
                                                        mode="append"))
            return jax.checkpoint(inner)(c, x), None
        return jax.lax.scan(body, 1.0, xs)[0]

    xs = jnp.array([0.1, 0.2, 0.3])
    c, vs = 1.0, []
    for x in np.asarray(xs):
        vs.append(np.sin(x) * c)
        c = c + vs[-1]
    out, reaps = h.call_and_reap(f, tag=T)(xs)
    allclose(out, c, rtol=1e-6)
    assert_tree_allclose(reaps, {"v": np.array(vs)})
    gr = jax.grad(lambda xs: h.reap(f, tag=T)(xs)["v"].sum())(xs)
    allclose(gr, jax.grad(f)(xs), rtol=1e-6)  # sum(v) = out - 1
    p = jnp.array([1.0, 2.0, 3.0])
    allclose(h.plant(f, tag=T)({"v": p}, xs), 7.0)
    gp = jax.grad(lambda p: h.plant(f, tag=T)({"v": p}, xs))(p)
    allclose(gp, np.ones(3))
    check(jax.make_jaxpr(h.reap(f, tag=T))(xs))
    check(jax.make_jaxpr(jax.grad(lambda xs: h.reap(f, tag=T)(xs)["v"].sum()))(xs))


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


def test_plant_append_shape_checked():
    f = lambda x: jax.lax.scan(lambda c, xi: (c + h.sow(xi, tag=T, name="v", mode="append"),
                                               None), x, jnp.arange(3.0))[0]
    msg = (r"^Planted value for 'v' has type {}, but its append sows \(at scan\[length=3\]\) "
           r"stack to float32\[3\];")
    raises(ValueError, msg.format(r"float32\[2\]"), h.plant(f, tag=T), {"v": jnp.ones(2)}, 0.0)
    raises(ValueError, msg.format(r"float32\[3, 2\]"), h.plant(f, tag=T), {"v": jnp.ones((3, 2))},
           0.0)
    raises(ValueError, msg.format(r"int32\[3\]"), h.plant(f, tag=T),
           {"v": jnp.ones(3, jnp.int32)}, 0.0)


def test_plant_append_leading_size_checked():
    f = lambda x: jax.lax.scan(lambda c, xi: (c + h.sow(xi, tag=T, name="v", mode="append"),
                                               None), x, jnp.arange(3.0))[0]
    raises(ValueError, r"^Planted value for 'v' has type float32\[4\], but its append sows \(at "
           r"scan\[length=3\]\) stack to float32\[3\];", h.plant(f, tag=T), {"v": jnp.ones(4)},
           0.0)
    g = _twice("append")  # two sows at the top level: a stack of 2 rows
    msg = (r"^Planted value for 'x' has type float32\[{}, 2\], but its append sows \(at "
           r"<top level>\) stack to float32\[2, 2\];")
    raises(ValueError, msg.format(1), h.plant(g, tag=T), {"x": jnp.ones((1, 2))}, jnp.ones(2))
    raises(ValueError, msg.format(3), h.plant(g, tag=T), {"x": jnp.ones((3, 2))}, jnp.ones(2))


def _layers(x, ws):
    """A scan over layers whose activations are append sows."""
    def layer(x, w):
        a = h.sow(jnp.tanh(w * x), tag=T, name="act", mode="append")
        return a, a
    return jax.lax.scan(layer, x, ws)


def _layers_eager(x, ws, patch: dict):
    acts = []
    for i, w in enumerate(np.asarray(ws)):
        x = patch.get(i, np.tanh(w * x))
        acts.append(x)
    return x, np.stack(acts)


def test_rows_plant_overrides_only_selected_iterations():
    x, ws = jnp.array([0.3, -0.2]), jnp.array([1.0, 2.0, -1.5, 0.5])
    for patch in ({1: np.array([1.0, 0.0])}, {0: np.zeros(2), 3: np.ones(2)},
                  {-1: np.full(2, 0.5)}):
        want = _layers_eager(np.asarray(x), ws, {i % 4: v for i, v in patch.items()})
        got = h.plant(_layers, tag=T)({"act": h.rows(patch)}, x, ws)
        assert_tree_allclose(got, want)
        got = jax.jit(h.plant(_layers, tag=T))({"act": h.rows(patch)}, x, ws)
        assert_tree_allclose(got, want)
    # no rows: the program unchanged
    assert_tree_allclose(h.plant(_layers, tag=T)({"act": h.rows({})}, x, ws),
                         _layers_eager(np.asarray(x), ws, {}))


def test_rows_plant_with_a_traced_mask():
    x, ws = jnp.array([0.3, -0.2]), jnp.array([1.0, 2.0, -1.5])
    stack = jnp.arange(6.0).reshape(3, 2)
    mask = jnp.array([False, True, False])
    want = _layers_eager(np.asarray(x), ws, {1: np.asarray(stack[1])})
    run = jax.jit(lambda m, v: h.plant(_layers, tag=T)({"act": h.rows(mask=m, values=v)}, x, ws))
    assert_tree_allclose(run(mask, stack), want)
    # differentiable with respect to the planted rows (and only those rows matter)
    g = jax.grad(lambda v: run(mask, v)[0].sum())(stack)
    eps = 1e-3
    num = (run(mask, stack.at[1, 0].add(eps))[0].sum()
           - run(mask, stack.at[1, 0].add(-eps))[0].sum()) / (2 * eps)
    allclose(g[1, 0], num, rtol=1e-2)
    allclose(g[0], [0.0, 0.0])
    allclose(g[2], [0.0, 0.0])


def test_rows_plant_inside_reap_and_with_nest():
    x, ws = jnp.array([0.3, -0.2]), jnp.array([1.0, 2.0, -1.5])
    want_out, want_acts = _layers_eager(np.asarray(x), ws, {1: np.ones(2)})
    # an outer reap sees the activations after the patch (another name's sows
    # stay; the planted one is consumed, so reap a second sow of the result)
    def model(x, ws):
        out, acts = h.plant(_layers, tag=T)({"act": h.rows({1: jnp.ones(2)})}, x, ws)
        return h.sow(acts, tag=T, name="seen")
    assert_tree_allclose(h.reap(model, tag=T)(x, ws), {"seen": want_acts})
    nested = h.nest(_layers, scope="m")
    assert_tree_allclose(h.plant(nested, tag=T)({"m": {"act": h.rows({1: jnp.ones(2)})}}, x, ws),
                         (want_out, want_acts))


def test_rows_plant_errors():
    x, ws = jnp.array([0.3, -0.2]), jnp.array([1.0, 2.0, -1.5])
    p = h.plant(_layers, tag=T)
    raises(ValueError, r"'act'.*row 3 is out of range.*3 rows", p, {"act": h.rows({3: jnp.ones(2)})},
           x, ws)
    raises(ValueError, r"'act'.*float32\[3\]", p, {"act": h.rows({0: jnp.ones(3)})}, x, ws)
    raises(ValueError, r"rows\(mask=\.\.\.\) for 'act'.*bool\[3\]", p,
           {"act": h.rows(mask=jnp.ones(2, bool), values=jnp.ones((3, 2)))}, x, ws)
    raises(ValueError, r"rows\(\.\.\.\) planted for 'a'.*'strict' mode", h.plant(_basic, tag=T),
           {"a": h.rows({0: 1.0})}, 3.0)
    with pytest.raises(TypeError, match="either"):
        h.rows({0: 1.0}, mask=jnp.ones(1, bool))
    with pytest.raises(TypeError, match="int row"):
        h.rows({"0": 1.0})


def test_plant_append_inside_scan():
    xs = jnp.arange(4.0)
    (c, ys) = h.plant(_scan_fn, tag=T)({"y": jnp.array([10.0, 20.0, 30.0, 40.0])}, 2.0, xs)
    allclose(ys, [10.0, 20.0, 30.0, 40.0])
    allclose(c, 6.0)
    # with reverse: the plant is aligned with xs too
    (c, ys) = h.plant(functools.partial(_scan_fn, reverse=True), tag=T)(
        {"y": jnp.array([10.0, 20.0, 30.0, 40.0])}, 2.0, xs)
    allclose(ys, [10.0, 20.0, 30.0, 40.0])
    # per-iteration values feed the carry
    def g(x):
        def body(c, xi):
            return c + h.sow(c * xi, tag=T, name="v", mode="append"), None
        return jax.lax.scan(body, x, jnp.ones(3))[0]
    allclose(h.plant(g, tag=T)({"v": jnp.array([1.0, 2.0, 4.0])}, 5.0), 12.0)


def test_plant_append_nested_scans():
    def f(x):
        def outer(c, _):
            def inner(c2, _):
                return c2 + h.sow(c2, tag=T, name="v", mode="append"), None
            return jax.lax.scan(inner, c, None, length=3)[0], None
        return jax.lax.scan(outer, x, None, length=2)[0]

    p = jnp.arange(6.0).reshape(2, 3)
    allclose(h.plant(f, tag=T)({"v": p}, 1.0), 1.0 + 15.0)
    out, reaps = h.harvest(f, tag=T)({}, 1.0)
    allclose(out, 64.0)
    allclose(reaps["v"], [[1, 2, 4], [8, 16, 32.0]])


def _sm_mesh():
    return cpu_mesh("x")


def test_shard_map_replicated_sow():
    def body(x):
        total = h.sow(jax.lax.psum(jnp.sum(x), "x"), tag=T, name="total")
        return x * 2 + total

    f = shard_map()(body, mesh=_sm_mesh(), in_specs=P("x"), out_specs=P("x"))
    x = jnp.arange(8.0)
    out, reaps = h.call_and_reap(f, tag=T)(x)
    allclose(out, np.arange(8.0) * 2 + 28.0)
    assert_tree_allclose(reaps, {"total": 28.0})
    out, reaps = jax.jit(h.call_and_reap(f, tag=T))(x)
    assert_tree_allclose(reaps, {"total": 28.0})
    allclose(h.plant(f, tag=T)({"total": 100.0}, x), np.arange(8.0) * 2 + 100.0)
    check(jax.make_jaxpr(h.reap(f, tag=T))(x))


def test_shard_map_with_scan_inside_and_outside():
    def body(x):
        def sb(c, xi):
            return c + h.sow(jax.lax.psum(xi, "x"), tag=T, name="s", mode="clobber"), None
        return x + jax.lax.scan(sb, 0.0, x)[0]

    f = shard_map()(body, mesh=_sm_mesh(), in_specs=P("x"), out_specs=P("x"))
    # shard k holds [2k, 2k+1]: the psums are 0+2+4+6 = 12 then 1+3+5+7 = 16
    out, reaps = h.call_and_reap(f, tag=T)(jnp.arange(8.0))
    allclose(out, np.arange(8.0) + 28.0)
    assert_tree_allclose(reaps, {"s": 16.0})

    def outer(xs):
        g = shard_map()(lambda v: v + h.sow(jax.lax.psum(jnp.sum(v), "x"), tag=T, name="s",
                                            mode="clobber"),
                        mesh=_sm_mesh(), in_specs=P("x"), out_specs=P("x"))
        return jax.lax.scan(lambda c, x: (c + g(x).sum(), None), 0.0, xs)[0]

    xs = jnp.stack([jnp.ones(8), 2 * jnp.ones(8)])
    out, reaps = h.call_and_reap(outer, tag=T)(xs)
    allclose(out, 8 * (1 + 8) + 8 * (2 + 16))
    assert_tree_allclose(reaps, {"s": 16.0})


def test_shard_map_grad_of_reaped_value():
    f = shard_map()(lambda x: x * 2 + h.sow(jax.lax.psum(jnp.sum(x ** 2), "x"), tag=T, name="s"),
                    mesh=_sm_mesh(), in_specs=P("x"), out_specs=P("x"))
    g = jax.grad(lambda x: h.reap(f, tag=T)(x)["s"])(jnp.arange(8.0))
    allclose(g, 2 * np.arange(8.0))


def test_shard_map_plant_into_varying_sow():
    f = shard_map()(lambda x: x + h.sow(jnp.sum(x), tag=T, name="s"), mesh=_sm_mesh(),
                    in_specs=P("x"), out_specs=P("x"))
    # the planted value is the same on every shard: each shard adds 5
    allclose(h.plant(f, tag=T)({"s": 5.0}, jnp.arange(8.0)), np.arange(8.0) + 5.0)
    allclose(jax.jit(h.plant(f, tag=T))({"s": 5.0}, jnp.arange(8.0)), np.arange(8.0) + 5.0)


def test_shard_map_varying_sow_is_clear_error():
    f = shard_map()(lambda x: x + h.sow(jnp.sum(x), tag=T, name="s"), mesh=_sm_mesh(),
                    in_specs=P("x"), out_specs=P("x"))
    raises(ValueError, "'s'.*shard_map", h.reap(f, tag=T), jnp.arange(8.0))


def test_shard_map_append_sow_of_replicated_value_works_varying_is_an_error():
    f = shard_map()(lambda x: x + h.sow(jax.lax.psum(jnp.sum(x), "x"), tag=T, name="s",
                                        mode="append"),
                    mesh=_sm_mesh(), in_specs=P("x"), out_specs=P("x"))
    assert_tree_allclose(h.reap(f, tag=T)(jnp.arange(8.0)), {"s": np.array([28.0])})
    allclose(h.plant(f, tag=T)({"s": jnp.array([1.0])}, jnp.arange(8.0)), np.arange(8.0) + 1)
    g = shard_map()(lambda x: x + h.sow(jnp.sum(x), tag=T, name="s", mode="append"),
                    mesh=_sm_mesh(), in_specs=P("x"), out_specs=P("x"))
    raises(ValueError, "'s'.*shard_map", h.reap(g, tag=T), jnp.arange(8.0))


def test_shard_map_sow_never_silently_ignored():
    f = shard_map()(lambda x: x + h.sow(jax.lax.psum(jnp.sum(x), "x"), tag=T, name="s",
                                        mode="append"),
                    mesh=_sm_mesh(), in_specs=P("x"), out_specs=P("x"))
    # reaped (one sow: one row holding the psum, 0 + 1 + ... + 7), and the
    # sow is gone from the reaped program rather than left unreaped
    assert_tree_allclose(h.reap(f, tag=T)(jnp.arange(8.0)), {"s": np.array([28.0])})
    closed = jax.make_jaxpr(h.reap(f, tag=T))(jnp.arange(8.0))
    assert not [e for e, _ in _traverse.iter_eqns(closed) if e.primitive is h.sow_p]


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


# ---- cost: linear in nesting depth (no timing: just that it is quick) --------------------

def test_deep_nesting_jaxpr_size_linear():
    sizes = [len(all_prims(jax.make_jaxpr(h.reap(_deep(d), tag=T))(0.0))) for d in (4, 8)]
    assert sizes[1] <= 2.5 * sizes[0], sizes


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_append_sow_in_custom_rule_function_reap_plant_and_grads(kind):
    body = lambda x: h.sow(x * 2, tag=T, name="a", mode="append") + 1
    if kind == "custom_jvp":
        fn = jax.custom_jvp(body)
        fn.defjvp(lambda p, t: (fn(p[0]), t[0] * 7))
    else:
        fn = jax.custom_vjp(body)
        fn.defvjp(lambda x: (fn(x), None), lambda _, g: (g * 7,))
    assert_tree_allclose(h.reap(fn, tag=T)(1.0), {"a": np.array([2.0])})
    allclose(h.plant(fn, tag=T)({"a": jnp.array([5.0])}, 1.0), 6.0)
    # the output keeps the user's rule; the reaped value has its own derivative
    allclose(jax.grad(lambda x: h.call_and_reap(fn, tag=T)(x)[0])(1.0), 7.0)
    allclose(jax.grad(lambda x: h.call_and_reap(fn, tag=T)(x)[1]["a"].sum())(1.0), 2.0)
    allclose(jax.grad(lambda p: h.plant(fn, tag=T)({"a": p}, 1.0))(jnp.array([5.0])), [1.0])


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "jacrev", "jit_grad"])
def test_plant_into_a_custom_jvp_whose_rule_is_its_jvp_differentiates_the_planted_function(
        transform):
    # The rule (the JVP of the function, so it sows too) is planted too: it
    # must not add the tangent of the replaced value.
    def body(x, y):
        return h.sow(x * 3.0, tag=T, name="c0", mode="clobber") + y, y

    fn = jax.custom_jvp(body)
    fn.defjvp(lambda p, t: jax.jvp(body, p, t))
    planted = lambda c, x, y: h.plant(fn, tag=T)({"c0": c}, x, y)[0]  # noqa: E731
    eager = lambda c, x, y: c + y  # noqa: E731 - the sow's value replaced by c
    args = (jnp.float32(2.0), jnp.float32(3.0), jnp.float32(4.0))
    if transform == "jvp":
        for t in np.eye(3, dtype=np.float32):
            allclose(jax.jvp(planted, args, tuple(t))[1], jax.jvp(eager, args, tuple(t))[1])
        return
    d = {"jacfwd": jax.jacfwd, "jacrev": jax.jacrev,
         "jit_grad": lambda f, argnums: jax.jit(jax.grad(f, argnums=argnums))}[transform]
    assert_tree_allclose(d(planted, argnums=(0, 1, 2))(*args), (1.0, 0.0, 1.0))
    assert_tree_allclose(d(eager, argnums=(0, 1, 2))(*args), (1.0, 0.0, 1.0))


def test_plant_in_a_custom_vjp_whose_bwd_recomputes_is_planted_in_the_recomputation():
    # The bwd runs the function again (jax.vjp of it): the recomputation sees
    # the planted value too, so the output depends on the plant, not on x.
    def g(x):
        return h.sow(x * 1.0, tag="rv", name="c1", mode="clobber")

    g_vjp = jax.custom_vjp(g)
    g_vjp.defvjp(lambda x: (g(x), x), lambda x, ct: jax.vjp(g, x)[1](ct))

    def f(x):
        return g_vjp(g_vjp(x) * 3.0) * 2.0

    planted = lambda c1, x: h.plant(f, tag="rv")({"c1": c1}, x)  # noqa: E731
    assert float(planted(5.0, 1.0)) == 10.0
    d_c1, d_x = jax.grad(planted, argnums=(0, 1))(5.0, 1.0)
    # By hand: f = 2 * c1 whatever x is.
    assert float(d_c1) == 2.0 and float(d_x) == 0.0


def test_a_recomputing_custom_vjp_that_sows_in_a_branch_under_grad_is_reaped():
    def sow(x):
        return h.sow(x, tag=T, name="c", mode="clobber")

    def fn(x):
        return sow(jnp.sin(x))

    f = jax.custom_vjp(fn)
    f.defvjp(lambda x: (fn(x), x), lambda x, ct: jax.vjp(fn, x)[1](ct))

    def program(x):
        return jax.lax.cond(x > 0.3, sow, f, x)

    # The taken branch's value, once (the bwd's recomputation is not reaped).
    for x, want, grad in ((0.5, 0.5, 1.0), (0.1, np.sin(0.1), np.cos(0.1))):
        x = np.float32(x)
        allclose(h.reap(program, tag=T)(x)["c"], want)
        (g, reaps) = h.call_and_reap(jax.grad(program), tag=T)(x)
        allclose(reaps["c"], want)
        allclose(g, grad)


def test_a_strict_sow_in_a_recomputing_custom_vjp_under_grad_is_reaped():
    def fn(x):
        return h.sow(jnp.sin(x), tag=T, name="c", mode="strict") * 2.0

    f = jax.custom_vjp(fn)
    f.defvjp(lambda x: (fn(x), x), lambda x, ct: jax.vjp(fn, x)[1](ct))
    x = np.float32(0.5)
    assert float(h.reap(f, tag=T)(x)["c"]) == float(jnp.sin(x))
    g, reaps = h.call_and_reap(jax.grad(f), tag=T)(x)
    assert float(reaps["c"]) == float(jnp.sin(x))  # once: the recomputation is not reaped
    allclose(g, 2 * np.cos(x))


def test_plant_through_a_recomputing_bwd_under_jit_and_vmap_of_grad():
    # The replayed bwd is traced with the values JAX passes: tracers under
    # jit and vmap. Reference by hand: f = 2 * c1 * x0 ** 0 (x does not matter).
    def g(x):
        return h.sow(x * 1.0, tag="rj", name="c1", mode="clobber")

    g_vjp = jax.custom_vjp(g)
    g_vjp.defvjp(lambda x: (g(x), x), lambda x, ct: jax.vjp(g, x)[1](ct))

    def planted(c1, x):
        return h.plant(lambda y: g_vjp(g_vjp(y) * 3.0) * 2.0, tag="rj")({"c1": c1}, x)

    grad = jax.jit(jax.vmap(jax.grad(planted, argnums=(0, 1))))
    c1s, xs = jnp.array([5.0, -1.0]), jnp.array([1.0, 4.0])
    for _ in range(2):
        d_c1, d_x = grad(c1s, xs)
        assert [float(v) for v in d_c1] == [2.0, 2.0]
        assert [float(v) for v in d_x] == [0.0, 0.0]


# ---- perturb: gradients with respect to sown values ---------------------------------------

def _mlp_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (3, 4)) * 0.5, "w2": jax.random.normal(k2, (4, 2)) * 0.5}


def _mlp_loss(params, x):
    hidden = h.sow(jnp.tanh(x @ params["w1"]), tag="act", name="hidden")
    out = h.sow(hidden @ params["w2"], tag="act", name="out")
    return jnp.sum(out ** 2)


def _mlp_loss_by_hand(params, x, d_hidden, d_out):
    # The same MLP with the perturbations written in.
    hidden = jnp.tanh(x @ params["w1"]) + d_hidden
    out = hidden @ params["w2"] + d_out
    return jnp.sum(out ** 2)


def test_perturb_gives_the_gradient_wrt_sown_activations_in_one_backward_pass():
    params, x = _mlp_params(), jnp.array([[0.5, -1.0, 2.0], [1.0, 0.0, -0.5]])
    zeros = jax.tree.map(jnp.zeros_like, h.reap(_mlp_loss, tag="act")(params, x))
    assert set(zeros) == {"hidden", "out"}
    loss, (d_acts, d_params) = jax.jit(jax.value_and_grad(
        h.perturb(_mlp_loss, tag="act"), argnums=(0, 1)))(zeros, params, x)
    want = jax.grad(_mlp_loss_by_hand, argnums=(0, 2, 3))(
        params, x, zeros["hidden"], zeros["out"])
    np.testing.assert_allclose(loss, _mlp_loss(params, x), rtol=1e-6)
    np.testing.assert_allclose(d_acts["hidden"], want[1], rtol=1e-5)
    np.testing.assert_allclose(d_acts["out"], want[2], rtol=1e-5)
    # The sown values keep their derivative: the parameters' gradient is f's.
    for k in params:
        np.testing.assert_allclose(d_params[k], want[0][k], rtol=1e-5)
    # d loss / d out = 2 out, by hand; and a central finite difference for one entry.
    out = jnp.tanh(x @ params["w1"]) @ params["w2"]
    np.testing.assert_allclose(d_acts["out"], 2 * out, rtol=1e-5)
    eps = 1e-2
    bump = zeros["hidden"].at[0, 1].set(eps)
    fd = (_mlp_loss_by_hand(params, x, bump, zeros["out"])
          - _mlp_loss_by_hand(params, x, -bump, zeros["out"])) / (2 * eps)
    np.testing.assert_allclose(d_acts["hidden"][0, 1], fd, rtol=1e-3)


def test_perturb_equals_plant_and_differentiate():
    params, x = _mlp_params(), jnp.ones((1, 3))
    acts = h.reap(_mlp_loss, tag="act")(params, x)
    d_perturb = jax.grad(h.perturb(_mlp_loss, tag="act"))(
        jax.tree.map(jnp.zeros_like, acts), params, x)
    # Planting the sown value itself, differentiated w.r.t. the planted
    # value: only the output's direct dependence, as plant's derivative rule says.
    d_plant = jax.grad(lambda a: h.plant(_mlp_loss, tag="act", allowlist=["out"])(
        a, params, x))({"out": acts["out"]})
    np.testing.assert_allclose(d_perturb["out"], d_plant["out"], rtol=1e-6)


def test_perturb_of_append_sows_in_scan_is_one_row_per_iteration():
    def f(xs):
        def body(c, x):
            y = h.sow(jnp.tanh(c * x), tag="s", name="y", mode="append")
            return c + y, None
        return jax.lax.scan(body, 1.0, xs)[0]

    def by_hand(xs, deltas):  # the Python loop with the perturbations added
        c = 1.0
        for x, d in zip(xs, deltas):
            c = c + jnp.tanh(c * x) + d
        return c

    xs = jnp.array([1.0, 2.0, 0.5])
    zeros = {"y": jnp.zeros(3)}
    d_rows, d_xs = jax.grad(h.perturb(f, tag="s"), argnums=(0, 1))(zeros, xs)
    want_rows, want_xs = jax.grad(by_hand, argnums=(1, 0))(xs, jnp.zeros(3))
    np.testing.assert_allclose(d_rows["y"], want_rows, rtol=1e-5)
    np.testing.assert_allclose(d_xs, want_xs, rtol=1e-5)
    # A nonzero perturbation changes the value as the loop says.
    deltas = jnp.array([0.1, -0.2, 0.3])
    np.testing.assert_allclose(h.perturb(f, tag="s")({"y": deltas}, xs), by_hand(xs, deltas),
                               rtol=1e-6)


def test_perturb_under_vmap_per_example():
    params = _mlp_params()
    xs = jnp.arange(6.0).reshape(2, 1, 3) / 6.0
    zeros = jax.tree.map(jnp.zeros_like, h.reap(_mlp_loss, tag="act")(params, xs[0]))
    grads = jax.vmap(jax.grad(h.perturb(_mlp_loss, tag="act")), in_axes=(None, None, 0))(
        zeros, params, xs)
    for i in range(2):
        want = jax.grad(_mlp_loss_by_hand, argnums=(2, 3))(params, xs[i], zeros["hidden"],
                                                             zeros["out"])
        np.testing.assert_allclose(grads["hidden"][i], want[0], rtol=1e-5)
        np.testing.assert_allclose(grads["out"][i], want[1], rtol=1e-5)


def test_perturb_errors_name_the_sow():
    params, x = _mlp_params(), jnp.ones((1, 3))
    raises(ValueError, r"^Perturbation for 'out' has type float32\[5\], but the sow at "
           r"<top level> has type float32\[1, 2\]", h.perturb(_mlp_loss, tag="act"),
           {"out": jnp.zeros(5)}, params, x)
    raises(ValueError, r"rows\(\.\.\.\) given as the perturbation of 'out'",
           h.perturb(_mlp_loss, tag="act"), {"out": h.rows({0: jnp.zeros(2)})}, params, x)
    assert list(inspect.signature(h.perturb(_mlp_loss, tag="act")).parameters) == [
        "perturbations", "params", "x"]

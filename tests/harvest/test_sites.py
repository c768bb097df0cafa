"""taxpr.harvest._sites: reap and plant through jit, loops, cond, vmap, grad, shard_map."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from taxpr import harvest as h
from taxpr import _traverse

from helpers import check, cpu_mesh, shard_map
from harvest_helpers import (T, all_prims, allclose, assert_tree_allclose, raises, _basic,
                             _scan_eager, _scan_fn, _switch, _while)


def top_prims(closed) -> list[str]:
    j = closed.jaxpr if hasattr(closed, "jaxpr") else closed
    return [e.primitive.name for e in j.eqns]


def checked_jaxpr(fn, *args):
    """make_jaxpr(fn)(*args), checked with core.check_jaxpr."""
    closed = jax.make_jaxpr(fn)(*args)
    check(closed)
    return closed


# ---- append sows in sub-jaxprs (jit, checkpoint, scan bodies) -------------------------

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


# ---- scan --------------------------------------------------------------------------

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

def test_while_clobber():
    out, reaps = h.call_and_reap(_while, tag=T)(1.0, 3)
    allclose(out, 8.0)
    assert_tree_allclose(reaps, {"v": 8.0})


def test_while_never_runs_reaps_zeros():
    out, reaps = h.call_and_reap(_while, tag=T)(jnp.full(2, 5.0), 0)
    allclose(out, [5.0, 5.0])
    assert_tree_allclose(reaps, {"v": np.zeros(2)})


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
    i, val, val2 = 0, 0.0, 0.0
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


# ---- shard_map ------------------------------------------------------------------------

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


# ---- cost: linear in nesting depth (no timing: just that it is quick) --------------------

def test_deep_nesting_jaxpr_size_linear():
    sizes = [len(all_prims(jax.make_jaxpr(h.reap(_deep(d), tag=T))(0.0))) for d in (4, 8)]
    assert sizes[1] <= 2.5 * sizes[0], sizes

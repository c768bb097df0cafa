"""Finding and removing tags: iter_tags, find_tags, dissolve_tags."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core
from jax.core import ShapedArray
from jax.extend.core import jaxpr_as_fun
from jax.sharding import PartitionSpec as P

import taxpr as tx
from helpers import (MERGED_JAXPR, all_effects, check, closed_call, cpu_devices, cpu_mesh,
                     shard_map)

X = jnp.linspace(-1.0, 1.0, 4)


def tg(x, name, **kw):
    return tx.tag(x, op=name, **kw)


# ---- programs with tags in every kind of nested jaxpr ------------------------------------

def p_straight(x):
    y = tg(x, "a") * 2
    return tg(jnp.sin(y), "b")


@jax.jit
def f(x):  # the name shows up in the path: jit[f]
    return jax.lax.scan(lambda c, _: (tg(c, "s") + 1, None), x, None, length=5)[0]


def p_jit_scan(x):
    return f(tg(x, "pre")) * 2


def p_scan_reverse(x):
    return jax.lax.scan(lambda c, x: (tg(c, "s") + x, c), 0.0, x, reverse=True)


def p_while(x):
    def cond(c):
        return tg(c, "cond")[0] < 3.0

    def body(c):
        return tg(c, "body") + 1.0

    return jax.lax.while_loop(cond, body, x)


def p_fori(x):
    return jax.lax.fori_loop(0, 3, lambda i, c: tg(c, "fori") * 1.5, x)


def p_cond(x):
    return jax.lax.cond(x[0] > 0, lambda x: tg(x, "true") * 2, lambda x: tg(x, "false") - 1, x)


def _branch(i):
    return lambda x: tg(x, f"b{i}") + i


def p_switch(x):
    idx = jnp.clip(jnp.sum(x > 0), 0, 2)
    return jax.lax.switch(idx, [_branch(i) for i in range(3)], x)


@jax.custom_jvp
def cj(x):
    return tg(jnp.sin(x), "cj")


cj.defjvp(lambda p, t: (cj(p[0]), jnp.cos(p[0]) * t[0]))


def p_custom_jvp(x):
    return cj(x) * 2


@jax.custom_vjp
def cv(x):
    return tg(jnp.sin(x), "cv")


cv.defvjp(lambda x: (cv(x), x), lambda r, g: (g * jnp.cos(r),))


def p_custom_vjp(x):
    return cv(x) + 1


def p_checkpoint(x):
    return jax.checkpoint(lambda x: tg(jnp.sin(x), "ck") * 2)(x)


def p_shard_map(x):
    mesh = cpu_mesh("i")
    return shard_map()(lambda y: tg(y, "sm") * 2, mesh=mesh, in_specs=P("i"),
                       out_specs=P("i"))(x)


_INNER = None


def _inner():
    global _INNER
    if _INNER is None:
        _INNER = jax.make_jaxpr(lambda y: tg(y, "cc") + 1)(X)
    return _INNER


def p_closed_call(x):
    (out,) = closed_call(_inner(), x)
    return out * 3


def p_linear_solve(x):
    a = jnp.eye(4) * 2.0 + 0.1

    def matvec(v):
        return tg(a @ v, "matvec")

    def solve(mv, b):
        return tg(jnp.linalg.solve(a, b), "solve")

    return jax.lax.custom_linear_solve(matvec, x, solve, symmetric=True)


def p_pmap(x):
    return jax.pmap(lambda y: tg(y, "pm") * 2, devices=cpu_devices(4))(x)


def p_nested(x):
    def body(c, _):
        c = jax.lax.cond(c[0] > 0, lambda c: tg(c, "deep") * 0.5, lambda c: c + 1, c)
        return c, None

    g = jax.jit(lambda x: jax.lax.scan(body, x, None, length=5)[0])
    return g(x)


def p_custom_vmap(x):
    from jax.custom_batching import custom_vmap

    @custom_vmap
    def h(x):
        return tg(jnp.sin(x), "cvm")

    @h.def_vmap
    def _rule(axis_size, in_batched, x):
        return jnp.sin(x), in_batched[0]

    return h(x)


def p_linear_call(x):
    from jax._src.custom_derivatives import linear_call

    return linear_call(lambda c, x: tg(c * x, "callee"), lambda c, ct: c * ct, 2.0, x)


def p_run_state(x):
    from jax._src.state.discharge import run_state

    def body(ref):
        ref[...] = tg(ref[...] * 2, "rs")

    return run_state(body)(x)


# name -> (program, expected [(op, path), ...] in program order)
CASES = {
    "straight": (p_straight, [("a", ()), ("b", ())]),
    "jit_scan": (p_jit_scan, [("pre", ()), ("s", ("jit[f]", "scan[length=5]"))]),
    "scan_reverse": (p_scan_reverse, [("s", ("scan[length=4,reverse]",))]),
    "while": (p_while, [("cond", ("while[cond]",)), ("body", ("while[body]",))]),
    "fori": (p_fori, [("fori", ("scan[length=3]",))]),
    "cond": (p_cond, [("false", ("cond[branch=0]",)), ("true", ("cond[branch=1]",))]),
    "switch": (p_switch, [(f"b{i}", (f"cond[branch={i}]",)) for i in range(3)]),
    "custom_jvp": (p_custom_jvp, [("cj", ("custom_jvp",))]),
    "custom_vjp": (p_custom_vjp, [("cv", ("custom_vjp",))]),
    "checkpoint": (p_checkpoint, [("ck", ("checkpoint",))]),
    "shard_map": (p_shard_map, [("sm", ("shard_map",))]),
    "closed_call": (p_closed_call, [("cc", ("closed_call",))]),
    "linear_solve": (p_linear_solve, [
        ("matvec", ("custom_linear_solve[matvec]",)),
        ("matvec", ("custom_linear_solve[vecmat]",)),
        ("solve", ("custom_linear_solve[solve]",)),
        ("solve", ("custom_linear_solve[transpose_solve]",))]),
    "nested": (p_nested, [("deep", ("jit[<lambda>]", "scan[length=5]", "cond[branch=1]"))]),
    "custom_vmap": (p_custom_vmap, [("cvm", ("custom_vmap_call[call]",))]),
    "linear_call": (p_linear_call, [("callee", ("linear_call[callee]",))]),
    "run_state": (p_run_state, [("rs", ("run_state[jaxpr]",))]),
}


def _jaxpr(name):
    prog, _ = CASES[name]
    return jax.make_jaxpr(prog)(X)


@pytest.mark.parametrize("name", sorted(CASES))
def test_find_tags_paths_in_program_order(name):
    j = _jaxpr(name)
    sites = tx.find_tags(j)
    assert [(s.params["op"], s.path) for s in sites] == CASES[name][1]
    for s in sites:
        assert isinstance(s.shape, ShapedArray)
        assert s.shape.dtype == jnp.float32
        assert set(s.params) == {"op"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_iter_tags_matches_find_tags(name):
    j = _jaxpr(name)
    sites = tx.find_tags(j)
    found = list(tx.iter_tags(j))
    assert found == [(s.params, s.shape) for s in sites]
    # The open jaxpr (0.10's Jaxpr; in 0.12 `.jaxpr` is the object itself) too.
    assert list(tx.iter_tags(j.jaxpr)) == found


def test_pmap_traces_to_shard_map():
    x = jnp.arange(4.0)
    sites = tx.find_tags(jax.make_jaxpr(p_pmap)(x))
    assert [s.params["op"] for s in sites] == ["pm"]
    assert sites[0].path[-1] == "shard_map"
    assert sites[0].path[0].startswith("jit[")
    np.testing.assert_allclose(p_pmap(x), 2 * x)


def test_shapes_are_pytrees_of_shaped_arrays():
    def g(x, i):
        tx.tag({"x": x, "pair": (i, jnp.float16(1))}, op="tree")
        tx.tag(jnp.zeros((0, 2)), op="empty")
        tx.tag(jax.random.key(0), op="key")
        return x

    j = jax.make_jaxpr(g)(X, jnp.arange(3))
    (tree, empty, key) = [s.shape for s in tx.find_tags(j)]
    assert tree == {"x": ShapedArray((4,), jnp.float32),
                    "pair": (ShapedArray((3,), jnp.int32), ShapedArray((), jnp.float16))}
    assert empty == ShapedArray((0, 2), jnp.float32)
    assert key.shape == () and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)


def test_weak_type_in_shape():
    j = jax.make_jaxpr(lambda: tx.tag((1.0, 2), op="w"))()
    (site,) = tx.find_tags(j)
    assert all(a.weak_type for a in site.shape)


def test_kept_tags_under_grad_are_found_once():
    j = jax.make_jaxpr(jax.grad(lambda x: p_nested(x).sum()))(X)
    assert [s.path for s in tx.find_tags(j)] == [
        ("jit[<lambda>]", "scan[length=5]", "cond[branch=1]")]
    assert [s.params for s in tx.find_tags(j)] == [{"op": "deep"}]


def test_no_tags():
    j = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(X)
    assert tx.find_tags(j) == [] and list(tx.iter_tags(j)) == []


# ---- dissolve_tags ----------------------------------------------------------------------

INPUTS = [X, -X, X * 3.0 + 0.5, jnp.array([0.3, -0.2, 0.9, -1.5])]

def _cases_for_dissolve():
    out = []
    for name in sorted(CASES):
        out.append(pytest.param(name, id=name))
    return out


def _run(j, *args):
    return jaxpr_as_fun(j)(*args)


def _assert_same_results(j1, j2, inputs=INPUTS):
    for x in inputs:
        for a, b in zip(_run(j1, x), _run(j2, x)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", _cases_for_dissolve())
def test_dissolve_all(name):
    j = _jaxpr(name)
    d = tx.dissolve_tags(j)
    check(d)
    assert type(d) is type(j)
    assert tx.find_tags(d) == []
    assert not any("tag" in e.primitive.name for e, _ in _iter(d))
    _assert_same_results(j, d)
    # Effects of dissolved (kept) tags are gone too.
    assert not any("TagEffect" in str(e) for e in all_effects(d))


def _iter(j):
    from taxpr import _traverse

    return _traverse.iter_eqns(j)


@pytest.mark.parametrize("name", _cases_for_dissolve())
def test_dissolve_by_predicate(name):
    j = _jaxpr(name)
    want = CASES[name][1]
    drop = want[0][0]
    d = tx.dissolve_tags(j, lambda params, shape: params["op"] == drop)
    check(d)
    assert type(d) is type(j)
    assert [(s.params["op"], s.path) for s in tx.find_tags(d)] == [
        w for w in want if w[0] != drop]
    _assert_same_results(j, d)


@pytest.mark.parametrize("name", sorted(CASES))
def test_dissolve_nothing_returns_same_object(name):
    j = _jaxpr(name)
    assert tx.dissolve_tags(j, lambda params, shape: False) is j
    plain = jax.make_jaxpr(lambda x: jnp.cos(x) + 1)(X)
    assert tx.dissolve_tags(plain) is plain


def test_dissolve_predicate_sees_shape():
    def g(x):
        tx.tag(x, op="big")
        tx.tag(x[:2], op="small")
        return x * 2

    j = jax.make_jaxpr(g)(X)
    d = tx.dissolve_tags(j, lambda params, shape: shape.shape == (2,))
    assert [s.params["op"] for s in tx.find_tags(d)] == ["big"]
    check(d)


def test_dissolve_keeps_unrelated_subjaxprs_identical():
    def g(x):
        a = jax.lax.scan(lambda c, _: (c + 1, None), x, None, length=2)[0]
        b = jax.lax.scan(lambda c, _: (tg(c, "t") * 2, None), x, None, length=2)[0]
        return a + b

    j = jax.make_jaxpr(g)(X)
    d = tx.dissolve_tags(j)
    eqns_j = [e for e in j.jaxpr.eqns if e.primitive.name == "scan"]
    eqns_d = [e for e in d.jaxpr.eqns if e.primitive.name == "scan"]
    assert eqns_d[0].params["jaxpr"] is eqns_j[0].params["jaxpr"]
    assert eqns_d[1].params["jaxpr"] is not eqns_j[1].params["jaxpr"]
    _assert_same_results(j, d)


@pytest.mark.parametrize("name", ["straight", "jit_scan", "nested", "checkpoint", "fori",
                                  "cond", "custom_jvp", "custom_vjp"])
def test_dissolve_derivative_jaxprs(name):
    """grad/jvp jaxprs contain kept tags (with TagEffect) and tag tangents."""
    prog = CASES[name][0]
    jaxprs = [jax.make_jaxpr(jax.grad(lambda x: prog(x).sum()))(X),
              jax.make_jaxpr(jax.vmap(jax.grad(lambda x: prog(x).sum())))(jnp.stack([X, -X]))]
    if name != "custom_vjp":  # JAX cannot evaluate jvp of a custom_vjp function
        jaxprs.append(jax.make_jaxpr(lambda x, t: jax.jvp(prog, (x,), (t,)))(X, X))
    for j in jaxprs:
        d = tx.dissolve_tags(j)
        check(d)
        assert type(d) is type(j)
        assert not any("tag" in e.primitive.name for e, _ in _iter(d))
        assert not any("TagEffect" in str(e) for e in all_effects(d))
        n_in = len(j.in_avals)
        for x in INPUTS[:2]:
            args = [x] * n_in if j.in_avals[0].shape == X.shape else [jnp.stack([x, -x])]
            for a, b in zip(_run(j, *args), _run(d, *args)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dissolve_runs_under_jit_vmap_grad():
    j = _jaxpr("nested")
    d = tx.dissolve_tags(j)
    fun = lambda x: _run(d, x)[0].sum()
    np.testing.assert_allclose(jax.jit(fun)(X), p_nested(X).sum())
    np.testing.assert_allclose(jax.grad(fun)(X), jax.grad(lambda x: p_nested(x).sum())(X))
    np.testing.assert_allclose(jax.vmap(fun)(jnp.stack(INPUTS)),
                               jnp.stack([p_nested(x).sum() for x in INPUTS]))


@pytest.mark.skipif(MERGED_JAXPR, reason="0.10 only: open Jaxpr is its own class")
def test_dissolve_open_jaxpr_with_consts():
    big = jnp.arange(4.0) + 7.0  # becomes a constvar

    def g(x):
        return jax.lax.scan(lambda c, _: (tg(c * big, "s"), None), x, None, length=2)[0] + big

    closed = jax.make_jaxpr(g)(X)
    open_jaxpr = closed.jaxpr
    d = tx.dissolve_tags(open_jaxpr)
    assert type(d) is type(open_jaxpr)
    core.check_jaxpr(d)
    assert tx.find_tags(d) == []
    for x in INPUTS:
        np.testing.assert_array_equal(core.eval_jaxpr(d, closed.consts, x)[0], g(x))

"""The public ``inject`` / ``injected`` API (taxpr/_inject.py): the
injector protocol and what the rewritten program takes and returns.

An injector is called as ``injector(ctx, value, params)`` at each selected tag
and returns ``tx.Injected(value=..., ctx=...)`` or a plain ``(value, ctx)``
tuple; ``inject`` gives a program from ``(*ctx, *inputs)`` to
``(*outputs, *ctx)``. Tested here: that signature; the forms ctx may take (a
bare array, a ``ShapeDtypeStruct``, a pytree, a PRNG key, empty) and pytree
tokens; a predicate selecting which tags are injected; the injector traced
once per distinct signature; ``tx.injected`` (pytree args and kwargs, its
cache, under jit and grad); and clear errors for an injector returning the
wrong structure, shape, dtype or kind, raising, or storing a batched value
into ctx, after which JAX still works. The programs and the eager reference
come from tests/inject_programs.py; how each primitive threads ctx is
tests/test_engine.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import core
from jax.extend.core import jaxpr_as_fun

import taxpr as tx
from helpers import check
from inject_programs import (MERGED_JAXPR, PROGRAMS, Eager, Prog, assert_close, ctx0, eager,
                             f32, injector, jax_still_works, run, trace, tree_flatten)


# ---- the result's signature and the forms of ctx ---------------------------------------

def test_result_signature_is_ctx_then_inputs_then_outputs_then_ctx():
    prog = PROGRAMS["fori_traced"]
    closed, new, _ = trace(prog, prog.inputs[0])

    def types(avals):
        return [(a.shape, np.dtype(a.dtype).name) for a in avals]

    f, i = ((), "float32"), ((), "int32")
    assert types(closed.in_avals) == [f, i] and types(closed.out_avals) == [f]
    assert types(new.in_avals) == [f, i, f, i]  # acc, n, x, n_iter
    assert types(new.out_avals) == [f, f, i]  # out, acc, n


def test_ctx_may_be_a_bare_array_or_a_shape_dtype_struct():
    def inj(ctx, token, params):
        return token * ctx, ctx + token

    def f(x):
        def body(c, xi):
            return tx.tag(c, op="m") + xi, c
        return lax.scan(body, x, jnp.arange(3.0))[0]

    closed = jax.make_jaxpr(f)(1.0)
    for spec in (jnp.float32(0.0), jax.ShapeDtypeStruct((), jnp.float32)):
        new = tx.inject(closed, inj, spec)
        check(new)
        c0, x = 2.0, 1.0
        c, ctx = x, c0
        for xi in range(3):
            c, ctx = c * ctx + xi, ctx + c
        out, ctx_out = jaxpr_as_fun(new)(jnp.float32(c0), jnp.float32(x))
        np.testing.assert_allclose([out, ctx_out], [c, ctx], rtol=1e-6)


# ---- a predicate selects the tags ------------------------------------------------------

def test_predicate_selects_tags_and_leaves_the_rest():
    prog = PROGRAMS["cond_in_scan_in_jit"]

    def pred(params, shape):
        assert isinstance(shape, core.ShapedArray)
        return params["op"] != "get"

    closed, new, out_tree = trace(prog, prog.inputs[0], predicate=pred)
    left = tx.find_tags(new)
    assert [s.params for s in left] == [{"op": "get"}]
    assert left[0].path == ("jit[f]", "scan[length=4]", "cond[branch=0]")
    for args in prog.inputs:
        assert_close(run(new, out_tree, ctx0(1.5), args), eager(prog, args, ctx0(1.5), pred))
    # the leftover tags can be injected afterwards
    new2 = tx.inject(new, injector, ctx0())
    check(new2)
    assert not tx.find_tags(new2)


# ---- tracing the injector ------------------------------------------------------------------

def counting(inj):
    calls = []

    def wrapped(ctx, token, params):
        calls.append(dict(params))
        return inj(ctx, token, params)

    return wrapped, calls


def test_injector_traced_once_for_identical_tags():
    inj, calls = counting(injector)

    def f(x):
        for _ in range(50):
            x = tx.tag(x, op="push") * 1.01
        return x

    closed = jax.make_jaxpr(f)(1.0)
    new = tx.inject(closed, inj, ctx0())
    assert len(calls) == 1
    out, ctx = run(new, jax.tree_util.tree_structure(0), ctx0(), (f32(1.0),))
    want = eager(Prog(fn=_fifty, inputs=[]), (f32(1.0),), ctx0())
    assert_close((out, ctx), want)


def _fifty(B, x):
    for _ in range(50):
        x = B.tag(x, op="push") * 1.01
    return x


def test_injector_traced_once_per_distinct_signature():
    inj, calls = counting(injector)

    def f(x, v):
        for i in range(50):
            x = tx.tag(x, op="push", id=i % 5) * 1.01
            v = tx.tag(v, op="push", id=0)  # another token type: one more trace
        return x, tx.tag(v, op="add", id=0)

    def body(c, xi):  # the same signatures inside a scan: no new trace
        return tx.tag(c, op="push", id=3), tx.tag(xi, op="push", id=0)

    def g(x, v):
        a, b = f(x, v)
        return lax.scan(body, a, v)

    # (f32 inputs: a weak-typed f32[] would be another token type)
    closed = jax.make_jaxpr(g)(f32(1.0), jnp.ones(3))
    new = tx.inject(closed, inj, ctx0())
    check(new)
    sigs = sorted((c["op"], c["id"]) for c in calls)
    assert sigs == [("add", 0), ("push", 0), ("push", 0), ("push", 1), ("push", 2),
                    ("push", 3), ("push", 4)]


# ---- pytree tokens and ctx -----------------------------------------------------------------

def test_pytree_ctx_dict_of_arrays():
    def inj(ctx, token, params):
        return token * ctx["scale"], {
            "total": ctx["total"] + token.sum(),
            "hist": ctx["hist"].at[ctx["k"] % 4].set(token.sum()),
            "k": ctx["k"] + 1,
            "scale": ctx["scale"],
        }

    def f(x):
        def body(c, xi):
            return tx.tag(c * xi, op="h"), None
        c = lax.scan(body, x, jnp.arange(1.0, 4.0))[0]
        return lax.cond(c.sum() > 0, lambda v: tx.tag(v, op="h"), lambda v: v, c)

    c0 = {"total": jnp.float32(0), "hist": jnp.zeros(4), "k": jnp.int32(0),
          "scale": jnp.float32(0.5)}
    x = jnp.array([1.0, 2.0])
    closed = jax.make_jaxpr(f)(x)
    new = tx.inject(closed, inj, c0)
    check(new)
    leaves, tree = tree_flatten(c0)
    outs = jaxpr_as_fun(new)(*leaves, x)
    got_out, got_ctx = outs[0], jax.tree_util.tree_unflatten(tree, outs[1:])
    # eager
    ctx, c = c0, x
    for xi in range(1, 4):
        c, ctx = inj(ctx, c * xi, {})
    if c.sum() > 0:
        c, ctx = inj(ctx, c, {})
    assert_close((got_out, got_ctx), (c, ctx))


def test_pytree_token_structure_is_passed_to_injector():
    seen = []

    def inj(ctx, token, params):
        seen.append(jax.tree_util.tree_structure(token))
        return {"b": token["b"], "a": (token["a"][0] + ctx, token["a"][1])}, ctx + 1

    def f(x):
        t = tx.tag({"a": (x, jnp.int32(2)), "b": [x * 2]}, op="t")
        return t["a"][0] + t["a"][1] + t["b"][0]

    new = tx.inject(jax.make_jaxpr(f)(1.0), inj, jnp.float32(0))
    check(new)
    assert seen == [jax.tree_util.tree_structure({"a": (0, 0), "b": [0]})]
    out, c = jaxpr_as_fun(new)(jnp.float32(10.0), jnp.float32(1.0))
    assert float(out) == 1.0 + 10.0 + 2 + 2.0 and float(c) == 11.0


# ---- other ctx kinds and input forms -------------------------------------------------------

def test_prng_key_ctx_through_loops_and_checkpoint():
    def inj(ctx, token, params):
        k1, k2 = jax.random.split(ctx)
        return token + jax.random.normal(k1, token.shape), k2

    def f(x):
        x = lax.scan(lambda c, _: (tx.tag(c, op="a"), None), x, None, length=3)[0]
        x = lax.while_loop(lambda c: tx.tag(c, op="a")[0] < 100.0,
                           lambda c: tx.tag(c, op="a") + 50.0, x)
        return jax.checkpoint(lambda y: tx.tag(y, op="a") * 2)(x)

    x = jnp.zeros(2)
    closed = jax.make_jaxpr(f)(x)
    new = tx.inject(closed, inj, jax.random.key(0))
    check(new)
    out, key = jaxpr_as_fun(new)(jax.random.key(7), x)

    k, v = jax.random.key(7), x  # eager
    def site(v):
        nonlocal k
        k1, k = jax.random.split(k)
        return v + jax.random.normal(k1, v.shape)
    for _ in range(3):
        v = site(v)
    while site(v)[0] < 100.0:  # the cond's tagged value is thrown away
        v = site(v) + 50.0
    v = site(v) * 2
    np.testing.assert_allclose(out, v, rtol=1e-5)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(k))


def test_empty_ctx():
    f = lambda x: lax.scan(lambda c, _: (tx.tag(c, op="a"), None), x, None, length=3)[0]  # noqa: E731
    new = tx.inject(jax.make_jaxpr(f)(1.0), lambda c, t, p: (t * 2, c), ())
    check(new)
    assert float(jaxpr_as_fun(new)(f32(1.0))[0]) == 8.0


def test_plain_jaxpr_is_taken_as_closed():
    closed = jax.make_jaxpr(lambda x: jax.jit(lambda y: tx.tag(y, op="add") * 2)(x))(f32(1.0))
    plain = closed if MERGED_JAXPR else closed.jaxpr
    new = tx.inject(plain, injector, ctx0(1.0))
    check(new)
    out, acc, n = jaxpr_as_fun(new)(f32(1.0), jnp.int32(0), f32(3.0))
    assert (float(out), float(acc), int(n)) == (6.0, 4.0, 1)


# ---- what the injector returns: tx.Injected or a tuple ---------------------------------

def test_injector_returning_injected_by_name_equals_a_plain_tuple():
    # `tx.Injected(value=..., ctx=...)` names what the injector returns; the
    # (value, ctx) tuple of taxpr 0.0.3's injectors is the same thing.
    def f(xs):
        def body(c, x):
            tx.tag(x, op="add")
            return c + tx.tag(0.0, op="get"), None
        return jax.lax.scan(body, 0.0, xs)[0]

    def named(ctx, value, params):
        if params["op"] == "add":
            return tx.Injected(ctx=ctx + value, value=value)
        return tx.Injected(value=ctx, ctx=ctx)

    def plain(ctx, value, params):
        if params["op"] == "add":
            return value, ctx + value
        return ctx, ctx

    xs = jnp.arange(1.0, 5.0)
    closed = jax.make_jaxpr(f)(xs)
    results = [jaxpr_as_fun(tx.inject(closed, inj, jnp.float32(0)))(jnp.float32(0), xs)
               for inj in (named, plain)]
    # Python: the running sum read after each add.
    ctx, out = 0.0, 0.0
    for x in [1.0, 2.0, 3.0, 4.0]:
        ctx += x
        out += ctx
    for got_out, got_ctx in results:
        assert float(got_out) == out and float(got_ctx) == ctx


def test_injector_returning_the_wrong_kind_names_the_expected_result():
    closed = jax.make_jaxpr(lambda x: tx.tag(x, op="a"))(1.0)
    with pytest.raises(tx.InjectError, match=r"op='a'.*tx\.Injected\(value=\.\.\., ctx=\.\.\.\)"):
        tx.inject(closed, lambda ctx, value, params: value, jnp.float32(0))


# ---- tx.injected ---------------------------------------------------------------------------

def test_injected_with_pytree_args_kwargs_and_cache():
    traces = []

    def fn(a, b, *, c):
        traces.append(1)

        def body(carry, xi):
            return carry + tx.tag(xi * a["u"], op="push"), tx.tag(xi, op="get")

        s, ys = lax.scan(body, b[0], b[1])
        return {"s": s, "ys": ys, "c": tx.tag(c, op="add") * 2}

    def fn_eager(E, a, b, c):
        s = b[0]
        ys = []
        for xi in b[1]:
            s = s + E.tag(xi * a["u"], op="push")
            ys.append(E.tag(xi, op="get"))
        return {"s": s, "ys": jnp.stack(ys), "c": E.tag(c, op="add") * 2}

    pure = tx.injected(fn, injector)
    for u in (0.5, 2.0):
        a = {"u": f32(u)}
        b = (f32(1.0), jnp.arange(3.0))
        c = jnp.ones(2)
        out, ctx = pure(ctx0(1.0), a, b, c=c)
        e = Eager(ctx0(1.0))
        assert_close((out, ctx), (fn_eager(e, a, b, c), e.ctx))
    assert len(traces) == 1
    pure(ctx0(), {"u": f32(1)}, (f32(1.0), jnp.arange(4.0)), c=c)  # new shape
    assert len(traces) == 2
    pure(ctx0(), {"u": f32(3)}, (f32(2.0), jnp.arange(4.0)), c=c)
    assert len(traces) == 2
    pure(ctx0(), {"u": f32(3)}, (f32(2.0), jnp.arange(4.0)), c=jnp.ones(3))  # kwarg shape
    assert len(traces) == 3
    # works as an ordinary JAX function
    f = jax.jit(lambda ctx, u: pure(ctx, {"u": u}, (f32(1.0), jnp.arange(3.0)), c=c))
    out, ctx = f(ctx0(1.0), f32(2.0))
    e = Eager(ctx0(1.0))
    assert_close((out, ctx), (fn_eager(e, {"u": f32(2.0)}, (f32(1.0), jnp.arange(3.0)), c),
                              e.ctx))
    g = jax.grad(lambda u: pure(ctx0(1.0), {"u": u}, (f32(1.0), jnp.arange(3.0)), c=c)[1]["acc"])
    np.testing.assert_allclose(g(f32(2.0)), jax.grad(
        lambda u: (lambda e: (fn_eager(e, {"u": u}, (f32(1.0), jnp.arange(3.0)), c),
                              e.ctx["acc"])[1])(Eager(ctx0(1.0))))(f32(2.0)), rtol=1e-6)


def test_injected_with_predicate():
    def fn(x):
        return tx.tag(x, op="add") + tx.tag(x, op="get")

    pure = tx.injected(fn, injector, predicate=lambda p, s: p["op"] == "get")
    out, ctx = pure(ctx0(5.0), f32(1.0))
    assert float(out) == 6.0 and int(ctx["n"]) == 1 and float(ctx["acc"]) == 5.0


# ---- errors ----------------------------------------------------------------------------------

def _bad(kind):
    def inj(ctx, token, params):
        new_token, new_ctx = injector(ctx, token, params)
        if kind == "token_structure":
            return (new_token, new_token), new_ctx
        if kind == "token_shape":
            return jnp.broadcast_to(new_token, (2,)), new_ctx
        if kind == "token_dtype":
            return new_token.astype(jnp.int32), new_ctx
        if kind == "ctx_structure":
            return new_token, {"acc": new_ctx["acc"]}
        if kind == "ctx_shape":
            return new_token, dict(new_ctx, acc=jnp.zeros(3))
        if kind == "ctx_dtype":
            return new_token, dict(new_ctx, n=new_ctx["n"].astype(jnp.float32))
        if kind == "not_a_pair":
            return new_token
        raise ValueError(kind)
    return inj


BAD_KINDS = ["token_structure", "token_shape", "token_dtype", "ctx_structure", "ctx_shape",
             "ctx_dtype", "not_a_pair"]


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_wrong_injector_output_is_a_clear_error(kind):
    def inner(y):
        def body(c, xi):
            return c + tx.tag(xi, op="push", where="inner"), c
        return lax.scan(body, y, jnp.arange(3.0))

    def f(x):
        return jax.jit(inner)(tx.tag(x, op="get"))

    closed = jax.make_jaxpr(f)(1.0)
    before = str(closed)
    # only the scan's tag is selected, so the error must be about it
    with pytest.raises(tx.InjectError) as info:
        tx.inject(closed, _bad(kind), ctx0(), predicate=lambda p, s: p["op"] == "push")
    msg = str(info.value)
    assert "op='push'" in msg and "where='inner'" in msg, msg
    assert "jit[inner]/scan[length=3]" in msg, msg
    word = {"token": "value", "ctx": "ctx", "not": "tx.Injected(value=..., ctx=...)"}[
        kind.split("_")[0]]
    assert word in msg, msg
    # the difference is shown
    if kind.endswith("shape"):
        assert re.search(r"(f32|float32)\[(2|3)\]", msg), msg
    if kind.endswith("dtype"):
        assert re.search(r"i(nt)?32", msg) and re.search(r"f(loat)?32", msg), msg
    # nothing was modified, and JAX still works
    assert str(closed) == before
    assert float(jaxpr_as_fun(closed)(f32(1.0))[0]) == 4.0
    jax_still_works()
    # the same error from injected(), also when called under jit
    pure = tx.injected(f, _bad(kind), predicate=lambda p, s: p["op"] == "push")
    with pytest.raises(tx.InjectError, match=re.escape(msg.split("\n")[0])):
        jax.jit(pure)(ctx0(), f32(1.0))
    jax_still_works()


def test_error_at_top_level_names_tag():
    with pytest.raises(tx.InjectError, match=r"op='add'.*<top level>|<top level>.*op='add'"):
        tx.inject(jax.make_jaxpr(lambda x: tx.tag(x, op="add"))(1.0), _bad("token_dtype"),
                  ctx0())
    jax_still_works()


def test_injector_raising_leaves_jax_clean():
    def inj(ctx, token, params):
        raise RuntimeError("boom")

    closed = jax.make_jaxpr(lambda x: lax.scan(lambda c, _: (tx.tag(c, op="add"), None),
                                               x, None, length=2)[0])(1.0)
    with pytest.raises(RuntimeError, match="boom"):
        tx.inject(closed, inj, ctx0())
    jax_still_works()
    with pytest.raises(RuntimeError, match="boom"):
        jax.jit(tx.injected(lambda x: tx.tag(x, op="add") * 2, inj))(ctx0(), 1.0)
    jax_still_works()


def test_batched_token_stored_into_ctx_is_an_error():
    def f(xs):
        return jax.vmap(lambda v: tx.tag(v, op="set") * 2)(xs)

    closed = jax.make_jaxpr(f)(jnp.ones(4))
    with pytest.raises(tx.InjectError, match="batched") as info:
        tx.inject(closed, injector, ctx0())
    assert "op='set'" in str(info.value)
    jax_still_works()
    with pytest.raises(tx.InjectError, match="batched"):
        jax.jit(tx.injected(f, injector))(ctx0(), jnp.ones(4))
    jax_still_works()
    # reading ctx under vmap is fine: the read broadcasts
    out, ctx = tx.injected(lambda xs: jax.vmap(lambda v: tx.tag(v, op="get") + v)(xs),
                           injector)(ctx0(2.0), jnp.arange(3.0))
    assert_close((out, ctx), (jnp.arange(3.0) + 2.0, {"acc": f32(2.0), "n": jnp.int32(1)}))

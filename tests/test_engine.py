"""The threading engine (taxpr/_engine/): how ``inject`` threads ctx
through each primitive, and what the rewritten program looks like.

Every program of the corpus (tests/inject_programs.py: straight-line code,
jit, scan, fori/while loops, cond, switch, checkpoint, closed_call, vmap and
their nestings) is injected and compared with the same program run eagerly
with Python control flow, on outputs and final ctx, evaluated directly,
under ``jax.jit``, ``jax.vmap`` and ``jax.grad``, and with predicates that
leave some tags behind. Also: the structure of the result (a jit stays a
jit with its name and params, a shared sub-jaxpr is threaded once,
sub-jaxprs without selected tags are kept as the same objects), explicit
counts of how often each site acts (while conds, untaken branches,
checkpoint under grad, reverse scans), primitives the engine has no thread
rule for, and derivatives of ctx-dependent injectors across jaxprs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import core
from jax.extend.core import jaxpr_as_fun

import taxpr as tx
from helpers import check
from inject_programs import (JIT_NAMES, MERGED_JAXPR, PREDICATES, PROGRAMS, WRAPPERS, Eager,
                             Prog, assert_close, closed_call, ctx0, eager, f32, injector,
                             jax_still_works, loss, run, trace, tree_leaves, tree_map)


# ---- each program against the eager reference ------------------------------------------

@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_matches_eager(name):
    prog = PROGRAMS[name]
    closed, new, out_tree = trace(prog, prog.inputs[0])
    assert not tx.find_tags(new), "every tag is selected"
    direct = jaxpr_as_fun(new)
    jitted = jax.jit(jaxpr_as_fun(new))
    for acc in prog.ctxs:
        for i, args in enumerate(prog.inputs):
            want = eager(prog, args, ctx0(acc))
            assert_close(run(new, out_tree, ctx0(acc), args, jitted), want)
            if i == 0:
                assert_close(run(new, out_tree, ctx0(acc), args, direct), want)


@pytest.mark.parametrize("name", sorted(n for n, p in PROGRAMS.items() if p.vmap))
def test_vmap_of_injected(name):
    prog = PROGRAMS[name]
    _, new, out_tree = trace(prog, prog.inputs[0])
    stacked = tree_map(lambda *a: jnp.stack(a), *prog.inputs)
    ctx_leaves = tree_leaves(ctx0(1.5))
    n_args = len(tree_leaves(prog.inputs[0]))
    f = jax.vmap(jaxpr_as_fun(new), in_axes=(None,) * len(ctx_leaves) + (0,) * n_args)
    out, ctx = run(new, out_tree, ctx0(1.5), stacked, f)
    for k, args in enumerate(prog.inputs):
        want_out, want_ctx = eager(prog, args, ctx0(1.5))
        assert_close(tree_map(lambda a: a[k], (out, ctx)), (want_out, want_ctx))
    # a batch of ctxs too
    accs = [1.5 - k for k in range(len(prog.inputs))]
    ctxs = tree_map(lambda *a: jnp.stack(a), *[ctx0(a) for a in accs])
    out, ctx = run(new, out_tree, ctxs, stacked, jax.vmap(jaxpr_as_fun(new)))
    for k, args in enumerate(prog.inputs):
        assert_close(tree_map(lambda a: a[k], (out, ctx)), eager(prog, args, ctx0(accs[k])))


@pytest.mark.parametrize("name", sorted(n for n, p in PROGRAMS.items() if p.grad))
def test_grad_of_injected(name):
    prog = PROGRAMS[name]
    _, new, out_tree = trace(prog, prog.inputs[0])
    for args in prog.inputs[:2]:
        def f_inj(x):
            return loss(*run(new, out_tree, ctx0(1.5), (x, *args[1:])))

        def f_ref(x):
            return loss(*eager(prog, (x, *args[1:]), ctx0(1.5)))

        np.testing.assert_allclose(jax.grad(f_inj)(args[0]), jax.grad(f_ref)(args[0]),
                                   rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(jax.jit(jax.grad(f_inj))(args[0]),
                                   jax.grad(f_ref)(args[0]), rtol=1e-4, atol=1e-5)
    # w.r.t. the initial ctx
    args = prog.inputs[0]
    g_inj = jax.grad(lambda a: loss(*run(new, out_tree, dict(ctx0(), acc=a), args)))
    g_ref = jax.grad(lambda a: loss(*eager(prog, args, dict(ctx0(), acc=a))))
    np.testing.assert_allclose(g_inj(f32(1.5)), g_ref(f32(1.5)), rtol=1e-4, atol=1e-5)


def _left_behind(old, predicate) -> list:
    """The tags ``inject`` leaves in a program: those the predicate rejects,
    where they were, except in the cond of a while that also holds a
    selected tag: that while carries its predicate, so its cond runs once
    before the loop and at the end of each iteration, and each rejected tag
    of it is left in both places."""
    def cond_prefix(site):
        return site.path[:site.path.index("while[cond]")] if "while[cond]" in site.path else None

    rewritten = {cond_prefix(s) for s in old if predicate(s.params, s.shape)} - {None}
    left = []
    for s in old:
        if predicate(s.params, s.shape):
            continue
        prefix = cond_prefix(s)
        if prefix not in rewritten:
            left.append(s)
            continue
        rest = s.path[len(prefix) + 1:]
        left.append(dataclasses.replace(s, path=prefix + rest))                    # before the loop
        left.append(dataclasses.replace(s, path=prefix + ("while[body]",) + rest))  # in the body
    return left


@pytest.mark.parametrize("pred", sorted(PREDICATES))
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_predicate_matches_eager(name, pred):
    prog, predicate = PROGRAMS[name], PREDICATES[pred]
    closed, new, out_tree = trace(prog, prog.inputs[0], predicate=predicate)
    old = tx.find_tags(closed)
    left = tx.find_tags(new)
    rejected = [s for s in old if not predicate(s.params, s.shape)]
    if not any("while[cond]" in s.path for s in rejected):
        assert left == rejected
    else:
        key = lambda s: (repr(sorted(s.params.items())), s.path, str(s.shape))  # noqa: E731
        assert sorted(map(key, left)) == sorted(map(key, _left_behind(old, predicate)))
    fun = jax.jit(jaxpr_as_fun(new))
    for args in prog.inputs:
        assert_close(run(new, out_tree, ctx0(1.5), args, fun),
                     eager(prog, args, ctx0(1.5), predicate))
    # the tags left behind can be injected afterwards, with a second ctx:
    # (*ctx2, *ctx1, *args) -> (*outs, *ctx1, *ctx2)
    new2 = tx.inject(new, injector, ctx0())
    check(new2)
    assert not tx.find_tags(new2)
    fun2 = jax.jit(jaxpr_as_fun(new2))
    n = out_tree.num_leaves
    for args in prog.inputs[:2]:
        outs = fun2(*tree_leaves((ctx0(-2.0), ctx0(1.5))), *tree_leaves(args))
        e = Eager(ctx0(1.5), predicate, other=ctx0(-2.0))
        want = prog.fn(e, *args)
        got = (jax.tree_util.tree_unflatten(out_tree, outs[:n]), outs[n:n + 2], outs[n + 2:])
        assert_close(got, (want, tree_leaves(e.ctx), tree_leaves(e.other)))


# ---- structure of the result -------------------------------------------------------------

def is_jaxpr(v):
    return isinstance(v, (core.Jaxpr, getattr(core, "ClosedJaxpr", core.Jaxpr)))


def subs_of(eqn) -> dict:
    """The jaxpr-valued params of ``eqn`` (tuples of jaxprs included)."""
    return {k: v for k, v in eqn.params.items()
            if is_jaxpr(v) or (isinstance(v, tuple) and v and all(map(is_jaxpr, v)))}


def eqns_of(j):
    return (j.jaxpr if hasattr(j, "jaxpr") and not MERGED_JAXPR else j).eqns


def test_jit_stays_a_jit_with_its_name_and_extended_params():
    def inner_fn(y):
        return tx.tag(y, op="push") * 2

    def f(x):
        return jax.jit(inner_fn)(x) + 1

    closed = jax.make_jaxpr(f)(1.0)
    new = tx.inject(closed, injector, ctx0())
    check(new)
    (eqn,) = [e for e in eqns_of(new) if e.primitive.name in JIT_NAMES]
    assert eqn.params["name"] == "inner_fn"
    assert len(eqn.invars) == 3 and len(eqn.outvars) == 3  # acc, n, y -> out, acc, n
    for key in ("in_shardings", "in_layouts", "donated_invars"):
        assert len(eqn.params[key]) == 3, key
    for key in ("out_shardings", "out_layouts"):
        assert len(eqn.params[key]) == 3, key
    assert not tx.find_tags(new)


def all_eqns(j):
    for e in eqns_of(j):
        yield e
        for v in subs_of(e).values():
            for sj in (v if isinstance(v, tuple) else (v,)):
                yield from all_eqns(sj)


def test_nested_jits_stay_jits_with_their_names():
    prog = PROGRAMS["nested_jit"]
    closed, new, _ = trace(prog, prog.inputs[0])
    names = lambda j: [e.params["name"] for e in all_eqns(j)  # noqa: E731
                       if e.primitive.name in JIT_NAMES]
    assert names(closed) == names(new) == ["outer", "middle", "leaf", "leaf"]
    assert tx.find_tags(new) == []
    n_ctx = len(tree_leaves(ctx0()))
    for e in all_eqns(new):
        if e.primitive.name in JIT_NAMES:  # ctx enters first and leaves last
            assert [v.aval.dtype for v in e.invars[:n_ctx]] == [jnp.float32, jnp.int32]
            assert [v.aval.dtype for v in e.outvars[-n_ctx:]] == [jnp.float32, jnp.int32]


def test_jit_donation_of_original_arguments_is_kept():
    def inner_fn(y, z):
        return tx.tag(y, op="push") * z

    def f(x, z):
        return jax.jit(inner_fn, donate_argnums=(1,))(x, z)

    closed = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3))
    new = tx.inject(closed, injector, ctx0())
    check(new)
    (eqn,) = [e for e in eqns_of(new) if e.primitive.name in JIT_NAMES]
    assert tuple(eqn.params["donated_invars"]) == (False, False, False, True)


def test_subjaxprs_without_selected_tags_are_the_same_objects():
    def no_tags(y):
        return jnp.sin(y) * 2

    def f(x):
        a = jax.jit(no_tags)(x)
        b = lax.scan(lambda c, xi: (c + xi, c), x, jnp.arange(3.0))[0]
        c = lax.cond(x > 0, jnp.sin, jnp.cos, x)
        d = lax.while_loop(lambda c: c < 5, lambda c: c + 1, x)
        e = jax.checkpoint(no_tags)(x)
        g = closed_call(jax.make_jaxpr(no_tags)(x), x)[0]
        h = jax.jit(lambda y: tx.tag(y, op="other"))(x)  # unselected tag
        return tx.tag(a + b + c + d + e + g + h, op="add")

    closed = jax.make_jaxpr(f)(1.0)
    new = tx.inject(closed, injector, ctx0(), predicate=lambda p, s: p["op"] == "add")
    check(new)
    old_hops = [(e.primitive.name, subs_of(e)) for e in eqns_of(closed) if subs_of(e)]
    new_hops = [(e.primitive.name, subs_of(e)) for e in eqns_of(new) if subs_of(e)]
    assert len(old_hops) == 7
    assert len(new_hops) == 7
    for (old_name, old_subs), (new_name, new_subs) in zip(old_hops, new_hops):
        assert old_name == new_name
        assert old_subs.keys() == new_subs.keys()
        for k in old_subs:
            assert new_subs[k] is old_subs[k] or (
                isinstance(old_subs[k], tuple)
                and all(a is b for a, b in zip(old_subs[k], new_subs[k]))), (old_name, k)
    # the unselected tag is still there, with its path
    (site,) = tx.find_tags(new)
    assert site.params == {"op": "other"} and site.path == ("jit[<lambda>]",)


def test_predicate_selecting_nothing_keeps_every_subjaxpr():
    prog = PROGRAMS["nested_jit"]
    closed, new, out_tree = trace(prog, prog.inputs[0], predicate=lambda p, s: False)
    assert len(tx.find_tags(new)) == len(tx.find_tags(closed)) == 4
    (old_jit,) = [e for e in eqns_of(closed) if e.primitive.name in JIT_NAMES]
    (new_jit,) = [e for e in eqns_of(new) if e.primitive.name in JIT_NAMES]
    assert new_jit.params["jaxpr"] is old_jit.params["jaxpr"]
    out, ctx = run(new, out_tree, ctx0(1.5), prog.inputs[0])
    want = prog.fn(Eager(ctx0(), lambda p, s: False), *prog.inputs[0])
    assert_close((out, ctx), (want, ctx0(1.5)))


def test_shared_subjaxpr_is_threaded_once():
    def leaf(y):
        return tx.tag(y, op="push")

    j = jax.jit(leaf)

    def f(x):
        return j(x) + j(x * 2)

    closed = jax.make_jaxpr(f)(1.0)
    olds = [e.params["jaxpr"] for e in eqns_of(closed) if e.primitive.name in JIT_NAMES]
    assert len(olds) == 2 and olds[0] is olds[1]
    new = tx.inject(closed, injector, ctx0())
    news = [e.params["jaxpr"] for e in eqns_of(new) if e.primitive.name in JIT_NAMES]
    assert len(news) == 2 and news[0] is news[1]


# ---- explicit counts: how often each site acts ------------------------------------------

def count_injector(ctx, token, params):
    """ctx: {op: number of times a tag with that op acted}."""
    return token, dict(ctx, **{params["op"]: ctx[params["op"]] + 1})


def counts(f, *args, ops=("body", "cond", "t", "f")):
    ctx = {op: jnp.int32(0) for op in ops}
    out, ctx = tx.injected(f, count_injector)(ctx, *args)
    return out, {k: int(v) for k, v in ctx.items()}


def test_while_cond_runs_before_each_iteration_and_once_more():
    def f(n):
        def cond(i):
            return tx.tag(i, op="cond") < n

        def body(i):
            return tx.tag(i, op="body") + 1

        return lax.while_loop(cond, body, 0)

    for n in (0, 1, 4):
        out, c = counts(f, jnp.int32(n))
        assert int(out) == n and c["body"] == n and c["cond"] == n + 1


def test_only_the_taken_branch_acts():
    def f(x, i):
        a = lax.cond(x > 0, lambda v: tx.tag(v, op="t"), lambda v: tx.tag(v, op="f"), x)
        b = lax.switch(i, [lambda v: tx.tag(v, op="t"), lambda v: v,
                           lambda v: tx.tag(v, op="f") * 2], x)
        return a + b

    assert counts(f, f32(1.0), 0)[1] == {"body": 0, "cond": 0, "t": 2, "f": 0}
    assert counts(f, f32(-1.0), 1)[1] == {"body": 0, "cond": 0, "t": 0, "f": 1}
    assert counts(f, f32(1.0), 2)[1] == {"body": 0, "cond": 0, "t": 1, "f": 1}
    assert counts(f, f32(1.0), 9)[1] == {"body": 0, "cond": 0, "t": 1, "f": 1}  # clamped


def test_checkpoint_effect_happens_once_also_under_grad():
    def f(x):
        g = jax.checkpoint(lambda y: jnp.sin(tx.tag(y, op="t")) * y)
        return jax.grad(g)(x), jax.grad(jax.checkpoint(lambda y: jax.grad(g)(y)))(x)

    (d1, d2), c = counts(f, f32(0.3))
    assert c["t"] == 2  # once per checkpointed primal call, not per rematerialization
    np.testing.assert_allclose(d1, np.cos(0.3) * 0.3 + np.sin(0.3), rtol=1e-5)
    np.testing.assert_allclose(d2, -np.sin(0.3) * 0.3 + 2 * np.cos(0.3), rtol=1e-5)


def test_scan_reverse_acts_in_iteration_order():
    def inj(ctx, token, params):  # records the order in which the xs are seen
        return token, ctx.at[ctx[0].astype(jnp.int32) + 1].set(token).at[0].add(1)

    def f(xs, reverse):
        return lax.scan(lambda c, x: (c, tx.tag(x, op="t")), 0.0, xs, reverse=reverse)[1]

    xs = jnp.arange(1.0, 5.0)
    for reverse, want in ((False, [1, 2, 3, 4]), (True, [4, 3, 2, 1])):
        ys, ctx = tx.injected(functools.partial(f, reverse=reverse), inj)(jnp.zeros(5), xs)
        np.testing.assert_array_equal(ys, xs)
        np.testing.assert_array_equal(ctx, [4.0, *want])


# ---- primitives without a thread rule --------------------------------------------------

def _unknown_hop(implemented: bool):
    from jax.extend.core import Primitive

    p = Primitive("my_unknown_hop")
    p.multiple_results = True
    if implemented:
        p.def_impl(lambda *args, jaxpr: jaxpr_as_fun(jaxpr)(*args))
    p.def_abstract_eval(lambda *avals, jaxpr: list(jaxpr.out_avals))
    return p


UNKNOWN_HOP = _unknown_hop(implemented=True)
UNKNOWN_HOP_WITHOUT_IMPL = _unknown_hop(implemented=False)


def _calls_unknown_hop(prim):
    def inner(y):
        return tx.tag(y, op="add") * 2

    def f(x):
        sub = jax.make_jaxpr(inner)(x)
        return prim.bind(x, jaxpr=sub)[0] + tx.tag(x, op="get")

    return f


def test_selected_tag_in_unknown_primitive_runs_through_its_implementation():
    # Eagerly: inner adds x (1.0) to acc (3.0), then get reads acc (4.0).
    f = _calls_unknown_hop(UNKNOWN_HOP)
    closed = jax.make_jaxpr(f)(1.0)
    new = tx.inject(closed, injector, ctx0())
    check(new)
    out, acc, n = jaxpr_as_fun(new)(f32(3.0), jnp.int32(0), f32(1.0))
    assert (float(out), float(acc), int(n)) == (2.0 + 4.0, 4.0, 2)
    out, ctx = jax.jit(tx.injected(f, injector))(ctx0(3.0), 1.0)
    assert (float(out), float(ctx["acc"]), int(ctx["n"])) == (6.0, 4.0, 2)


def test_selected_tag_in_unknown_primitive_without_implementation_raises():
    f = _calls_unknown_hop(UNKNOWN_HOP_WITHOUT_IMPL)
    closed = jax.make_jaxpr(f)(1.0)
    with pytest.raises(NotImplementedError, match="'my_unknown_hop' at <top level>: it holds "
                                                  r"tag\(op='add'\)"):
        tx.inject(closed, injector, ctx0())
    jax_still_works()
    with pytest.raises(NotImplementedError, match="my_unknown_hop"):
        jax.jit(tx.injected(f, injector))(ctx0(), 1.0)
    jax_still_works()


def test_unknown_primitive_without_selected_tags_is_kept():
    closed = jax.make_jaxpr(_calls_unknown_hop(UNKNOWN_HOP))(1.0)
    # not selected inside it: the primitive is kept as is
    new = tx.inject(closed, injector, ctx0(3.0), predicate=lambda p, s: p["op"] == "get")
    check(new)
    (hop,) = [e for e in eqns_of(new) if e.primitive is UNKNOWN_HOP]
    (old,) = [e for e in eqns_of(closed) if e.primitive is UNKNOWN_HOP]
    assert hop.params["jaxpr"] is old.params["jaxpr"]
    out, acc, n = jaxpr_as_fun(new)(f32(3.0), jnp.int32(0), f32(1.0))
    assert (float(out), float(acc), int(n)) == (5.0, 3.0, 1)


# ---- derivatives of ctx-dependent injectors inside the traced program ----------------------

@pytest.mark.parametrize("wrap", ["none"])
def test_grad_inside_program_of_ctx_dependent_injector(wrap):
    def prog(B, x):
        f = WRAPPERS[wrap](B, lambda y: jnp.sin(B.tag(y, op="scale")))
        B.tag(x, op="add")
        return B.grad(f)(x), B.tag(x, op="get")

    p = Prog(prog, [(f32(0.3),), (f32(-0.7),)], grad=False)
    _, new, out_tree = trace(p, p.inputs[0])
    for args in p.inputs:
        got = run(new, out_tree, ctx0(1.5), args)
        want = eager(p, args, ctx0(1.5))
        assert_close(got, want)
        c = 1.5 + float(args[0])  # acc at the tag: a constant for the derivative
        np.testing.assert_allclose(got[0][0], c * np.cos(c * float(args[0])), rtol=1e-5)


@pytest.mark.parametrize("wrap", [w for w in WRAPPERS if w != "none"])
def test_reverse_mode_ctx_dependent_derivative_across_jaxprs_is_a_clear_error(wrap):
    """Documented limitation: when the injector's derivative depends on ctx and
    reverse mode moves the cotangent into another sub-jaxpr than the tag, the
    ctx at the tag is not available there; inject says so instead of guessing."""
    def prog(B, x):
        f = WRAPPERS[wrap](B, lambda y: jnp.sin(B.tag(y, op="scale")))
        return B.grad(f)(x)

    p = Prog(prog, [(f32(0.3),)], grad=False)
    with pytest.raises(NotImplementedError, match=r"op='scale'.*depends on ctx"):
        trace(p, p.inputs[0])
    assert float(jax.jit(lambda x: x * 2)(1.0)) == 2.0

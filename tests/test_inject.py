"""inject / injected: semantics against an eager reference.

Every program is written once against a small "backend" ``B``:

* ``LAX`` traces it with raw JAX (``tx.tag``, ``lax.scan``, ``lax.cond``, ...);
  the jaxpr is then rewritten by ``tx.inject``.
* ``Eager`` runs it with Python control flow, ``ctx`` a Python attribute that
  every tag replaces by calling the injector -- the meaning inject has
  (the per-primitive table in docs/semantics.md).

Both must agree on the outputs and on the final ctx, for several inputs, when
the injected jaxpr is evaluated directly, under ``jax.jit``, ``jax.vmap`` and
(for differentiable programs) ``jax.grad``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import core
from jax.extend.core import jaxpr_as_fun

import taxpr as tx
from helpers import check

tree_flatten = jax.tree_util.tree_flatten
tree_leaves = jax.tree_util.tree_leaves
tree_map = jax.tree_util.tree_map
MERGED_JAXPR = not hasattr(core, "ClosedJaxpr")
JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:2])


# ---- the injector --------------------------------------------------------------------

def injector(ctx, token, params):
    """ctx = {"acc": f32[], "n": i32[]}; every selected tag counts itself in n.

    add:   acc += sum(token)            push:  acc = acc / 2 + sum(token)
    get:   token := acc (broadcast)     scale: token := token * acc
    set:   acc := token (raw; must be f32[])
    """
    op = params["op"]
    leaves, tree = tree_flatten(token)
    acc, n = ctx["acc"], ctx["n"] + 1
    total = jnp.zeros((), acc.dtype)
    for leaf in leaves:
        total = total + jnp.sum(leaf).astype(acc.dtype)
    if op == "add":
        acc = acc + total
    elif op == "push":
        acc = 0.5 * acc + total
    elif op == "get":
        leaves = [jnp.broadcast_to(acc, jnp.shape(l)).astype(jnp.result_type(l))
                  for l in leaves]
    elif op == "scale":
        leaves = [l * acc.astype(jnp.result_type(l)) for l in leaves]
    elif op == "set":
        acc = token
    else:  # pragma: no cover
        raise ValueError(op)
    return jax.tree_util.tree_unflatten(tree, leaves), {"acc": acc, "n": n}


def ctx0(acc=0.0):
    return {"acc": jnp.float32(acc), "n": jnp.int32(0)}


# ---- closed_call in both JAX versions ------------------------------------------------

def closed_call(closed, *args):
    """Bind core ``closed_call`` (0.10) / ``eval_jaxpr`` (0.12) on ``closed``.

    0.10's ClosedCallPrimitive builds its ``subfuns`` in ``get_bind_params``;
    0.12's ``eval_jaxpr`` binds ``call_jaxpr`` directly.
    """
    p = core.closed_call_p
    params = p.get_bind_params({"call_jaxpr": closed})
    if isinstance(params, tuple):  # pragma: no cover  (generic Primitive form)
        subfuns, params = params
        return p.bind(*subfuns, *args, **params)
    return p.bind(*args, **params)


CALL_NAMES = ("closed_call", "eval_jaxpr")
JIT_NAMES = ("jit", "pjit")


# ---- the two backends ----------------------------------------------------------------

class Lax:
    """Raw JAX: what users write."""

    tag = staticmethod(tx.tag)
    scan = staticmethod(lax.scan)
    fori = staticmethod(lax.fori_loop)
    while_loop = staticmethod(lax.while_loop)
    cond = staticmethod(lax.cond)
    switch = staticmethod(lax.switch)
    jit = staticmethod(jax.jit)
    checkpoint = staticmethod(jax.checkpoint)
    grad = staticmethod(jax.grad)
    vmap = staticmethod(jax.vmap)

    @staticmethod
    def call(f):
        def g(*args):
            closed, shape = jax.make_jaxpr(f, return_shape=True)(*args)
            outs = closed_call(closed, *tree_leaves(args))
            return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), outs)
        return g


LAX = Lax()


class Eager:
    """The reference: Python control flow, ctx a Python variable."""

    def __init__(self, ctx, predicate=None, other=None):
        self.ctx = ctx
        self.predicate = predicate
        self.other = other  # if given, the ctx of the tags the predicate rejects
        self.in_grad = 0

    def tag(self, x, **params):
        x = tree_map(jnp.asarray, x)
        if self.predicate is not None:
            shape = tree_map(lambda l: core.ShapedArray(l.shape, l.dtype), x)
            if not self.predicate(params, shape):
                if self.other is None:
                    return x
                other = self.other
                if self.in_grad:
                    other = jax.lax.stop_gradient(other)
                token, self.other = injector(other, x, params)
                return token
        ctx = self.ctx
        if self.in_grad:  # values taken from ctx are constants for derivatives
            ctx = jax.lax.stop_gradient(ctx)
        token, self.ctx = injector(ctx, x, params)
        return token

    def scan(self, f, init, xs=None, length=None, reverse=False, unroll=1):
        if length is None:
            length = tree_leaves(xs)[0].shape[0]
        order = range(length - 1, -1, -1) if reverse else range(length)
        carry, ys = init, []
        for i in order:
            carry, y = f(carry, tree_map(lambda a: a[i], xs))
            ys.append(y)
        if reverse:
            ys = ys[::-1]
        if length:
            return carry, tree_map(lambda *a: jnp.stack(a), *ys)
        saved = self.ctx, self.other  # zero-length: only the ys' shapes are needed
        x_spec = tree_map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), xs)
        y_spec = jax.eval_shape(lambda c, x: f(c, x)[1], init, x_spec)
        self.ctx, self.other = saved
        return carry, tree_map(lambda s: jnp.zeros((0, *s.shape), s.dtype), y_spec)

    def fori(self, lo, hi, body, init, unroll=None):
        v = init
        for i in range(int(lo), int(hi)):
            v = body(jnp.int32(i), v)
        return v

    def while_loop(self, cond, body, init):
        c = init
        while bool(cond(c)):
            c = body(c)
        return c

    def cond(self, pred, tf, ff, *ops):
        return tf(*ops) if bool(pred) else ff(*ops)

    def switch(self, index, branches, *ops):
        i = min(max(int(index), 0), len(branches) - 1)
        return branches[i](*ops)

    def jit(self, f):
        return f

    checkpoint = call = vmap = jit

    def grad(self, f):
        def g(x):
            def inner(x):
                self.in_grad += 1
                try:
                    out = f(x)
                finally:
                    self.in_grad -= 1
                return out, (self.ctx, self.other)
            d, (self.ctx, self.other) = jax.grad(inner, has_aux=True)(x)
            return d
        return g


# ---- programs ------------------------------------------------------------------------

@dataclasses.dataclass
class Prog:
    fn: Callable  # fn(B, *args)
    inputs: list  # a list of argument tuples (same shapes)
    grad: bool = True  # differentiable w.r.t. args[0]
    vmap: bool = True
    ctxs: tuple = (0.0, 1.5)


f32 = jnp.float32
XS = [(f32(0.5),), (f32(-1.25),), (f32(2.0),)]
PROGRAMS: dict[str, Prog] = {}


def program(inputs=XS, **kw):
    def deco(fn):
        PROGRAMS[fn.__name__.removeprefix("p_")] = Prog(fn, inputs, **kw)
        return fn
    return deco


@program()
def p_straight(B, x):
    a = B.tag(x, op="add")
    b = B.tag(x * 2, op="push")
    c = B.tag(x, op="get")
    d = B.tag(x + 1, op="scale")
    return a + b * c + d


@program()
def p_unused_results(B, x):
    B.tag(x * 3, op="add")  # results ignored: the effects must still happen
    B.tag(x, op="set")
    B.tag(x, op="push")
    return x * 2


@program()
def p_pytree_and_python_scalar_tokens(B, x):
    t = B.tag({"a": x, "b": (x * 2, jnp.arange(3.0) * x)}, op="add")
    g = B.tag((x, 1.0, jnp.int32(4)), op="get")  # python scalar: weak typed
    s = B.tag({"u": jnp.ones(2) * x}, op="scale")
    return t["a"] + t["b"][1].sum() + g[0] * g[1] + g[2] + s["u"].sum() + (x + B.tag(2.0, op="get"))


@program()
def p_int_token(B, x):
    k = B.tag(jnp.int32(3), op="add")
    return x * k


@program()
def p_jit(B, x):
    def inner(y):
        return B.tag(y * 2, op="push") + B.tag(y, op="get")
    return B.jit(inner)(x) + B.tag(x, op="add")


@program()
def p_nested_jit(B, x):
    def leaf(y):
        return B.tag(y, op="push") * 2

    def middle(y):
        return B.jit(leaf)(y) + B.jit(leaf)(y + 1) + B.tag(y, op="get")

    def outer(y):
        return B.jit(middle)(y) * B.tag(y, op="scale")

    return B.jit(outer)(x)


@program()
def p_scan_carry_and_xs(B, x):
    def body(c, xi):
        c = B.tag(c, op="push")
        y = B.tag(xi * c, op="add")
        g = B.tag(xi, op="get")
        return c + xi, y + g

    xs = x * jnp.arange(1.0, 4.0)
    return B.scan(body, x, xs)


@program()
def p_scan_reverse(B, x):
    def body(c, xi):
        y = B.tag(xi, op="push")
        g = B.tag(xi, op="get")
        return c * 0.5 + y, (g, B.tag(c, op="scale"))

    xs = x + jnp.arange(4.0)
    return B.scan(body, x, xs, reverse=True)


@program()
def p_scan_length_zero(B, x):
    def body(c, xi):
        return B.tag(c + xi, op="push"), B.tag(xi, op="get")

    xs = x * jnp.ones((0,))
    c, ys = B.scan(body, x, xs)
    return c, ys, B.tag(x, op="get")


@program()
def p_scan_no_xs(B, x):
    def body(c, _):
        return B.tag(c, op="push") * 0.5, B.tag(c, op="get")

    return B.scan(body, x, None, length=3)


@program()
def p_nested_scans(B, x):
    def inner(c, xi):
        c = B.tag(c + xi, op="push")
        return c, B.tag(xi, op="get")

    def outer(c, row):
        c2, ys = B.scan(inner, c, row)
        return c2 * 0.5, ys * B.tag(c, op="scale")

    xs = x * jnp.arange(6.0).reshape(2, 3)
    return B.scan(outer, x, xs, reverse=True)


@program()
def p_fori_static(B, x):
    def body(i, v):
        B.tag(i, op="add")
        return B.tag(v, op="push") * 0.5 + B.tag(v, op="get")

    return B.fori(0, 4, body, x)


@program(inputs=[(f32(0.5), jnp.int32(3)), (f32(-1.0), jnp.int32(0)),
                 (f32(2.0), jnp.int32(5))], grad=False)
def p_fori_traced(B, x, n):
    def body(i, v):
        B.tag(i, op="add")
        return B.tag(v, op="push") * 0.5 + B.tag(v, op="get")

    return B.fori(0, n, body, x)


@program(inputs=[(f32(0.5),), (f32(2.0),), (f32(7.0),), (f32(20.0),)], grad=False,
         ctxs=(0.0, 4.0, 12.0))
def p_while_cond_reads_ctx(B, x):
    def cond(c):
        # loop until acc >= 10 (every loop here is capped: it must end whatever
        # the tags are replaced by)
        return (c[0] < 12) & (B.tag(c[0].astype(jnp.float32), op="get") < 10.0)

    def body(c):
        i, v = c
        B.tag(jnp.abs(v) + 1.0, op="add")
        return i + 1, v * 0.5 + B.tag(v, op="get")

    return B.while_loop(cond, body, (jnp.int32(0), x))


@program(inputs=[(f32(0.5), jnp.int32(3)), (f32(2.0), jnp.int32(0)),
                 (f32(-3.0), jnp.int32(2))], grad=False)
def p_while_cond_writes_ctx(B, x, n):
    def cond(c):
        i, v = c
        B.tag(v, op="push")  # runs n+1 times: once more at the end
        return i < n

    def body(c):
        i, v = c
        return i + 1, B.tag(v, op="scale") + B.tag(v, op="get")

    return B.while_loop(cond, body, (jnp.int32(0), x))


@program(inputs=[(f32(0.5), jnp.int32(3)), (f32(2.0), jnp.int32(0))], grad=False)
def p_while_body_only(B, x, n):
    def body(c):
        i, v = c
        return i + 1, B.tag(v, op="push") + 1.0

    return B.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), x))


@program()
def p_cond(B, x):
    def tf(y):
        return B.tag(y, op="push") * 2 + B.tag(y, op="get")

    def ff(y):
        return y - 1.0  # no tag: passes ctx through

    a = B.cond(x > 0, tf, ff, x)
    b = B.cond(x < 1, ff, lambda y: B.tag(y, op="scale"), x)
    return a + b


@program(inputs=[(f32(0.5), jnp.int32(0)), (f32(-1.0), jnp.int32(1)),
                 (f32(2.0), jnp.int32(2)), (f32(1.0), jnp.int32(7)),
                 (f32(1.5), jnp.int32(-3))])
def p_switch(B, x, i):
    branches = [
        lambda y: B.tag(y, op="add") * 2,
        lambda y: y + 3.0,
        lambda y: B.tag(y, op="push") + B.tag(y, op="get"),
    ]
    return B.switch(i, branches, x)


@program()
def p_checkpoint(B, x):
    def f(y):
        return jnp.sin(B.tag(y, op="push")) * B.tag(y, op="get")

    return B.checkpoint(f)(x) + B.tag(x, op="add")


@program(grad=False)
def p_grad_of_checkpoint(B, x):
    def f(y):
        B.tag(y, op="add")  # must happen once although the backward pass remats
        return jnp.sin(B.tag(y * 2, op="push")) * B.tag(y, op="get")

    return B.grad(B.checkpoint(f))(x), B.tag(x, op="get")


@program()
def p_closed_call(B, x):
    def f(y, z):
        return B.tag(y, op="push") * z + B.tag(z, op="get")

    return B.call(f)(x, x + 1)


@program()
def p_cond_in_scan_in_jit(B, x):
    def body(c, xi):
        def tf(v):
            return B.tag(v, op="push")

        def ff(v):
            return B.tag(v, op="get") - 1.0

        c = B.cond(xi > 1.0, tf, ff, c + xi)
        return c, B.tag(c, op="scale")

    def f(y):
        return B.scan(body, y, y * jnp.arange(4.0))

    return B.jit(f)(x)


@program(inputs=[(f32(0.5),), (f32(2.0),), (f32(4.0),)], grad=False)
def p_while_in_scan(B, x):
    def body(c, xi):
        def wbody(s):
            i, v = s
            return i + 1, B.tag(v, op="push")

        def wcond(s):
            return (s[0] < 3) & (B.tag(s[1], op="get") < 20.0)

        _, v = B.while_loop(wcond, wbody, (jnp.int32(0), c + xi))
        return v * 0.5, B.tag(xi, op="add")

    return B.scan(body, x, jnp.arange(3.0))


@program(inputs=[(f32(0.5), jnp.int32(2)), (f32(3.0), jnp.int32(3))], grad=False)
def p_scan_in_while_body(B, x, n):
    def wbody(s):
        i, v = s

        def sbody(c, xi):
            return B.tag(c, op="push") + xi, B.tag(xi, op="get")

        v, ys = B.scan(sbody, v, jnp.arange(2.0))
        return i + 1, v * 0.25 + ys.sum()

    return B.while_loop(lambda s: s[0] < n, wbody, (jnp.int32(0), x))


@program()
def p_switch_in_fori_in_checkpoint(B, x):
    def body(i, v):
        return B.switch(i % 3, [
            lambda y: B.tag(y, op="push"),
            lambda y: y * 1.5,
            lambda y: B.tag(y, op="get") + y,
        ], v)

    return B.checkpoint(lambda y: B.fori(0, 5, body, y))(x)


# JAX 0.10 itself (no taxpr involved) fails vmap of a closed_call inside a scan
# under jax_enable_checks: "_check_closed_call() got an unexpected keyword
# argument 'name'".
@program(vmap=JAX_VERSION >= (0, 11))
def p_call_and_checkpoint_in_scan(B, x):
    def body(c, xi):
        a = B.call(lambda u: B.tag(u, op="push") * 2)(c)
        b = B.checkpoint(lambda u: B.tag(u, op="get") + u)(xi)
        return a * 0.5, b

    return B.scan(body, x, x + jnp.arange(3.0))


BIG = np.arange(5.0, dtype=np.float32)  # a closed-over numpy constant


@program()
def p_scan_and_fori_unrolled(B, x):
    def body(c, xi):
        return B.tag(c, op="push") * 0.5 + xi, B.tag(xi, op="get")

    c, ys = B.scan(body, x, jnp.arange(5.0), unroll=2)
    return B.fori(0, 3, lambda i, v: B.tag(v, op="push") * 0.5, c, unroll=2), ys


@program(inputs=[(f32(0.5),), (f32(1.0),), (f32(3.0),)], grad=False)
def p_while_closes_over_consts(B, x):
    def cond(c):
        return (c[0] < 8) & (B.tag(c[1], op="push") < x * BIG[3] + 1.0)

    def body(c):
        return c[0] + 1, c[1] + x * BIG[2] + B.tag(c[1] * BIG[1], op="get") * 0.1

    return B.while_loop(cond, body, (0, x))


@program()
def p_cond_without_operands_and_literal_tags(B, x):
    a = B.cond(x > 0, lambda: B.tag(f32(1.0), op="add"), lambda: f32(2.0))
    b = B.jit(lambda y: y + B.tag(2.0, op="push") + B.tag(y, op="get"))(x)
    c = B.tag(x, op="push") + B.tag(x, op="push")  # the same variable tagged twice
    return a + b + c


@program(inputs=[(f32(0.5),), (f32(2.0),), (f32(9.0),)], grad=False)
def p_loops_in_while_cond(B, x):
    def inner_cond(d):
        return B.tag(d, op="push") < 5.0

    def cond(ic):
        i, c = ic
        d = B.while_loop(inner_cond, lambda d: d + 1.0, c)
        e = B.cond(c > 2, lambda v: B.tag(v, op="get"), lambda v: v, c)
        return (i < 10) & ((d + e) < 12.0)

    def body(ic):
        return ic[0] + 1, ic[1] + 1.0 + B.tag(ic[1], op="add") * 0

    return B.while_loop(cond, body, (0, x))


@program(inputs=[(f32(0.5),), (f32(2.0),), (f32(30.0),)], grad=False)
def p_checkpoint_and_jit_in_while(B, x):
    step = B.checkpoint(lambda c: (c[0] + 1, B.tag(c[1], op="push") + 1.0))
    test = B.jit(lambda c: (c[0] < 25) & (B.tag(c[1], op="get") < 20.0))
    return B.while_loop(test, step, (0, x))


@program(inputs=[(jnp.array([0.5, -1.0, 2.0], jnp.float32),),
                 (jnp.array([1.0, 0.25, -3.0], jnp.float32),)])
def p_vmap_inside(B, x):
    # the tags see the batched token once (vmap is not a loop)
    def f(v):
        return B.tag(v, op="get") * v + B.tag(v * 2, op="add")

    return B.vmap(f)(x), B.tag(x.sum(), op="push")


# ---- running both ----------------------------------------------------------------------

def trace(prog: Prog, args, predicate=None, ctx=None):
    ctx = ctx0() if ctx is None else ctx
    with tx.keep_tags():  # the tags will be consumed by inject
        closed, shape = jax.make_jaxpr(functools.partial(prog.fn, LAX), return_shape=True)(*args)
    new = tx.inject(closed, injector, ctx, predicate)
    check(new)
    return closed, new, jax.tree_util.tree_structure(shape)


def run(new, out_tree, ctx, args, fun=None):
    ctx_leaves, ctx_tree = tree_flatten(ctx)
    fun = fun or jaxpr_as_fun(new)
    outs = fun(*ctx_leaves, *tree_leaves(args))
    n = out_tree.num_leaves
    return (jax.tree_util.tree_unflatten(out_tree, outs[:n]),
            jax.tree_util.tree_unflatten(ctx_tree, outs[n:]))


def eager(prog: Prog, args, ctx, predicate=None):
    e = Eager(ctx, predicate)
    out = prog.fn(e, *args)
    return out, e.ctx


def assert_close(got, want):
    gl, gt = tree_flatten(got)
    wl, wt = tree_flatten(want)
    assert gt == wt, (gt, wt)
    for g, w in zip(gl, wl):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape, (g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def loss(out, ctx):
    return sum(jnp.sum(l) for l in tree_leaves((out, ctx["acc"]))
               if jnp.issubdtype(jnp.result_type(l), jnp.floating))


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


PREDICATES = {
    "not_get": lambda p, s: p["op"] != "get",
    "only_push": lambda p, s: p["op"] == "push",
    "scalars_only": lambda p, s: all(getattr(l, "shape", None) == () for l in tree_leaves(s)),
}


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

def jax_still_works():
    assert float(jax.jit(lambda x: x * 2)(1.0)) == 2.0

    def fresh(x):
        return jnp.sin(x) * x

    np.testing.assert_allclose(jax.grad(fresh)(0.3), np.cos(0.3) * 0.3 + np.sin(0.3),
                               rtol=1e-6)
    assert len(jax.make_jaxpr(lambda x: jnp.sin(x) + 1)(1.0).eqns) == 2


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


# ---- derivatives of ctx-dependent injectors inside the traced program ----------------------

WRAPPERS = {
    "none": lambda B, f: f,
    "jit": lambda B, f: B.jit(f),
    "checkpoint": lambda B, f: B.checkpoint(f),
    "cond": lambda B, f: lambda y: B.cond(y > -100.0, f, lambda v: v * 0.0, y),
    "scan": lambda B, f: lambda y: B.scan(lambda c, _: (f(c), None), y, None, length=1)[0],
}
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

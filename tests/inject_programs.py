"""The program corpus that tests inject (tests/test_inject.py) and its
threading engine (tests/test_engine.py): every program is written once
against a small "backend" ``B``:

* ``LAX`` traces it with raw JAX (``tx.tag``, ``lax.scan``, ``lax.cond``, ...);
  the jaxpr is then rewritten by ``tx.inject``.
* ``Eager`` runs it with Python control flow, ``ctx`` a Python attribute that
  every tag replaces by calling the injector -- the meaning inject has
  (the per-primitive table in docs/semantics.md).

Also here: the injector the programs are run with (``injector``, its starting
ctx ``ctx0``), the programs themselves (``PROGRAMS``, one ``Prog`` each: its
inputs and whether it is differentiated and vmapped), the predicates and the
wrappers (jit, checkpoint, cond, scan) the tests combine them with, and the
runners: ``trace`` (trace with ``LAX`` and inject), ``run`` (call the
result), ``eager`` (the reference), ``assert_close``, ``loss`` and
``jax_still_works``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
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


# ---- predicates and wrappers the programs are combined with ----------------------------

PREDICATES = {
    "not_get": lambda p, s: p["op"] != "get",
    "only_push": lambda p, s: p["op"] == "push",
    "scalars_only": lambda p, s: all(getattr(l, "shape", None) == () for l in tree_leaves(s)),
}


WRAPPERS = {
    "none": lambda B, f: f,
    "jit": lambda B, f: B.jit(f),
    "checkpoint": lambda B, f: B.checkpoint(f),
    "cond": lambda B, f: lambda y: B.cond(y > -100.0, f, lambda v: v * 0.0, y),
    "scan": lambda B, f: lambda y: B.scan(lambda c, _: (f(c), None), y, None, length=1)[0],
}


# ---- JAX after an error ----------------------------------------------------------------

def jax_still_works():
    assert float(jax.jit(lambda x: x * 2)(1.0)) == 2.0

    def fresh(x):
        return jnp.sin(x) * x

    np.testing.assert_allclose(jax.grad(fresh)(0.3), np.cos(0.3) * 0.3 + np.sin(0.3),
                               rtol=1e-6)
    assert len(jax.make_jaxpr(lambda x: jnp.sin(x) + 1)(1.0).eqns) == 2

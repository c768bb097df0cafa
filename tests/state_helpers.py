"""What the state tests (tests/state/) share: every program is written once
against a small backend ``S``:

* ``TX`` traces it with raw JAX (``tx.get_state``, ``lax.scan``, ``lax.cond``,
  ``jax.jit``, ...); ``tx.uncurry`` turns it into ``pure(state, *args)``.
* ``Eager`` runs the same code with Python control flow and a mutable dict of
  states -- the meaning state has (docs/state.md, "Semantics").

Both must agree on the output and on the final states, for several inputs and
several starting states (``check_program``). Also here: the comparisons
(``assert_close``, ``assert_states``), ``perturb`` (another starting state of
the same types), ``jax_still_works`` and the programs several test files run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import taxpr as tx
from helpers import check

tree_map = jax.tree_util.tree_map
tree_leaves = jax.tree_util.tree_leaves


# ---- the two backends --------------------------------------------------------------------

class _TX:
    """Raw JAX: taxpr state plus lax control flow."""

    get = staticmethod(tx.get_state)
    set = staticmethod(tx.set_state)
    scan = staticmethod(lax.scan)
    cond = staticmethod(lax.cond)
    switch = staticmethod(lax.switch)
    while_loop = staticmethod(lax.while_loop)
    fori_loop = staticmethod(lax.fori_loop)
    jit = staticmethod(jax.jit)
    checkpoint = staticmethod(jax.checkpoint)
    vmap = staticmethod(jax.vmap)
    grad = staticmethod(jax.grad)


TX = _TX()


class Eager:
    """Eager reference: Python control flow and a mutable dict of states.

    ``first`` records each state's value at first use (its ``init`` when first
    read, zeros when first set) -- what ``uncurry``'s ``state0`` must be.
    """

    def __init__(self, state=None):
        self.state = dict(state or {})
        self.first = {}

    def get(self, name, init):
        if name not in self.state:
            value = jnp.asarray(init() if callable(init) else init)
            self.state[name] = self.first[name] = value
        return self.state[name]

    def set(self, name, value):
        value = jnp.asarray(value)
        if name not in self.state:
            self.first[name] = jnp.zeros_like(value)
        self.state[name] = value
        return value

    def scan(self, f, init, xs=None, length=None, reverse=False):
        n = length if xs is None else len(tree_leaves(xs)[0])
        idx = range(n - 1, -1, -1) if reverse else range(n)
        carry, ys = init, [None] * n
        if n == 0:
            # The shape of ys without running f's effects.
            saved = dict(self.state), dict(self.first)
            x0 = None if xs is None else tree_map(lambda a: a[0] if len(a) else
                                                  jnp.zeros(a.shape[1:], a.dtype), xs)
            y_shape = jax.eval_shape(lambda c, x: f(c, x)[1], carry, x0)
            self.state, self.first = saved
            return carry, tree_map(lambda s: jnp.zeros((0, *s.shape), s.dtype), y_shape)
        for i in idx:
            x = None if xs is None else tree_map(lambda a: a[i], xs)
            carry, ys[i] = f(carry, x)
        if ys[0] is None:
            return carry, None
        return carry, tree_map(lambda *a: jnp.stack(a), *ys)

    # Under the eval_shape of a length-0 scan, predicates are abstract: any
    # branch gives the shapes.
    def cond(self, pred, true_fun, false_fun, *ops):
        if isinstance(pred, jax.core.Tracer):
            return true_fun(*ops)
        return true_fun(*ops) if bool(pred) else false_fun(*ops)

    def switch(self, index, branches, *ops):
        if isinstance(index, jax.core.Tracer):
            return branches[0](*ops)
        return branches[int(np.clip(index, 0, len(branches) - 1))](*ops)

    def while_loop(self, cond_fun, body_fun, val):
        if isinstance(cond_fun(val), jax.core.Tracer):
            return val
        while bool(cond_fun(val)):
            val = body_fun(val)
        return val

    def fori_loop(self, lower, upper, body, val):
        for i in range(int(lower), int(upper)):
            val = body(jnp.int32(i), val)
        return val

    def jit(self, f):
        return f

    def checkpoint(self, f):
        return f

    vmap = staticmethod(jax.vmap)
    grad = staticmethod(jax.grad)


# ---- comparison helpers ------------------------------------------------------------------

def assert_close(got, want, rtol=1e-5, atol=1e-5):
    g, gt = jax.tree_util.tree_flatten(got)
    w, wt = jax.tree_util.tree_flatten(want)
    assert gt == wt, (gt, wt)
    for a, b in zip(g, w):
        assert np.shape(a) == np.shape(b), (np.shape(a), np.shape(b))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def assert_states(got: dict, want: dict, like: dict | None = None):
    """Same names and values; dtypes exactly those of ``like`` (state0)."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    assert_close(got, want)
    for n, v in got.items():
        ref = (like or want)[n]
        assert jnp.result_type(v) == jnp.result_type(ref), (n, v, ref)


def perturb(state: dict, k: int) -> dict:
    """A different starting state of the same types."""
    out = {}
    for i, (n, v) in enumerate(sorted(state.items())):
        v = jnp.asarray(v)
        if v.dtype == jnp.bool_:
            out[n] = jnp.logical_not(v) if k % 2 else v
        elif jnp.issubdtype(v.dtype, jnp.integer):
            out[n] = v + jnp.asarray(k + i, v.dtype)
        else:
            noise = jax.random.normal(jax.random.key(17 * k + i), v.shape, v.dtype)
            out[n] = v + 0.5 * noise
    return out


def check_program(prog, example, inputs, n_perturb=1, kwargs=None):
    """uncurry(prog(TX, ...)) against prog(Eager, ...): state0, outputs, final states."""
    kwargs = kwargs or {}
    fn = functools.partial(prog, TX)
    pure, state0 = tx.uncurry(fn, *example, **kwargs)
    # state0 = each state's value at first use in an eager run of the example.
    ref = Eager()
    prog(ref, *example, **kwargs)
    assert set(ref.first) <= set(state0), (sorted(ref.first), sorted(state0))
    assert_close({n: state0[n] for n in ref.first}, ref.first)
    for n in ref.first:
        assert jnp.result_type(state0[n]) == jnp.result_type(ref.first[n]), n
    for args in inputs:
        starts = [state0] + [perturb(state0, k + 1) for k in range(n_perturb)]
        for start in starts:
            out, state1 = pure(start, *args, **kwargs)
            ref = Eager(start)
            want = prog(ref, *args, **kwargs)
            assert_close(out, want)
            assert_states(state1, ref.state, like=state0)
    jaxpr, _ = tx.make_jaxpr(fn)(*example, **kwargs)
    check(jaxpr)
    check(jax.make_jaxpr(pure)(state0, *example, **kwargs))
    return pure, state0


def check_vmap_over_states(pure, state0, args, reference):
    """``jax.vmap(pure)`` over a batch of two starting states (``state0`` and
    ``state0 + 1``) against ``reference(state, *args) -> (out, new_state)``
    run on each."""
    batch = tree_map(lambda a: jnp.stack([a, a + 1]), state0)
    outs, news = jax.vmap(pure, in_axes=(0,) + (None,) * len(args))(batch, *args)
    for i in range(2):
        want_out, want = reference(tree_map(lambda a: a[i], batch), *args)
        assert_close(outs[i], want_out)
        assert_close(tree_map(lambda a: a[i], news), want)


def sow_after_a_first_use_in_a_branch(x, p, calls: list):
    """Reads state "c" first in a cond branch (so ``uncurry`` runs the
    function once to find its initial value, 2), sets it to the branch's
    value, appends to ``calls`` from a ``jax.debug.callback`` and returns
    that value sown as "y" (tag "t", append mode)."""
    c0 = jnp.full(2, 2.0, jnp.float32)
    y = lax.cond(p > 0, lambda x: x * tx.get_state("c", c0), lambda x: x, x)
    tx.set_state("c", y)
    jax.debug.callback(lambda: calls.append(1))
    return tx.harvest.sow(y, tag="t", name="y", mode="append")


def jax_still_works():
    assert float(jax.jit(lambda x: x * 2)(1.0)) == 2.0
    assert float(jax.grad(lambda x: jnp.sin(x) * x)(0.0)) == 0.0
    assert float(jax.grad(lambda x: x ** 3)(2.0)) == 12.0


f32 = jnp.float32
i32 = jnp.int32
key = jax.random.key


def rnd(k, *shape):
    return jax.random.normal(key(k), shape, f32)


# ---- programs ----------------------------------------------------------------------------

def straight(S, x):
    a = S.get("a", jnp.zeros(3))
    b = S.get("b", lambda: jnp.ones((), i32))
    S.set("a", a + x)
    S.set("b", b * 2)
    a2 = S.get("a", jnp.zeros(3))
    S.set("a", a2 * 3.0)
    return a2.sum() + b, S.get("a", jnp.zeros(3))


def scan_body(S, carry, x):
    n = S.get("n", jnp.zeros((), i32))
    acc = S.get("acc", lambda: jnp.full((2,), 0.5, f32))
    S.set("n", n + 1)
    S.set("acc", acc * 0.5 + x * carry)
    return carry + acc.sum(), carry * x.sum() + n


def scan_prog(S, c, xs, reverse=False):
    return S.scan(functools.partial(scan_body, S), c, xs, reverse=reverse)


def fori_prog(S, x, lo, hi):
    def body(i, c):
        k = S.get("k", jnp.zeros((), f32))
        S.set("k", k + c * i)
        S.set("last", i)
        return c * 0.9 + 1.0
    return S.fori_loop(lo, hi, body, x)


def while_prog(S, x, limit):
    def cond(c):
        return S.get("n", jnp.zeros((), i32)) < limit

    def body(c):
        n = S.get("n", jnp.zeros((), i32))
        S.set("n", n + 1)
        s = S.get("s", jnp.zeros(2, f32))
        S.set("s", s + c)
        return c * 1.5
    return S.while_loop(cond, body, x)


def _br_a(S, x):
    S.set("a", S.get("a", jnp.full((), 5.0, f32)) + x)
    return x * 2.0


def _br_b(S, x):
    S.set("b", S.get("b", jnp.full((), -1.0, f32)) - x)
    return x + 1.0


def _br_none(S, x):
    return -x


def cond_prog(S, p, x):
    return S.cond(p, functools.partial(_br_a, S), functools.partial(_br_b, S), x)


def switch_prog(S, i, x):
    return S.switch(i, [functools.partial(b, S) for b in (_br_a, _br_b, _br_none)], x)


def jit_prog(S, x):
    @S.jit
    def inner(x):
        c = S.get("c", jnp.zeros((), f32))
        S.set("c", c + x.sum())
        return x * 2.0

    @S.jit
    def outer(x):
        y = inner(inner(x))
        return y + S.get("c", jnp.zeros((), f32))
    return outer(x)


def checkpoint_prog(S, x):
    def g(x):
        c = S.get("c", jnp.ones((), f32))
        S.set("c", c * 2.0 + jnp.sin(x).sum())
        return jnp.cos(x) * c
    return S.checkpoint(g)(x) + S.get("c", jnp.ones((), f32))


def nested_python_prog(S, x):
    def bump(name, by):
        v = S.get(name, jnp.zeros((), f32))
        return S.set(name, v + by)

    def layer(x, i):
        h = jnp.tanh(x * (i + 1.0))
        bump(f"l{i}", h.sum())
        bump("total", 1.0)
        return h

    def net(x):
        for i in range(3):
            x = layer(x, i)
        return x
    return net(x)


def cond_scan_jit_prog(S, xs):
    @S.jit
    def run(xs):
        def body(c, x):
            def hit(c):
                S.set("hits", S.get("hits", jnp.zeros((), i32)) + 1)
                return c + x
            def miss(c):
                S.set("miss", S.get("miss", jnp.zeros((), f32)) + x)
                return c - 1.0
            return S.cond(x > 0, hit, miss, c), c
        return S.scan(body, jnp.zeros((), f32), xs)
    return run(xs)


def while_in_scan_prog(S, ns):
    def body(c, n):
        def wc(v):
            return v[0] < n

        def wb(v):
            t = S.get("ticks", jnp.zeros((), i32))
            S.set("ticks", t + 1)
            return v[0] + 1, v[1] * 1.1 + S.get("w", jnp.ones((), f32))
        _, y = S.while_loop(wc, wb, (jnp.zeros((), i32), c))
        S.set("w", S.get("w", jnp.ones((), f32)) * 0.5)
        return y, y
    return S.scan(body, jnp.ones((), f32), ns)


def scan_in_scan_prog(S, xss):
    def inner(c, x):
        m = S.get("m", lambda: jnp.zeros((2,), f32))
        S.set("m", m * 0.9 + x)
        return c + (m * x).sum(), None

    def outer(c, xs):
        c2, _ = S.scan(inner, c, xs)
        S.set("rows", S.get("rows", jnp.zeros((), i32)) + 1)
        return c2 * 0.5, c2
    return S.scan(outer, jnp.zeros((), f32), xss, reverse=True)


def created_in_loop_prog(S, x, n):
    def body(i, c):
        # "h" and "seen" first appear here, never outside the loop.
        h = S.get("h", jnp.full((2,), 3.0, f32))
        S.set("h", h * c + i)
        S.set("seen", i)
        return c + 0.25
    c = S.fori_loop(0, n, body, x)
    return c


def set_only_prog(S, x):
    S.set("written", x * 2.0)
    S.set("count", jnp.ones((), i32))
    return x


def init_kinds_prog(S, x):
    a = S.get("arr", jnp.arange(3.0))
    b = S.get("call", lambda: jnp.ones(3))
    c = S.get("int", lambda: jnp.array([7, 8], i32))
    d = S.get("flag", jnp.array(True))
    e = S.get("dep", x * 3.0)  # an init computed from the arguments
    S.set("arr", a + x)
    S.set("flag", jnp.logical_not(d))
    S.set("dep", e + 1.0)
    return (a + b + e).sum() + c.sum() + d


# ---- custom_vjp functions around states --------------------------------------------

def custom_vjp_of(fn):
    """``fn`` as a custom_vjp function whose rules are JAX's own derivative
    of ``fn`` (fwd runs ``fn``; bwd is ``jax.vjp`` of it, run again)."""
    g = jax.custom_vjp(fn)
    g.defvjp(lambda *p: (fn(*p), p), lambda p, ct: jax.vjp(fn, *p)[1](ct))
    return g


def counting_and_scaling_custom_vjps():
    """``(count, read_scale)``: two custom_vjp functions of ``(a, b)``, one
    counting its calls in the int state ``calls``, one scaling ``a`` by the
    float state ``scale`` (which the first does not touch)."""
    @custom_vjp_of
    def count(a, b):
        tx.set_state("calls", tx.get_state("calls", np.int32(0)) + 1)
        return a, b

    @custom_vjp_of
    def read_scale(a, b):
        return a * tx.get_state("scale", np.float32(0.5)), b

    return count, read_scale

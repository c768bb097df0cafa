"""``uncurry`` and ``make_jaxpr`` (``taxpr._state._uncurry``): the state dict
``pure`` takes (checked; entries its call path does not use pass through),
non-array arguments static and each signature traced once, what
``make_jaxpr`` returns (the states, their order, its options), ``uncurry``
inside a function being uncurried, and results that never depend on JAX's
trace caches.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import jaxpr_as_fun

import taxpr as tx
from taxpr import harvest as h

from helpers import check
from state_helpers import (TX, Eager, assert_close, assert_states, f32, i32, jax_still_works,
                           perturb, sow_after_a_first_use_in_a_branch, straight, tree_leaves)


# ---- the state dict of pure --------------------------------------------------------------

def test_wrong_state_dict_passed_to_pure():
    pure, s0 = tx.uncurry(functools.partial(straight, TX), jnp.ones(3))
    x = jnp.ones(3)
    with pytest.raises(tx.StateError, match="'b'|b"):
        pure({"a": s0["a"]}, x)  # missing key
    jax_still_works()
    # An unknown key passes through unchanged, as in a dict .
    _, s1 = pure({**s0, "extra": f32(3.0)}, x)
    assert_close(s1["extra"], f32(3.0))
    with pytest.raises(tx.StateError, match="'a'"):
        pure({**s0, "a": jnp.zeros(4)}, x)  # wrong shape
    jax_still_works()
    with pytest.raises(tx.StateError, match="'b'"):
        pure({**s0, "b": jnp.zeros((), f32)}, x)  # wrong dtype
    jax_still_works()
    # Also when pure is jitted (the check runs at trace time).
    with pytest.raises(tx.StateError, match="'a'"):
        jax.jit(pure)({**s0, "a": jnp.zeros((2, 3))}, x)
    jax_still_works()
    # Still usable afterwards.
    out, s1 = pure(s0, x)
    ref = Eager(s0)
    assert_close(out, straight(ref, x))


def _two_paths(S, x, which: str):
    """Two call paths that touch different states (``which`` is static)."""
    if which == "a":
        S.set("a", S.get("a", jnp.zeros((), f32)) + x)
    else:
        S.set("b", S.get("b", jnp.ones((2,), f32)) * x)
    return x * 2.0


def test_pure_passes_entries_its_path_does_not_touch_through_unchanged():
    fn = functools.partial(_two_paths, TX)
    pure, s0 = tx.uncurry(fn, f32(1.0), "a")
    # The state after "training" both paths, fed to the path that touches "a" only.
    full = {"a": f32(3.0), "b": jnp.array([4.0, 5.0], f32), "step": i32(7)}
    for p in (pure, jax.jit(pure, static_argnums=2)):
        out, s1 = p(full, f32(2.0), "a")
        ref = Eager(full)
        want = _two_paths(ref, f32(2.0), "a")
        assert_close(out, want)
        assert_states(s1, ref.state)
        out, s1 = p(full, f32(2.0), "b")
        ref = Eager(full)
        _two_paths(ref, f32(2.0), "b")
        assert_states(s1, ref.state)


def test_pure_still_requires_the_states_its_path_uses():
    pure, s0 = tx.uncurry(functools.partial(_two_paths, TX), f32(1.0), "a")
    with pytest.raises(tx.StateError, match=r"missing \['a'\]"):
        pure({"b": jnp.ones(2)}, f32(1.0), "a")
    jax_still_works()


# ---- static (non-array) arguments --------------------------------------------------------

def test_non_array_arguments_are_static():
    traces = []

    def fn(x, n, flag, mode, act):
        traces.append((n, flag, mode, act))
        c = tx.get_state("c", jnp.zeros((), f32))
        y = x
        for _ in range(n):  # needs a concrete n
            y = act(y)
        if flag:
            y = -y
        if mode == "double":
            y = y * 2.0
        tx.set_state("c", c + y.sum())
        return y

    x = jnp.array([0.5, -1.0])
    pure, s0 = tx.uncurry(fn, x, 2, True, "double", jnp.tanh)
    n0 = len(traces)

    def ref(x, n, flag, mode, act, c):
        e = Eager({"c": c})
        y = x
        for _ in range(n):
            y = act(y)
        y = -y if flag else y
        y = y * 2.0 if mode == "double" else y
        e.set("c", e.get("c", None) + y.sum())
        return y, e.state

    for args in [(2, True, "double", jnp.tanh), (3, False, "single", jnp.sin),
                 (0, True, "double", jnp.tanh), (2, True, "double", jnp.sin)]:
        out, s1 = pure(s0, x, *args)
        want, wstate = ref(x, *args, s0["c"])
        assert_close(out, want)
        assert_close(s1, wstate)
    # Each distinct static value traced once; the first is the cached example trace.
    assert len(traces) == n0 + 3, traces
    pure(s0, x, 3, False, "single", jnp.sin)
    pure(s0, x * 2, 2, True, "double", jnp.tanh)
    assert len(traces) == n0 + 3
    # A keyword static argument too.
    out, _ = pure(s0, x, 1, flag=False, mode="x", act=jnp.cos)
    assert_close(out, jnp.cos(x))


def test_python_scalars_are_static_arrays_are_traced():
    traces = []

    def fn(x, s):
        traces.append(1)
        tx.set_state("last", jnp.asarray(x, f32) * s)
        return x * s

    pure, s0 = tx.uncurry(fn, f32(1.0), 2.0)
    n0 = len(traces)
    pure(s0, f32(3.0), 2.0)
    pure(s0, f32(4.0), 2.0)
    assert len(traces) == n0  # arrays don't retrace
    out, s1 = pure(s0, f32(3.0), 5.0)
    assert len(traces) == n0 + 1  # a new Python scalar does
    assert_close(out, f32(15.0))
    assert_close(s1, {"last": f32(15.0)})


# ---- make_jaxpr --------------------------------------------------------------------------

def _mixed(x, y):
    r = tx.get_state("r_only", jnp.ones(2))
    tx.set_state("w_only", jnp.zeros((), i32) + 4)
    rw = tx.get_state("rw", lambda: jnp.zeros((2, 2), f32))
    tx.set_state("rw", rw + x[:, None] * y)
    return {"sum": (r * x).sum(), "prod": x * y}


def test_make_jaxpr_state_reports_and_order():
    x, y = jnp.array([1.0, 2.0]), f32(3.0)
    jaxpr, states = tx.make_jaxpr(_mixed)(x, y)
    check(jaxpr)
    assert all(isinstance(s, tx.StateInfo) for s in states)
    by_name = {s.name: s for s in states}
    assert sorted(by_name) == ["r_only", "rw", "w_only"]
    assert by_name["r_only"] == tx.StateInfo("r_only", (2,), jnp.dtype(f32), True, False)
    assert by_name["w_only"] == tx.StateInfo("w_only", (), jnp.dtype(i32), False, True)
    assert by_name["rw"] == tx.StateInfo("rw", (2, 2), jnp.dtype(f32), True, True)
    # Input avals follow the order of ``states`` ...
    in_avals = jaxpr.in_avals
    assert len(in_avals) == len(states) + 2
    for s, a in zip(states, in_avals):
        assert tuple(a.shape) == s.shape and a.dtype == s.dtype
    assert len(jaxpr.out_avals) == 2 + len(states)
    # ... and running it agrees with uncurry.
    pure, s0 = tx.uncurry(_mixed, x, y)
    start = perturb(s0, 1)
    outs = jaxpr_as_fun(jaxpr)(*(start[s.name] for s in states), x, y)
    out, s1 = pure(start, x, y)
    flat_out = tree_leaves(out)
    assert_close(list(outs[:2]), flat_out)
    assert_close(list(outs[2:]), [s1[s.name] for s in states])


def test_make_jaxpr_return_only_write_and_shape():
    x, y = jnp.array([1.0, 2.0]), f32(3.0)
    jaxpr, states, shape = tx.make_jaxpr(_mixed, return_only_write=True,
                                         return_shape=True)(x, y)
    check(jaxpr)
    written = [s for s in states if s.written]
    assert len(jaxpr.in_avals) == len(states) + 2
    assert len(jaxpr.out_avals) == 2 + len(written)
    assert shape == jax.eval_shape(_mixed, x, y)
    assert isinstance(shape["prod"], jax.ShapeDtypeStruct)
    pure, s0 = tx.uncurry(_mixed, x, y)
    start = perturb(s0, 2)
    outs = jaxpr_as_fun(jaxpr)(*(start[s.name] for s in states), x, y)
    _, s1 = pure(start, x, y)
    assert_close(list(outs[2:]), [s1[s.name] for s in written])
    # return_shape without return_only_write.
    jaxpr2, states2, shape2 = tx.make_jaxpr(_mixed, return_shape=True)(x, y)
    assert states2 == states and shape2 == shape
    assert len(jaxpr2.out_avals) == 2 + len(states)


def test_make_jaxpr_static_args():
    def fn(x, n, *, mode):
        c = tx.get_state("c", jnp.zeros((), f32))
        for _ in range(n):
            x = x * 2.0
        if mode == "neg":
            x = -x
        tx.set_state("c", c + x.sum())
        return x

    jaxpr, states = tx.make_jaxpr(fn, static_argnums=1, static_argnames="mode")(
        jnp.ones(2), 3, mode="neg")
    check(jaxpr)
    assert [s.name for s in states] == ["c"]
    assert len(jaxpr.in_avals) == 2  # c, x
    out, c1 = jaxpr_as_fun(jaxpr)(f32(1.0), jnp.ones(2))
    assert_close(out, jnp.full(2, -8.0))
    assert_close(c1, f32(-15.0))
    jaxpr, _ = tx.make_jaxpr(fn, static_argnums=(1,), static_argnames=("mode",))(
        jnp.ones(2), 1, mode="pos")
    out, c1 = jaxpr_as_fun(jaxpr)(f32(0.0), jnp.ones(2))
    assert_close(out, jnp.full(2, 2.0))


def test_make_jaxpr_without_state_is_jax_make_jaxpr():
    def fn(x, y):
        def body(c, x):
            return c + jnp.sin(x), c
        c, ys = lax.scan(body, y, x)
        return jax.jit(lambda a: a * 2)(c), ys

    x, y = jnp.arange(3.0), f32(1.0)
    ours, states = tx.make_jaxpr(fn)(x, y)
    theirs = jax.make_jaxpr(fn)(x, y)
    assert states == ()
    check(ours)
    assert len(ours.eqns) == len(theirs.eqns)
    assert len(ours.out_avals) == len(theirs.out_avals)
    assert ours.in_avals == theirs.in_avals and ours.out_avals == theirs.out_avals
    assert_close(jaxpr_as_fun(ours)(x, y), jaxpr_as_fun(theirs)(x, y))
    ours, states, shape = tx.make_jaxpr(fn, return_shape=True, return_only_write=True)(x, y)
    assert states == () and shape == jax.eval_shape(fn, x, y)
    # static_argnums / axis_env pass through.
    j1, _ = tx.make_jaxpr(lambda x, n: x * n, static_argnums=1)(x, 3)
    j2 = jax.make_jaxpr(lambda x, n: x * n, static_argnums=1)(x, 3)
    assert len(j1.eqns) == len(j2.eqns) and len(j1.in_avals) == 1


def test_make_jaxpr_axis_env():
    def fn(x):
        c = tx.get_state("c", jnp.zeros((), f32))
        tx.set_state("c", c + lax.psum(x, "i"))
        return x
    jaxpr, states = tx.make_jaxpr(fn, axis_env=[("i", 4)])(f32(1.0))
    assert [s.name for s in states] == ["c"]
    # Bind the axis by vmapping the pure program over it.
    out, c1 = jax.vmap(jaxpr_as_fun(jaxpr), in_axes=(None, 0), axis_name="i")(
        f32(1.0), jnp.arange(4.0))
    assert_close(out, jnp.arange(4.0))
    assert_close(c1, jnp.full(4, 7.0))


# ---- uncurry inside a function being uncurried -------------------------------------------

def _inner(S, x):
    c = S.get("c", f32(1.0))
    S.set("c", c * 2.0 + x)
    return x + c


def _outer(S, x, inner_where: str = "top"):
    S.set("o", S.get("o", f32(5.0)) + 1.0)

    def run_inner(x):
        if S is TX:
            pure, s0 = tx.uncurry(functools.partial(_inner, TX), x)
            y, s1 = pure(s0, x)
            y2, s2 = pure(s1, x)
            return y + y2, s2["c"]
        ref = Eager()  # the inner program has its own dict
        return _inner(ref, x) + _inner(ref, x), ref.state["c"]

    if inner_where == "top":
        y, c = run_inner(x)
    else:
        (y, c), _ = S.scan(lambda carry, _: (run_inner(carry[0] * 0.5), None),
                           (x, f32(0.0)), None, length=2)
    S.set("inner_c", c)
    return y


@pytest.mark.parametrize("inner_where", ["top", "scan"])
def test_uncurry_inside_uncurry_has_eager_semantics(inner_where):
    fn = functools.partial(_outer, TX, inner_where=inner_where)
    pure, s0 = tx.uncurry(fn, f32(1.0))
    ref = Eager()
    _outer(ref, f32(1.0), inner_where)
    assert_close({"o": s0["o"]}, {"o": ref.first["o"]})
    for x in (f32(1.0), f32(2.0)):
        out, s1 = pure(s0, x)
        ref = Eager(s0)
        assert_close(out, _outer(ref, x, inner_where))
        assert_states(s1, ref.state)


# ---- JAX's trace caches ------------------------------------------------------------------
# JAX caches the traces of jitted functions, scan/while/cond bodies,
# checkpointed functions and custom_jvp/custom_vjp functions by function
# identity. taxpr traces user code in keep mode (``keep_tags()``); keep mode
# is part of JAX's trace context, so a trace cached by an earlier plain call
# (``jax.jit(g)(...)``, an eager call, ``jax.make_jaxpr(g)``) is never reused
# by ``uncurry`` / ``tx.make_jaxpr`` / ``reap`` / ``plant``. Each program is
# built once (``make(S)``: its inner functions keep their identity), warmed
# up, then transformed, and compared with the same program run eagerly.

def _bump(S, y):
    """The effect every case has: count calls, remember ``y``."""
    S.set("n", S.get("n", jnp.zeros((), i32)) + 1)
    S.set("last", y)


def make_jit(S):
    @S.jit
    def inner(x, y):
        _bump(S, y)
        return jnp.sin(x) * 2.0
    return inner


def make_scan(S):
    def body(c, y):
        _bump(S, y)
        return c * 1.5 + jnp.sin(c), None
    return lambda x, y: S.scan(body, x, jnp.stack([y, y + 1.0, y + 2.0]))[0]


def make_while(S):
    def cond(v):
        return v[0] < 3

    def body(v):
        _bump(S, v[2])
        return v[0] + 1, v[1] * 1.5, v[2] + 1.0
    return lambda x, y: S.while_loop(cond, body, (jnp.zeros((), i32), x, y))[1]


def make_fori(S):
    def body(i, c):
        _bump(S, c[1])
        return c[0] * 0.5 + jnp.cos(c[0]), c[1] + 1.0
    return lambda x, y: S.fori_loop(0, 3, body, (x, y))[0]


def make_cond(S):
    def yes(x, y):
        _bump(S, y)
        return jnp.sin(x)

    def no(x, y):
        return x * 3.0
    return lambda x, y: S.cond(y > 0, yes, no, x, y)


def make_checkpoint(S):
    def g(x, y):
        _bump(S, y)
        return jnp.sin(x) * jnp.cos(x)
    return S.checkpoint(g)


def make_custom_jvp(S):
    @jax.custom_jvp
    def f(x, y):
        _bump(S, y)
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        x, y = primals
        return f(x, y), jnp.cos(x) * tangents[0]
    return f


def make_custom_vjp(S):
    @jax.custom_vjp
    def f(x, y):
        _bump(S, y)
        return jnp.sin(x)

    def fwd(x, y):
        return f(x, y), (x, y)

    def bwd(res, g):
        return jnp.cos(res[0]) * g, jnp.zeros_like(res[1])
    f.defvjp(fwd, bwd)
    return f


MAKERS = {"jit": make_jit, "scan": make_scan, "while": make_while, "fori": make_fori,
          "cond": make_cond, "checkpoint": make_checkpoint, "custom_jvp": make_custom_jvp,
          "custom_vjp": make_custom_vjp}


def _program(make, S, under_grad: bool):
    fn = make(S)
    if under_grad:
        # while_loop has no reverse mode: differentiate it forward.
        diff = jax.jacfwd if make is make_while else jax.grad
        return lambda x, y: diff(fn)(x, y)
    return fn


def _warm(fn, how: str, x, y, warns: bool = True):
    """Run ``fn`` as users do before transforming it. Run or compiled
    without uncurry, a set_state is lost, and taxpr says so where ``warns``
    (tracing with make_jaxpr loses nothing and says nothing)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tx.StateNotUncurriedWarning)
        if how == "jit":
            jax.block_until_ready(jax.jit(fn)(x, y))
        elif how == "eager":
            jax.block_until_ready(fn(x, y))
        else:
            jax.make_jaxpr(fn)(x, y)
    assert all(issubclass(w.category, tx.StateNotUncurriedWarning) for w in caught), caught
    assert bool(caught) == (warns and how != "make_jaxpr"), caught


def _warns(case: str, warm: str, under_grad: bool) -> bool:
    # A set_state inside a custom derivative rule that jit differentiates
    # runs in JAX's own trace of the rule, which taxpr does not see.
    return not (case in ("custom_jvp", "custom_vjp") and warm == "jit" and under_grad)


X, Y = f32(0.7), f32(2.0)


@pytest.mark.parametrize("under_grad", [False, True], ids=["plain", "grad"])
@pytest.mark.parametrize("warm", ["jit", "eager", "make_jaxpr"])
@pytest.mark.parametrize("case", sorted(MAKERS))
def test_uncurry_after_warm_up_matches_eager(case, warm, under_grad):
    fn = _program(MAKERS[case], TX, under_grad)
    _warm(fn, warm, X, Y, warns=_warns(case, warm, under_grad))
    pure, s0 = tx.uncurry(fn, X, Y)
    ref = Eager()
    _program(MAKERS[case], ref, under_grad)(X, Y)
    assert_close(s0, ref.first)
    for args in ((X, Y), (f32(-0.3), f32(5.0))):
        out, s1 = pure(s0, *args)
        ref = Eager(s0)
        want = _program(MAKERS[case], ref, under_grad)(*args)
        assert_close(out, want)
        assert_states(s1, ref.state, like=s0)
    # The effect happened exactly as often as eagerly (not lost, not doubled).
    assert int(s1["n"]) == int(ref.state["n"]) >= 1


@pytest.mark.parametrize("under_grad", [False, True], ids=["plain", "grad"])
@pytest.mark.parametrize("warm", ["jit", "eager", "make_jaxpr"])
@pytest.mark.parametrize("case", sorted(MAKERS))
def test_make_jaxpr_after_warm_up_threads_every_state(case, warm, under_grad):
    fn = _program(MAKERS[case], TX, under_grad)
    _warm(fn, warm, X, Y, warns=_warns(case, warm, under_grad))
    jaxpr, infos = tx.make_jaxpr(fn)(X, Y)
    check(jaxpr)
    assert [s.name for s in infos] == ["last", "n"]
    assert all(s.written for s in infos)
    assert list(tx.iter_tags(jaxpr)) == []  # no state access left as a tag
    start = {"last": f32(0.0), "n": i32(10)}
    *outs, last, n = jaxpr_as_fun(jaxpr)(start["last"], start["n"], X, Y)
    ref = Eager(start)
    want = _program(MAKERS[case], ref, under_grad)(X, Y)
    assert_close(outs[0], want)
    assert_states({"last": last, "n": n}, ref.state)


def make_sowing(S):
    """A scan whose body sows (append) and counts (clobber)."""
    def body(c, y):
        h.sow(c * y, tag="t", name="rows", mode="append")
        h.sow(y, tag="t", name="lastc", mode="clobber")
        return c * 0.5 + jnp.sin(c), None
    return lambda x, y: S.scan(body, x, jnp.stack([y, y + 1.0, y + 2.0]))[0]


def _sow_reference(x, y):
    """The sown values, with Python control flow."""
    c, rows = float(x), []
    for yi in (float(y), float(y) + 1.0, float(y) + 2.0):
        rows.append(c * yi)
        c = c * 0.5 + np.sin(c)
    return {"rows": np.array(rows, np.float32), "lastc": np.float32(float(y) + 2.0)}


@pytest.mark.parametrize("under_grad", [False, True], ids=["plain", "grad"])
@pytest.mark.parametrize("warm", ["jit", "eager", "make_jaxpr"])
def test_reap_and_plant_after_warm_up_match_eager(warm, under_grad):
    fn = _program(make_sowing, TX, under_grad)
    _warm(fn, warm, X, Y, warns=False)  # no state
    reaped = h.reap(fn, tag="t")(X, Y)
    assert_close(reaped, _sow_reference(X, Y))
    # Planting the rows changes nothing else; planting "lastc" is a no-op on
    # the output (it is not used), and both sows are found once warm.
    planted = h.plant(fn, tag="t")({"rows": jnp.zeros(3), "lastc": f32(0.0)}, X, Y)
    assert_close(planted, fn(X, Y))
    _, reaped2 = h.call_and_reap(fn, tag="t")(X, Y)
    assert_close(reaped2, reaped)


def test_uncurry_inside_jit_of_a_function_drawing_keys():
    # The key stream's initial value is a typed key, copied fresh for
    # state0: inside a trace the copy is a tracer.
    def noisy(x):
        return x * jax.random.normal(tx.next_key(), x.shape)

    def outer(x):
        pure, state0 = tx.uncurry(noisy, x)
        out, state = pure(state0, x)
        return out, jax.random.key_data(state["rng"])

    x = jnp.ones(3)
    eager = outer(x)
    for got in (jax.jit(outer)(x), tx.seed(outer, jax.random.key(5))(x)):
        np.testing.assert_array_equal(got[0], eager[0])
        np.testing.assert_array_equal(got[1], eager[1])
    key, sub = jax.random.split(jax.random.key(0))
    np.testing.assert_array_equal(eager[0], jax.random.normal(sub, (3,)))


@pytest.mark.parametrize("around", ["uncurry", "reap"])
def test_uncurry_inside_a_trace_does_not_repeat_the_effects_of_its_example_run(around):
    # The first use of "c" is in a cond branch, so uncurry runs the function
    # once to find its initial value; traced inside another function, that
    # run is part of the enclosing program and must not sow or call back
    # a second time.
    calls = []

    def inner(x, p):
        return sow_after_a_first_use_in_a_branch(x, p, calls).sum()

    def outer(x, p):
        pure, state0 = tx.uncurry(inner, x, p)
        out, state = pure(state0, x, p)
        return out, state["c"]

    x, p = jnp.array([1.0, 2.0]), f32(1.0)
    if around == "uncurry":
        opure, ostate0 = tx.uncurry(outer, x, p)
        ((out, c), _), reaps = h.call_and_reap(opure, tag="t")(ostate0, x, p)
    else:
        (out, c), reaps = h.call_and_reap(outer, tag="t")(x, p)
    jax.effects_barrier()
    assert float(out) == 6.0 and c.tolist() == [2.0, 4.0]
    assert reaps["y"].tolist() == [[2.0, 4.0]]
    assert len(calls) == 1


class _Config:
    """A static argument that is not hashable (as a config object with
    ``__eq__`` and no ``__hash__``)."""

    __hash__ = None

    def __init__(self, scale: float):
        self.scale = scale

    def __eq__(self, other):
        return isinstance(other, _Config) and other.scale == self.scale


def test_an_unhashable_static_argument_never_reuses_the_trace_of_another():
    # Each new object is traced anew (it is told apart by identity, and the
    # cache holds it, so its id cannot be reused by another one while the
    # trace is cached): never a stale trace of an object that is gone.
    def f(x, config):
        n = tx.get_state("n", jnp.zeros(()))
        tx.set_state("n", n + config.scale)
        return x * config.scale

    x = jnp.float32(2.0)
    pure, s0 = tx.uncurry(f, x, _Config(1.0))
    for scale in (2.0, 3.0, 4.0, 5.0):
        out, s1 = pure(s0, x, _Config(scale))  # the object is freed after the call
        assert float(out) == 2.0 * scale and float(s1["n"]) == scale


def test_the_signature_cache_keeps_the_most_recently_used():
    from taxpr._inject import SignatureCache
    cache = SignatureCache(maxsize=2)
    made = []
    for key in ("a", "b", "a", "c", "a", "b"):
        cache.get_or_make(key, lambda key=key: made.append(key) or key.upper())
    assert made == ["a", "b", "c", "b"] and len(cache) == 2

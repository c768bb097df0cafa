"""State semantics a new user relies on (unreached states, every dtype as
state, custom derivative rules, vmap, per-device values, ...): each compared with the same program run eagerly with Python control flow
and a dict for state (``Eager`` from test_state), or a clear error."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx

from helpers import check
from test_state import TX, Eager, assert_close, assert_states, jax_still_works

f32, i32 = jnp.float32, jnp.int32


# ---- G: state dicts with extra entries ---------------------------------------------------

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


# ---- I: hints are true ------------------------------------------------------------------

def test_dtype_mismatch_of_scalar_state_does_not_say_batched():
    def fn(x):
        tx.get_state("s", f32(0.0))
        tx.set_state("s", i32(1))
        return x
    with pytest.raises(tx.StateError, match=r"'s'.*int32\[\].*float32\[\]") as info:
        tx.uncurry(fn, f32(1.0))
    assert "batched" not in str(info.value)
    jax_still_works()


def test_shape_mismatch_with_an_extra_axis_names_the_axis_without_claiming_vmap():
    def fn(x):
        tx.get_state("s", jnp.zeros(3))
        tx.set_state("s", jnp.zeros((4, 3)))
        return x
    with pytest.raises(tx.StateError, match=r"extra leading axis of size 4"):
        tx.uncurry(fn, f32(1.0))


def test_injector_returning_wrong_ctx_outside_vmap_does_not_say_batched():
    closed = jax.make_jaxpr(lambda x: tx.tag(x, a=1))(f32(1.0))
    with pytest.raises(tx.InjectError, match=r"float32\[3\], expected float32\[\]") as info:
        tx.inject(closed, lambda ctx, tok, p: (tok, jnp.zeros(3, f32)), f32(0.0))
    assert "batched" not in str(info.value)
    closed = jax.make_jaxpr(lambda x: tx.tag(x, a=1))(f32(1.0))
    with pytest.raises(tx.InjectError, match=r"int32\[\], expected float32\[\]") as info:
        tx.inject(closed, lambda ctx, tok, p: (tok, i32(0)), f32(0.0))
    assert "batched" not in str(info.value)


def test_injector_storing_a_vmap_batched_token_says_batched():
    closed = jax.make_jaxpr(jax.vmap(lambda x: tx.tag(x, a=1)))(jnp.ones(3))
    with pytest.raises(tx.InjectError, match="looks batched"):
        tx.inject(closed, lambda ctx, tok, p: (tok, tok), f32(0.0))


# ---- D: every dtype as state, typed PRNG keys included --------------------------------------

def _dtype_prog(S, x, init_fn, step):
    """Read a state, use it, write ``step(value)``; also first-touched in a loop."""
    v = S.get("v", init_fn)
    S.set("v", step(v))

    def body(i, c):
        w = S.get("w", init_fn)
        S.set("w", step(w))
        return c + 1.0
    return S.fori_loop(0, 2, body, x), v


def _step_for(dtype):
    if dtype == "key":
        return lambda k: jax.random.split(k)[0]
    if dtype == jnp.bool_:
        return jnp.logical_not
    return lambda v: (v + jnp.asarray(1, dtype)).astype(dtype)


KEY_IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]
PLAIN_DTYPES = [jnp.bool_, jnp.int8, jnp.int16, jnp.int32, jnp.uint8, jnp.uint16, jnp.uint32,
                jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64]


def _values_equal(a, b):
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):
        assert a.dtype == b.dtype
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _check_dtype_state(init_fn, step, dtype):
    fn = functools.partial(_dtype_prog, TX, init_fn=init_fn, step=step)
    pure, s0 = tx.uncurry(fn, f32(1.0))
    ref = Eager()
    _dtype_prog(ref, f32(1.0), init_fn, step)
    assert sorted(s0) == ["v", "w"]
    for n in s0:
        _values_equal(s0[n], ref.first[n])
    for p in (pure, jax.jit(pure)):
        (out, v), s1 = p(s0, f32(2.0))
        ref = Eager(s0)
        want, v_ref = _dtype_prog(ref, f32(2.0), init_fn, step)
        assert_close(out, want)
        _values_equal(v, v_ref)
        for n in s1:
            _values_equal(s1[n], ref.state[n])
    jaxpr, infos = tx.make_jaxpr(fn)(f32(1.0))
    check(jaxpr)
    assert [(s.name, s.dtype) for s in infos] == [("v", dtype), ("w", dtype)]
    assert all(s.read and s.written for s in infos)


@pytest.mark.parametrize("dtype", PLAIN_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_every_dtype_works_as_state(dtype):
    _check_dtype_state(lambda: jnp.ones((2,), dtype), _step_for(dtype), jnp.dtype(dtype))


def test_64_bit_dtypes_work_as_state_with_x64():
    with jax.enable_x64(True):
        for dtype in (jnp.int64, jnp.uint64, jnp.float64, jnp.complex128):
            _check_dtype_state(lambda: jnp.ones((2,), dtype), _step_for(dtype),
                               jnp.dtype(dtype))


@pytest.mark.parametrize("impl", KEY_IMPLS)
def test_typed_prng_keys_work_as_state(impl):
    init = lambda: jax.random.key(0, impl=impl)  # noqa: E731
    _check_dtype_state(init, _step_for("key"), init().dtype)


def test_typed_key_state_drives_random_numbers_like_eager():
    def prog(S, x):
        k = S.get("k", lambda: jax.random.key(42))
        k, sub = jax.random.split(k)
        S.set("k", k)
        return x + jax.random.normal(sub, (3,))
    pure, s0 = tx.uncurry(functools.partial(prog, TX), jnp.zeros(3))
    state = s0
    ref = Eager()
    for _ in range(3):
        out, state = jax.jit(pure)(state, jnp.zeros(3))
        assert_close(out, prog(ref, jnp.zeros(3)))
    _values_equal(state["k"], ref.state["k"])
    # A wrong dtype for a key state is a clear error.
    with pytest.raises(tx.StateError, match="'k'"):
        pure({"k": jnp.zeros((), jnp.uint32)}, jnp.zeros(3))


# ---- C: initial values of states the example run never reaches ---------------------------

# Inits that do not depend on traced inputs (a constant built inside the branch is
# a tracer there), and one computed from the function's argument.
CONST_INITS = {
    "jnp_scalar": lambda x: jnp.float32(10.0),
    "ones_times": lambda x: 10 * jnp.ones(()),
    "callable": lambda x: (lambda: jnp.full((), 10.0, f32)),
    "numpy": lambda x: np.float32(10.0),
    "from_argument": lambda x: x * 10.0,
}


def _unreached_prog(where: str, make_init):
    """``fn(S, p, x)``: a get_state of "s" on a path the example (p False, x
    1) does not take; taken when p is True."""
    def fn(S, p, x):
        def touch(c):
            return c + S.get("s", make_init(x))
        if where == "cond":
            return S.cond(p, touch, lambda c: c * 2.0, x)
        if where == "switch":
            return S.switch(jnp.where(p, 0, 2), [touch, lambda c: c, lambda c: -c], x)
        if where == "while":
            return S.while_loop(lambda c: p & (c < 3.0), touch, x)
        if where == "fori":  # zero trips unless p
            return S.fori_loop(0, jnp.where(p, 2, 0), lambda i, c: touch(c), x)
        if where == "scan_cond":
            def body(c, _):
                return S.cond(p, touch, lambda c: c, c), None
            return S.scan(body, x, None, length=2)[0]
        raise ValueError(where)
    return fn


@pytest.mark.parametrize("where", ["cond", "switch", "while", "fori", "scan_cond"])
@pytest.mark.parametrize("init", sorted(CONST_INITS))
def test_unreached_state_starts_at_its_init_computed_exactly(where, init):
    prog = _unreached_prog(where, CONST_INITS[init])
    pure, s0 = tx.uncurry(functools.partial(prog, TX), jnp.array(False), f32(1.0))
    # The init the first get_state would use (its argument is the example's).
    assert_close(s0, {"s": f32(10.0)})
    assert s0["s"].dtype == jnp.float32
    for p, x in ((jnp.array(True), f32(0.5)), (jnp.array(False), f32(0.5))):
        out, s1 = pure(s0, p, x)
        ref = Eager(s0)
        assert_close(out, prog(ref, p, x))
        assert_states(s1, ref.state)


@pytest.mark.parametrize("n_branches, how", [(3, "switch"), (2, "switch"), (2, "cond")])
def test_unreached_state_with_different_inits_starts_at_the_first_traced(n_branches, how):
    # A state read with a different init in each branch of a switch or
    # cond, none taken by the example, starts at the init of the first read
    # JAX traces: lax.cond traces its branches backwards (true first),
    # lax.switch in index order.
    traced = []

    def prog(n, x):
        def branch(k):
            def f(c):
                traced.append(k)
                return c + tx.get_state("s", f32(k + 0.5))
            return f
        branches = [branch(k) for k in range(n_branches)]

        def inner(c):
            if how == "cond":
                return lax.cond(n % 2 == 0, branches[1], branches[0], c)
            return lax.switch(n, branches, c)
        # The example (n = 0) takes neither inner branch.
        return lax.cond(n > 100, inner, lambda c: c * 2.0, x)

    pure, s0 = tx.uncurry(prog, i32(0), f32(1.0))
    first = traced[0]  # JAX's own trace order
    assert traced[:n_branches] == ([1, 0] if how == "cond" else list(range(n_branches)))
    assert_close(s0, {"s": f32(first + 0.5)})


@pytest.mark.parametrize("where", ["while", "fori", "scan_carry"])
def test_unreached_state_whose_init_depends_on_a_loop_carry_is_an_error(where):
    def fn(p, x):
        def touch(c):
            return c + tx.get_state("s", c * 10.0)  # the loop's carry
        if where == "while":
            return lax.while_loop(lambda c: p & (c < 3.0), touch, x)
        if where == "fori":
            return lax.fori_loop(0, jnp.where(p, 2, 0), lambda i, c: touch(c), x)
        return lax.scan(lambda c, _: (lax.cond(p, touch, lambda c: c, c), None), x, None,
                        length=2)[0]
    with pytest.raises(tx.StateError, match=r"(?s)state 's'.*never reached.*carry"):
        tx.uncurry(fn, jnp.array(False), f32(1.0))
    jax_still_works()
    # Reached on the example arguments, the same program is fine.
    pure, s0 = tx.uncurry(fn, jnp.array(True), f32(1.0))
    assert set(s0) == {"s"}


def test_unreached_state_whose_init_reads_another_state_is_an_error():
    def fn(p, x):
        t = tx.get_state("t", f32(2.0))
        return lax.cond(p, lambda c: c + tx.get_state("s", t * 3.0), lambda c: c, x)
    with pytest.raises(tx.StateError, match=r"(?s)state 's'.*cond\[branch=1\].*state 't'"):
        tx.uncurry(fn, jnp.array(False), f32(1.0))


def test_unreached_typed_key_state_starts_at_its_init():
    def fn(p, x):
        def draw(c):
            k = tx.get_state("k", jax.random.key(3))
            k, sub = jax.random.split(k)
            tx.set_state("k", k)
            return c + jax.random.normal(sub)
        return lax.cond(p, draw, lambda c: c, x)
    pure, s0 = tx.uncurry(fn, jnp.array(False), f32(1.0))
    np.testing.assert_array_equal(jax.random.key_data(s0["k"]),
                                  jax.random.key_data(jax.random.key(3)))


def test_unreached_state_only_set_starts_at_zeros():
    def fn(p, x):
        return lax.cond(p, lambda c: tx.set_state("s", c * 3.0), lambda c: c, x)
    pure, s0 = tx.uncurry(fn, jnp.array(False), f32(1.0))
    assert_close(s0, {"s": f32(0.0)})


# ---- H: uncurry inside a function being uncurried ---------------------------------------

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


def test_uncurry_inside_uncurry_keeps_the_outer_unreached_init():
    def inner(x):
        return x + tx.get_state("c", f32(1.0))

    def outer(p, x):
        y = lax.cond(p, lambda c: c + tx.get_state("u", jnp.float32(7.0)), lambda c: c, x)
        pure, s0 = tx.uncurry(inner, x)
        return y + pure(s0, x)[0]
    pure, s0 = tx.uncurry(outer, jnp.array(False), f32(1.0))
    assert_close(s0, {"u": f32(7.0)})


def test_nested_uncurry_with_an_unreached_traced_init_is_a_clear_error():
    def inner(p, x):
        return lax.while_loop(lambda c: p & (c < 3.0),
                              lambda c: c + tx.get_state("s", c * 2.0), x)

    def outer(p, x):
        pure, s0 = tx.uncurry(inner, p, x)
        return pure(s0, p, x)[0]
    with pytest.raises(tx.StateError, match=r"(?s)state 's'.*inside a traced function"):
        tx.uncurry(outer, jnp.array(False), f32(1.0))
    jax_still_works()
    # With a constant init the traced "reached?" flag selects the right value.
    def inner2(p, x):
        return lax.while_loop(lambda c: p & (c < 3.0),
                              lambda c: c + tx.get_state("s", jnp.float32(2.0)), x)

    def outer2(p, x):
        pure, s0 = tx.uncurry(inner2, p, x)
        tx.set_state("s0", s0["s"])
        return pure(s0, p, x)[0]
    pure, s0 = tx.uncurry(outer2, jnp.array(False), f32(1.0))
    for p in (True, False):
        out, s1 = pure(s0, jnp.array(p), f32(0.5))
        assert_close(s1["s0"], f32(2.0))
        assert_close(out, f32(0.5 + 2.0 * 2 if p else 0.5))


# ---- E: state inside custom derivative rules ----------------------------------------------

def _cjvp(S, body_state: bool):
    @jax.custom_jvp
    def f(x):
        k = S.get("k", f32(1.0)) if body_state else f32(1.0)
        return jnp.sin(x) * k

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        k = S.get("k", f32(1.0))  # the rule reads the state (for the tangent)
        return f(x), k * jnp.cos(x) * t
    return f


def _cjvp_prog(S, x, body_state=True, grad_inside=False):
    S.set("k", S.get("k", f32(1.0)) + 1.0)
    f = _cjvp(S, body_state)
    return S.grad(f)(x) if grad_inside else f(x)


def test_custom_jvp_rule_reading_state_under_grad_inside_the_function_matches_eager():
    fn = functools.partial(_cjvp_prog, TX, grad_inside=True)
    pure, s0 = tx.uncurry(fn, f32(0.3))
    for start in (s0, {"k": f32(4.0)}):
        out, s1 = pure(start, f32(0.5))
        ref = Eager(start)
        assert_close(out, _cjvp_prog(ref, f32(0.5), grad_inside=True))
        assert_states(s1, ref.state)


def test_custom_jvp_rule_reading_state_sees_the_current_value_when_differentiated_from_outside():
    fn = functools.partial(_cjvp_prog, TX)
    pure, s0 = tx.uncurry(fn, f32(0.3))
    out, s1 = pure(s0, f32(0.5))
    ref = Eager(s0)
    assert_close(out, _cjvp_prog(ref, f32(0.5)))
    assert_states(s1, ref.state)
    # Eagerly, grad runs the rule with the current "k" (2.0 from s0's 1.0).
    for start in (s0, {"k": f32(4.0)}):
        want = jax.grad(lambda x: _cjvp_prog(Eager(start), x))(f32(0.5))
        assert_close(want, 5.0 * np.cos(0.5) if start is not s0 else 2.0 * np.cos(0.5))
        for diff in (jax.grad, lambda f: jax.jit(jax.grad(f))):
            assert_close(diff(lambda x: pure(start, x)[0])(f32(0.5)), want)


def test_custom_jvp_rule_with_state_around_a_stateless_body_matches_eager_from_outside():
    # The rule is traced only when JAX differentiates the function (with
    # JAX's own tangents), and then reads the state as it stands at the call.
    fn = functools.partial(_cjvp_prog, TX, body_state=False)
    pure, s0 = tx.uncurry(fn, f32(0.3))
    out, s1 = pure(s0, f32(0.5))
    ref = Eager(s0)
    assert_close(out, _cjvp_prog(ref, f32(0.5), body_state=False))
    assert_states(s1, ref.state)
    jaxpr, states = tx.make_jaxpr(fn)(f32(0.3))
    assert [s.name for s in states] == ["k"]
    for start in (s0, {"k": f32(4.0)}):
        want = jax.grad(lambda x: _cjvp_prog(Eager(start), x, body_state=False))(f32(0.5))
        for diff in (jax.grad, lambda f: jax.jit(jax.grad(f))):
            assert_close(diff(lambda x: pure(start, x)[0])(f32(0.5)), want)


def _cvjp_prog(S, x, body_state=True, fwd_state=False, bwd_state=True):
    @jax.custom_vjp
    def f(x):
        if body_state:
            S.set("calls", S.get("calls", jnp.zeros((), i32)) + 1)
        return x * 2.0

    def fwd(x):
        if fwd_state:
            S.set("calls", S.get("calls", jnp.zeros((), i32)) + 1)
        return x * 2.0, x

    def bwd(res, g):
        if bwd_state:
            S.set("last_ct", g)  # the bwd writes a state
        return (g * 2.0,)
    f.defvjp(fwd, bwd)
    S.set("last_ct", S.get("last_ct", f32(0.0)))
    return f(x)


def test_custom_vjp_bwd_setting_state_is_an_error_not_a_lost_update():
    # A stateless body: the bwd runs (and refuses) only when JAX runs it.
    fn = functools.partial(_cvjp_prog, TX, body_state=False)
    pure, s0 = tx.uncurry(fn, f32(0.3))
    out, s1 = pure(s0, f32(0.5))
    ref = Eager(s0)
    assert_close(out, _cvjp_prog(ref, f32(0.5), body_state=False))
    assert_states(s1, ref.state)
    with pytest.raises(tx.StateError, match=r"state 'last_ct'.*custom_vjp\[bwd\]"):
        jax.grad(lambda x: pure(s0, x)[0])(f32(0.5))
    jax_still_works()
    # A body with state: works undifferentiated, an error when differentiated
    # from outside (eagerly the bwd's write would happen).
    fn = functools.partial(_cvjp_prog, TX)
    pure, s0 = tx.uncurry(fn, f32(0.3))
    out, s1 = pure(s0, f32(0.5))
    ref = Eager(s0)
    assert_close(out, _cvjp_prog(ref, f32(0.5)))
    assert_states(s1, ref.state)
    with pytest.raises(tx.StateError, match=r"state 'last_ct'.*custom_vjp\[bwd\]"):
        jax.grad(lambda x: pure(s0, x)[0])(f32(0.5))
    jax_still_works()


def test_custom_vjp_fwd_with_state_runs_instead_of_the_function_when_differentiated_from_outside():
    prog = functools.partial(_cvjp_prog, fwd_state=True, bwd_state=False)
    pure, s0 = tx.uncurry(functools.partial(prog, TX), f32(0.3))
    for start in (s0, {**s0, "calls": jnp.asarray(5, i32)}):
        ref = Eager(start)
        want, vjp = jax.vjp(lambda x: prog(ref, x), f32(0.5))
        (out, s1), got_vjp = jax.vjp(lambda x: pure(start, x), f32(0.5))
        assert_close(out, want)
        assert_states(s1, ref.state)
        assert int(s1["calls"]) == int(start["calls"]) + 1  # the fwd's count, once
        zero_cts = jax.tree_util.tree_map(
            lambda v: np.zeros(v.shape, jax.dtypes.float0) if v.dtype == i32
            else jnp.zeros_like(v), s1)
        assert_close(got_vjp((f32(1.0), zero_cts))[0], vjp(f32(1.0))[0])
    # A fwd with state around a body without it: the body is not rewritten,
    # so its rules are not threaded (only checked when JAX runs them).
    prog = functools.partial(_cvjp_prog, body_state=False, fwd_state=True, bwd_state=False)
    pure, s0 = tx.uncurry(functools.partial(prog, TX), f32(0.3))
    assert sorted(s0) == ["last_ct"]
    with pytest.raises(tx.StateError, match=r"state 'calls'.*custom_vjp\[fwd\]"):
        jax.grad(lambda x: pure(s0, x)[0])(f32(0.5))
    jax_still_works()


# ---- differentiated inside the program: JAX moves loop-invariant work ---------------------
# Under ``jax.vjp`` / ``jax.linearize`` / ``jax.grad`` JAX partially evaluates
# a differentiated ``scan`` and hoists work that depends only on the loop's
# constants out of the loop; a ``cond``'s partial evaluation keeps its staged
# half only when an output is used. Either loses a state write or makes it
# happen once instead of every step. Reference: the same program run eagerly
# (the primal output of ``vjp`` is the program's output, the writes the same).

def _count_and_store(S, f, c):
    """When ``f > 0.1``: count a call in ``n`` and store ``2c`` in ``s0``.
    Returns ``c``: no output depends on a state, the case JAX's ``cond``
    partial evaluation dropped."""
    def yes(c):
        S.set("n", S.get("n", f32(0.0)) + 1.0)
        S.set("s0", c * 2.0)
        return c
    return S.cond(f > 0.1, yes, lambda c: c, c)


_LOOP_INVARIANT_BODIES = {
    "cond_of_a_constant": lambda S, f, c: _count_and_store(S, f, f) * 0.0 + c,
    "cond_of_the_carry": lambda S, f, c: _count_and_store(S, f, c),
    "jit_of_a_constant": lambda S, f, c: S.jit(lambda f: _count_and_store(S, f, f))(f) * 0.0 + c,
    "fori_of_a_constant": lambda S, f, c: S.fori_loop(
        0, 2, lambda i, a: a + _count_and_store(S, f, f), f32(0.0)) * 0.0 + c,
    "scan_of_a_constant": lambda S, f, c: S.scan(
        lambda a, _: (a + _count_and_store(S, f, f), None), f32(0.0), None, length=2)[0] * 0.0 + c,
    "checkpoint_of_a_constant": lambda S, f, c: S.checkpoint(
        lambda f: _count_and_store(S, f, f))(f) * 0.0 + c,
    "checkpoint_of_the_carry": lambda S, f, c: S.checkpoint(
        lambda f, c: _count_and_store(S, f, c))(f, c),
}

_DIFFERENTIATIONS = {
    "vjp": lambda fn: lambda x: jax.vjp(fn, x)[0],
    "linearize": lambda fn: lambda x: jax.linearize(fn, x)[0],
    "value_and_grad": lambda fn: lambda x: jax.value_and_grad(fn)(x)[0],
}


def _scan_with_body(S, body, f0):
    def step(c, _):
        c = body(S, f0, c)
        return c, c
    return jnp.tanh(S.scan(step, f0, jnp.arange(2.0, dtype=f32))[1].sum())


@pytest.mark.parametrize("how", sorted(_DIFFERENTIATIONS))
@pytest.mark.parametrize("body", sorted(_LOOP_INVARIANT_BODIES))
def test_state_written_in_loop_invariant_work_of_a_differentiated_scan_matches_eager(body, how):
    body_fn = _LOOP_INVARIANT_BODIES[body]
    fn = _DIFFERENTIATIONS[how](functools.partial(_scan_with_body, TX, body_fn))
    pure, s0 = tx.uncurry(fn, f32(0.5))
    for x in (f32(0.5), f32(-1.0)):  # the cond taken / not taken
        out, s1 = pure(s0, x)
        ref = Eager(s0)
        assert_close(out, _scan_with_body(ref, body_fn, x))
        assert_states(s1, ref.state)


def _counted_custom_jvp():
    @jax.custom_jvp
    def counted(f):
        return _count_and_store(TX, f, f)
    counted.defjvp(lambda p, t: (counted(*p), t[0]))
    return counted


def _counted_custom_vjp():
    @jax.custom_vjp
    def counted(f):
        return _count_and_store(TX, f, f)
    counted.defvjp(lambda f: (_count_and_store(TX, f, f), None), lambda _, ct: (ct,))
    return counted


@pytest.mark.parametrize("how", sorted(_DIFFERENTIATIONS))
@pytest.mark.parametrize("make_counted", [_counted_custom_jvp, _counted_custom_vjp],
                         ids=["custom_jvp", "custom_vjp"])
def test_state_written_in_a_loop_invariant_custom_rule_function_of_a_differentiated_scan_matches_eager(
        make_counted, how):
    # JAX evaluates a custom_jvp / custom_vjp call whose inputs are all
    # loop-invariant once, outside a differentiated scan (in
    # JaxprTrace.process_custom_*_call, which consults no rule); one holding
    # kept tags stays in the loop.
    counted = make_counted()

    def body(S, f, c):
        return (counted(f) if S is TX else _count_and_store(S, f, f)) * 0.0 + c

    differentiated = _DIFFERENTIATIONS[how](functools.partial(_scan_with_body, TX, body))
    pure, s0 = tx.uncurry(differentiated, f32(0.5))
    out, s1 = pure(s0, f32(0.5))
    ref = Eager(s0)
    assert_close(out, _scan_with_body(ref, body, f32(0.5)))
    assert_states(s1, ref.state)


def test_reaping_a_custom_jvp_with_state_under_vmap_and_grad_matches_eager():
    """harvest looks into custom JVP rules for sows when JAX may differentiate
    (any non-jit trace, vmap included): a rule with state must not make that
    look fail; the error belongs to differentiating it."""
    from taxpr import harvest as h

    def body(x):
        s = tx.get_state("s", f32(0.5))
        tx.set_state("s", s + x)
        h.sow(x * 3.0, tag="t", name="a")
        return x * s

    counted = jax.custom_jvp(body)
    counted.defjvp(lambda p, t: jax.jvp(body, p, t))
    pure, s0 = tx.uncurry(counted, f32(1.0))
    xs = jnp.array([1.0, 2.0], f32)
    (out, fin), reaps = jax.vmap(h.call_and_reap(pure, tag="t"), in_axes=(None, 0))(s0, xs)
    for row, x in enumerate((1.0, 2.0)):
        ref = Eager(s0)  # eagerly: s = 0.5, then s + x; out = x * 0.5; sown 3x
        want = x * ref.get("s", None)
        ref.set("s", ref.get("s", None) + x)
        assert_close(out[row], want)
        assert_close(fin["s"][row], ref.state["s"])
        assert_close(reaps["a"][row], 3.0 * x)
    # Differentiated, the rule (the function's JVP) runs in its place once:
    # d(x * s)/dx with s the state before the call; the sow is reaped from it.
    ((out, fin), reaps), ((out_t, fin_t), reaps_t) = jax.jvp(
        h.call_and_reap(pure, tag="t"), (s0, f32(2.0)),
        (jax.tree_util.tree_map(jnp.zeros_like, s0), f32(1.0)))
    assert_close((out, fin["s"], reaps["a"]), (f32(1.0), f32(2.5), f32(6.0)))
    assert_close((out_t, fin_t["s"], reaps_t["a"]), (f32(0.5), f32(0.0), f32(3.0)))
    assert_close(jax.grad(lambda x: h.call_and_reap(pure, tag="t")(s0, x)[0][0])(f32(1.0)),
                 f32(0.5))


def test_custom_vjp_in_a_vmapped_scan_with_an_array_constant_in_a_stateful_program_matches_eager():
    """uncurry looks into custom_vjp fwd rules for state; a fwd that vmap
    lifted (its function holds an array constant) refuses to be traced as if
    differentiated w.r.t. that constant."""
    def with_const(x, v):
        return x, jnp.array([0.5, 1.5, -1.0], f32) + 0.0 * v

    cv = jax.custom_vjp(with_const)
    cv.defvjp(lambda *p: (with_const(*p), p), lambda p, ct: jax.vjp(with_const, *p)[1](ct))

    def fn(S, xs, v):
        def one(x):
            def step(carry, _):
                x, v = cv(*carry)
                return (x, v), x
            return S.scan(step, (x, v), None, length=2)[0][1].sum()
        S.set("n", S.get("n", f32(0.0)) + 1.0)
        return jax.vmap(one)(xs)

    xs, v = jnp.array([1.0, 2.0], f32), jnp.ones(3, f32)
    pure, s0 = tx.uncurry(functools.partial(fn, TX), xs, v)
    out, s1 = pure(s0, xs, v)
    ref = Eager(s0)
    assert_close(out, fn(ref, xs, v))
    assert_states(s1, ref.state)


def _sowing_custom_jvp(kind: str):
    """A custom_jvp whose rule is the JVP of its function (which sows ``x``
    directly, in a taken ``cond`` branch, or every step of a 3-step scan), and
    the eager derivative and reaped value at 0.5."""
    from taxpr import harvest as h

    def body(x):
        if kind == "direct":
            return h.sow(x, tag="t", name="c0") * 2.0
        if kind == "cond":
            return lax.cond(x > 0, lambda x: h.sow(x, tag="t", name="c0") * 2.0,
                            lambda x: h.sow(x * 3.0, tag="t", name="c0"), x)
        def step(c, _):
            return h.sow(c, tag="t", name="c0", mode="append") * 2.0, None
        return lax.scan(step, x, None, length=3)[0]

    fn = jax.custom_jvp(body)
    fn.defjvp(lambda p, t: jax.jvp(body, p, t))
    # eagerly: d(2x)/dx = 2 (x > 0 takes the first branch), d(8x)/dx = 8;
    # the rule runs once, on the primal 0.5
    want = {"direct": (2.0, 0.5), "cond": (2.0, 0.5), "scan": (8.0, [0.5, 1.0, 2.0])}[kind]
    return fn, want


@pytest.mark.parametrize("kind", ["direct", "cond", "scan"])
def test_grad_of_a_custom_jvp_whose_rule_sows_matches_eager(kind):
    # Kept tags whose inputs are known are not staged where JAX linearizes a
    # custom_jvp from its rule (staging them leaves the rule's primal output
    # unknown: "Linearization failed").
    from taxpr import harvest as h

    fn, (grad, sown) = _sowing_custom_jvp(kind)
    assert_close(jax.grad(fn)(f32(0.5)), grad)
    assert_close(h.reap(jax.grad(fn), tag="t")(f32(0.5))["c0"], jnp.asarray(sown, f32))
    assert_close(jax.jit(jax.grad(fn))(f32(0.5)), grad)
    jax_still_works()


def test_state_read_and_written_in_a_custom_jvp_rule_under_grad_inside_the_function_matches_eager():
    # Failed with JAX's "Linearization failed" before: the rule's state tags
    # were staged, leaving its primal output unknown.
    @jax.custom_jvp
    def f(x):
        return x * 2.0

    def rule(S, p, t):
        s = S.get("s", f32(3.0))
        S.set("s", s + 1.0)
        return p[0] * s, t[0] * s

    f.defjvp(lambda p, t: rule(TX, p, t))
    pure, s0 = tx.uncurry(lambda x: jax.grad(f)(x), f32(1.0))
    out, s1 = pure(s0, f32(1.0))
    ref = Eager(s0)  # eagerly, grad runs the rule once
    assert_close(out, rule(ref, (1.0,), (1.0,))[1])
    assert_states(s1, ref.state)
    jax_still_works()


def test_a_custom_jvp_whose_rule_cannot_be_traced_does_not_stop_uncurry():
    # uncurry looks into custom rules for
    # state; a rule taking the JVP of a custom_vjp function cannot be traced
    # at all (JAX's TypeError). Undifferentiated the program is fine, so
    # must be uncurry; differentiated, JAX's own error comes.
    def inner(x):
        return x * 2.0

    cv = jax.custom_vjp(inner)
    cv.defvjp(lambda x: (inner(x), x), lambda x, g: (2.0 * g,))
    body = lambda x: cv(x)  # noqa: E731
    cj = jax.custom_jvp(body)
    cj.defjvp(lambda p, t: jax.jvp(body, p, t))

    def fn(S, x):
        S.set("n", S.get("n", f32(0.0)) + 1.0)
        return cj(x)

    xs = jnp.array([1.0, 2.0], f32)
    for f, x in ((functools.partial(fn, TX), f32(1.0)),
                 (jax.vmap(functools.partial(fn, TX)), xs)):
        pure, s0 = tx.uncurry(f, x)
        out, s1 = pure(s0, x)
        ref = Eager(s0)
        assert_close(out, 2.0 * x)
        fn(ref, f32(1.0))  # the state is not batched: one eager call's update
        assert_states(s1, ref.state)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.grad(lambda x: pure(s0, x)[0].sum())(xs)
    jax_still_works()

"""State in custom derivative rules (``custom_jvp`` rules, ``custom_vjp`` fwd
and bwd) and in backward passes that replay the forward pass: the rewrite
threads state through the rules it runs, and the guard on the rules it
cannot thread makes them clear errors naming the state. Differentiated from
outside (``jax.grad(lambda x: pure(s, x)[0])``), JAX runs a custom_jvp rule
or a custom_vjp fwd instead of the function; the reference is the same
program run eagerly with a Python dict under the same JAX differentiation
(``Eager``): the rule's effects happen once, with the states as they stand
at the call. Also: rules run by a ``jax.grad`` inside the program, and keys
drawn in rules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx

from state_helpers import (TX, Eager, assert_close, assert_states, check_program,
                           counting_and_scaling_custom_vjps, f32, i32, jax_still_works)


# ---- functions with state and custom rules -----------------------------------------------

def cjvp_prog(S, x):
    @jax.custom_jvp
    def f(x):
        k = S.get("k", jnp.full((), 2.0, f32))
        S.set("calls", S.get("calls", jnp.zeros((), i32)) + 1)
        return jnp.sin(x) * k

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return jnp.sin(x) * 2.0, 7.0 * t
    return f(x) + x


def cvjp_prog(S, x):
    @jax.custom_vjp
    def f(x):
        k = S.get("k", jnp.full((), 3.0, f32))
        S.set("k", k + 1.0)
        return x * k

    def fwd(x):
        return x * 3.0, None

    def bwd(_, g):
        return (5.0 * g,)
    f.defvjp(fwd, bwd)
    return f(x) * 2.0


def test_custom_jvp_with_state():
    pure, s0 = check_program(cjvp_prog, (f32(0.3),), [(f32(1.2),), (f32(-0.7),)])
    for x in (0.3, 1.2):
        g = jax.grad(lambda x: pure(s0, x)[0])(f32(x))
        assert_close(g, f32(8.0))  # the user's rule (7) + 1, not cos(x) * k + 1
        g = jax.jit(jax.grad(lambda x: pure(s0, x)[0]))(f32(x))
        assert_close(g, f32(8.0))


def test_custom_vjp_with_state():
    pure, s0 = check_program(cvjp_prog, (f32(0.3),), [(f32(1.2),), (f32(-0.7),)])
    g = jax.grad(lambda x: pure(s0, x)[0])(f32(0.5))
    assert_close(g, f32(10.0))  # the user's rule: 2 * 5
    # Differentiated, the fwd runs instead of the function (as eagerly): its
    # output, and none of the body's state effects.
    (out, s1), _ = jax.vjp(lambda x: pure(s0, x), f32(0.5))
    ref = Eager(s0)
    want, _ = jax.vjp(lambda x: cvjp_prog(ref, x), f32(0.5))
    assert_close(out, want)
    assert_states(s1, ref.state)
    assert_close(s1["k"], f32(3.0))


def test_custom_jvp_grad_inside_fn_uses_user_rule():
    def prog(S, x):
        S.set("seen", x)
        @jax.custom_jvp
        def f(x):
            return jnp.sin(x)
        f.defjvp(lambda p, t: (jnp.sin(p[0]), 11.0 * t[0]))
        g = jax.grad(f)(x)
        S.set("g", g)
        return g
    pure, s0 = tx.uncurry(functools.partial(prog, TX), f32(0.1))
    out, s1 = pure(s0, f32(0.4))
    assert_close(out, f32(11.0))
    assert_close(s1, {"seen": f32(0.4), "g": f32(11.0)})


# ---- rules reading a state, fwd and bwd with state ---------------------------------------

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


# ---- rules that run instead of the function ----------------------------------------------

def _scaled_sin(S):
    """The rule calls the function itself (JAX's canonical idiom)."""
    @jax.custom_jvp
    def scaled_sin(x):
        S.set("calls", S.get("calls", jnp.zeros((), i32)) + 1)
        return S.get("scale", f32(2.0)) * jnp.sin(x)

    @scaled_sin.defjvp
    def _(primals, tangents):
        (x,), (dx,) = primals, tangents
        return scaled_sin(x), 3.0 * jnp.cos(x) * dx

    return scaled_sin


def _rule_calls_function(S, x):
    return _scaled_sin(S)(x)


def _eager_value_and_grad(prog, start, x):
    ref = Eager(start)
    out, g = jax.value_and_grad(lambda x: prog(ref, x))(x)
    return out, g, ref.state


def test_rule_calling_the_function_runs_once_with_the_current_state():
    pure, s0 = tx.uncurry(functools.partial(_rule_calls_function, TX), f32(0.5))
    for start in (s0, {"calls": jnp.asarray(4, i32), "scale": f32(-1.5)}):
        want_out, want_g, want_state = _eager_value_and_grad(_rule_calls_function, start,
                                                             f32(0.5))
        assert int(want_state["calls"]) == int(start["calls"]) + 1
        assert_close(want_g, 3.0 * np.cos(0.5))
        for diff in (jax.value_and_grad, lambda f, **kw: jax.jit(jax.value_and_grad(f, **kw))):
            (out, s1), g = diff(lambda x: pure(start, x), has_aux=True)(f32(0.5))
            assert_close((out, g), (want_out, want_g))
            assert_states(s1, want_state)
    jax_still_works()


def test_rule_calling_the_function_under_jvp_jacrev_and_hessian():
    pure, s0 = tx.uncurry(functools.partial(_rule_calls_function, TX), f32(0.5))
    x = f32(0.5)
    (out, s1), (out_t, s1_t) = jax.jvp(lambda x: pure(s0, x), (x,), (f32(1.0),))
    ref = Eager(s0)
    want, want_t = jax.jvp(lambda x: _rule_calls_function(ref, x), (x,), (f32(1.0),))
    assert_close((out, out_t), (want, want_t))
    assert_states(s1, ref.state)
    assert_close(s1_t["scale"], f32(0.0))
    # Second order: the rule's tangent 3 cos(x), differentiated again.
    assert_close(jax.hessian(lambda x: pure(s0, x)[0])(x), -3.0 * np.sin(0.5))
    assert_close(jax.hessian(lambda x: _rule_calls_function(Eager(s0), x))(x),
                 -3.0 * np.sin(0.5))
    # Derivatives w.r.t. a state flow through the function's body.
    d_scale, d_x = jax.jacrev(lambda sc, x: pure({**s0, "scale": sc}, x)[0],
                              argnums=(0, 1))(s0["scale"], x)
    assert_close((d_scale, d_x), (np.sin(0.5), 3.0 * np.cos(0.5)))


def _rule_reads_a_scale(S, x):
    """A rule reads a state that the program sets before and after the call:
    the tangent uses the value at the call."""
    @jax.custom_jvp
    def clipped(x):
        S.set("seen", S.get("seen", jnp.zeros((), i32)) + 1)
        return jnp.tanh(x)

    @clipped.defjvp
    def _(primals, tangents):
        (x,), (dx,) = primals, tangents
        return clipped(x), S.get("grad_scale", f32(1.0)) * dx

    S.set("grad_scale", S.get("grad_scale", f32(1.0)) * 3.0)
    y = clipped(x)
    S.set("grad_scale", f32(100.0))
    return y * 2.0


def test_rule_reading_a_state_uses_its_value_at_the_call():
    pure, s0 = tx.uncurry(functools.partial(_rule_reads_a_scale, TX), f32(0.5))
    for start in (s0, {"seen": jnp.asarray(1, i32), "grad_scale": f32(0.25)}):
        want_out, want_g, want_state = _eager_value_and_grad(_rule_reads_a_scale, start,
                                                             f32(0.5))
        assert_close(want_g, 2.0 * 3.0 * start["grad_scale"])
        (out, s1), g = jax.jit(jax.value_and_grad(lambda x: pure(start, x), has_aux=True))(
            f32(0.5))
        assert_close((out, g), (want_out, want_g))
        assert_states(s1, want_state)


def _rule_without_the_function(S, x):
    """The rule computes the JVP without calling the function: under
    differentiation the body's count does not happen (as eagerly)."""
    @jax.custom_jvp
    def f(x):
        S.set("body_calls", S.get("body_calls", jnp.zeros((), i32)) + 1)
        return jnp.sin(x)

    f.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
    return f(x) + f(2.0 * x)


def test_rule_not_calling_the_function_replaces_its_effects():
    pure, s0 = tx.uncurry(functools.partial(_rule_without_the_function, TX), f32(0.5))
    out, s1 = pure(s0, f32(0.5))
    assert int(s1["body_calls"]) == 2
    want_out, want_g, want_state = _eager_value_and_grad(_rule_without_the_function, s0,
                                                         f32(0.5))
    assert int(want_state["body_calls"]) == 0
    (out, s1), g = jax.value_and_grad(lambda x: pure(s0, x), has_aux=True)(f32(0.5))
    assert_close((out, g), (want_out, want_g))
    assert_states(s1, want_state)


def _rule_in_a_scan(S, xs):
    f = _scaled_sin(S)

    def body(c, x):
        S.set("scale", S.get("scale", f32(2.0)) + 1.0)
        return c + f(x * c), None

    return S.scan(body, f32(1.0), xs)[0]


def test_rule_in_a_jitted_scan_sees_each_step_state():
    xs = jnp.array([0.3, -0.2, 0.7], f32)
    pure, s0 = tx.uncurry(functools.partial(_rule_in_a_scan, TX), xs)
    want_out, want_g, want_state = _eager_value_and_grad(_rule_in_a_scan, s0, xs)
    assert int(want_state["calls"]) == 3
    (out, s1), g = jax.jit(jax.value_and_grad(lambda xs: pure(s0, xs), has_aux=True))(xs)
    assert_close((out, g), (want_out, want_g))
    assert_states(s1, want_state)


# ---- keys drawn in a custom_vjp fwd ------------------------------------------------------

def _dropout(x):
    @jax.custom_vjp
    def drop(x):
        keep = jax.random.bernoulli(tx.next_key(), 0.5, x.shape)
        return jnp.where(keep, x * 2.0, 0.0)

    def fwd(x):
        keep = jax.random.bernoulli(tx.next_key(), 0.5, x.shape)
        return jnp.where(keep, x * 2.0, 0.0), keep

    def bwd(keep, g):
        return (jnp.where(keep, g * 2.0, 0.0),)

    drop.defvjp(fwd, bwd)
    y = drop(x)
    return jnp.sum(y * y), jax.random.normal(tx.next_key(), ())


def test_custom_vjp_fwd_drawing_a_key_advances_the_stream_once():
    x = jnp.linspace(0.5, 2.0, 16, dtype=f32)
    seeded = tx.seed(_dropout, jax.random.key(3))
    # Undifferentiated, the body draws; differentiated, the fwd draws the
    # same key (its position in the stream), and the next draw follows it.
    loss, after = seeded(x)
    (g_loss, g_after), g = jax.value_and_grad(seeded, has_aux=True)(x)
    assert_close((g_loss, g_after), (loss, after))
    kept = np.asarray(g) != 0.0
    assert 0 < kept.sum() < x.size
    np.testing.assert_allclose(np.asarray(g)[kept], 8.0 * np.asarray(x)[kept], rtol=1e-6)
    # The same key drawn by hand: split once for the mask, once after.
    key, sub = jax.random.split(jax.random.key(3))
    assert (np.asarray(jax.random.bernoulli(sub, 0.5, x.shape)) == kept).all()
    _, sub = jax.random.split(key)
    assert_close(after, jax.random.normal(sub, ()))


def test_uncurry_of_a_fwd_drawing_keys_matches_the_undifferentiated_stream():
    x = jnp.linspace(0.5, 2.0, 16, dtype=f32)
    pure, s0 = tx.uncurry(_dropout, x)
    (loss, (after, s1)), g = jax.jit(jax.value_and_grad(
        lambda x: (lambda o: (o[0][0], (o[0][1], o[1])))(pure(s0, x)), has_aux=True))(x)
    (want_loss, want_after), want_s1 = pure(s0, x)
    assert_close((loss, after), (want_loss, want_after))
    assert (jax.random.key_data(s1["rng"]) == jax.random.key_data(want_s1["rng"])).all()
    kept = np.asarray(g) != 0.0
    assert 0 < kept.sum() < x.size


# ---- states only a rule touches, rules that do not run, a state a fwd reads --------------

def _counted_sin(rule_extra):
    """sin counting its calls in "n"; its rule calls it and ``rule_extra(t)``
    scales the tangent (and may touch state)."""
    @jax.custom_jvp
    def f(x):
        tx.set_state("n", tx.get_state("n", jnp.zeros((), i32)) + 1)
        return jnp.sin(x)

    @f.defjvp
    def _(p, t):
        return f(p[0]), rule_extra(t[0]) * jnp.cos(p[0]) * t[0]

    return f


def test_a_state_only_a_rule_sets_is_an_error_naming_it():
    def log_tangent(t):
        tx.set_state("tangent_norm", jnp.abs(t))
        return 1.0

    pure, s0 = tx.uncurry(_counted_sin(log_tangent), f32(0.5))
    assert sorted(s0) == ["n"]
    with pytest.raises(tx.StateError, match=r"state 'tangent_norm'.*custom_jvp\[jvp rule\]"
                                            r".*function itself never touches"):
        jax.grad(lambda x: pure(s0, x)[0])(f32(0.5))
    jax_still_works()


def test_a_state_only_a_rule_reads_gives_its_init():
    pure, s0 = tx.uncurry(_counted_sin(lambda t: tx.get_state("only_in_rule", f32(4.0))),
                          f32(0.5))
    (out, s1), g = jax.value_and_grad(lambda x: pure(s0, x), has_aux=True)(f32(0.5))
    assert_close((out, g), (np.sin(0.5), 4.0 * np.cos(0.5)))
    assert sorted(s1) == ["n"] and int(s1["n"]) == 1


def test_without_differentiation_rules_do_not_run():
    def prog(x):
        return lax.fori_loop(0, 3, lambda i, c: _scaled_sin(TX)(c), x)

    pure, s0 = tx.uncurry(prog, f32(0.5))
    out, s1 = pure(s0, f32(0.5))
    ref = Eager(s0)
    want = _scaled_sin(ref)(_scaled_sin(ref)(_scaled_sin(ref)(f32(0.5))))
    assert_close(out, want)
    assert_states(s1, ref.state)


def test_differentiating_a_state_a_custom_vjp_fwd_reads_is_a_clear_error():
    @jax.custom_vjp
    def f(x):
        return x * tx.get_state("k", f32(1.0))

    def fwd(x):
        k = tx.get_state("k", f32(1.0))
        return x * k, k

    f.defvjp(fwd, lambda k, g: (g * k,))
    pure, s0 = tx.uncurry(f, f32(2.0))
    # W.r.t. the argument: the user's rules, with the state at the call.
    assert_close(jax.grad(lambda x: pure({"k": f32(3.0)}, x)[0])(f32(2.0)), f32(3.0))
    with pytest.raises(NotImplementedError, match=r"w\.r\.t\. state 'k'.*custom_vjp\[fwd\]"):
        jax.grad(lambda k: pure({"k": k}, f32(2.0))[0])(f32(3.0))
    jax_still_works()


def test_differentiating_a_state_a_custom_vjp_hands_on_unchanged():
    # The function uses a state of its own; the differentiated state 'a' is
    # only handed on by the call (its derivative there is the identity).
    def body(x):
        tx.set_state("calls", tx.get_state("calls", jnp.zeros((), i32)) + 1)
        return jnp.sin(x)

    f = jax.custom_vjp(body)
    f.defvjp(lambda x: (body(x), x), lambda x, g: (jnp.cos(x) * g,))

    def program(x):
        a = tx.get_state("a", f32(1.0))
        y = f(x * a)
        tx.set_state("a", a * 3.0)
        return y * a

    x = f32(0.5)
    pure, s0 = tx.uncurry(program, x)

    def loss(a):
        out, s1 = pure({**s0, "a": a}, x)
        return out + s1["a"], s1

    (value, s1), g = jax.value_and_grad(loss, has_aux=True)(f32(2.0))
    # By hand: sin(x a) a + 3 a, d/da = x a cos(x a) + sin(x a) + 3.
    assert_close(value, np.sin(0.5 * 2.0) * 2.0 + 6.0)
    assert_close(g, 0.5 * 2.0 * np.cos(1.0) + np.sin(1.0) + 3.0)
    assert int(s1["calls"]) == int(s0["calls"]) + 1
    jax_still_works()


# ---- under vmap with warm caches; equinox's filter_custom_jvp ----------------------------

def test_rule_under_vmap_and_warm_caches_matches_eager_per_example():
    pure, s0 = tx.uncurry(functools.partial(_rule_reads_a_scale, TX), f32(0.5))
    grad = jax.jit(jax.vmap(jax.value_and_grad(lambda s, x: pure(s, x), argnums=1, has_aux=True),
                            in_axes=(None, 0)))
    xs = jnp.array([-0.4, 0.1, 0.9], f32)
    # Called twice with different states: the second call reuses every trace.
    for start in (s0, {"seen": jnp.asarray(7, i32), "grad_scale": f32(-2.0)}):
        (outs, s1), gs = grad(start, xs)
        for row, x in enumerate(np.asarray(xs)):
            want_out, want_g, want_state = _eager_value_and_grad(_rule_reads_a_scale, start,
                                                                 f32(x))
            assert_close((outs[row], gs[row]), (want_out, want_g))
            assert_states({k: v[row] for k, v in s1.items()}, want_state)


def test_equinox_filter_custom_jvp_rule_calling_the_function():
    import equinox as eqx

    @eqx.filter_custom_jvp
    def counted(x):
        tx.set_state("calls", tx.get_state("calls", jnp.zeros((), i32)) + 1)
        return jnp.tanh(x) * tx.get_state("gain", f32(1.5))

    @counted.def_jvp
    def _(primals, tangents):
        (x,), (dx,) = primals, tangents
        return counted(x), 0.5 * dx  # a deliberately different tangent

    def prog(x):
        tx.set_state("gain", f32(2.0))
        return counted(x) + counted(2.0 * x)

    pure, s0 = tx.uncurry(prog, f32(0.3))
    (out, s1), g = jax.jit(jax.value_and_grad(lambda x: pure(s0, x), has_aux=True))(f32(0.3))
    # Hand-threaded: two calls, gain 2.0, the rule's tangents 0.5 and 2 * 0.5.
    assert_close((out, g), (2.0 * np.tanh(0.3) + 2.0 * np.tanh(0.6), f32(1.5)))
    assert int(s1["calls"]) == int(s0["calls"]) + 2 and float(s1["gain"]) == 2.0


# ---- backward passes that recompute the forward pass -------------------------------------

def test_custom_vjp_bwd_recomputing_the_function_reads_the_state_the_forward_read():
    # The bwd runs the function again (jax.vjp of it): a state it reads and
    # the forward pass does not change is the value the forward read.
    def g(x):
        return x * tx.get_state("rb_scale", jnp.float32(1.0))

    g_vjp = jax.custom_vjp(g)
    g_vjp.defvjp(lambda x: (g(x), x), lambda x, ct: jax.vjp(g, x)[1](ct))

    def f(x):
        tx.set_state("rb_n", tx.get_state("rb_n", jnp.zeros((), jnp.int32)) + 1)
        return g_vjp(x) ** 2

    pure, s0 = tx.uncurry(f, 2.0)
    s = {**s0, "rb_scale": jnp.float32(3.0)}
    dx = jax.grad(lambda x: pure(s, x)[0])(2.0)
    assert float(dx) == 2 * 3.0 * 2.0 * 3.0  # d (3x)^2 / dx
    _, s1 = pure(s, 2.0)
    assert int(s1["rb_n"]) == 1


def test_custom_vjp_bwd_recomputing_a_state_the_forward_updates_is_a_clear_error():
    # A checkpointed loop recomputes from saved steps: what a state the body
    # updates reads there depends on an order taxpr cannot see.
    import equinox.internal as eqxi  # equinox is a dependency of taxpr

    def body(carry):
        i, y = carry
        n = tx.get_state("rb_k", jnp.zeros(()))
        tx.set_state("rb_k", n + 1.0)
        return i + 1, y * (1.0 + 0.1 * n)

    def loss(x):
        return eqxi.while_loop(lambda c: c[0] < 3, body, (0, x), max_steps=3,
                               kind="checkpointed")[1]

    pure, s0 = tx.uncurry(loss, 2.0)
    with pytest.raises(tx.StateError, match=r"state 'rb_k'.*custom_vjp\[bwd\].*recomputes"):
        jax.grad(lambda x: pure(s0, x)[0])(2.0)


# ---- rules reading a state their function does not use -----------------------------------

def _grad_scale_layer(S):
    """A layer whose JVP rule scales tangents by a gradient scale kept in a
    state; its body uses no state (the program updates the scale)."""
    @jax.custom_jvp
    def scale_grad(x):
        return x

    @scale_grad.defjvp
    def _(primals, tangents):
        return primals[0], tangents[0] * S.get("grad_scale", f32(1.0))

    return scale_grad


def _rule_reads_a_state_the_body_does_not(S, xs):
    """A gradient scale kept in a state, read only by the JVP rule of a
    function whose body uses no state (the state is set elsewhere in the
    program, per step of a scan)."""
    scale_grad = _grad_scale_layer(S)

    def step(c, x):
        S.set("grad_scale", S.get("grad_scale", f32(1.0)) * 2.0)
        return c + jnp.sin(scale_grad(c * x)), None

    return S.scan(step, f32(0.5), xs)[0]


def test_rule_reading_a_state_its_function_does_not_use_sees_the_current_value():
    xs = jnp.array([1.0, 0.5, 2.0], f32)
    pure, s0 = tx.uncurry(functools.partial(_rule_reads_a_state_the_body_does_not, TX), xs)
    for start in (s0, {"grad_scale": f32(0.25)}):
        want_out, want_g, want_state = _eager_value_and_grad(
            _rule_reads_a_state_the_body_does_not, start, xs)
        (out, s1), g = jax.jit(jax.value_and_grad(lambda xs: pure(start, xs), has_aux=True))(xs)
        assert_close((out, g), (want_out, want_g))
        assert_states(s1, want_state)
    # the scale matters: the gradient differs from the one with the init
    _, g_init = jax.value_and_grad(lambda xs: pure({"grad_scale": f32(1.0)}, xs),
                                   has_aux=True)(xs)
    assert not np.allclose(g, g_init)


def _two_calls_of_a_scaled_layer(S, x):
    S.set("grad_scale", S.get("grad_scale", f32(1.0)) * 3.0)
    u = _grad_scale_layer(S)(x)
    return jnp.sin(u) * _grad_scale_layer(S)(x)


@pytest.mark.parametrize("how", ["grad_of_jit", "jvp", "vmap_of_grad", "hessian"])
def test_rule_reading_a_state_its_function_does_not_use_under_jax_transformations(how):
    pure, s0 = tx.uncurry(functools.partial(_two_calls_of_a_scaled_layer, TX), f32(0.5))
    x, starts = f32(0.5), (s0, {"grad_scale": f32(2.0)})

    def eager(start, x):
        return _two_calls_of_a_scaled_layer(Eager(start), x)

    if how == "grad_of_jit":
        for start in starts:
            assert_close(jax.grad(lambda x: jax.jit(pure)(start, x)[0])(x),
                         jax.grad(functools.partial(eager, start))(x))
    elif how == "jvp":
        for start in starts:
            assert_close(jax.jvp(lambda x: pure(start, x)[0], (x,), (f32(1.0),)),
                         jax.jvp(functools.partial(eager, start), (x,), (f32(1.0),)))
    elif how == "vmap_of_grad":
        scales = jnp.array([1.0, 2.0, -0.5], f32)
        got = jax.vmap(jax.grad(lambda x, k: pure({"grad_scale": k}, x)[0]))(
            jnp.full(3, 0.5, f32), scales)
        want = [jax.grad(functools.partial(eager, {"grad_scale": k}))(x) for k in scales]
        assert_close(got, jnp.stack(want))
        assert len(set(np.asarray(got).round(4).tolist())) == 3  # the scale matters
    else:
        for start in starts:
            assert_close(jax.hessian(lambda x: pure(start, x)[0])(x),
                         jax.hessian(functools.partial(eager, start))(x))


def test_rule_reading_a_state_its_function_does_not_use_inside_a_custom_vjp_is_a_clear_error():
    # The custom_vjp's bwd runs after pure has returned its states: a
    # custom_jvp rule it runs cannot read the state as it stands.
    scale_grad = _grad_scale_layer(TX)

    @jax.custom_vjp
    def g(x):
        return jnp.sin(scale_grad(x))

    def fwd(x):
        return g(x), x

    def bwd(x, ct):
        return (jax.vjp(lambda x: jnp.sin(scale_grad(x)), x)[1](ct)[0],)

    g.defvjp(fwd, bwd)

    def prog(x):
        tx.set_state("grad_scale", f32(3.0))
        return g(x)

    pure, s0 = tx.uncurry(prog, f32(0.5))
    assert_close(pure(s0, f32(0.5))[0], np.sin(0.5))
    with pytest.raises(tx.StateError, match=r"state 'grad_scale'.*custom_vjp\[bwd\]"):
        jax.grad(lambda x: pure(s0, x)[0])(f32(0.5))
    jax_still_works()


def test_rule_reading_a_state_inside_a_primitive_without_thread_rule_is_a_clear_error():
    # custom_vmap has no thread rule: the custom_jvp function in it is left
    # as it is, and its rule, run when JAX differentiates, is checked.
    scale_grad = _grad_scale_layer(TX)

    @jax.custom_batching.custom_vmap
    def g(x):
        return jnp.sin(scale_grad(x))

    @g.def_vmap
    def _(axis_size, in_batched, x):
        return jnp.sin(scale_grad(x)), in_batched[0]

    def prog(x):
        tx.set_state("grad_scale", f32(3.0))
        return g(x)

    pure, s0 = tx.uncurry(prog, f32(0.5))
    with pytest.raises(tx.StateError,
                       match=r"state 'grad_scale'.*custom_vmap_call\[call\]/custom_jvp\[jvp rule\]"):
        jax.grad(lambda x: pure(s0, x)[0])(f32(0.5))
    jax_still_works()


def test_rule_drawing_a_key_its_function_does_not_draw_advances_the_stream_as_eagerly():
    # Noisy gradients: the JVP rule of an identity draws from the stream.
    @jax.custom_jvp
    def noisy_grad(x):
        return x

    @noisy_grad.defjvp
    def _(primals, tangents):
        return primals[0], tangents[0] * (1.0 + jax.random.uniform(tx.next_key()))

    def prog(x):
        a = jax.random.normal(tx.next_key())
        return jnp.sin(noisy_grad(x)) + a

    pure, s0 = tx.uncurry(prog, f32(0.5))
    start = {"rng": jax.random.key(7)}
    # By hand: key, sub = split(key) per draw, in the order the draws run.
    k1, s1 = jax.random.split(start["rng"])
    k2, s2 = jax.random.split(k1)
    (out, after), g = jax.value_and_grad(lambda x: pure(start, x), has_aux=True)(f32(0.5))
    assert_close(out, np.sin(0.5) + jax.random.normal(s1))
    assert_close(g, np.cos(0.5) * (1.0 + jax.random.uniform(s2)))
    assert (jax.random.key_data(after["rng"]) == jax.random.key_data(k2)).all()
    # Undifferentiated, the rule does not run: one draw.
    _, after = pure(start, f32(0.5))
    assert (jax.random.key_data(after["rng"]) == jax.random.key_data(k1)).all()


def _eqx_scaled_identity():
    """equinox's filter_custom_jvp around an identity, its rule scaling the
    tangent by a state."""
    import equinox as eqx

    @eqx.filter_custom_jvp
    def scaled(x):
        return x

    @scaled.def_jvp
    def _(primals, tangents):
        return primals[0], tangents[0] * tx.get_state("grad_scale", f32(1.0))

    return scaled


def test_equinox_filter_custom_jvp_rule_reading_a_state_the_program_sets_matches_eager():
    scaled = _eqx_scaled_identity()

    def prog(x):
        tx.set_state("grad_scale", tx.get_state("grad_scale", f32(1.0)) * 2.0)
        return jnp.sum(jnp.sin(scaled(x * 3.0)))

    pure, s0 = tx.uncurry(prog, jnp.ones(3, f32))
    x = jnp.array([0.1, 1.0, 2.0], f32)
    for c in (0.5, 2.0):
        g = jax.jit(jax.grad(lambda x: pure({"grad_scale": f32(c)}, x)[0]))(x)
        # set to 2c before the call; d/dx sin(3x) scaled by it
        assert_close(g, np.cos(3.0 * np.asarray(x)) * 3.0 * (2.0 * c))


def test_a_rule_reading_a_state_in_a_program_without_states_is_a_clear_error():
    # No state to thread: the rule's read cannot see a value, as before.
    scaled = _eqx_scaled_identity()
    pure, s0 = tx.uncurry(lambda x: jnp.sum(jnp.sin(scaled(x))), jnp.ones(3, f32))
    assert s0 == {}
    with pytest.raises(tx.StateError, match=r"state 'grad_scale'.*custom_jvp\[jvp rule\]"):
        jax.grad(lambda x: pure({"grad_scale": f32(2.0)}, x)[0])(jnp.ones(3, f32))
    jax_still_works()


# ---- custom_vjp functions called by a rule or passing a state through --------------------

def _custom_jvp_calling_a_custom_vjp(reads_state: bool):
    @jax.custom_vjp
    def h(x):
        return jnp.sin(x)

    h.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (jnp.cos(x) * ct,))

    def g_fn(x):
        scale = tx.get_state("scale", jnp.float32(2.0)) if reads_state else 2.0
        return h(x) * scale

    g = jax.custom_jvp(g_fn)
    g.defjvp(lambda p, t: jax.jvp(g_fn, p, t))

    def program(x):
        tx.set_state("scale", x * 4.0)  # a state whose tangent is nonzero at the call
        return g(x)

    return g, program


def test_rule_of_a_function_calling_a_custom_vjp_with_a_differentiated_state_around_it():
    # JAX's idiom (a rule that is jax.jvp of the function) around a
    # custom_vjp: JAX transposes the custom_vjp's linearization and never
    # runs it forward. A state with a tangent at the call, which the body
    # does not read, must not make taxpr differentiate the body again.
    g, program = _custom_jvp_calling_a_custom_vjp(reads_state=False)
    x = np.float32(0.5)
    pure, s0 = tx.uncurry(program, x)
    (val, s1), grad = jax.value_and_grad(lambda x: pure(s0, x), has_aux=True)(x)
    want_val, want_grad = jax.value_and_grad(g)(x)  # no state involved
    assert_close(val, want_val)
    assert_close(grad, want_grad)
    assert_close(s1["scale"], x * 4.0)


def test_rule_of_a_function_calling_a_custom_vjp_and_reading_a_differentiated_state():
    # The body reads the state, which has a derivative: it flows through the
    # body (autodiff w.r.t. the state alone, so the custom_vjp, whose input
    # does not depend on the state, is not differentiated in forward mode).
    _, program = _custom_jvp_calling_a_custom_vjp(reads_state=True)
    x = np.float32(0.5)
    pure, s0 = tx.uncurry(program, x)
    grad = jax.grad(lambda x: pure(s0, x)[0])(x)
    # d/dx [sin(x) * scale(x)], scale(x) = 4 x, as eagerly with a dict
    assert_close(grad, np.cos(0.5) * 2.0 + np.sin(0.5) * 4.0)


@pytest.mark.parametrize("where", ["after_another_custom_vjp", "twice", "in_a_scan"])
def test_a_state_a_custom_vjp_reads_is_not_differentiated_by_a_call_that_passes_it_through(where):
    # No derivative w.r.t. the state is asked for, and nothing sets it: a
    # custom_vjp call before (or the previous step of a scan), which does not
    # touch it, must not make it look differentiated (JAX gives every output
    # of a custom_vjp call a tangent).
    count, read_scale = counting_and_scaling_custom_vjps()

    def program(a, b):
        if where == "after_another_custom_vjp":
            return read_scale(*count(a, b))
        if where == "twice":
            return read_scale(*read_scale(a, b))
        (a, b), _ = lax.scan(lambda c, _: (read_scale(*c), None), (a, b), None, length=2)
        return a, b

    args = (np.float32(0.25), np.float32(0.75))
    pure, s0 = tx.uncurry(program, *args)
    state = {**s0, "scale": np.float32(-2.0)}
    (out, s1), vjp_fn = jax.vjp(lambda a, b: pure(state, a, b), *args)
    power = 1 if where == "after_another_custom_vjp" else 2
    assert_close(out[0], 0.25 * (-2.0) ** power)
    assert_close(out[1], 0.75)
    assert_close(s1["scale"], -2.0)
    cts = jax.tree_util.tree_map(
        lambda v: (np.ones_like(v) if jnp.issubdtype(v.dtype, jnp.inexact)
                   else np.zeros(np.shape(v), jax.dtypes.float0)), (out, s1))
    ga, gb = vjp_fn(cts)
    assert_close(ga, (-2.0) ** power)  # the bwd of jax.vjp of the function
    assert_close(gb, 1.0)


def _count_then_read_scale():
    count, read_scale = counting_and_scaling_custom_vjps()
    return lambda a, b: read_scale(*count(a, b))


def test_a_state_passed_through_a_custom_vjp_under_vmap_over_a_batch_of_states():
    # One scale per example: each example's output and gradient use its own
    # scale, and the state passed through the first call keeps its value.
    program = _count_then_read_scale()
    args = (np.float32(0.25), np.float32(0.75))
    pure, s0 = tx.uncurry(program, *args)
    scales = np.array([-2.0, 0.5, 3.0], np.float32)
    states = {"calls": np.zeros(3, np.int32), "scale": scales}

    def loss(state, a, b):
        (out, s1) = pure(state, a, b)
        return out[0] + out[1], s1

    (val, s1), ga = jax.vmap(jax.value_and_grad(loss, argnums=1, has_aux=True),
                             in_axes=(0, None, None))(states, *args)
    assert_close(val, 0.25 * scales + 0.75)
    assert_close(ga, scales)
    assert_close(s1["scale"], scales)
    np.testing.assert_array_equal(s1["calls"], [1, 1, 1])


def test_a_state_passed_through_a_custom_vjp_under_jit_of_grad_with_warm_caches():
    program = _count_then_read_scale()
    args = (np.float32(0.25), np.float32(0.75))
    pure, s0 = tx.uncurry(program, *args)
    grad = jax.jit(jax.grad(lambda a, state: pure(state, a, np.float32(0.75))[0][0]))
    for scale in (-2.0, 0.5, 4.0):  # the second and third calls hit the caches
        state = {**s0, "scale": np.float32(scale)}
        assert_close(grad(np.float32(0.25), state), scale)


def test_a_custom_jvp_calling_a_custom_vjp_with_a_differentiated_state_under_jit_and_vmap():
    _, program = _custom_jvp_calling_a_custom_vjp(reads_state=True)
    xs = np.array([0.5, -1.0, 2.0], np.float32)
    pure, s0 = tx.uncurry(program, xs[0])
    grad = jax.jit(jax.vmap(jax.grad(lambda x: pure(s0, x)[0])))
    for _ in range(2):  # the second call hits the caches
        # d/dx [sin(x) * scale(x)], scale(x) = 4 x, per example
        assert_close(grad(xs), np.cos(xs) * 4.0 * xs + np.sin(xs) * 4.0)


def test_a_state_passed_through_a_custom_vjp_inside_shard_map():
    from helpers import cpu_mesh, shard_map
    from jax.sharding import PartitionSpec as P

    mesh = cpu_mesh("x")
    inner = _count_then_read_scale()

    def program(a, b):
        # Replicated operands: every shard computes the same, so the states
        # set there are the same on every shard (vma checking on).
        return shard_map()(inner, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P()))(a, b)

    args = (np.float32(0.25), np.float32(0.75))
    pure, s0 = tx.uncurry(program, *args)
    state = {**s0, "scale": np.float32(-2.0)}
    (out, s1), vjp_fn = jax.vjp(lambda a, b: pure(state, a, b), *args)
    assert_close(out[0], 0.25 * -2.0)
    assert_close(out[1], 0.75)
    assert_close(s1["scale"], -2.0)
    assert int(s1["calls"]) == 1
    cts = jax.tree_util.tree_map(
        lambda v: (np.ones_like(v) if jnp.issubdtype(v.dtype, jnp.inexact)
                   else np.zeros(np.shape(v), jax.dtypes.float0)), (out, s1))
    ga, gb = vjp_fn(cts)
    assert_close(ga, -2.0)
    assert_close(gb, 1.0)


# ---- rules inside vmap, harvest and rules that cannot be traced --------------------------

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


@pytest.mark.parametrize("entry", ["grad_of_pure", "tx.grad"])
def test_a_differentiated_state_a_custom_vjp_hands_on_has_the_identity_derivative(entry):
    # The custom_vjp's body uses another state (a counter), so its call
    # threads every state; the differentiated "k" only passes through it
    # (also through the fwd's own call of the function), so its derivative
    # is the identity and no error is due.
    @jax.custom_vjp
    def counted_sin(y):
        tx.set_state("n", tx.get_state("n", np.int32(0)) + 1)
        return jnp.sin(y)

    counted_sin.defvjp(lambda y: (counted_sin(y), y), lambda y, ct: (jnp.cos(y) * ct,))

    def loss(a):
        tx.set_state("k", a * 2.0)
        return counted_sin(a) + tx.get_state("k", f32(0.0))  # sin(a) + 2 a

    a = f32(0.5)
    if entry == "grad_of_pure":
        pure, s0 = tx.uncurry(loss, a)
        grad = jax.grad(lambda a: pure(s0, a)[0])(a)
    else:
        pure, s0 = tx.uncurry(tx.grad(loss), a)
        grad, s1 = pure(s0, a)
        assert int(s1["n"]) == 1
    assert_close(grad, np.cos(0.5) + 2.0)

"""``tx.value_and_grad`` / ``tx.grad`` (``taxpr._state._grad``): derivatives
taken inside a stateful function flow through its states. Each program is
compared with the same computation written with explicit carries and
differentiated by JAX (the state threaded by hand), or with finite
differences; values and states with eager Python and a dict."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx
from taxpr import harvest as h

from helpers import check
from state_helpers import sow_after_a_first_use_in_a_branch

f32 = np.float32


def _set_then_read(x):
    tx.set_state("h", x * 2.0)
    return tx.get_state("h", f32(0.0)) * 3.0  # eagerly: 6 x


def test_a_value_read_back_after_a_set_carries_its_derivative():
    pure, s0 = tx.uncurry(tx.value_and_grad(_set_then_read), f32(0.5))
    (value, grad), s1 = pure(s0, f32(0.5))
    assert (float(value), float(grad), float(s1["h"])) == (3.0, 6.0, 1.0)
    pure_g, _ = tx.uncurry(tx.grad(_set_then_read), f32(0.5))
    assert float(jax.jit(pure_g)(s0, f32(0.5))[0]) == 6.0


def _rnn_loss(w, x):
    h = tx.get_state("h", lambda: jnp.zeros(2))
    h = jnp.tanh(w @ h + x)
    tx.set_state("h", h)
    return (tx.get_state("h", lambda: jnp.zeros(2)) ** 2).sum()


def _rnn_loss_by_hand(w, x, h):
    h = jnp.tanh(w @ h + x)
    return (h ** 2).sum(), h


W = np.array([[0.5, -0.3], [0.2, 0.4]], np.float32)
XS = np.linspace(0.1, 0.8, 8, dtype=np.float32).reshape(4, 2)


def test_a_training_loop_in_a_scan_differentiates_through_the_hidden_state():
    def train(w, xs):
        def step(w, x):
            loss, g = tx.value_and_grad(_rnn_loss)(w, x)
            tx.set_state("steps", tx.get_state("steps", np.int32(0)) + 1)
            return w - 0.1 * g, loss
        return lax.scan(step, w, xs)

    def by_hand(w, xs, h):
        losses = []
        for x in xs:
            (loss, h), g = jax.value_and_grad(_rnn_loss_by_hand, has_aux=True)(w, x, h)
            w = w - 0.1 * g
            losses.append(loss)
        return w, np.stack(losses), h

    pure, s0 = tx.uncurry(train, W, XS)
    check(tx.make_jaxpr(train)(W, XS)[0])
    state, h = s0, np.zeros(2, np.float32)
    for _ in range(2):  # the second call starts where the first left off
        (w, losses), state = jax.jit(pure)(state, W, XS)
        w_ref, losses_ref, h = by_hand(W, XS, h)
        np.testing.assert_allclose(w, w_ref, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(losses, losses_ref, rtol=1e-6)
        np.testing.assert_allclose(state["h"], h, rtol=1e-6)
    assert int(state["steps"]) == 8


def test_the_gradient_through_two_steps_matches_finite_differences():
    def two_steps(w):
        return _rnn_loss(w, XS[0]) + _rnn_loss(w, XS[1])

    pure, s0 = tx.uncurry(tx.grad(two_steps), W)
    g, _ = pure(s0, W)

    def loss_by_hand(w):
        w = np.asarray(w, np.float64)
        h = np.zeros(2)
        total = 0.0
        for x in XS[:2]:
            h = np.tanh(w @ h + x)
            total += (h ** 2).sum()
        return total

    eps = 1e-4
    fd = np.zeros_like(W, dtype=np.float64)
    for idx in np.ndindex(W.shape):
        dw = np.zeros(W.shape)
        dw[idx] = eps
        fd[idx] = (loss_by_hand(W + dw) - loss_by_hand(W - dw)) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=1e-3, atol=1e-4)


def test_scopes_pytree_states_aux_and_argnums_as_jax_value_and_grad():
    def layer(w, b, x):
        count, prev = tx.get_state("st", (f32(0.0), jnp.zeros(2)))
        y = jnp.tanh(w * x + b + prev)
        tx.set_state("st", (count + 1.0, y))
        return (y ** 2).sum(), y

    vg = tx.value_and_grad(layer, argnums=(0, 1), has_aux=True)

    def program(w, b, x):
        with tx.scope("a"):  # one wrapper, called in two scopes and twice in one
            first = vg(w, b, x)
            second = vg(w, b, x)
        with tx.scope("b"):
            other = vg(w, b, x)
        return first, second, other

    def by_hand(w, b, x, st):
        y = jnp.tanh(w * x + b + st[1])
        return (y ** 2).sum(), (y, (st[0] + 1.0, y))

    w, b, x = f32(0.7), f32(0.1), np.array([0.2, -0.4], np.float32)
    pure, s0 = tx.uncurry(program, w, b, x)
    (first, second, other), s1 = pure(s0, w, b, x)
    st = (f32(0.0), np.zeros(2, np.float32))
    ref1 = jax.value_and_grad(by_hand, argnums=(0, 1), has_aux=True)(w, b, x, st)
    ref2 = jax.value_and_grad(by_hand, argnums=(0, 1), has_aux=True)(w, b, x, ref1[0][1][1])
    for got, ref in ((first, ref1), (second, ref2), (other, ref1)):
        (value, aux), grads = got
        (value_ref, (aux_ref, _)), grads_ref = ref
        np.testing.assert_allclose(value, value_ref, rtol=1e-6)
        np.testing.assert_allclose(aux, aux_ref, rtol=1e-6)
        assert isinstance(grads, tuple) and len(grads) == 2
        for g, g_ref in zip(grads, grads_ref):
            np.testing.assert_allclose(g, g_ref, rtol=1e-5)
    assert float(s1["a"]["st"][0]) == 2.0 and float(s1["b"]["st"][0]) == 1.0
    np.testing.assert_allclose(s1["a"]["st"][1], ref2[0][1][1][1], rtol=1e-6)


def test_keys_drawn_inside_advance_the_stream_as_eagerly():
    def noisy(x):
        return (x * jax.random.normal(tx.next_key(), x.shape)).sum()

    def program(x):
        return tx.grad(noisy)(x), tx.grad(noisy)(x)

    key, x = jax.random.key(1), jnp.ones(3)
    g1, g2 = tx.seed(program, key)(x)
    key, sub1 = jax.random.split(key)
    key, sub2 = jax.random.split(key)
    np.testing.assert_array_equal(g1, jax.random.normal(sub1, (3,)))
    np.testing.assert_array_equal(g2, jax.random.normal(sub2, (3,)))


def test_sows_inside_are_reaped_from_outside():
    def sowing(x):
        c = tx.get_state("c", f32(1.0))
        y = h.sow(jnp.sin(x) * c, tag="t", name="y", mode="clobber")
        tx.set_state("c", c + 1.0)
        return y.sum()

    x = np.array([0.3, -0.2], np.float32)
    pure, s0 = tx.uncurry(tx.value_and_grad(sowing), x)
    ((value, grad), s1), reaps = h.call_and_reap(pure, tag="t")({"c": f32(2.0)}, x)
    np.testing.assert_allclose(reaps["y"], 2.0 * np.sin(x), rtol=1e-6)
    np.testing.assert_allclose(grad, 2.0 * np.cos(x), rtol=1e-6)
    assert float(s1["c"]) == 3.0


def test_differentiating_pure_from_outside_gives_the_second_derivative():
    def program(w):
        def f(w):
            k = tx.set_state("k", tx.get_state("k", f32(1.0)) * w)
            return k ** 2  # (k w)^2: derivative 2 k^2 w
        return tx.grad(f)(w)

    pure, s0 = tx.uncurry(program, f32(3.0))
    for k in (1.0, 2.0):
        assert float(pure({"k": f32(k)}, f32(3.0))[0]) == 2 * k * k * 3.0
        assert float(jax.grad(lambda w: pure({"k": f32(k)}, w)[0])(f32(3.0))) == 2 * k * k


def test_vmap_of_pure_over_a_batch_of_states():
    def program(x):
        def f(x):
            v = tx.set_state("h", tx.get_state("h", f32(1.0)) * x)
            return v * tx.get_state("h", f32(1.0))  # (h x)^2
        return tx.grad(f)(x)

    pure, _ = tx.uncurry(program, f32(2.0))
    hs = np.array([1.0, 2.0, 3.0], np.float32)
    g, s = jax.vmap(pure, in_axes=({"h": 0}, None))({"h": hs}, f32(2.0))
    np.testing.assert_allclose(g, 2 * hs ** 2 * 2.0)
    np.testing.assert_allclose(s["h"], hs * 2.0)


def test_a_custom_jvp_rule_reads_the_state_as_it_stands():
    @jax.custom_jvp
    def scaled_identity(x):
        return x

    @scaled_identity.defjvp
    def _(primals, tangents):
        return primals[0], tangents[0] * tx.get_state("scale", f32(0.5))

    def loss(x):
        tx.set_state("y", scaled_identity(x) * 3.0)
        return tx.get_state("y", f32(0.0)) ** 2  # (3 x)^2, its derivative scaled

    pure, s0 = tx.uncurry(tx.value_and_grad(loss), f32(1.0))
    for scale in (0.5, 2.0):
        (value, grad), _ = pure({**s0, "scale": f32(scale)}, f32(1.0))
        assert (float(value), float(grad)) == (9.0, 18.0 * scale)


def test_a_state_only_a_custom_jvp_rule_sets_is_set_where_the_rule_runs():
    # The function's body only reads the counter; its rule (which runs in
    # its place when differentiated) counts. Eagerly, each step's
    # differentiation runs the rule once.
    @jax.custom_jvp
    def counted_sin(x):
        return jnp.sin(x) + 0.0 * tx.get_state("rule_calls", jnp.int32(0))

    @counted_sin.defjvp
    def _(primals, tangents):
        tx.set_state("rule_calls", tx.get_state("rule_calls", jnp.int32(0)) + 1)
        return jax.jvp(counted_sin.fun, primals, tangents)

    def step(c, x):
        value, g = tx.value_and_grad(lambda x: counted_sin(x) * x)(x)
        return c + value + g, None

    xs = jnp.linspace(0.1, 0.9, 3, dtype=f32)
    pure, s0 = tx.uncurry(lambda xs: lax.scan(step, f32(0.0), xs)[0], xs)
    for run in (pure, jax.jit(pure)):
        total, s1 = run(s0, xs)
        assert int(s1["rule_calls"]) == 3
        x = np.asarray(xs, np.float64)
        np.testing.assert_allclose(total, np.sum(np.sin(x) * x + np.cos(x) * x + np.sin(x)),
                                   rtol=1e-6)
        total, s2 = run(s1, xs)  # the count goes on
        assert int(s2["rule_calls"]) == 6


@pytest.mark.parametrize("body_uses_state", [False, True])
def test_a_state_a_bwd_sets_is_set_where_the_backward_pass_runs(body_uses_state):
    # A gradient logged by a custom_vjp bwd: the bwd runs inside the
    # enclosing uncurry's trace, which threads the state it sets.
    @jax.custom_vjp
    def logged(x):
        if body_uses_state:
            tx.set_state("n", tx.get_state("n", np.int32(0)) + 1)
        return jnp.sin(x)

    def bwd(x, ct):
        tx.set_state("gnorm", jnp.abs(ct))
        return (jnp.cos(x) * ct,)

    logged.defvjp(lambda x: (logged(x), x), bwd)

    def loss(x):
        tx.set_state("s", logged(x))
        return tx.get_state("s", f32(0.0)) ** 2  # sin(x)^2

    x = f32(0.5)
    pure, s0 = tx.uncurry(tx.value_and_grad(loss), x)
    assert float(s0["gnorm"]) == 0.0  # only ever set: zeros
    for run in (pure, jax.jit(pure)):
        (value, grad), s1 = run(s0, x)
        np.testing.assert_allclose(value, np.sin(x) ** 2, rtol=1e-6)
        np.testing.assert_allclose(grad, 2 * np.sin(x) * np.cos(x), rtol=1e-6)
        np.testing.assert_allclose(s1["gnorm"], 2 * np.sin(x), rtol=1e-6)  # d loss / d sin(x)
        assert int(s1.get("n", 1)) == 1
    # Outside every transformation there is nothing to set it in: an error
    # naming the state and the bwd, as for jax.grad of pure from outside.
    with pytest.raises(tx.StateError, match=r"set_state\('gnorm'\) at custom_vjp\[bwd\]"):
        tx.value_and_grad(loss)(x)
    plain, p0 = tx.uncurry(loss, x)
    with pytest.raises(tx.StateError, match=r"set_state\('gnorm'\) at custom_vjp\[bwd\]"):
        jax.grad(lambda x: plain(p0, x)[0])(x)


def test_without_states_it_is_jax_value_and_grad():
    f = lambda x, y: (jnp.sin(x) * y, x)  # noqa: E731
    got = tx.value_and_grad(f, argnums=1, has_aux=True)(f32(0.3), f32(2.0))
    want = jax.value_and_grad(f, argnums=1, has_aux=True)(f32(0.3), f32(2.0))
    assert jax.tree.map(float, got) == jax.tree.map(float, want)


def test_outside_every_transformation_states_start_at_their_inits_and_updates_are_lost():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value, grad = tx.value_and_grad(
            lambda x: tx.set_state("q", x * 2.0) * tx.get_state("q", f32(0.0)))(f32(2.0))
    assert (float(value), float(grad)) == (16.0, 16.0)  # (2x)^2 at x = 2, as with a dict
    assert any(issubclass(w.category, tx.StateNotUncurriedWarning) and "'q'" in str(w.message)
               for w in caught)


def test_under_jit_inside_the_function():
    def program(w, x):
        return jax.jit(tx.value_and_grad(_rnn_loss))(w, x)

    pure, s0 = tx.uncurry(program, W, XS[0])
    state, h = s0, np.zeros(2, np.float32)
    for x in XS[:3]:
        (value, grad), state = pure(state, W, x)
        (value_ref, h), grad_ref = jax.value_and_grad(_rnn_loss_by_hand, has_aux=True)(W, x, h)
        np.testing.assert_allclose(value, value_ref, rtol=1e-6)
        np.testing.assert_allclose(grad, grad_ref, rtol=1e-6)
        np.testing.assert_allclose(state["h"], h, rtol=1e-6)


def test_a_first_use_in_a_branch_does_not_repeat_sows_or_callbacks():
    # The initial value of "c" needs a run of the function (its first use is
    # in a cond branch); that run is inside the enclosing trace.
    calls = []

    def fun(x, p):
        y = sow_after_a_first_use_in_a_branch(x, p, calls)
        return (y * tx.get_state("c", jnp.zeros(2))).sum()  # (2 x) . (2 x)

    x, p = np.array([1.0, 2.0], np.float32), f32(1.0)
    pure, s0 = tx.uncurry(tx.value_and_grad(fun), x, p)
    calls.clear()
    ((value, grad), s1), reaps = h.call_and_reap(pure, tag="t")(s0, x, p)
    jax.effects_barrier()
    assert float(value) == 20.0 and grad.tolist() == [8.0, 16.0]
    assert s1["c"].tolist() == [2.0, 4.0]
    assert reaps["y"].tolist() == [[2.0, 4.0]]
    assert len(calls) == 1


def test_a_state_set_only_in_a_branch_not_taken_keeps_its_value():
    def fun(x, p):
        def set_it(x):
            tx.set_state("s", x)
            return x
        return lax.cond(p > 0, set_it, lambda x: x, x) ** 2

    pure, s0 = tx.uncurry(tx.value_and_grad(fun), f32(3.0), f32(1.0))
    assert float(s0["s"]) == 0.0  # only ever set: zeros, as uncurry gives
    for p, want in ((-1.0, 5.0), (1.0, 3.0)):
        (value, grad), s1 = pure({"s": f32(5.0)}, f32(3.0), f32(p))
        assert (float(value), float(grad), float(s1["s"])) == (9.0, 6.0, want)


def test_grad_of_grad_differentiates_twice_through_the_state():
    def f(x):
        tx.set_state("h", tx.get_state("h", f32(1.0)) * x)
        return tx.get_state("h", f32(1.0)) ** 3  # (h x)^3: second derivative 6 h^3 x

    pure, _ = tx.uncurry(tx.grad(tx.grad(f)), f32(2.0))
    for h0 in (1.0, 2.0):
        g2, s1 = pure({"h": f32(h0)}, f32(2.0))
        assert (float(g2), float(s1["h"])) == (6 * h0 ** 3 * 2.0, h0 * 2.0)

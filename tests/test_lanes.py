"""``tx.uncurry_vmap`` (states of their own per vmap lane) and
``tx.bounded_while_loop``, each against a reference written by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taxpr as tx


def neuron(i_ext):
    """A leaky neuron whose weight is drawn at init and whose potential
    starts from its input."""
    w = tx.get_state("w", lambda: jax.random.uniform(tx.next_key(), (3,)))
    v = tx.get_state("v", lambda: 0.5 * i_ext * jnp.ones(3))
    v = tx.set_state("v", 0.9 * v + w * i_ext)
    return v.sum()


def test_each_lane_starts_from_its_own_key_and_arguments():
    key, xs = jax.random.key(7), jnp.arange(1.0, 5.0)
    pure, states = tx.uncurry_vmap(neuron, key, xs)
    for i, k in enumerate(jax.random.split(key, 4)):
        k_init, _ = jax.random.split(k)
        # eager Python with a key variable: the init draws split(k_init)[1]
        w = jax.random.uniform(jax.random.split(k_init)[1], (3,))
        np.testing.assert_allclose(states["w"][i], w)
        np.testing.assert_allclose(states["v"][i], 0.5 * xs[i] * jnp.ones(3))
    # the stream continues from each lane's second key
    for i, k in enumerate(jax.random.split(key, 4)):
        want = jax.random.key_data(jax.random.split(k)[1])
        assert (jax.random.key_data(states["rng"][i]) == want).all()
    assert not np.allclose(states["w"][0], states["w"][1])

    out, new = jax.jit(pure)(states, xs)
    want_v = 0.9 * states["v"] + states["w"] * xs[:, None]
    np.testing.assert_allclose(new["v"], want_v, rtol=1e-6)
    np.testing.assert_allclose(out, want_v.sum(1), rtol=1e-6)


def test_a_lane_keeps_drawing_from_its_own_stream():
    def noisy(x):
        w = tx.get_state("w", lambda: jax.random.normal(tx.next_key()))
        return w * x + jax.random.normal(tx.next_key())

    key = jax.random.key(3)
    pure, states = tx.uncurry_vmap(noisy, key, jnp.ones(2))
    out, new = pure(states, jnp.arange(2.0))
    one, _ = tx.uncurry(noisy, 1.0)
    for i in range(2):  # each lane run alone by uncurry's pure function
        lane = jax.tree_util.tree_map(lambda s: s[i], states)
        want, want_state = one(lane, jnp.float32(i))
        np.testing.assert_allclose(out[i], want, rtol=1e-6)
        assert (jax.random.key_data(new["rng"][i]) ==
                jax.random.key_data(want_state["rng"])).all()
    data = jax.random.key_data(new["rng"])
    assert not (data[0] == data[1]).all()  # the lanes' streams differ


def test_in_axes_axis_size_and_a_raw_key():
    def scaled(x, scale):
        v = tx.get_state("v", lambda: jax.random.normal(tx.next_key(), (2,)))
        return tx.set_state("v", v * scale + x)

    raw = jax.random.PRNGKey(0)
    pure, states = tx.uncurry_vmap(scaled, raw, jnp.ones(2), 2.0, in_axes=None, axis_size=5)
    assert states["v"].shape == (5, 2)
    out, new = pure(states, jnp.ones(2), 2.0)
    np.testing.assert_allclose(out, states["v"] * 2.0 + 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="axis_size"):
        tx.uncurry_vmap(scaled, raw, jnp.ones(2), 2.0, in_axes=None)
    with pytest.raises(ValueError, match="in_axes"):
        tx.uncurry_vmap(scaled, raw, jnp.ones(2), 2.0, in_axes=(0,))


def _by_hand(w):
    x, n = w, 0.0
    for _ in range(5):
        n, x = n + x, jnp.sin(w * x)
    return x, n


@pytest.mark.parametrize("checkpoint", [True, False])
def test_bounded_while_loop_differentiates_its_states(checkpoint):
    def f(w):
        def body(c):
            i, x = c
            tx.set_state("n", tx.get_state("n", jnp.zeros(())) + x)
            return i + 1, jnp.sin(w * x)
        return tx.bounded_while_loop(lambda c: c[0] < 5, body, (0, w), max_steps=8,
                                     checkpoint=checkpoint)[1]

    pure, state0 = tx.uncurry(f, 0.7)
    out, state1 = jax.jit(pure)(state0, 0.7)
    want_x, want_n = _by_hand(0.7)
    np.testing.assert_allclose(out, want_x, rtol=1e-6)
    np.testing.assert_allclose(state1["n"], want_n, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda w: pure(state0, w)[1]["n"])(0.7),
                               jax.grad(lambda w: _by_hand(w)[1])(0.7), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(lambda w: pure(state0, w)[0])(0.7),
                               jax.grad(lambda w: _by_hand(w)[0])(0.7), rtol=1e-5)


def test_bounded_while_loop_stops_at_its_bound():
    out = tx.bounded_while_loop(lambda i: i < 100, lambda i: i + 1, 0, max_steps=7)
    assert int(out) == 7
    assert int(tx.bounded_while_loop(lambda i: i < 3, lambda i: i + 1, 0, max_steps=7)) == 3


def test_an_init_under_a_cond_that_draws_a_key_is_an_error_naming_the_state():
    def f(x):
        def taken(x):
            n = tx.get_state("n", lambda: jax.random.normal(tx.next_key()))
            return tx.set_state("n", n + x)
        return jax.lax.cond(x > 0, taken, lambda x: x, x)

    with pytest.raises(tx.StateError, match="'n'"):
        tx.uncurry_vmap(f, jax.random.key(0), jnp.array([1.0, 2.0]))


def test_bounded_while_loop_with_relu_in_its_body_differentiated_from_outside():
    # relu is a custom_jvp: its rule runs in the body's place under grad.
    # The reference is the loop unrolled by hand, without taxpr.
    def body(c):
        i, v = c
        h = jax.nn.relu(v - 0.5)
        tx.set_state("acc", tx.get_state("acc", jnp.zeros(())) + h)
        return i + 1, 0.9 * v + h

    def f(x):
        return tx.bounded_while_loop(lambda c: c[0] < 3, body, (0, x), max_steps=5)[1]

    def by_hand(x):
        v, acc = x, 0.0
        for _ in range(3):
            h = jax.nn.relu(v - 0.5)
            v, acc = 0.9 * v + h, acc + h
        return v, acc

    pure, state0 = tx.uncurry(f, 2.0)
    loss = lambda x: pure(state0, x)[0] + pure(state0, x)[1]["acc"]  # noqa: E731
    want = lambda x: sum(by_hand(x))  # noqa: E731
    for x in (2.0, 0.2):  # relu on and off
        np.testing.assert_allclose(jax.grad(loss)(x), jax.grad(want)(x), rtol=1e-6)
        np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), jax.grad(want)(x), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(jax.grad(loss))(jnp.array([2.0, 0.2])),
                               [jax.grad(want)(2.0), jax.grad(want)(0.2)], rtol=1e-6)

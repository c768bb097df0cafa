"""A state set from differentiated inputs inside a custom_vjp whose fwd
runs in the function's place (equinox's checkpointed loops): its derivative
is a clear StateError, never a silent zero; the same loop written with
``lax.scan`` and ``jax.checkpoint`` differentiates like the state threaded
by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taxpr as tx


def _body(c, _):
    tx.set_state("m", tx.get_state("m", jnp.zeros(())) + jnp.sin(c))
    return c * 1.1, c


def _by_hand(x):
    m = jnp.zeros(())
    for _ in range(10):
        m, x = m + jnp.sin(x), x * 1.1
    return m


@pytest.mark.parametrize("loop", ["lax.scan", "lax.scan(checkpoint)"])
def test_the_derivative_of_a_state_a_differentiable_loop_sets_is_the_hand_threaded_one(loop):
    body = _body if loop == "lax.scan" else jax.checkpoint(_body)
    pure, s0 = tx.uncurry(lambda x: jax.lax.scan(body, x, None, length=10)[1], 1.0)
    got = jax.grad(lambda x: pure(s0, x)[1]["m"])(1.0)
    np.testing.assert_allclose(got, jax.grad(_by_hand)(1.0), rtol=1e-5)
    np.testing.assert_allclose(got, -2.0299, atol=1e-3)


@pytest.mark.parametrize("kind", ["scan", "while_loop"])
def test_the_derivative_of_a_state_an_equinox_checkpointed_loop_sets_is_a_state_error(kind):
    import equinox.internal as eqxi

    def g(x):
        if kind == "scan":
            return eqxi.scan(_body, x, None, length=10, kind="checkpointed", checkpoints=3)[1]

        def step(carry):
            i, c = carry
            return i + 1, _body(c, None)[0]
        return eqxi.while_loop(lambda carry: carry[0] < 10, step, (0, x), max_steps=10,
                               kind="checkpointed", checkpoints=3)[1]

    pure, s0 = tx.uncurry(g, 1.0)
    # the forward values are right
    np.testing.assert_allclose(pure(s0, 1.0)[1]["m"], _by_hand(1.0), rtol=1e-5)
    with pytest.raises(tx.StateError, match="'m'.*custom_vjp"):
        jax.grad(lambda x: pure(s0, x)[1]["m"])(1.0)

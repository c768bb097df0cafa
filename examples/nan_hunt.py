"""Training until a NaN appears, and finding where it was born.

A logistic regression trained with a learning rate that is too large, its
log-likelihood written naively as ``log(1 / (1 + exp(-z)))``: once the
weights grow, ``exp(-z)`` overflows to ``inf``, the loss becomes ``-inf``
and the next update is NaN. The whole training (200 steps) runs in one
``lax.scan`` under ``jit``; ``tx.debug_nans`` names the ``exp`` that
overflowed, its line, the training step, and the pass (the gradient's
computation). The step is checked against a Python loop that runs the same
updates one by one with NumPy checks; the fix (``jax.nn.log_sigmoid``)
trains without error.

Run: ``python examples/nan_hunt.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import taxpr as tx

STEPS, LR = 200, 10.0


def data(key, n=64):
    kx, kn = jax.random.split(key)
    x = jax.random.normal(kx, (n, 2)) * 3.0
    y = (x[:, 0] - x[:, 1] + 0.5 * jax.random.normal(kn, (n,)) > 0).astype(jnp.float32)
    return x, y


def naive_log_sigmoid(z):
    return jnp.log(1.0 / (1.0 + jnp.exp(-z)))  # overflows for z < -88


def make_train(log_sigmoid):
    def loss(w, x, y):
        z = x @ w
        return -jnp.mean(y * log_sigmoid(z) + (1.0 - y) * log_sigmoid(-z))

    def train(w, x, y):
        def step(w, _):
            value, g = jax.value_and_grad(loss)(w, x, y)
            return w - LR * g, value
        return lax.scan(step, w, None, length=STEPS)

    return loss, train


def first_overflow_step(loss, w, x, y) -> int:
    """The reference: the same updates in a Python loop, the first step at
    which ``exp(-z)`` or ``exp(z)`` overflows (a check outside taxpr)."""
    w = np.asarray(w)
    for i in range(STEPS):
        z = np.asarray(x) @ w
        with np.errstate(over="ignore"):
            if not (np.isfinite(np.exp(-z.astype(np.float32))).all()
                    and np.isfinite(np.exp(z.astype(np.float32))).all()):
                return i
        _, g = jax.value_and_grad(loss)(jnp.asarray(w), x, y)
        w = w - LR * np.asarray(g)
    raise AssertionError("no overflow")


def main() -> None:
    x, y = data(jax.random.key(0))
    w0 = jnp.zeros((2,))
    loss, train = make_train(naive_log_sigmoid)
    expected_step = first_overflow_step(loss, w0, x, y)
    try:
        tx.debug_nans(jax.jit(train))(w0, x, y)
    except tx.NonFiniteError as e:
        print(e)
        assert e.primitive == "exp" and e.kind == "inf", e
        assert "naive_log_sigmoid" in e.source, e.source
        assert e.iterations == (("scan", expected_step),), (e.iterations, expected_step)
    else:
        raise AssertionError("the naive loss trained without a non-finite value")

    _, train_fixed = make_train(jax.nn.log_sigmoid)
    w, losses = tx.debug_nans(jax.jit(train_fixed))(w0, x, y)
    assert np.isfinite(np.asarray(losses)).all()
    print(f"with jax.nn.log_sigmoid: final loss {float(losses[-1]):.4f}, w = {np.asarray(w)}")


if __name__ == "__main__":
    main()

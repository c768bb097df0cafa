"""A stateful RNN: the hidden state is taxpr state inside a raw ``lax.scan``.

The cell reads its hidden state with ``tx.get_state("h", ...)`` and writes it
back with ``tx.set_state``; the sequence loop is a plain ``jax.lax.scan``
whose carry is empty (no framework wrapper such as ``hk.scan`` or
``nn.scan``). ``tx.uncurry`` turns the model into a pure function
``pure(state, params, xs) -> (ys, new_state)``, which is checked against a
hand-written pure RNN that carries the hidden state through the scan itself:

* the outputs and the final hidden state agree to float tolerance, from the
  initial state and from a non-zero one (a second sequence continuing the
  first);
* the same holds under ``jax.jit``;
* ``jax.grad`` of a loss w.r.t. the weights agrees with the hand-written
  model's gradient.

Run: ``python examples/stateful_rnn.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import taxpr as tx

IN, HIDDEN, OUT, STEPS = 3, 16, 2, 20


def init_params(key: jax.Array) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "wx": jax.random.normal(k1, (IN, HIDDEN)) / np.sqrt(IN),
        "wh": jax.random.normal(k2, (HIDDEN, HIDDEN)) / np.sqrt(HIDDEN),
        "b": jnp.zeros((HIDDEN,)),
        "wo": jax.random.normal(k3, (HIDDEN, OUT)) / np.sqrt(HIDDEN),
    }


# -- the stateful model --------------------------------------------------------

def cell(params: dict, x: jax.Array) -> jax.Array:
    """One step: the hidden state lives in taxpr state ``"h"``."""
    h = tx.get_state("h", jnp.zeros((HIDDEN,), jnp.float32))
    h = jnp.tanh(x @ params["wx"] + h @ params["wh"] + params["b"])
    tx.set_state("h", h)
    return h @ params["wo"]


def rnn(params: dict, xs: jax.Array) -> jax.Array:
    """The cell over a sequence with a raw ``lax.scan`` (no carry)."""
    def body(carry, x):
        return carry, cell(params, x)

    _, ys = lax.scan(body, None, xs)
    return ys


# -- the hand-written pure equivalent --------------------------------------------

def rnn_reference(h0: jax.Array, params: dict, xs: jax.Array):
    """The same RNN with the hidden state as the scan carry."""
    def body(h, x):
        h = jnp.tanh(x @ params["wx"] + h @ params["wh"] + params["b"])
        return h, h @ params["wo"]

    h, ys = lax.scan(body, h0, xs)
    return ys, h


def close(a, b, tol=1e-5) -> bool:
    return all(np.allclose(x, y, rtol=tol, atol=tol)
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def main() -> dict:
    kp, kx, ky, kx2 = jax.random.split(jax.random.key(0), 4)
    params = init_params(kp)
    xs = jax.random.normal(kx, (STEPS, IN))
    targets = jax.random.normal(ky, (STEPS, OUT))

    pure, state0 = tx.uncurry(rnn, params, xs)
    assert set(state0) == {"h"} and np.all(state0["h"] == 0), state0

    # Eager: outputs and final hidden state match the hand-written RNN.
    ys, state1 = pure(state0, params, xs)
    ys_ref, h1_ref = rnn_reference(state0["h"], params, xs)
    assert ys.shape == (STEPS, OUT)
    assert close(ys, ys_ref) and close(state1["h"], h1_ref)

    # A second sequence continues from the first one's hidden state.
    xs2 = jax.random.normal(kx2, (STEPS, IN))
    ys2, state2 = pure(state1, params, xs2)
    ys2_ref, h2_ref = rnn_reference(h1_ref, params, xs2)
    assert close(ys2, ys2_ref) and close(state2["h"], h2_ref)
    assert not np.allclose(state2["h"], 0.0)

    # jit.
    ys_j, state1_j = jax.jit(pure)(state0, params, xs)
    assert close(ys_j, ys_ref) and close(state1_j["h"], h1_ref)

    # grad w.r.t. the weights, from a non-zero hidden state, under jit.
    def loss(params, state):
        ys, _ = pure(state, params, xs)
        return jnp.mean((ys - targets) ** 2)

    def loss_reference(params, h0):
        ys, _ = rnn_reference(h0, params, xs)
        return jnp.mean((ys - targets) ** 2)

    g = jax.jit(jax.grad(loss))(params, state1)
    g_ref = jax.jit(jax.grad(loss_reference))(params, state1["h"])
    assert close(g, g_ref, tol=1e-4), (g, g_ref)
    grad_norm = float(jnp.sqrt(sum(jnp.sum(v ** 2) for v in jax.tree_util.tree_leaves(g))))
    assert grad_norm > 0.0

    results = {
        "steps": STEPS,
        "max_abs_diff_ys": float(jnp.max(jnp.abs(ys - ys_ref))),
        "max_abs_diff_h": float(jnp.max(jnp.abs(state1["h"] - h1_ref))),
        "max_abs_diff_grad": max(float(jnp.max(jnp.abs(a - b))) for a, b in
                                 zip(jax.tree_util.tree_leaves(g),
                                     jax.tree_util.tree_leaves(g_ref))),
        "loss": float(loss(params, state1)),
        "grad_norm": grad_norm,
    }
    print(f"stateful RNN ({STEPS} steps of lax.scan, hidden={HIDDEN}) "
          "matches the hand-written pure RNN (eager, jit, grad):")
    for k, v in results.items():
        print(f"  {k:18s} {v:.3g}" if isinstance(v, float) else f"  {k:18s} {v}")
    return results


if __name__ == "__main__":
    # The checks compare float32 matmuls with NumPy: ask for full float32
    # precision (GPUs default to TF32 matmuls).
    with jax.default_matmul_precision("highest"):
        main()

"""An equinox MLP with dropout between layers, its layers applied by a raw
``lax.scan`` over stacked weights, trained a few steps through ``tx.uncurry``.

Dropout draws its mask with ``tx.next_key("dropout")``: no key is passed
around; the stream is a state that ``uncurry`` threads through the scan (and
the ``jax.checkpoint`` around each layer), so every layer and every step gets
a fresh mask. The example checks that:

* the masks differ across layers and across training steps;
* the gradient equals the one of the same network with the forward's masks
  given as data: the checkpointed recomputation in the backward pass used
  the same masks as the forward;
* the first step equals the same network written with the key threaded by
  hand (``key, sub = split(key)`` before each layer's mask).

Run: ``python examples/dropout_mlp.py``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import taxpr as tx

WIDTH, DEPTH, BATCH, RATE, LR, STEPS = 16, 4, 8, 0.3, 0.05, 3


class MLP(eqx.Module):
    layers: eqx.nn.Linear  # DEPTH Linear(WIDTH, WIDTH) stacked on a leading axis
    head: eqx.nn.Linear

    def __init__(self, key):
        k_layers, k_head = jax.random.split(key)
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(WIDTH, WIDTH, key=k))(
            jax.random.split(k_layers, DEPTH))
        self.head = eqx.nn.Linear(WIDTH, 1, key=k_head)

    def __call__(self, x, masks=None):
        """``x``: (BATCH, WIDTH). Dropout masks come from the "dropout" stream,
        or from ``masks`` (DEPTH, BATCH, WIDTH) when given. Returns the
        predictions and the masks used."""
        weights, static = eqx.partition(self.layers, eqx.is_array)

        def layer(h, per_layer):
            w, given = per_layer
            h = jax.nn.relu(jax.vmap(eqx.combine(w, static))(h))
            keep = (jax.random.bernoulli(tx.next_key("dropout"), 1.0 - RATE, h.shape)
                    if given is None else given)
            return jnp.where(keep, h / (1.0 - RATE), 0.0), keep

        # A raw lax.scan over the layers, each layer rematerialized.
        h, used = jax.lax.scan(jax.checkpoint(layer), x, (weights, masks))
        return jax.vmap(self.head)(h)[:, 0], used


def loss(model, x, y, masks=None):
    pred, used = model(x, masks)
    return jnp.mean((pred - y) ** 2), used


def explicit_loss(model, x, y, key):
    """The same loss with the dropout key threaded by hand."""
    weights, static = eqx.partition(model.layers, eqx.is_array)

    def layer(carry, w):
        h, key = carry
        key, sub = jax.random.split(key)
        h = jax.nn.relu(jax.vmap(eqx.combine(w, static))(h))
        keep = jax.random.bernoulli(sub, 1.0 - RATE, h.shape)
        return (jnp.where(keep, h / (1.0 - RATE), 0.0), key), None

    (h, key), _ = jax.lax.scan(jax.checkpoint(layer), (x, key), weights)
    return jnp.mean((jax.vmap(model.head)(h)[:, 0] - y) ** 2), key


def main() -> None:
    k_model, k_x = jax.random.split(jax.random.key(0))
    model = MLP(k_model)
    x = jax.random.normal(k_x, (BATCH, WIDTH))
    y = jnp.sin(x.sum(axis=1))

    pure, state = tx.uncurry(loss, model, x, y)
    assert list(state) == ["dropout"]
    state = {"dropout": jax.random.key(1)}  # reseed: a key in the state dict

    @eqx.filter_jit
    def step(model, state):
        def objective(m):
            (value, masks), new_state = pure(state, m, x, y)
            return value, (masks, new_state)
        (value, (masks, new_state)), grads = eqx.filter_value_and_grad(
            objective, has_aux=True)(model)
        new_model = jax.tree_util.tree_map(lambda p, g: p - LR * g, model, grads)
        return new_model, new_state, value, masks, grads

    # The first step against the hand-threaded key.
    (want, want_key), want_grads = eqx.filter_value_and_grad(
        explicit_loss, has_aux=True)(model, x, y, state["dropout"])

    all_masks, losses = [], []
    for i in range(STEPS):
        new_model, new_state, value, masks, grads = step(model, state)
        # The recomputation used the forward's masks: same gradient as the
        # network with those masks given as data.
        fixed = eqx.filter_grad(lambda m: loss(m, x, y, masks)[0])(model)
        for g, f in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(fixed)):
            np.testing.assert_allclose(g, f, rtol=1e-5, atol=1e-6)
        if i == 0:
            np.testing.assert_allclose(value, want, rtol=1e-6)
            np.testing.assert_array_equal(jax.random.key_data(new_state["dropout"]),
                                          jax.random.key_data(want_key))
            for g, w in zip(jax.tree_util.tree_leaves(grads),
                            jax.tree_util.tree_leaves(want_grads)):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        all_masks.append(np.asarray(masks))
        losses.append(float(value))
        model, state = new_model, new_state

    masks = np.stack(all_masks)  # (STEPS, DEPTH, BATCH, WIDTH)
    for s in range(STEPS):
        for a in range(DEPTH):
            for b in range(a + 1, DEPTH):
                assert (masks[s, a] != masks[s, b]).any(), "layers share a mask"
    for a in range(STEPS):
        for b in range(a + 1, STEPS):
            assert (masks[a] != masks[b]).any(), "steps share masks"
    print("losses:", " ".join(f"{v:.4f}" for v in losses))
    print("masks differ across layers and steps; forward and recomputation agree")


if __name__ == "__main__":
    main()

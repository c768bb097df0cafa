"""An equinox MLP whose layers keep running statistics in taxpr state.

Each hidden layer is an ``eqx.nn.Linear`` followed by a batch-norm-like
step: in training mode it normalises its activations with the batch mean
and variance and updates running averages of them (``tx.get_state`` /
``tx.set_state``, one pair of states per layer, as batch norm keeps its
running statistics); in evaluation mode it normalises with the running
statistics and writes nothing. The model is an ordinary ``eqx.Module``: no
state object is threaded through ``__call__``.

``tx.uncurry`` turns it into ``pure(state, model, x, train=...) ->
(out, new_state)``; a few plain SGD steps (no optax) use ``jax.grad`` of the
pure function with the new state as auxiliary output. Checked:

* the training loss decreases;
* after the steps, every running mean and variance equals a reference
  computed by hand with numpy from the parameters used at each step;
* evaluation mode uses the running statistics (checked against numpy too).

Run: ``python examples/mlp_running_stats.py``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import taxpr as tx

SIZES = (4, 32, 32, 1)
MOMENTUM = 0.9
EPS = 1e-5
BATCH, STEPS, LR = 64, 25, 0.05


class StatLinear(eqx.Module):
    """``eqx.nn.Linear`` that keeps running mean/variance of its output."""

    linear: eqx.nn.Linear
    name: str = eqx.field(static=True)

    def __init__(self, n_in: int, n_out: int, name: str, key: jax.Array):
        self.linear = eqx.nn.Linear(n_in, n_out, key=key)
        self.name = name

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        a = jax.vmap(self.linear)(x)                        # (batch, n_out)
        n = a.shape[-1]
        mean = tx.get_state(f"{self.name}.mean", jnp.zeros((n,), jnp.float32))
        var = tx.get_state(f"{self.name}.var", jnp.ones((n,), jnp.float32))
        if train:
            m, v = jnp.mean(a, axis=0), jnp.var(a, axis=0)
            tx.set_state(f"{self.name}.mean", MOMENTUM * mean + (1 - MOMENTUM) * m)
            tx.set_state(f"{self.name}.var", MOMENTUM * var + (1 - MOMENTUM) * v)
        else:
            m, v = mean, var
        return (a - m) / jnp.sqrt(v + EPS)


class MLP(eqx.Module):
    hidden: list
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        keys = jax.random.split(key, len(SIZES) - 1)
        self.hidden = [StatLinear(a, b, f"layer{i}", k)
                       for i, (a, b, k) in enumerate(zip(SIZES[:-2], SIZES[1:-1], keys))]
        self.head = eqx.nn.Linear(SIZES[-2], SIZES[-1], key=keys[-1])

    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        for layer in self.hidden:
            x = jax.nn.relu(layer(x, train))
        return jax.vmap(self.head)(x)[:, 0]


# -- a numpy reference for the statistics -----------------------------------------

def reference_forward(model: MLP, x: np.ndarray, stats: dict | None, train: bool):
    """numpy forward pass; updates ``stats`` in place when training."""
    h = np.asarray(x, np.float64)
    for layer in model.hidden:
        w, b = np.asarray(layer.linear.weight, np.float64), np.asarray(layer.linear.bias, np.float64)
        a = h @ w.T + b
        mk, vk = f"{layer.name}.mean", f"{layer.name}.var"
        if train:
            m, v = a.mean(0), a.var(0)
            stats[mk] = MOMENTUM * stats[mk] + (1 - MOMENTUM) * m
            stats[vk] = MOMENTUM * stats[vk] + (1 - MOMENTUM) * v
        else:
            m, v = stats[mk], stats[vk]
        h = np.maximum((a - m) / np.sqrt(v + EPS), 0.0)
    w, b = np.asarray(model.head.weight, np.float64), np.asarray(model.head.bias, np.float64)
    return (h @ w.T + b)[:, 0]


def target_fn(x):
    return jnp.sin(x[:, 0]) + x[:, 1] * x[:, 2] - 0.5 * x[:, 3]


def main() -> dict:
    kmodel, kdata = jax.random.split(jax.random.key(0))
    model = MLP(kmodel)
    xs = jax.random.normal(kdata, (STEPS, BATCH, SIZES[0]))
    ys = jax.vmap(target_fn)(xs)

    # The model is an argument (its arrays are traced, so jax.grad can
    # differentiate w.r.t. it); ``train`` is a Python bool, hence static.
    def call(model, x, train):
        return model(x, train)

    pure, state = tx.uncurry(call, model, xs[0], True)
    names = sorted(f"layer{i}.{s}" for i in range(len(SIZES) - 2) for s in ("mean", "var"))
    assert sorted(state) == names, state
    assert all(np.all(state[n] == (0.0 if n.endswith("mean") else 1.0)) for n in names)

    def loss(model, state, x, y):
        pred, new_state = pure(state, model, x, True)
        return jnp.mean((pred - y) ** 2), new_state

    @jax.jit
    def sgd_step(model, state, x, y):
        (value, new_state), g = jax.value_and_grad(loss, has_aux=True)(model, state, x, y)
        model = jax.tree_util.tree_map(lambda p, d: p - LR * d, model, g)
        return model, new_state, value

    ref_stats = {n: np.zeros(state[n].shape) if n.endswith("mean") else np.ones(state[n].shape)
                 for n in names}
    losses = []
    for t in range(STEPS):
        ref_pred = reference_forward(model, xs[t], ref_stats, train=True)
        model, state, value = sgd_step(model, state, xs[t], ys[t])
        losses.append(float(value))
        assert np.isclose(value, np.mean((ref_pred - np.asarray(ys[t])) ** 2), rtol=1e-4)

    # The loss decreases.
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert last < 0.8 * first, losses

    # The running statistics equal the hand-computed reference.
    stat_err = max(float(np.max(np.abs(np.asarray(state[n]) - ref_stats[n]))) for n in names)
    for n in names:
        assert np.allclose(state[n], ref_stats[n], rtol=1e-4, atol=1e-5), (n, state[n], ref_stats[n])

    # Evaluation mode normalises with the running statistics and writes nothing.
    pred, state_after = jax.jit(pure, static_argnums=3)(state, model, xs[0], False)
    assert all(np.array_equal(state_after[n], state[n]) for n in names)
    assert np.allclose(pred, reference_forward(model, xs[0], ref_stats, train=False),
                       rtol=1e-4, atol=1e-4)

    results = {"steps": STEPS, "loss_first": losses[0], "loss_last": losses[-1],
               "states": len(names), "max_stat_error": stat_err}
    print(f"MLP {SIZES} with running statistics, {STEPS} SGD steps via jax.grad of "
          "uncurry's pure function:")
    print(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"  {len(names)} states ({', '.join(names)})")
    print(f"  running stats match the numpy reference (max abs error {stat_err:.2e})")
    return results


if __name__ == "__main__":
    # The checks compare float32 matmuls with NumPy: ask for full float32
    # precision (GPUs default to TF32 matmuls).
    with jax.default_matmul_precision("highest"):
        main()

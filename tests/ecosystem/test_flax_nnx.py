"""taxpr inside flax nnx: a model whose `__call__` uses taxpr state,
`nnx.scan` over stacked layers with a state counter and a sow, and
`nnx.Dropout` with keys from `tx.next_key`, and a harvest of a function
taking an nnx module.

References: Python loops over the layers with a dict, keys threaded by hand.
"""
import pytest

nnx = pytest.importorskip("flax.nnx")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import taxpr as tx  # noqa: E402
from taxpr import harvest as h  # noqa: E402

from ecohelpers import close  # noqa: E402

X = jnp.array([[0.5, -1.0, 2.0], [1.0, 0.0, -0.5]])
LAYERS = 3


class Normalized(nnx.Module):
    """A Linear layer whose input is normalized by a running mean kept in
    taxpr state (not in an nnx Variable)."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        mean = tx.get_state("nnx_mean", lambda: jnp.zeros(3))
        mean = 0.9 * mean + 0.1 * x.mean(0)
        tx.set_state("nnx_mean", mean)
        tx.set_state("nnx_calls", tx.get_state("nnx_calls", jnp.zeros((), jnp.int32)) + 1)
        return self.linear(x - mean)


def test_module_call_uses_state():
    model = Normalized(nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def f(params, x):
        return nnx.merge(graphdef, params)(x)

    pure, s = tx.uncurry(f, params, X)
    mean, w, b = np.zeros(3), np.asarray(model.linear.kernel[...]), np.asarray(model.linear.bias[...])
    for i in range(3):
        x = X * (i + 1)
        out, s = jax.jit(pure)(s, params, x)
        mean = 0.9 * mean + 0.1 * np.asarray(x).mean(0)  # Python loop, a dict's worth of state
        close(out, (np.asarray(x) - mean) @ w + b, rtol=1e-5, atol=1e-6)
    close(s["nnx_mean"], mean)
    assert int(s["nnx_calls"]) == 3


def test_module_as_pytree_argument_and_grad():
    model = Normalized(nnx.Rngs(0))
    pure, s0 = tx.uncurry(lambda m, x: m(x).sum(), model, X)
    out, s1 = pure(s0, model, X)
    mean = 0.1 * np.asarray(X).mean(0)
    w, b = np.asarray(model.linear.kernel[...]), np.asarray(model.linear.bias[...])
    close(out, ((np.asarray(X) - mean) @ w + b).sum(), rtol=1e-5)
    g = jax.grad(lambda m: pure(s0, m, X)[0])(model)
    close(g.linear.kernel[...], np.tile((np.asarray(X) - mean).sum(0)[:, None], (1, 2)),
          rtol=1e-5)


# --- nnx.scan over stacked layers ---------------------------------------------

class Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


def _stack():
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return Block(rngs)
    return create(nnx.Rngs(0))


def _python_loop(stack, x, scale=1.0):
    kernels, biases = np.asarray(stack.linear.kernel[...]), np.asarray(stack.linear.bias[...])
    sums = []
    for i in range(LAYERS):
        x = np.tanh(np.asarray(x) @ kernels[i] + biases[i]) * scale
        sums.append(x.sum())
    return x, np.array(sums)


def test_nnx_scan_counts_and_reads_state():
    stack = _stack()

    def f(stack, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            tx.set_state("ns_calls", tx.get_state("ns_calls", jnp.zeros((), jnp.int32)) + 1)
            return block(x) * tx.get_state("ns_scale", jnp.float32(1.0))
        return forward(x, stack)

    pure, s0 = tx.uncurry(f, stack, X)
    out, s1 = pure({**s0, "ns_scale": jnp.float32(0.5)}, stack, X)
    close(out, _python_loop(stack, X, scale=0.5)[0], rtol=1e-5, atol=1e-6)
    assert int(s1["ns_calls"]) == LAYERS


def test_nnx_scan_reap_and_plant_sow():
    stack = _stack()

    def f(stack, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            y = block(x)
            h.sow(y.sum(), tag="nnx", name="ns_sum", mode="append")
            return y
        return forward(x, stack)

    want_out, want_sums = _python_loop(stack, X)

    def check(res):
        out, reaped = res
        close(out, want_out, rtol=1e-5, atol=1e-6)
        close(reaped["ns_sum"], want_sums, rtol=1e-5, atol=1e-6)

    check(h.call_and_reap(f, tag="nnx")(stack, X))


def test_nnx_scan_next_key_per_layer():
    stack = _stack()

    def f(stack, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x) + jax.random.normal(tx.next_key(), x.shape)
        return forward(x, stack)

    pure, s0 = tx.uncurry(f, stack, X)
    out, s1 = pure(s0, stack, X)
    key, x = s0["rng"], np.asarray(X)
    kernels, biases = np.asarray(stack.linear.kernel[...]), np.asarray(stack.linear.bias[...])
    for i in range(LAYERS):
        key, sub = jax.random.split(key)
        x = np.tanh(x @ kernels[i] + biases[i]) + np.asarray(jax.random.normal(sub, x.shape))
    close(out, x, rtol=1e-5, atol=1e-5)
    assert (jax.random.key_data(s1["rng"]) == jax.random.key_data(key)).all()


# --- nnx.Dropout with keys from tx.next_key ---------------------------------------

def test_dropout_keys_from_next_key():
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(3, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.5)
            self.l2 = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x, key1, key2):
            x = self.drop(jax.nn.relu(self.l1(x)), rngs=key1)
            return self.drop(self.l2(x), rngs=key2)

    model = MLP(nnx.Rngs(0))
    pure, s = tx.uncurry(lambda m, x: m(x, tx.next_key(), tx.next_key()), model, X)
    key = jax.random.key(0)
    outs = []
    for _ in range(2):
        out, s = jax.jit(pure)(s, model, X)
        key, k1 = jax.random.split(key)
        key, k2 = jax.random.split(key)
        close(out, model(X, k1, k2))
        outs.append(np.asarray(out))
    assert not np.allclose(outs[0], outs[1])
    g = jax.grad(lambda m: pure(s, m, X)[0].sum())(model)
    kk, k1 = jax.random.split(key)
    _, k2 = jax.random.split(kk)
    g_want = jax.grad(lambda m: m(X, k1, k2).sum())(model)
    close(g.l1.kernel[...], g_want.l1.kernel[...])


def test_harvest_of_a_function_taking_an_nnx_module():
    # The module is an argument (its arrays traced, the rest static, as
    # for uncurry): reap its hidden value and plant over it.
    linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))

    def forward(m, x):
        return jnp.tanh(h.sow(m(x), tag="nnx", name="pre", mode="clobber")).sum()

    out, reaped = h.call_and_reap(forward, tag="nnx")(linear, X)
    close(reaped["pre"], linear(X))
    close(out, jnp.tanh(linear(X)).sum())
    planted = jnp.ones((2, 2))
    close(h.plant(forward, tag="nnx")({"pre": planted}, linear, X), np.tanh(1.0) * 4)

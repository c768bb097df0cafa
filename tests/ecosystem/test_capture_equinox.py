"""taxpr.capture / taxpr.patch on equinox models (an MLP, multi-head
attention, layers stacked and run with ``lax.scan``), against the same
computation written by hand with the models' own weights."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

eqx = pytest.importorskip("equinox")

import taxpr as tx  # noqa: E402
from taxpr import harvest as h  # noqa: E402


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


# Models are made on first use, not when the module is imported: every
# pytest-xdist worker imports every test module (to collect it), and
# initialising a model compiles its initialisers.
@functools.cache
def mlp():
    with jax.ensure_compile_time_eval():  # also when first used in a trace
        return eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(0))


X = jnp.array([0.5, -1.0, 2.0])
LINEAR_OUT = "eqx.nn.MLP/eqx.nn.Linear/add"  # the first layer's output; ":1", ":2" the next


def mlp_by_hand(model, x, patch=None):
    hidden = []
    for i, layer in enumerate(model.layers):
        x = layer.weight @ x + layer.bias
        if patch is not None:
            x = patch(i, x)
        hidden.append(x)
        if i < len(model.layers) - 1:
            x = jax.nn.relu(x)
    return x, hidden


def test_the_mlps_layer_outputs_are_the_hand_computed_ones():
    names = [LINEAR_OUT, LINEAR_OUT + ":1", LINEAR_OUT + ":2"]
    out, acts = tx.capture(mlp(), *names)(X)
    want, hidden = mlp_by_hand(mlp(), X)
    close(out, want)
    for name, value in zip(names, hidden):
        close(acts[name], value)
    out, acts = eqx.filter_jit(lambda model, x: tx.capture(model, *names)(x))(mlp(), X)
    close(acts[names[1]], hidden[1])


def test_the_mlp_under_vmap_and_grad():
    xs = jnp.stack([X, -X, 2 * X])
    _, acts = jax.vmap(tx.capture(mlp(), LINEAR_OUT + ":1"))(xs)
    for i, x in enumerate(xs):
        close(acts[LINEAR_OUT + ":1"][i], mlp_by_hand(mlp(), x)[1][1])

    def loss(model):
        return jnp.sum(tx.capture(model, LINEAR_OUT + ":1")(X)[1][LINEAR_OUT + ":1"] ** 2)

    def loss_by_hand(model):
        return jnp.sum(mlp_by_hand(model, X)[1][1] ** 2)

    g, g_ref = eqx.filter_grad(loss)(mlp()), eqx.filter_grad(loss_by_hand)(mlp())
    jax.tree_util.tree_map(close, jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref))


def test_patching_a_hidden_layer_of_the_mlp():
    patch = lambda v: jnp.where(v > 0, v, 0.1 * v)  # noqa: E731
    out = tx.patch(mlp(), {LINEAR_OUT + ":1": patch})(X)
    close(out, mlp_by_hand(mlp(), X, lambda i, v: patch(v) if i == 1 else v)[0])


@functools.cache
def attention():
    with jax.ensure_compile_time_eval():  # also when first used in a trace
        return eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(1))


@functools.cache
def seq():
    with jax.ensure_compile_time_eval():  # also when first used in a trace
        return jax.random.normal(jax.random.key(2), (5, 8))


PROBS = "eqx.nn.MultiheadAttention/div:1"


def attention_by_hand(att, x, edit=None):
    """Multi-head self-attention written out: per-head probabilities and the output."""
    heads = att.num_heads
    q = (x @ att.query_proj.weight.T).reshape(5, heads, -1)
    k = (x @ att.key_proj.weight.T).reshape(5, heads, -1)
    v = (x @ att.value_proj.weight.T).reshape(5, heads, -1)
    logits = jnp.einsum("shd,Shd->hsS", q, k) / jnp.sqrt(q.shape[-1])
    probs = jax.nn.softmax(logits, axis=-1)
    if edit is not None:
        probs = edit(probs)
    out = jnp.einsum("hsS,Shd->shd", probs, v).reshape(5, -1)
    return out @ att.output_proj.weight.T, probs


def self_attention(x):
    return attention()(x, x, x)


def test_attention_probabilities_and_a_head_ablated():
    out, acts = tx.capture(self_attention, PROBS)(seq())
    want, probs = attention_by_hand(attention(), seq())
    close(out, want)
    close(acts[PROBS], probs)
    ablate = lambda p: p.at[1].set(0.0)  # noqa: E731
    close(tx.patch(self_attention, {PROBS: ablate})(seq()),
          attention_by_hand(attention(), seq(), ablate)[0])
    g = jax.grad(lambda x: jnp.sum(tx.capture(self_attention, PROBS)(x)[1][PROBS][0] ** 2))(seq())
    g_ref = jax.grad(lambda x: jnp.sum(attention_by_hand(attention(), x)[1][0] ** 2))(seq())
    close(g, g_ref)
    batch = jnp.stack([seq(), seq() * 0.5])
    _, acts = jax.jit(jax.vmap(tx.capture(self_attention, PROBS)))(batch)
    close(acts[PROBS][1], attention_by_hand(attention(), batch[1])[1])


def make_stack(depth=4, width=3):
    keys = jax.random.split(jax.random.key(3), depth)
    return eqx.filter_vmap(lambda k: eqx.nn.Linear(width, width, key=k))(keys)


@functools.cache
def stack():
    with jax.ensure_compile_time_eval():  # also when first used in a trace
        return make_stack()


def run_stack(stack, x):
    params, static = eqx.partition(stack, eqx.is_array)

    def body(x, p):
        layer = eqx.combine(p, static)
        return jnp.tanh(layer(x)), None
    return jax.lax.scan(body, x, params)[0]


def test_layers_stacked_with_scan_capture_one_row_per_layer():
    out, acts = tx.capture(run_stack, "eqx.nn.Linear/add")(stack(), X)
    x, rows = X, []
    for i in range(4):
        pre = stack().weight[i] @ x + stack().bias[i]
        rows.append(pre)
        x = jnp.tanh(pre)
    close(out, x)
    close(acts["eqx.nn.Linear/add"], jnp.stack(rows))
    # patch the third layer's pre-activation only
    patched = tx.patch(run_stack, {"eqx.nn.Linear/add": h.rows({2: jnp.zeros(3)})})(stack(), X)
    x = X
    for i in range(4):
        x = jnp.tanh(jnp.zeros(3) if i == 2 else stack().weight[i] @ x + stack().bias[i])
    close(patched, x)

"""taxpr.capture / taxpr.patch on flax models (linen with ``nn.scan`` over
its blocks, nnx), against flax's own ``sow`` and per-layer loops run by
hand with the same parameters."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

import taxpr as tx  # noqa: E402
from taxpr import harvest as h  # noqa: E402

LAYERS, HEADS, WIDTH, VOCAB = 3, 2, 8, 11
PROBS = "Transformer/blocks/attn/div:1"  # the softmax's output in each attention


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


class Block(nn.Module):
    attention_fn: object = nn.dot_product_attention

    @nn.compact
    def __call__(self, x, _=None):
        y = nn.LayerNorm(name="ln")(x)
        x = x + nn.MultiHeadDotProductAttention(
            num_heads=HEADS, qkv_features=WIDTH, name="attn", attention_fn=self.attention_fn)(
            y, y, sow_weights=True)
        return x + nn.Dense(WIDTH, name="mlp")(jax.nn.gelu(x)), None


class Transformer(nn.Module):
    @nn.compact
    def __call__(self, tok):
        x = nn.Embed(VOCAB, WIDTH, name="embed")(tok)
        x, _ = nn.scan(Block, variable_axes={"params": 0, "intermediates": 0},
                       split_rngs={"params": True}, length=LAYERS)(name="blocks")(x, None)
        return nn.Dense(VOCAB, name="head")(x)


MODEL = Transformer()
TOK = jnp.array([1, 4, 2, 9, 3])


# Made on first use, not when the module is imported: every pytest-xdist
# worker imports every test module (to collect it), and initialising the
# model compiles its initialisers.
@functools.cache
def model_params():
    with jax.ensure_compile_time_eval():  # also when first used in a trace
        return MODEL.init(jax.random.key(0), TOK)


def apply(params, tok):
    return MODEL.apply(params, tok)


def by_hand(params, tok, attention_fn=None, layer_fn=None):
    """The transformer as a Python loop over its blocks (each block applied
    with its slice of the stacked parameters): logits and the residual
    stream after each block."""
    P = params["params"]
    x = nn.Embed(VOCAB, WIDTH).apply({"params": P["embed"]}, tok)
    stream = []
    for i in range(LAYERS):
        p_i = jax.tree_util.tree_map(lambda a: a[i], P["blocks"])
        fn = nn.dot_product_attention if attention_fn is None else attention_fn(i)
        x, _ = Block(attention_fn=fn).apply({"params": p_i}, x)
        stream.append(x)
    logits = nn.Dense(VOCAB).apply({"params": P["head"]}, x)
    return logits, jnp.stack(stream)


def test_the_attention_probabilities_of_every_layer_are_flaxs_own_sown_weights():
    _, inter = MODEL.apply(model_params(), TOK, mutable=["intermediates"])
    (want,) = inter["intermediates"]["blocks"]["attn"]["attention_weights"]
    out, acts = tx.capture(apply, PROBS)(model_params(), TOK)
    assert acts[PROBS].shape == (LAYERS, HEADS, 5, 5)
    close(acts[PROBS], want)
    close(out, by_hand(model_params(), TOK)[0])
    out, acts = jax.jit(tx.capture(apply, PROBS))(model_params(), TOK)
    close(acts[PROBS], want)


def test_logit_lens_reads_the_residual_stream_after_each_block():
    (stream_site,) = [s for s in tx.sites(apply, model_params(), TOK)
                      if "Transformer/blocks" in s.leaves and s.scope == "Transformer/blocks"]
    _, acts = tx.capture(apply, tx.select.leaving("Transformer/blocks") & tx.select.scope("Transformer/blocks"))(
        model_params(), TOK)
    logits, stream = by_hand(model_params(), TOK)
    close(acts[stream_site.name], stream)
    lens = nn.Dense(VOCAB).apply({"params": model_params()["params"]["head"]}, acts[stream_site.name])
    close(lens[-1], logits)


def ablate_head(layer, head):
    def attention_fn(i):
        def fn(q, k, v, **kw):
            w = nn.dot_product_attention_weights(q, k)
            if i == layer:
                w = w.at[..., head, :, :].set(0.0)
            return jnp.einsum("...hqk,...khd->...qhd", w, v)
        return fn
    return attention_fn


def test_patching_one_head_of_one_layer_is_the_hand_ablated_model():
    want = by_hand(model_params(), TOK, ablate_head(1, 0))[0]
    probs = tx.capture(apply, PROBS)(model_params(), TOK)[1][PROBS]
    patched = tx.patch(apply, {PROBS: h.rows({1: probs[1].at[0].set(0.0)})})(model_params(), TOK)
    close(patched, want)
    # a function patches every layer, where each layer computes its probabilities
    every = tx.patch(apply, {PROBS: lambda w: w.at[0].set(0.0)})(model_params(), TOK)
    close(every, by_hand(model_params(), TOK, lambda i: ablate_head(i, 0)(i))[0])
    close(jax.jit(tx.patch(apply, {PROBS: lambda w: w.at[0].set(0.0)}))(model_params(), TOK),
          by_hand(model_params(), TOK, lambda i: ablate_head(i, 0)(i))[0])


def test_capture_under_grad_and_vmap():
    def loss(params, tok):
        logits, acts = tx.capture(apply, PROBS)(params, tok)
        return jnp.mean(logits ** 2) + jnp.mean(acts[PROBS] ** 2)

    def loss_by_hand(params, tok):
        logits = by_hand(params, tok)[0]
        _, inter = MODEL.apply(params, tok, mutable=["intermediates"])
        (w,) = inter["intermediates"]["blocks"]["attn"]["attention_weights"]
        return jnp.mean(logits ** 2) + jnp.mean(w ** 2)

    g = jax.grad(loss)(model_params(), TOK)
    g_ref = jax.grad(loss_by_hand)(model_params(), TOK)
    jax.tree_util.tree_map(close, g, g_ref)
    toks = jnp.stack([TOK, TOK[::-1]])
    _, acts = jax.vmap(tx.capture(apply, PROBS), in_axes=(None, 0))(model_params(), toks)
    for i in range(2):
        _, inter = MODEL.apply(model_params(), toks[i], mutable=["intermediates"])
        close(acts[PROBS][i], inter["intermediates"]["blocks"]["attn"]["attention_weights"][0])


def test_attribution_patching_gradient_of_the_loss_with_respect_to_a_patched_head():
    probs = tx.capture(apply, PROBS)(model_params(), TOK)[1][PROBS]

    def loss(row):
        return jnp.sum(tx.patch(apply, {PROBS: h.rows({2: row})})(model_params(), TOK)[:, 3])

    def loss_by_hand(row):
        def attention_fn(i):
            def fn(q, k, v, **kw):
                w = row if i == 2 else nn.dot_product_attention_weights(q, k)
                return jnp.einsum("...hqk,...khd->...qhd", w, v)
            return fn
        return jnp.sum(by_hand(model_params(), TOK, attention_fn)[0][:, 3])

    close(jax.grad(loss)(probs[2]), jax.grad(loss_by_hand)(probs[2]))


def test_gradient_of_the_loss_with_respect_to_each_layers_attention_in_one_pass():
    def loss(params, tok):
        return jnp.sum(apply(params, tok)[:, 3])

    probs = tx.capture(apply, PROBS)(model_params(), TOK)[1][PROBS]
    d = jax.grad(tx.perturb(loss, PROBS))({PROBS: jnp.zeros_like(probs)}, model_params(), TOK)[PROBS]

    def loss_by_hand(delta):
        def attention_fn(i):
            def fn(q, k, v, **kw):
                w = nn.dot_product_attention_weights(q, k) + delta[i]
                return jnp.einsum("...hqk,...khd->...qhd", w, v)
            return fn
        return jnp.sum(by_hand(model_params(), TOK, attention_fn)[0][:, 3])

    close(d, jax.grad(loss_by_hand)(jnp.zeros_like(probs)))


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(6, name="fc1")(x))
        return nn.Dense(2, name="fc2")(x)


def test_a_linen_mlp_under_jit_grad_and_vmap():
    mlp = LinenMLP()
    x = jax.random.normal(jax.random.key(4), (4, 3))
    params = mlp.init(jax.random.key(5), x)

    def mlp_apply(params, x):
        return mlp.apply(params, x)

    def hidden_by_hand(params, x):
        p = params["params"]["fc1"]
        return x @ p["kernel"] + p["bias"]

    (site,) = [s for s in tx.sites(mlp_apply, params, x) if "LinenMLP/fc1" in s.leaves]
    assert site.name == "LinenMLP/fc1/add"
    _, acts = jax.jit(tx.capture(mlp_apply, tx.select.leaving("LinenMLP/fc1")))(params, x)
    close(acts[site.name], hidden_by_hand(params, x))
    g = jax.grad(lambda p: jnp.sum(tx.capture(mlp_apply, site.name)(p, x)[1][site.name] ** 2))(
        params)
    g_ref = jax.grad(lambda p: jnp.sum(hidden_by_hand(p, x) ** 2))(params)
    close(g["params"]["fc1"]["kernel"], g_ref["params"]["fc1"]["kernel"])
    xs = jnp.stack([x, 2 * x])
    _, acts = jax.vmap(tx.capture(mlp_apply, site.name), in_axes=(None, 0))(params, xs)
    close(acts[site.name][1], hidden_by_hand(params, 2 * x))
    # patched: the hidden layer's pre-activation halved
    out = tx.patch(mlp_apply, {site.name: lambda v: v * 0.5})(params, x)
    p = params["params"]
    close(out, nn.relu(hidden_by_hand(params, x) * 0.5) @ p["fc2"]["kernel"] + p["fc2"]["bias"])


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(3, 4, rngs=rngs)
        self.fc2 = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        with jax.named_scope("fc1"):
            hidden = nnx.relu(self.fc1(x))
        with jax.named_scope("fc2"):
            return self.fc2(hidden)


def test_an_nnx_model_with_named_scopes():
    model = NnxMLP(nnx.Rngs(0))
    graph, state = nnx.split(model)

    def f(state, x):
        return nnx.merge(graph, state)(x)

    x = jax.random.normal(jax.random.key(1), (5, 3))
    hidden = nnx.relu(model.fc1(x))
    _, acts = tx.capture(f, tx.select.leaving("fc1"))(state, x)
    (name,) = acts
    close(acts[name], hidden)
    patched = tx.patch(f, {name: jnp.zeros_like(hidden)})(state, x)
    close(patched, model.fc2(jnp.zeros_like(hidden)))
    g = jax.grad(lambda s: jnp.sum(tx.capture(f, name)(s, x)[1][name]))(state)
    g_ref = jax.grad(lambda s: jnp.sum(nnx.relu(nnx.merge(graph, s).fc1(x))))(state)
    jax.tree_util.tree_map(close, g, g_ref)
    xs = jnp.stack([x, -x])
    _, acts = jax.vmap(tx.capture(f, name), in_axes=(None, 0))(state, xs)
    close(acts[name][1], nnx.relu(model.fc1(-x)))
    _, acts = jax.jit(tx.capture(f, name))(state, x)
    close(acts[name], hidden)

"""Interpretability without touching the model: train a tiny transformer on
a toy task, capture every layer's attention pattern with `tx.capture`,
ablate one head with `tx.patch`, and measure what the head was doing.

The task: predict, at each position, the token one position back. A head
that attends to the previous position solves it; the model's code (plain
JAX with `jax.named_scope`, as a library writes it, its blocks run with
`lax.scan`) has no hook for any of this.

Run: python examples/attention_heads.py [--figure PATH]   (PATH: a .png or
.svg of the attention patterns; needs matplotlib)
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import taxpr as tx

VOCAB, SEQ, WIDTH, HEADS, LAYERS = 8, 8, 32, 2, 2
HEAD_DIM = WIDTH // HEADS


# ---- the model (imagine it is a library's) -----------------------------------

def init(key):
    ks = jax.random.split(key, 8)
    n = lambda k, *s: jax.random.normal(k, s) / np.sqrt(s[-2] if len(s) > 1 else 1)  # noqa: E731
    return {
        "embed": jax.random.normal(ks[0], (VOCAB, WIDTH)) * 0.5,
        "pos": jax.random.normal(ks[1], (SEQ, WIDTH)) * 0.5,
        "blocks": {  # stacked: one row per layer
            "qkv": n(ks[2], LAYERS, WIDTH, 3 * WIDTH),
            "out": n(ks[3], LAYERS, WIDTH, WIDTH),
            "mlp": n(ks[4], LAYERS, WIDTH, WIDTH),
        },
        "head": n(ks[5], WIDTH, VOCAB),
    }


def transformer(params, tokens):
    x = params["embed"][tokens] + params["pos"]
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))

    def block(x, p):
        with jax.named_scope("attn"):
            q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
            q, k, v = (a.reshape(SEQ, HEADS, HEAD_DIM).transpose(1, 0, 2) for a in (q, k, v))
            logits = jnp.where(causal, q @ k.transpose(0, 2, 1) / np.sqrt(HEAD_DIM), -1e9)
            probs = jax.nn.softmax(logits, axis=-1)  # (heads, query, key)
            x = x + (probs @ v).transpose(1, 0, 2).reshape(SEQ, WIDTH) @ p["out"]
        with jax.named_scope("mlp"):
            x = x + jax.nn.gelu(x @ p["mlp"])
        return x, None

    x, _ = jax.lax.scan(block, x, params["blocks"])
    return x @ params["head"]


def loss_fn(params, tokens, apply=transformer):
    logits = jax.vmap(lambda t: apply(params, t))(tokens)[:, 1:]
    target = tokens[:, :-1]  # the previous token
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), target[..., None], -1))


def batch(key, n=128):
    return jax.random.randint(key, (n, SEQ), 0, VOCAB)


def train(steps=400, lr=3e-3):
    params = init(jax.random.key(0))
    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)

    @jax.jit
    def step(i, params, m, v, key):  # Adam, written out
        loss, g = jax.value_and_grad(loss_fn)(params, batch(key))
        m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
        v = jax.tree_util.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, v, g)
        t = i + 1.0
        params = jax.tree_util.tree_map(
            lambda p, m, v: p - lr * (m / (1 - 0.9 ** t)) / (jnp.sqrt(v / (1 - 0.999 ** t)) + 1e-8),
            params, m, v)
        return params, m, v, loss

    for i, key in enumerate(jax.random.split(jax.random.key(1), steps)):
        params, m, v, loss = step(i, params, m, v, key)
    return params, float(loss)


# ---- the analysis: no change to the model ------------------------------------

def main(argv):
    params, final_loss = train()
    assert final_loss < 0.1, final_loss
    tokens = batch(jax.random.key(2), 256)

    # Every capturable value has a name; the softmax output of each block's
    # attention is the division that ends jax.nn.softmax (the first one of
    # that shape scales the logits).
    sites = tx.sites(transformer, params, tokens[0])
    probs_site = [s for s in sites if s.scope == "attn" and s.primitive == "div"
                  and s.shape == (HEADS, SEQ, SEQ)][-1]
    assert probs_site.loops == (("scan", LAYERS),)
    name = probs_site.name

    # Capture: stacked per layer by the scan, batched by vmap.
    _, acts = jax.vmap(tx.capture(transformer, name), in_axes=(None, 0))(params, tokens)
    probs = acts[name].mean(0)  # (layers, heads, query, key), averaged over the batch
    previous = np.array([[float(jnp.mean(jnp.diagonal(probs[l, h], -1)))
                          for h in range(HEADS)] for l in range(LAYERS)])
    layer, head = np.unravel_index(np.argmax(previous), previous.shape)
    print(f"attention to the previous token, per layer and head:\n{previous.round(2)}")
    assert previous[layer, head] > 0.9

    # Patch: ablate one head of one layer (uniform attention over the causal
    # prefix). The layers share one equation (the scan's body), so the patch
    # replaces that layer's row: rows() of the captured stack, head edited.
    uniform = jnp.tril(jnp.ones((SEQ, SEQ))) / jnp.arange(1, SEQ + 1)[:, None]

    def with_head_ablated(layer, head):
        def apply(params, t):
            stack = tx.capture(transformer, name)(params, t)[1][name]
            row = stack[layer].at[head].set(uniform)
            return tx.patch(transformer, {name: tx.harvest.rows({layer: row})})(params, t)
        return apply

    base = float(loss_fn(params, tokens))
    losses = {(l, h): float(jax.jit(loss_fn, static_argnums=2)(params, tokens,
                                                               with_head_ablated(l, h)))
              for l in range(LAYERS) for h in range(HEADS)}
    print(f"loss {base:.3f}; with one head ablated: "
          + ", ".join(f"layer {l} head {h}: {v:.3f}" for (l, h), v in losses.items()))
    assert all(v >= base - 1e-4 for v in losses.values())

    # Every head of every layer ablated at once (a function patch applies
    # where each layer computes its probabilities): the task is lost, the
    # loss near chance (log 8 = 2.08).
    everything = tx.patch(transformer, {name: lambda p: jnp.broadcast_to(uniform, p.shape)})
    blind = float(loss_fn(params, tokens, everything))
    print(f"every head ablated: loss {blind:.3f}")
    assert blind > base + 1.0

    if "--figure" in argv:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(LAYERS, HEADS, figsize=(2.2 * HEADS, 2.2 * LAYERS))
        for l in range(LAYERS):
            for h in range(HEADS):
                ax = axes[l, h]
                ax.imshow(np.asarray(probs[l, h]), cmap="viridis", vmin=0, vmax=1)
                ax.set_title(f"layer {l}, head {h}\nablated loss {losses[(l, h)]:.2f}",
                             fontsize=8)
                ax.set_xticks([]), ax.set_yticks([])
        fig.suptitle(f"attention patterns (query x key); loss {base:.2f}", fontsize=9)
        fig.tight_layout()
        fig.savefig(argv[argv.index("--figure") + 1])


if __name__ == "__main__":
    main(sys.argv[1:])

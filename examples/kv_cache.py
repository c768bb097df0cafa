"""Step-by-step decoding with a key/value cache per layer, kept in taxpr state.

A small equinox transformer decoder (two blocks, one attention head each).
Each block's attention keeps its cache as one pytree-valued state,
``{"k": (MAX_LEN, D), "v": (MAX_LEN, D)}``, read and written with
``tx.get_state`` / ``tx.set_state`` inside ``__call__``; the blocks are
called under ``tx.scope(f"block{i}")``, so the same attention code keeps one
cache per block (``state["block0"]["cache"]``, ``state["block1"]["cache"]``)
and the decoding position is one state beside them. The model is an
ordinary ``eqx.Module``: no cache is threaded through its calls.

``tx.uncurry`` turns one decoding step into ``pure(state, model, token)``;
generation, sampling with a key of taxpr's stream (``tx.next_key``), is a
``lax.scan`` over steps that carries the state,
jitted, and ``jax.vmap`` decodes a batch of prompts with a batch of states.
Checked:

* at every step, the logits equal those of the model run on the whole
  generated sequence at once with a causal mask, without any cache;
* each block's cache holds the keys and values of that full run;
* the batch of prompts decodes as each prompt does alone.

Run: ``python examples/kv_cache.py``.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import taxpr as tx

VOCAB, D, MAX_LEN, BLOCKS, STEPS = 13, 16, 12, 2, 10


def empty_cache() -> dict:
    return {"k": jnp.zeros((MAX_LEN, D)), "v": jnp.zeros((MAX_LEN, D))}


class Attention(eqx.Module):
    """One causal attention head; ``__call__`` decodes one position."""

    qkv: eqx.nn.Linear
    out: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.qkv = eqx.nn.Linear(D, 3 * D, key=k1)
        self.out = eqx.nn.Linear(D, D, key=k2)

    def __call__(self, x: jax.Array, pos: jax.Array) -> jax.Array:
        q, k, v = jnp.split(self.qkv(x), 3)
        cache = tx.get_state("cache", empty_cache)
        cache = {"k": cache["k"].at[pos].set(k), "v": cache["v"].at[pos].set(v)}
        tx.set_state("cache", cache)
        scores = cache["k"] @ q / jnp.sqrt(D)
        weights = jax.nn.softmax(jnp.where(jnp.arange(MAX_LEN) <= pos, scores, -jnp.inf))
        return self.out(weights @ cache["v"])

    def full(self, xs: jax.Array) -> tuple[jax.Array, dict]:
        """Every position at once (causal mask, no cache): the reference."""
        q, k, v = jnp.split(jax.vmap(self.qkv)(xs), 3, axis=-1)
        n = xs.shape[0]
        scores = q @ k.T / jnp.sqrt(D)
        scores = jnp.where(jnp.tril(jnp.ones((n, n), bool)), scores, -jnp.inf)
        return jax.vmap(self.out)(jax.nn.softmax(scores, axis=-1) @ v), {"k": k, "v": v}


class Block(eqx.Module):
    attention: Attention
    mlp: eqx.nn.MLP
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.attention = Attention(k1)
        self.mlp = eqx.nn.MLP(D, D, 2 * D, 1, key=k2)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)

    def __call__(self, x: jax.Array, pos: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x), pos)
        return x + self.mlp(self.norm2(x))

    def full(self, xs: jax.Array) -> tuple[jax.Array, dict]:
        a, kv = self.attention.full(jax.vmap(self.norm1)(xs))
        xs = xs + a
        return xs + jax.vmap(self.mlp)(jax.vmap(self.norm2)(xs)), kv


class Decoder(eqx.Module):
    embed: eqx.nn.Embedding
    positions: jax.Array
    blocks: list
    unembed: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        keys = jax.random.split(key, BLOCKS + 3)
        self.embed = eqx.nn.Embedding(VOCAB, D, key=keys[0])
        self.positions = 0.1 * jax.random.normal(keys[1], (MAX_LEN, D))
        self.blocks = [Block(k) for k in keys[2:-1]]
        self.unembed = eqx.nn.Linear(D, VOCAB, key=keys[-1])

    def __call__(self, token: jax.Array) -> jax.Array:
        """The logits after ``token``, at the next position (a state)."""
        pos = tx.get_state("pos", jnp.int32(0))
        x = self.embed(token) + self.positions[pos]
        for i, block in enumerate(self.blocks):
            with tx.scope(f"block{i}"):  # one cache per block
                x = block(x, pos)
        tx.set_state("pos", pos + 1)
        return self.unembed(x)

    def full(self, tokens: jax.Array) -> tuple[jax.Array, list]:
        """The logits at every position of ``tokens``, and each block's keys
        and values, without a cache."""
        xs = jax.vmap(self.embed)(tokens) + self.positions[: len(tokens)]
        kvs = []
        for block in self.blocks:
            xs, kv = block.full(xs)
            kvs.append(kv)
        return jax.vmap(self.unembed)(xs), kvs


def decode(model: Decoder, token: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One step: the logits after ``token`` and the next token, sampled
    with a key of the state's stream."""
    logits = model(token)
    return logits, jax.random.categorical(tx.next_key(), logits).astype(jnp.int32)


def generate(step, model: Decoder, state: dict, first: jax.Array) -> tuple:
    """Decoding for STEPS steps with the uncurried ``step``: the tokens
    fed, the logits after each, and the final state (caches filled,
    position and key stream advanced)."""

    def one(carry, _):
        state, token = carry
        (logits, sampled), state = step(state, model, token)
        return (state, sampled), (token, logits)

    (state, _), (tokens, logits) = lax.scan(one, (state, first), None, length=STEPS)
    return tokens, logits, state


def main() -> None:
    model = Decoder(jax.random.key(0))
    step, state0 = tx.uncurry(decode, model, jnp.int32(0))
    assert sorted(state0) == ["block0", "block1", "pos", "rng"]
    assert state0["block1"]["cache"]["k"].shape == (MAX_LEN, D)
    run = eqx.filter_jit(functools.partial(generate, step))

    tokens, logits, state = run(model, state0, jnp.int32(3))
    want_logits, want_kvs = model.full(tokens)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4)
    assert int(state["pos"]) == STEPS
    for i, kv in enumerate(want_kvs):
        cache = state[f"block{i}"]["cache"]
        for part in ("k", "v"):
            np.testing.assert_allclose(cache[part][:STEPS], kv[part], rtol=1e-4, atol=1e-5)
            assert not np.any(cache[part][STEPS:])  # positions not decoded yet
    print(f"decoded {tokens.tolist()}; logits equal the full causal run at every step "
          f"(max difference {float(jnp.abs(logits - want_logits).max()):.1e})")

    # A batch of prompts: vmap over a batch of states (each prompt its own
    # caches and its own key stream).
    firsts = jnp.array([1, 5, 9], jnp.int32)
    states = jax.tree_util.tree_map(lambda v: jnp.broadcast_to(v, (len(firsts), *v.shape)),
                                    state0)
    states["rng"] = jax.random.split(jax.random.key(1), len(firsts))
    batch_tokens, batch_logits, _ = eqx.filter_vmap(run, in_axes=(None, 0, 0))(
        model, states, firsts)
    for b, first in enumerate(firsts):
        alone_tokens, alone_logits, _ = run(model, {**state0, "rng": states["rng"][b]}, first)
        np.testing.assert_array_equal(batch_tokens[b], alone_tokens)
        np.testing.assert_allclose(batch_logits[b], alone_logits, rtol=1e-4, atol=1e-4)
    print(f"a batch of {len(firsts)} prompts decodes as each does alone: "
          f"{batch_tokens[:, :5].tolist()}")


if __name__ == "__main__":
    main()

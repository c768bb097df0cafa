"""Programs that the viewer's tests, benchmark and screenshots show, and
an account of a jaxpr's nesting computed here with ``jax.extend.core``
alone (not with taxpr's walk), to check the page against."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

import taxpr as tx

JAXPR_TYPES = tuple(t for t in (getattr(jax.extend.core, "Jaxpr", None),
                                getattr(jax.extend.core, "ClosedJaxpr", None)) if t is not None)


def mixed_program():
    """A function holding every container kind the viewer shows (jit, scan,
    while, cond, custom_jvp, custom_vjp, checkpoint, named scopes) and taxpr
    tags, a state, a sow and a key; with its example arguments."""

    @jax.custom_jvp
    def softplus(x):
        return jnp.logaddexp(x, 0.0)

    softplus.defjvp(lambda p, t: (softplus(p[0]), t[0] * jax.nn.sigmoid(p[0])))

    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))

    @jax.jit
    def block(h, w):
        with jax.named_scope("mlp"):
            return jnp.tanh(h @ w) + softplus(h)

    def model(x, w):
        x = tx.tag(x, name="inputs")
        n = tx.get_state("calls", init=jnp.zeros((), jnp.int32))
        tx.set_state("calls", n + 1)
        with jax.named_scope("encoder"):
            def step(h, _):
                return block(h, w), h.sum()
            h, sums = lax.scan(step, x, None, length=4)
        h = jax.checkpoint(lambda t: jnp.sin(t) * 2.0)(h)
        h = lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 0.5, c[1] + 1), (h, 0))[0]
        h = lax.cond(sums[0] > 0, lambda t: clip_grad(t), lambda t: -t, h)
        h = tx.harvest.sow(h, tag="intermediates", name="head")
        noise = jax.random.normal(tx.next_key(), h.shape)
        return (h + 0.01 * noise).sum()

    return model, (jnp.ones((2, 3)), jnp.eye(3))


def flax_transformer(layers: int = 3, width: int = 16, heads: int = 2, seq: int = 8):
    """A small flax linen transformer whose blocks are one ``nn.scan``:
    ``(apply, params, x)`` with ``apply(params, x)``."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            h = nn.LayerNorm(name="ln1")(x)
            h = nn.MultiHeadDotProductAttention(num_heads=heads, name="attn")(h)
            x = x + h
            h = nn.LayerNorm(name="ln2")(x)
            h = nn.Dense(width * 4, name="up")(h)
            h = nn.Dense(width, name="down")(nn.gelu(h))
            return x + h, None

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(64, width, name="embed")(tokens)
            blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                             length=layers)
            x, _ = blocks(name="blocks")(x, None)
            return nn.Dense(64, name="head")(nn.LayerNorm(name="ln_f")(x))

    model = Transformer()
    tokens = jnp.arange(seq, dtype=jnp.int32)[None] % 64
    params = model.init(jax.random.PRNGKey(0), tokens)
    return model.apply, params, tokens


def unrolled_program(blocks: int):
    """``blocks`` blocks of about ten equations each, in named scopes, every
    fifth a scan and every seventh a jitted call (about ``10 * blocks``
    equations in all); with its example arguments."""

    def f(x, w):
        for i in range(blocks):
            with jax.named_scope(f"layer_{i}"):
                h = jnp.tanh(x @ w + 1.0)
                if i % 5 == 0:
                    h = lax.scan(lambda c, _: (c * 0.9 + 0.1, None), h, None, length=2)[0]
                elif i % 7 == 0:
                    h = jax.jit(lambda t: t * jax.nn.sigmoid(t))(h)
                else:
                    h = h * jax.nn.sigmoid(h)
                x = x + h.mean(axis=-1, keepdims=True)
        return x

    return f, (jnp.ones((4, 8)), jnp.ones((8, 8)) * 0.1)


# ---- the nesting of a jaxpr, independently of taxpr ----------------------------------

def _parts(j: Any):
    inner = getattr(j, "jaxpr", j)
    return inner.invars, inner.eqns, inner.outvars


def nested(eqn: Any) -> list[Any]:
    """The jaxprs in ``eqn``'s params (tuples of them included)."""
    out = []
    for v in eqn.params.values():
        items = v if isinstance(v, (tuple, list)) else (v,)
        out.extend(x for x in items if isinstance(x, JAXPR_TYPES))
    return out


def scope_names(eqn: Any) -> tuple[str, ...]:
    """The named scopes of an equation's name stack (its ``Scope`` frames;
    transformation frames such as ``jvp(...)`` left out)."""
    return tuple(s.name for s in eqn.source_info.name_stack.stack
                 if type(s).__name__ == "Scope")


class Nesting(NamedTuple):
    """What a program's page must show: counts by primitive of the
    equations holding jaxprs (each jaxpr a container), the full paths of
    the named scopes, and the number of equations."""

    subs_by_primitive: dict[str, int]
    scopes: set[str]
    n_eqns: int


def nesting(closed: Any) -> Nesting:
    subs: dict[str, int] = {}
    scopes: set[str] = set()
    count = [0]

    def visit(j: Any, outer: tuple[str, ...]) -> None:
        for eqn in _parts(j)[1]:
            count[0] += 1
            scope = outer + scope_names(eqn)
            for i in range(len(scope) - len(outer)):
                scopes.add("/".join(scope[:len(outer) + i + 1]))
            for sj in nested(eqn):
                subs[eqn.primitive.name] = subs.get(eqn.primitive.name, 0) + 1
                visit(sj, scope)

    visit(closed, ())
    return Nesting(subs, scopes, count[0])


def eqn_list(closed: Any) -> list[Any]:
    """Every equation in program order (an equation before those of its
    jaxprs, these in param order)."""
    out = []

    def visit(j):
        for eqn in _parts(j)[1]:
            out.append(eqn)
            for sj in nested(eqn):
                visit(sj)

    visit(closed)
    return out


def inside(pane: dict, node: int, ancestor: int) -> bool:
    """Whether container ``node`` of a page's pane (its ``N`` records: the
    parent at index 2) is ``ancestor`` or inside it."""
    while node >= 0:
        if node == ancestor:
            return True
        node = pane["N"][node][2]
    return False

"""A differential fuzzer for patches inside custom derivative rules: random
small networks whose activations are ``jax.nn.relu``, ``jax.nn.softplus``
or custom_jvp / custom_vjp functions whose rules call the function, in an
unrolled chain or a ``lax.scan``, with a patch (by constant, or by a value
the patch closes over) at a site inside one activation's function,
differentiated from outside (``grad``, ``jvp``, ``vjp``, under ``jit`` and
``vmap``). The reference is the same network with the patch written into
the activation by hand (the same rules), run by JAX without taxpr.

``TAXPR_RULE_FUZZ=N`` runs N programs instead of the everyday share."""

from __future__ import annotations

import os
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx

N_PROGRAMS = int(os.environ.get("TAXPR_RULE_FUZZ", "24"))
KINDS = ("relu", "softplus", "jvp_by_defjvps", "jvp_using_output", "vjp_with_residuals")
# The primitive of the patched site inside each activation's function.
PATCHED_PRIMITIVE = {"relu": "max", "softplus": "log1p", "jvp_by_defjvps": "sin",
                     "jvp_using_output": "sin", "vjp_with_residuals": "sin"}


def _by_hand(kind: str, patch, a):
    """The activation ``kind`` with ``patch(value, a)`` applied to its
    patched site, written by hand with the same rule. ``a`` (what a patch
    closes over) is an input of the function whose derivative the rule does
    not give: autodiff of the function gives it, as taxpr differentiates a
    value a patch closes over through the patched function."""

    def with_a_direction(body, x, a, t_a):
        return jax.jvp(lambda q: body(x, q), (a,), (t_a,))[1]

    if kind == "vjp_with_residuals":
        @jax.custom_vjp
        def act(x, q):
            with jax.named_scope("inner"):
                return patch(jnp.sin(x), q) * x

        def fwd(x, q):
            y = act(x, q)
            # d body / d q, from residuals (a bwd that ran the function again
            # would be taxpr's error: it would not see the patch)
            d_q = jax.jvp(lambda q_: patch(jnp.sin(x), q_), (q,), (jnp.ones_like(q),))[1] * x
            return y, (x, y, d_q)

        def bwd(res, g):
            x, y, d_q = res
            return g * (x + 0.1 * y), jnp.sum(g * d_q).astype(d_q.dtype)
        act.defvjp(fwd, bwd)
        return lambda x: act(x, a)

    if kind == "relu":  # jax.nn.relu's function and rule
        def body(x, q):
            return patch(jnp.maximum(x, 0.0), q)

        def x_tangent(x, y, t):
            return lax.select(x > 0, t, lax.full_like(t, 0))
    elif kind == "softplus":  # logaddexp(x, 0): its rule calls it and uses its output
        def body(x, q):
            delta = x
            return lax.select(jnp.isnan(delta), x,
                              lax.add(lax.max(x, 0.0),
                                      patch(lax.log1p(lax.exp(lax.neg(lax.abs(delta)))), q)))

        def x_tangent(x, y, t):
            return t * jnp.exp(x - y)
    elif kind == "jvp_by_defjvps":
        def body(x, q):
            with jax.named_scope("inner"):
                return patch(jnp.sin(x), q) * 2.0

        def x_tangent(x, y, t):
            return t * 2.0 * jnp.cos(x)
    else:  # "jvp_using_output"
        def body(x, q):
            with jax.named_scope("inner"):
                return patch(jnp.sin(x), q) + x

        def x_tangent(x, y, t):
            return t * (1.0 + 0.5 * y)

    @jax.custom_jvp
    def act(x, q):
        return body(x, q)

    @act.defjvp
    def _jvp(primals, tangents):
        (x, q), (t, t_q) = primals, tangents
        y = act(x, q)  # the rule calls the function
        return y, x_tangent(x, y, t) + with_a_direction(body, x, q, t_q)
    return lambda x: act(x, a)


def _plain(kind: str):
    if kind == "relu":
        return jax.nn.relu
    if kind == "softplus":
        return jax.nn.softplus
    return _by_hand(kind, lambda v, q: v, jnp.float32(0.0))


def _network(kinds, scanned: bool, acts):
    """``net(ws, x) -> scalar``: layer i is ``acts[i](w_i * h) - 0.2`` in
    scope ``L{i}`` (in a scan: one layer kind, scope ``L``)."""
    def net(ws, x):
        if scanned:
            def layer(h, w):
                with jax.named_scope("L"):
                    return acts[0](w * h) - 0.2, None
            h = lax.scan(layer, x, ws)[0]
        else:
            h = x
            for i, act in enumerate(acts):
                with jax.named_scope(f"L{i}"):
                    h = act(ws[i] * h) - 0.2
        return jnp.sum(h * h)
    return net


def _case(seed: int):
    rng = random.Random(seed)
    scanned = rng.random() < 0.4
    n = rng.randint(1, 3)
    kinds = [rng.choice(KINDS)] * n if scanned else [rng.choice(KINDS) for _ in range(n)]
    target = rng.randrange(n) if not scanned else 0
    how = rng.choice(["scale", "shift", "closed_over"])
    transforms = ["grad", "jit_grad", "vjp", "vmap_grad"]
    if "vjp_with_residuals" not in kinds:  # (JAX has no forward mode for a custom_vjp)
        transforms.append("jvp")
    transform = rng.choice(transforms)
    ws = jnp.asarray(np.random.RandomState(seed).uniform(-1.5, 1.5, n), jnp.float32)
    x = jnp.asarray(np.random.RandomState(seed + 1).uniform(-2, 2, 3), jnp.float32)
    return scanned, kinds, target, how, transform, ws, x


@pytest.mark.parametrize("seed", range(N_PROGRAMS))
def test_a_patch_inside_a_custom_rule_differentiates_like_the_hand_patched_network(seed):
    scanned, kinds, target, how, transform, ws, x = _case(seed)
    scope = "L" if scanned else f"L{target}"
    prim = PATCHED_PRIMITIVE[kinds[target]]

    def picks(site):
        return (site.scope.split("/")[0] == scope and site.primitive == prim
                and any(p.startswith("custom") for p in site.path))

    patch_fn = {"scale": lambda v, q: v * 1.5, "shift": lambda v, q: v + 0.25,
                "closed_over": lambda v, q: v * q}[how]

    def patched(ws, x, a):
        return tx.patch(_network(kinds, scanned, [_plain(k) for k in kinds]),
                        {picks: lambda v: patch_fn(v, a)})(ws, x)

    def by_hand(ws, x, a):
        acts = [_by_hand(k, patch_fn, a) if i == target or scanned else _plain(k)
                for i, k in enumerate(kinds)]
        return _network(kinds, scanned, acts)(ws, x)

    a = jnp.float32(0.75)
    if transform in ("grad", "jit_grad"):
        run = lambda f: jax.value_and_grad(f, argnums=(0, 2))(ws, x, a)  # noqa: E731
        if transform == "jit_grad":
            run = jax.jit(run, static_argnums=0)
    elif transform == "jvp":
        run = lambda f: jax.jvp(lambda w, q: f(w, x, q), (ws, a),  # noqa: E731
                                (jnp.ones_like(ws), jnp.float32(0.5)))
    elif transform == "vjp":
        def run(f):
            out, back = jax.vjp(lambda w, q: f(w, x, q), ws, a)
            return out, back(jnp.float32(1.0))
    else:
        xs = jnp.stack([x, x * 0.5 - 0.3])
        run = lambda f: jax.vmap(jax.grad(f, argnums=(0, 2)), (None, 0, None))(ws, xs, a)  # noqa: E731
    got, want = run(patched), run(by_hand)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=1e-6,
                                   err_msg=f"{kinds=} {scanned=} {target=} {how=} {transform=}")

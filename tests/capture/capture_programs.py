"""Programs for the capture tests, each with an eager reference written by
hand (Python control flow, no taxpr) that returns the values the tests
capture, keyed by site name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

WEIGHTS = (1.0, -2.0, 0.5)


def layers(x):
    """scan over three layers with a cond in each, a while loop, a top-level
    cond and a checkpoint, every part in a named scope."""
    with jax.named_scope("pre"):
        h = jnp.sin(x) * 2.0

    def body(c, w):
        with jax.named_scope("layer"):
            a = c * w
            b = jax.lax.cond(a.sum() > 0, lambda a: jnp.exp(-a * a), lambda a: -a, a)
        return c + b, None

    h, _ = jax.lax.scan(body, h, jnp.asarray(WEIGHTS))
    with jax.named_scope("loop"):
        def step(c):
            i, v = c
            return i + 1, jnp.cos(v)
        _, h = jax.lax.while_loop(lambda c: c[0] < 2, step, (0, h))
    with jax.named_scope("top"):
        h = jax.lax.cond(h.sum() > 0, jnp.tanh, lambda h: h * 3.0, h)
    with jax.named_scope("out"):
        return jax.checkpoint(lambda h: jnp.sum(jnp.log1p(h ** 2)))(h)


def layers_reference(x, patch: dict | None = None):
    """``layers`` run eagerly; ``patch`` maps a site name to a function
    applied to its value (per iteration) where it is computed."""
    patch = patch or {}
    p = lambda name, v: patch[name](v) if name in patch else v  # noqa: E731
    acts: dict = {}
    h = p("pre/mul", jnp.sin(x) * 2.0)
    acts["pre/mul"] = h
    exps, negs, muls = [], [], []
    for w in WEIGHTS:
        a = p("layer/mul", h * w)
        muls.append(a)
        if a.sum() > 0:
            b = p("layer/exp", jnp.exp(-a * a))
            exps.append(b)
            negs.append(jnp.zeros_like(a))
        else:
            b = p("layer/neg", -a)
            negs.append(b)
            exps.append(jnp.zeros_like(a))
        h = h + b
    acts["layer/mul"] = jnp.stack(muls)
    acts["layer/exp"] = jnp.stack(exps)
    acts["layer/neg"] = jnp.stack(negs)
    for _ in range(2):
        h = p("loop/cos", jnp.cos(h))
    acts["loop/cos"] = h
    if h.sum() > 0:
        h = p("top/tanh", jnp.tanh(h))
        acts["top/tanh"], acts["top/mul"] = h, jnp.zeros_like(h)
    else:
        h = p("top/mul", h * 3.0)
        acts["top/mul"], acts["top/tanh"] = h, jnp.zeros_like(h)
    out = jnp.sum(p("out/log1p", jnp.log1p(h ** 2)))
    return out, acts


def assert_close(a, b, **kw):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, **kw)

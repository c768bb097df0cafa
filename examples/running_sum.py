"""The running-sum counter from the original taxpr README, working.

State is built from raw tags and ``tx.inject``, with no special API:

* ``get_state(name, init)`` tags ``init`` with ``op="get"``: the injector
  replaces the value with the current state;
* ``set_state(name, v)`` tags ``v`` with ``op="set"``: the injector stores the
  value into the state;
* the context threaded through the program is a dict ``{name: value}``;
  ``tx.iter_tags`` discovers the states and their shapes (through scan
  bodies, cond branches, while cond and body) to build it, and
  ``tx.find_tags`` shows where each tag sits.

The counter runs straight-line, inside ``lax.scan`` (taxpr 0.0.3 silently
returned 0 instead of 4 for a 4-step scan), inside ``lax.cond`` (0.0.3 raised
a KeyError) and inside a ``lax.while_loop`` whose cond reads the state. Each
result is checked against the plain-Python answer.

Run: ``python examples/running_sum.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import jaxpr_as_fun

import taxpr as tx


# -- state from raw tags ------------------------------------------------------

def get_state(name, init):
    """The current value of state ``name`` (``init`` fixes shape and dtype)."""
    return tx.tag(init, op="get", name=name)


def set_state(name, v):
    """Set state ``name`` to ``v``; returns ``v``."""
    return tx.tag(v, op="set", name=name)


def injector(ctx, token, params):
    """get: the token becomes ctx[name]; set: ctx[name] becomes the token."""
    name = params["name"]
    if params["op"] == "get":
        return ctx[name], ctx
    return token, {**ctx, name: token}


def stateful(fn):
    """``fn(*args) -> out`` using get/set_state -> ``(pure, state0)`` with
    ``pure(state, *args) -> (out, new_state)`` an ordinary JAX function."""

    def build(*example_args):
        closed = jax.make_jaxpr(fn)(*example_args)
        # Discover the states, in program order, through every nested jaxpr
        # (scan bodies, cond branches, while cond and body). Each starts at
        # zeros of the shape and dtype of its first tag.
        init = {}
        for params, shape in tx.iter_tags(closed):
            if params.get("op") in ("get", "set") and params["name"] not in init:
                init[params["name"]] = jnp.zeros(shape.shape, shape.dtype)
        new = tx.inject(closed, injector, init)
        run = jaxpr_as_fun(new)
        n_states = len(init)

        def pure(state, *args):
            leaves, tree = jax.tree_util.tree_flatten(state)
            outs = run(*leaves, *args)
            out, new_leaves = outs[:-n_states], outs[-n_states:]
            out = out[0] if len(out) == 1 else tuple(out)
            return out, jax.tree_util.tree_unflatten(tree, new_leaves)

        return pure, init

    return build


# -- the counter --------------------------------------------------------------

def add(x):
    """Add ``x`` to the running sum; return the new total."""
    total = get_state("total", jnp.zeros((), jnp.float32))
    return set_state("total", total + x)


def straight(x):
    add(x)
    add(2 * x)
    return add(3 * x)


def in_scan(xs):
    def body(carry, x):
        return carry, add(x)
    _, totals = lax.scan(body, 0.0, xs)
    return totals


def in_cond(p, x):
    return lax.cond(p, lambda x: add(x), lambda x: x * 0.0, x)


def in_while(x):
    # The loop condition reads the state: keep adding x while total < 10.
    def cond(i):
        return get_state("total", jnp.zeros((), jnp.float32)) < 10.0

    def body(i):
        add(x)
        return i + 1

    return lax.while_loop(cond, body, 0)


def main() -> dict:
    results = {}

    # Straight-line: 1 + 2 + 3 = 6.
    pure, s0 = stateful(straight)(1.0)
    out, s1 = pure(s0, 1.0)
    assert float(out) == 6.0 and float(s1["total"]) == 6.0, (out, s1)
    # The state carries across calls: a second call continues from 6.
    out, s2 = pure(s1, 1.0)
    assert float(s2["total"]) == 12.0, s2
    results["straight"] = float(s1["total"])

    # lax.scan over 4 ones: totals 1, 2, 3, 4 (taxpr 0.0.3 returned 0).
    xs = jnp.ones((4,), jnp.float32)
    pure, s0 = stateful(in_scan)(xs)
    totals, s1 = pure(s0, xs)
    assert np.allclose(totals, [1.0, 2.0, 3.0, 4.0]), totals
    assert float(s1["total"]) == 4.0, s1
    results["scan"] = float(s1["total"])
    # It is an ordinary JAX function: jit and vmap (over a batch of states).
    totals_j, s1_j = jax.jit(pure)(s0, xs)
    assert float(s1_j["total"]) == 4.0
    batch = {"total": jnp.arange(3.0)}
    _, s1_v = jax.vmap(pure, in_axes=(0, None))(batch, xs)
    assert np.allclose(s1_v["total"], [4.0, 5.0, 6.0]), s1_v

    # lax.cond: only the taken branch adds (taxpr 0.0.3 raised KeyError).
    pure, s0 = stateful(in_cond)(True, 5.0)
    _, s_true = pure(s0, True, 5.0)
    _, s_false = pure(s0, False, 5.0)
    assert float(s_true["total"]) == 5.0 and float(s_false["total"]) == 0.0
    results["cond_true"] = float(s_true["total"])
    results["cond_false"] = float(s_false["total"])

    # lax.while_loop whose cond reads the state: add 3 while total < 10.
    expected_total, expected_iters = 0.0, 0
    while expected_total < 10.0:
        expected_total += 3.0
        expected_iters += 1
    pure, s0 = stateful(in_while)(3.0)
    iters, s1 = pure(s0, 3.0)
    assert int(iters) == expected_iters and float(s1["total"]) == expected_total, (iters, s1)
    results["while_iters"] = int(iters)
    results["while_total"] = float(s1["total"])

    # Where the counter's tags sit: find_tags gives each site's path.
    for site in tx.find_tags(jax.make_jaxpr(in_while)(3.0)):
        print(f"  tag {site.params} {site.shape.str_short()} at {'/'.join(site.path)}")

    for k, v in results.items():
        print(f"{k:12s} {v}")
    return results


if __name__ == "__main__":
    main()

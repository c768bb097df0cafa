"""A running-sum counter kept in taxpr state, through raw JAX control flow.

The stateful function below reads and writes a state with ``tx.get_state`` /
``tx.set_state`` inside ``lax.scan``, ``lax.cond`` and a ``lax.while_loop``
whose condition reads the state. ``tx.uncurry`` turns it into a pure function
``pure(state, *args) -> (out, new_state)`` that ``jax.jit`` (or vmap, grad,
scan) accepts like any other. Every result is checked against the same
program run in plain Python with a dict for the state.

Run: ``python examples/running_sum.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import taxpr as tx


def add(x):
    """Add ``x`` to the running sum and count the call."""
    total = tx.get_state("total", jnp.zeros((), jnp.float32))
    calls = tx.get_state("calls", jnp.zeros((), jnp.int32))
    tx.set_state("calls", calls + 1)
    return tx.set_state("total", total + x)


def program(xs):
    """Sum ``xs`` in a scan, add 100 if the sum is large, then keep adding
    1 while the total is below 120 (the loop's condition reads the state)."""

    def step(carry, x):
        return carry, add(x)

    _, partial_sums = lax.scan(step, None, xs)
    lax.cond(partial_sums[-1] > 5.0, lambda: add(100.0), lambda: add(0.0))
    lax.while_loop(lambda _: tx.get_state("total", jnp.zeros(())) < 120.0,
                   lambda c: (add(1.0), c + 1)[1], 0)
    return partial_sums


def program_in_python(state: dict, xs) -> tuple[list, dict]:
    """The same program with Python control flow and a mutable dict."""

    def add_py(x):
        state["calls"] = state["calls"] + 1
        state["total"] = state["total"] + x
        return state["total"]

    partial_sums = [add_py(float(x)) for x in xs]
    add_py(100.0 if partial_sums[-1] > 5.0 else 0.0)
    while state["total"] < 120.0:
        add_py(1.0)
    return partial_sums, state


def main() -> None:
    xs = jnp.arange(1.0, 5.0)  # 1, 2, 3, 4
    pure, state0 = tx.uncurry(program, xs)
    print("initial state:", {k: v.tolist() for k, v in state0.items()})

    step = jax.jit(pure)
    out, state1 = step(state0, xs)
    print("partial sums (scan):", out.tolist())
    print("state after one call:", {k: v.tolist() for k, v in state1.items()})

    _, state2 = step(state1, xs)  # state flows from one call to the next
    print("state after two calls:", {k: v.tolist() for k, v in state2.items()})

    ref_out, ref1 = program_in_python({"total": 0.0, "calls": 0}, xs)
    _, ref2 = program_in_python(dict(ref1), xs)
    np.testing.assert_allclose(out, ref_out)
    for got, want in ((state1, ref1), (state2, ref2)):
        assert float(got["total"]) == want["total"], (got, want)
        assert int(got["calls"]) == want["calls"], (got, want)

    # The pure program as a jaxpr: states are explicit inputs and outputs.
    jaxpr, states = tx.make_jaxpr_with_states(program)(xs)
    print("states in the pure jaxpr:", [(s.name, s.dtype.name, s.read, s.written)
                                        for s in states])
    assert not tx.find_tags(jaxpr), "uncurried programs keep no state tags"
    print("ok: matches the same program run in Python with a dict")


if __name__ == "__main__":
    main()

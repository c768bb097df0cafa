"""Programs traced with 64-bit types on (``jax.enable_x64``), as scientific
users run JAX: float64 / int64 states, reaped values and jaxpr rewrites
agree with the same program run eagerly, and a function used both with x64
off and on keeps the types of each (taxpr's caches are keyed on types).

The rest of the suite runs with x64 off (its programs mix Python floats
with float32 values, which x64 would make float64)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx
from taxpr import harvest

from ir_fuzz.checks import check_program
from ir_fuzz.generator import differentiable, program, vmappable


def enable_x64():
    """x64 on within the block (``jax.enable_x64`` where JAX has it, else
    ``jax.experimental.enable_x64``)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax import experimental
    if hasattr(experimental, "enable_x64"):
        return experimental.enable_x64()
    pytest.skip("this JAX has no x64 context manager")
    return contextlib.nullcontext()


def _accumulate(xs, n):
    """Add every x (float64: 0.1 steps that float32 would round) to a
    state, count the additions in an int64 state past 2**31, through scan,
    cond and a while whose predicate reads the state."""

    def add(x):
        total = tx.get_state("total", jnp.zeros((), jnp.float64))
        calls = tx.get_state("calls", jnp.asarray(2**31 + 5, jnp.int64))
        tx.set_state("calls", calls + 1)
        return tx.set_state("total", total + x)

    _, sums = lax.scan(lambda c, x: (c, add(x)), None, xs)
    lax.cond(sums[-1] > 0.25, lambda: add(jnp.float64(1e-9)), lambda: add(jnp.float64(0.0)))
    lax.while_loop(lambda i: (i < n) & (tx.get_state("total", jnp.zeros(())) < 10.0),
                   lambda i: (add(jnp.float64(0.1)), i + 1)[1], 0)
    return sums


def _accumulate_in_python(state, xs, n):
    def add(x):
        state["calls"] += 1
        state["total"] += x
        return state["total"]
    sums = [add(float(x)) for x in xs]
    add(1e-9 if sums[-1] > 0.25 else 0.0)
    i = 0
    while i < n and state["total"] < 10.0:
        add(0.1)
        i += 1
    return sums, state


def test_float64_and_int64_states_match_python_exactly():
    with enable_x64():
        xs = jnp.asarray([0.1, 0.2, 0.3], jnp.float64)
        pure, s0 = tx.uncurry(_accumulate, xs, 4)
        assert s0["total"].dtype == jnp.float64 and s0["calls"].dtype == jnp.int64
        for n in (0, 3, 7):
            out, s1 = jax.jit(pure, static_argnums=2)(s0, xs, n)
            want, ws = _accumulate_in_python({"total": 0.0, "calls": 2**31 + 5},
                                             [0.1, 0.2, 0.3], n)
            np.testing.assert_array_equal(np.asarray(out), np.asarray(want, np.float64))
            assert float(s1["total"]) == ws["total"], (n, float(s1["total"]), ws["total"])
            assert int(s1["calls"]) == ws["calls"] and s1["calls"].dtype == jnp.int64


def test_a_function_used_with_x64_off_then_on_keeps_each_types():
    def prog(x):
        s = tx.get_state("s", jnp.zeros(()))  # float32 with x64 off, float64 on
        return tx.set_state("s", s + x)

    pure32, s32 = tx.uncurry(prog, 1.0)
    assert s32["s"].dtype == jnp.float32
    with enable_x64():
        pure64, s64 = tx.uncurry(prog, 1.0)
        assert s64["s"].dtype == jnp.float64
        out, s = jax.jit(pure64)(s64, 1e-10)
        assert s["s"].dtype == jnp.float64 and float(s["s"]) == 1e-10
    out, s = jax.jit(pure32)(s32, np.float32(0.5))
    assert s["s"].dtype == jnp.float32 and float(s["s"]) == 0.5


def test_reap_and_plant_of_float64_values_in_a_scan():
    def f(xs):
        def body(c, x):
            y = harvest.sow(c * x, tag="t", name="y", mode="append")
            return c + y, None
        return lax.scan(body, jnp.float64(1.0), xs)[0]

    with enable_x64():
        xs = jnp.asarray([0.1, 1e-12, 3.0], jnp.float64)
        out, reaped = harvest.call_and_reap(f, tag="t")(xs)
        c, rows = 1.0, []
        for x in (0.1, 1e-12, 3.0):
            rows.append(c * x)
            c += c * x
        assert reaped["y"].dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(reaped["y"]), np.asarray(rows))
        assert float(out) == c
        planted = harvest.plant(f, tag="t")({"y": jnp.zeros(3, jnp.float64)}, xs)
        assert float(planted) == 1.0


@pytest.mark.parametrize("seed", [0, 4, 7, 25])
def test_ir_passes_and_codegen_on_programs_traced_with_x64(seed):
    # The ir fuzzer's programs under x64: weak literals, while counters
    # and scan indices are 64-bit; checked as the ir fuzzer checks them
    # (tests/ir_fuzz/), under vmap and jvp too.
    stmts = program(seed)
    with enable_x64():
        check_program(seed)
        if vmappable(stmts):
            check_program(seed, batched=True)
        if differentiable(stmts):
            check_program(seed, differentiated=True)

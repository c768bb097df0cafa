"""``tx.error_if`` and ``tx.checked``: errors from inside compiled code.

The reference for each error is known by construction: the first step at
which a geometric sequence passes a threshold, computed in Python.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx

LIMIT = 10.0


def _line(marker: str) -> str:
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()
    n = next(i for i, text in enumerate(lines, 1) if marker in text and "_line(" not in text)
    return f"test_error_if.py:{n}"


def _simulate(x):
    def step(c, i):
        c = c * 1.5
        tx.error_if(c > LIMIT, "step {} diverged: value {}", i, c)  # the check
        return c, c
    return lax.scan(step, x, jnp.arange(10))[1]


def _diverges_at(x: float) -> tuple[int, float]:
    c = np.float32(x)
    for i in range(10):
        c = np.float32(c * np.float32(1.5))
        if c > LIMIT:
            return i, float(c)
    raise AssertionError("no divergence")


def test_no_error_leaves_the_outputs_bit_for_bit():
    x = jnp.float32(0.01)
    np.testing.assert_array_equal(np.asarray(tx.checked(_simulate)(x)),
                                  np.asarray(jax.jit(_simulate)(x)))


def test_checked_raises_naming_the_iteration():
    step, value = _diverges_at(1.0)
    with pytest.raises(tx.CheckError) as info:
        tx.checked(_simulate)(jnp.float32(1.0))
    e = info.value
    assert e.message == f"step {step} diverged: value {value}"
    assert e.iterations == (("scan", step),)
    assert e.path == ("scan[length=10]",)
    assert e.source.startswith(_line("# the check"))


def test_without_a_wrapper_under_jit_the_callback_raises():
    step, value = _diverges_at(1.0)
    with pytest.raises(Exception, match=rf"step {step} diverged: value {value}"):
        jax.jit(_simulate)(jnp.float32(1.0))
        jax.effects_barrier()


def test_concrete_values_raise_at_once():
    with pytest.raises(tx.CheckError, match="bad: 3"):
        tx.error_if(jnp.array([False, True]), "bad: {}", 3)
    tx.error_if(jnp.array([False, False]), "never")


def test_vmap_names_the_example():
    xs = jnp.array([0.01, 0.02, 1.0], jnp.float32)
    step, value = _diverges_at(1.0)
    for f in (jax.vmap(tx.checked(_simulate)), tx.checked(jax.vmap(_simulate))):
        with pytest.raises(tx.CheckError) as info:
            f(xs)
        assert info.value.message.startswith(f"step {step} diverged")
        assert info.value.example == 2


def test_inside_uncurrys_pure_function():
    def f(x):
        n = tx.get_state("n", jnp.zeros((), jnp.int32)) + 1
        tx.set_state("n", n)
        tx.error_if(n > 2, "called {} times", n)
        return x * 2.0

    pure, s0 = tx.uncurry(f, 1.0)
    step = tx.checked(pure)
    y, s1 = step(s0, 1.0)
    y, s2 = step(s1, y)
    assert float(y) == 4.0 and int(s2["n"]) == 2
    with pytest.raises(tx.CheckError, match="called 3 times"):
        step(s2, y)


def test_under_grad():
    def f(x):
        tx.error_if(x < 0, "negative input {}", x)
        return jnp.sin(x)

    np.testing.assert_allclose(jax.grad(tx.checked(f))(0.5), np.cos(0.5), rtol=1e-6)
    with pytest.raises(tx.CheckError, match="negative input -0.5"):
        jax.grad(tx.checked(f))(-0.5)

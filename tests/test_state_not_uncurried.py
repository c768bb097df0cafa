"""Jitting a stateful function without ``uncurry`` says so at compilation."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import taxpr as tx


def counter(x):
    n = tx.get_state("n", jnp.zeros(()))
    tx.set_state("n", n + x)
    return x * 2


def _compile_warnings(fn, *args) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(fn).lower(*args).compile()
    return [w for w in caught if issubclass(w.category, tx.StateNotUncurriedWarning)]


def test_jit_without_uncurry_warns_naming_the_state_and_uncurry():
    (w,) = _compile_warnings(counter, 1.0)
    assert "set_state('n')" in str(w.message)
    assert "tx.uncurry" in str(w.message)


def test_the_warning_can_be_made_an_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error", tx.StateNotUncurriedWarning)
        with pytest.raises(tx.StateNotUncurriedWarning, match="set_state\\('n'\\)"):
            jax.jit(lambda x: counter(x) + 1).lower(1.0)


def test_uncurried_function_compiles_silently():
    pure, state0 = tx.uncurry(counter, 1.0)
    assert _compile_warnings(pure, state0, 1.0) == []
    out, state1 = jax.jit(pure)(state0, 3.0)
    assert float(out) == 6.0 and float(state1["n"]) == 3.0


def test_read_only_state_and_user_tags_compile_silently():
    def reads(x):
        return x + tx.get_state("n", jnp.ones(()))

    def user_tags(x):  # a user's own tag with state-like params is not state
        return tx.tag(x, op="set", name="n")

    assert _compile_warnings(reads, 1.0) == []
    assert _compile_warnings(user_tags, 1.0) == []

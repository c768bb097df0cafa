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


def _eager_warnings(fn, *args) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args)
    return [w for w in caught if issubclass(w.category, tx.StateNotUncurriedWarning)]


def test_an_eager_call_without_uncurry_warns_at_the_set_state_line():
    (w,) = _eager_warnings(counter, 1.0)
    assert "set_state('n') ran eagerly" in str(w.message) and "tx.uncurry" in str(w.message)
    # the warning points at the user's set_state, not at taxpr or JAX
    assert w.filename == __file__
    assert w.lineno == counter.__code__.co_firstlineno + 2


def test_jit_under_disable_jit_runs_eagerly_and_warns():
    with jax.disable_jit():
        (w,) = _eager_warnings(jax.jit(counter), jnp.float32(1.0))
    assert "set_state('n') ran eagerly" in str(w.message)


def test_next_key_without_uncurry_or_seed_warns_that_every_call_gives_the_same_key():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, b = tx.next_key(), tx.next_key()
    assert (jax.random.key_data(a) == jax.random.key_data(b)).all()
    assert len(caught) == 2 and all(w.category is tx.StateNotUncurriedWarning for w in caught)
    assert "set_state('rng')" in str(caught[0].message)
    assert "tx.next_key the same key" in str(caught[0].message)
    assert "tx.seed" in str(caught[0].message)


def test_uncurry_and_seed_run_without_warnings_eagerly_and_under_disable_jit():
    for disabled in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error", tx.StateNotUncurriedWarning)
            with jax.disable_jit(disabled):
                pure, state0 = tx.uncurry(counter, 1.0)
                out, state1 = pure(state0, 3.0)
                assert float(out) == 6.0 and float(state1["n"]) == 3.0
                tx.seed(lambda: jax.random.normal(tx.next_key()), jax.random.key(1))()

"""State accesses (``taxpr._state._ops``): ``get_state`` / ``set_state`` are
tags marked by a private ``StateOp``, so a user's tag with state-like params
(``op="get"``) is never a state access; a ``set_state`` compiled or run
eagerly without ``uncurry`` says that its update is lost
(``StateNotUncurriedWarning``, at the user's line), and ``uncurry`` / ``seed``
say nothing.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import taxpr as tx

from helpers import check
from state_helpers import assert_close, f32


# ---- user tags are not state accesses ----------------------------------------------------

def test_user_tags_are_not_states():
    def fn(x):
        n = tx.get_state("n", jnp.zeros((), f32))
        y = tx.tag(x * 2.0, op="get", name="n")
        z = tx.tag(x + 1.0, op="set", name="m")
        tx.set_state("n", n + y)
        return y + z

    jaxpr, states = tx.make_jaxpr(fn)(f32(1.0))
    check(jaxpr)
    assert [s.name for s in states] == ["n"]
    user = [s.params for s in tx.find_tags(jaxpr)]
    assert {"op": "get", "name": "n"} in [dict(p) for p in user]
    assert {"op": "set", "name": "m"} in [dict(p) for p in user]
    assert len(user) == 2  # only the user's tags are left

    pure, s0 = tx.uncurry(fn, f32(1.0))
    assert list(s0) == ["n"]
    out, s1 = pure({"n": f32(5.0)}, f32(3.0))
    assert_close(out, f32(6.0 + 4.0))
    assert_close(s1, {"n": f32(11.0)})
    # A user tag whose name matches no state and a state-free program.
    jaxpr2, states2 = tx.make_jaxpr(lambda x: tx.tag(x, op="get", name="q"))(f32(1.0))
    assert states2 == () and len(tx.find_tags(jaxpr2)) == 1


# ---- a set_state without uncurry warns ---------------------------------------------------

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

"""Programs run under ``jax.disable_jit()``, as users do to debug.

Under it ``lax.while_loop`` first runs the loop in Python and, when a traced
predicate stops that attempt, stages the loop: the attempt's first call of
the predicate stayed in taxpr's trace as if it had run (a key drawn, a state
written, a value sown once more than eagerly). Each program is compared with
the same computation written with Python control flow."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taxpr as tx
from taxpr import harvest as h

from helpers import check, n_tags

f32, i32 = jnp.float32, jnp.int32


def _draws(x):
    def cond(c):
        return (jax.random.uniform(tx.next_key()) < 0.8) & (c[1] < 20)

    def body(c):
        return c[0] + jax.random.normal(tx.next_key()), c[1] + 1
    return jax.lax.while_loop(cond, body, (x, i32(0)))


def _draws_eagerly(key, x):
    def next_key():
        nonlocal key
        key, sub = jax.random.split(key)
        return sub
    c = (x, 0)
    while (jax.random.uniform(next_key()) < 0.8) & (c[1] < 20):
        c = (c[0] + jax.random.normal(next_key()), c[1] + 1)
    return c, key


def _counts(x):
    def cond(c):  # counts the predicate's runs: one more than the body's
        tx.set_state("runs", tx.get_state("runs", jnp.zeros((), i32)) + 1)
        return c < 3.0

    return jax.lax.while_loop(cond, lambda c: c + 1.0, x)


@pytest.mark.parametrize("disabled", [False, True])
def test_uncurry_of_a_while_whose_predicate_draws_keys_matches_eager(disabled):
    x = f32(0.0)
    (want_c, want_n), want_key = _draws_eagerly(jax.random.key(0), x)
    with jax.disable_jit(disabled):
        pure, state0 = tx.uncurry(_draws, x)
        for p in (pure, jax.jit(pure)):
            (c, n), state1 = p(state0, x)
            assert int(n) == want_n and float(c) == float(want_c)
            np.testing.assert_array_equal(jax.random.key_data(state1["rng"]),
                                          jax.random.key_data(want_key))
        c, n = tx.seed(_draws, jax.random.key(0))(x)
        assert int(n) == want_n and float(c) == float(want_c)


@pytest.mark.parametrize("disabled", [False, True])
def test_uncurry_of_a_while_whose_predicate_writes_state_matches_eager(disabled):
    with jax.disable_jit(disabled):
        pure, state0 = tx.uncurry(_counts, f32(0.0))
        out, state1 = pure(state0, f32(0.0))
        jaxpr, _ = tx.make_jaxpr(_counts)(f32(0.0))
    check(jaxpr)
    # eagerly: c = 0, 1, 2, 3 -> the predicate runs 4 times
    assert float(out) == 3.0 and int(state1["runs"]) == 4


@pytest.mark.parametrize("disabled", [False, True])
def test_reap_of_a_sow_in_a_while_predicate_counts_its_runs_as_eager(disabled):
    def f(x):
        def cond(c):
            return h.sow(c[1], tag="t", name="n", mode="clobber") < 3
        return jax.lax.while_loop(cond, lambda c: (c[0] * 2.0, c[1] + 1), (x, i32(0)))

    with jax.disable_jit(disabled):
        (out, _), reaped = h.call_and_reap(f, tag="t")(f32(1.0))
        planted, _ = h.plant(f, tag="t")({"n": i32(5)}, f32(1.0))
    assert float(out) == 8.0 and int(reaped["n"]) == 3  # the last predicate's value
    assert float(planted) == 1.0  # a planted 5 stops the loop before its first step


@pytest.mark.parametrize("disabled", [False, True])
def test_keep_tags_traces_the_program_jit_would_trace(disabled):
    with jax.disable_jit(disabled), tx.keep_tags():
        jaxpr = jax.make_jaxpr(_counts)(f32(0.0))
    # one get and one set, both inside the while's predicate
    assert n_tags(jaxpr) == 2
    assert [e.primitive.name for e in jaxpr.jaxpr.eqns] == ["while"]

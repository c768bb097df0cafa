"""Initial values (``taxpr._state._initial``): ``state0`` holds each state's
value at first use, its ``init`` when first read and zeros when first set.
Where every first use is certain from the program's structure only what
computes the inits is evaluated (the program does not run), else one run
with the example arguments decides. A state that run never reaches starts at
the init of its first ``get_state``, computed exactly (zeros when it is only
set); an init that depends on a loop's carry or on another state is a clear
error naming the state, also when ``uncurry`` runs inside a traced function.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx

from state_helpers import (TX, Eager, assert_close, assert_states, check_program,
                           created_in_loop_prog, f32, i32, init_kinds_prog, jax_still_works,
                           rnd, set_only_prog)


# ---- the value at first use --------------------------------------------------------------

def test_state_created_inside_loop_body():
    pure, s0 = check_program(created_in_loop_prog, (f32(1.0), i32(2)),
                             [(f32(2.0), i32(3)), (f32(0.5), i32(0)), (f32(1.0), i32(5))])
    # The value at first use is the init (not zeros).
    assert_close(s0["h"], jnp.full((2,), 3.0))
    assert s0["seen"].dtype == jnp.int32


def test_state_created_inside_while_and_scan_body():
    def prog(S, x):
        def body(c, x):
            q = S.get("q", jnp.full((), 2.0, f32))
            S.set("q", q * x)
            return c + q, None
        c, _ = S.scan(body, f32(0.0), x)
        c = S.while_loop(lambda c: S.get("lim", jnp.full((), 10.0, f32)) > c,
                         lambda c: c + S.get("step", jnp.full((), 3.0, f32)), c)
        return c
    pure, s0 = check_program(prog, (jnp.array([1.0, 2.0]),),
                             [(jnp.array([0.5, 1.0, 2.0]),), (rnd(12, 4),)])
    assert_close(s0, {"q": f32(2.0), "lim": f32(10.0), "step": f32(3.0)})


def test_set_but_never_read_starts_at_zeros():
    pure, s0 = check_program(set_only_prog, (jnp.ones(3),), [(rnd(13, 3),)])
    assert_close(s0, {"written": jnp.zeros(3), "count": jnp.zeros((), i32)})
    assert s0["count"].dtype == jnp.int32 and s0["written"].dtype == jnp.float32
    _, s1 = pure(s0, jnp.arange(3.0))
    assert_close(s1["written"], jnp.arange(3.0) * 2)


def test_state0_init_arrays_and_callables():
    pure, s0 = check_program(init_kinds_prog, (jnp.ones(3),),
                             [(rnd(14, 3),), (jnp.full(3, 2.0),)])
    assert_close(s0, {"arr": jnp.arange(3.0), "call": jnp.ones(3),
                      "int": jnp.array([7, 8], i32), "flag": jnp.array(True),
                      "dep": jnp.full(3, 3.0)})
    assert s0["int"].dtype == jnp.int32 and s0["flag"].dtype == jnp.bool_
    # The init computed from arguments is taken from the example arguments only.
    _, s1 = pure(s0, jnp.full(3, 10.0))
    assert_close(s1["dep"], jnp.full(3, 4.0))


# ---- without running the program, or with one example run --------------------------------

def _with_probe(calls: list):
    """A callback that counts how often the program runs."""
    def probe(x):
        jax.debug.callback(lambda v: calls.append(1), x)
        return x
    return probe


def test_uncurry_with_constant_inits_does_not_run_the_program():
    calls: list = []
    probe = _with_probe(calls)

    def prog(S, w, xs):
        def body(_, x):
            h = S.get("h", lambda: jnp.zeros(3, f32))
            S.set("h", jnp.tanh(w * h + probe(x)))
            S.set("n", S.get("n", jnp.zeros((), jnp.int32)) + 1)
            return None, None
        S.scan(body, None, xs)
        S.set("last", S.get("h", jnp.ones(3, f32)))  # first use: a set (zeros)
        return S.get("h", jnp.ones(3, f32))

    w, xs = jnp.full(3, 0.5, f32), jnp.ones((4, 3), f32)
    pure, state0 = tx.uncurry(functools.partial(prog, TX), w, xs)
    jax.effects_barrier()
    assert calls == []
    ref = Eager()
    prog(ref, w, xs)
    assert_close(state0, ref.first)
    out, _ = pure(state0, w, xs)
    jax.effects_barrier()
    assert calls  # the probe is live: the pure function runs it
    calls.clear()
    check_program(prog, (w, xs), [(w * 2.0, xs * 0.5)])


def test_uncurry_init_computed_from_inputs_without_running_the_program():
    calls: list = []
    probe = _with_probe(calls)

    def prog(S, x, y):
        z = probe(jnp.sin(y))  # not needed by the init: not run
        inner = S.jit(lambda a: S.get("h", a * 2.0 + 1.0))  # init from an input
        h = inner(x)
        S.set("h", h + z)
        return h

    x, y = jnp.arange(3, dtype=f32), jnp.ones(3, f32)
    _, state0 = tx.uncurry(functools.partial(prog, TX), x, y)
    jax.effects_barrier()
    assert calls == []
    assert_close(state0["h"], x * 2.0 + 1.0)
    check_program(prog, (x, y), [(x - 1.0, y)])


def test_uncurry_first_use_decided_by_values_runs_the_example():
    # Which init counts depends on the predicate's value: the example run
    # decides (both ways agree with eager).
    def prog(S, p, x):
        y = S.cond(p, lambda v: v + S.get("s", jnp.full(2, 3.0, f32)),
                   lambda v: v - S.get("s", jnp.full(2, -1.0, f32)), x)
        S.set("s", y)
        return S.get("s", jnp.zeros(2, f32))

    x = jnp.ones(2, f32)
    for p in (True, False):
        check_program(prog, (jnp.bool_(p), x), [(jnp.bool_(not p), x)])


def test_uncurry_init_from_a_loop_carry_runs_the_example():
    def prog(S, xs):
        def body(c, x):
            h = S.get("h", c * 3.0)  # the init changes per iteration
            S.set("h", h + x)
            return c + 1.0, None
        S.scan(body, jnp.ones(2, f32), xs)
        return S.get("h", jnp.zeros(2, f32))

    check_program(prog, (jnp.ones((3, 2), f32),), [(jnp.full((3, 2), 2.0, f32),)])


def test_uncurry_static_initial_values_under_jit():
    def prog(S, x):
        S.set("h", S.get("h", x * 2.0) + 1.0)
        S.set("c", S.get("c", jnp.ones((), f32)) * 3.0)
        return x

    state0 = jax.jit(lambda x: tx.uncurry(functools.partial(prog, TX), x)[1])(
        jnp.arange(2, dtype=f32))
    ref = Eager()
    prog(ref, jnp.arange(2, dtype=f32))
    assert_close(state0, ref.first)


def test_uncurry_state0_is_a_fresh_array():
    init = jnp.ones(3, f32)

    def prog(S, x):
        S.set("h", S.get("h", init) + x)
        return x

    _, state0 = tx.uncurry(functools.partial(prog, TX), jnp.ones(3, f32))
    assert state0["h"] is not init  # may be donated without deleting `init`
    assert_close(state0["h"], init)


def test_uncurry_scan_of_length_zero_runs_the_example():
    def prog(S, xs):
        def body(_, x):
            S.set("h", S.get("h", jnp.full(2, 5.0, f32)) + x)
            return None, None
        S.scan(body, None, xs)
        return S.get("h", jnp.full(2, 7.0, f32))

    check_program(prog, (jnp.ones((0, 2), f32),), [(jnp.ones((0, 2), f32),)])


def test_uncurry_while_body_first_use_runs_the_example():
    def prog(S, n):
        def body(i):
            S.set("h", S.get("h", jnp.full((), 5.0, f32)) + 1.0)
            return i + 1
        S.while_loop(lambda i: i < n, body, 0)
        return S.get("h", jnp.full((), 7.0, f32))

    for n in (0, 2):
        check_program(prog, (jnp.int32(n),), [(jnp.int32(3 - n),)])


def test_uncurry_first_use_inside_lax_jit_and_checkpoint():
    def prog(S, x):
        f = S.checkpoint(lambda v: v * S.get("a", jnp.full(2, 2.0, f32)))
        y = S.jit(f)(x)
        S.set("a", y)
        return lax.stop_gradient(y)

    check_program(prog, (jnp.ones(2, f32),), [(jnp.full(2, 3.0, f32),)])


# ---- states the example run never reaches ------------------------------------------------

def test_state0_of_unreached_get_is_its_init():
    def fn(p, x):
        def branch(x):
            return tx.set_state("b", tx.get_state("b", lambda: jnp.full((), -1.0, f32)) - x)
        return lax.cond(p, lambda x: x, branch, x)
    # A state the example run never reaches starts at its init, computed
    # exactly (test_unreached_state_starts_at_its_init_computed_exactly
    # covers every kind of init).
    pure, s0 = tx.uncurry(fn, jnp.array(True), f32(1.0))
    assert_close(s0, {"b": f32(-1.0)})


# Inits that do not depend on traced inputs (a constant built inside the branch is
# a tracer there), and one computed from the function's argument.
CONST_INITS = {
    "jnp_scalar": lambda x: jnp.float32(10.0),
    "ones_times": lambda x: 10 * jnp.ones(()),
    "callable": lambda x: (lambda: jnp.full((), 10.0, f32)),
    "numpy": lambda x: np.float32(10.0),
    "from_argument": lambda x: x * 10.0,
}


def _unreached_prog(where: str, make_init):
    """``fn(S, p, x)``: a get_state of "s" on a path the example (p False, x
    1) does not take; taken when p is True."""
    def fn(S, p, x):
        def touch(c):
            return c + S.get("s", make_init(x))
        if where == "cond":
            return S.cond(p, touch, lambda c: c * 2.0, x)
        if where == "switch":
            return S.switch(jnp.where(p, 0, 2), [touch, lambda c: c, lambda c: -c], x)
        if where == "while":
            return S.while_loop(lambda c: p & (c < 3.0), touch, x)
        if where == "fori":  # zero trips unless p
            return S.fori_loop(0, jnp.where(p, 2, 0), lambda i, c: touch(c), x)
        if where == "scan_cond":
            def body(c, _):
                return S.cond(p, touch, lambda c: c, c), None
            return S.scan(body, x, None, length=2)[0]
        raise ValueError(where)
    return fn


@pytest.mark.parametrize("where", ["cond", "switch", "while", "fori", "scan_cond"])
@pytest.mark.parametrize("init", sorted(CONST_INITS))
def test_unreached_state_starts_at_its_init_computed_exactly(where, init):
    prog = _unreached_prog(where, CONST_INITS[init])
    pure, s0 = tx.uncurry(functools.partial(prog, TX), jnp.array(False), f32(1.0))
    # The init the first get_state would use (its argument is the example's).
    assert_close(s0, {"s": f32(10.0)})
    assert s0["s"].dtype == jnp.float32
    for p, x in ((jnp.array(True), f32(0.5)), (jnp.array(False), f32(0.5))):
        out, s1 = pure(s0, p, x)
        ref = Eager(s0)
        assert_close(out, prog(ref, p, x))
        assert_states(s1, ref.state)


@pytest.mark.parametrize("n_branches, how", [(3, "switch"), (2, "switch"), (2, "cond")])
def test_unreached_state_with_different_inits_starts_at_the_first_traced(n_branches, how):
    # A state read with a different init in each branch of a switch or
    # cond, none taken by the example, starts at the init of the first read
    # JAX traces: lax.cond traces its branches backwards (true first),
    # lax.switch in index order.
    traced = []

    def prog(n, x):
        def branch(k):
            def f(c):
                traced.append(k)
                return c + tx.get_state("s", f32(k + 0.5))
            return f
        branches = [branch(k) for k in range(n_branches)]

        def inner(c):
            if how == "cond":
                return lax.cond(n % 2 == 0, branches[1], branches[0], c)
            return lax.switch(n, branches, c)
        # The example (n = 0) takes neither inner branch.
        return lax.cond(n > 100, inner, lambda c: c * 2.0, x)

    pure, s0 = tx.uncurry(prog, i32(0), f32(1.0))
    first = traced[0]  # JAX's own trace order
    assert traced[:n_branches] == ([1, 0] if how == "cond" else list(range(n_branches)))
    assert_close(s0, {"s": f32(first + 0.5)})


@pytest.mark.parametrize("where", ["while", "fori", "scan_carry"])
def test_unreached_state_whose_init_depends_on_a_loop_carry_is_an_error(where):
    def fn(p, x):
        def touch(c):
            return c + tx.get_state("s", c * 10.0)  # the loop's carry
        if where == "while":
            return lax.while_loop(lambda c: p & (c < 3.0), touch, x)
        if where == "fori":
            return lax.fori_loop(0, jnp.where(p, 2, 0), lambda i, c: touch(c), x)
        return lax.scan(lambda c, _: (lax.cond(p, touch, lambda c: c, c), None), x, None,
                        length=2)[0]
    with pytest.raises(tx.StateError, match=r"(?s)state 's'.*never reached.*carry"):
        tx.uncurry(fn, jnp.array(False), f32(1.0))
    jax_still_works()
    # Reached on the example arguments, the same program is fine.
    pure, s0 = tx.uncurry(fn, jnp.array(True), f32(1.0))
    assert set(s0) == {"s"}


def test_unreached_state_whose_init_reads_another_state_is_an_error():
    def fn(p, x):
        t = tx.get_state("t", f32(2.0))
        return lax.cond(p, lambda c: c + tx.get_state("s", t * 3.0), lambda c: c, x)
    with pytest.raises(tx.StateError, match=r"(?s)state 's'.*cond\[branch=1\].*state 't'"):
        tx.uncurry(fn, jnp.array(False), f32(1.0))


def test_unreached_typed_key_state_starts_at_its_init():
    def fn(p, x):
        def draw(c):
            k = tx.get_state("k", jax.random.key(3))
            k, sub = jax.random.split(k)
            tx.set_state("k", k)
            return c + jax.random.normal(sub)
        return lax.cond(p, draw, lambda c: c, x)
    pure, s0 = tx.uncurry(fn, jnp.array(False), f32(1.0))
    np.testing.assert_array_equal(jax.random.key_data(s0["k"]),
                                  jax.random.key_data(jax.random.key(3)))


def test_unreached_state_only_set_starts_at_zeros():
    def fn(p, x):
        return lax.cond(p, lambda c: tx.set_state("s", c * 3.0), lambda c: c, x)
    pure, s0 = tx.uncurry(fn, jnp.array(False), f32(1.0))
    assert_close(s0, {"s": f32(0.0)})


# ---- uncurry inside a traced function (a nested uncurry) ---------------------------------

def test_uncurry_inside_uncurry_keeps_the_outer_unreached_init():
    def inner(x):
        return x + tx.get_state("c", f32(1.0))

    def outer(p, x):
        y = lax.cond(p, lambda c: c + tx.get_state("u", jnp.float32(7.0)), lambda c: c, x)
        pure, s0 = tx.uncurry(inner, x)
        return y + pure(s0, x)[0]
    pure, s0 = tx.uncurry(outer, jnp.array(False), f32(1.0))
    assert_close(s0, {"u": f32(7.0)})


def test_nested_uncurry_with_an_unreached_traced_init_is_a_clear_error():
    def inner(p, x):
        return lax.while_loop(lambda c: p & (c < 3.0),
                              lambda c: c + tx.get_state("s", c * 2.0), x)

    def outer(p, x):
        pure, s0 = tx.uncurry(inner, p, x)
        return pure(s0, p, x)[0]
    with pytest.raises(tx.StateError, match=r"(?s)state 's'.*inside a traced function"):
        tx.uncurry(outer, jnp.array(False), f32(1.0))
    jax_still_works()
    # With a constant init the traced "reached?" flag selects the right value.
    def inner2(p, x):
        return lax.while_loop(lambda c: p & (c < 3.0),
                              lambda c: c + tx.get_state("s", jnp.float32(2.0)), x)

    def outer2(p, x):
        pure, s0 = tx.uncurry(inner2, p, x)
        tx.set_state("s0", s0["s"])
        return pure(s0, p, x)[0]
    pure, s0 = tx.uncurry(outer2, jnp.array(False), f32(1.0))
    for p in (True, False):
        out, s1 = pure(s0, jnp.array(p), f32(0.5))
        assert_close(s1["s0"], f32(2.0))
        assert_close(out, f32(0.5 + 2.0 * 2 if p else 0.5))

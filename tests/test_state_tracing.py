"""Tracing cost of state: what the fast paths do, and that results
stay those of the eager program.

* A callable ``init`` is called once per trace and state (``get_state``
  caches it by code, globals, defaults and closure contents), never shared
  between states nor reused when its closure changed.
* State sites become atom substitutions: the pure program has exactly the
  equations of the same program written with explicit carries.
* ``uncurry`` finds initial values without running the program when every
  state's first use is certain (constant inits directly, inits computed
  from inputs by slicing); otherwise the example run decides, as before.

Programs are compared with the same code run eagerly with Python control
flow and a dict for state (``Eager`` of ``test_state``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import jaxpr_as_fun

import taxpr as tx
from taxpr import _traverse
from helpers import check
from test_state import TX, Eager, assert_close, check_program

f32 = jnp.float32


# ---- callable inits -------------------------------------------------------------------

def _counted(calls: list, value: float, n: int = 2):
    calls.append(value)
    return jnp.full((n,), value, f32)


def test_callable_init_is_called_once_per_trace_and_state():
    calls: list = []

    def h_init():  # a new lambda object every call, same code and closure
        return lambda: _counted(calls, 1.0)

    def prog(S, x):
        for _ in range(5):
            h = S.get("h", h_init())
            S.set("h", h * 0.5 + x)
        for _ in range(3):
            g = S.get("g", lambda: _counted(calls, 2.0))
            S.set("g", g + h)

        def body(c, _):  # a nested trace shares the outer trace's values
            S.set("h", S.get("h", h_init()) + c)
            return c, None
        S.scan(body, x, None, length=2)
        return g + S.get("h", h_init())

    x = jnp.arange(2, dtype=f32)
    tx.make_jaxpr(functools.partial(prog, TX))(x)
    assert calls == [1.0, 2.0]  # one call per state, not one per get_state
    calls.clear()
    check_program(prog, (x,), [(x + 1.0,)])


def test_callable_inits_of_distinct_states_stay_distinct():
    # The same init code for several states (a helper used per layer), with
    # NumPy's global random generator: every state gets its own draw.
    def layer(S, name, x):
        w = S.get(name, lambda: np.random.standard_normal(3).astype(np.float32))
        return jnp.tanh(w * x)

    def prog(S, x):
        for i in range(4):
            x = layer(S, f"w{i}", x)
        return x

    x = jnp.ones(3, f32)
    np.random.seed(0)
    _, state0 = tx.uncurry(functools.partial(prog, TX), x)
    np.random.seed(0)
    ref = Eager()
    prog(ref, x)
    assert_close(state0, ref.first)
    assert len({tuple(np.asarray(v)) for v in state0.values()}) == 4


def test_callable_init_with_changed_closure_is_called_again():
    # Outside uncurry every get_state returns its own init: a lambda whose
    # closure holds another value is not served from the cache.
    def prog(S):
        outs = []
        for i in range(3):
            scale = float(i)
            outs.append(S.get("h", lambda: jnp.full((2,), scale, f32)))
        return jnp.stack(outs)

    got = jax.jit(lambda: prog(TX))()
    want = jnp.stack([jnp.full((2,), float(i), f32) for i in range(3)])
    assert_close(got, want)


def test_callable_init_outside_taxpr_is_called_at_every_get_state():
    # Traced by plain jax.jit (no uncurry) every get_state returns its own
    # init: one reading a mutable object changed in between sees the change.
    cfg = {"v": 0.0}

    def f():
        outs = []
        for i in range(3):
            cfg["v"] = float(i)
            outs.append(tx.get_state("h", lambda: jnp.full((2,), cfg["v"], f32)))
        return jnp.stack(outs)

    want = jnp.stack([jnp.full((2,), float(i), f32) for i in range(3)])
    assert_close(jax.jit(f)(), want)


# ---- sites as substitutions -------------------------------------------------------------

def _eqn_signature(closed) -> list:
    return [(e.primitive.name, tuple(sorted((k, str(v)) for k, v in e.params.items())))
            for e in closed.jaxpr.eqns]


def test_pure_program_has_the_equations_of_explicit_carries():
    steps = 6
    w = jnp.eye(4, dtype=f32) * 0.5
    xs = jnp.ones((steps, 4), f32) * 0.1

    def carried(w, xs, h0):
        h = h0
        for t in range(steps):
            h = jnp.tanh(w @ h + xs[t])
        return h

    def stateful(w, xs):
        for t in range(steps):
            h = tx.get_state("h", lambda: jnp.zeros(4, f32))
            tx.set_state("h", jnp.tanh(w @ h + xs[t]))
        return tx.get_state("h", lambda: jnp.zeros(4, f32))

    pure, _ = tx.make_jaxpr(stateful)(w, xs)
    plain = jax.make_jaxpr(carried)(w, xs, jnp.zeros(4, f32))
    assert _eqn_signature(pure) == _eqn_signature(plain)
    out = jaxpr_as_fun(pure)(jnp.full(4, 0.3, f32), w, xs)
    ref = carried(w, xs, jnp.full(4, 0.3, f32))
    assert_close(out[0], ref)
    assert_close(out[1], ref)


def test_weak_typed_state_values_keep_their_types():
    # A Python-scalar init and set (weak types) take the traced injector,
    # which casts them to the state's type: results as eager.
    def prog(S, x):
        a = S.get("a", 1.5)
        S.set("a", 2.0)
        S.set("b", S.get("b", jnp.zeros((), f32)) + a * x)
        return S.get("a", 0.0) + x

    check_program(prog, (jnp.float32(1.0),), [(jnp.float32(3.0),)])


# ---- uncurry's initial values -----------------------------------------------------------

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


def test_make_jaxpr_drops_what_callable_inits_computed():
    # make_jaxpr traces a callable init into the program (cheaper than
    # evaluating it inside a trace); the pure program takes every state as
    # an input, so the state pass drops the init's equations.
    def prog(w, xs):
        def body(_, x):
            inp = x
            for i in range(3):
                inp = jnp.tanh(w @ tx.get_state(f"h{i}", lambda: jnp.zeros(4)) + inp)
                tx.set_state(f"h{i}", inp)
            return None, None
        lax.scan(body, None, xs)
        return tx.get_state("h2", lambda: jnp.zeros(4) + 1.0)

    def explicit(h0, h1, h2, w, xs):
        def body(hs, x):
            h0 = jnp.tanh(w @ hs[0] + x)
            h1 = jnp.tanh(w @ hs[1] + h0)
            return (h0, h1, jnp.tanh(w @ hs[2] + h1)), None
        hs, _ = lax.scan(body, (h0, h1, h2), xs)
        return hs[2], *hs

    w, xs = jnp.eye(4, dtype=f32) * 0.5, jnp.ones((3, 4), f32)
    pure, infos = tx.make_jaxpr(prog)(w, xs)
    want = jax.make_jaxpr(explicit)(*(jnp.zeros(4, f32),) * 3, w, xs)
    names = lambda j: [e.primitive.name for e, _ in _traverse.iter_eqns(j)]  # noqa: E731
    assert names(pure) == names(want)
    check(pure)
    # the init's effects are not dropped
    def printing(x):
        def init():
            jax.debug.print("init")
            return jnp.zeros(())
        tx.set_state("s", tx.get_state("s", init) + x)
        return x
    assert {"debug_callback", "debug_print"} & set(names(tx.make_jaxpr(printing)(f32(1.0))[0]))


def _leak_cases():
    def straight(x):
        a = tx.get_state("a", lambda: jnp.zeros(3))
        tx.set_state("a", a + x)
        return a.sum()

    def closes_over_an_argument(x):  # the init closes over a tracer
        return x + tx.get_state("z", lambda: x * 0)

    def closes_over_traced_params(x):  # ... inside a dict
        params = {"w": x}
        return x + tx.get_state("z", lambda: params["w"] * 0)

    def in_a_scan_body(x):
        def body(c, _):
            tx.set_state("z", tx.get_state("z", lambda: c * 0) + c)
            return c + 1.0, None
        return jax.lax.scan(body, x, None, length=2)[0]

    return {"straight": straight, "argument": closes_over_an_argument,
            "params": closes_over_traced_params, "scan": in_a_scan_body}


@pytest.mark.parametrize("case", sorted(_leak_cases()))
@pytest.mark.parametrize("how", ["make_jaxpr", "uncurry", "make_jaxpr_of_jit"])
def test_callable_inits_leak_no_tracer_under_jax_checking_leaks(case, how):
    # The per-trace cache of init values held tracers (JAX's leak checker
    # reported them when the trace ended); the results are those computed
    # without the checker.
    fn = _leak_cases()[case]
    fn = jax.jit(fn) if how == "make_jaxpr_of_jit" else fn
    x = jnp.arange(3, dtype=f32)

    def run():
        if how == "uncurry":
            pure, state0 = tx.uncurry(fn, x)
            return pure(state0, x)
        jaxpr, states = tx.make_jaxpr(fn)(x)
        check(jaxpr)
        return str(jaxpr), [(s.name, s.shape, s.dtype) for s in states]

    want = run()
    with jax.checking_leaks():
        got = run()
    if how == "uncurry":
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1][next(iter(want[1]))], want[1][next(iter(want[1]))])
    else:
        assert got == want

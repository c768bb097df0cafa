"""Every effect inside a custom derivative rule's function, differentiated
from outside: a state counter, a state set from the differentiated value, a
key drawn, a value sown and reaped, a value planted, inside a
``custom_jvp`` (its rule calls the function) or a ``custom_vjp`` (its fwd
calls the function), called twice in a chain or three times in a
``lax.scan``, differentiated by ``grad``, ``vjp`` or ``jvp`` (``jvp``: the
custom_jvp only, as JAX), with and without ``jit``.

The reference is the program run eagerly in Python with NumPy (float64)
and a dict: each call of the function does its effect once, and the
derivative is the rule's (``2 cos(x)`` for ``2 sin(x)``) chained by hand.
A state a rule writes is a constant with respect to the function's inputs
(a rule runs on primal values: docs/state.md), so the accumulated state's
derivative is 0 under a ``custom_jvp``; under a ``custom_vjp``, whose fwd
runs in the function's place, asking for it is taxpr's documented error
(docs/limitations.md), which the case asserts. A float state one
``custom_vjp`` call sets and the next reads has a tangent in JAX's eyes
(every float output of a custom_vjp call does): taxpr's documented error
(docs/limitations.md), which the case asserts, also where no derivative is
asked of the state (an integer count has none, and differentiates).

The everyday share runs a fixed sample of the cases; ``TAXPR_RULE_EFFECTS=all``
runs every case."""

from __future__ import annotations

import itertools
import os
import random
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx
from taxpr import harvest as h

KINDS = ("custom_jvp", "custom_vjp")
EFFECTS = ("counter", "float_counter", "accumulated", "key", "sow", "plant")
CONTAINERS = ("chain", "scan")
DERIVATIVES = ("grad", "vjp", "jvp")
X0, PLANTED, NOISE = 0.7, 0.3, 0.1
CALLS = {"chain": 2, "scan": 3}


class Case(NamedTuple):
    kind: str
    effect: str
    container: str
    derivative: str
    jit: bool

    @property
    def id(self) -> str:
        return "-".join([*self[:4], "jit" if self.jit else "eager"])


def _cases() -> list[Case]:
    cases = [Case(*c) for c in itertools.product(KINDS, EFFECTS, CONTAINERS, DERIVATIVES,
                                                  (False, True))
             if not (c[0] == "custom_vjp" and c[3] == "jvp")]
    if os.environ.get("TAXPR_RULE_EFFECTS") == "all":
        return cases
    return random.Random(0).sample(cases, 24)


# ---- the program, with taxpr ---------------------------------------------------

def _body(effect: str, x):
    """``2 sin(x)`` (``2 p`` planted, plus noise for ``key``) with the effect."""
    if effect == "counter":  # an integer count: no derivative
        tx.set_state("n", tx.get_state("n", jnp.zeros((), jnp.int32)) + 1)
    elif effect == "float_counter":  # a float count: JAX differentiates it after a custom_vjp
        tx.set_state("n", tx.get_state("n", jnp.zeros(())) + 1.0)
    elif effect == "accumulated":
        tx.set_state("acc", tx.get_state("acc", jnp.zeros(())) + jnp.sin(x))
    elif effect in ("sow", "plant"):
        return 2.0 * h.sow(jnp.sin(x), tag="fz", name="s", mode="clobber")
    elif effect == "key":
        return 2.0 * jnp.sin(x) + NOISE * jax.random.normal(tx.next_key())
    return 2.0 * jnp.sin(x)


def _activation(kind: str, effect: str):
    if kind == "custom_jvp":
        @jax.custom_jvp
        def act(x):
            return _body(effect, x)

        @act.defjvp
        def act_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            return act(x), 2.0 * jnp.cos(x) * t  # the rule calls the function
        return act

    @jax.custom_vjp
    def act(x):
        return _body(effect, x)

    def fwd(x):
        return act(x), x  # the fwd calls the function

    def bwd(x, g):
        return (2.0 * jnp.cos(x) * g,)
    act.defvjp(fwd, bwd)
    return act


def _program(case: Case):
    act = _activation(case.kind, case.effect)
    if case.container == "chain":
        return lambda x: act(act(x))
    return lambda x: lax.scan(lambda c, _: (act(c), None), x, None,
                              length=CALLS["scan"])[0]


# ---- the reference: eager, NumPy float64, a dict --------------------------------

def _reference(case: Case, x: float) -> dict:
    """The output, its derivative (the rule's, chained), the states and the
    reaped value, as eager Python computes them."""
    state = {"n": 0, "acc": 0.0}
    key = jax.random.key(0)  # the stream's initial key (tx.next_key's default)
    c, dc, reaped = np.float64(x), 1.0, None
    for _ in range(CALLS[case.container]):
        if case.effect == "key":
            key, sub = jax.random.split(key)
            noise = float(jax.random.normal(sub))
        y = 2.0 * np.sin(c)
        if case.effect in ("counter", "float_counter"):
            state["n"] += 1
        elif case.effect == "accumulated":
            state["acc"] += np.sin(c)
        elif case.effect == "sow":
            reaped = np.sin(c)
        elif case.effect == "plant":
            y = 2.0 * PLANTED
        elif case.effect == "key":
            y = y + NOISE * noise
        c, dc = y, 2.0 * np.cos(c) * dc  # the rule's derivative, whatever the value
    return {"out": c, "d_out": dc, "state": state, "reaped": reaped, "key": key}


# ---- running a case with taxpr ---------------------------------------------------

def _differentiate(case: Case, f):
    """``(value, derivative at X0)`` of the scalar function ``f``."""
    if case.derivative == "grad":
        run = lambda x: jax.value_and_grad(f, has_aux=True)(x)  # noqa: E731
    elif case.derivative == "vjp":
        def run(x):
            value, pullback, aux = jax.vjp(f, x, has_aux=True)
            return (value, aux), pullback(jnp.ones_like(value))[0]
    else:
        def run(x):
            value, t, aux = jax.jvp(f, (x,), (jnp.ones_like(x),), has_aux=True)
            return (value, aux), t
    return jax.jit(run) if case.jit else run


def _assert_close(got, want, what: str) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-6,
                               err_msg=what)


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_an_effect_in_a_custom_rules_function_differentiated_from_outside(case: Case):
    want = _reference(case, X0)
    program = _program(case)
    x = jnp.float32(X0)
    if case.effect in ("counter", "float_counter", "accumulated", "key"):
        pure, state0 = tx.uncurry(program, x)

        def f(x):
            out, state = pure(state0, x)
            return out, state
        if case.kind == "custom_vjp" and case.effect in ("accumulated", "float_counter"):
            name = "acc" if case.effect == "accumulated" else "n"
            with pytest.raises((tx.StateError, NotImplementedError), match=f"state '{name}'"):
                _differentiate(case, f)(x)
            return
        (value, state), d = _differentiate(case, f)(x)
        _assert_close(value, want["out"], f"{case.id}: the value")
        _assert_close(d, want["d_out"], f"{case.id}: the derivative")
        if case.effect in ("counter", "float_counter"):
            assert float(state["n"]) == want["state"]["n"], (case.id, state["n"])
        elif case.effect == "accumulated":
            _assert_close(state["acc"], want["state"]["acc"], f"{case.id}: the state")

            def f_acc(x):
                out, state = pure(state0, x)
                return state["acc"], out
            (_, _), d_acc = _differentiate(case, f_acc)(x)
            # what a rule writes is a constant w.r.t. the function's inputs
            _assert_close(d_acc, 0.0, f"{case.id}: the state's derivative")
        else:
            np.testing.assert_array_equal(jax.random.key_data(state["rng"]),
                                          jax.random.key_data(want["key"]),
                                          err_msg=f"{case.id}: the stream's key")
        return
    if case.effect == "sow":
        def f(x):
            return h.call_and_reap(program, tag="fz")(x)
    else:
        def f(x):
            return h.plant(program, tag="fz")({"s": jnp.float32(PLANTED)}, x), {}
    (value, reaps), d = _differentiate(case, f)(x)
    _assert_close(value, want["out"], f"{case.id}: the value")
    _assert_close(d, want["d_out"], f"{case.id}: the derivative")
    if case.effect == "sow":
        _assert_close(reaps["s"], want["reaped"], f"{case.id}: the reaped value")

"""Every effect inside a custom derivative rule's function, differentiated:
a state counter, a state set from the differentiated value, a key drawn, a
value sown and reaped, a value planted, a site patched by a function or by
a value, a site captured; inside a ``custom_jvp`` (its rule calls the
function) or a ``custom_vjp`` (its fwd calls the function), called twice in
a chain, three times in a ``lax.scan``, three times in a ``lax.scan``
whose body is a ``jax.checkpoint`` (recomputed when differentiated), or
three times in equinox's checkpointed ``while_loop`` (a custom_vjp whose
fwd and bwd evaluate the body's code; its bwd recomputes the body under
``jax.vjp``);
differentiated by ``grad``, ``vjp`` or ``jvp`` (``jvp``: the custom_jvp
only, as JAX), from outside the transformed function or inside it, with
and without ``jit``, for one input or a ``vmap`` batch of two.

The reference is the program run eagerly in Python with NumPy (float64)
and a dict: each call of the function does its effect once, and the
derivative is the rule's (``2 cos(x)`` for ``2 sin(x)``) chained by hand:
the rule is what JAX differentiates, whatever the function's value (a
patch or a plant changes the value, not the rule). A state a rule writes
is a constant with respect to the function's inputs (a rule runs on primal
values: docs/state.md), so the accumulated state's derivative is 0 under a
``custom_jvp``; under a ``custom_vjp``, whose fwd runs in the function's
place, asking for it from outside is taxpr's documented error
(docs/limitations.md), which the case asserts. A float state one
``custom_vjp`` call sets and the next reads has a tangent in JAX's eyes
(every float output of a custom_vjp call does): from outside, taxpr's
documented error (docs/limitations.md), which the case asserts, also where
no derivative is asked of the state. A site patched by value inside a
scan gets one row per iteration, which the rule's own call of the function
cannot be given: from outside, taxpr's documented error, which the case
asserts.

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
EFFECTS = ("counter", "float_counter", "accumulated", "key", "sow", "plant",
           "patch_fn", "patch_value", "capture")
STATE_EFFECTS = ("counter", "float_counter", "accumulated", "key")
CONTAINERS = ("chain", "scan", "remat_scan", "checkpointed_while")
DERIVATIVES = ("grad", "vjp", "jvp")
WHERE = ("outside", "inside")
X0, PLANTED, NOISE, SHIFT = 0.7, 0.3, 0.1, 0.25
XS = (0.7, -0.4)  # a vmap batch
CALLS = {"chain": 2, "scan": 3, "remat_scan": 3, "checkpointed_while": 3}


class Case(NamedTuple):
    kind: str
    effect: str
    container: str
    derivative: str
    where: str
    jit: bool
    batch: bool

    @property
    def id(self) -> str:
        return "-".join([*self[:5], "jit" if self.jit else "eager",
                         "vmap" if self.batch else "one"])


def _cases() -> list[Case]:
    cases = [Case(*c) for c in itertools.product(KINDS, EFFECTS, CONTAINERS, DERIVATIVES,
                                                  WHERE, (False, True), (False, True))
             if not ((c[0] == "custom_vjp" or c[2] == "checkpointed_while")
                     and c[3] == "jvp")]
    if os.environ.get("TAXPR_RULE_EFFECTS") == "all":
        return cases
    return random.Random(0).sample(cases, 32)


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
    elif effect in ("patch_fn", "patch_value", "capture"):  # the site: sin
        return 2.0 * jnp.sin(x)
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
    if case.container == "checkpointed_while":
        # equinox's checkpointed while_loop: a custom_vjp whose fwd and bwd
        # evaluate the closure-converted body (the bwd under jax.vjp)
        import equinox.internal as eqxi

        def loop(x):
            step = lambda c: (c[0] + 1, act(c[1]))  # noqa: E731
            return eqxi.while_loop(lambda c: c[0] < CALLS[case.container], step, (0, x),
                                   max_steps=CALLS[case.container], kind="checkpointed",
                                   checkpoints=2)[1]
        return loop
    body = lambda c, _: (act(c), None)  # noqa: E731
    if case.container == "remat_scan":
        body = jax.checkpoint(body)
    return lambda x: lax.scan(body, x, None, length=CALLS[case.container])[0]


# ---- the reference: eager, NumPy float64, a dict --------------------------------

def _reference(case: Case, x: float) -> dict:
    """The output, its derivative (the rule's, chained), the states and the
    reaped value, as eager Python computes them."""
    state = {"n": 0, "acc": 0.0}
    key = jax.random.key(0)  # the stream's initial key (tx.next_key's default)
    c, dc, reaped, captured = np.float64(x), 1.0, None, []
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
        elif case.effect == "patch_fn":
            y = 2.0 * (np.sin(c) + SHIFT)
        elif case.effect == "patch_value":
            y = 2.0 * PLANTED
        elif case.effect == "capture":
            captured.append(np.sin(c))
            if case.container == "checkpointed_while":  # a while loop keeps the last
                captured = captured[-1:]
        c, dc = y, 2.0 * np.cos(c) * dc  # the rule's derivative, whatever the value
    return {"out": c, "d_out": dc, "state": state, "reaped": reaped, "key": key,
            "captured": captured}


# ---- running a case with taxpr ---------------------------------------------------

def _with_derivative(case: Case, f):
    """``x -> ((value, aux), derivative)`` of ``f: x -> (scalar, aux)``."""
    if case.derivative == "grad":
        return lambda x: jax.value_and_grad(f, has_aux=True)(x)  # noqa: E731

    if case.derivative == "vjp":
        def run(x):
            value, pullback, aux = jax.vjp(f, x, has_aux=True)
            return (value, aux), pullback(jnp.ones_like(value))[0]
        return run

    def run(x):
        value, t, aux = jax.jvp(f, (x,), (jnp.ones_like(x),), has_aux=True)
        return (value, aux), t
    return run


def _transformed(case: Case, g):
    """``x -> (g(x), aux)``: ``g`` with taxpr's transformation of the case's
    effect (aux: the states, the reaped or captured values)."""
    sin = tx.select.primitive("sin")
    if case.effect in STATE_EFFECTS:
        pure, state0 = tx.uncurry(g, jnp.float32(X0))
        return lambda x: pure(state0, x)  # noqa: E731
    if case.effect == "sow":
        return h.call_and_reap(g, tag="fz")
    if case.effect == "plant":
        return lambda x: (h.plant(g, tag="fz")({"s": jnp.float32(PLANTED)}, x), {})  # noqa: E731
    if case.effect == "patch_fn":
        return lambda x: (tx.patch(g, {sin: lambda v: v + SHIFT})(x), {})  # noqa: E731
    if case.effect == "patch_value":
        # inside a scan: one value per iteration
        value = (jnp.float32(PLANTED) if case.container in ("chain", "checkpointed_while")
                 else jnp.full((CALLS[case.container],), PLANTED, jnp.float32))
        return lambda x: (tx.patch(g, {sin: value})(x), {})  # noqa: E731
    return tx.capture(g, sin)


def _run(case: Case, f=None):
    """``((value, aux), derivative)`` at the case's input(s); ``f``: what is
    differentiated from outside (default: the transformed program)."""
    program = _program(case)
    if case.where == "outside":
        run = _with_derivative(case, f or _transformed(case, program))
    else:
        differentiated = _with_derivative(case, lambda x: (program(x), ()))
        inner = _transformed(case, lambda x: (lambda r: (r[0][0], r[1]))(differentiated(x)))

        def run(x):
            (value, d), aux = inner(x)
            return (value, aux), d
    if case.batch:
        run = jax.vmap(run)
    if case.jit:
        run = jax.jit(run)
    return run(jnp.array(XS, jnp.float32) if case.batch else jnp.float32(X0))


def _assert_close(got, want, what: str) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-6,
                               err_msg=what)


def _stacked(case: Case, what: str):
    """The reference's ``what``, per example under ``vmap``."""
    if not case.batch:
        return _reference(case, X0)[what]
    return np.stack([np.asarray(_reference(case, x)[what], np.float64) for x in XS])


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_an_effect_in_a_custom_rules_function_differentiated(case: Case):
    outside = case.where == "outside"
    in_loop_rule = case.container == "checkpointed_while"
    if (outside and case.kind == "custom_vjp" and not in_loop_rule
            and case.effect in ("accumulated", "float_counter")):
        name = "acc" if case.effect == "accumulated" else "n"
        with pytest.raises((tx.StateError, NotImplementedError), match=f"state '{name}'"):
            _run(case)
        return
    if outside and case.effect == "patch_value" and case.container in ("scan", "remat_scan"):
        # Patched by value in a scan: one row per iteration, fed to the
        # function; the rule's own call of the function cannot be given its
        # row: taxpr's documented error (docs/limitations.md), never the
        # unpatched value.
        with pytest.raises(NotImplementedError, match=r"the site 'sin', planted with one value "
                                                      r"per sow .* the rule calls the function"):
            _run(case)
        return
    if in_loop_rule and case.effect == "key" and not (case.batch and outside):
        # The loop's bwd recomputes the forward pass from checkpoints, in an
        # order of its own: what a recomputed draw would read is taxpr's
        # documented error (docs/limitations.md), naming the stream.
        with pytest.raises(tx.StateError, match=r"state 'rng'.* recomputes the forward pass"):
            _run(case)
        return
    if case.effect == "key" and case.batch:
        # One unbatched key for every example: taxpr's documented error
        # (docs/random.md), which names the stream.
        with pytest.raises(tx.StateError, match=r"next_key\('rng'\) runs under jax.vmap "
                                                r"without an axis name"):
            _run(case)
        return
    (value, aux), d = _run(case)
    _assert_close(value, _stacked(case, "out"), f"{case.id}: the value")
    _assert_close(d, _stacked(case, "d_out"), f"{case.id}: the derivative")
    want = _reference(case, X0)
    if case.effect in ("counter", "float_counter"):
        np.testing.assert_array_equal(np.asarray(aux["n"]), want["state"]["n"],
                                      err_msg=f"{case.id}: the count")
    elif case.effect == "accumulated":
        _assert_close(aux["acc"], np.asarray([_reference(case, x)["state"]["acc"] for x in XS])
                      if case.batch else want["state"]["acc"], f"{case.id}: the state")
        if outside:
            def f_acc(x):
                out, state = _transformed(case, _program(case))(x)
                return state["acc"], out
            if in_loop_rule:
                # The loop's fwd runs in the function's place and its bwd
                # gives derivatives of its outputs only: taxpr's documented
                # error (docs/limitations.md), naming the state.
                with pytest.raises(tx.StateError, match="state 'acc'"):
                    _run(case, f_acc)
                return
            (_, _), d_acc = _run(case, f_acc)
            # what a rule writes is a constant w.r.t. the function's inputs
            _assert_close(d_acc, np.zeros_like(np.asarray(d_acc)), f"{case.id}: the state's derivative")
    elif case.effect == "key":
        keys = np.asarray(jax.random.key_data(aux["rng"]))
        want_key = np.asarray(jax.random.key_data(want["key"]))
        np.testing.assert_array_equal(keys, np.broadcast_to(want_key, keys.shape),
                                      err_msg=f"{case.id}: the stream's key")
    elif case.effect == "sow":
        _assert_close(aux["s"], _stacked(case, "reaped"), f"{case.id}: the reaped value")
    elif case.effect == "capture":
        if in_loop_rule and not outside:
            # The differentiated program computes sin in the loop's forward
            # pass and again in its bwd's recomputation: the forward site
            # holds the eager value.
            assert any("bwd" in name for name in aux), list(aux)
            aux = {name: v for name, v in aux.items() if "fwd" in name}
        rows = [np.asarray(v, np.float64).reshape((len(XS), -1) if case.batch else (-1,))
                for v in aux.values()]
        _assert_close(np.concatenate(rows, axis=-1), _stacked(case, "captured"),
                      f"{case.id}: the captured values ({list(aux)})")

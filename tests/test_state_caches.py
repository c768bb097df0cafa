"""Results never depend on JAX's trace caches.

JAX caches the traces of jitted functions, scan/while/cond bodies,
checkpointed functions and custom_jvp/custom_vjp functions by function
identity. taxpr traces user code in keep mode (``keep_tags()``); keep mode
is part of JAX's trace context, so a trace cached by an earlier plain call
(``jax.jit(g)(...)``, an eager call, ``jax.make_jaxpr(g)``) is never reused
by ``uncurry`` / ``tx.make_jaxpr`` / ``reap`` / ``plant``.

Each program is built once (``make(S)``: its inner functions keep their
identity), warmed up, then transformed, and compared with the same program
run eagerly with Python control flow and a dict for state (``Eager``).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.extend.core import jaxpr_as_fun

import taxpr as tx
from taxpr import harvest as h

from helpers import check
from test_state import TX, Eager, assert_close, assert_states

f32, i32 = jnp.float32, jnp.int32


def _bump(S, y):
    """The effect every case has: count calls, remember ``y``."""
    S.set("n", S.get("n", jnp.zeros((), i32)) + 1)
    S.set("last", y)


def make_jit(S):
    @S.jit
    def inner(x, y):
        _bump(S, y)
        return jnp.sin(x) * 2.0
    return inner


def make_scan(S):
    def body(c, y):
        _bump(S, y)
        return c * 1.5 + jnp.sin(c), None
    return lambda x, y: S.scan(body, x, jnp.stack([y, y + 1.0, y + 2.0]))[0]


def make_while(S):
    def cond(v):
        return v[0] < 3

    def body(v):
        _bump(S, v[2])
        return v[0] + 1, v[1] * 1.5, v[2] + 1.0
    return lambda x, y: S.while_loop(cond, body, (jnp.zeros((), i32), x, y))[1]


def make_fori(S):
    def body(i, c):
        _bump(S, c[1])
        return c[0] * 0.5 + jnp.cos(c[0]), c[1] + 1.0
    return lambda x, y: S.fori_loop(0, 3, body, (x, y))[0]


def make_cond(S):
    def yes(x, y):
        _bump(S, y)
        return jnp.sin(x)

    def no(x, y):
        return x * 3.0
    return lambda x, y: S.cond(y > 0, yes, no, x, y)


def make_checkpoint(S):
    def g(x, y):
        _bump(S, y)
        return jnp.sin(x) * jnp.cos(x)
    return S.checkpoint(g)


def make_custom_jvp(S):
    @jax.custom_jvp
    def f(x, y):
        _bump(S, y)
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        x, y = primals
        return f(x, y), jnp.cos(x) * tangents[0]
    return f


def make_custom_vjp(S):
    @jax.custom_vjp
    def f(x, y):
        _bump(S, y)
        return jnp.sin(x)

    def fwd(x, y):
        return f(x, y), (x, y)

    def bwd(res, g):
        return jnp.cos(res[0]) * g, jnp.zeros_like(res[1])
    f.defvjp(fwd, bwd)
    return f


MAKERS = {"jit": make_jit, "scan": make_scan, "while": make_while, "fori": make_fori,
          "cond": make_cond, "checkpoint": make_checkpoint, "custom_jvp": make_custom_jvp,
          "custom_vjp": make_custom_vjp}


def _program(make, S, under_grad: bool):
    fn = make(S)
    if under_grad:
        # while_loop has no reverse mode: differentiate it forward.
        diff = jax.jacfwd if make is make_while else jax.grad
        return lambda x, y: diff(fn)(x, y)
    return fn


def _warm(fn, how: str, x, y, warns: bool = True):
    """Run ``fn`` as users do before transforming it. Run or compiled
    without uncurry, a set_state is lost, and taxpr says so where ``warns``
    (tracing with make_jaxpr loses nothing and says nothing)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tx.StateNotUncurriedWarning)
        if how == "jit":
            jax.block_until_ready(jax.jit(fn)(x, y))
        elif how == "eager":
            jax.block_until_ready(fn(x, y))
        else:
            jax.make_jaxpr(fn)(x, y)
    assert all(issubclass(w.category, tx.StateNotUncurriedWarning) for w in caught), caught
    assert bool(caught) == (warns and how != "make_jaxpr"), caught


def _warns(case: str, warm: str, under_grad: bool) -> bool:
    # A set_state inside a custom derivative rule that jit differentiates
    # runs in JAX's own trace of the rule, which taxpr does not see.
    return not (case in ("custom_jvp", "custom_vjp") and warm == "jit" and under_grad)


X, Y = f32(0.7), f32(2.0)


@pytest.mark.parametrize("under_grad", [False, True], ids=["plain", "grad"])
@pytest.mark.parametrize("warm", ["jit", "eager", "make_jaxpr"])
@pytest.mark.parametrize("case", sorted(MAKERS))
def test_uncurry_after_warm_up_matches_eager(case, warm, under_grad):
    fn = _program(MAKERS[case], TX, under_grad)
    _warm(fn, warm, X, Y, warns=_warns(case, warm, under_grad))
    pure, s0 = tx.uncurry(fn, X, Y)
    ref = Eager()
    _program(MAKERS[case], ref, under_grad)(X, Y)
    assert_close(s0, ref.first)
    for args in ((X, Y), (f32(-0.3), f32(5.0))):
        out, s1 = pure(s0, *args)
        ref = Eager(s0)
        want = _program(MAKERS[case], ref, under_grad)(*args)
        assert_close(out, want)
        assert_states(s1, ref.state, like=s0)
    # The effect happened exactly as often as eagerly (not lost, not doubled).
    assert int(s1["n"]) == int(ref.state["n"]) >= 1


@pytest.mark.parametrize("under_grad", [False, True], ids=["plain", "grad"])
@pytest.mark.parametrize("warm", ["jit", "eager", "make_jaxpr"])
@pytest.mark.parametrize("case", sorted(MAKERS))
def test_make_jaxpr_after_warm_up_threads_every_state(case, warm, under_grad):
    fn = _program(MAKERS[case], TX, under_grad)
    _warm(fn, warm, X, Y, warns=_warns(case, warm, under_grad))
    jaxpr, infos = tx.make_jaxpr(fn)(X, Y)
    check(jaxpr)
    assert [s.name for s in infos] == ["last", "n"]
    assert all(s.written for s in infos)
    assert list(tx.iter_tags(jaxpr)) == []  # no state access left as a tag
    start = {"last": f32(0.0), "n": i32(10)}
    *outs, last, n = jaxpr_as_fun(jaxpr)(start["last"], start["n"], X, Y)
    ref = Eager(start)
    want = _program(MAKERS[case], ref, under_grad)(X, Y)
    assert_close(outs[0], want)
    assert_states({"last": last, "n": n}, ref.state)


def make_sowing(S):
    """A scan whose body sows (append) and counts (clobber)."""
    def body(c, y):
        h.sow(c * y, tag="t", name="rows", mode="append")
        h.sow(y, tag="t", name="lastc", mode="clobber")
        return c * 0.5 + jnp.sin(c), None
    return lambda x, y: S.scan(body, x, jnp.stack([y, y + 1.0, y + 2.0]))[0]


def _sow_reference(x, y):
    """The sown values, with Python control flow."""
    c, rows = float(x), []
    for yi in (float(y), float(y) + 1.0, float(y) + 2.0):
        rows.append(c * yi)
        c = c * 0.5 + np.sin(c)
    return {"rows": np.array(rows, np.float32), "lastc": np.float32(float(y) + 2.0)}


@pytest.mark.parametrize("under_grad", [False, True], ids=["plain", "grad"])
@pytest.mark.parametrize("warm", ["jit", "eager", "make_jaxpr"])
def test_reap_and_plant_after_warm_up_match_eager(warm, under_grad):
    fn = _program(make_sowing, TX, under_grad)
    _warm(fn, warm, X, Y, warns=False)  # no state
    reaped = h.reap(fn, tag="t")(X, Y)
    assert_close(reaped, _sow_reference(X, Y))
    # Planting the rows changes nothing else; planting "lastc" is a no-op on
    # the output (it is not used), and both sows are found once warm.
    planted = h.plant(fn, tag="t")({"rows": jnp.zeros(3), "lastc": f32(0.0)}, X, Y)
    assert_close(planted, fn(X, Y))
    _, reaped2 = h.call_and_reap(fn, tag="t")(X, Y)
    assert_close(reaped2, reaped)

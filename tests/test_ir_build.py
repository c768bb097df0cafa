"""taxpr.ir: building jaxprs from equations, and inlining jit calls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from taxpr import _compat, _jaxpr, _traverse, ir

from ir_helpers import assert_bitwise, check, run


def _names(j):
    return [e.primitive.name for e, _ in _traverse.iter_eqns(j)]


def test_eqns_to_jaxpr_has_the_effects_of_its_equations(capfd):
    def f(x):
        jax.debug.print("x={x}", x=x)
        return jnp.sin(x) * 2.0

    j = jax.make_jaxpr(f)(jnp.float32(1.0))
    eqns = _jaxpr.jaxpr_parts(j).eqns
    built = ir.eqns_to_jaxpr(eqns)
    check(built)
    assert set(built.effects) == set(j.effects) and built.effects
    assert len(built.invars) == 1 and len(built.outvars) == 1
    closed = ir.eqns_to_closed_jaxpr(eqns)
    check(closed)
    out = run(closed, np.float32(0.5), jit=False)
    jax.effects_barrier()
    assert "x=0.5" in capfd.readouterr().out
    assert_bitwise(out, run(j, np.float32(0.5), jit=False))


def test_eqns_to_jaxpr_defaults_and_explicit_vars():
    j = jax.make_jaxpr(lambda x, y: (x * y + 1.0, jnp.cos(x)))(jnp.float32(1.0), jnp.float32(2.0))
    eqns = _jaxpr.jaxpr_parts(j).eqns
    built = ir.eqns_to_jaxpr(eqns[:1])  # x * y
    assert built.invars == list(j.jaxpr.invars if not _compat.MERGED_JAXPR else j.invars)
    assert built.outvars == [eqns[0].outvars[0]]
    x, y = _jaxpr.jaxpr_parts(j).invars
    closed = ir.eqns_to_closed_jaxpr(eqns, invars=[x], consts=[np.float32(3.0)])
    check(closed)
    assert_bitwise(run(closed, np.float32(2.0)), run(j, np.float32(2.0), np.float32(3.0)))
    closed2 = ir.eqns_to_closed_jaxpr(eqns, consts={y: np.float32(3.0)})
    assert_bitwise(run(closed2, np.float32(2.0)), run(closed, np.float32(2.0)))


def test_inline_jit_at_any_depth_keeps_every_call_and_effect(capfd):
    @jax.jit
    def g(x):
        jax.debug.print("g {x}", x=x)
        return jax.jit(jnp.sin)(x) * 2.0

    def f(x):
        def body(c, _):
            return g(c) + g(c), None
        return lax.scan(body, x, None, length=2)[0] + g(x)

    j = jax.make_jaxpr(f)(jnp.float32(0.25))
    o = ir.inline_jit(j)
    check(o)
    assert "jit" not in _names(o) and "pjit" not in _names(o)
    assert _names(o).count("debug_print") + _names(o).count("debug_callback") == 3
    capfd.readouterr()
    got = run(o, np.float32(0.25), jit=False)
    jax.effects_barrier()
    printed = capfd.readouterr().out.count("g ")
    want = run(j, np.float32(0.25), jit=False)
    jax.effects_barrier()
    assert printed == 5 and capfd.readouterr().out.count("g ") == 5
    assert_bitwise(got, want)


def test_inline_jit_keeps_jits_whose_shardings_or_donation_would_be_lost():
    donating = jax.jit(lambda x: x * 2.0, donate_argnums=0)
    dev = jax.devices("cpu")[0]
    sharded = jax.jit(lambda x: x + 1.0,
                      out_shardings=jax.sharding.SingleDeviceSharding(dev))
    plain = jax.jit(lambda x: x - 1.0)
    j = jax.make_jaxpr(lambda x: sharded(donating(plain(x))))(jnp.ones(3, jnp.float32))
    o = ir.inline_jit(j)
    check(o)
    assert [e.primitive.name for e in _jaxpr.jaxpr_parts(o).eqns].count(
        _jaxpr.jaxpr_parts(j).eqns[0].primitive.name) == 2
    assert_bitwise(run(o, np.ones(3, np.float32)), run(j, np.ones(3, np.float32)))


def test_inline_jit_predicate_selects_calls():
    a = jax.jit(jnp.sin)
    b = jax.jit(jnp.cos)
    j = jax.make_jaxpr(lambda x: a(x) + b(x))(jnp.float32(1.0))
    o = ir.inline_jit(j, predicate=lambda e: e.params["name"] == "sin")
    check(o)
    top = [e.primitive.name for e in _jaxpr.jaxpr_parts(o).eqns]
    assert "sin" in top and "cos" not in top and len(top) == 3

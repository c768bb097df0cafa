"""``taxpr._compat`` detects JAX's behaviour, not its version: each feature
test is checked here against what the installed JAX actually does."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
from jax._src.interpreters import ad, partial_eval as pe
from jax.extend.core import Primitive, jaxpr_as_fun

import taxpr as tx
from taxpr import _compat, _jaxpr

TAXPR = Path(tx.__file__).resolve().parent


def test_no_module_compares_jax_versions():
    for path in sorted(TAXPR.rglob("*.py")):
        text = path.read_text()
        assert "JAX_VERSION" not in text, path
        if path.name != "_compat.py":
            assert "jax.__version__" not in text and "__version_info__" not in text, path


def test_detected_dce_rule_arity_is_that_of_every_rule_jax_registers():
    arities = {p.name: _compat._positional_arity(rule) for p, rule in pe.dce_rules.items()}
    expected = 3 if _compat.DCE_RULES_TAKE_LIVE_INPUTS else 2
    assert arities and set(arities.values()) == {expected}, arities
    # A kept tag (traced as taxpr's transformations trace) stays through
    # pe.dce_jaxpr.
    with tx.keep_tags():
        closed = jax.make_jaxpr(lambda x: (tx.tag(x, op="unused"), x)[1])(1.0)
    open_jaxpr, _ = _jaxpr.open_with_constvars(closed)
    pruned, _ = pe.dce_jaxpr(open_jaxpr, [True])
    assert [e.params["op"] for e in pruned.eqns if e.primitive is tx.tag_p] == ["unused"]


def test_detected_linearization_shape_is_that_of_jax_own_rules():
    out = ad.primitive_linearizations[jax.lax.sin_p](False, [True], jnp.float32(1.0),
                                                     accuracy=None)
    assert len(out) == (5 if _compat.LINEARIZE_STRUCTURED_RESIDUALS else 4)
    # grad through a tag uses taxpr's linearization rule.
    assert float(jax.grad(lambda x: tx.tag(jnp.sin(x), op="t") * 2)(0.0)) == 2.0


def test_detected_custom_vjp_bwd_results_match_jax_bwd():
    @jax.custom_vjp
    def f(x):
        return x * 2

    f.defvjp(lambda x: (x * 2, None), lambda res, g: (g * 3,))
    closed = jax.make_jaxpr(f)(1.0)
    (eqn,) = [e for e in _jaxpr.jaxpr_parts(closed).eqns
              if e.primitive is _compat.custom_vjp_call_p]
    eqn.params["fwd_jaxpr_thunk"].call_wrapped(True)  # fills out_trees
    raw = eqn.params["bwd"].call_wrapped(jnp.float32(1.0))
    if _compat.CUSTOM_VJP_BWD_RETURNS_LOGS:
        raw_cts, raw_logs = raw
        assert raw_logs is None
    else:
        raw_cts = raw
    assert [float(c) for c in raw_cts] == [3.0]
    cts, logs = _compat.call_custom_vjp_bwd(eqn.params["bwd"], [jnp.float32(1.0)])
    assert [float(c) for c in cts] == [3.0] and logs is None
    rebuilt = _compat.custom_vjp_bwd_result(cts, logs)
    assert rebuilt == ((cts, None) if _compat.CUSTOM_VJP_BWD_RETURNS_LOGS else cts)


def test_jaxpr_parts_is_a_named_tuple_of_the_jaxpr():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) + jnp.ones(2))(jnp.ones(2))
    parts = _jaxpr.jaxpr_parts(closed)
    assert parts._fields == ("constvars", "consts", "invars", "eqns", "outvars", "effects",
                             "debug_info")
    assert len(parts.invars) == 1 and len(parts.outvars) == 1
    assert [e.primitive.name for e in parts.eqns][0] == "sin"
    rebuilt = _jaxpr.make_closed(*parts)
    assert jnp.allclose(jaxpr_as_fun(rebuilt)(jnp.zeros(2))[0], 1.0)


def test_every_shipped_thread_rule_is_keyed_by_a_primitive_object():
    from taxpr import _engine

    prims = set(_engine.THREAD_RULES)
    for p in (_compat.jit_p, _compat.scan_p, _compat.while_p, _compat.cond_p, _compat.remat_p,
              _compat.custom_jvp_call_p, _compat.custom_vjp_call_p, _compat.shard_map_p,
              *_compat.CLOSED_CALL_PRIMITIVES):
        assert p in prims, p
    assert all(isinstance(p, Primitive) for p in prims)

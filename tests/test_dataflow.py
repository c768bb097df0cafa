"""Utilities: transpose / partition_out / partial / strip_outputs / TypedClosedJaxpr."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun

import taxpr as tx
from tests.helpers import check


def f(x):
    a = tx.tag(x * 2, name="a")

    def body(c, xi):
        def inner(d, xj):
            return d + tx.tag(xj * d, name="b"), None
        d, _ = jax.lax.scan(inner, c, jnp.arange(2.0) + xi)
        return d, None

    c, _ = jax.jit(lambda a: jax.lax.scan(body, a, jnp.arange(3.0)))(a)
    return c, a + 1, jnp.sin(x)


def eager_tags(x):
    a = x * 2
    c, bs = a, []
    for xi in range(3):
        d, row = c, []
        for xj in np.arange(2.0) + xi:
            row.append(xj * d)
            d = d + xj * d
        bs.append(row)
        c = d
    return a, np.array(bs)


@pytest.mark.parametrize("x", [0.5, -1.0, 2.0])
def test_transpose_returns_tags_stacked_through_nested_scans(x):
    closed = jax.make_jaxpr(f)(1.0)
    t, params, structures = tx.transpose(closed)
    check(t)
    assert params == [{"name": "a"}, {"name": "b"}]
    assert structures[1].shape == (3, 2)
    a, b = jaxpr_as_fun(t)(x)
    ea, eb = eager_tags(x)
    np.testing.assert_allclose(a, ea, rtol=1e-6)
    np.testing.assert_allclose(b, eb, rtol=1e-5)


def test_transpose_errors_where_a_tag_has_no_single_value():
    w = jax.make_jaxpr(lambda x: jax.lax.while_loop(
        lambda c: c < 3, lambda c: tx.tag(c, n=1) + 1, x))(0.0)
    with pytest.raises(ValueError, match="while_loop"):
        tx.transpose(w)
    c = jax.make_jaxpr(lambda x: jax.lax.cond(
        x > 0, lambda: tx.tag(x, n=2), lambda: x))(0.0)
    with pytest.raises(ValueError, match="branch"):
        tx.transpose(c)
    assert float(jax.jit(lambda x: x * 2)(1.0)) == 2.0


def test_partition_out_and_strip_outputs_remove_dead_code_inside_nested_jaxprs():
    def g(x):
        def body(c, _):
            return (c[0] * 2, jnp.cos(c[1])), None
        (p, q), _ = jax.lax.scan(body, (x, x), None, length=3)
        return p, q, jnp.sin(x)

    closed = jax.make_jaxpr(g)(1.0)
    first, rest = tx.partition_out(closed, [[0], [2, 1]])
    for part in (first, rest):
        check(part)
    assert [float(v) for v in jaxpr_as_fun(first)(0.7)] == pytest.approx([5.6])
    out = jaxpr_as_fun(rest)(0.7)
    assert [float(v) for v in out] == pytest.approx(
        [np.sin(0.7), np.cos(np.cos(np.cos(0.7)))], rel=1e-6)
    # The scan in `first` no longer computes the cos carry.
    (scan_eqn,) = [e for e in first.eqns if e.primitive.name == "scan"]
    assert not any(e.primitive.name == "cos" for e in scan_eqn.params["jaxpr"].eqns)
    stripped = tx.strip_outputs(closed, {0, 1})
    check(stripped)
    assert not any(e.primitive.name == "scan" for e in stripped.eqns)
    assert float(jaxpr_as_fun(stripped)(0.7)[0]) == pytest.approx(np.sin(0.7))


def test_partial_fixes_inputs():
    closed = jax.make_jaxpr(lambda x, y, z: x * y + z)(1.0, jnp.ones(2), 2.0)
    p = tx.partial(closed, {1: jnp.array([3.0, 4.0])})
    check(p)
    np.testing.assert_allclose(jaxpr_as_fun(p)(2.0, 1.0)[0], [7.0, 9.0])
    with pytest.raises(ValueError, match="input 1"):
        tx.partial(closed, {1: jnp.ones(3)})


def test_typed_closed_jaxpr():
    tcj = tx.TypedClosedJaxpr.make(lambda d: {"s": d["a"] + d["b"], "p": d["a"] * 2})(
        {"a": 1.0, "b": 2.0})
    assert tcj.eval({"a": 2.0, "b": 3.0}) == {"s": 5.0, "p": 4.0}
    doubled = tcj.map_outputs(lambda o: o["s"] * 2)
    assert float(doubled.eval({"a": 2.0, "b": 3.0})) == 10.0
    swapped = tcj.map_inputs(lambda a, b: ({"a": b, "b": a},))(1.0, 2.0)
    assert swapped.eval(5.0, 1.0) == {"s": 6.0, "p": 2.0}

    tagged = tx.TypedClosedJaxpr.make(lambda x: tx.tag(x * 3, n=1) + 1)(1.0)
    t, params = tx.tcj_transpose(tagged)
    assert params == [{"n": 1}] and float(t.eval(2.0)[0]) == 6.0
    injected = tagged.inject(lambda ctx, tok, p: (tok, ctx + tok), 0.0)
    out, ctx = injected.eval(10.0, 2.0)
    assert float(out) == 7.0 and float(ctx) == 16.0
    parts = tx.tcj_partition_out(tx.TypedClosedJaxpr.make(lambda x: (x + 1, x * 2))(1.0), [[1]])
    assert [float(v) for v in parts[0].eval(3.0)] == [6.0]

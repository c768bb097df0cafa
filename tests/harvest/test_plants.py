"""taxpr.harvest._plants: append plants fed per site (scans) and ``rows(...)``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from taxpr import harvest as h

from harvest_helpers import T, allclose, assert_tree_allclose, raises, _basic, _scan_fn, _twice


# ---- better than oryx ----------------------------------------------------------------

def test_plant_append_shape_checked():
    f = lambda x: jax.lax.scan(lambda c, xi: (c + h.sow(xi, tag=T, name="v", mode="append"),
                                               None), x, jnp.arange(3.0))[0]
    msg = (r"^Planted value for 'v' has type {}, but its append sows \(at scan\[length=3\]\) "
           r"stack to float32\[3\];")
    raises(ValueError, msg.format(r"float32\[2\]"), h.plant(f, tag=T), {"v": jnp.ones(2)}, 0.0)
    raises(ValueError, msg.format(r"float32\[3, 2\]"), h.plant(f, tag=T), {"v": jnp.ones((3, 2))},
           0.0)
    raises(ValueError, msg.format(r"int32\[3\]"), h.plant(f, tag=T),
           {"v": jnp.ones(3, jnp.int32)}, 0.0)


def test_plant_append_leading_size_checked():
    f = lambda x: jax.lax.scan(lambda c, xi: (c + h.sow(xi, tag=T, name="v", mode="append"),
                                               None), x, jnp.arange(3.0))[0]
    raises(ValueError, r"^Planted value for 'v' has type float32\[4\], but its append sows \(at "
           r"scan\[length=3\]\) stack to float32\[3\];", h.plant(f, tag=T), {"v": jnp.ones(4)},
           0.0)
    g = _twice("append")  # two sows at the top level: a stack of 2 rows
    msg = (r"^Planted value for 'x' has type float32\[{}, 2\], but its append sows \(at "
           r"<top level>\) stack to float32\[2, 2\];")
    raises(ValueError, msg.format(1), h.plant(g, tag=T), {"x": jnp.ones((1, 2))}, jnp.ones(2))
    raises(ValueError, msg.format(3), h.plant(g, tag=T), {"x": jnp.ones((3, 2))}, jnp.ones(2))


def _layers(x, ws):
    """A scan over layers whose activations are append sows."""
    def layer(x, w):
        a = h.sow(jnp.tanh(w * x), tag=T, name="act", mode="append")
        return a, a
    return jax.lax.scan(layer, x, ws)


def _layers_eager(x, ws, patch: dict):
    acts = []
    for i, w in enumerate(np.asarray(ws)):
        x = patch.get(i, np.tanh(w * x))
        acts.append(x)
    return x, np.stack(acts)


def test_rows_plant_overrides_only_selected_iterations():
    x, ws = jnp.array([0.3, -0.2]), jnp.array([1.0, 2.0, -1.5, 0.5])
    for patch in ({1: np.array([1.0, 0.0])}, {0: np.zeros(2), 3: np.ones(2)},
                  {-1: np.full(2, 0.5)}):
        want = _layers_eager(np.asarray(x), ws, {i % 4: v for i, v in patch.items()})
        got = h.plant(_layers, tag=T)({"act": h.rows(patch)}, x, ws)
        assert_tree_allclose(got, want)
        got = jax.jit(h.plant(_layers, tag=T))({"act": h.rows(patch)}, x, ws)
        assert_tree_allclose(got, want)
    # no rows: the program unchanged
    assert_tree_allclose(h.plant(_layers, tag=T)({"act": h.rows({})}, x, ws),
                         _layers_eager(np.asarray(x), ws, {}))


def test_rows_plant_with_a_traced_mask():
    x, ws = jnp.array([0.3, -0.2]), jnp.array([1.0, 2.0, -1.5])
    stack = jnp.arange(6.0).reshape(3, 2)
    mask = jnp.array([False, True, False])
    want = _layers_eager(np.asarray(x), ws, {1: np.asarray(stack[1])})
    run = jax.jit(lambda m, v: h.plant(_layers, tag=T)({"act": h.rows(mask=m, values=v)}, x, ws))
    assert_tree_allclose(run(mask, stack), want)
    # differentiable with respect to the planted rows (and only those rows matter)
    g = jax.grad(lambda v: run(mask, v)[0].sum())(stack)
    eps = 1e-3
    num = (run(mask, stack.at[1, 0].add(eps))[0].sum()
           - run(mask, stack.at[1, 0].add(-eps))[0].sum()) / (2 * eps)
    allclose(g[1, 0], num, rtol=1e-2)
    allclose(g[0], [0.0, 0.0])
    allclose(g[2], [0.0, 0.0])


def test_rows_plant_inside_reap_and_with_nest():
    x, ws = jnp.array([0.3, -0.2]), jnp.array([1.0, 2.0, -1.5])
    want_out, want_acts = _layers_eager(np.asarray(x), ws, {1: np.ones(2)})
    # an outer reap sees the activations after the patch (another name's sows
    # stay; the planted one is consumed, so reap a second sow of the result)
    def model(x, ws):
        out, acts = h.plant(_layers, tag=T)({"act": h.rows({1: jnp.ones(2)})}, x, ws)
        return h.sow(acts, tag=T, name="seen")
    assert_tree_allclose(h.reap(model, tag=T)(x, ws), {"seen": want_acts})
    nested = h.nest(_layers, scope="m")
    assert_tree_allclose(h.plant(nested, tag=T)({"m": {"act": h.rows({1: jnp.ones(2)})}}, x, ws),
                         (want_out, want_acts))


def test_rows_plant_errors():
    x, ws = jnp.array([0.3, -0.2]), jnp.array([1.0, 2.0, -1.5])
    p = h.plant(_layers, tag=T)
    raises(ValueError, r"'act'.*row 3 is out of range.*3 rows", p, {"act": h.rows({3: jnp.ones(2)})},
           x, ws)
    raises(ValueError, r"'act'.*float32\[3\]", p, {"act": h.rows({0: jnp.ones(3)})}, x, ws)
    raises(ValueError, r"rows\(mask=\.\.\.\) for 'act'.*bool\[3\]", p,
           {"act": h.rows(mask=jnp.ones(2, bool), values=jnp.ones((3, 2)))}, x, ws)
    raises(ValueError, r"rows\(\.\.\.\) planted for 'a'.*'strict' mode", h.plant(_basic, tag=T),
           {"a": h.rows({0: 1.0})}, 3.0)
    with pytest.raises(TypeError, match="either"):
        h.rows({0: 1.0}, mask=jnp.ones(1, bool))
    with pytest.raises(TypeError, match="int row"):
        h.rows({"0": 1.0})


def test_plant_append_inside_scan():
    xs = jnp.arange(4.0)
    (c, ys) = h.plant(_scan_fn, tag=T)({"y": jnp.array([10.0, 20.0, 30.0, 40.0])}, 2.0, xs)
    allclose(ys, [10.0, 20.0, 30.0, 40.0])
    allclose(c, 6.0)
    # with reverse: the plant is aligned with xs too
    (c, ys) = h.plant(functools.partial(_scan_fn, reverse=True), tag=T)(
        {"y": jnp.array([10.0, 20.0, 30.0, 40.0])}, 2.0, xs)
    allclose(ys, [10.0, 20.0, 30.0, 40.0])
    # per-iteration values feed the carry
    def g(x):
        def body(c, xi):
            return c + h.sow(c * xi, tag=T, name="v", mode="append"), None
        return jax.lax.scan(body, x, jnp.ones(3))[0]
    allclose(h.plant(g, tag=T)({"v": jnp.array([1.0, 2.0, 4.0])}, 5.0), 12.0)


def test_plant_append_nested_scans():
    def f(x):
        def outer(c, _):
            def inner(c2, _):
                return c2 + h.sow(c2, tag=T, name="v", mode="append"), None
            return jax.lax.scan(inner, c, None, length=3)[0], None
        return jax.lax.scan(outer, x, None, length=2)[0]

    p = jnp.arange(6.0).reshape(2, 3)
    allclose(h.plant(f, tag=T)({"v": p}, 1.0), 1.0 + 15.0)
    out, reaps = h.harvest(f, tag=T)({}, 1.0)
    allclose(out, 64.0)
    allclose(reaps["v"], [[1, 2, 4], [8, 16, 32.0]])

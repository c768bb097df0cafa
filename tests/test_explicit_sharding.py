"""State and harvest with JAX's sharding in types (a mesh with Explicit
axes: ``float32[8@x]``), on 4 CPU devices selected explicitly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import taxpr as tx
from taxpr import harvest as h

from helpers import cpu_devices

AxisType = getattr(jax.sharding, "AxisType", None)
pytestmark = pytest.mark.skipif(AxisType is None, reason="this JAX has no sharding in types")


def _explicit_mesh():
    return jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,), devices=cpu_devices(4))


def _using(mesh):
    return jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else jax.sharding.use_mesh(mesh)


def _accumulate(init):
    def f(w, xs):
        def step(c, x):
            s = tx.get_state("s", init(w))
            s = s + jnp.sin(x) * w
            tx.set_state("s", s)
            h.sow(s.sum(), tag="t", name="total", mode="append")
            return c + s, None
        return jax.lax.scan(step, jnp.zeros_like(w), xs)[0]
    return f


def _accumulate_eagerly(w, xs):
    s, c, totals = np.zeros_like(w), np.zeros_like(w), []
    for x in xs:
        s = s + np.sin(x) * w
        totals.append(s.sum())
        c = c + s
    return c, s, np.array(totals)


def test_sharded_state_threads_with_its_sharding_and_matches_eager():
    mesh = _explicit_mesh()
    with _using(mesh):
        w = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        xs = jax.device_put(jnp.linspace(0.0, 1.0, 24).reshape(3, 8), NamedSharding(mesh, P(None, "x")))
        f = _accumulate(lambda w: (lambda: jnp.zeros_like(w)))
        pure, state0 = tx.uncurry(f, w, xs)
        assert jax.typeof(state0["s"]).sharding.spec == P("x")
        (out, state1), reaps = jax.jit(h.call_and_reap(pure, tag="t"))(state0, w, xs)
        assert jax.typeof(state1["s"]).sharding.spec == P("x")
    c, s, totals = _accumulate_eagerly(np.asarray(w), np.asarray(xs))
    np.testing.assert_allclose(out, c, rtol=1e-6)
    np.testing.assert_allclose(state1["s"], s, rtol=1e-6)
    np.testing.assert_allclose(reaps["total"], totals, rtol=1e-6)


def test_a_state_read_replicated_and_set_sharded_is_a_clear_error():
    # Threaded, it was a scan whose carry changes type: JAX refused the
    # pure program at compilation ("while_carry[1][0] has type float32[8]
    # but the corresponding output carry component has type float32[8@x]").
    mesh = _explicit_mesh()
    with _using(mesh):
        w = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        xs = jax.device_put(jnp.ones((3, 8)), NamedSharding(mesh, P(None, "x")))
        f = _accumulate(lambda w: (lambda: jnp.zeros(8)))
        with pytest.raises(tx.StateError, match=r"state 's': set_state\('s'\) at scan\[length=3\] "
                           r"has type float32\[8@x\], but get_state\('s'\) at scan\[length=3\] "
                           r"gave it type float32\[8\]: their shardings .* reshard"):
            tx.uncurry(f, w, xs)


def test_sows_of_one_name_with_different_shardings_are_a_clear_error():
    # Threaded, the clobbered value was a scan carry changing type (an
    # invalid program JAX refused at compilation).
    def f(w):
        def body(c, _):
            h.sow(c, tag="t", name="b", mode="clobber")
            return c * 2.0, None
        h.sow(jnp.zeros(8), tag="t", name="b", mode="clobber")
        return jax.lax.scan(body, w, None, length=2)[0]

    mesh = _explicit_mesh()
    with _using(mesh):
        w = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("x")))
        with pytest.raises(ValueError, match=r"^Mismatched sharding between sows: 'b': "
                           r"float32\[8\] and float32\[8@x\]"):
            h.call_and_reap(f, tag="t")(w)
        # sown alike, it reaps the last value, as eagerly: 2 * w
        g = lambda w: f(jax.sharding.reshard(w, P()))  # noqa: E731
        out, reaps = jax.jit(h.call_and_reap(g, tag="t"))(w)
    np.testing.assert_array_equal(reaps["b"], 2.0 * np.arange(8.0))
    np.testing.assert_array_equal(out, 4.0 * np.arange(8.0))

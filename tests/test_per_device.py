"""Per-device values: jax.pmap and shard_map without vma checking.

Inside ``shard_map(check_vma=False)`` (which ``jax.pmap`` uses) types do not
say whether a value is the same on every shard, so a reap, a ctx change
computed from a tagged value, or a state set of a value not proven the same
on every shard is a clear error instead of keeping one shard's value;
reads, plants, ctx changes computed from ctx alone, and sets of values a
collective made the same everywhere work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh, PartitionSpec as P

import taxpr as tx
from taxpr import harvest as h

from helpers import check, shard_map as _shard_map_fn

shard_map = _shard_map_fn()

CPUS = jax.devices("cpu")
pytestmark = pytest.mark.skipif(len(CPUS) < 4, reason="needs 4 CPU devices "
                                "(XLA_FLAGS=--xla_force_host_platform_device_count=4)")
XS = jnp.arange(4.0)


def mesh():
    return Mesh(np.array(CPUS[:4]), ("i",))


def unchecked(fn):
    return shard_map(fn, mesh=mesh(), in_specs=P("i"), out_specs=P("i"), check_vma=False)


def test_pmap_set_state_of_a_per_device_value_is_a_state_error():
    f = jax.pmap(lambda x: tx.set_state("t", x), devices=CPUS[:4])
    with pytest.raises(tx.StateError) as e:
        tx.uncurry(f, XS)
    msg = str(e.value)
    assert "'t'" in msg and "shard_map" in msg and "check_vma=False" in msg


def test_pmap_get_state_reads_the_state_on_every_device():
    f = jax.pmap(lambda x: x * tx.get_state("w", lambda: jnp.float32(2.0)), devices=CPUS[:4])
    pure, s0 = tx.uncurry(f, XS)
    assert float(s0["w"]) == 2.0
    out, s1 = pure({"w": jnp.float32(3.0)}, XS)
    np.testing.assert_allclose(out, XS * 3.0)  # eager: each device reads w
    assert float(s1["w"]) == 3.0


def test_reap_in_shard_map_without_vma_check_is_an_error():
    f = unchecked(lambda x: h.sow(x.sum(), tag="t", name="s", mode="clobber") + x)
    with pytest.raises(ValueError) as e:
        h.reap(f, tag="t")(jnp.arange(8.0))
    assert "'s'" in str(e.value) and "check_vma=False" in str(e.value)


def test_reap_in_pmap_is_an_error():
    f = jax.pmap(lambda x: h.sow(x * 2, tag="t", name="s", mode="clobber"), devices=CPUS[:4])
    with pytest.raises(ValueError, match="check_vma=False"):
        h.reap(f, tag="t")(XS)


def test_plant_in_shard_map_without_vma_check_is_the_same_on_every_shard():
    f = unchecked(lambda x: h.sow(x.sum(), tag="t", name="s", mode="clobber") + x)
    out = h.plant(f, tag="t")({"s": jnp.float32(100.0)}, jnp.arange(8.0))
    np.testing.assert_allclose(out, jnp.arange(8.0) + 100.0)


def test_reap_in_shard_map_with_vma_check_of_a_replicated_value():
    f = shard_map(lambda x: h.sow(jax.lax.psum(x.sum(), "i"), tag="t", name="s",
                                  mode="clobber") + x,
                  mesh=mesh(), in_specs=P("i"), out_specs=P("i"))
    got = h.reap(f, tag="t")(jnp.arange(8.0))
    assert float(got["s"]) == float(jnp.arange(8.0).sum())


def test_injector_counting_from_ctx_alone_in_shard_map_without_vma_check():
    closed = jax.make_jaxpr(unchecked(lambda x: tx.tag(x.sum(), op="c") + x))(jnp.arange(8.0))
    new = tx.inject(closed, lambda ctx, tok, p: (tok, ctx + 1), jnp.int32(0))
    check(new)
    out, n = jaxpr_as_fun(new)(jnp.int32(0), jnp.arange(8.0))
    assert int(n) == 1  # the same on every shard: the program's one tag ran once
    shard_sums = jnp.repeat(jnp.arange(8.0).reshape(4, 2).sum(1), 2)
    np.testing.assert_allclose(out, jnp.arange(8.0) + shard_sums)


def test_injector_storing_the_token_in_shard_map_without_vma_check_is_an_inject_error():
    closed = jax.make_jaxpr(unchecked(lambda x: tx.tag(x.sum(), op="c") + x))(jnp.arange(8.0))
    with pytest.raises(tx.InjectError) as e:
        tx.inject(closed, lambda ctx, tok, p: (tok, ctx + tok), jnp.float32(0))
    assert "op='c'" in str(e.value) and "check_vma=False" in str(e.value)


# ---- sets of values provably the same on every device ------------------------
# Without vma checking, a set_state works when taxpr's dataflow analysis
# (taxpr/_state/_replicated.py) proves its value the same on every device
# (a collective reduced it over every axis it varied over); otherwise it
# stays the StateError naming the state.

def mesh2x2():
    return Mesh(np.array(CPUS[:4]).reshape(2, 2), ("i", "j"))


def _set(name, value):
    tx.set_state(name, value)


def _per_device_error(fn, *args, name="s"):
    with pytest.raises(tx.StateError) as e:
        tx.uncurry(fn, *args)
    msg = str(e.value)
    assert repr(name) in msg and "check_vma=False" in msg, msg


def test_pmap_batch_statistics_running_mean_matches_numpy():
    def step(x):
        m = jax.lax.pmean(x.mean(), "i")
        tx.set_state("mean", 0.9 * tx.get_state("mean", jnp.float32(0.0)) + 0.1 * m)
        return x - m

    f = jax.pmap(step, axis_name="i", devices=CPUS[:4])
    batches = [np.arange(12.0, dtype=np.float32).reshape(4, 3),
               np.linspace(-2.0, 5.0, 12, dtype=np.float32).reshape(4, 3)]
    pure, state = tx.uncurry(f, batches[0])
    assert float(state["mean"]) == 0.0
    running = 0.0
    for xs in batches:
        out, state = pure(state, xs)
        running = 0.9 * running + 0.1 * xs.mean()  # the mean over all devices
        np.testing.assert_allclose(out, xs - xs.mean(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state["mean"], running, rtol=1e-6)


def test_shard_map_without_vma_check_sets_psum_and_all_gather_values():
    def body(x):
        total = jax.lax.psum(x.sum(), "i")
        gathered = jax.lax.all_gather(x, "i", tiled=True)  # the whole array everywhere
        tx.set_state("total", total)
        tx.set_state("biggest", gathered.max())
        return x + total

    f = unchecked(body)
    xs = np.arange(8.0, dtype=np.float32)
    pure, s0 = tx.uncurry(f, xs)
    out, s1 = pure(s0, xs * 2)
    np.testing.assert_allclose(out, xs * 2 + (xs * 2).sum())
    np.testing.assert_allclose(s1["total"], (xs * 2).sum())
    np.testing.assert_allclose(s1["biggest"], (xs * 2).max())


def test_shard_map_without_vma_check_sets_a_pytree_state_of_pmeans():
    def body(x):
        mean = jax.lax.pmean(x.mean(), "i")
        var = jax.lax.pmean(((x - mean) ** 2).mean(), "i")
        old_mean, old_var = tx.get_state("stats", (jnp.float32(0.0), jnp.float32(1.0)))
        tx.set_state("stats", (0.5 * old_mean + 0.5 * mean, 0.5 * old_var + 0.5 * var))
        return (x - mean) / jnp.sqrt(var + 1e-5)

    f = unchecked(body)
    xs = np.array([1.0, 3.0, -2.0, 0.5, 4.0, 4.5, -1.0, 2.0], np.float32)
    pure, s0 = tx.uncurry(f, xs)
    out, s1 = pure(s0, xs)
    mean, var = xs.mean(), xs.var()
    np.testing.assert_allclose(out, (xs - mean) / np.sqrt(var + 1e-5), rtol=1e-5)
    np.testing.assert_allclose(s1["stats"][0], 0.5 * mean, rtol=1e-6)
    np.testing.assert_allclose(s1["stats"][1], 0.5 + 0.5 * var, rtol=1e-6)


def test_pmap_sets_through_jit_scan_and_a_replicated_cond():
    def step(x):
        m = jax.jit(lambda v: jax.lax.pmean(v.sum(), "i"))(x)
        jax.jit(lambda v: tx.set_state("m", v))(m)
        # A predicate the same on every device: the set runs everywhere or nowhere.
        jax.lax.cond(m > 0, lambda: _set("pos", m), lambda: None)
        # A carry summed over every device each iteration stays replicated.
        c, _ = jax.lax.scan(lambda c, _: (c + jax.lax.psum(x.sum(), "i"), None),
                            jnp.float32(0.0), None, length=3)
        tx.set_state("c", c)
        return x

    f = jax.pmap(step, axis_name="i", devices=CPUS[:4])
    xs = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    pure, s0 = tx.uncurry(f, xs)
    _, s1 = pure(s0, xs)
    np.testing.assert_allclose(s1["m"], xs.sum() / 4)
    np.testing.assert_allclose(s1["pos"], xs.sum() / 4)
    np.testing.assert_allclose(s1["c"], 3 * xs.sum())


def test_pmap_set_of_a_per_device_sum_is_a_state_error():
    _per_device_error(jax.pmap(lambda x: (tx.set_state("s", x.sum()), x)[1], axis_name="i",
                               devices=CPUS[:4]), np.ones((4, 2), np.float32))


def test_set_of_a_psum_over_one_of_two_mesh_axes_is_a_state_error():
    # Summed over "i" only: still differs across "j".
    f = shard_map(lambda x: (tx.set_state("s", jax.lax.psum(x.sum(), "i")), x)[1],
                  mesh=mesh2x2(), in_specs=P("i", "j"), out_specs=P("i", "j"),
                  check_vma=False)
    _per_device_error(f, np.ones((4, 4), np.float32))
    # Over both axes: the same everywhere.
    g = shard_map(lambda x: (tx.set_state("s", jax.lax.psum(x.sum(), ("i", "j"))), x)[1],
                  mesh=mesh2x2(), in_specs=P("i", "j"), out_specs=P("i", "j"),
                  check_vma=False)
    xs = np.arange(16.0, dtype=np.float32).reshape(4, 4)
    pure, s0 = tx.uncurry(g, xs)
    np.testing.assert_allclose(pure(s0, xs)[1]["s"], xs.sum())


def test_set_of_a_value_from_axis_index_is_a_state_error():
    f = jax.pmap(lambda x: (tx.set_state("s", jax.lax.axis_index("i") * 1.0), x)[1],
                 axis_name="i", devices=CPUS[:4])
    _per_device_error(f, np.ones((4, 2), np.float32))
    # Reduced over the axis it varies over: fine.
    g = jax.pmap(lambda x: (tx.set_state("s", jax.lax.psum(jax.lax.axis_index("i"), "i")),
                            x)[1], axis_name="i", devices=CPUS[:4])
    pure, s0 = tx.uncurry(g, np.ones((4, 2), np.float32))
    assert int(pure(s0, np.ones((4, 2), np.float32))[1]["s"]) == 0 + 1 + 2 + 3


def test_set_in_a_cond_on_per_device_data_is_a_state_error():
    # The value is replicated, but only the devices whose data is positive set it.
    def step(x):
        m = jax.lax.pmean(x.sum(), "i")
        jax.lax.cond(x.sum() > 0, lambda: _set("s", m), lambda: None)
        return x
    _per_device_error(jax.pmap(step, axis_name="i", devices=CPUS[:4]),
                      np.ones((4, 2), np.float32))


def test_per_device_set_in_a_custom_jvp_rule_is_still_refused():
    # The body's set is proven replicated; the rule's (traced only when
    # pure is differentiated) is checked by the engine and refused.
    @jax.custom_jvp
    def g(x):
        tx.set_state("s", jax.lax.pmean(x, "i"))
        return x * 2

    @g.defjvp
    def g_jvp(primals, tangents):
        (x,), (dx,) = primals, tangents
        tx.set_state("s", x)
        return x * 2, dx * 2

    f = jax.pmap(g, axis_name="i", devices=CPUS[:4])
    pure, s0 = tx.uncurry(f, XS)
    np.testing.assert_allclose(pure(s0, XS)[1]["s"], np.asarray(XS).mean())
    with pytest.raises(tx.InjectError, match="check_vma=False"):
        jax.jvp(lambda x: pure(s0, x), (XS,), (jnp.ones(4),))


def test_a_set_shared_with_an_unfollowed_place_is_a_state_error():
    # JAX shares the jitted setter's jaxpr: its one set eqn is reached with a
    # pmean (proven) and, inside a custom_vjp (not followed), a per-device sum.
    setter = jax.jit(lambda v: (tx.set_state("s", v), v)[1])

    @jax.custom_vjp
    def per_device(v):
        return setter(v)
    per_device.defvjp(lambda v: (setter(v), None), lambda _, g: (g,))

    def step(x):
        setter(jax.lax.pmean(x.sum(), "i"))
        per_device(x.sum())
        return x
    _per_device_error(jax.pmap(step, axis_name="i", devices=CPUS[:4]),
                      np.ones((4, 2), np.float32))

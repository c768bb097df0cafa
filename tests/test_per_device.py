"""Per-device values: jax.pmap and shard_map without vma checking.

Inside ``shard_map(check_vma=False)`` (which ``jax.pmap`` uses) types do not
say whether a value is the same on every shard, so a state set, a reap or a
ctx change computed from a tagged value is a clear error instead of keeping
one shard's value; reads, plants and ctx changes computed from ctx alone
work.
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

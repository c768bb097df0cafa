"""inject through shard_map (4 simulated CPU devices, see conftest)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import taxpr as tx
from helpers import cpu_mesh

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map

MESH = cpu_mesh("x")  # skips the module with fewer than 4 CPU devices


def injector(ctx, token, params):
    op = params["op"]
    if op == "get":
        return ctx, ctx
    if op == "count":
        return token, ctx + 1
    if op == "store":
        return token, ctx + token  # per-shard value into a replicated ctx
    raise ValueError(op)


def _body(x):
    tx.tag(x, op="count")
    return x * 2 + tx.tag(jnp.sum(x), op="get")


def _eager(x, ctx):
    ctx = ctx + 1  # ctx is replicated: every shard counts the same tag once
    return np.asarray(x) * 2 + ctx, ctx


@pytest.mark.parametrize("ctx0", [0.0, 10.0])
def test_shard_map_threads_replicated_ctx(ctx0):
    f = shard_map(_body, mesh=MESH, in_specs=P("x"), out_specs=P("x"))
    pure = tx.injected(f, injector)
    x = jnp.arange(8.0)
    out, ctx = pure(np.float32(ctx0), x)
    ref_out, ref_ctx = _eager(x, ctx0)
    np.testing.assert_allclose(out, ref_out)
    np.testing.assert_allclose(ctx, ref_ctx)
    out_j, ctx_j = jax.jit(pure)(np.float32(ctx0), x)
    np.testing.assert_allclose(out_j, ref_out)
    g = jax.grad(lambda x: pure(np.float32(ctx0), x)[0].sum())(x)
    np.testing.assert_allclose(g, 2 * np.ones(8))


def test_shard_map_ctx_varying_across_shards_is_a_clear_error():
    def body(x):
        return x + tx.tag(jnp.sum(x), op="store")

    f = shard_map(body, mesh=MESH, in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(tx.InjectError, match=r"op='store'.*shard_map.*differ across the shards"):
        tx.injected(f, injector)(np.float32(0.0), jnp.arange(8.0))
    assert float(jax.jit(lambda x: x * 2)(1.0)) == 2.0
    assert float(jax.grad(lambda x: x ** 2)(3.0)) == 6.0

"""taxpr used from several threads at once (a server tracing requests, a
data loader, pytest-xdist's thread mode): every transformation keeps its
per-trace state per thread, so concurrent traces give what one thread
alone gives."""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np

import taxpr as tx
from taxpr import harvest as h


def _rnn(k: int):
    def f(w, xs):
        def step(_, x):
            hh = tx.get_state(f"h{k}", lambda: jnp.full(2, float(k)))
            hh = jnp.tanh(w @ hh + x)
            tx.set_state(f"h{k}", hh)
            tx.set_state("n", tx.get_state("n", lambda: jnp.zeros((), jnp.int32)) + k)
            return None, hh + jax.random.normal(tx.next_key(), (2,))
        return jax.lax.scan(step, None, xs)[1]
    return f


def _sowing(k: int):
    def f(x):
        def body(c, _):
            return h.sow(c * (k + 1), tag="t", name=f"c{k}", mode="append") + 1.0, None
        return jax.lax.scan(body, x, None, length=4)[0]
    return f


def _job(k: int) -> list:
    w, xs = 0.5 * (k + 1) * jnp.eye(2), k * jnp.ones((5, 2))
    pure, state0 = tx.uncurry(_rnn(k), w, xs)
    ys, state1 = jax.jit(pure)(state0, w, xs)
    ys2, state2 = pure(state1, w, xs)
    reaped = h.call_and_reap(_sowing(k), tag="t")(jnp.float32(k))
    planted = h.plant(_sowing(k), tag="t")({f"c{k}": jnp.arange(4.0)}, jnp.float32(k))
    seeded = tx.seed(lambda x: x + jax.random.normal(tx.next_key(), (2,)), jax.random.key(k))(w[0])
    jaxpr, _ = tx.make_jaxpr(_rnn(k))(w, xs)

    def data(x):
        return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    leaves = jax.tree_util.tree_leaves((ys, state1, ys2, state2, reaped, planted, seeded))
    return [np.asarray(data(x)) for x in leaves] + [str(jaxpr)]


def test_concurrent_traces_match_one_thread():
    alone = {k: _job(k) for k in range(4)}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [(k, pool.submit(_job, k)) for k in [*range(4), *range(4)]]
        for k, future in futures:
            got = future.result()
            assert len(got) == len(alone[k])
            for a, b in zip(alone[k], got):
                if isinstance(a, str):
                    assert a == b
                else:
                    np.testing.assert_array_equal(a, b)

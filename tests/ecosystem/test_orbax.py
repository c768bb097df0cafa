"""A taxpr state dict saved and restored with orbax: pytree-valued states,
states nested by `tx.scope` and a typed PRNG key stream. Reference: the same
run without the save and restore, compared bit for bit."""
import pytest

ocp = pytest.importorskip("orbax.checkpoint")

from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import taxpr as tx  # noqa: E402
from helpers import assert_same_bits  # noqa: E402


class Stats(NamedTuple):
    mean: jax.Array
    count: jax.Array


def _noisy_layer(x):
    st = tx.get_state("stats", Stats(jnp.zeros(3), jnp.int32(0)))
    x = x + 0.1 * jax.random.normal(tx.next_key(), x.shape)
    tx.set_state("stats", Stats(st.mean + (x - st.mean) / (st.count + 1), st.count + 1))
    return x


def _model(x):
    with tx.scope("first"):
        x = _noisy_layer(x)
    with tx.scope("second"):
        return _noisy_layer(jnp.tanh(x))


def test_an_orbax_checkpoint_resumes_bit_for_bit(tmp_path):
    pure, state0 = tx.uncurry(_model, jnp.ones(3))
    step = jax.jit(pure)
    x = jnp.array([0.5, -1.0, 2.0])

    state, outs = state0, []
    for _ in range(4):
        out, state = step(state, x)
        outs.append(out)

    resumed = state0
    for _ in range(2):
        _, resumed = step(resumed, x)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "step2", resumed)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "step2", state0)

    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state0)
    assert isinstance(restored["first"], tx.StateScope)
    assert isinstance(restored["second"]["stats"], Stats)
    assert jax.dtypes.issubdtype(restored["rng"].dtype, jax.dtypes.prng_key)
    resumed_outs = []
    for _ in range(2):
        out, restored = step(restored, x)
        resumed_outs.append(out)
    for got, want in zip(resumed_outs, outs[2:]):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(jax.random.key_data(restored["rng"]),
                                  jax.random.key_data(state["rng"]))
    assert int(restored["second"]["stats"].count) == 4


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "int4", "complex64", "bool"])
def test_an_orbax_checkpoint_round_trips_every_state_dtype_bit_for_bit(tmp_path, dtype):
    values = np.array([1, 0, 3, 2]) if dtype in ("int4", "bool") else np.array([1.5, -2.25, 0.0, 3.0])

    def f(x):
        w = tx.get_state("w", jnp.asarray(values).astype(dtype))
        tx.set_state("w", w)
        return x

    _, state0 = tx.uncurry(f, 1.0)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state0)
    checkpointer.wait_until_finished()
    back = checkpointer.restore(tmp_path / "ckpt", state0)
    assert_same_bits(back["w"], state0["w"])

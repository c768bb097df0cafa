"""taxpr._state._checkpoint: save_state / load_state round trips."""

from __future__ import annotations

import io
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taxpr as tx
from helpers import assert_same_bits


class Stats(NamedTuple):
    mean: jax.Array
    count: jax.Array


def noisy_mean(x):
    """A step with a typed key, a NamedTuple state and a plain one."""
    key = tx.get_state("key", lambda: jax.random.key(7))
    key, sub = jax.random.split(key)
    tx.set_state("key", key)
    st = tx.get_state("stats", lambda: Stats(jnp.zeros(3), jnp.zeros((), jnp.int32)))
    v = x + 0.1 * jax.random.normal(sub, (3,))
    n = st.count + 1
    tx.set_state("stats", Stats(st.mean + (v - st.mean) / n, n))
    tx.set_state("last", tx.get_state("last", jnp.zeros(3)) * 0.0 + v)
    return jnp.sum(v)


def run(pure, state, steps):
    outs = []
    for i in range(steps):
        out, state = pure(state, jnp.full(3, float(i)))
        outs.append(out)
    return outs, state


def leaves_equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("to", ["path", "file object"])
def test_a_saved_and_restored_run_resumes_bit_for_bit(tmp_path, to):
    pure, state0 = tx.uncurry(noisy_mean, jnp.zeros(3))
    pure = jax.jit(pure)
    straight, end = run(pure, state0, 5)
    _, middle = run(pure, state0, 3)
    target = tmp_path / "state.npz" if to == "path" else io.BytesIO()
    tx.save_state(target, middle)
    if to != "path":
        target.seek(0)
    restored = tx.load_state(target, like=state0)
    assert isinstance(restored["stats"], Stats)
    assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    leaves_equal(restored, middle)
    resumed = []
    state = restored
    for i in range(3, 5):
        out, state = pure(state, jnp.full(3, float(i)))
        resumed.append(out)
    np.testing.assert_array_equal(np.asarray(resumed), np.asarray(straight[3:]))
    leaves_equal(state, end)


def test_loading_into_another_structure_or_type_is_an_error_naming_the_array(tmp_path):
    pure, state0 = tx.uncurry(noisy_mean, jnp.zeros(3))
    tx.save_state(tmp_path / "s.npz", state0)
    with pytest.raises(ValueError, match=r"no array \['other'\]"):
        tx.load_state(tmp_path / "s.npz", like={**state0, "other": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"\['last'\] is float32\[3\] in the file and "
                                         r"float32\[4\]"):
        tx.load_state(tmp_path / "s.npz", like={**state0, "last": jnp.zeros(4)})


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float8_e5m2", "int4", "uint4",
                                   "complex64", "bool", "float16", "int8"])
def test_every_dtype_a_state_can_have_round_trips_bit_for_bit(tmp_path, dtype):
    values = np.array([1.5, -2.25, 0.0, 3.0]) if dtype not in ("int4", "uint4", "bool") \
        else np.array([1, 0, 3, 2])
    if dtype == "complex64":
        values = values + 1j * values[::-1]
    state = {"w": jnp.asarray(values).astype(dtype), "key": jax.random.key(7)}
    tx.save_state(tmp_path / "s", state)
    back = tx.load_state(tmp_path / "s.npz", state)
    assert_same_bits(back["w"], state["w"])
    np.testing.assert_array_equal(jax.random.key_data(back["key"]),
                                  jax.random.key_data(state["key"]))

"""State semantics a new user relies on (issue 10, classes C, D, E, G, H, I):
each compared with the same program run eagerly with Python control flow
and a dict for state (``Eager`` from test_state), or a clear error."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx

from helpers import check
from test_state import TX, Eager, assert_close, assert_states, jax_still_works

f32, i32 = jnp.float32, jnp.int32


# ---- G: state dicts with extra entries ---------------------------------------------------

def _two_paths(S, x, which: str):
    """Two call paths that touch different states (``which`` is static)."""
    if which == "a":
        S.set("a", S.get("a", jnp.zeros((), f32)) + x)
    else:
        S.set("b", S.get("b", jnp.ones((2,), f32)) * x)
    return x * 2.0


def test_pure_passes_entries_its_path_does_not_touch_through_unchanged():
    fn = functools.partial(_two_paths, TX)
    pure, s0 = tx.uncurry(fn, f32(1.0), "a")
    # The state after "training" both paths, fed to the path that touches "a" only.
    full = {"a": f32(3.0), "b": jnp.array([4.0, 5.0], f32), "step": i32(7)}
    for p in (pure, jax.jit(pure, static_argnums=2)):
        out, s1 = p(full, f32(2.0), "a")
        ref = Eager(full)
        want = _two_paths(ref, f32(2.0), "a")
        assert_close(out, want)
        assert_states(s1, ref.state)
        out, s1 = p(full, f32(2.0), "b")
        ref = Eager(full)
        _two_paths(ref, f32(2.0), "b")
        assert_states(s1, ref.state)


def test_pure_still_requires_the_states_its_path_uses():
    pure, s0 = tx.uncurry(functools.partial(_two_paths, TX), f32(1.0), "a")
    with pytest.raises(tx.StateError, match=r"missing \['a'\]"):
        pure({"b": jnp.ones(2)}, f32(1.0), "a")
    jax_still_works()


# ---- I: hints are true ------------------------------------------------------------------

def test_dtype_mismatch_of_scalar_state_does_not_say_batched():
    def fn(x):
        tx.get_state("s", f32(0.0))
        tx.set_state("s", i32(1))
        return x
    with pytest.raises(tx.StateError, match=r"'s'.*int32\[\].*float32\[\]") as info:
        tx.uncurry(fn, f32(1.0))
    assert "batched" not in str(info.value)
    jax_still_works()


def test_shape_mismatch_with_an_extra_axis_names_the_axis_without_claiming_vmap():
    def fn(x):
        tx.get_state("s", jnp.zeros(3))
        tx.set_state("s", jnp.zeros((4, 3)))
        return x
    with pytest.raises(tx.StateError, match=r"extra leading axis of size 4"):
        tx.uncurry(fn, f32(1.0))


def test_injector_returning_wrong_ctx_outside_vmap_does_not_say_batched():
    closed = jax.make_jaxpr(lambda x: tx.tag(x, a=1))(f32(1.0))
    with pytest.raises(tx.InjectError, match=r"float32\[3\], expected float32\[\]") as info:
        tx.inject(closed, lambda ctx, tok, p: (tok, jnp.zeros(3, f32)), f32(0.0))
    assert "batched" not in str(info.value)
    closed = jax.make_jaxpr(lambda x: tx.tag(x, a=1))(f32(1.0))
    with pytest.raises(tx.InjectError, match=r"int32\[\], expected float32\[\]") as info:
        tx.inject(closed, lambda ctx, tok, p: (tok, i32(0)), f32(0.0))
    assert "batched" not in str(info.value)


def test_injector_storing_a_vmap_batched_token_says_batched():
    closed = jax.make_jaxpr(jax.vmap(lambda x: tx.tag(x, a=1)))(jnp.ones(3))
    with pytest.raises(tx.InjectError, match="looks batched"):
        tx.inject(closed, lambda ctx, tok, p: (tok, tok), f32(0.0))


# ---- D: every dtype as state, typed PRNG keys included --------------------------------------

def _dtype_prog(S, x, init_fn, step):
    """Read a state, use it, write ``step(value)``; also first-touched in a loop."""
    v = S.get("v", init_fn)
    S.set("v", step(v))

    def body(i, c):
        w = S.get("w", init_fn)
        S.set("w", step(w))
        return c + 1.0
    return S.fori_loop(0, 2, body, x), v


def _step_for(dtype):
    if dtype == "key":
        return lambda k: jax.random.split(k)[0]
    if dtype == jnp.bool_:
        return jnp.logical_not
    return lambda v: (v + jnp.asarray(1, dtype)).astype(dtype)


KEY_IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]
PLAIN_DTYPES = [jnp.bool_, jnp.int8, jnp.int16, jnp.int32, jnp.uint8, jnp.uint16, jnp.uint32,
                jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64]


def _values_equal(a, b):
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended):
        assert a.dtype == b.dtype
        a, b = jax.random.key_data(a), jax.random.key_data(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _check_dtype_state(init_fn, step, dtype):
    fn = functools.partial(_dtype_prog, TX, init_fn=init_fn, step=step)
    pure, s0 = tx.uncurry(fn, f32(1.0))
    ref = Eager()
    _dtype_prog(ref, f32(1.0), init_fn, step)
    assert sorted(s0) == ["v", "w"]
    for n in s0:
        _values_equal(s0[n], ref.first[n])
    for p in (pure, jax.jit(pure)):
        (out, v), s1 = p(s0, f32(2.0))
        ref = Eager(s0)
        want, v_ref = _dtype_prog(ref, f32(2.0), init_fn, step)
        assert_close(out, want)
        _values_equal(v, v_ref)
        for n in s1:
            _values_equal(s1[n], ref.state[n])
    jaxpr, infos = tx.make_jaxpr(fn)(f32(1.0))
    check(jaxpr)
    assert [(s.name, s.dtype) for s in infos] == [("v", dtype), ("w", dtype)]
    assert all(s.read and s.written for s in infos)


@pytest.mark.parametrize("dtype", PLAIN_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_every_dtype_works_as_state(dtype):
    _check_dtype_state(lambda: jnp.ones((2,), dtype), _step_for(dtype), jnp.dtype(dtype))


def test_64_bit_dtypes_work_as_state_with_x64():
    with jax.enable_x64(True):
        for dtype in (jnp.int64, jnp.uint64, jnp.float64, jnp.complex128):
            _check_dtype_state(lambda: jnp.ones((2,), dtype), _step_for(dtype),
                               jnp.dtype(dtype))


@pytest.mark.parametrize("impl", KEY_IMPLS)
def test_typed_prng_keys_work_as_state(impl):
    init = lambda: jax.random.key(0, impl=impl)  # noqa: E731
    _check_dtype_state(init, _step_for("key"), init().dtype)


def test_typed_key_state_drives_random_numbers_like_eager():
    def prog(S, x):
        k = S.get("k", lambda: jax.random.key(42))
        k, sub = jax.random.split(k)
        S.set("k", k)
        return x + jax.random.normal(sub, (3,))
    pure, s0 = tx.uncurry(functools.partial(prog, TX), jnp.zeros(3))
    state = s0
    ref = Eager()
    for _ in range(3):
        out, state = jax.jit(pure)(state, jnp.zeros(3))
        assert_close(out, prog(ref, jnp.zeros(3)))
    _values_equal(state["k"], ref.state["k"])
    # A wrong dtype for a key state is a clear error.
    with pytest.raises(tx.StateError, match="'k'"):
        pure({"k": jnp.zeros((), jnp.uint32)}, jnp.zeros(3))

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

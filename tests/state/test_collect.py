"""A program's states and the checks on them (``taxpr._state._collect``):
every access of a state has its shape and dtype, else a ``StateError``
naming the state (its message mentions ``vmap`` only where a value does look
batched); a state set to a value batched by ``vmap`` is an error. (The guard
on custom derivative rules is tested with the rules, in test_in_rules.py.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import taxpr as tx

from state_helpers import f32, i32, jax_still_works


# ---- sets batched by vmap ----------------------------------------------------------------

def _batched_set_with_read(xs):
    def g(x):
        c = tx.get_state("cnt", jnp.zeros(()))
        tx.set_state("cnt", c + x)
        return x
    return jax.vmap(g)(xs)


def _batched_set_only(xs):
    def g(x):
        tx.set_state("last", x)
        return x
    return jax.vmap(g)(xs)


def _batched_set_then_read_outside(xs):
    jax.vmap(lambda x: tx.set_state("pre", x))(xs)
    return tx.get_state("pre", jnp.zeros(()))


def test_batched_set_inside_vmap_is_an_error():
    with pytest.raises(tx.StateError, match=r"(?s)'cnt'.*batched"):
        tx.uncurry(_batched_set_with_read, jnp.zeros(3))
    jax_still_works()
    with pytest.raises(tx.StateError, match=r"(?s)'cnt'.*batched"):
        tx.make_jaxpr(_batched_set_with_read)(jnp.zeros(3))
    jax_still_works()
    # Also under jit and scan.
    def in_scan(xs):
        def body(c, x):
            _batched_set_with_read(x)
            return c, None
        return lax.scan(body, 0.0, xs)
    with pytest.raises(tx.StateError, match=r"(?s)'cnt'.*batched"):
        tx.uncurry(jax.jit(in_scan), jnp.zeros((2, 3)))
    jax_still_works()


def test_batched_set_only_inside_vmap_is_an_error():
    with pytest.raises(tx.StateError, match=r"(?s)'last'.*batched"):
        tx.uncurry(_batched_set_only, jnp.zeros(3))


def test_batched_set_then_read_outside_says_batched():
    with pytest.raises(tx.StateError, match=r"(?s)'pre'.*batched"):
        tx.uncurry(_batched_set_then_read_outside, jnp.zeros(3))


def test_batched_set_then_read_outside_is_an_error():
    with pytest.raises(tx.StateError, match="'pre'"):
        tx.uncurry(_batched_set_then_read_outside, jnp.zeros(3))
    jax_still_works()


# ---- one shape and dtype per state -------------------------------------------------------

def test_set_wrong_shape_names_state():
    def fn(x):
        tx.get_state("buf", jnp.zeros(3))
        tx.set_state("buf", jnp.zeros(4))
        return x
    with pytest.raises(tx.StateError, match="'buf'"):
        tx.uncurry(fn, jnp.ones(()))
    jax_still_works()
    with pytest.raises(tx.StateError, match="'buf'"):
        tx.make_jaxpr(fn)(jnp.ones(()))
    jax_still_works()


def test_set_wrong_dtype_names_state():
    def fn(x):
        def body(c, _):
            tx.set_state("ctr", tx.get_state("ctr", jnp.zeros((), i32)) + 0.5)
            return c, None
        return jax.jit(lambda x: lax.scan(body, x, None, length=2))(x)
    with pytest.raises(tx.StateError, match=r"(?s)'ctr'.*(int32|float32)"):
        tx.uncurry(fn, jnp.ones(()))
    jax_still_works()


def test_inconsistent_gets_name_state():
    def fn(x):
        a = tx.get_state("g", jnp.zeros(2))
        b = lax.cond(x > 0, lambda: tx.get_state("g", jnp.zeros(3)).sum(), lambda: 0.0)
        return a.sum() + b
    with pytest.raises(tx.StateError, match="'g'"):
        tx.uncurry(fn, jnp.ones(()))
    jax_still_works()


def test_error_inside_jit_leaves_jax_clean():
    @jax.jit
    def fn(x):
        tx.set_state("z", tx.get_state("z", jnp.zeros(2)).sum())
        return x
    for _ in range(2):
        with pytest.raises(tx.StateError, match="'z'"):
            tx.uncurry(fn, jnp.ones(()))
        jax_still_works()


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

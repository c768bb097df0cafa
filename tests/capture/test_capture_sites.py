"""taxpr.sites: names, scopes, loops, sources and the scopes a value leaves."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taxpr as tx

from capture_programs import layers

X = jnp.array([0.3, -0.2])


def by_name(sites):
    return {s.name: s for s in sites}


def test_names_are_scope_and_primitive_numbered_on_repeats():
    def f(x):
        with jax.named_scope("a"):
            y = jnp.sin(x) * 2.0
            y = y * 3.0
        with jax.named_scope("b"):
            return jnp.sin(y)
    names = [s.name for s in tx.sites(f, X)]
    assert names == ["a/sin", "a/mul", "a/mul:1", "b/sin"]


def test_a_site_knows_its_scope_primitive_type_loops_and_cond():
    sites = by_name(tx.sites(layers, X))
    mul = sites["layer/mul"]
    assert (mul.scope, mul.primitive, mul.shape, np.dtype(mul.dtype)) == (
        "layer", "mul", (2,), np.dtype("float32"))
    assert mul.loops == (("scan", 3),) and mul.loops[0].kind == "scan"
    assert not mul.in_cond
    assert sites["layer/exp"].in_cond and sites["layer/exp"].loops == mul.loops
    assert tuple(sites["loop/cos"].loops[0]) == ("while_loop", None)
    assert sites["top/tanh"].in_cond and sites["top/tanh"].loops == ()
    # values in a while loop's predicate are not sites (harvest cannot thread them)
    assert not any(s.primitive == "lt" for s in sites.values())


def test_names_are_unique_and_stable_across_traces():
    first = [s.name for s in tx.sites(layers, X)]
    assert len(first) == len(set(first))
    assert [s.name for s in tx.sites(layers, jax.ShapeDtypeStruct((2,), jnp.float32))] == first


def test_source_names_the_users_line_also_inside_jit_bodies():
    @jax.jit
    def inner(v):
        return jnp.tanh(v)

    def f(x):
        return inner(x * 2.0)  # the line of the multiplication
    sites = by_name(tx.sites(f, X))
    here = os.path.basename(__file__)
    assert sites["mul"].source.startswith(f"{here}:") and sites["mul"].function.endswith("<locals>.f")
    assert sites["mul"].file == __file__
    # tanh's own equation is JAX's: the call's line is where it comes from
    assert sites["tanh"].file == __file__


def test_leaves_lists_the_scopes_a_value_is_used_outside_of():
    def f(x):
        with jax.named_scope("block_0"):
            with jax.named_scope("fc"):
                a = jnp.sin(x) * 2.0
            b = a + 1.0
        with jax.named_scope("block_1"):
            return jnp.sum(b * a)
    sites = by_name(tx.sites(f, X))
    assert sites["block_0/fc/sin"].leaves == ()
    assert sites["block_0/fc/mul"].leaves == ("block_0", "block_0/fc")
    assert sites["block_0/add"].leaves == ("block_0",)
    assert sites["block_1/reduce_sum"].leaves == ("block_1",)  # the program's output


def test_leaves_of_a_scan_body_is_the_value_carried_to_the_next_iteration():
    def f(x):
        def body(c, _):
            with jax.named_scope("block"):
                return jnp.sin(c) * 2.0, None
        return jax.lax.scan(body, x, None, length=4)[0]
    sites = by_name(tx.sites(f, X))
    assert sites["block/mul"].leaves == ("block",) and sites["block/sin"].leaves == ()


def test_equations_with_several_outputs_have_a_site_each():
    def f(x):
        return jax.lax.sort((x, -x), num_keys=1)
    assert [s.name for s in tx.sites(f, X) if s.primitive == "sort"] == ["sort#0", "sort#1"]


def test_sites_of_a_traced_program_are_those_of_its_function():
    closed = jax.make_jaxpr(layers)(X)
    assert [s.name for s in tx.sites(closed)] == [s.name for s in tx.sites(layers, X)]
    with pytest.raises(TypeError, match="takes no arguments"):
        tx.sites(closed, X)


def test_sites_of_a_program_with_no_equation_is_empty():
    assert tx.sites(lambda x: x, X) == ()

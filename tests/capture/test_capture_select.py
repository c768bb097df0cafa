"""taxpr.select: globs, predicates, helpers and their combinations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import taxpr as tx
from taxpr import select as S

X = jnp.array([0.3, -0.2])


def f(x):
    with jax.named_scope("enc"):
        with jax.named_scope("fc1"):
            a = jnp.sin(x) * 2.0
        with jax.named_scope("fc2"):
            b = jnp.cos(a) + a
    with jax.named_scope("dec"):
        c = b.astype(jnp.float16)
        return jnp.sum(c * c)


def chosen(selector):
    from taxpr._capture._select import select
    return [s.name for s in select(tx.sites(f, X), selector, "capture")]


def test_a_glob_over_names():
    assert chosen("enc/*/mul") == ["enc/fc1/mul"]
    assert chosen("enc/fc?/*") == ["enc/fc1/sin", "enc/fc1/mul", "enc/fc2/cos", "enc/fc2/add"]


def test_helpers_by_scope_primitive_shape_dtype_and_source():
    assert chosen(S.scope("enc/fc2")) == ["enc/fc2/cos", "enc/fc2/add"]
    assert chosen(S.primitive("sin", "cos")) == ["enc/fc1/sin", "enc/fc2/cos"]
    # jnp.sum of float16 accumulates in float32 and converts back
    assert chosen(S.shape(())) == ["dec/reduce_sum", "dec/convert_element_type:2"]
    assert chosen(S.dtype(jnp.float16)) == ["dec/convert_element_type", "dec/mul",
                                            "dec/convert_element_type:2"]
    assert chosen(S.source(file="test_capture_select.py", function="f") & S.primitive("mul")
                  ) == ["enc/fc1/mul", "dec/mul"]
    line = [s for s in tx.sites(f, X) if s.name == "enc/fc2/cos"][0].line
    assert chosen(S.source(line=line)) == ["enc/fc2/cos", "enc/fc2/add"]


def test_leaving_selects_what_code_outside_a_scope_uses():
    assert chosen(S.leaving("enc/fc*")) == ["enc/fc1/mul", "enc/fc2/add"]
    assert chosen(S.leaving("enc")) == ["enc/fc2/add"]


def test_combinations_and_predicates():
    assert chosen(S.scope("enc/*") & ~S.primitive("sin", "cos")) == ["enc/fc1/mul", "enc/fc2/add"]
    assert chosen(S.primitive("sin") | "dec/mul") == ["enc/fc1/sin", "dec/mul"]
    assert chosen(lambda s: s.primitive == "reduce_sum") == ["dec/reduce_sum"]


def test_a_selector_of_the_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="a selector is a glob"):
        tx.capture(f, 3)(X)


def _two_blocks(block):
    def f(x):
        for i in range(2):
            with jax.named_scope(f"block{i}"):
                x = block(x)
        return x
    return f


def test_leaving_in_blocks_that_share_one_traced_jit_body():
    # jnp.tril and jnp.where are jits: both blocks call the same traced jaxpr
    def block(x):
        m = jnp.tril(jnp.ones((3, 3), bool))
        return x + jnp.where(m, x, 0.0)

    x = jnp.arange(9.0).reshape(3, 3)
    out, got = tx.capture(_two_blocks(block), S.leaving("block0"))(x)
    assert sorted(got) == ["block0/add:1"]
    assert jnp.array_equal(got["block0/add:1"], block(x))  # the value, computed by hand


def test_leaving_in_blocks_that_call_one_user_jitted_function():
    @jax.jit
    def block(x):
        with jax.named_scope("inner"):
            return jnp.tanh(x @ jnp.eye(3) * 0.5) + x

    x = jnp.arange(9.0).reshape(3, 3)
    # one value leaves each block: its result (the last add; jnp.eye adds too)
    _, got = tx.capture(_two_blocks(block), S.leaving("block0"))(x)
    assert list(got) == ["block0/inner/add:1"]
    assert jnp.allclose(got["block0/inner/add:1"], block(x))
    _, got = jax.jit(tx.capture(_two_blocks(block), S.leaving("block1")))(x)
    assert list(got) == ["block1/inner/add:1"]
    assert jnp.allclose(got["block1/inner/add:1"], block(block(x)))


def test_a_value_returned_from_a_scan_body_leaves_its_scope():
    def lstm_like(xs):
        def cell(carry, x):
            c, h = carry
            with jax.named_scope("cell"):
                c = 0.5 * c + x  # the new cell state: returned from the body
                h = jnp.tanh(c)
            return (c, h), h
        return jax.lax.scan(cell, (0.0, 0.0), xs)[1]

    leaves = {s.name: s.leaves for s in tx.sites(lstm_like, jnp.ones(3))}
    assert leaves["cell/add"] == ("cell",) and leaves["cell/tanh"] == ("cell",)
    assert leaves["cell/mul"] == ()
    xs = jnp.array([1.0, 2.0, -1.0])
    _, got = tx.capture(lstm_like, S.leaving("cell"))(xs)
    c, cs = 0.0, []
    for x in xs:  # the cell states, by hand
        c = 0.5 * c + x
        cs.append(c)
    assert jnp.allclose(got["cell/add"], jnp.array(cs))

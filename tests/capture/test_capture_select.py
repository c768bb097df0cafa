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

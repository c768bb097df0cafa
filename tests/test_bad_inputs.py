"""A table of bad inputs. Each raises a clear error that names the
tag or state and where it is; afterwards JAX's trace state is clean and
unrelated JAX code still works."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core
from jax.extend.core import Primitive
from jax.sharding import PartitionSpec as P

import taxpr as tx
from taxpr import harvest as h

from helpers import cpu_mesh

shard_map = getattr(jax, "shard_map", None)
if shard_map is None:  # pragma: no cover - older JAX
    from jax.experimental.shard_map import shard_map


def _in_scan(inner):
    """``inner`` applied to the carry of a 2-step scan (the path names it)."""
    return lambda x: jax.lax.scan(lambda c, _: (inner(c), None), x, None, length=2)[0]


def _inject(injector, ctx=np.float32(0.0), op="a"):
    f = _in_scan(lambda c: tx.tag(c, op=op) * 2)
    return lambda: tx.inject(jax.make_jaxpr(f)(1.0), injector, ctx)


# An unknown higher-order primitive holding a jaxpr, with no implementation
# taxpr could run instead (one with an implementation runs through it: see
# tests/test_expand.py).
_unknown_p = Primitive("my_unknown_hop")
_unknown_p.multiple_results = True
_unknown_p.def_abstract_eval(lambda *a, jaxpr: [v.aval for v in jaxpr.jaxpr.outvars]
                             if hasattr(jaxpr, "jaxpr") else list(jaxpr.out_avals))


def _unknown_hop():
    inner = jax.make_jaxpr(lambda x: tx.tag(x, op="a") + 1)(1.0)
    f = lambda x: _unknown_p.bind(x, jaxpr=inner)[0]
    return lambda: tx.inject(jax.make_jaxpr(f)(1.0), lambda c, t, p: (t, c), np.float32(0))


def _state(fn, *args):
    return lambda: tx.uncurry(fn, *args)


def _shard_map_ctx():
    mesh = cpu_mesh("x")
    f = shard_map(lambda x: x + tx.tag(jnp.sum(x), op="store"), mesh=mesh,
                  in_specs=P("x"), out_specs=P("x"))
    return lambda: tx.injected(f, lambda c, t, p: (t, c + t))(np.float32(0), jnp.arange(8.0))


def _set_twice_shapes(x):
    tx.set_state("s", jnp.zeros(3))
    return jax.lax.scan(lambda c, _: (tx.set_state("s", jnp.zeros(2)) .sum() + c, None),
                        x, None, length=2)[0]


CASES = {
    # name: (thunk, exception, message pattern naming the tag/state and place)
    "injector token structure": (
        _inject(lambda c, t, p: ((t, t), c)), tx.InjectError,
        r"op='a'.*scan\[length=2\].*structure"),
    "injector token shape": (
        _inject(lambda c, t, p: (jnp.zeros(3), c)), tx.InjectError,
        r"op='a'.*scan\[length=2\].*value leaf 0.*float32\[3\]"),
    "injector token dtype": (
        _inject(lambda c, t, p: (t.astype(jnp.int32), c)), tx.InjectError,
        r"op='a'.*scan\[length=2\].*int32"),
    "injector ctx structure": (
        _inject(lambda c, t, p: (t, (c, c))), tx.InjectError,
        r"op='a'.*scan\[length=2\].*ctx of structure"),
    "injector ctx shape": (
        _inject(lambda c, t, p: (t, jnp.zeros(2))), tx.InjectError,
        r"op='a'.*scan\[length=2\].*ctx leaf 0"),
    "injector ctx dtype": (
        _inject(lambda c, t, p: (t, c.astype(jnp.int32))), tx.InjectError,
        r"op='a'.*ctx leaf 0.*int32"),
    "injector not a pair": (
        _inject(lambda c, t, p: t), tx.InjectError, r"op='a'.*tx\.Injected\(value=\.\.\., ctx=\.\.\.\)"),
    "batched token into ctx": (
        lambda: tx.injected(jax.vmap(lambda x: tx.tag(x, op="set")),
                            lambda c, t, p: (t, t))(np.float32(0), jnp.ones(3)),
        tx.InjectError, r"op='set'.*batched"),
    "unhashable tag param": (
        lambda: tx.tag(1.0, p=[1]), TypeError, r"'p'"),
    "unknown higher-order primitive": (
        _unknown_hop(), NotImplementedError, r"'my_unknown_hop' at <top level>: it holds "
                                             r"tag\(op='a'\)"),
    "ctx varying across shard_map shards": (
        _shard_map_ctx(), tx.InjectError, r"op='store'.*shard_map.*differ across the shards"),
    "state set with wrong shape": (
        _state(_set_twice_shapes, 1.0), tx.StateError, r"'s'.*scan\[length=2\]"),
    "pytree state set with another structure": (
        _state(lambda x: tx.set_state("t", tx.get_state("t", (x, x)) + (x,))[0], jnp.ones(())),
        tx.StateError, r"state 't': set_state\('t'\).*leaf t\[2\] is new"),
    "pytree state set to one array": (
        _state(lambda x: tx.set_state("d", tx.get_state("d", {"mean": x, "var": x})["mean"]),
               jnp.ones(())),
        tx.StateError, r"state 'd': set_state\('d'\).*one array.*get_state\('d'\).*pytree"),
    "pytree state passed with another structure": (
        lambda: tx.uncurry(lambda x: tx.get_state("p", {"a": x})["a"], 1.0)[0](
            {"p": {"b": jnp.ones(())}}, 1.0),
        tx.StateError, r"state 'p' must have structure.*no leaf p\['a'\]"),
    "state set with wrong dtype": (
        _state(lambda x: tx.set_state("n", tx.get_state("n", jnp.zeros((), jnp.int32)) + 0.5),
               1.0), tx.StateError, r"'n'.*int32.*float32|'n'.*float32.*int32"),
    "batched set under vmap": (
        _state(lambda xs: jax.vmap(lambda x: tx.set_state("last", x))(xs), jnp.zeros(3)),
        tx.StateError, r"'last'.*batched"),
    "wrong state passed to pure": (
        lambda: tx.uncurry(lambda x: tx.get_state("c", 0.0) + x, 1.0)[0]({"c": jnp.ones(2)}, 1.0),
        tx.StateError, r"'c'"),
    "strict double sow": (
        lambda: h.reap(lambda x: h.sow(x, tag="t", name="x") + h.sow(x, tag="t", name="x"),
                       tag="t")(1.0),
        ValueError, r"^Variable has already been reaped: x\s*($|\n)"),
    "append sow in while": (
        lambda: h.reap(lambda x: jax.lax.while_loop(
            lambda c: c < 3, lambda c: h.sow(c + 1, tag="t", name="w", mode="append"), x),
            tag="t")(0.0),
        ValueError, r"'w' inside of a `while_loop`"),
    "plant with wrong shape": (
        lambda: h.plant(lambda x: h.sow(x * 2, tag="t", name="y") + 1, tag="t")(
            {"y": jnp.ones(3)}, 1.0),
        ValueError, r"Planted value for 'y'"),
    "cond branches sow differently": (
        lambda: h.reap(lambda x: jax.lax.cond(x > 0, lambda: h.sow(x, tag="t", name="b"),
                                              lambda: h.sow(jnp.ones(2).sum(), tag="t",
                                                            name="c")), tag="t")(1.0),
        ValueError, r"Missing sow in branch: '[bc]'\."),
}


def _jax_still_works():
    assert core.trace_state_clean()
    assert float(jax.jit(lambda x: x * 2)(1.0)) == 2.0
    assert float(jax.grad(lambda x: jnp.sin(x) * x)(0.0)) == 0.0
    closed = jax.make_jaxpr(lambda x: x + 1)(1.0)
    assert [e.primitive.name for e in closed.jaxpr.eqns] == ["add"]


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_clear_error_and_jax_still_works(case):
    thunk, exc, pattern = CASES[case]
    with pytest.raises(exc, match=pattern):
        thunk()
    _jax_still_works()


@pytest.mark.parametrize("case", ["injector token shape", "state set with wrong shape",
                                  "strict double sow", "plant with wrong shape"])
def test_bad_input_inside_jit_raises_and_jax_still_works(case):
    thunk, exc, pattern = CASES[case]
    with pytest.raises(exc, match=pattern):
        jax.jit(lambda x: (thunk(), x)[1])(1.0)
    _jax_still_works()

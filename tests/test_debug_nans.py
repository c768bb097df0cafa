"""``tx.debug_nans``: where a NaN or an infinity was born.

Each program is built so that the origin is known by construction: the
primitive, the line (found in this file by its marker comment), the loop
iteration, the vmap example, the pass. The reference for "no error" is the
same function without the wrapper, compared bit for bit.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx


def _line(marker: str) -> str:
    """``"test_debug_nans.py:N"``: the line of this file holding ``marker``."""
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()
    n = next(i for i, text in enumerate(lines, 1) if marker in text and "_line(" not in text)
    return f"test_debug_nans.py:{n}"


def _simulate(x):
    """log(x - 0.1 i) over 12 steps: negative from the step where
    0.1 i > x."""
    def step(c, i):
        return c, jnp.log(c - 0.1 * i)  # origin: log
    return lax.scan(step, x, jnp.arange(12.0))[1].sum()


def _first_bad_step(x: float) -> int:
    return next(i for i in range(12) if np.float32(x) - np.float32(0.1) * np.float32(i) < 0)


def test_finite_outputs_are_returned_bit_for_bit():
    f = tx.debug_nans(_simulate)
    for x in (2.0, 5.0):
        np.testing.assert_array_equal(np.asarray(f(jnp.float32(x))),
                                      np.asarray(jax.jit(_simulate)(jnp.float32(x))))


@pytest.mark.parametrize("outer_jit", [False, True])
def test_log_of_a_value_turning_negative_in_a_scan(outer_jit):
    f = tx.debug_nans(_simulate)
    x = jnp.float32(0.75)
    if not outer_jit:
        with pytest.raises(tx.NonFiniteError) as info:
            f(x)
        e = info.value
        assert (e.kind, e.primitive, e.phase, e.example) == ("NaN", "log", "forward", None)
        assert e.source.startswith(_line("origin: log"))
        assert e.path == ("scan[length=12]",)
        assert e.iterations == (("scan", _first_bad_step(0.75)),)
        return
    g = jax.jit(f)
    for _ in range(2):  # a warm second call reports again
        # Under an outer jit the error is raised by a host callback: JAX
        # reports it as its runtime error, with the report's message.
        with pytest.raises(Exception, match=r"NaN produced by `log` at "
                           + _line("origin: log") + r".*scan iteration 8"):
            g(x)
            jax.effects_barrier()


def test_vmap_names_the_example():
    xs = jnp.array([2.0, 3.0, 1.5, 0.75, 5.0], jnp.float32)  # example 3 fails first at step 8
    with pytest.raises(tx.NonFiniteError) as info:
        jax.vmap(tx.debug_nans(_simulate))(xs)
    e = info.value
    assert (e.primitive, e.example, e.iterations) == ("log", 3, (("scan", 8),))


def test_exp_overflow_is_an_inf_only_with_inf():
    def f(x):
        return jnp.exp(x * 2.0) + 1.0  # origin: exp
    x = jnp.float32(60.0)
    with pytest.raises(tx.NonFiniteError) as info:
        tx.debug_nans(f)(x)
    assert (info.value.kind, info.value.primitive) == ("inf", "exp")
    assert info.value.source.startswith(_line("origin: exp"))
    assert info.value.inputs == ("input 0 = 120.0",)
    assert np.isinf(np.asarray(tx.debug_nans(f, inf=False)(x)))


def test_a_masked_nan_is_not_reported():
    def f(x):
        return jnp.where(x > 0, jnp.log(x), 0.0).sum()
    x = jnp.array([-1.0, 2.0])
    np.testing.assert_array_equal(np.asarray(tx.debug_nans(f)(x)), np.asarray(f(x)))


def test_an_untaken_branch_under_vmap_is_not_reported():
    def f(x):
        return lax.cond(x > 0, jnp.log, lambda x: x * 0.0, x)
    xs = jnp.array([-1.0, 2.0])
    np.testing.assert_array_equal(np.asarray(jax.vmap(tx.debug_nans(f))(xs)),
                                  np.asarray(jax.vmap(f)(xs)))
    np.testing.assert_array_equal(np.asarray(tx.debug_nans(jax.vmap(f))(xs)),
                                  np.asarray(jax.vmap(f)(xs)))


def test_the_earliest_of_two_origins_in_a_cond_branch():
    def f(x):
        a = lax.cond(x[0] > 0, lambda x: jnp.sqrt(x), lambda x: x, x)  # origin: sqrt
        b = jnp.log(x)
        return (a + b).sum()
    with pytest.raises(tx.NonFiniteError) as info:
        tx.debug_nans(f)(jnp.array([1.0, -1.0]))
    e = info.value
    assert (e.primitive, e.path) == ("sqrt", ("cond[branch=1]",))
    assert e.inputs == ("input 0: float32[2], at [1] = -1.0",)


def test_a_nan_gradient_through_where_is_born_in_the_backward_pass():
    # The classic: the primal is masked, the cotangent of the masked x / y
    # w.r.t. x is 0 / 0 in the transpose of div.
    def f(x, y):
        return jnp.where(y == 0.0, 0.0, x / y).sum()  # origin: div
    x, y = jnp.array([1.0, 2.0]), jnp.array([1.0, 0.0])
    assert float(tx.debug_nans(f)(x, y)) == 1.0
    for g in (tx.debug_nans(jax.grad(f)), jax.grad(tx.debug_nans(f))):
        with pytest.raises(tx.NonFiniteError) as info:
            g(x, y)
        e = info.value
        assert (e.kind, e.primitive, e.phase) == ("NaN", "div", "backward")
        assert e.source.startswith(_line("origin: div"))
    # Under jit, the backward pass's callback raises: JAX's runtime error.
    with pytest.raises(Exception, match=r"NaN produced by `div` at "
                       + _line("origin: div") + r".*backward pass"):
        jax.jit(jax.grad(tx.debug_nans(f)))(x, y)
        jax.effects_barrier()


def test_sqrt_at_zero_is_infinite_in_the_derivative_only():
    def f(x):
        return jnp.sqrt(x).sum()  # origin: sqrt's derivative
    x = jnp.array([1.0, 0.0])
    assert float(tx.debug_nans(f)(x)) == 1.0
    with pytest.raises(tx.NonFiniteError) as info:
        tx.debug_nans(jax.grad(f))(x)
    e = info.value
    # (the derivative's 0.5 / sqrt(x), computed in the forward pass of grad)
    assert (e.kind, e.primitive, e.phase) == ("inf", "div", "forward")
    assert e.source.startswith(_line("origin: sqrt's derivative"))


def test_a_nan_in_a_custom_jvp_rule():
    @jax.custom_jvp
    def act(x):
        return x * 2.0

    @act.defjvp
    def act_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return act(x), t * jnp.log(x)  # origin: the rule's log

    f = lambda x: act(x).sum()  # noqa: E731
    x = jnp.array([1.0, -1.0])
    assert float(tx.debug_nans(f)(x)) == 0.0
    with pytest.raises(tx.NonFiniteError) as info:
        tx.debug_nans(jax.grad(f))(x)
    assert info.value.primitive == "log"
    assert info.value.source.startswith(_line("origin: the rule's log"))


def test_while_loop_iteration_and_nested_jit():
    @jax.jit
    def inner(c):
        return c - 1.0, jnp.sqrt(c - 1.0)  # origin: sqrt in a while

    def f(x):
        def body(carry):
            c, acc = carry
            c, r = inner(c)
            return c, acc + r
        return lax.while_loop(lambda carry: carry[0] > -2.0, body, (x, 0.0))[1]

    with pytest.raises(tx.NonFiniteError) as info:
        tx.debug_nans(f)(jnp.float32(2.5))  # c - 1: 1.5, 0.5, -0.5 -> NaN at iteration 2
    e = info.value
    assert e.primitive == "sqrt" and e.iterations == (("while", 2),)
    assert e.path[-1] == "jit[inner]" and e.path[0].startswith("while")


def test_a_nan_in_a_custom_vjp_bwd_is_in_the_backward_pass():
    @jax.custom_vjp
    def act(x):
        return x * 2.0

    def fwd(x):
        return act(x), x

    def bwd(x, g):
        return (g * jnp.log(x),)

    act.defvjp(fwd, bwd)

    def f(x):
        return act(x).sum()  # the call: JAX traces the bwd with its source

    x = jnp.array([1.0, -1.0])
    assert float(tx.debug_nans(f)(x)) == 0.0
    with pytest.raises(tx.NonFiniteError) as info:
        tx.debug_nans(jax.grad(f))(x)
    e = info.value
    assert (e.primitive, e.phase) == ("log", "backward")
    assert e.source.startswith(_line("the call: JAX traces the bwd"))


_shard_map = getattr(jax, "shard_map", None)
if _shard_map is None:  # (JAX without jax.shard_map)
    from jax.experimental.shard_map import shard_map as _shard_map


def _mesh():
    from jax.sharding import Mesh
    return Mesh(np.array(jax.devices()[:4]), ("d",))


def test_a_nan_in_a_shard_map_body_names_the_shard():
    # 8 values over 4 shards of 2: log(4.5 - x) is first NaN at x = 5, in
    # shard 5 // 2 = 2.
    from jax.sharding import PartitionSpec as P

    def f(x):
        def body(b):
            return jnp.log(4.5 - b) * 2.0  # origin: shard body
        return _shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=P("d"))(x).sum()

    x = jnp.arange(8.0)
    first_bad = next(i for i in range(8) if 4.5 - i < 0)
    with pytest.raises(tx.NonFiniteError) as info:
        tx.debug_nans(f)(x)
    e = info.value
    assert (e.primitive, e.phase, e.iterations) == ("log", "forward", (("shard", first_bad // 2),))
    assert e.path[-1].startswith("shard_map") and e.source.startswith(_line("origin: shard body"))
    with pytest.raises(Exception, match=r"NaN produced by `log` at "
                       + _line("origin: shard body") + r".*shard 2"):
        jax.jit(tx.debug_nans(f))(x)
        jax.effects_barrier()
    np.testing.assert_array_equal(np.asarray(tx.debug_nans(f)(x - 4.0)),
                                  np.asarray(jax.jit(f)(x - 4.0)))


def test_a_nan_in_a_shard_map_body_with_a_collective_is_the_shard_maps():
    # A body calling psum runs for all shards at once: the origin is the
    # shard_map equation itself.
    from jax.sharding import PartitionSpec as P

    def f(x):
        def body(b):
            return jax.lax.psum(jnp.log(b), "d")
        return _shard_map(body, mesh=_mesh(), in_specs=P("d"), out_specs=P())(x).sum()

    x = jnp.arange(8.0) - 1.0
    with pytest.raises(tx.NonFiniteError) as info:
        tx.debug_nans(f)(x)
    assert (info.value.primitive, info.value.phase) == ("shard_map", "forward")
    good = jnp.arange(8.0) + 1.0
    np.testing.assert_allclose(np.asarray(tx.debug_nans(f)(good)),
                               np.log(np.arange(8.0) + 1.0).sum() * 1, rtol=1e-6)

"""The data-dependence analysis (`taxpr._dependence`): which outputs of a
jaxpr depend on which inputs, through nested jaxprs, where JAX's dead-code
elimination keeps more than the dataflow needs. Each expectation is read off
the program by hand."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from taxpr import _dependence
from taxpr._replay import replay_read_p


def _dep(fn, *args, tainted):
    closed = jax.make_jaxpr(fn)(*args)
    return _dependence.dependence(closed, tainted)


def test_elementwise_outputs_follow_their_inputs():
    dep = _dep(lambda a, b: (a * 2.0, jnp.sin(b), a + b), 1.0, 2.0, tainted=[True, False])
    assert dep.outputs == (True, False, True)
    assert not dep.reaches_effect


def test_a_while_carry_that_never_mixes_with_the_chosen_one_does_not_depend_on_it():
    # (i, counter, x): the counter is incremented, x doubled; neither mixes.
    def f(counter, x):
        return lax.while_loop(lambda c: c[0] < 3,
                              lambda c: (c[0] + 1, c[1] + 1, c[2] * 2.0), (0, counter, x))
    assert _dep(f, 0, 1.0, tainted=[True, False]).outputs == (False, True, False)
    assert _dep(f, 0, 1.0, tainted=[False, True]).outputs == (False, False, True)


def test_a_while_carry_reaches_the_others_through_later_iterations():
    # x picks up the counter only from the second iteration on (via y).
    def f(counter, x):
        return lax.while_loop(lambda c: c[0] < 3,
                              lambda c: (c[0] + 1, c[1], c[2] + c[3], c[1] * 1.0),
                              (0, counter, x, 0.0))
    assert _dep(f, 0, 1.0, tainted=[True, False]).outputs == (False, True, True, True)


def test_a_while_predicate_on_the_chosen_input_makes_every_output_depend():
    def f(n, x):
        return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 2.0), (0, x))
    assert _dep(f, 3, 1.0, tainted=[True, False]).outputs == (True, True)


def test_scan_carries_reach_a_fixed_point_and_ys_follow():
    def f(a, b):
        def body(c, x):
            return (c[1], c[0] + x), c[0]
        return lax.scan(body, (a, b), jnp.arange(3.0))
    assert _dep(f, 1.0, 2.0, tainted=[True, False]).outputs == (True, True, True)
    # a carry swapped in each step reaches both; a fresh scan over a const does not
    assert _dep(lambda a, b: lax.scan(lambda c, x: (c * 2.0, c), b, None, length=2),
                1.0, 2.0, tainted=[True, False]).outputs == (False, False)


def test_cond_outputs_are_the_union_of_the_branches_and_the_index_reaches_all():
    def f(p, a, b):
        return lax.cond(p, lambda a, b: (a, 1.0), lambda a, b: (b, 2.0), a, b)
    assert _dep(f, True, 1.0, 2.0, tainted=[False, True, False]).outputs == (True, False)
    assert _dep(f, True, 1.0, 2.0, tainted=[True, False, False]).outputs == (True, True)


def test_a_custom_vjp_call_follows_its_function_not_all_its_inputs():
    @jax.custom_vjp
    def g(x, unused):
        return x * 2.0

    g.defvjp(lambda x, u: (g(x, u), None), lambda _, ct: (2.0 * ct, jnp.zeros(())))
    dep = _dep(lambda x, u: g(x, u), 1.0, 2.0, tainted=[False, True])
    assert dep.outputs == (False,)
    # JAX's DCE keeps every input of the call: the case the analysis exists for
    assert _dep(lambda x, u: g(x, u), 1.0, 2.0, tainted=[True, False]).outputs == (True,)


def test_jit_and_checkpoint_calls_are_followed_inside():
    f = jax.jit(lambda a, b: (a + 1.0, b))
    h = jax.checkpoint(lambda a, b: (a * b, b))
    assert _dep(f, 1.0, 2.0, tainted=[True, False]).outputs == (True, False)
    assert _dep(h, 1.0, 2.0, tainted=[False, True]).outputs == (True, True)
    assert _dep(h, 1.0, 2.0, tainted=[True, False]).outputs == (True, False)


def test_a_value_reaching_a_callback_reaches_an_effect():
    def f(a, b):
        jax.debug.callback(lambda v: None, a)
        return b

    assert _dep(f, 1.0, 2.0, tainted=[True, False]) == _dependence.Dependence((False,), True)
    assert _dep(f, 1.0, 2.0, tainted=[False, True]) == _dependence.Dependence((True,), False)
    # inside a loop too
    g = lambda a, b: lax.fori_loop(0, 2, lambda i, c: (f(c[0], c[1]), c[1]), (a, b))  # noqa: E731
    assert _dep(g, 1.0, 2.0, tainted=[True, False]).reaches_effect


def test_sources_inside_nested_jaxprs_taint_what_they_reach():
    def f(a, b):
        def body(c, _):
            return (replay_read_p.bind(c[0], index=0, scope=0) + 1.0, c[1] * 2.0), None
        return lax.scan(body, (a, b), None, length=2)[0]
    closed = jax.make_jaxpr(f)(1.0, 2.0)
    dep = _dependence.dependence(closed, [False, False], source=lambda e: e.primitive is replay_read_p)
    assert dep.outputs == (True, False)


def test_references_make_everything_depend():
    if not hasattr(jax, "new_ref"):
        pytest.skip("JAX without mutable array references")
    def f(a, b):
        r = jax.new_ref(b)
        r[...] = a
        return r[...], b
    dep = _dep(f, np.float32(1.0), np.float32(2.0), tainted=[True, False])
    assert dep.outputs[0]

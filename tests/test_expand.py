"""Operations taxpr threads through their implementation (taxpr/_expand.py):
primitives with jaxprs in params but no thread rule (``lax.custom_linear_solve``,
``custom_vmap``), run as JAX runs them eagerly, with clear errors for the
transformations from outside that the implementation does not stand for."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx
from taxpr import _jaxpr, _traverse
from taxpr import harvest as h

A = np.array([[4.0, 1.0], [1.0, 3.0]], np.float32)
B = np.array([1.0, 2.0], np.float32)
STEPS = 40


def _richardson(matvec, b):
    return lax.fori_loop(0, STEPS, lambda i, x: x + 0.1 * (b - matvec(x)), jnp.zeros_like(b))


def _python_richardson(scale, b):
    x = np.zeros(2, np.float32)
    for _ in range(STEPS):
        x = x + 0.1 * (b - scale * A @ x)
    return x


def _counted_solve(b):
    """A linear solve whose matvec reads a scale and counts its calls."""
    def matvec(x):
        tx.set_state("evals", tx.get_state("evals", jnp.zeros((), jnp.int32)) + 1)
        return tx.get_state("scale", jnp.float32(1.0)) * (A @ x)

    return lax.custom_linear_solve(matvec, b, _richardson, symmetric=True)


def _primitives(closed):
    return {e.primitive.name for e, _ in _traverse.iter_eqns(closed)}


def test_custom_linear_solve_runs_its_solve_as_a_python_loop():
    pure, s0 = tx.uncurry(_counted_solve, B)
    s = dict(s0, scale=jnp.float32(2.0), evals=jnp.int32(5))
    x, s1 = jax.jit(pure)(s, B)
    np.testing.assert_allclose(x, _python_richardson(2.0, B), rtol=1e-5)
    # the solve's matvec calls, once each, after the 5 already counted; the
    # matvec kept for the derivative rule never runs
    assert int(s1["evals"]) == 5 + STEPS


def test_custom_linear_solve_under_vmap_of_pure_over_states():
    pure, s0 = tx.uncurry(_counted_solve, B)
    scales = jnp.array([1.0, 2.0, 4.0], jnp.float32)
    xs, s1 = jax.vmap(pure, in_axes=({"scale": 0, "evals": None}, None))(
        dict(s0, scale=scales), B)
    for i, scale in enumerate([1.0, 2.0, 4.0]):
        np.testing.assert_allclose(xs[i], _python_richardson(scale, B), rtol=1e-5)
    np.testing.assert_array_equal(s1["evals"], [STEPS] * 3)


def test_custom_linear_solve_grad_inside_pure_matches_hand_threaded():
    def loss(b):
        return _counted_solve(b).sum()

    pure, s0 = tx.uncurry(lambda b: jax.grad(loss)(b), B)
    g, s1 = pure(dict(s0, scale=jnp.float32(2.0)), B)

    def hand(b):  # the same solve, the scale passed in
        return lax.custom_linear_solve(lambda x: 2.0 * (A @ x), b, _richardson,
                                       symmetric=True).sum()

    np.testing.assert_allclose(g, jax.grad(hand)(jnp.asarray(B)), rtol=1e-5)


def test_custom_linear_solve_differentiated_from_outside_is_a_clear_error():
    pure, s0 = tx.uncurry(_counted_solve, B)
    with pytest.raises(NotImplementedError,
                       match=r"differentiating through '(custom_)?linear_solve' at .* holds "
                             r"tag\(op=state\.(get|set), name='(evals|scale)'\)"):
        jax.grad(lambda b: pure(s0, b)[0].sum())(B)
    # the forward values need no derivative
    x, _ = pure(s0, B)
    np.testing.assert_allclose(x, _python_richardson(1.0, B), rtol=1e-5)


def test_custom_linear_solve_reap_and_plant_of_a_sow_in_matvec():
    def solve(b):
        def matvec(x):
            return h.sow(jnp.float32(1.0), tag="ls", name="scale", mode="clobber") * (A @ x)
        return lax.custom_linear_solve(matvec, b, _richardson, symmetric=True)

    out, reaped = h.call_and_reap(solve, tag="ls")(B)
    np.testing.assert_allclose(out, _python_richardson(1.0, B), rtol=1e-5)
    assert float(reaped["scale"]) == 1.0
    planted = h.plant(solve, tag="ls")({"scale": jnp.float32(2.0)}, B)
    np.testing.assert_allclose(planted, _python_richardson(2.0, B), rtol=1e-5)


def test_an_operation_whose_tags_are_not_consumed_keeps_its_rules():
    # The state transformation leaves a custom_linear_solve holding only a
    # sow as it is: its derivative rule still applies to `pure`.
    def solve(b):
        tx.set_state("seen", b.sum())
        return lax.custom_linear_solve(
            lambda x: h.sow(jnp.float32(2.0), tag="ls", name="s") * (A @ x), b, _richardson,
            symmetric=True)

    jaxpr, _ = tx.make_jaxpr_with_states(solve)(B)
    assert any(n in _primitives(jaxpr) for n in ("custom_linear_solve", "linear_solve"))
    pure, s0 = tx.uncurry(solve, B)
    g = jax.grad(lambda b: pure(s0, b)[0].sum())(jnp.asarray(B))

    def hand(b):
        return lax.custom_linear_solve(lambda x: 2.0 * (A @ x), b, _richardson,
                                       symmetric=True).sum()

    np.testing.assert_allclose(g, jax.grad(hand)(jnp.asarray(B)), rtol=1e-6)


@jax.custom_batching.custom_vmap
def _scaled(x):
    return x * tx.get_state("factor", jnp.float32(1.0))


@_scaled.def_vmap
def _scaled_rule(axis_size, in_batched, x):
    # differs from batching the function: a batch is scaled once more
    return 10.0 * x * tx.get_state("factor", jnp.float32(1.0)), in_batched[0]


def test_custom_vmap_runs_its_function_and_its_rule_under_vmap_inside():
    def f(xs):
        tx.set_state("factor", jnp.float32(3.0))
        return jax.vmap(_scaled)(xs), _scaled(xs[0])

    xs = jnp.arange(3.0)
    pure, s0 = tx.uncurry(f, xs)
    (batched, single), _ = pure(s0, xs)
    np.testing.assert_allclose(batched, 30.0 * np.arange(3.0))  # the rule ran
    np.testing.assert_allclose(single, 0.0)


def test_custom_vmap_vmapped_from_outside_is_a_clear_error():
    pure, s0 = tx.uncurry(lambda x: _scaled(x), jnp.float32(2.0))
    out, _ = pure(dict(s0, factor=jnp.float32(3.0)), jnp.float32(2.0))
    np.testing.assert_allclose(out, 6.0)
    with pytest.raises(NotImplementedError,
                       match=r"vmapping 'custom_vmap_call' at .* holds "
                             r"tag\(op=state\.get, name='factor'\)"):
        jax.vmap(pure, in_axes=(None, 0))(s0, jnp.arange(3.0))


def test_inject_expands_an_operation_in_a_jaxpr_made_by_the_user():
    def f(b):
        def matvec(x):
            return tx.tag(jnp.float32(1.0), kind="scale") * (A @ x)
        return lax.custom_linear_solve(matvec, b, _richardson, symmetric=True)

    with tx.keep_tags():
        closed = jax.make_jaxpr(f)(B)

    def injector(ctx, value, params):
        return value * ctx, ctx

    new = tx.inject(closed, injector, jnp.float32(2.0))
    x, ctx = _jaxpr.jaxpr_as_fun(new)(jnp.float32(2.0), B)
    np.testing.assert_allclose(x, _python_richardson(2.0, B), rtol=1e-5)
    assert float(ctx) == 2.0


def test_a_primitive_without_a_thread_rule_runs_through_its_implementation():
    from jax.extend.core import Primitive

    calls_p = Primitive("calls_its_jaxpr_twice")
    calls_p.multiple_results = True

    def impl(x, *, jaxpr):
        f = _jaxpr.jaxpr_as_fun(jaxpr)
        return f(*f(x))

    calls_p.def_impl(impl)
    calls_p.def_abstract_eval(lambda x, *, jaxpr: [x])

    def f(x):
        with tx.keep_tags():
            body = jax.make_jaxpr(lambda y: 2.0 * y + tx.get_state("n", jnp.float32(0.0)))(x)
        tx.set_state("n", jnp.float32(1.0))
        return calls_p.bind(x, jaxpr=body)[0]

    pure, s0 = tx.uncurry(f, jnp.float32(1.0))
    out, _ = pure(s0, jnp.float32(1.0))
    assert float(out) == 2.0 * (2.0 * 1.0 + 1.0) + 1.0  # the implementation's two calls


def test_custom_linear_solve_in_a_scan_and_an_untaken_branch_with_warm_caches():
    def f(b, pred):
        def step(c, _):
            x = _counted_solve(c)
            return c + 0.1 * x, None

        c, _ = lax.scan(step, b, None, length=3)
        # never taken here: its solve must count nothing
        return lax.cond(pred, lambda c: _counted_solve(c), lambda c: c, c)

    b = jnp.asarray(B)
    with pytest.warns(tx.StateNotUncurriedWarning):  # compiled without uncurry first:
        jax.jit(f)(b, False)  # JAX's trace caches are warm with the same functions
    pure, s0 = tx.uncurry(f, b, False)
    s = dict(s0, scale=jnp.float32(2.0), evals=jnp.int32(0))
    out, s1 = jax.jit(pure)(s, b, False)
    c = np.asarray(B)  # the Python loop
    for _ in range(3):
        c = c + 0.1 * _python_richardson(2.0, c)
    np.testing.assert_allclose(out, c, rtol=1e-5)
    assert int(s1["evals"]) == 3 * STEPS
    out, s1 = jax.jit(pure)(s, b, True)  # now taken: one more solve
    np.testing.assert_allclose(out, _python_richardson(2.0, c), rtol=1e-5)
    assert int(s1["evals"]) == 4 * STEPS

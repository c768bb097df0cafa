"""taxpr inside optimistix: Newton, LevenbergMarquardt and
FixedPointIteration on functions that read a state and count their
evaluations in another, grad through the implicit adjoint inside and from
outside `pure`, sows in the function.

References: the same solve without taxpr (the state's value as `args`), a
`jax.debug.callback` count of evaluations in that program, `sol.stats`,
closed forms.
"""
import pytest

optx = pytest.importorskip("optimistix")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import taxpr as tx  # noqa: E402
from taxpr import harvest as h  # noqa: E402

from ecohelpers import Counter, close  # noqa: E402

Y0 = jnp.array([1.0, 2.0])
TARGET = jnp.array([2.0, 4.5])  # scaled by 2.0: roots sqrt(4), sqrt(9)
SCALE = 2.0


def _solvers():
    return {
        "newton": lambda fn, y0, a: optx.root_find(fn, optx.Newton(rtol=1e-6, atol=1e-6), y0, a),
        "levenberg_marquardt": lambda fn, y0, a: optx.least_squares(
            fn, optx.LevenbergMarquardt(rtol=1e-6, atol=1e-6), y0, a),
    }


def _residual(y, scale, target):
    return y ** 2 - scale * target


def _stateful_fn(y, target):
    tx.set_state("ox_evals", tx.get_state("ox_evals", jnp.zeros((), jnp.int32)) + 1)
    return _residual(y, tx.get_state("ox_scale", jnp.float32(1.0)), target)


def _stateful(method):
    solve = _solvers()[method]

    def f(target):
        tx.set_state("ox_scale", jnp.float32(SCALE))
        return solve(_stateful_fn, Y0, target).value
    return f


def _reference(method, target=TARGET, grad=False):
    """The same solve without taxpr; `grad=True`: under jax.value_and_grad,
    as the test runs it inside `pure` (the implicit adjoint evaluates the
    function again at the root: the callback counts those too)."""
    counter = Counter()
    solve = _solvers()[method]

    def fn(y, target):
        counter.tick()
        return _residual(y, SCALE, target)

    if grad:
        value = jax.jit(jax.value_and_grad(lambda t: solve(fn, Y0, t).value.sum()))(target)
        jax.effects_barrier()
        return value, counter.n, None
    value, stats = jax.jit(lambda t: (lambda s: (s.value, s.stats))(solve(fn, Y0, t)))(target)
    jax.effects_barrier()
    return value, counter.n, int(stats["num_steps"])


@pytest.mark.parametrize("method", ["newton", "levenberg_marquardt"])
def test_solve_reads_state_and_counts_evaluations(method):
    pure, s0 = tx.uncurry(_stateful(method), TARGET)
    y, s1 = jax.jit(pure)(s0, TARGET)
    ref, evals, steps = _reference(method)
    close(y, ref, rtol=1e-5)
    close(y, [2.0, 3.0], rtol=1e-5)
    assert evals == steps  # the library's count and the callback's agree
    assert int(s1["ox_evals"]) == evals
    assert float(s1["ox_scale"]) == SCALE


@pytest.mark.parametrize("method", ["newton", "levenberg_marquardt"])
def test_grad_through_implicit_adjoint_from_outside(method):
    pure, s0 = tx.uncurry(_stateful(method), TARGET)
    g = jax.grad(lambda t: pure(s0, t)[0].sum())(TARGET)
    # y_i = sqrt(2 t_i): dy_i/dt_i = 1 / y_i
    close(g, [1.0 / 2.0, 1.0 / 3.0], rtol=1e-4)


@pytest.mark.parametrize("method", ["newton", "levenberg_marquardt"])
def test_grad_through_implicit_adjoint_inside(method):
    solve = _stateful(method)

    def f(target):
        return jax.value_and_grad(lambda t: solve(t).sum())(target)

    pure, s0 = tx.uncurry(f, TARGET)
    (val, g), s1 = pure(s0, TARGET)
    close(val, 5.0, rtol=1e-5)
    close(g, [1.0 / 2.0, 1.0 / 3.0], rtol=1e-4)
    (val_ref, g_ref), evals, _ = _reference(method, grad=True)
    close(g, g_ref, rtol=1e-5)
    _, forward_evals, _ = _reference(method)
    assert evals > forward_evals  # the adjoint evaluates the function at the root
    assert int(s1["ox_evals"]) == evals


def _fp_fn(y, a):
    tx.set_state("fp_evals", tx.get_state("fp_evals", jnp.zeros((), jnp.int32)) + 1)
    return jnp.cos(y) * tx.get_state("fp_scale", jnp.float32(1.0)) * a


def test_fixed_point_iteration_reads_state():
    def f(a):
        tx.set_state("fp_scale", jnp.float32(0.5))
        return optx.fixed_point(_fp_fn, optx.FixedPointIteration(rtol=1e-6, atol=1e-6),
                                jnp.array([0.5, 0.6]), a).value

    a = jnp.array([1.0, 2.0])
    pure, s0 = tx.uncurry(f, a)
    y, s1 = jax.jit(pure)(s0, a)

    counter = Counter()

    def fn(y, a):
        counter.tick()
        return jnp.cos(y) * 0.5 * a

    ref, stats = jax.jit(lambda a: (lambda s: (s.value, s.stats))(optx.fixed_point(
        fn, optx.FixedPointIteration(rtol=1e-6, atol=1e-6), jnp.array([0.5, 0.6]), a)))(a)
    jax.effects_barrier()
    close(y, ref, rtol=1e-6)
    close(y, jnp.cos(y) * 0.5 * a, rtol=1e-5)  # a fixed point of the scaled map
    assert int(s1["fp_evals"]) == counter.n
    assert counter.n >= int(stats["num_steps"]) > 3
    # Python loop: the same iteration with the state in a dict
    state, yy = {"fp_scale": 0.5, "fp_evals": 0}, np.array([0.5, 0.6])
    for _ in range(int(stats["num_steps"])):
        state["fp_evals"] += 1
        yy = np.cos(yy) * state["fp_scale"] * np.asarray(a)
    close(y, yy, rtol=1e-5)


def test_fixed_point_vmap_over_states():
    def f(a):
        return optx.fixed_point(_fp_fn, optx.FixedPointIteration(rtol=1e-6, atol=1e-6),
                                jnp.array([0.5]), a).value

    a = jnp.array([1.0])
    pure, s0 = tx.uncurry(f, a)
    scales = jnp.array([0.2, 0.5])
    ys, _ = jax.vmap(pure, in_axes=(0, None))(
        {"fp_scale": scales, "fp_evals": jnp.zeros(2, jnp.int32)}, a)
    for i, sc in enumerate([0.2, 0.5]):
        close(ys[i], jnp.cos(ys[i]) * sc, rtol=1e-5)


def _sowing_fn(y, target):
    scale = h.sow(jnp.float32(1.0), tag="ox", name="ox_scale", mode="clobber")
    return _residual(y, scale, target)


@pytest.mark.parametrize("method", ["newton", "levenberg_marquardt"])
def test_reap_and_plant_sow_in_function(method):
    solve = _solvers()[method]
    f = lambda t: solve(_sowing_fn, Y0, t).value  # noqa: E731
    out, reaped = h.call_and_reap(f, tag="ox")(TARGET)
    close(out, np.sqrt(np.asarray(TARGET)), rtol=1e-5)
    assert set(reaped) == {"ox_scale"} and float(reaped["ox_scale"]) == 1.0
    planted = h.plant(f, tag="ox")({"ox_scale": jnp.float32(SCALE)}, TARGET)
    close(planted, [2.0, 3.0], rtol=1e-5)

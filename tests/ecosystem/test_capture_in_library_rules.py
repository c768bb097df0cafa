"""tx.patch inside the custom derivative rules of libraries, differentiated
from outside: optimistix's implicit differentiation of a root (the patched
residual is what its rule differentiates) against the root of the residual
patched by hand; the relu of an equinox MLP and of a flax ``nn.remat``
block against the model with relu patched by hand; diffrax's adjoints,
whose rules run the solve again from their own Python code, a clear error
rather than the unpatched derivative (``DirectAdjoint`` differentiates)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taxpr as tx
from taxpr import CustomRuleError


def test_a_patched_residual_is_what_optimistix_differentiates_implicitly():
    optx = pytest.importorskip("optimistix")

    def resid(y, a):
        with jax.named_scope("residual"):
            return y ** 3 + y - a

    def resid_by_hand(y, a):
        return y ** 3 + y - a - 1.0

    def root_of(fn):
        return lambda a: optx.root_find(fn, optx.Newton(1e-6, 1e-6), jnp.ones(2), args=a).value

    patched = tx.patch(root_of(resid), {"residual/sub": lambda r: r - 1.0})
    a, t = jnp.array([2.0, 10.0]), jnp.ones(2)
    got = jax.jvp(patched, (a,), (t,))
    want = jax.jvp(root_of(resid_by_hand), (a,), (t,))
    np.testing.assert_allclose(got[0], [1.2134, 2.0743], atol=1e-4)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5)
    # y^3 + y = a + 1: dy/da = 1 / (3 y^2 + 1)
    np.testing.assert_allclose(got[1], 1.0 / (3 * got[0] ** 2 + 1), rtol=1e-4)
    np.testing.assert_allclose(jax.grad(lambda a: patched(a).sum())(a), want[1], rtol=1e-5)


def _diffrax_solve(adjoint: str, doubled_by_hand: bool = False):
    diffrax = pytest.importorskip("diffrax")
    adjoints = {"recursive": diffrax.RecursiveCheckpointAdjoint(),
                "backsolve": diffrax.BacksolveAdjoint(),
                "direct": diffrax.DirectAdjoint()}

    def vf(t, y, k):
        with jax.named_scope("vf"):
            return -(k * y) if not doubled_by_hand else -(2.0 * (k * y))

    def solve(y0, k):
        return diffrax.diffeqsolve(diffrax.ODETerm(vf), diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, k,
                                   adjoint=adjoints[adjoint]).ys[-1]
    return solve


@pytest.mark.parametrize("adjoint", ["recursive", "backsolve", "direct"])
def test_a_patch_in_a_diffrax_vector_field_under_grad_is_the_patched_derivative_or_an_error(
        adjoint):
    # RecursiveCheckpointAdjoint's loop (equinox's checkpointed while_loop)
    # evaluates the vector field's code in its fwd and bwd: the patch is
    # carried there. DirectAdjoint differentiates the solve itself.
    # BacksolveAdjoint's bwd traces the vector field again from Python,
    # where no patch can be applied: an error naming the site. The
    # reference is diffrax's own solve of the vector field patched by hand.
    f = tx.patch(_diffrax_solve(adjoint), {"*/vf/mul": lambda v: v * 2.0})
    by_hand = _diffrax_solve(adjoint, doubled_by_hand=True)
    y0, k = jnp.float32(1.0), jnp.float32(0.7)
    np.testing.assert_allclose(f(y0, k), np.exp(-1.4), rtol=1e-3)
    if adjoint == "backsolve":
        with pytest.raises(CustomRuleError, match="vf/mul.*bwd computes it again"):
            jax.value_and_grad(f)(y0, k)
        return
    value, grads = jax.value_and_grad(f, argnums=(0, 1))(y0, k)
    want_value, want_grads = jax.value_and_grad(by_hand, argnums=(0, 1))(y0, k)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grads, want_grads, rtol=1e-5)
    # y0 exp(-2 k t) at t = 1
    np.testing.assert_allclose(grads, [np.exp(-1.4), -2.0 * np.exp(-1.4)], rtol=1e-3)


def test_a_patch_by_value_in_a_diffrax_vector_field_under_grad():
    # A value the same in every step (under the default adjoint, whose
    # checkpointed loop evaluates the vector field in its fwd and bwd): the
    # vector field's k * y replaced by 0.5, so dy/dt = -0.5, y(1) = y0 -
    # 0.5, d/dy0 = 1 and d/dk = 0. The reference is diffrax's own solve of
    # that vector field. (Under DirectAdjoint the vector field is inside
    # scans, where a patch by value is one row per step.)
    diffrax = pytest.importorskip("diffrax")
    f = tx.patch(_diffrax_solve("recursive"), {"*/vf/mul": jnp.float32(0.5)})

    def by_hand(y0, k):
        return diffrax.diffeqsolve(diffrax.ODETerm(lambda t, y, k: -(0.5 + 0.0 * (k * y))),
                                   diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, k).ys[-1]

    y0, k = jnp.float32(1.0), jnp.float32(0.7)
    value, grads = jax.value_and_grad(f, argnums=(0, 1))(y0, k)
    want_value, want_grads = jax.value_and_grad(by_hand, argnums=(0, 1))(y0, k)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grads, want_grads, atol=1e-6)
    np.testing.assert_allclose([value, *grads], [0.5, 1.0, 0.0], atol=1e-5)


def test_a_patched_relu_in_a_neural_ode_differentiates_like_the_relu_patched_by_hand():
    # relu (a custom_jvp) inside the vector field, inside the checkpointed
    # loop of diffrax's default adjoint: the loop's bwd re-evaluates relu's
    # call, whose rule (calling relu) is given the patch there. The
    # reference is diffrax's own solve with relu replaced by 2 * max under
    # relu's rule.
    diffrax = pytest.importorskip("diffrax")
    w1 = jnp.array([[0.5, -0.3], [0.2, 0.8]])
    w2 = jnp.array([[0.1, -0.4], [0.7, 0.2]])

    def solve_with(activation):
        def vf(t, y, args):
            with jax.named_scope("vf"):
                return jnp.tanh(w2 @ activation(w1 @ y))

        def solve(y0):
            return diffrax.diffeqsolve(diffrax.ODETerm(vf), diffrax.Tsit5(), 0.0, 1.0, 0.1,
                                       y0).ys[-1].sum()
        return solve

    y0 = jnp.array([1.0, 0.5])
    (site,) = [s.name for s in tx.sites(solve_with(jax.nn.relu), y0) if s.primitive == "max"]
    patched = tx.patch(solve_with(jax.nn.relu), {site: lambda h: 2.0 * h})
    by_hand = solve_with(_relu_doubled)
    want_value, want_grad = jax.value_and_grad(by_hand)(y0)
    value, grad = jax.jit(jax.value_and_grad(patched))(y0)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5)
    # the patch changes the derivative: it is not the unpatched solve's
    assert not np.allclose(grad, jax.grad(solve_with(jax.nn.relu))(y0), rtol=1e-3)


def test_a_patch_closing_over_a_differentiated_value_in_a_diffrax_loop_is_an_error():
    # The patch's constant enters the checkpointed loop as a closure, and the
    # loop's bwd gives derivatives of its own inputs only.
    solve = _diffrax_solve("recursive")
    y0, k = jnp.float32(1.0), jnp.float32(0.7)

    def loss(a):
        return tx.patch(solve, {"*/vf/mul": lambda v: v * a})(y0, k)

    np.testing.assert_allclose(loss(2.0), np.exp(-1.4), rtol=1e-3)
    with pytest.raises(NotImplementedError, match="vf/mul.*differentiated.*while loop"):
        jax.grad(loss)(2.0)


@jax.custom_jvp
def _relu_doubled(x):
    """jax.nn.relu patched by hand (2 * max), under relu's rule."""
    return 2.0 * jnp.maximum(x, 0.0)


_relu_doubled.defjvps(lambda g, ans, x: jax.lax.select(x > 0, g, jax.lax.full_like(g, 0)))


def _leaves_close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5)


def test_a_patched_relu_in_an_equinox_mlp_differentiates_like_the_mlp_patched_by_hand():
    import equinox as eqx  # (a dependency of taxpr)
    mlp = eqx.nn.MLP(3, 2, 8, 2, activation=jax.nn.relu, key=jax.random.key(0))
    x = jnp.array([0.5, -1.0, 2.0])

    def loss(m, x):
        return jnp.sum(m(x) ** 2)

    def loss_by_hand(m, x):  # the first hidden layer's relu doubled
        h = x
        for i, layer in enumerate(m.layers[:-1]):
            h = layer(h)
            h = _relu_doubled(h) if i == 0 else jax.nn.relu(h)
        return jnp.sum(m.layers[-1](h) ** 2)

    first = [s.name for s in tx.sites(loss, mlp, x) if s.primitive == "max"][0]
    patched = tx.patch(loss, {first: lambda h: 2.0 * h})
    np.testing.assert_allclose(patched(mlp, x), loss_by_hand(mlp, x), rtol=1e-6)
    _leaves_close(eqx.filter_grad(patched)(mlp, x), eqx.filter_grad(loss_by_hand)(mlp, x))
    _leaves_close(eqx.filter_jit(eqx.filter_grad(patched))(mlp, x),
                  eqx.filter_grad(loss_by_hand)(mlp, x))


def test_a_patched_relu_in_a_flax_remat_block_differentiates_like_the_block_patched_by_hand():
    nn = pytest.importorskip("flax.linen")

    def net(activation):
        class Block(nn.Module):
            @nn.compact
            def __call__(self, x):
                return activation(nn.Dense(4)(x))

        class Net(nn.Module):
            @nn.compact
            def __call__(self, x):
                x = nn.remat(Block)(name="CheckpointBlock_0")(x)
                return nn.Dense(1)(x).sum()
        return Net()

    x = jnp.array([0.5, -1.0, 2.0])
    model, by_hand = net(jax.nn.relu), net(_relu_doubled)
    variables = model.init(jax.random.key(0), x)
    (site,) = [s.name for s in tx.sites(model.apply, variables, x) if s.primitive == "max"]
    assert site == "Net/CheckpointBlock_0/max"
    patched = tx.patch(model.apply, {site: lambda h: 2.0 * h})
    np.testing.assert_allclose(patched(variables, x), by_hand.apply(variables, x), rtol=1e-6)
    _leaves_close(jax.grad(patched)(variables, x), jax.grad(by_hand.apply)(variables, x))

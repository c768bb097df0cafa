"""tx.patch inside the custom derivative rules of libraries, differentiated
from outside: optimistix's implicit differentiation of a root (the patched
residual is what its rule differentiates) against the root of the residual
patched by hand; diffrax's adjoints, whose rules run the solve again from
their own Python code, a clear error rather than the unpatched derivative."""

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


@pytest.mark.parametrize("adjoint", ["recursive", "backsolve", "direct"])
def test_a_patch_in_a_diffrax_vector_field_under_grad_is_the_patched_derivative_or_an_error(
        adjoint):
    # RecursiveCheckpointAdjoint's loop runs the vector field in a fwd of its
    # own and BacksolveAdjoint's bwd solves again: neither is given the patch,
    # so both are an error naming the site; DirectAdjoint differentiates the
    # solve itself.
    diffrax = pytest.importorskip("diffrax")
    adjoints = {"recursive": diffrax.RecursiveCheckpointAdjoint(),
                "backsolve": diffrax.BacksolveAdjoint(),
                "direct": diffrax.DirectAdjoint()}

    def vf(t, y, k):
        with jax.named_scope("vf"):
            return -(k * y)

    def solve(y0, k):
        return diffrax.diffeqsolve(diffrax.ODETerm(vf), diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, k,
                                   adjoint=adjoints[adjoint]).ys[-1]

    y0, k = jnp.float32(1.0), jnp.float32(0.7)
    f = tx.patch(solve, {"*/vf/mul": lambda v: v * 2.0})
    np.testing.assert_allclose(f(y0, k), np.exp(-1.4), rtol=1e-3)
    if adjoint == "direct":  # y0 exp(-2 k t) at t = 1
        value, grads = jax.value_and_grad(f, argnums=(0, 1))(y0, k)
        np.testing.assert_allclose(value, np.exp(-1.4), rtol=1e-3)
        np.testing.assert_allclose(grads, [np.exp(-1.4), -2.0 * np.exp(-1.4)], rtol=1e-3)
    else:
        with pytest.raises(CustomRuleError, match="vf/mul"):
            jax.value_and_grad(f)(y0, k)

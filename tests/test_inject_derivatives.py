"""inject: derivative consistency and custom derivative rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taxpr as tx


def injector(ctx, token, params):
    op = params["op"]
    if op == "get":
        return ctx, ctx  # value replaced by a ctx constant: derivative 0
    if op == "scale":
        return token * 3.0, ctx
    if op == "sq":
        return token * token, ctx
    if op == "mulctx":
        return token * ctx, ctx
    if op == "add":
        return token, ctx + token
    raise ValueError(op)


def _eager_site(op, t, ctx):
    return {"get": ctx, "scale": t * 3.0, "sq": t * t, "mulctx": t * ctx}[op]


def _fd(f, x, eps=1e-3):
    return (f(x + eps) - f(x - eps)) / (2 * eps)


@pytest.mark.parametrize("op", ["get", "scale", "sq", "mulctx"])
@pytest.mark.parametrize("x", [0.7, -1.2])
def test_grad_and_jvp_inside_traced_program_match_finite_differences(op, x):
    def inner(x):
        return jnp.sin(tx.tag(x * 2.0, op=op)) * x

    def prog(x):
        return jax.grad(inner)(x), jax.jvp(inner, (x,), (1.0,))[1]

    ctx = np.float32(1.3)
    (g, t), _ = tx.injected(prog, injector)(ctx, x)
    expected = _fd(lambda x: np.sin(_eager_site(op, x * 2.0, ctx)) * x, np.float64(x))
    np.testing.assert_allclose(g, expected, rtol=2e-3, atol=1e-4)
    np.testing.assert_allclose(t, expected, rtol=2e-3, atol=1e-4)


def test_grad_through_scan_uses_injected_derivative():
    def prog(x):
        def inner(x):
            def body(c, _):
                return jnp.sin(tx.tag(c, op="scale")), None
            return jax.lax.scan(body, x, None, length=3)[0]
        return jax.grad(inner)(x)

    def eager(x):
        for _ in range(3):
            x = np.sin(x * 3.0)
        return x

    g, _ = tx.injected(prog, injector)(np.float32(0.0), 0.3)
    np.testing.assert_allclose(g, _fd(eager, 0.3), rtol=2e-3)


def test_outer_grad_of_injected_program_matches_finite_differences():
    def prog(x):
        return jnp.sin(tx.tag(x, op="scale")) + tx.tag(x, op="add")

    pure = tx.injected(prog, injector)
    g = jax.grad(lambda x: pure(np.float32(0.0), x)[0])(0.4)
    np.testing.assert_allclose(g, _fd(lambda x: np.sin(3 * x) + x, 0.4), rtol=2e-3)


@jax.custom_jvp
def _cj(x):
    return jnp.sin(tx.tag(x, op="add")) * 2


_cj.defjvp(lambda p, t: (_cj(p[0]), t[0] * 100.0))


@jax.custom_vjp
def _cv(x):
    return jnp.sin(tx.tag(x, op="add")) * 3


_cv.defvjp(lambda x: (_cv(x), x), lambda r, c: (c * 1000.0,))


def test_custom_jvp_and_vjp_thread_ctx_and_keep_user_rules():
    def prog(x):
        return _cj(x) + _cv(x)

    pure = tx.injected(prog, injector)
    out, ctx = pure(np.float32(1.0), 2.0)
    np.testing.assert_allclose(out, np.sin(2.0) * 5, rtol=1e-6)
    np.testing.assert_allclose(ctx, 5.0)
    # The user's rules, not the derivative of the primal.
    assert float(jax.grad(lambda x: pure(np.float32(1.0), x)[0])(2.0)) == pytest.approx(1100.0)
    assert float(jax.jit(jax.grad(lambda x: pure(np.float32(1.0), x)[0]))(2.0)) == pytest.approx(1100.0)
    # ctx flows through the custom_jvp / custom_vjp calls with its own derivative.
    assert float(jax.grad(lambda c: pure(c, 2.0)[1])(np.float32(1.0))) == pytest.approx(1.0)
    assert float(jax.grad(lambda x: pure(np.float32(1.0), x)[1])(2.0)) == pytest.approx(2.0)
    # grad inside the traced program: the effect happens once.
    g, ctx = tx.injected(jax.grad(prog), injector)(np.float32(1.0), 2.0)
    assert float(g) == pytest.approx(1100.0)
    np.testing.assert_allclose(ctx, 5.0)
    ys, ctxs = jax.vmap(pure, (None, 0))(np.float32(1.0), jnp.arange(3.0))
    np.testing.assert_allclose(ctxs, 1.0 + 2 * jnp.arange(3.0))


def test_checkpoint_effect_happens_once_under_grad():
    def prog(x):
        f = jax.checkpoint(lambda x: jnp.sin(tx.tag(x, op="add")) * x)
        return jax.grad(f)(x)

    g, ctx = tx.injected(prog, injector)(np.float32(0.0), 0.5)
    np.testing.assert_allclose(ctx, 0.5)
    np.testing.assert_allclose(g, np.cos(0.5) * 0.5 + np.sin(0.5), rtol=1e-5)


def test_custom_vjp_outputs_depending_on_ctx_get_its_derivative():
    @jax.custom_vjp
    def h(x):
        return x * tx.tag(x, op="get")  # the token is replaced by ctx

    h.defvjp(lambda x: (h(x), x), lambda r, c: (c * 7.0,))
    pure = tx.injected(lambda x: h(x) * 1.0, injector)
    # d/dctx of x * ctx is x (through the threaded function); d/dx uses the user rule.
    assert float(jax.grad(lambda c: pure(c, 3.0)[0])(np.float32(2.0))) == pytest.approx(3.0)
    assert float(jax.grad(lambda x: pure(np.float32(2.0), x)[0])(3.0)) == pytest.approx(7.0)
    out, ctx = pure(np.float32(2.0), 3.0)
    assert float(out) == pytest.approx(6.0) and float(ctx) == pytest.approx(2.0)

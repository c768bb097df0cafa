"""Patches and captures inside the function of a custom derivative rule
(``jax.nn.relu``, ``jax.nn.softplus``, a user's custom_jvp / custom_vjp),
differentiated from outside: the references are the same programs with the
patch written into the function by hand, run by JAX without taxpr."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx
from taxpr import CustomRuleError


def mlp(w1, w2, x):
    with jax.named_scope("mlp"):
        return jax.nn.relu(w1 * x) @ w2


@jax.custom_jvp
def relu_doubled(x):
    """jax.nn.relu with its max patched by hand (2 * max): its rule is relu's."""
    return 2.0 * jnp.maximum(x, 0.0)


relu_doubled.defjvps(lambda g, ans, x: lax.select(x > 0, g, lax.full_like(g, 0)))


def mlp_by_hand(w1, w2, x):
    return relu_doubled(w1 * x) @ w2


W1, W2, X = jnp.float32(1.0), jnp.array([1.0, -2.0, 0.5]), jnp.array([0.3, 1.0, 2.0])


def _relu_site():
    (site,) = [s.name for s in tx.sites(mlp, W1, W2, X) if s.primitive == "max"]
    return site


def test_a_patch_inside_relu_is_seen_by_relus_rule_under_value_and_grad():
    f = tx.patch(mlp, {_relu_site(): lambda h: h * 2.0})
    got = jax.value_and_grad(f, argnums=(0, 1))(W1, W2, X)
    want = jax.value_and_grad(mlp_by_hand, argnums=(0, 1))(W1, W2, X)
    np.testing.assert_allclose(got[0], -1.4, rtol=1e-6)
    np.testing.assert_allclose(got[1][1], [0.6, 2.0, 4.0], rtol=1e-6)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("how", ["jit", "vmap", "jvp", "vjp", "hessian"])
def test_a_patch_inside_relu_differentiated_every_way_matches_the_hand_patched_model(how):
    f = tx.patch(mlp, {_relu_site(): lambda h: h * 2.0})
    if how == "jit":
        run = lambda g: jax.jit(jax.value_and_grad(g, argnums=(0, 1)))(W1, W2, X)  # noqa: E731
    elif how == "vmap":
        ws = jnp.array([1.0, -0.5, 2.0])
        run = lambda g: jax.vmap(jax.grad(g, argnums=(0, 1)), (0, None, None))(ws, W2, X)  # noqa: E731
    elif how == "jvp":
        run = lambda g: jax.jvp(lambda w: g(w, W2, X), (W1,), (jnp.float32(1.0),))  # noqa: E731
    elif how == "vjp":
        def run(g):
            out, back = jax.vjp(lambda w2: g(W1, w2, X), W2)
            return out, back(jnp.float32(1.0))
    else:
        run = lambda g: jax.hessian(g, argnums=1)(W1, W2, X)  # noqa: E731
    for g, w in zip(jax.tree_util.tree_leaves(run(f)), jax.tree_util.tree_leaves(run(mlp_by_hand))):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_the_derivative_with_respect_to_a_value_the_patch_closes_over_goes_through_relus_rule():
    site = _relu_site()
    got = jax.grad(lambda a: tx.patch(mlp, {site: lambda h: h * a})(W1, W2, X))(2.0)
    # d/da (a * relu(w1 x)) @ w2 = relu(w1 x) @ w2
    np.testing.assert_allclose(got, jax.nn.relu(W1 * X) @ W2, rtol=1e-6)


def test_a_patch_inside_softplus_is_seen_by_its_rule():
    def net(x):
        with jax.named_scope("act"):
            return jax.nn.softplus(x).sum()
    x = jnp.array([-1.0, 0.5, 2.0])
    # softplus is logaddexp(x, 0), a custom_jvp whose rule computes its output
    # y by calling logaddexp and its tangent as t * exp(x - y): patched to
    # y + 1, the value grows by 1 per element and the rule's derivative is
    # sigmoid(x) * exp(-1), as with the patch written into logaddexp by hand.
    site = [s.name for s in tx.sites(net, x) if "custom_jvp" in s.path][-1]
    f = tx.patch(net, {site: lambda v: v + 1.0})
    value, grad = jax.value_and_grad(f)(x)
    np.testing.assert_allclose(value, jax.nn.softplus(x).sum() + 3.0, rtol=1e-6)
    np.testing.assert_allclose(grad, jax.nn.sigmoid(x) * np.exp(-1.0), rtol=1e-5)


@jax.custom_jvp
def cube(x):
    with jax.named_scope("cube"):
        return x * x * x


@cube.defjvp
def _cube_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return x ** 3, 3 * x ** 2 * t  # computes its output without calling cube


def test_a_rule_that_does_not_call_its_function_is_an_error_naming_the_site():
    def prog(x):
        return cube(x) + 1.0
    (site,) = [s.name for s in tx.sites(prog, 2.0) if s.scope == "cube"][-1:]
    f = tx.patch(prog, {site: lambda v: v * 2.0})
    np.testing.assert_allclose(f(2.0), 17.0)  # the function runs: patched
    with pytest.raises(CustomRuleError, match=f"{site}.*does not call the function"):
        jax.grad(f)(2.0)


def body(x):
    with jax.named_scope("body"):
        return jnp.sin(x) * 3.0


@jax.custom_vjp
def sin3(x):
    return body(x)


sin3.defvjp(lambda x: (sin3(x), jnp.cos(x)), lambda c, g: (3.0 * c * g,))


@jax.custom_vjp
def sin3_recomputing(x):
    return body(x)


def _recomputing_bwd(x, g):
    return jax.vjp(body, x)[1](g)


sin3_recomputing.defvjp(lambda x: (sin3_recomputing(x), x), _recomputing_bwd)


@jax.custom_vjp
def sin6_by_hand(x):
    return 2.0 * jnp.sin(x) * 3.0


sin6_by_hand.defvjp(lambda x: (sin6_by_hand(x), jnp.cos(x)), lambda c, g: (3.0 * c * g,))


def test_a_patch_inside_a_custom_vjp_whose_fwd_calls_the_function_reaches_the_fwd():
    prog = lambda x: sin3(x) ** 2  # noqa: E731
    f = tx.patch(prog, {"body/sin": lambda v: v * 2.0})
    got = jax.value_and_grad(f)(1.0)
    want = jax.value_and_grad(lambda x: sin6_by_hand(x) ** 2)(1.0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(1.0), want[1], rtol=1e-6)


def test_a_custom_vjp_bwd_that_recomputes_the_patched_function_is_an_error():
    prog = lambda x: sin3_recomputing(x) ** 2  # noqa: E731
    f = tx.patch(prog, {"body/sin": lambda v: v * 2.0})
    np.testing.assert_allclose(f(1.0), (6.0 * np.sin(1.0)) ** 2, rtol=1e-6)
    with pytest.raises(CustomRuleError, match="body/sin.*bwd computes it again"):
        jax.grad(f)(1.0)


def _checkpointed_sin_loop(x, kind="checkpointed"):
    import equinox.internal as eqxi

    def step(c):
        i, v = c
        with jax.named_scope("step"):
            v = jnp.sin(v) + 0.1
        return i + 1, v
    return eqxi.while_loop(lambda c: c[0] < 5, step, (0, x), max_steps=5,
                           kind=kind, checkpoints=2)[1]


def _halved_sin_loop_by_hand(x: float) -> tuple[float, float]:
    """The loop with ``sin`` halved written out, and its derivative by the
    chain rule (NumPy, no JAX)."""
    v, dv = x, 1.0
    for _ in range(5):
        v, dv = 0.5 * np.sin(v) + 0.1, dv * 0.5 * np.cos(v)
    return v, dv


@pytest.mark.parametrize("transform", ["grad", "value_and_grad_jit", "vjp"])
def test_a_patch_inside_an_equinox_checkpointed_loop_is_differentiated_through_the_patch(
        transform):
    # The loop's custom_vjp fwd and bwd evaluate the closure-converted body
    # instead of calling the function: the patch is carried into both.
    f = tx.patch(_checkpointed_sin_loop, {"*step/sin": lambda v: v * 0.5})
    value, derivative = _halved_sin_loop_by_hand(1.0)
    np.testing.assert_allclose(f(1.0), value, rtol=1e-6)
    if transform == "grad":
        got = (f(1.0), jax.grad(f)(1.0))
    elif transform == "value_and_grad_jit":
        got = jax.jit(jax.value_and_grad(f))(1.0)
    else:  # (a custom_vjp has no forward-mode derivative)
        out, pullback = jax.vjp(f, 1.0)
        got = (out, pullback(jnp.ones_like(out))[0])
    np.testing.assert_allclose(got[0], value, rtol=1e-6)
    np.testing.assert_allclose(got[1], derivative, rtol=1e-5)


def test_a_patch_inside_an_equinox_checkpointed_loop_matches_the_loop_written_patched():
    # The reference is equinox's own checkpointed loop with the patch
    # written into the body.
    import equinox.internal as eqxi

    def by_hand(x):
        def step(c):
            i, v = c
            return i + 1, 0.5 * jnp.sin(v) + 0.1
        return eqxi.while_loop(lambda c: c[0] < 5, step, (0, x), max_steps=5,
                               kind="checkpointed", checkpoints=2)[1]

    f = tx.patch(_checkpointed_sin_loop, {"*step/sin": lambda v: v * 0.5})
    xs = jnp.array([0.3, 1.0, 2.0])
    np.testing.assert_allclose(jax.vmap(jax.grad(f))(xs), jax.vmap(jax.grad(by_hand))(xs),
                               rtol=1e-5)


def test_a_patch_in_a_checkpointed_loop_after_warm_traces_of_the_same_loop():
    # The unpatched loop differentiated first fills JAX's trace caches (the
    # loop's fwd, its body's jit calls); the patched program, then another
    # patch of it, must not reuse them, nor each other's.
    value, derivative = _halved_sin_loop_by_hand(1.0)
    unpatched = jax.grad(_checkpointed_sin_loop)(1.0)
    halved = tx.patch(_checkpointed_sin_loop, {"*step/sin": lambda v: v * 0.5})
    for _ in range(2):
        np.testing.assert_allclose(jax.grad(halved)(1.0), derivative, rtol=1e-5)
    np.testing.assert_allclose(jax.vmap(jax.grad(halved))(jnp.array([1.0, 1.0])),
                               [derivative] * 2, rtol=1e-5)
    zeroed = tx.patch(_checkpointed_sin_loop, {"*step/sin": lambda v: v * 0.0})
    # sin replaced by 0: v = 0.1 after the first step, whatever x
    np.testing.assert_allclose(zeroed(1.0), 0.1, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(zeroed)(1.0), 0.0, atol=1e-7)
    np.testing.assert_allclose(jax.grad(halved)(1.0), derivative, rtol=1e-5)
    np.testing.assert_allclose(jax.grad(_checkpointed_sin_loop)(1.0), unpatched, rtol=1e-6)
    assert not np.allclose(unpatched, derivative, rtol=1e-3)


def test_a_value_patch_inside_an_equinox_checkpointed_loop_differentiates():
    # A value the same in every step is a function returning it, carried
    # into the loop's fwd and bwd: the derivative is the loop's with that
    # value written in (the reference, run by equinox's loop itself).
    import equinox.internal as eqxi

    def loop_with(half_sin):
        def loop(x):
            def step(c):
                i, v, w = c
                with jax.named_scope("step"):
                    v = half_sin(v) + w * w
                return i + 1, v, w
            return eqxi.while_loop(lambda c: c[0] < 5, step, (0, x, x), max_steps=5,
                                   kind="checkpointed", checkpoints=2)[1]
        return loop

    f = tx.patch(loop_with(lambda v: jnp.sin(v) * 0.5), {"*step/mul": jnp.float32(0.3)})
    by_hand = loop_with(lambda v: jnp.float32(0.3))
    value, grad = jax.value_and_grad(f)(1.5)
    want_value, want_grad = jax.value_and_grad(by_hand)(1.5)
    np.testing.assert_allclose([value, grad], [want_value, want_grad], rtol=1e-6)
    np.testing.assert_allclose([value, grad], [0.3 + 1.5 ** 2, 3.0], rtol=1e-6)


def test_a_patch_of_one_of_two_equations_of_a_line_in_a_checkpointed_loop_is_an_error():
    # The loop evaluates the body's line twice per step; only one of the
    # two is patched, and a re-evaluation cannot tell them apart.
    import equinox.internal as eqxi

    def twice(v):
        return jnp.sin(v)

    def loop(x):
        def step(c):
            i, v = c
            return i + 1, twice(v) + twice(v * 2.0)
        return eqxi.while_loop(lambda c: c[0] < 3, step, (0, x), max_steps=3,
                               kind="checkpointed", checkpoints=2)[1]

    sins = [s.name for s in tx.sites(loop, 1.0) if s.primitive == "sin"]
    assert len(sins) == 2
    f = tx.patch(loop, {sins[0]: lambda v: v * 0.5})
    with pytest.raises(CustomRuleError, match=f"{sins[0]}.*traced at the same point.*cannot be told apart"):
        jax.grad(f)(1.0)


def test_a_capture_inside_relu_under_grad_is_the_functions_value():
    site = _relu_site()
    out, acts = tx.capture(mlp, site)(W1, W2, X)
    np.testing.assert_allclose(acts[site], jax.nn.relu(W1 * X))

    def captured_sum(w1):
        return tx.capture(mlp, site)(w1, W2, X)[1][site].sum()
    value, grad = jax.value_and_grad(captured_sum)(W1)
    np.testing.assert_allclose(value, jax.nn.relu(W1 * X).sum(), rtol=1e-6)
    np.testing.assert_allclose(grad, jnp.sum(jnp.where(X > 0, X, 0.0)), rtol=1e-6)


def test_a_patch_inside_relu_of_a_function_that_differentiates_itself_under_jit_twice():
    # differentiated inside the patched function, jitted and called again
    # with other values (a warm trace cache)
    def step(w1, w2, x):
        return jax.value_and_grad(mlp, argnums=(0, 1))(w1, w2, x)

    def step_by_hand(w1, w2, x):
        return jax.value_and_grad(mlp_by_hand, argnums=(0, 1))(w1, w2, x)

    f = jax.jit(tx.patch(step, {_relu_site(): lambda h: 2.0 * h}))
    for w1 in (W1, -0.5 * W1, 2.0 * W1):
        for g, w in zip(jax.tree_util.tree_leaves(f(w1, W2, X)),
                        jax.tree_util.tree_leaves(step_by_hand(w1, W2, X))):
            np.testing.assert_allclose(g, w, rtol=1e-6)

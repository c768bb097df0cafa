"""A custom_vjp bwd that recomputes its function, differentiated inside a
traced function (``jax.grad`` inside what ``uncurry`` / ``reap`` trace).

The bwd's tags run after the forward pass: taxpr threads them as a replay
of it. What they write to a state the function writes is not applied again,
a state the function leaves alone reads as the forward read it, a state
only the bwd sets is set where the backward pass runs, and a gradient that
depends on what the recomputation reads of a state the forward changes is a
clear error. References: hand-threaded Python (the counts and values a run
with a dict gives when each call runs once).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taxpr as tx
from taxpr import harvest as h

f32 = jnp.float32


def _counted_scale(x):
    """Counts its calls in state "n" and scales by state "scale"."""
    tx.set_state("n", tx.get_state("n", f32(0.0)) + 1.0)
    return x * tx.get_state("scale", f32(3.0))


def _recomputing(fn, bwd_extra=None):
    """``fn`` as a custom_vjp whose bwd runs ``jax.vjp(fn)`` again."""
    wrapped = jax.custom_vjp(fn)

    def bwd(x, g):
        if bwd_extra is not None:
            bwd_extra(g)
        return jax.vjp(fn, x)[1](g)

    wrapped.defvjp(lambda x: (fn(x), x), bwd)
    return wrapped


@pytest.mark.parametrize("start", [None, {"n": 5.0, "scale": 2.0}])
def test_recomputed_function_counts_once_and_reads_what_the_forward_read(start):
    f = _recomputing(_counted_scale)
    pure, s0 = tx.uncurry(lambda x: jax.value_and_grad(f)(x), f32(2.0))
    s = s0 if start is None else {k: f32(v) for k, v in start.items()}
    (out, g), s1 = jax.jit(pure)(s, f32(2.0))
    # Hand-threaded: one call, n + 1, value and derivative with the scale.
    scale, n = float(s["scale"]), float(s["n"])
    np.testing.assert_allclose([out, g], [2.0 * scale, scale])
    assert float(s1["n"]) == n + 1.0
    assert float(s1["scale"]) == scale


def test_state_only_the_bwd_sets_is_set_after_the_forward():
    f = _recomputing(_counted_scale, bwd_extra=lambda g: tx.set_state("ct", g * 10.0))

    def loss(x):
        tx.set_state("ct", f32(-1.0))  # the forward's value, before the bwd
        y = f(x)
        seen = tx.get_state("ct", f32(0.0))  # read before the backward pass
        return y, seen

    def prog(x):
        (y, seen), g = jax.value_and_grad(loss, has_aux=True)(x)
        return y, seen, g, tx.get_state("ct", f32(0.0))

    pure, s0 = tx.uncurry(prog, f32(2.0))
    (y, seen, g, after), s1 = pure(s0, f32(2.0))
    np.testing.assert_allclose([y, seen, g, after], [6.0, -1.0, 3.0, 10.0])
    assert float(s1["n"]) == 1.0 and float(s1["ct"]) == 10.0


def test_gradient_depending_on_a_state_the_forward_updates_is_a_clear_error():
    def body(x):
        n = tx.get_state("upd", f32(0.0))
        tx.set_state("upd", n + 1.0)
        return x * (n + 1.0)

    f = _recomputing(body)
    with pytest.raises(tx.StateError, match=r"state 'upd'.*backward pass.*recomputes"):
        tx.uncurry(lambda x: jax.grad(f)(x), f32(2.0))


def _python_loop(x, steps=3):
    n, y, dy = 0.0, x, 1.0
    for _ in range(steps):
        n += 1.0
        y, dy = y * 1.5, dy * 1.5
    return y, dy, n


@pytest.mark.parametrize("steps", [1, 3])
def test_equinox_checkpointed_loop_counts_each_step_once_inside_grad(steps):
    import equinox.internal as eqxi  # equinox is a dependency of taxpr

    def body(carry):
        i, y = carry
        tx.set_state("steps", tx.get_state("steps", f32(0.0)) + 1.0)
        return i + 1, y * 1.5

    def loss(x):
        return eqxi.while_loop(lambda c: c[0] < steps, body, (0, x), max_steps=steps,
                               kind="checkpointed", checkpoints=1)[1]

    pure, s0 = tx.uncurry(lambda x: jax.value_and_grad(loss)(x), f32(2.0))
    (out, g), s1 = pure(s0, f32(2.0))
    y, dy, n = _python_loop(2.0, steps)
    np.testing.assert_allclose([out, g], [y, dy], rtol=1e-6)
    assert float(s1["steps"]) == n


def test_sow_in_the_recomputed_function_is_reaped_once():
    def fn(x):
        return h.sow(x * 2.0, tag="rp", name="y", mode="append")

    f = _recomputing(fn)
    (out, g), reaped = h.call_and_reap(lambda x: jax.value_and_grad(f)(x), tag="rp")(f32(2.0))
    np.testing.assert_allclose([out, g], [4.0, 2.0])
    np.testing.assert_allclose(reaped["y"], [4.0])  # the forward's sow only


def _draws(x):
    """Draws a key; its value is only logged (a state), never differentiated."""
    tx.set_state("drawn", jax.random.uniform(tx.next_key()))
    return x * 2.0


def test_key_drawn_in_the_recomputed_function_advances_the_stream_once():
    f = _recomputing(_draws)

    def prog(x, differentiate):
        y = jax.value_and_grad(f)(x)[0] if differentiate else _draws(x)
        return y, jax.random.uniform(tx.next_key())

    key = jax.random.key(7)
    pure, s0 = tx.uncurry(tx.seed(lambda x: prog(x, True), key), f32(2.0))
    (y, after), s1 = pure(s0, f32(2.0))
    ref_pure, r0 = tx.uncurry(tx.seed(lambda x: prog(x, False), key), f32(2.0))
    (y_ref, after_ref), r1 = ref_pure(r0, f32(2.0))
    assert float(y) == float(y_ref) == 4.0
    assert float(after) == float(after_ref)  # the next key: one draw before it
    assert float(s1["drawn"]) == float(r1["drawn"])


def test_gradient_depending_on_a_key_the_recomputation_draws_is_a_clear_error():
    f = _recomputing(lambda x: x * jax.random.uniform(tx.next_key()))
    with pytest.raises(tx.StateError, match=r"state 'rng'.*backward pass.*recomputes"):
        tx.seed(lambda x: jax.grad(f)(x), jax.random.key(0))(f32(2.0))


def test_warm_caches_a_jitted_body_traced_before_and_a_second_trace():
    # The body is jitted: JAX caches its trace. Traced first without
    # differentiation, then in the fwd and in the bwd of a differentiated
    # call, then by a second uncurry: each trace counts once.
    body = jax.jit(_counted_scale)
    f = _recomputing(body)
    plain, p0 = tx.uncurry(f, f32(2.0))
    out, p1 = plain(p0, f32(2.0))
    assert float(out) == 6.0 and float(p1["n"]) == 1.0
    for _ in range(2):
        pure, s0 = tx.uncurry(lambda x: jax.value_and_grad(f)(x), f32(2.0))
        for start in (s0, {"n": f32(4.0), "scale": f32(0.5)}):
            (y, g), s1 = pure(start, f32(2.0))
            scale = float(start["scale"])
            np.testing.assert_allclose([y, g], [2.0 * scale, scale])
            assert float(s1["n"]) == float(start["n"]) + 1.0


def test_vmap_over_states_with_a_recomputing_bwd_differentiated_inside():
    f = _recomputing(_counted_scale)
    pure, s0 = tx.uncurry(lambda x: jax.value_and_grad(f)(x), f32(2.0))
    states = {"n": jnp.array([0.0, 3.0, 7.0]), "scale": jnp.array([1.0, 2.0, -1.5])}
    (ys, gs), s1 = jax.jit(jax.vmap(pure, in_axes=(0, None)))(states, f32(2.0))
    # Per example, as a Python run alone: one call, its own scale.
    np.testing.assert_allclose(ys, 2.0 * np.asarray(states["scale"]))
    np.testing.assert_allclose(gs, states["scale"])
    np.testing.assert_allclose(s1["n"], np.asarray(states["n"]) + 1.0)


def test_equinox_filter_custom_vjp_whose_bwd_recomputes():
    import equinox as eqx  # equinox is a dependency of taxpr

    @eqx.filter_custom_vjp
    def f(x):
        return _counted_scale(x)

    @f.def_fwd
    def f_fwd(perturbed, x):
        return _counted_scale(x), x

    @f.def_bwd
    def f_bwd(x, g, perturbed, x_again):
        return jax.vjp(_counted_scale, x)[1](g)[0]

    pure, s0 = tx.uncurry(lambda x: eqx.filter_value_and_grad(f)(x), f32(2.0))
    (y, g), s1 = eqx.filter_jit(pure)({"n": f32(2.0), "scale": f32(4.0)}, f32(2.0))
    np.testing.assert_allclose([y, g], [8.0, 4.0])
    assert float(s1["n"]) == 3.0

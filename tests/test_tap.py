"""``tx.tap``: the values of selected sites, delivered to the host per
iteration, against the same values computed by a Python loop in NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx

N = 6


def _rnn(x):
    @jax.jit
    def cell(c, i):
        with jax.named_scope("cell"):
            return jnp.tanh(c * 0.5 + i)

    def step(c, i):
        h = cell(c, i)
        return h, h
    with jax.named_scope("readout"):
        return lax.scan(step, x, jnp.arange(float(N)))[1].sum() * 2.0


def _reference(x: float) -> list[float]:
    c, hs = np.float32(x), []
    for i in range(N):
        c = np.tanh(np.float32(c * np.float32(0.5) + np.float32(i)))
        hs.append(float(c))
    return hs


class Seen(list):
    def __call__(self, name, value, step):
        self.append((name, np.asarray(value).tolist(), step))


def test_values_per_iteration_in_order():
    seen = Seen()
    f = tx.tap(_rnn, "*cell/tanh", seen)
    out = f(jnp.float32(0.3))
    jax.effects_barrier()
    assert np.asarray(out).tobytes() == np.asarray(jax.jit(_rnn)(jnp.float32(0.3))).tobytes()
    assert [(n, s) for n, _, s in seen] == [("readout/cell/tanh", i) for i in range(N)]
    np.testing.assert_allclose([v for _, v, _ in seen], _reference(0.3), rtol=1e-6)


def test_a_site_outside_loops_and_two_selectors():
    seen = Seen()
    tx.tap(_rnn, ["readout/mul", "*cell/tanh"], seen)(jnp.float32(0.3))
    jax.effects_barrier()
    outside = [(v, s) for n, v, s in seen if n == "readout/mul"]
    assert len(outside) == 1 and outside[0][1] is None
    np.testing.assert_allclose(outside[0][0], 2.0 * sum(_reference(0.3)), rtol=1e-5)
    assert sum(n == "readout/cell/tanh" for n, _, _ in seen) == N


def test_vmap_gives_each_example():
    seen = Seen()
    xs = [0.3, -1.2]
    jax.vmap(tx.tap(_rnn, "*cell/tanh", seen))(jnp.array(xs, jnp.float32))
    jax.effects_barrier()
    assert len(seen) == N * len(xs)
    got = {}
    for _, v, s in seen:
        got.setdefault(s, []).append(v)
    for i in range(N):
        np.testing.assert_allclose(sorted(got[i]), sorted(_reference(x)[i] for x in xs),
                                   rtol=1e-6)


def test_grad_taps_the_forward_values():
    seen = Seen()
    g = jax.grad(tx.tap(_rnn, "*cell/tanh", seen))(jnp.float32(0.3))
    jax.effects_barrier()
    assert np.asarray(g).tobytes() == np.asarray(jax.grad(_rnn)(jnp.float32(0.3))).tobytes()
    np.testing.assert_allclose([v for _, v, _ in seen], _reference(0.3), rtol=1e-6)


def test_a_selector_matching_nothing_names_the_nearest_sites():
    with pytest.raises(ValueError, match=r"taxpr.tap: the selector .* matches none"):
        tx.tap(_rnn, "cell/tanhh", Seen())(jnp.float32(0.3))


def test_a_second_call_of_the_same_types_is_not_traced_again():
    traces = []

    def f(x, scale):
        traces.append(1)
        return jnp.sin(x) * scale

    seen = Seen()
    g = tx.tap(f, "sin", seen)
    a = g(jnp.float32(0.5), 2.0)
    b = g(jnp.float32(0.7), 2.0)
    jax.effects_barrier()
    np.testing.assert_allclose([a, b], [2 * np.sin(0.5), 2 * np.sin(0.7)], rtol=1e-6)
    assert len(traces) == 1
    np.testing.assert_allclose([v for _, v, _ in seen], [np.sin(0.5), np.sin(0.7)], rtol=1e-6)


def _rnn_perturbed(x, eps):
    """``_rnn`` written by hand with ``eps[i]`` added to step ``i``'s
    ``tanh``: the derivative with respect to ``eps[i]`` is the cotangent
    of that value."""
    def step(c, e_i):
        e, i = e_i
        h = jnp.tanh(c * 0.5 + i) + e
        return h, h
    return lax.scan(step, x, (eps, jnp.arange(float(N))))[1].sum() * 2.0


@pytest.mark.parametrize("outer_jit", [False, True])
def test_cotangents_in_the_backward_pass_last_iteration_first(outer_jit):
    seen, cotangents = Seen(), Seen()
    f = tx.tap(_rnn, "*cell/tanh", seen, cotangents=cotangents)
    grad = jax.grad(f)
    if outer_jit:
        grad = jax.jit(grad)
    g = grad(jnp.float32(0.3))
    jax.effects_barrier()
    assert np.asarray(g).tobytes() == np.asarray(jax.grad(_rnn)(jnp.float32(0.3))).tobytes()
    want = jax.grad(_rnn_perturbed, argnums=1)(jnp.float32(0.3), jnp.zeros(N))
    assert [(n, s) for n, _, s in cotangents] == [("readout/cell/tanh", i)
                                                  for i in reversed(range(N))]
    np.testing.assert_allclose([v for _, v, _ in cotangents][::-1], want, rtol=1e-5)
    np.testing.assert_allclose([v for _, v, _ in seen], _reference(0.3), rtol=1e-6)


def test_cotangents_are_not_called_without_differentiation():
    cotangents = Seen()
    out = tx.tap(_rnn, "*cell/tanh", Seen(), cotangents=cotangents)(jnp.float32(0.3))
    jax.effects_barrier()
    assert np.asarray(out).tobytes() == np.asarray(jax.jit(_rnn)(jnp.float32(0.3))).tobytes()
    assert cotangents == []


def test_cotangents_under_vmap_of_grad_give_each_example():
    cotangents = Seen()
    xs = jnp.array([0.3, -1.2], jnp.float32)
    jax.vmap(jax.grad(tx.tap(_rnn, "*cell/tanh", Seen(), cotangents=cotangents)))(xs)
    jax.effects_barrier()
    want = jax.vmap(lambda x: jax.grad(_rnn_perturbed, argnums=1)(x, jnp.zeros(N)))(xs)
    got: dict = {}
    for _, v, s in cotangents:
        got.setdefault(s, []).append(v)
    for i in range(N):
        np.testing.assert_allclose(sorted(got[i]), sorted(np.asarray(want[:, i])), rtol=1e-5)

"""The rows of docs/coming-from-*.md checked against the other library's
own result: each program run by brainstate (or Flax NNX) and by its taxpr
port, with the same numbers asserted. Each part skips where its library is
not installed (brainstate: ``pip install -e '.[peers]'``, Python >= 3.12)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taxpr as tx

N, STEPS, TAU, V_TH = 50, 40, 10.0, 1.0
CURRENTS = jnp.linspace(0.5, 2.0, N)


def _bs():
    return pytest.importorskip("brainstate", reason="brainstate not installed (the peers extra)")


@pytest.fixture(autouse=True)
def _without_jax_checks():
    # brainstate 0.6.0's traces carry debug info that JAX's own checks
    # (tests/conftest.py turns them on) reject; both sides run without them.
    with jax.enable_checks(False):
        yield


def _brainstate_lif(bs):
    class LIF(bs.nn.Module):
        def __init__(self):
            super().__init__()
            self.v = bs.HiddenState(jnp.zeros(N))
            self.spike = bs.ShortTermState(jnp.zeros(N))

        def update(self, i_ext):
            v = self.v.value + (-self.v.value + i_ext) / TAU
            spike = (v >= V_TH).astype(jnp.float32)
            self.v.value = jnp.where(spike > 0, 0.0, v)
            self.spike.value = spike
            return spike

    return LIF()


class LIF:
    """The port of docs/coming-from-brainstate.md."""

    def __init__(self, name="lif"):
        self.name = name

    def update(self, i_ext):
        with tx.scope(self.name):
            v = tx.get_state("v", lambda: jnp.zeros(N))
            v = v + (-v + i_ext) / TAU
            spike = tx.set_state("spike", (v >= V_TH).astype(jnp.float32))
            tx.set_state("v", jnp.where(spike > 0, 0.0, v))
            return spike


def _scale():
    return 1.0 + 0.5 * jnp.sin(jnp.arange(STEPS) / 5.0)


def test_for_loop_under_jit_is_a_scan_through_uncurry():
    bs = _bs()
    pop = _brainstate_lif(bs)
    want = bs.transform.jit(lambda s: bs.transform.for_loop(
        lambda x: pop.update(CURRENTS * x), s))(_scale())
    port = LIF()
    pure, state0 = tx.uncurry(
        lambda s: jax.lax.scan(lambda _, x: (None, port.update(CURRENTS * x)), None, s)[1],
        _scale())
    got, state1 = jax.jit(pure)(state0, _scale())
    assert want.sum() > 0
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(state1["lif"]["v"], pop.v.value, rtol=1e-6)
    np.testing.assert_array_equal(state1["lif"]["spike"], pop.spike.value)


def _smooth_bs(bs):
    class Leak(bs.nn.Module):
        def __init__(self):
            super().__init__()
            self.v = bs.HiddenState(jnp.zeros(N))

        def update(self, x):
            self.v.value = self.v.value + (-self.v.value + jnp.tanh(x)) / TAU
            return self.v.value

    return Leak()


def _smooth_port(x):
    v = tx.get_state("v", lambda: jnp.zeros(N))
    return tx.set_state("v", v + (-v + jnp.tanh(x)) / TAU)


def test_checkpointed_for_loop_gradient_is_a_checkpointed_scans():
    bs = _bs()
    leak = _smooth_bs(bs)

    def bs_loss(w):
        return bs.transform.checkpointed_for_loop(
            lambda x: leak.update(w * CURRENTS * x), _scale(), base=4).sum()

    want = bs.transform.grad(bs_loss)(0.7)

    def loss(w):
        step = jax.checkpoint(lambda _, x: (None, _smooth_port(w * CURRENTS * x)))
        return jax.lax.scan(step, None, _scale())[1].sum()

    pure, state0 = tx.uncurry(loss, 0.7)
    got = jax.grad(lambda w: pure(state0, w)[0])(0.7)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_bounded_while_loop_and_its_gradient():
    bs = _bs()

    def body(c):
        i, x = c
        return i + 1, jnp.sin(1.3 * x) + 0.1

    def run(loop, w):
        return loop(lambda c: c[0] < 6, body, (0, w), max_steps=10)[1]

    want = run(bs.transform.bounded_while_loop, 0.4)
    want_grad = jax.grad(lambda w: run(bs.transform.bounded_while_loop, w))(0.4)
    np.testing.assert_allclose(run(tx.bounded_while_loop, 0.4), want, rtol=1e-6)
    np.testing.assert_allclose(jax.grad(lambda w: run(tx.bounded_while_loop, w))(0.4),
                               want_grad, rtol=1e-5)


def test_ifelse_is_a_switch_on_the_first_true_condition():
    bs = _bs()
    branches = [lambda x: jnp.ones(()), lambda x: -jnp.ones(()), lambda x: x]

    def port(x):
        conds = [x > 1.0, x < -1.0, jnp.abs(x) <= 1.0]
        return jax.lax.switch(jnp.argmax(jnp.stack(conds)), branches, x)

    for x in (3.0, -2.0, 0.5):
        x = jnp.float32(x)  # brainstate asks for exactly one true condition
        want = bs.transform.ifelse([x > 1.0, x < -1.0, jnp.abs(x) <= 1.0], branches, x)
        assert float(port(x)) == float(want)


def test_grad_with_respect_to_states_is_a_grad_of_pure():
    bs = _bs()
    leak = _smooth_bs(bs)
    leak.v.value = jnp.linspace(-1.0, 1.0, N)

    def bs_loss():
        for x in range(3):
            leak.update(CURRENTS * x)
        return (leak.v.value ** 2).sum()

    # brainstate differentiates w.r.t. the states' values at the call
    v_before = leak.v.value
    want = bs.transform.grad(bs_loss, grad_states=leak.v)()
    leak.v.value = v_before

    def loss():
        for x in range(3):
            _smooth_port(CURRENTS * x)
        return (tx.get_state("v", lambda: jnp.zeros(N)) ** 2).sum()

    pure, state0 = tx.uncurry(loss)
    got = jax.grad(lambda v: pure({"v": v})[0])(jnp.linspace(-1.0, 1.0, N))
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_vector_grad_is_a_vjp_with_ones():
    bs = _bs()

    def f(x):
        return jnp.sin(x) * x[::-1]

    x = jnp.linspace(0.1, 1.0, 5)
    want = bs.transform.vector_grad(f)(x)
    value, pullback = jax.vjp(f, x)
    np.testing.assert_allclose(pullback(jnp.ones_like(value))[0], want, rtol=1e-6)


def test_states_created_per_lane_from_the_lanes_arguments():
    bs = _bs()

    def build(x):
        scratch = bs.ShortTermState(jnp.full(3, 0.5) * x)
        scratch.value = scratch.value * 2.0 + x
        return scratch.value

    xs = jnp.arange(4.0)
    want = bs.transform.vmap_new_states(build, in_axes=0, axis_size=4)(xs)

    def port(x):
        scratch = tx.get_state("scratch", lambda: jnp.full(3, 0.5) * x)
        return tx.set_state("scratch", scratch * 2.0 + x)

    pure, states = tx.uncurry_vmap(port, jax.random.key(0), xs)
    got, _ = pure(states, xs)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_eval_shape_of_pure():
    bs = _bs()
    pop = _brainstate_lif(bs)
    want = bs.transform.eval_shape(
        lambda s: bs.transform.for_loop(lambda x: pop.update(CURRENTS * x), s), _scale())
    port = LIF()
    pure, state0 = tx.uncurry(
        lambda s: jax.lax.scan(lambda _, x: (None, port.update(CURRENTS * x)), None, s)[1],
        _scale())
    got, _ = jax.eval_shape(pure, state0, _scale())
    assert (got.shape, got.dtype) == (want.shape, want.dtype)


def test_unvmap_any_is_equinoxs():
    bs = _bs()
    import equinox.internal as eqxi

    xs = jnp.array([0.0, 3.0, 0.0])
    want = jax.vmap(lambda x: bs.transform.unvmap(x > 1.0, op="any"))(xs)
    got = jax.vmap(lambda x: eqxi.unvmap_any(x > 1.0))(xs)
    np.testing.assert_array_equal(jnp.broadcast_to(got, want.shape), want)


def test_jit_error_if_is_error_if():
    bs = _bs()

    def bs_f(x):
        bs.transform.jit_error_if(x > 1.0, "too large: {}", x)
        return x

    with pytest.raises(Exception, match="too large"):
        jax.block_until_ready(jax.jit(bs_f)(2.0))

    def port(x):
        tx.error_if(x > 1.0, "too large: {}", x)
        return x

    with pytest.raises(tx.CheckError, match="too large"):
        tx.checked(port)(2.0)
    assert float(tx.checked(port)(0.5)) == 0.5


def _port_batch_norm(x, scale, bias, train, momentum=0.99, eps=1e-5):
    """docs/coming-from-flax-nnx.md's port of ``nnx.BatchNorm``."""
    mean = tx.get_state("mean", lambda: jnp.zeros(x.shape[-1]))
    var = tx.get_state("var", lambda: jnp.ones(x.shape[-1]))
    if train:
        batch_mean, batch_var = x.mean(0), x.var(0)
        tx.set_state("mean", momentum * mean + (1 - momentum) * batch_mean)
        tx.set_state("var", momentum * var + (1 - momentum) * batch_var)
        mean, var = batch_mean, batch_var
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def test_nnx_batch_norm_running_statistics_and_eval_output():
    nnx = pytest.importorskip("flax.nnx", reason="flax not installed")
    bn = nnx.BatchNorm(6, momentum=0.9, rngs=nnx.Rngs(0))
    xs = 2.0 + jax.random.normal(jax.random.key(4), (5, 32, 6))
    for x in xs:
        bn(x)
    scale, bias = jnp.linspace(0.5, 1.5, 6), jnp.linspace(-1.0, 1.0, 6)
    bn.scale[...], bn.bias[...] = scale, bias

    def port(x, train=True):
        with tx.scope("bn"):
            return _port_batch_norm(x, scale, bias, train, momentum=0.9)

    pure, state = tx.uncurry(port, xs[0])
    for x in xs:
        _, state = jax.jit(pure)(state, x)
    np.testing.assert_allclose(state["bn"]["mean"], bn.mean[...], rtol=1e-5)
    np.testing.assert_allclose(state["bn"]["var"], bn.var[...], rtol=1e-5)
    bn.eval()
    got, _ = pure(state, xs[0], False)
    np.testing.assert_allclose(got, bn(xs[0]), rtol=1e-5, atol=1e-5)

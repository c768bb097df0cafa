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


# Two rows are not compared number for number. brainstate.random draws from
# its own global random state and taxpr's tx.next_key() from a key stream kept
# in the state dict, with other keys: the same program draws other numbers, so
# the test asserts what holds for both (shapes, a fresh draw each step,
# standard-normal statistics). pmap2 and jax.pmap run on the local devices,
# whose numbers are a vmap lane's only where every device does the same
# arithmetic: on the tests' CPU devices the test asserts that, with a
# tolerance (accelerators may round otherwise).


def _simulate_port(port):
    return lambda s: jax.lax.scan(lambda _, x: (None, port.update(CURRENTS * x)), None, s)[1]


def _names(states):
    """A (nested) state dict as {"scope/name": value}."""
    return {"/".join(str(k.key) for k in path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(states)}


def test_stateful_function_jaxpr_is_make_jaxpr_with_states():
    bs = _bs()
    pop = _brainstate_lif(bs)

    def bs_simulate(s):
        return bs.transform.for_loop(lambda x: pop.update(CURRENTS * x), s)

    v0, spike0 = jnp.linspace(0.0, 0.9, N), jnp.zeros(N)
    sf = bs.transform.StatefulFunction(bs_simulate, return_only_write=True)
    sf.make_jaxpr(_scale())
    key = sf.get_arg_cache_key(_scale())
    bs_states = sf.get_states_by_cache(key)
    bs_names = ["v" if s is pop.v else "spike" for s in bs_states]
    assert [s is pop.v or s is pop.spike for s in bs_states] == [True, True]
    assert len(sf.get_write_states_by_cache(key)) == 2
    bs_ins = [{"v": v0, "spike": spike0}[n] for n in bs_names]
    bs_new, want = sf.jaxpr_call(bs_ins, _scale())
    want_states = dict(zip(bs_names, bs_new))
    # make_jaxpr(return_only_write=True) gives the same program: (*args, *states)
    # -> (*outs, *written states)
    bs_jaxpr, bs_states2 = bs.transform.make_jaxpr(bs_simulate, return_only_write=True)(_scale())
    assert [s is t for s, t in zip(bs_states2, bs_states)] == [True, True]
    bs_out, *bs_new2 = jax.core.eval_jaxpr(bs_jaxpr.jaxpr, bs_jaxpr.consts, _scale(), *bs_ins)
    np.testing.assert_array_equal(bs_out, want)
    for a, b in zip(bs_new2, bs_new):
        np.testing.assert_array_equal(a, b)

    jaxpr, states = tx.make_jaxpr_with_states(_simulate_port(LIF()), return_only_write=True)(
        _scale())
    assert [(s.name, s.read, s.written) for s in states] == [
        ("lif/spike", False, True), ("lif/v", True, True)]
    ins = {"lif/v": v0, "lif/spike": spike0}
    got, *new = jax.core.eval_jaxpr(jaxpr.jaxpr, jaxpr.consts,
                                    *[ins[s.name] for s in states], _scale())
    got_states = {s.name: x for s, x in zip(states, new)}
    assert want.sum() > 0
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got_states["lif/v"], want_states["v"], rtol=1e-6)
    np.testing.assert_array_equal(got_states["lif/spike"], want_states["spike"])


def test_state_finders_are_split_states():
    bs = _bs()

    class Net(bs.nn.Module):
        def __init__(self):
            super().__init__()
            self.exc, self.inh = _brainstate_lif(bs), _brainstate_lif(bs)

        def update(self, x):
            return self.exc.update(x) + self.inh.update(0.5 * x)

    net = Net()
    bs.transform.jit(lambda s: bs.transform.for_loop(lambda x: net.update(CURRENTS * x), s))(
        _scale())
    want = {"/".join(path): st.value for path, st in net.states(bs.HiddenState).items()}
    found = bs.transform.StateFinder(net.update, bs.HiddenState)(CURRENTS)
    assert sorted(id(s) for s in found.values()) == sorted(
        id(s) for s in net.states(bs.HiddenState).values())

    class NetPort:
        def __init__(self):
            self.exc, self.inh = LIF("exc"), LIF("inh")

        def update(self, x):
            return self.exc.update(x) + self.inh.update(0.5 * x)

    net_port = NetPort()
    pure, state0 = tx.uncurry(_simulate_port(net_port), _scale())
    _, state1 = jax.jit(pure)(state0, _scale())
    hidden, rest = tx.split_states(state1, "*/v")
    got = _names(hidden)
    assert sorted(got) == sorted(want) == ["exc/v", "inh/v"]
    assert sorted(_names(rest)) == ["exc/spike", "inh/spike"]
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6)
    assert want["exc/v"].sum() != want["inh/v"].sum()


def _port_fwd_grad(f, key):
    """docs/coming-from-brainstate.md's port of ``fwd_grad(f, key=key)``."""
    def estimate(params):
        leaves, tree = jax.tree_util.tree_flatten(params)
        keys = jax.random.split(key, len(leaves))
        tangent = tree.unflatten([jax.random.normal(k, p.shape, p.dtype)
                                  for k, p in zip(keys, leaves)])
        _, along = jax.jvp(f, (params,), (tangent,))
        return jax.tree_util.tree_map(lambda t: t * along, tangent)
    return estimate


def test_fwd_grad_is_a_jvp_along_a_random_tangent():
    bs = _bs()
    leak = _smooth_bs(bs)

    def bs_loss(w):
        return bs.transform.for_loop(lambda x: leak.update(w * x), _scale()).sum()

    w = jnp.linspace(0.5, 1.5, N)
    key = jax.random.key(3)
    want = bs.transform.fwd_grad(bs_loss, key=key)(w)
    want_exact = bs.transform.jacfwd(bs_loss)(w)

    def loss(w):
        return jax.lax.scan(lambda _, x: (None, _smooth_port(w * x)), None, _scale())[1].sum()

    pure, state0 = tx.uncurry(loss, w)
    f = lambda w: pure(state0, w)[0]  # noqa: E731
    np.testing.assert_allclose(_port_fwd_grad(f, key)(w), want, rtol=1e-5)
    np.testing.assert_allclose(jax.jacfwd(f)(w), want_exact, rtol=1e-5)
    assert not np.allclose(want, want_exact, rtol=0.1)  # an estimate, not the gradient


def _lanes():
    return jnp.linspace(0.0, 0.9, 4)[:, None] * jnp.ones(N)


def _batched_port(lanes):
    pure, state0 = tx.uncurry(_simulate_port(LIF()), _scale())
    batch = {"lif": {"v": lanes, "spike": jnp.zeros_like(lanes)}}
    spikes, new = jax.vmap(pure, in_axes=(0, None))(batch, _scale())
    return spikes, new["lif"]["v"], new["lif"]["spike"]


def _batched_brainstate(bs, mapping, lanes):
    pop = _brainstate_lif(bs)
    pop.v.value, pop.spike.value = lanes, jnp.zeros_like(lanes)
    spikes = mapping(pop, lambda s: bs.transform.for_loop(
        lambda x: pop.update(CURRENTS * x), s))(_scale())
    return spikes, pop.v.value, pop.spike.value


@pytest.mark.parametrize("kind", ["vmap", "vmap2", "StatefulMapping"])
def test_vmap_over_states_is_a_vmap_of_pure(kind):
    bs = _bs()
    from brainstate.util.filter import OfType

    mappings = {
        "vmap": lambda pop, f: bs.transform.jit(bs.transform.vmap(
            f, in_axes=None, axis_size=4,
            in_states=[pop.v, pop.spike], out_states=[pop.v, pop.spike])),
        "vmap2": lambda pop, f: bs.transform.vmap2(
            f, in_axes=None, axis_size=4,
            state_in_axes={0: OfType(bs.ShortTermState)},
            state_out_axes={0: OfType(bs.ShortTermState)}),
        "StatefulMapping": lambda pop, f: bs.transform.StatefulMapping(
            f, in_axes=None, axis_size=4,
            state_in_axes={0: [pop.v, pop.spike]}, state_out_axes={0: [pop.v, pop.spike]}),
    }
    want = _batched_brainstate(bs, mappings[kind], _lanes())
    got = _batched_port(_lanes())
    assert want[0].shape == (4, STEPS, N) and want[1].shape == (4, N)
    assert len({float(s.sum()) for s in want[0]}) > 1  # the lanes differ
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    np.testing.assert_array_equal(got[2], want[2])


def test_pmap2_over_the_local_devices_is_a_pmap_of_pure():
    bs = _bs()
    n_dev = jax.local_device_count()
    lanes = jnp.linspace(0.0, 0.9, n_dev)[:, None] * jnp.ones(N)
    want = _batched_brainstate(bs, lambda pop, f: bs.transform.pmap2(
        f, in_axes=None, axis_size=n_dev,
        state_in_axes={0: [pop.v, pop.spike]}, state_out_axes={0: [pop.v, pop.spike]}), lanes)
    pure, state0 = tx.uncurry(_simulate_port(LIF()), _scale())
    per_device = {"lif": {"v": lanes, "spike": jnp.zeros_like(lanes)}}
    spikes, new = jax.pmap(pure, in_axes=(0, None))(per_device, _scale())
    np.testing.assert_allclose(spikes, want[0])
    np.testing.assert_allclose(new["lif"]["v"], want[1], rtol=1e-6)
    # a device runs what a vmap lane runs
    lane_spikes, lane_v, _ = _batched_port(lanes)
    np.testing.assert_allclose(spikes, lane_spikes)
    np.testing.assert_allclose(new["lif"]["v"], lane_v, rtol=1e-6)


def test_random_draws_fresh_standard_normals_in_both():
    bs = _bs()
    bs.random.seed(0)
    want = bs.transform.jit(lambda s: bs.transform.for_loop(
        lambda x: x * bs.random.normal(size=(N,)), s))(_scale())

    def noisy(s):
        return jax.lax.scan(
            lambda _, x: (None, x * jax.random.normal(tx.next_key(), (N,))), None, s)[1]

    pure, state0 = tx.uncurry(noisy, _scale())
    got, state1 = jax.jit(pure)(state0, _scale())
    assert "rng" in state1
    np.testing.assert_allclose(pure(state0, _scale())[0], got, rtol=1e-6)  # again from state0
    assert got.shape == want.shape == (STEPS, N)
    for draws in (got, want):
        z = draws / _scale()[:, None]
        assert not np.allclose(z[0], z[1])  # a fresh draw each step
        assert abs(float(z.mean())) < 0.1 and abs(float(z.std()) - 1.0) < 0.1


def test_debug_nan_is_debug_nans():
    bs = _bs()
    pop = _brainstate_lif(bs)

    def bs_log_rates(s):
        return jnp.log(bs.transform.for_loop(lambda x: pop.update(CURRENTS * x), s).mean(0) - 0.05)

    with pytest.raises(RuntimeError, match="primitive : `log`"):
        bs.transform.debug_nan(bs_log_rates, _scale())

    def log_rates(s):
        return jnp.log(_simulate_port(LIF())(s).mean(0) - 0.05)

    pure, state0 = tx.uncurry(log_rates, _scale())
    with pytest.raises(tx.NonFiniteError) as err:
        tx.debug_nans(pure)(state0, _scale())
    assert err.value.primitive == "log"
    # both pass the program where every neuron fires often enough
    assert bs.transform.debug_nan(bs_log_rates, 4.0 * _scale()) is None
    finite, _ = tx.debug_nans(pure)(state0, 4.0 * _scale())
    assert np.isfinite(finite).all()


def test_progress_bar_is_tx_progress(capfd):
    bs = _bs()
    from progress_recorder import Recorder

    pop = _brainstate_lif(bs)
    want = bs.transform.jit(lambda s: bs.transform.for_loop(
        lambda x: pop.update(CURRENTS * x), s, pbar=bs.transform.ProgressBar()))(_scale())
    jax.effects_barrier()
    assert f"{STEPS}/{STEPS}" in capfd.readouterr().err

    rec = Recorder()
    pure, state0 = tx.uncurry(_simulate_port(LIF()), _scale())
    got, _ = jax.jit(tx.progress(pure, display=rec))(state0, _scale())
    jax.effects_barrier()
    np.testing.assert_array_equal(got, want)
    assert rec.events[0][0] == "start" and rec.events[0][2] == STEPS
    assert rec.events[-1][0] == "close" and rec.events[-1][2] == STEPS

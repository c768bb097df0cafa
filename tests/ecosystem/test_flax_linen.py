"""taxpr inside flax linen: `nn.scan` over layers with
`variable_broadcast="params"` and a taxpr sow of a carry-derived value (init,
plain apply, reap, plant) or a state counter, `nn.remat`, and `nn.Dropout`
with its rng from `tx.next_key`.

References: the same layers applied by a Python loop with the same
parameters, keys threaded by hand.
"""
import pytest

nn = pytest.importorskip("flax.linen")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import taxpr as tx  # noqa: E402
from taxpr import harvest as h  # noqa: E402

from ecohelpers import Counter, close  # noqa: E402

LAYERS = 3
X = jnp.array([[0.5, -1.0, 2.0], [1.0, 0.0, -0.5]])


class SowingBlock(nn.Module):
    @nn.compact
    def __call__(self, carry, _):
        carry = jnp.tanh(nn.Dense(3)(carry))
        h.sow(carry.sum(), tag="lin", name="carry_sum", mode="append")
        return carry, None


class CountingBlock(nn.Module):
    @nn.compact
    def __call__(self, carry, _):
        tx.set_state("ln_calls", tx.get_state("ln_calls", jnp.zeros((), jnp.int32)) + 1)
        scale = tx.get_state("ln_scale", jnp.float32(1.0))
        return jnp.tanh(nn.Dense(3)(carry)) * scale, None


def _callback_count(run, prepare=lambda model: None):
    """Body calls of the same nn.scan model without taxpr, counted at run
    time with jax.debug.callback (flax runs the body once more than the
    length, outside the loop, for the broadcast variables)."""
    counter = Counter()

    class TickingBlock(nn.Module):
        @nn.compact
        def __call__(self, carry, _):
            counter.tick()
            return jnp.tanh(nn.Dense(3)(carry)), None

    model = _scanned(TickingBlock)
    prepared = prepare(model)
    jax.effects_barrier()
    counter.reset()
    run(model) if prepared is None else run(model, prepared)
    jax.effects_barrier()
    return counter.n


def _scanned(block):
    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            ScanBlock = nn.scan(block, variable_broadcast="params",
                                split_rngs={"params": False}, length=LAYERS)
            return ScanBlock()(x, None)[0]
    return Stack()


def _dense_params(variables):
    (name,) = variables["params"]  # nn.scan names it Scan<Block>_0
    assert name.startswith("Scan"), name
    p = variables["params"][name]["Dense_0"]
    return p["kernel"], p["bias"]


def _python_loop(variables, x, scale=1.0):
    kernel, bias = _dense_params(variables)
    sums = []
    for _ in range(LAYERS):
        x = jnp.tanh(x @ kernel + bias) * scale
        sums.append(x.sum())
    return x, jnp.stack(sums)


_SOWING = []


def _sowing():
    """The scan-over-layers model with a sow and its variables (initialized
    once per module; every test that needs it fails alone if init does)."""
    if not _SOWING:
        model = _scanned(SowingBlock)
        variables = model.init(jax.random.key(0), X)  # must work with the sow inside
        _SOWING.append((model, variables))
    return _SOWING[0]


def test_scan_broadcast_params_init_shapes():
    model, variables = _sowing()
    kernel, bias = _dense_params(variables)
    assert kernel.shape == (3, 3) and bias.shape == (3,)  # broadcast: one set of params


def test_scan_broadcast_params_plain_apply():
    model, variables = _sowing()
    out = model.apply(variables, X)
    close(out, _python_loop(variables, X)[0])
    close(jax.jit(model.apply)(variables, X), _python_loop(variables, X)[0])


def test_scan_broadcast_params_reap_carry_sow():
    # One row per layer, as flax's own sow: flax's extra trace of the body
    # (its loop-invariance check) sows nothing.
    model, variables = _sowing()
    _, want = _python_loop(variables, X)
    reaped = h.reap(lambda x: model.apply(variables, x), tag="lin")(X)
    close(reaped["carry_sum"], want)
    reaped = jax.jit(h.reap(lambda x: model.apply(variables, x), tag="lin"))(X)
    close(reaped["carry_sum"], want)


def test_scan_broadcast_params_plant_carry_sow():
    model, variables = _sowing()
    # planting the (unused) sown sums changes nothing in the output
    out = h.plant(lambda x: model.apply(variables, x), tag="lin")(
        {"carry_sum": jnp.zeros(LAYERS)}, X)
    close(out, _python_loop(variables, X)[0])


def test_scan_broadcast_params_init_inside_reap():
    model = _scanned(SowingBlock)
    reaped = h.reap(lambda x: model.init(jax.random.key(0), x), tag="lin")(X)
    variables = model.init(jax.random.key(0), X)
    close(reaped["carry_sum"], _python_loop(variables, X)[1])


class JittedSowBlock(nn.Module):
    @nn.compact
    def __call__(self, carry, _):
        carry = jnp.tanh(nn.Dense(3)(carry))
        jax.jit(lambda v: h.sow(v, tag="lin", name="carry_sum", mode="append"))(carry.sum())
        return carry, None


class SettingBlock(nn.Module):
    """Sets a state to a value computed from the carry (the last layer's sum)."""

    @nn.compact
    def __call__(self, carry, _):
        carry = jnp.tanh(nn.Dense(3)(carry))
        tx.set_state("ln_last", carry.sum())
        return carry, None


def test_scan_broadcast_params_reap_sow_inside_a_jit_in_the_body():
    model = _scanned(JittedSowBlock)
    variables = model.init(jax.random.key(0), X)
    reaped = h.reap(lambda x: model.apply(variables, x), tag="lin")(X)
    close(reaped["carry_sum"], _python_loop(variables, X)[1])


def test_scan_broadcast_params_state_set_from_the_carry_fails_as_a_callback_does():
    # flax evaluates its extra trace of the body with its effects, and its
    # loop-invariance check then sees a carry-derived value used: the same
    # error as for a jax.debug.callback of that value, without taxpr.
    class CallbackBlock(nn.Module):
        @nn.compact
        def __call__(self, carry, _):
            carry = jnp.tanh(nn.Dense(3)(carry))
            jax.debug.callback(lambda v: None, carry.sum())
            return carry, None

    message = r"broadcasted variable has a data dependency on the scan body"
    with pytest.raises(ValueError, match=message):
        _scanned(CallbackBlock).init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=message):
        _scanned(SettingBlock).init(jax.random.key(0), X)


def test_scan_broadcast_params_state_counter():
    model = _scanned(CountingBlock)

    def init_and_apply(x):
        variables = model.init(jax.random.key(0), x)
        tx.set_state("ln_scale", jnp.float32(0.5))
        return model.apply(variables, x), variables

    pure, s0 = tx.uncurry(init_and_apply, X)
    (out, variables), s1 = pure(s0, X)
    close(out, _python_loop(variables, X, scale=0.5)[0])
    want = _callback_count(lambda m: jax.jit(
        lambda x: m.apply(m.init(jax.random.key(0), x), x))(X))
    assert want >= 2 * LAYERS
    assert int(s1["ln_calls"]) == want


def test_scan_broadcast_params_state_counter_apply_only():
    model = _scanned(CountingBlock)
    pure_init, si = tx.uncurry(lambda x: model.init(jax.random.key(0), x), X)
    variables, _ = pure_init(si, X)
    pure, s0 = tx.uncurry(lambda v, x: model.apply(v, x), variables, X)
    out, s1 = jax.jit(pure)({**s0, "ln_scale": jnp.float32(2.0)}, variables, X)
    close(out, _python_loop(variables, X, scale=2.0)[0])
    want = _callback_count(lambda m, v: jax.jit(m.apply)(v, X),
                           prepare=lambda m: m.init(jax.random.key(0), X))
    assert want >= LAYERS
    assert int(s1["ln_calls"]) == want


# --- nn.remat ------------------------------------------------------------------

class RematStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        Block = nn.remat(CountingDense)
        for _ in range(2):
            x = Block()(x)
        return x.sum()


class CountingDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        tx.set_state("rm_calls", tx.get_state("rm_calls", jnp.zeros((), jnp.int32)) + 1)
        return jnp.sin(nn.Dense(3)(x)) * tx.get_state("rm_scale", jnp.float32(1.0))


def test_remat_grad_inside_with_state():
    model = RematStack()
    pure_init, si = tx.uncurry(lambda x: model.init(jax.random.key(1), x), X)
    variables, _ = pure_init(si, X)

    def f(v, x):
        tx.set_state("rm_scale", jnp.float32(2.0))
        return jax.value_and_grad(lambda v: model.apply(v, x))(v)

    pure, s0 = tx.uncurry(f, variables, X)
    (val, grads), s1 = pure(s0, variables, X)

    def ref(v, x):  # the same network, scale 2, no state, no remat
        p = v["params"]
        for name in ["CheckpointCountingDense_0", "CheckpointCountingDense_1"]:
            x = jnp.sin(x @ p[name]["Dense_0"]["kernel"] + p[name]["Dense_0"]["bias"]) * 2.0
        return x.sum()

    rval, rgrads = jax.value_and_grad(ref)(variables, X)
    close(val, rval)
    for name in ["CheckpointCountingDense_0", "CheckpointCountingDense_1"]:
        close(grads["params"][name]["Dense_0"]["kernel"],
              rgrads["params"][name]["Dense_0"]["kernel"], rtol=1e-5, atol=1e-6)
    assert int(s1["rm_calls"]) == 2  # the recomputation sets nothing


def test_remat_reap_sow():
    class Sowing(nn.Module):
        @nn.compact
        def __call__(self, x):
            return h.sow(jnp.sin(nn.Dense(3)(x)), tag="rm", name="rm_act").sum()

    model = nn.remat(Sowing)()
    variables = model.init(jax.random.key(2), X)
    p = variables["params"]["Dense_0"]
    out, reaped = h.call_and_reap(lambda x: model.apply(variables, x), tag="rm")(X)
    close(reaped["rm_act"], jnp.sin(X @ p["kernel"] + p["bias"]))
    close(h.plant(lambda x: model.apply(variables, x), tag="rm")(
        {"rm_act": jnp.ones((2, 3))}, X), 6.0)


# --- nn.Dropout with its rng from tx.next_key --------------------------------------

class DropoutMLP(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic):
        x = nn.Dense(8)(x)
        x = nn.Dropout(0.5)(jax.nn.relu(x), deterministic=deterministic)
        return nn.Dense(1)(x)


def test_dropout_rng_from_next_key():
    model = DropoutMLP()
    variables = model.init(jax.random.key(3), X, deterministic=True)

    def f(v, x):
        return model.apply(v, x, deterministic=False, rngs={"dropout": tx.next_key()})

    pure, s = tx.uncurry(f, variables, X)
    key = jax.random.key(0)
    outs = []
    for _ in range(2):
        out, s = jax.jit(pure)(s, variables, X)
        key, sub = jax.random.split(key)
        close(out, model.apply(variables, X, deterministic=False, rngs={"dropout": sub}))
        outs.append(np.asarray(out))
    assert not np.allclose(outs[0], outs[1])
    g = jax.grad(lambda v: pure(s, v, X)[0].sum())(variables)
    _, sub = jax.random.split(key)
    g_want = jax.grad(lambda v: model.apply(v, X, deterministic=False,
                                            rngs={"dropout": sub}).sum())(variables)
    close(g["params"]["Dense_0"]["kernel"], g_want["params"]["Dense_0"]["kernel"])


def test_dropout_in_scan_over_layers_rng_from_next_key():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, c, _):
            return nn.Dropout(0.5, deterministic=False)(c), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.scan(Block, variable_broadcast="params",
                           split_rngs={"params": False, "dropout": True},
                           length=LAYERS)()(x, None)[0]

    model = Stack()
    variables = model.init(jax.random.key(0), X)
    pure, s0 = tx.uncurry(lambda x: model.apply(variables, x, rngs={"dropout": tx.next_key()}), X)
    out, _ = pure(s0, X)
    _, sub = jax.random.split(s0["rng"])
    close(out, model.apply(variables, X, rngs={"dropout": sub}))


# --- nn.scan / nn.remat_scan over checkpointed layers ---------------------------
# flax evaluates its analysis trace of the body with its effects; a state
# access there runs as a jax.debug.callback does, also inside the layer's
# checkpoint (where an effect-free equation would be dropped).

class CountingLayer(nn.Module):
    tick: object = None  # a Counter's tick in the reference run, else the state

    @nn.compact
    def __call__(self, x):
        if self.tick is None:
            tx.set_state("layer_calls", tx.get_state("layer_calls", jnp.zeros((), jnp.int32)) + 1)
        else:
            self.tick()
        return x + jnp.tanh(nn.Dense(3)(x))


class CountingScanLayer(CountingLayer):
    def __call__(self, x, _=None):
        return super().__call__(x), None


_CHECKPOINTED_STACKS = {
    "scan_of_remat": lambda **kw: nn.scan(
        nn.remat(CountingScanLayer), variable_axes={"params": 0}, split_rngs={"params": True},
        length=4)(**kw),
    "remat_scan": lambda **kw: nn.remat_scan(CountingLayer, lengths=(2, 3))(**kw),
}


@pytest.mark.parametrize("stack", sorted(_CHECKPOINTED_STACKS))
def test_state_counter_in_checkpointed_scanned_layers_counts_as_a_callback(stack):
    make = _CHECKPOINTED_STACKS[stack]
    counter = Counter()
    ticking = make(tick=counter.tick)
    variables = ticking.init(jax.random.key(0), X)
    jax.effects_barrier()
    counter.reset()
    want_out = ticking.apply(variables, X)
    jax.effects_barrier()
    model = make()
    pure, s0 = tx.uncurry(model.apply, variables, X)
    out, s1 = jax.jit(pure)(s0, variables, X)
    close(jax.tree.leaves(out)[0], jax.tree.leaves(want_out)[0])
    assert counter.n > 0 and int(s1["layer_calls"]) == counter.n

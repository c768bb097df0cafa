"""Programs whose generated Python code must run on its own (in a fresh
process, no ``OBJECTS``) and compute what their jaxpr computes, bit for bit:
what the ir fuzzer generates (plain, vmapped, differentiated), what
tests/test_ir_codegen.py covers family by family, and realistic programs
(indexing updates, debug prints, gathers, batched matmuls, reductions,
scans of sorts and cumulative sums, convolutions, dynamic slices, random
numbers, host callbacks of module-level functions, linear algebra, taxpr
state, a shard_map over two CPU devices), the programs of examples/ (their
pure functions, reap/plant-transformed functions and training steps) and,
for the JAX libraries installed, their programs with taxpr state or sows
(equinox, diffrax, optimistix, lineax, optax, flax linen and nnx).

``cases()`` lists ``(name, jaxpr, flat arguments)``. bench/codegen_binds.py
counts the primitives the generated code of these programs still binds.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

import taxpr as tx

CALLS: Counter = Counter()

F32 = np.array([0.5, -1.25, 3.0, -0.0, 2.0, -7.5, 1.0, 0.25], np.float32)
IDX = np.array([0, 2, 2, 7, -1, 9, -9], np.int32)  # repeats, negative, out of bounds


def host_square(x):
    """A module-level function called back from the device."""
    return (np.asarray(x) * np.asarray(x)).astype(np.float32)


def host_count(x):
    CALLS["host_count"] += 1
    return x


# ---- realistic programs -----------------------------------------------------------------------

def scatter_updates(x, idx, upd):
    return (x.at[idx].add(1.0), x.at[idx].add(upd), x.at[idx].set(upd, mode="drop"),
            x.at[idx].mul(upd), x.at[idx].min(upd), x.at[idx].max(upd),
            x.at[idx].get(mode="fill", fill_value=-1.0))


def debug_prints(x, idx):
    jax.debug.print("x is {} and {y}", x, y=idx)
    jax.debug.print("sum {s:.3f}", s=x.sum(), ordered=True)
    return x * 2.0


def gathers(m, idx):
    i = jnp.clip(idx, 0, 3)
    return (m[i], m[:, i], m[i, i], jnp.take_along_axis(m, i[:4, None] % 4, axis=1),
            jnp.take(m.ravel(), idx, mode="wrap"))


def matmuls(a, b, h):
    return (jnp.einsum("bij,bjk->bik", a, b), a[0] @ b[0],
            lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))),
                            preferred_element_type=np.float32),
            jnp.dot(h, h.T), jnp.tensordot(a, b, axes=([1, 2], [2, 1])))


def reductions(m, k):
    return (m.sum(), m.sum(axis=0), m.max(axis=1), m.min(), m.prod(axis=0), m.mean(),
            jnp.argmax(m, axis=1), jnp.argmin(m), (m > 0).any(axis=0), (m > 0).all(),
            jax.nn.logsumexp(m, axis=1), jnp.bitwise_xor.reduce(k), jnp.bitwise_or.reduce(k),
            lax.reduce((m, m), (np.float32(0), np.float32(1)),
                       lambda a, b: (a[0] + b[0], a[1] * b[1]), (0,)))


def cumulative_and_sorts(x, k):
    return (jnp.cumsum(x), jnp.cumprod(x[:4]), lax.cummax(x, reverse=True),
            lax.cummin(x), lax.cumlogsumexp(x), jnp.sort(x), jnp.argsort(x),
            lax.sort((k, x), num_keys=1), lax.top_k(x, 3))


def convolution(img, ker):
    return (lax.conv_general_dilated(img, ker, (1, 1), "SAME"),
            lax.conv(img, ker, (2, 1), "VALID"),
            lax.conv_general_dilated(img, ker, (1, 1), ((1, 0), (0, 1)),
                                     rhs_dilation=(1, 2)))


def dynamic_slices(x, m, i):
    return (lax.dynamic_slice(x, (i,), (3,)), lax.dynamic_slice_in_dim(m, i, 2, axis=1),
            lax.dynamic_update_slice(x, x[:2] * 10.0, (i,)),
            lax.dynamic_update_slice(m, m[:1, :2], (i, np.int32(1))),
            lax.dynamic_index_in_dim(x, i - 3, keepdims=False))


def shapes(x, m, k):
    return (jnp.arange(6), lax.broadcasted_iota(np.int32, (2, 3), 1), jnp.where(x > 0, x, -x),
            lax.clamp(np.float32(-1.0), x, np.float32(1.0)), jnp.clip(k, -3, 3),
            lax.select_n(k % 3, x, -x, x * 2.0), jnp.pad(m, ((1, 0), (0, 2)), constant_values=7.0),
            jnp.concatenate([x, x[:3]]), m.T, jnp.flip(m, 0), jnp.split(x, [3, 5]),
            x.reshape(2, 4)[None], jnp.roll(x, 3), jnp.tile(x[:2], 3), jnp.repeat(x[:3], 2),
            lax.reduce_precision(x, 5, 10), lax.bitcast_convert_type(x, np.int32),
            x.astype(jnp.bfloat16), k.astype(np.float32), jnp.round(x), jnp.expand_dims(x, 1),
            lax.rev(m, (1,)), jnp.squeeze(m[:1]))


def random_numbers(seed, x):
    key = jax.random.key(seed)
    k1, k2 = jax.random.split(key)
    k3 = jax.random.fold_in(k1, 7)
    old = jax.random.PRNGKey(seed)
    return (jax.random.normal(k1, (3,)), jax.random.uniform(k2, (2, 2)),
            jax.random.randint(k3, (4,), 0, 10), jax.random.bernoulli(k2, 0.3, (5,)),
            jax.random.permutation(k3, x), jax.random.normal(old, (2,)),
            jax.random.key_data(jax.random.split(k3, 3)), jax.random.bits(k1, (2,), np.uint8),
            jax.random.gumbel(jax.random.key(3), (2,)))


def rng_bit_generator(key):
    new_key, bits = lax.rng_bit_generator(key, (2, 3))
    return new_key, bits, lax.rng_bit_generator(key, (4,), dtype=np.uint8)[1]


def host_callbacks(x):
    a = jax.pure_callback(host_square, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    b = jax.pure_callback(np.sort, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                          vmap_method="sequential")
    c = io_callback(host_count, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ordered=True)
    return a + b, c


def linear_algebra(a, b):
    p, l, u = jax.scipy.linalg.lu(a)
    return (jnp.linalg.solve(a, b), l @ u, p,
            jax.scipy.linalg.solve_triangular(u, b, lower=False),
            jax.scipy.sparse.linalg.cg(lambda v: a.T @ (a @ v), b, maxiter=3)[0])


def neural_network(w, x):
    h = jax.nn.relu(x @ w)
    h = jax.nn.softmax(h, axis=-1)
    g = jax.grad(lambda w: jnp.sum(jax.nn.gelu(x @ w) ** 2))(w)
    return h, g, jnp.linalg.norm(h, axis=-1), jax.nn.one_hot(jnp.argmax(h, -1), 4)


def stateful_rnn(w, xs):
    def rnn(w, xs):
        def step(_, x):
            h = tx.get_state("h", lambda: jnp.zeros(2))
            h = jnp.tanh(w @ h + x)
            tx.set_state("h", h)
            return None, h
        return lax.scan(step, None, xs)[1]

    pure, state0 = tx.uncurry(rnn, w, xs)
    return pure(state0, w, xs)


def state_through_custom_vjps(a, b):
    """Two custom_vjp functions, one counting its calls in a state, one
    reading a float state: uncurry's pure program passes the float state
    through the first call (``taxpr_ctx_through``)."""
    from state_helpers import counting_and_scaling_custom_vjps

    count, read_scale = counting_and_scaling_custom_vjps()

    def program(a, b):
        return read_scale(*count(a, b))

    pure, state0 = tx.uncurry(program, a, b)
    return pure({**state0, "scale": np.float32(-2.0)}, a, b)


# ---- families of tests/test_ir_codegen.py ------------------------------------------------------

def control_flow(x, i, n):
    def body(c):
        j, v = c
        v = lax.cond(j % 2 == 0, jnp.sin, lambda u: u * 2.0, v)
        return j + 1, v

    s = lax.switch(i, [jnp.sin, jnp.cos, lambda v: -v], x)
    w = lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]
    sc = lax.scan(lambda c, t: (c * t + 1.0, c.sum()), x, jnp.stack([x, -x, x * 0.5]),
                  reverse=True)
    fl = lax.fori_loop(0, 3, lambda k, c: c * 2.0 + k, x)
    return s, w, sc, fl


def calls(x):
    @jax.jit
    def g(v):
        return jnp.sin(io_callback(host_count, jax.ShapeDtypeStruct(v.shape, v.dtype), v))

    @jax.custom_jvp
    def cj(v):
        return jnp.exp(v) - 1.0

    cj.defjvp(lambda p, t: (cj(p[0]), t[0] * 100.0))

    @jax.custom_vjp
    def cv(v):
        return jnp.log1p(v * v)

    cv.defvjp(lambda v: (cv(v), v), lambda r, g: (g * 100.0,))
    return g(x) + g(x), jax.checkpoint(lambda v: jnp.sin(v) * v)(x), cj(x) * cv(x)


def tags(x):
    y = tx.tag({"a": x, "b": x * 2.0}, op="hello", layer=3)
    return y["a"] + tx.tag(y["b"], op="single")


def literals(a, b, x, h):
    return (lax.div(a, b), lax.rem(a, b), lax.div(a, np.int32(-2)), a // 3,
            x + 2, x * -0.0, x + jnp.float32(np.inf), jnp.where(x > 0, x, np.nan),
            h * jnp.bfloat16(2.5), h + 1, jnp.int8(-128) + jnp.int8(1), x * 1e-45)


def vmapped_while(xs, ns):
    def f(x, n):
        return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 1.5 - 0.25),
                              (0, x))
    return jax.vmap(f)(xs, ns)


def closure_constants(x):
    small = np.linspace(-1, 1, 5, dtype=np.float32)
    key = jax.random.key(11)
    return jnp.asarray(small) * x, jax.random.normal(key, (2,)) + x


def sharded_sum(x):
    from jax.sharding import PartitionSpec as P

    from helpers import cpu_mesh, shard_map

    return shard_map()(lambda v: lax.psum(jnp.sin(v), "i"), mesh=cpu_mesh("i", 2),
                       in_specs=P("i"), out_specs=P())(x)


def _realistic() -> dict:
    m = np.arange(16, dtype=np.float32).reshape(4, 4) / 3.0 - 2.0
    k = np.array([3, -1, 4, 1, -5, 9, 2, -6], np.int32)
    a = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((2, 4, 3)).astype(np.float32)
    h = np.random.default_rng(2).standard_normal((3, 4)).astype(jnp.bfloat16)
    img = np.random.default_rng(3).standard_normal((1, 2, 5, 5)).astype(np.float32)
    ker = np.random.default_rng(4).standard_normal((3, 2, 3, 2)).astype(np.float32)
    sq = np.array([[4.0, 1.0, 0.5], [1.0, 3.0, -1.0], [0.5, -1.0, 5.0]], np.float32)
    w = np.random.default_rng(5).standard_normal((4, 4)).astype(np.float32)
    return {
        "scatter_updates": (scatter_updates, (F32, IDX, np.linspace(-1, 1, 7, dtype=np.float32))),
        "debug_prints": (debug_prints, (F32, IDX)),
        "gathers": (gathers, (m, IDX)),
        "matmuls": (matmuls, (a, b, h)),
        "reductions": (reductions, (m, k)),
        "cumulative_and_sorts": (cumulative_and_sorts, (F32, k)),
        "convolution": (convolution, (img, ker)),
        "dynamic_slices": (dynamic_slices, (F32, m, np.int32(-2))),
        "dynamic_slices_out_of_bounds": (dynamic_slices, (F32, m, np.int32(7))),
        "shapes": (shapes, (F32, m, k)),
        "random_numbers": (random_numbers, (np.int32(42), F32)),
        "rng_bit_generator": (rng_bit_generator, (np.array([1, 2, 3, 4], np.uint32),)),
        "host_callbacks": (host_callbacks, (F32,)),
        "linear_algebra": (linear_algebra, (sq, np.array([1.0, -2.0, 0.5], np.float32))),
        "neural_network": (neural_network, (w, m)),
        "stateful_rnn": (stateful_rnn, (0.5 * np.eye(2, dtype=np.float32),
                                        np.ones((5, 2), np.float32))),
        "state_through_custom_vjps": (state_through_custom_vjps,
                                      (np.float32(0.25), np.float32(0.75))),
        "control_flow": (control_flow, (F32[:3], np.int32(1), np.int32(5))),
        "calls": (calls, (np.float32(0.3),)),
        "tags": (tags, (np.float32(1.5),)),
        "literals": (literals, (np.array([-7, 7, -2**31, 5], np.int32),
                                np.array([2, -2, -3, 1], np.int32),
                                np.array([1.0, -0.0, -3.0], np.float32),
                                np.array([0.5, -2.0], jnp.bfloat16))),
        "vmapped_while": (vmapped_while, (np.array([0.75, -2.0, 3.0], np.float32),
                                          np.array([0, 4, 2], np.int32))),
        "closure_constants": (closure_constants, (np.float32(2.0),)),
        "sharded_sum": (sharded_sum, (F32,)),
    }


# Seeds of the ir fuzzer's generator (tests/ir_fuzz/): plain, vmapped, differentiated.
FUZZ_SEEDS = {"plain": range(8), "batched": (0, 2, 3), "differentiated": (1, 5)}


def _fuzzed() -> dict:
    from ir_fuzz.build import traced_program
    from ir_fuzz.generator import differentiable, program, vmappable

    out = {}
    for mode, seeds in FUZZ_SEEDS.items():
        for seed in seeds:
            stmts = program(seed)
            if mode == "batched" and not vmappable(stmts) \
                    or mode == "differentiated" and not differentiable(stmts):
                continue
            _, args, j = traced_program(seed, batched=mode == "batched",
                                        differentiated=mode == "differentiated")
            out[f"fuzz_{mode}_{seed}"] = (j, list(args))
    return out


# ---- the programs of examples/ ---------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def has(*modules: str) -> bool:
    """Whether every one of ``modules`` is installed."""
    return all(importlib.util.find_spec(m) is not None for m in modules)


@functools.cache
def example(name: str):
    """examples/<name>.py as a module: its functions and constants (its
    ``main()`` runs only as a script)."""
    spec = importlib.util.spec_from_file_location(f"taxpr_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _traced(fn, *args) -> tuple:
    """``(jax.make_jaxpr(fn)(*args), the flat arguments)``."""
    return jax.make_jaxpr(fn)(*args), jax.tree_util.tree_leaves(args)


def _examples() -> dict:
    """The jaxprs the examples' programs run (their pure functions, their
    transformed functions, their training steps), with their inputs."""
    from taxpr import harvest as h

    out = {}
    m = example("activation_patching")
    params, x = m.init(jax.random.key(0)), jnp.linspace(-1.0, 1.0, m.WIDTH)
    out["example_activation_patching_reap"] = _traced(
        h.call_and_reap(m.model, tag="acts"), params, x)
    out["example_activation_patching_plant"] = _traced(
        h.plant(m.model, tag="acts"), {"act": h.rows({1: jnp.ones(m.WIDTH)})}, params, x)

    m = example("attention_heads")
    params, tokens = m.init(jax.random.key(0)), m.batch(jax.random.key(1), 4)
    probs = [s.name for s in tx.sites(m.transformer, params, tokens[0])
             if s.scope == "attn" and s.primitive == "div"][-1]
    out["example_attention_heads_capture"] = _traced(
        jax.vmap(tx.capture(m.transformer, probs), in_axes=(None, 0)), params, tokens)
    uniform = jnp.full((m.SEQ, m.SEQ), 1.0 / m.SEQ)
    out["example_attention_heads_patch"] = _traced(
        lambda p, t: m.loss_fn(p, t, tx.patch(m.transformer, {probs: lambda w: w.at[0].set(
            uniform)})), params, tokens)

    m = example("constraint_tracking")
    state, dt = (np.float32(2.0), np.float32(0.0)), np.float32(0.05)
    jaxpr = jax.make_jaxpr(m.simulate)(state, dt)
    out["example_constraint_tracking"] = (jaxpr, [*state, dt])
    values, _, _ = tx.transpose(jaxpr, predicate=lambda p, shape: p.get("kind") == "constraint")
    out["example_constraint_tracking_values"] = (values, [*state, dt])

    m = example("running_sum")
    xs = np.arange(1.0, 5.0, dtype=np.float32)
    pure, state0 = tx.uncurry(m.program, xs)
    jaxpr, infos = tx.make_jaxpr_with_states(m.program)(xs)
    out["example_running_sum"] = (jaxpr, [state0[i.name] for i in infos] + [xs])
    out["example_running_sum_jit_pure"] = _traced(jax.jit(pure), state0, xs)

    m = example("stateful_rnn")
    kp, kx, ky = jax.random.split(jax.random.key(0), 3)
    params = m.init_params(kp)
    xs, targets = jax.random.normal(kx, (m.STEPS, m.IN)), jax.random.normal(ky, (m.STEPS, m.OUT))
    pure, state0 = tx.uncurry(m.rnn, params, xs)
    out["example_stateful_rnn"] = _traced(pure, state0, params, xs)
    state1 = {"h": jnp.linspace(-0.5, 0.5, m.HIDDEN)}
    out["example_stateful_rnn_grad"] = _traced(
        jax.grad(lambda p, s: jnp.mean((pure(s, p, xs)[0] - targets) ** 2)), params, state1)

    m = example("data_parallel")
    pure, state0 = tx.uncurry(m.train_step, *m.global_batch(0))

    def data_parallel_step(state, x, y):
        # examples/data_parallel.py's step on one device; its dropout
        # stream's key is given as its data.
        state = {**state, "dropout": jax.random.wrap_key_data(state["dropout"])}
        loss, new = pure(state, x, y)
        return loss, {**new, "dropout": jax.random.key_data(new["dropout"])}

    state0 = {**state0, "dropout": jax.random.key_data(state0["dropout"])}
    out["example_data_parallel_step"] = _traced(jax.jit(data_parallel_step), state0,
                                                *m.global_batch(0))

    m = example("nan_hunt")
    x, y = m.data(jax.random.key(0))
    _, train = m.make_train(jax.nn.log_sigmoid)
    out["example_nan_hunt_train"] = _traced(train, jnp.zeros((2,)), x, y)

    if has("equinox"):
        out.update(_equinox_examples())
    return out


def _equinox_examples() -> dict:
    import equinox as eqx

    out = {}
    m = example("dropout_mlp")
    k_model, k_x = jax.random.split(jax.random.key(0))
    model = m.MLP(k_model)
    x = jax.random.normal(k_x, (m.BATCH, m.WIDTH))
    y = jnp.sin(x.sum(axis=1))
    pure, _ = tx.uncurry(m.loss, model, x, y)
    weights, static = eqx.partition(model, eqx.is_array)

    @eqx.filter_jit
    def step(weights, key_data):
        # examples/dropout_mlp.py's training step; its dropout stream's key
        # is given as its data.
        model = eqx.combine(weights, static)
        state = {"dropout": jax.random.wrap_key_data(key_data)}

        def objective(m):
            (value, masks), new_state = pure(state, m, x, y)
            return value, (masks, new_state)
        (value, (masks, new_state)), grads = eqx.filter_value_and_grad(
            objective, has_aux=True)(model)
        new_model = jax.tree_util.tree_map(lambda p, g: p - m.LR * g, model, grads)
        return (eqx.filter(new_model, eqx.is_array), jax.random.key_data(new_state["dropout"]),
                value, masks)

    out["example_dropout_mlp_step"] = _traced(
        step, weights, jax.random.key_data(jax.random.key(1)))

    m = example("mlp_running_stats")
    kmodel, kdata = jax.random.split(jax.random.key(0))
    model = m.MLP(kmodel)
    xs = jax.random.normal(kdata, (2, m.BATCH, m.SIZES[0]))
    ys = jax.vmap(m.target_fn)(xs)
    pure, state = tx.uncurry(lambda model, x, train: model(x, train), model, xs[0], True)

    def sgd_step(model, state, x, y):
        def loss(model, state, x, y):
            pred, new_state = pure(state, model, x, True)
            return jnp.mean((pred - y) ** 2), new_state
        (value, new_state), g = jax.value_and_grad(loss, has_aux=True)(model, state, x, y)
        return jax.tree_util.tree_map(lambda p, d: p - m.LR * d, model, g), new_state, value

    out["example_mlp_running_stats_step"] = _traced(jax.jit(sgd_step), model, state, xs[0], ys[0])
    out["example_mlp_running_stats_eval"] = _traced(
        lambda s, model, x: pure(s, model, x, False), state, model, xs[1])

    m = example("kv_cache")
    model = m.Decoder(jax.random.key(0))
    step, state0 = tx.uncurry(m.decode, model, jnp.int32(0))
    weights, static = eqx.partition(model, eqx.is_array)

    def generate(weights, state, key_data, first):
        # The example's decoding loop; its key stream is given as its data.
        state = {**state, "rng": jax.random.wrap_key_data(key_data)}
        tokens, logits, state = m.generate(step, eqx.combine(weights, static), state, first)
        return tokens, logits, {**state, "rng": jax.random.key_data(state["rng"])}

    others = {k: v for k, v in state0.items() if k != "rng"}
    out["example_kv_cache_generate"] = _traced(
        generate, weights, others, jax.random.key_data(state0["rng"]), jnp.int32(3))
    return out


# ---- programs of JAX libraries (those installed) ----------------------------------------------

def _equinox() -> dict:
    import equinox as eqx
    import equinox.internal as eqxi

    out = {}
    model = eqx.nn.MLP(3, 2, 8, 2, activation=jax.nn.softplus, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)

    @eqx.filter_jit
    def forward(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    x = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3)
    out["equinox_mlp_forward"] = _traced(forward, params, x)

    def loop(x):
        def body(carry):
            i, y = carry
            return i + 1, jnp.sin(y) * tx.get_state("scale", jnp.float32(1.0)) + 0.125 * y
        tx.set_state("scale", jnp.float32(1.25))  # (set before the loop, read in it)
        return eqxi.while_loop(lambda c: c[0] < 5, body, (0, x), max_steps=8,
                               kind="checkpointed")[1].sum()

    pure, state0 = tx.uncurry(loop, F32[:3])
    out["equinox_checkpointed_while_grad"] = _traced(
        jax.grad(lambda x, s: pure(s, x), has_aux=True), F32[:3], state0)
    return out


@contextlib.contextmanager
def equinox_checks_as_nan():
    """equinox's runtime checks (``eqx.error_if``, which diffrax's solvers
    call) as under ``EQX_ON_ERROR=nan``: a failed check gives NaNs. Under
    the default ("raise") a check calls back to a closure raising the error,
    which has no source form (the generated code reads it from ``OBJECTS``)."""
    import equinox._errors as errors

    old = errors.EQX_ON_ERROR
    errors.EQX_ON_ERROR = "nan"
    try:
        yield
    finally:
        errors.EQX_ON_ERROR = old


def _diffrax() -> dict:
    import diffrax

    def vector_field(t, y, k):
        tx.set_state("evaluations", tx.get_state("evaluations", jnp.zeros((), jnp.int32)) + 1)
        return -k * y + jnp.sin(t)

    def solve(y0, k):
        return diffrax.diffeqsolve(
            diffrax.ODETerm(vector_field), diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, args=k,
            stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-5),
            saveat=diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 4)), max_steps=64).ys

    y0, k = np.array([1.0, 0.5], np.float32), np.float32(2.0)
    with equinox_checks_as_nan():
        pure, state0 = tx.uncurry(solve, y0, k)
        # jax.grad inside the stateful function (the backward pass through
        # the default RecursiveCheckpointAdjoint's checkpointed loop).
        pure_grad, grad_state0 = tx.uncurry(
            jax.grad(lambda y0, k: solve(y0, k).sum(), argnums=(0, 1)), y0, k)
        return {
            "diffrax_tsit5_pid_saveat": _traced(pure, state0, y0, k),
            "diffrax_tsit5_grad_recursive_checkpoint": _traced(pure_grad, grad_state0, y0, k),
        }


def _optimistix() -> dict:
    import optimistix as optx

    def fn(y, target):
        tx.set_state("evaluations", tx.get_state("evaluations", jnp.zeros((), jnp.int32)) + 1)
        return y ** 3 - target

    def root(target):
        return optx.root_find(fn, optx.Newton(rtol=1e-6, atol=1e-6),
                              jnp.ones_like(target), target).value

    target = np.array([8.0, 2.0, 0.5], np.float32)
    with equinox_checks_as_nan():
        pure, state0 = tx.uncurry(root, target)
        return {"optimistix_newton_root_find": _traced(pure, state0, target)}


def _lineax() -> dict:
    import lineax as lx

    def solves(a, spd, b):
        lu = lx.linear_solve(lx.MatrixLinearOperator(a), b, lx.LU()).value
        cg = lx.linear_solve(lx.MatrixLinearOperator(spd, lx.positive_semidefinite_tag), b,
                             lx.CG(rtol=1e-6, atol=1e-6, max_steps=20)).value
        return lu, cg

    a = np.array([[4.0, 1.0, 0.5], [1.0, -3.0, -1.0], [0.5, -1.0, 5.0]], np.float32)
    spd = np.array([[4.0, 1.0, 0.5], [1.0, 3.0, -1.0], [0.5, -1.0, 5.0]], np.float32)
    return {"lineax_lu_and_cg": _traced(solves, a, spd, np.array([1.0, -2.0, 0.5], np.float32))}


def _optax() -> dict:
    import optax

    opt = optax.adam(1e-2)
    params = {"w": np.linspace(-1.0, 1.0, 6, dtype=np.float32).reshape(3, 2),
              "b": np.zeros(2, np.float32)}
    x = np.linspace(-2.0, 2.0, 12, dtype=np.float32).reshape(4, 3)
    y = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, -0.5]], np.float32)

    def step(params, opt_state, x, y):
        grads = jax.grad(lambda p: jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = opt.init(params)
    params1, opt_state = step(params, opt_state, x, y)  # a later step (count 1)
    return {"optax_adam_step": _traced(step, params1, opt_state, x, y)}


def _flax() -> dict:
    from flax import linen as nn
    from flax import nnx

    from taxpr import harvest as h

    class Block(nn.Module):
        @nn.compact
        def __call__(self, carry, _):
            carry = jnp.tanh(nn.Dense(3)(carry))
            h.sow(carry.sum(), tag="layers", name="carry_sum", mode="append")
            return carry, None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.scan(Block, variable_broadcast="params", split_rngs={"params": False},
                           length=3)()(x, None)[0]

    x = np.array([[0.5, -1.0, 2.0], [1.0, 0.0, -0.5]], np.float32)
    model = Stack()
    variables = model.init(jax.random.key(0), x)
    out = {"flax_linen_scan_over_layers_reap": _traced(
        h.call_and_reap(model.apply, tag="layers"), variables, x)}

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 4, rngs=rngs)
            self.norm = nnx.BatchNorm(4, rngs=rngs)

        def __call__(self, x):
            tx.set_state("calls", tx.get_state("calls", jnp.zeros((), jnp.int32)) + 1)
            return nnx.relu(self.norm(self.linear(x)))

    graphdef, state = nnx.split(Net(nnx.Rngs(0)))

    def apply(state, x):
        net = nnx.merge(graphdef, state)
        y = net(x)
        return y, nnx.split(net)[1]

    pure, s0 = tx.uncurry(apply, state, x)
    out["flax_nnx_linear_batchnorm"] = _traced(pure, s0, state, x)
    return out


LIBRARIES = {"equinox": (_equinox, ("equinox",)), "diffrax": (_diffrax, ("diffrax",)),
             "optimistix": (_optimistix, ("optimistix",)), "lineax": (_lineax, ("lineax",)),
             "optax": (_optax, ("optax",)), "flax": (_flax, ("flax",))}


def installed_libraries() -> tuple[str, ...]:
    """The names of ``LIBRARIES`` whose modules are installed."""
    return tuple(name for name, (_, modules) in LIBRARIES.items() if has(*modules))


def _libraries() -> dict:
    """``{library name: {program name: (jaxpr, flat arguments)}}`` for the
    libraries installed."""
    return {name: LIBRARIES[name][0]() for name in installed_libraries()}


# The source of the programs that need no library beyond taxpr's own
# dependencies (realistic programs, the examples', the fuzzer's).
CORE = "taxpr"


@functools.cache
def _sourced_cases() -> tuple[tuple[str, str, object, list], ...]:
    out = []
    for name, (fn, args) in _realistic().items():
        flat = jax.tree_util.tree_leaves(args)
        out.append((CORE, name, jax.make_jaxpr(fn)(*args), flat))
    out.extend((CORE, name, j, list(args)) for name, (j, args) in _examples().items())
    for library, programs in _libraries().items():
        out.extend((library, name, j, list(args)) for name, (j, args) in programs.items())
    out.extend((CORE, name, j, args) for name, (j, args) in _fuzzed().items())
    return tuple(out)


def cases() -> tuple[tuple[str, object, list], ...]:
    """``(name, jaxpr, flat arguments)`` of every program of the corpus
    (the library programs of the libraries installed). Traced once per
    process: the tests and bench/codegen_binds.py that read it only read."""
    return tuple((name, j, args) for _, name, j, args in _sourced_cases())


def sources() -> dict[str, str]:
    """``{program name: its source}``: ``CORE``, or the name in
    ``LIBRARIES`` of the library whose program it is."""
    return {name: source for source, name, _, _ in _sourced_cases()}

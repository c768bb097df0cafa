"""taxpr inside optax: a training loop whose loss keeps running statistics
in a state (with a learning-rate schedule driven by a step counter state),
`optax.MultiSteps`, and L-BFGS's zoom line search
(`optax.scale_by_zoom_linesearch`) on a value function that reads a state
and counts its evaluations.

References: the same training loop with the statistics threaded by hand, a
`jax.debug.callback` count of value-function evaluations without taxpr.
"""
import pytest

optax = pytest.importorskip("optax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import taxpr as tx  # noqa: E402

from ecohelpers import Counter, close  # noqa: E402

XS = jnp.array([[1.0, 2.0], [0.5, -1.0], [2.0, 0.0], [-1.0, 1.0]])
YS = jnp.array([1.0, -0.5, 2.0, 0.3])
PARAMS0 = {"w": jnp.array([0.1, -0.2]), "b": jnp.array(0.0)}
MOMENTUM = 0.9
STEPS = 3


def _loss_with_stats(params, x, y, mean):
    new_mean = MOMENTUM * mean + (1.0 - MOMENTUM) * x.mean(0)
    pred = (x - new_mean) @ params["w"] + params["b"]
    return jnp.mean((pred - y) ** 2), new_mean


def _schedule():
    return optax.exponential_decay(0.1, transition_steps=1, decay_rate=0.5)


# --- the training loop ---------------------------------------------------------

def _stateful_loss(params, x, y):
    mean = tx.get_state("running_mean", lambda: jnp.zeros(2))
    loss, new_mean = _loss_with_stats(params, x, y, mean)
    tx.set_state("running_mean", jax.lax.stop_gradient(new_mean))
    return loss


def test_training_loop_running_stats_grad_of_pure():
    opt = optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(_schedule()),
                      optax.scale(-1.0))
    pure, s = tx.uncurry(_stateful_loss, PARAMS0, XS, YS)

    @jax.jit
    def step(params, opt_state, s, x, y):
        (loss, s), grads = jax.value_and_grad(lambda p: pure(s, p, x, y), has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, s, loss

    params, opt_state = PARAMS0, opt.init(PARAMS0)
    # reference: the running mean threaded by hand
    rparams, ropt, rmean = PARAMS0, opt.init(PARAMS0), jnp.zeros(2)
    for i in range(STEPS):
        x, y = XS * (i + 1), YS
        params, opt_state, s, loss = step(params, opt_state, s, x, y)
        (rloss, rmean_new), g = jax.value_and_grad(
            lambda p: _loss_with_stats(p, x, y, rmean), has_aux=True)(rparams)
        rmean = rmean_new
        upd, ropt = opt.update(g, ropt, rparams)
        rparams = optax.apply_updates(rparams, upd)
        close(loss, rloss)
    close(params["w"], rparams["w"])
    close(params["b"], rparams["b"])
    close(s["running_mean"], rmean)


def test_training_step_inside_uncurry_with_step_counter_schedule():
    # The whole step (grad inside, schedule read from a step-counter state) is
    # uncurried; the optimizer state is threaded by the caller.
    sched = _schedule()

    def train_step(params, x, y):
        count = tx.get_state("opt_count", jnp.zeros((), jnp.int32))
        grads = jax.grad(_stateful_loss)(params, x, y)
        lr = sched(count)
        tx.set_state("opt_count", count + 1)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads)

    pure, s = tx.uncurry(train_step, PARAMS0, XS, YS)
    params = PARAMS0
    rparams, rmean = PARAMS0, jnp.zeros(2)
    for i in range(STEPS):
        params, s = jax.jit(pure)(s, params, XS, YS)
        g, rmean = jax.grad(lambda p: _loss_with_stats(p, XS, YS, rmean), has_aux=True)(rparams)
        rparams = jax.tree.map(lambda p, g: p - sched(i) * g, rparams, g)
    close(params["w"], rparams["w"])
    close(params["b"], rparams["b"])
    close(s["running_mean"], rmean)
    assert int(s["opt_count"]) == STEPS


def test_multisteps_with_state():
    opt = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)

    def train_step(params, opt_state, x, y):
        tx.set_state("ms_calls", tx.get_state("ms_calls", jnp.zeros((), jnp.int32)) + 1)
        grads = jax.grad(_stateful_loss)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = opt.init(PARAMS0)
    pure, s = tx.uncurry(train_step, PARAMS0, opt_state, XS, YS)
    params = PARAMS0
    rparams, ropt, rmean = PARAMS0, opt.init(PARAMS0), jnp.zeros(2)
    for i in range(4):
        x = XS * (i + 1)
        (params, opt_state), s = jax.jit(pure)(s, params, opt_state, x, YS)
        g, rmean = jax.grad(lambda p: _loss_with_stats(p, x, YS, rmean), has_aux=True)(rparams)
        upd, ropt = opt.update(g, ropt, rparams)
        rparams = optax.apply_updates(rparams, upd)
    close(params["w"], rparams["w"])
    close(s["running_mean"], rmean)
    assert int(s["ms_calls"]) == 4
    assert int(opt_state.gradient_step) == int(ropt.gradient_step) == 2


# --- L-BFGS with the zoom line search -------------------------------------------

TARGET = jnp.array([1.0, -2.0])


def test_lbfgs_zoom_linesearch_value_fn_reads_and_counts_state():
    opt = optax.lbfgs(linesearch=optax.scale_by_zoom_linesearch(max_linesearch_steps=8))

    def value(x, scale):
        return jnp.sum(scale * (x - TARGET) ** 2) + 0.1 * jnp.sum(x ** 4)

    def stateful_value(x):
        tx.set_state("zl_evals", tx.get_state("zl_evals", jnp.zeros((), jnp.int32)) + 1)
        return value(x, tx.get_state("zl_scale", jnp.float32(1.0)))

    def run(x):
        tx.set_state("zl_scale", jnp.float32(2.0))
        opt_state = opt.init(x)
        for _ in range(3):
            v, g = jax.value_and_grad(stateful_value)(x)
            updates, opt_state = opt.update(g, opt_state, x, value=v, grad=g,
                                            value_fn=stateful_value)
            x = optax.apply_updates(x, updates)
        return x

    x0 = jnp.zeros(2)
    pure, s0 = tx.uncurry(run, x0)
    x, s1 = jax.jit(pure)(s0, x0)

    counter = Counter()

    def ref_value(x):
        counter.tick()
        return value(x, 2.0)

    def ref_run(x):
        opt_state = opt.init(x)
        for _ in range(3):
            v, g = jax.value_and_grad(ref_value)(x)
            updates, opt_state = opt.update(g, opt_state, x, value=v, grad=g,
                                            value_fn=ref_value)
            x = optax.apply_updates(x, updates)
        return x

    xr = jax.jit(ref_run)(x0)
    jax.effects_barrier()
    close(x, xr, rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(x), np.asarray(x0))
    assert counter.n > 3  # the line search evaluated the function
    assert int(s1["zl_evals"]) == counter.n
    assert float(s1["zl_scale"]) == 2.0


def test_an_optax_optimizer_state_kept_as_one_pytree_state():
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.1))
    x = jnp.array([1.0, 2.0, -1.0])

    def step(params):
        st = tx.get_state("opt", lambda: opt.init(jnp.zeros(3)))
        loss, g = jax.value_and_grad(lambda p: jnp.sum((p * x - 1.0) ** 2))(params)
        updates, st = opt.update(g, st, params)
        tx.set_state("opt", st)
        return optax.apply_updates(params, updates), loss

    pure, state = tx.uncurry(step, jnp.zeros(3))
    assert jax.tree_util.tree_structure(state["opt"]) == jax.tree_util.tree_structure(
        opt.init(jnp.zeros(3)))
    params, opt_state = jnp.zeros(3), opt.init(jnp.zeros(3))  # by hand
    p = jnp.zeros(3)
    run = jax.jit(pure)
    for _ in range(4):
        (p, loss), state = run(state, p)
        g = jax.grad(lambda q: jnp.sum((q * x - 1.0) ** 2))(params)
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        close(p, params)
    jax.tree_util.tree_map(close, state["opt"], opt_state)


def test_an_optimizer_trains_the_states_split_off_by_name():
    # Two instances of one layer under tx.scope; adam trains every state named
    # "scale" (selected with tx.split_states), the counters ride along.
    x = jnp.array([1.0, 2.0, -1.0])

    def layer(h):
        tx.set_state("calls", tx.get_state("calls", jnp.int32(0)) + 1)
        return jnp.tanh(h * tx.get_state("scale", jnp.ones(3)))

    def model(h):
        with tx.scope("first"):
            h = layer(h)
        with tx.scope("second"):
            return layer(h)

    pure, state = tx.uncurry(model, x)
    opt = optax.adam(0.1)
    scales, rest = tx.split_states(state, "*/scale")
    opt_state = opt.init(scales)

    def loss(scales, rest):
        out, new = pure(tx.merge_states(scales, rest), x)
        return jnp.sum((out - 0.5) ** 2), new

    def by_hand_loss(s1, s2):  # the same model with its two scales as arguments
        return jnp.sum((jnp.tanh(jnp.tanh(x * s1) * s2) - 0.5) ** 2)

    s1, s2, hand_opt = jnp.ones(3), jnp.ones(3), opt.init((jnp.ones(3), jnp.ones(3)))
    for step in range(3):
        grads, new = jax.grad(loss, has_aux=True)(scales, rest)
        updates, opt_state = opt.update(grads, opt_state)
        scales = optax.apply_updates(scales, updates)
        _, rest = tx.split_states(new, "*/scale")
        g = jax.grad(by_hand_loss, argnums=(0, 1))(s1, s2)
        hand_updates, hand_opt = opt.update(g, hand_opt)
        s1, s2 = optax.apply_updates((s1, s2), hand_updates)
        close(scales["first"]["scale"], s1)
        close(scales["second"]["scale"], s2)
        assert int(rest["first"]["calls"]) == int(rest["second"]["calls"]) == step + 1

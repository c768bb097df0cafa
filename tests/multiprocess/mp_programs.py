"""The programs of the multi-process tests, and their plain-JAX references.

Every scenario is a function of a ``Run`` (the mesh, this process's index,
where to write) returning a flat dict ``{name: numpy array}``: the values
the tests compare, gathered to every host (``process_allgather``), so each
process of a multi-controller run reports the whole result and a
single-process run on as many devices reports the same names.

The same module runs in three settings (``mp_worker.py``): two processes
of two CPU devices each (``jax.distributed``), one process of four CPU
devices (the reference), and, for ``plain``, the reference process again:
the same computations written in plain JAX, a dict of state threaded by
hand and keys split by hand, on one device without a mesh and without
taxpr.
"""

from __future__ import annotations

import time
import traceback
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import taxpr as tx
from taxpr import harvest as hv

AXIS = "d"
N_DEVICES = 4
B, D, H = 16, 4, 8  # global batch, features, hidden units
STEPS, SAVE_AT = 5, 3
LR, MOMENTUM, KEEP, EPS = 0.1, 0.9, 0.75, 1e-5
# What process 1 (only) adds to its parameter update in the
# ``broken_jit_step`` scenario: a broken program the comparison must catch.
PERTURBATION = 1e-3


def shard_map() -> Callable:
    """``shard_map`` from wherever this JAX version has it."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map as sm  # pragma: no cover
    return sm


# ---- data --------------------------------------------------------------------

def init_params() -> dict:
    rng = np.random.RandomState(0)
    return {"w": (0.5 * rng.normal(size=(D, H))).astype(np.float32),
            "v": (0.5 * rng.normal(size=(H,))).astype(np.float32)}


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole batch of step ``step`` (every process can make it; each
    places only its own rows on its devices)."""
    rng = np.random.RandomState(100 + step)
    x = (2.0 * rng.normal(size=(B, D)) + 1.0).astype(np.float32)
    y = rng.normal(size=(B,)).astype(np.float32)
    return x, y


def dropout_mask(key, shape):
    return jax.random.bernoulli(key, KEEP, shape)


def forward(params, x, mean, var, key):
    """The model: normalize with the batch statistics, a tanh layer,
    dropout with ``key``, a linear readout. Plain JAX."""
    z = (x - mean) / jnp.sqrt(var + EPS)
    h = jnp.tanh(z @ params["w"])
    h = jnp.where(dropout_mask(key, h.shape), h / KEEP, 0.0)
    return h @ params["v"]


# ---- placing and gathering -----------------------------------------------------

def is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def put_global(tree: Any, shardings: Any) -> Any:
    """Place host values that are the same in every process (``uncurry``'s
    ``state0``, a restored checkpoint) on the global mesh; typed keys
    through their key data."""
    def put(x, sharding):
        if is_key(x):
            data = put(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
    return jax.tree.map(put, tree, shardings)


def gather(tree: Any) -> Any:
    """Every array of ``tree`` whole, as NumPy, on every process (typed keys
    as typed keys on the default device)."""
    from jax.experimental import multihost_utils

    def get(x):
        if is_key(x):
            data = get(jax.random.key_data(x))
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)
    return jax.tree.map(get, tree)


def flat(prefix: str, tree: Any) -> dict:
    """``{prefix + key path: numpy array}`` of a gathered tree (keys as their
    key data)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if is_key(leaf):
            leaf = jax.random.key_data(leaf)
        out[prefix + jax.tree_util.keystr(path)] = np.asarray(leaf)
    return out


class Run:
    """Where a scenario runs: the mesh of every device of every process,
    ordered by process, so that process ``p`` holds rows ``p * B / n ...``
    of a batch split along the mesh axis."""

    def __init__(self, out: Path):
        self.out = out
        self.process = jax.process_index()
        self.processes = jax.process_count()
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        assert len(devices) == N_DEVICES, devices
        self.mesh = Mesh(np.array(devices), (AXIS,))
        self.replicated = NamedSharding(self.mesh, P())
        self.rows = NamedSharding(self.mesh, P(AXIS))

    def local_rows(self, a: np.ndarray) -> np.ndarray:
        """This process's rows of a global array split along the mesh axis."""
        n = a.shape[0] // self.processes
        return a[self.process * n:(self.process + 1) * n]

    def batch(self, step: int) -> tuple[jax.Array, jax.Array]:
        """Step ``step``'s global batch split along the mesh axis, each
        process giving only its own rows (as a data loader would)."""
        return tuple(jax.make_array_from_process_local_data(self.rows, self.local_rows(a),
                                                            a.shape)
                     for a in global_batch(step))

    def barrier(self, name: str) -> None:
        if self.processes > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(name)


def error_text(fn: Callable, *args) -> str:
    """``fn(*args)``'s exception as ``"Type: message"``, or ``""``."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"
    return ""


def update_statistics(x) -> tuple:
    """The running mean / variance states (in scope ``bn``) updated with the
    batch's, the step count advanced: the batch's ``(mean, var)``."""
    with tx.scope("bn"):
        mean = tx.get_state("mean", lambda: jnp.zeros(D))
        var = tx.get_state("var", lambda: jnp.ones(D))
        bm, bv = x.mean(0), x.var(0)
        tx.set_state("mean", MOMENTUM * mean + (1 - MOMENTUM) * bm)
        tx.set_state("var", MOMENTUM * var + (1 - MOMENTUM) * bv)
    tx.set_state("step", tx.get_state("step", lambda: jnp.zeros((), jnp.int32)) + 1)
    return bm, bv


# ---- 1. a training step under jit, the batch sharded over the mesh --------------

def jit_train_step(x, y, perturb=0.0):
    params = tx.get_state("params", init_params)
    bm, bv = update_statistics(x)
    key = tx.next_key("dropout")

    def loss_fn(p):
        pred = forward(p, x, bm, bv, key)
        return jnp.mean((pred - y) ** 2), pred

    (loss, pred), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    tx.set_state("params", jax.tree.map(lambda p, g: p - LR * g + perturb, params, g))
    # One value per example, sharded like the batch: the predictions and
    # the dropout mask (its bits do not depend on the sharding).
    tx.set_state("last_pred", pred)
    tx.set_state("last_mask", dropout_mask(key, (B, H)))
    return loss


def state_shardings(run: Run, state: Any) -> Any:
    """The state's shardings: ``last_*`` split like the batch, the rest
    replicated."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: run.rows if "last_" in jax.tree_util.keystr(path)
        else run.replicated, state)


def jit_setup(run: Run, broken: bool = False):
    perturb = PERTURBATION if broken and run.process == 1 else 0.0
    pure, state0 = tx.uncurry(lambda x, y: jit_train_step(x, y, perturb), *global_batch(0))
    shardings = state_shardings(run, state0)
    step = jax.jit(pure, out_shardings=(run.replicated, shardings))
    return step, state0, shardings


def scenario_jit_step(run: Run, broken: bool = False) -> dict:
    """Five steps; the state gathered after step ``SAVE_AT`` (and saved: the
    checkpoint scenario restarts from it) and at the end. ``broken``: the
    program of process 1 adds ``PERTURBATION`` to its parameter update (and
    nothing is saved)."""
    step, state0, shardings = jit_setup(run, broken)
    state, losses = put_global(state0, shardings), []
    for i in range(STEPS):
        run.barrier(f"jit_step {i}")
        loss, state = step(state, *run.batch(i))
        losses.append(loss)
        if i + 1 == SAVE_AT:
            saved = gather(state)
            # The checkpoint: gathered to the host, written once (by
            # process 0), readable by any number of processes.
            if run.process == 0 and not broken:
                tx.save_state(run.out / "checkpoint.npz", saved)
            run.barrier("saved")
            at_save = flat("at_save/", saved)
    sharded = not any(state[k].sharding.is_fully_replicated for k in ("last_pred", "last_mask"))
    return {"losses": np.stack(gather(losses)), "last_sharded": np.asarray(sharded),
            **at_save, **flat("state/", gather(state))}


def scenario_resume(run: Run) -> dict:
    """Load the checkpoint ``jit_step`` wrote (in another run: a restart)
    and run the remaining steps."""
    step, state0, shardings = jit_setup(run)
    restored = tx.load_state(run.out / "checkpoint.npz", like=state0)
    state = put_global(restored, shardings)
    for i in range(SAVE_AT, STEPS):
        run.barrier(f"resume {i}")
        _, state = step(state, *run.batch(i))
    return flat("state/", gather(state))


def plain_jit_step() -> dict:
    """``jit_step`` in plain JAX: the states in a dict threaded by hand,
    the dropout key split by hand, the whole batch on one device."""
    state = {"bn": {"mean": jnp.zeros(D), "var": jnp.ones(D)}, "dropout": jax.random.key(0),
             "last_mask": jnp.zeros((B, H), bool), "last_pred": jnp.zeros(B),
             "params": jax.tree.map(jnp.asarray, init_params()),
             "step": jnp.zeros((), jnp.int32)}

    @jax.jit
    def step(state, x, y):
        bm, bv = x.mean(0), x.var(0)
        key, sub = jax.random.split(state["dropout"])

        def loss_fn(p):
            pred = forward(p, x, bm, bv, sub)
            return jnp.mean((pred - y) ** 2), pred

        (loss, pred), g = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        return loss, {
            "bn": {"mean": MOMENTUM * state["bn"]["mean"] + (1 - MOMENTUM) * bm,
                   "var": MOMENTUM * state["bn"]["var"] + (1 - MOMENTUM) * bv},
            "dropout": key, "last_mask": dropout_mask(sub, (B, H)), "last_pred": pred,
            "params": jax.tree.map(lambda p, g: p - LR * g, state["params"], g),
            "step": state["step"] + 1}

    losses = []
    for i in range(STEPS):
        loss, state = step(state, *global_batch(i))
        losses.append(loss)
        if i + 1 == SAVE_AT:
            at_save = flat("at_save/", state)
    return {"losses": np.stack(losses), **at_save, **flat("state/", state)}


# ---- 2. the same step under shard_map, statistics reduced with pmean ------------

def shard_train_step(x, y):
    """One shard's step: ``x``, ``y`` are its rows of the batch."""
    params = tx.get_state("params", init_params)
    with tx.scope("bn"):
        mean = tx.get_state("mean", lambda: jnp.zeros(D))
        var = tx.get_state("var", lambda: jnp.ones(D))
        bm = lax.pmean(x.mean(0), AXIS)  # the same on every shard: may be set
        bv = lax.pmean(((x - bm) ** 2).mean(0), AXIS)
        tx.set_state("mean", MOMENTUM * mean + (1 - MOMENTUM) * bm)
        tx.set_state("var", MOMENTUM * var + (1 - MOMENTUM) * bv)
    tx.set_state("step", tx.get_state("step", lambda: jnp.zeros((), jnp.int32)) + 1)
    key = tx.next_key("dropout")  # shard i: fold_in(the stream's new key, i)

    def loss_fn(p):
        pred = forward(p, x, bm, bv, key)
        return lax.pmean(jnp.mean((pred - y) ** 2), AXIS), pred

    (loss, pred), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
    tx.set_state("params", jax.tree.map(lambda p, g: p - LR * g, params, g))
    return loss, pred


def scenario_shard_map_step(run: Run) -> dict:
    sm = shard_map()(shard_train_step, mesh=run.mesh, in_specs=(P(AXIS), P(AXIS)),
                     out_specs=(P(), P(AXIS)))
    pure, state0 = tx.uncurry(sm, *global_batch(0))
    step = jax.jit(pure)
    state = put_global(state0, jax.tree.map(lambda _: run.replicated, state0))
    losses, preds = [], []
    for i in range(STEPS):
        run.barrier(f"shard_map_step {i}")
        (loss, pred), state = step(state, *run.batch(i))
        losses.append(loss)
        preds.append(pred)
    replicated = all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state))
    return {"losses": np.stack(gather(losses)), "preds": np.stack(gather(preds)),
            "state_replicated": np.asarray(replicated), **flat("state/", gather(state))}


def plain_shard_map_step() -> dict:
    """``shard_map_step`` in plain JAX, on one device: shard ``i``'s dropout
    key is ``fold_in(sub, i)``, as ``tx.next_key`` documents."""
    n = B // N_DEVICES
    state = {"bn": {"mean": jnp.zeros(D), "var": jnp.ones(D)}, "dropout": jax.random.key(0),
             "params": jax.tree.map(jnp.asarray, init_params()),
             "step": jnp.zeros((), jnp.int32)}

    @jax.jit
    def step(state, x, y):
        bm = x.mean(0)
        bv = ((x - bm) ** 2).mean(0)
        key, sub = jax.random.split(state["dropout"])

        def loss_fn(p):
            preds = [forward(p, x[i * n:(i + 1) * n], bm, bv, jax.random.fold_in(sub, i))
                     for i in range(N_DEVICES)]
            pred = jnp.concatenate(preds)
            return jnp.mean((pred - y) ** 2), pred

        (loss, pred), g = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        return (loss, pred), {
            "bn": {"mean": MOMENTUM * state["bn"]["mean"] + (1 - MOMENTUM) * bm,
                   "var": MOMENTUM * state["bn"]["var"] + (1 - MOMENTUM) * bv},
            "dropout": key, "params": jax.tree.map(lambda p, g: p - LR * g, state["params"], g),
            "step": state["step"] + 1}

    losses, preds = [], []
    for i in range(STEPS):
        (loss, pred), state = step(state, *global_batch(i))
        losses.append(loss)
        preds.append(pred)
    return {"losses": np.stack(losses), "preds": np.stack(preds), **flat("state/", state)}


def scenario_per_shard_set(run: Run) -> dict:
    """Without the pmean, a set of each shard's own statistic into a state
    (which holds one value): the error taxpr gives, with and without vma
    checking; ``""`` where there is none (then the value kept, per process)."""
    out = {}
    for check_vma in (True, False):
        def body(x):
            mean = tx.get_state("mean", lambda: jnp.zeros(D))
            tx.set_state("mean", MOMENTUM * mean + (1 - MOMENTUM) * x.mean(0))
            return x

        sm = shard_map()(body, mesh=run.mesh, in_specs=P(AXIS), out_specs=P(AXIS),
                         check_vma=check_vma)
        kept: list = []

        def attempt():
            pure, state0 = tx.uncurry(sm, global_batch(0)[0])
            state0 = put_global(state0, jax.tree.map(lambda _: run.replicated, state0))
            _, state1 = jax.jit(pure)(state0, run.batch(0)[0])
            kept.append(np.asarray(state1["mean"].addressable_data(0)))

        out[f"error/check_vma={check_vma}"] = np.asarray(error_text(attempt))
        if kept:
            out[f"kept/check_vma={check_vma}"] = kept[0]
    return out


# ---- 3. per-shard keys ----------------------------------------------------------

def scenario_shard_keys(run: Run) -> dict:
    """Draws of ``tx.next_key()`` in each shard of a 2 x 2 mesh (processes x
    local devices), from the first state twice (reproducible) and from the
    next. (On the 1-d mesh, ``shard_map_step``'s dropout keys are compared
    with their plain-JAX reference.)"""
    mesh = Mesh(run.mesh.devices.reshape(2, 2), ("p", "l"))
    spec = P(("p", "l"))
    sm = shard_map()(lambda x: x + jax.random.normal(tx.next_key(), x.shape), mesh=mesh,
                     in_specs=spec, out_specs=spec)
    zeros = np.zeros(B, np.float32)
    pure, state0 = tx.uncurry(sm, zeros)
    draw = jax.jit(pure)
    state0 = put_global(state0, {"rng": NamedSharding(mesh, P())})
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), run.local_rows(zeros),
                                               zeros.shape)
    first, state1 = draw(state0, x)
    again, _ = draw(state0, x)
    second, state2 = draw(state1, x)
    return flat("", gather({"first": first, "again": again, "second": second,
                            "rng1": state1["rng"], "rng2": state2["rng"]}))


def plain_shard_keys() -> dict:
    """Shard ``(p, l)`` of the 2 x 2 mesh draws
    ``normal(fold_in(fold_in(sub, p), l), (B / 4,))`` with
    ``key, sub = split(key)``: one ``fold_in`` per mesh axis, in the mesh's
    order."""
    out = {}
    key = jax.random.key(0)
    n = B // N_DEVICES
    for i, draw in enumerate(("first", "second")):
        key, sub = jax.random.split(key)
        shards = [jax.random.normal(jax.random.fold_in(jax.random.fold_in(sub, p), l), (n,))
                  for p in range(2) for l in range(2)]
        out[f"['{draw}']"] = np.asarray(jnp.concatenate(shards))
        out[f"['rng{i + 1}']"] = np.asarray(jax.random.key_data(key))
    return out


# ---- 4. gradients of the stateful step -----------------------------------------

def stateful_loss(params, x, y):
    """A loss that updates states as it runs: running statistics, a step
    counter, a dropout key."""
    bm, bv = update_statistics(x)
    pred = forward(params, x, bm, bv, tx.next_key("dropout"))
    return jnp.mean((pred - y) ** 2)


def train_with_tx_grad(params, x, y):
    loss, g = tx.value_and_grad(stateful_loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - LR * g, params, g), loss, g


def scenario_grad(run: Run) -> dict:
    """Five SGD steps two ways: ``tx.value_and_grad`` inside the uncurried
    step, and ``jax.value_and_grad`` of ``uncurry``'s pure loss from
    outside (its new states as aux)."""
    x0, y0 = global_batch(0)
    params0 = init_params()
    rep = lambda tree: jax.tree.map(lambda _: run.replicated, tree)  # noqa: E731
    out = {}

    pure, state0 = tx.uncurry(train_with_tx_grad, params0, x0, y0)
    step = jax.jit(pure)
    state, params, grads = put_global(state0, rep(state0)), put_global(params0, rep(params0)), []
    for i in range(STEPS):
        run.barrier(f"grad inside {i}")
        (params, _, g), state = step(state, params, *run.batch(i))
        grads.append(g)
    out.update(flat("inside/grads", gather(jax.tree.map(lambda *g: jnp.stack(g), *grads))))
    out.update(flat("inside/params", gather(params)))
    out.update(flat("inside/state", gather(state)))

    pure_loss, state0 = tx.uncurry(stateful_loss, params0, x0, y0)
    outside = jax.jit(jax.value_and_grad(lambda p, s, x, y: pure_loss(s, p, x, y), has_aux=True))
    state, params, grads = put_global(state0, rep(state0)), put_global(params0, rep(params0)), []
    for i in range(STEPS):
        run.barrier(f"grad outside {i}")
        (_, state), g = outside(params, state, *run.batch(i))
        params = jax.tree.map(lambda p, g: p - LR * g, params, g)
        grads.append(g)
    out.update(flat("outside/grads", gather(jax.tree.map(lambda *g: jnp.stack(g), *grads))))
    out.update(flat("outside/params", gather(params)))
    out.update(flat("outside/state", gather(state)))
    return out


def plain_grad() -> dict:
    """The gradients and states of ``grad``, the state threaded by hand."""
    state = {"bn": {"mean": jnp.zeros(D), "var": jnp.ones(D)}, "dropout": jax.random.key(0),
             "step": jnp.zeros((), jnp.int32)}
    params = jax.tree.map(jnp.asarray, init_params())

    @jax.jit
    def step(state, params, x, y):
        bm, bv = x.mean(0), x.var(0)
        key, sub = jax.random.split(state["dropout"])
        g = jax.grad(lambda p: jnp.mean((forward(p, x, bm, bv, sub) - y) ** 2))(params)
        return g, {"bn": {"mean": MOMENTUM * state["bn"]["mean"] + (1 - MOMENTUM) * bm,
                          "var": MOMENTUM * state["bn"]["var"] + (1 - MOMENTUM) * bv},
                   "dropout": key, "step": state["step"] + 1}

    grads = []
    for i in range(STEPS):
        g, state = step(state, params, *global_batch(i))
        params = jax.tree.map(lambda p, g: p - LR * g, params, g)
        grads.append(g)
    out = {}
    for way in ("inside", "outside"):
        out.update(flat(f"{way}/grads", jax.tree.map(lambda *g: jnp.stack(g), *grads)))
        out.update(flat(f"{way}/params", params))
        out.update(flat(f"{way}/state", state))
    return out


# ---- 5. harvest and capture under shard_map ------------------------------------

W_LAYER = np.random.RandomState(1).normal(size=(D, H)).astype(np.float32)


def layer(x):
    with jax.named_scope("layer"):
        h = jnp.tanh(x @ W_LAYER)
    h = hv.sow(h, tag="acts", name="h")  # this shard's rows
    hv.sow(h.mean(), tag="acts", name="shard_mean")  # one number per shard
    return h.sum(1)


def scenario_harvest(run: Run) -> dict:
    """``reap`` and ``tx.capture`` inside the shard_map body (each shard's
    values, stacked per shard by ``out_specs``), and reap from outside (a
    per-shard value: taxpr's error)."""
    def reaped(x):
        out, r = hv.call_and_reap(layer, tag="acts")(x)
        return out, r["h"], r["shard_mean"][None]

    def captured(x):
        out, acts = tx.capture(layer, "layer/tanh")(x)
        return out, acts["layer/tanh"]

    x_global = global_batch(0)[0]
    x = run.batch(0)[0]
    reap_in = jax.jit(shard_map()(reaped, mesh=run.mesh, in_specs=P(AXIS),
                                  out_specs=(P(AXIS),) * 3))
    capture_in = jax.jit(shard_map()(captured, mesh=run.mesh, in_specs=P(AXIS),
                                     out_specs=(P(AXIS),) * 2))
    out_r, h_r, means = reap_in(x)
    out_c, h_c = capture_in(x)
    plain = shard_map()(layer, mesh=run.mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    reap_outside = error_text(lambda: jax.jit(hv.reap(plain, tag="acts"))(x))
    capture_outside = error_text(lambda: tx.capture(plain, "layer/tanh")(x_global))
    return {**flat("", gather({"reap": {"out": out_r, "h": h_r, "shard_mean": means},
                               "capture": {"out": out_c, "h": h_c}})),
            "reap_outside_error": np.asarray(reap_outside),
            "capture_outside_error": np.asarray(capture_outside)}


def plain_harvest() -> dict:
    x = jnp.asarray(global_batch(0)[0])
    h = jnp.tanh(x @ W_LAYER)
    means = h.reshape(N_DEVICES, B // N_DEVICES, H).mean((1, 2))
    return flat("", {"reap": {"out": h.sum(1), "h": h, "shard_mean": means},
                     "capture": {"out": h.sum(1), "h": h}})


# ---- progress bars ----------------------------------------------------------------

class _Bars:
    """A ``tx.progress`` display that keeps what this process was told."""

    def __init__(self):
        self.events: list = []

    def start(self, loop):
        self.events.append(("start", loop.name, 0))

    def update(self, loop, n):
        self.events.append(("update", loop.name, n))

    def close(self, loop, n):
        self.events.append(("close", loop.name, n))


def scenario_progress(run: Run) -> dict:
    """``tx.progress`` of a jitted program with a loop of its own and a loop
    in a shard_map body over every device of every process: what each
    process's display was told, per loop (not gathered: each process
    reports its own)."""
    def loop(x):
        return lax.scan(lambda c, i: (c * 0.5 + i, None), x, jnp.arange(10.0))[0]

    sm = shard_map()(loop, mesh=run.mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    bars = _Bars()
    f = jax.jit(tx.progress(lambda x: (loop(x.sum()), sm(x)), display=bars, every=5,
                            nested=True))
    x = jax.make_array_from_process_local_data(run.rows, run.local_rows(np.arange(8.0)), (8,))
    top, sharded = f(x)
    jax.effects_barrier()
    run.barrier("progress")
    out = {"top": np.asarray(gather(top)), "sharded": np.asarray(gather(sharded))}
    for name in ("scan[length=10]", "shard_map/scan[length=10]"):
        mine = [(kind, n) for kind, loop_name, n in bars.events if loop_name == name]
        key = "shard_map" if name.startswith("shard_map") else "jit"
        out[f"{key}.starts"] = np.asarray(sum(kind == "start" for kind, _ in mine))
        out[f"{key}.updates"] = np.asarray([n for kind, n in mine if kind == "update"] or [-1])
        out[f"{key}.closes"] = np.asarray([n for kind, n in mine if kind == "close"] or [-1])
    return out


# ---- the registry ---------------------------------------------------------------

SCENARIOS: dict[str, Callable[[Run], dict]] = {
    "jit_step": scenario_jit_step,
    "broken_jit_step": lambda run: scenario_jit_step(run, broken=True),
    "shard_map_step": scenario_shard_map_step,
    "per_shard_set": scenario_per_shard_set,
    "shard_keys": scenario_shard_keys,
    "grad": scenario_grad,
    "harvest": scenario_harvest,
    "progress": scenario_progress,
    "resume": scenario_resume,
}

PLAIN: dict[str, Callable[[], dict]] = {
    "jit_step": plain_jit_step,
    "shard_map_step": plain_shard_map_step,
    "shard_keys": plain_shard_keys,
    "grad": plain_grad,
    "harvest": plain_harvest,
}


def run_scenarios(out: Path, names: list[str], plain: bool) -> None:
    """Run the scenarios ``names`` (and, with ``plain``, their plain-JAX
    references), writing ``out/<name>.p<process>.npz`` (``.plain.npz``), or
    ``.error.txt`` with the traceback of a scenario that raised."""
    run = Run(out)
    for name in names:
        run.barrier(f"start {name}")
        targets = [(f"{name}.p{run.process}", lambda: SCENARIOS[name](run))]
        if plain and name in PLAIN:
            targets.append((f"{name}.plain", PLAIN[name]))
        for stem, fn in targets:
            began = time.monotonic()
            try:
                result = fn()
            except Exception:  # noqa: BLE001 - reported to the test
                (out / f"{stem}.error.txt").write_text(traceback.format_exc())
                print(f"{stem}: error", flush=True)
                continue
            np.savez(out / f"{stem}.npz", **result)
            print(f"{stem}: done in {time.monotonic() - began:.1f} s", flush=True)

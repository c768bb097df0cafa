"""Data-parallel training with taxpr state, on one process or several.

A small model keeps everything that changes in taxpr states: its
parameters (updated by SGD), the running mean and variance of its input
(batch-norm statistics of the whole global batch), a step counter and a
dropout key stream (``tx.next_key``). ``tx.uncurry`` makes the training
step a pure function, ``jax.jit`` runs it with the batch split over a mesh
of four CPU devices and the states replicated. Half-way, the state is
checkpointed (gathered to the host, written once with ``tx.save_state``),
read back with ``tx.load_state`` and training continues from the copy.

    python examples/data_parallel.py                  # 1 process of 4 CPU devices
    python examples/data_parallel.py --processes 2    # 2 processes of 2 CPU devices each

With ``--processes 2`` the script starts itself twice on this machine
(JAX's multi-controller runtime: ``jax.distributed.initialize`` on a
loopback port, one global mesh over both processes' devices); each process
feeds only its own rows of every batch. Both ways print the same final
state. The example checks:

* the final state agrees with the same training written in plain JAX, the
  state threaded by hand in a dict (the dropout keys bit for bit);
* the restored checkpoint is the saved state bit for bit;
* with two processes, both print the same final state.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Whether JAX was imported before this script (a test runner running it):
# its devices are then set already, and the environment is left alone.
_JAX_ALREADY_IMPORTED = "jax" in sys.modules

import jax  # noqa: E402  (after the check above; JAX reads the device count when it starts)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import taxpr as tx  # noqa: E402

N_DEVICES = 4
BATCH, FEATURES, HIDDEN = 32, 3, 16
STEPS, LR, MOMENTUM, KEEP, EPS = 8, 0.1, 0.9, 0.8, 1e-5
PROXY_VARIABLES = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy",
                   "ALL_PROXY", "no_proxy", "NO_PROXY")


def cpu_env(devices: int) -> dict:
    """An environment for a JAX process on ``devices`` CPU devices (both
    ways JAX versions read the count), without proxies."""
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARIABLES}
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def launch(processes: int, timeout: float = 300.0) -> None:
    """Run this script as ``processes`` processes on this machine and print
    process 0's output; checks that they all print the same final state."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        procs = []
        for i in range(processes):
            cmd = [sys.executable, __file__, "--processes", str(processes), "--process-id", str(i),
                   "--port", str(port), "--checkpoint-dir", folder]
            with open(Path(folder) / f"out{i}.txt", "w") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                              env=cpu_env(N_DEVICES // processes)))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    break
                time.sleep(0.1)
        finally:
            for p in procs:  # a failed process's partners would wait for it
                if p.poll() is None:
                    p.kill()
                p.wait()
        outputs = [(Path(folder) / f"out{i}.txt").read_text() for i in range(processes)]
    if any(p.returncode != 0 for p in procs):
        for i, (p, text) in enumerate(zip(procs, outputs)):
            print(f"---- process {i} (exit status {p.returncode}) ----\n{text}", file=sys.stderr)
        raise SystemExit("a process failed or did not finish")
    finals = [[line for line in text.splitlines() if line.startswith("final ")]
              for text in outputs]
    assert finals[0] and all(f == finals[0] for f in finals), "the processes disagree"
    print("".join(line for line in outputs[0].splitlines(keepends=True)
                  if not line.startswith("[Gloo]")), end="")  # gloo's connection log
    print(f"all {processes} processes printed the same final state")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=None)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--checkpoint-dir", default=None)
    args, _ = parser.parse_known_args(argv)
    if args.processes > 1 and args.process_id is None:
        return launch(args.processes)
    if not _JAX_ALREADY_IMPORTED:  # run as a script: 4 CPU devices unless told otherwise
        for k, v in cpu_env(N_DEVICES).items():
            os.environ.setdefault(k, v)
    with tempfile.TemporaryDirectory() as folder:
        train(args.processes, args.process_id or 0, args.port, args.checkpoint_dir or folder)


def init_params():
    """The model's parameters at the start (a host pytree)."""
    rng = np.random.RandomState(0)
    return {"w": (0.5 * rng.normal(size=(FEATURES, HIDDEN))).astype(np.float32),
            "v": (0.5 * rng.normal(size=(HIDDEN,))).astype(np.float32)}


def global_batch(step):
    """Batch ``step`` of the data, whole (every process can make it)."""
    rng = np.random.RandomState(1000 + step)
    x = (rng.normal(size=(BATCH, FEATURES)) + 2.0).astype(np.float32)
    y = np.sin(x.sum(1)).astype(np.float32)
    return x, y


def predict(params, x, mean, var, key):
    """The model: inputs normalized by ``mean`` / ``var``, dropout by ``key``."""
    h = jnp.tanh(((x - mean) / jnp.sqrt(var + EPS)) @ params["w"])
    h = jnp.where(jax.random.bernoulli(key, KEEP, h.shape), h / KEEP, 0.0)
    return h @ params["v"]


# ---- the training step: written as if states were mutable ----
def train_step(x, y):
    """One SGD step on the batch ``(x, y)``; returns the loss."""
    params = tx.get_state("params", init_params)
    with tx.scope("bn"):
        mean = tx.get_state("mean", lambda: jnp.zeros(FEATURES))
        var = tx.get_state("var", lambda: jnp.ones(FEATURES))
        bm, bv = x.mean(0), x.var(0)  # over the global batch: XLA adds the shards' parts
        tx.set_state("mean", MOMENTUM * mean + (1 - MOMENTUM) * bm)
        tx.set_state("var", MOMENTUM * var + (1 - MOMENTUM) * bv)
    tx.set_state("step", tx.get_state("step", lambda: jnp.zeros((), jnp.int32)) + 1)
    key = tx.next_key("dropout")
    loss, g = jax.value_and_grad(
        lambda p: jnp.mean((predict(p, x, bm, bv, key) - y) ** 2))(params)
    tx.set_state("params", jax.tree.map(lambda p, g: p - LR * g, params, g))
    return loss


def train(processes: int, process_id: int, port: int, checkpoint_dir: str) -> None:
    # Random bits that do not depend on how an array is split over devices
    # (the default in recent JAX): dropout masks are the same on any mesh.
    if not jax.config.jax_threefry_partitionable:
        jax.config.update("jax_threefry_partitionable", True)
    if processes > 1:
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, ValueError):  # newer JAX: gloo is the default
            pass
        options = {}
        if "cluster_detection_method" in inspect.signature(jax.distributed.initialize).parameters:
            options["cluster_detection_method"] = "deactivate"  # no SLURM/MPI/cloud probing
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes,
                                   process_id=process_id, **options)

    # ---- the mesh: every device of every process, in process order ----
    devices = sorted(jax.devices("cpu"), key=lambda d: (d.process_index, d.id))[:N_DEVICES]
    mesh = Mesh(np.array(devices), ("data",))
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def place(host_tree):
        """Host values that every process has (``state0``, a checkpoint):
        replicated over the mesh; typed keys through their key data."""
        def put(x):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                return jax.random.wrap_key_data(put(jax.random.key_data(x)),
                                                impl=jax.random.key_impl(x))
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, replicated, lambda i: x[i])
        return jax.tree.map(put, host_tree)

    def gather(tree):
        """Every array whole, on the host of every process."""
        def get(x):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                return jax.random.wrap_key_data(get(jax.random.key_data(x)),
                                                impl=jax.random.key_impl(x))
            if x.is_fully_addressable:  # one process: nothing to gather
                return np.asarray(x)
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.tree.map(get, tree)

    def batch(step):
        """This process's rows of the global batch, assembled into global
        arrays split over the mesh (as a per-host data loader would)."""
        n = BATCH // jax.process_count()
        lo = jax.process_index() * n
        return tuple(jax.make_array_from_process_local_data(rows, a[lo:lo + n], a.shape)
                     for a in global_batch(step))

    pure, state0 = tx.uncurry(train_step, *global_batch(0))
    step_fn = jax.jit(pure, out_shardings=(replicated, replicated))
    state, losses = place(state0), []
    for i in range(STEPS):
        if i == STEPS // 2:  # checkpoint: gather, write once, read back
            saved = gather(state)
            path = Path(checkpoint_dir) / "state.npz"
            if jax.process_index() == 0:
                tx.save_state(path, saved)
            multihost_utils.sync_global_devices("checkpoint written")
            restored = tx.load_state(path, like=state0)
            for a, b in zip(jax.tree.leaves(flat_keys(jax, saved)),
                            jax.tree.leaves(flat_keys(jax, restored))):
                np.testing.assert_array_equal(a, b)
            state = place(restored)
        loss, state = step_fn(state, *batch(i))
        losses.append(loss)
    final = flat_keys(jax, gather(state))
    losses = np.asarray(gather(jnp.stack(losses)))

    # ---- the same training in plain JAX, the state in a dict by hand ----
    @jax.jit
    def reference_step(s, x, y):
        bm, bv = x.mean(0), x.var(0)
        key, sub = jax.random.split(s["dropout"])
        g = jax.grad(lambda p: jnp.mean((predict(p, x, bm, bv, sub) - y) ** 2))(s["params"])
        return {"bn": {"mean": MOMENTUM * s["bn"]["mean"] + (1 - MOMENTUM) * bm,
                       "var": MOMENTUM * s["bn"]["var"] + (1 - MOMENTUM) * bv},
                "dropout": key, "params": jax.tree.map(lambda p, g: p - LR * g, s["params"], g),
                "step": s["step"] + 1}

    ref = {"bn": {"mean": jnp.zeros(FEATURES), "var": jnp.ones(FEATURES)},
           "dropout": jax.random.key(0), "params": init_params(),
           "step": jnp.zeros((), jnp.int32)}
    for i in range(STEPS):
        ref = reference_step(ref, *global_batch(i))
    ref = flat_keys(jax, ref)
    assert sorted(ref) == sorted(final), (sorted(ref), sorted(final))
    for name in final:
        if final[name].dtype.kind == "f":
            np.testing.assert_allclose(final[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=name)
        else:  # the step counter, the dropout key's data: exactly
            np.testing.assert_array_equal(final[name], ref[name], err_msg=name)

    print(f"process {jax.process_index()} of {jax.process_count()}, "
          f"a mesh of {mesh.size} CPU devices")
    print("losses:", " ".join(f"{v:.4f}" for v in losses))
    for name, value in final.items():
        shown = np.array2string(value.ravel()[:6], precision=4, suppress_small=True)
        print(f"final {name}: {shown}")
    print("matches plain JAX with the state threaded by hand; checkpoint restored bit for bit")
    if processes > 1:
        multihost_utils.sync_global_devices("done")


def flat_keys(jax, tree) -> dict:
    """``{"bn/mean": array, ...}``, typed keys as their key data."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out[name] = np.asarray(leaf)
    return dict(sorted(out.items()))


if __name__ == "__main__":
    main(sys.argv[1:])

"""taxpr under JAX's multi-controller runtime: two processes of two CPU
devices each (``jax.distributed.initialize`` on loopback) make one
four-device mesh, and each program (``mp_programs.py``) runs there, in one
process of four devices, and as plain JAX with its state threaded by hand.

What is compared, for every scenario:

* the two processes report the same values, bit for bit (a state is one
  value, the same on every device that holds it);
* the two-process run and the one-process run agree: keys, counters and
  per-shard draws bit for bit; floats to rounding (the two runs' all-reduces
  add the devices' partial sums in different orders);
* the one-process run agrees with plain JAX (the same tolerances): the
  reference does not go through taxpr.

The runs are made once per session (``conftest.py``); ``jax_threefry_partitionable``
is on in every process, so random bits do not depend on the sharding.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mp_harness
from mp_harness import Mismatch, assert_same
from mp_programs import B, H, N_DEVICES, SAVE_AT, STEPS

# Floats of the two-process run against the one-process run and against
# plain JAX: a few units in the last place of float32 values of order 1.
RTOL, ATOL = 1e-5, 1e-6


def agree(runs, scenario, *, plain=True, exact_across_runs=False):
    """The processes agree bit for bit, the two-process run with the
    one-process run, and the one-process run with plain JAX (on the names
    the plain reference has). Returns the two-process results."""
    p0, p1 = runs.two(scenario)
    assert_same({"process 0": p0, "process 1": p1})
    one = runs.one(scenario)
    if exact_across_runs:
        assert_same({"2 processes": p0, "1 process": one})
    else:
        assert_same({"2 processes": p0, "1 process": one}, exact=False, rtol=RTOL, atol=ATOL)
    if plain:
        reference = runs.plain(scenario)
        assert_same({"1 process": one, "plain JAX": reference}, names=sorted(reference),
                    exact=False, rtol=RTOL, atol=ATOL)
    return p0


def _key_and_step_names(result):
    return [k for k in result if "dropout" in k or "step" in k]


# ---- 1. a training step under jit --------------------------------------------

def test_jit_step_states_agree_across_processes_one_process_and_plain_jax(runs):
    p0 = agree(runs, "jit_step")
    assert int(p0["state/['step']"]) == STEPS
    assert p0["state/['last_pred']"].shape == (B,)
    assert bool(p0["last_sharded"])  # states split over the mesh like the batch
    assert p0["losses"].shape == (STEPS,)


def test_jit_step_keys_masks_and_counter_are_bit_for_bit_everywhere(runs):
    p0 = runs.two("jit_step")[0]
    names = [*_key_and_step_names(p0), "state/['last_mask']", "at_save/['last_mask']"]
    assert "state/['dropout']" in names and "state/['step']" in names
    assert 0 < p0["state/['last_mask']"].mean() < 1
    assert_same({"2 processes": p0, "1 process": runs.one("jit_step"),
                 "plain JAX": runs.plain("jit_step")}, names=names)


# ---- 2. the step under shard_map with pmean'd statistics ----------------------

def test_shard_map_step_states_are_replicated_and_agree(runs):
    p0 = agree(runs, "shard_map_step")
    assert bool(p0["state_replicated"])
    assert int(p0["state/['step']"]) == STEPS
    assert p0["preds"].shape == (STEPS, B)
    assert_same({"2 processes": p0, "1 process": runs.one("shard_map_step"),
                 "plain JAX": runs.plain("shard_map_step")}, names=_key_and_step_names(p0))


@pytest.mark.parametrize("check_vma", [True, False])
def test_setting_a_per_shard_statistic_without_pmean_is_a_clear_error(runs, check_vma):
    # A state holds one value: a set of each shard's own mean would keep
    # one device's. taxpr refuses it, naming the state (with vma checking
    # the types say the value varies; without, taxpr cannot prove it does
    # not), in every process alike.
    p0, p1 = runs.two("per_shard_set")
    assert_same({"process 0": p0, "process 1": p1, "1 process": runs.one("per_shard_set")})
    error = str(p0[f"error/check_vma={check_vma}"])
    assert f"kept/check_vma={check_vma}" not in p0, "a per-shard value was kept silently"
    assert error.split(":")[0] == "StateError", error
    assert "'mean'" in error and "shard_map" in error, error


# ---- 3. per-shard keys -------------------------------------------------------

def test_per_shard_keys_differ_between_shards_and_are_reproducible(runs):
    # On a 2 x 2 mesh (processes x local devices): each shard folds in its
    # index on both mesh axes.
    p0, p1 = runs.two("shard_keys")
    one = runs.one("shard_keys")
    assert_same({"process 0": p0, "process 1": p1, "1 process": one})  # bit for bit
    first, again, second = (p0[f"['{k}']"] for k in ("first", "again", "second"))
    shards = first.reshape(N_DEVICES, -1)
    for i in range(N_DEVICES):
        for j in range(i):
            assert not np.any(shards[i] == shards[j]), (i, j)
    np.testing.assert_array_equal(again, first)  # the same state: the same draws
    assert not np.any(second == first)  # the stream advanced
    reference = runs.plain("shard_keys")  # written by hand with fold_in
    assert_same({"taxpr": p0, "plain JAX": reference}, names=sorted(reference))


# ---- 4. gradients of the stateful step ---------------------------------------

@pytest.mark.parametrize("way", ["inside", "outside"])
def test_gradients_of_the_stateful_step_match_and_update_states_once(runs, way):
    # inside: tx.value_and_grad in the uncurried step; outside:
    # jax.value_and_grad of uncurry's pure loss, its new states as aux.
    p0 = agree(runs, "grad")
    assert int(p0[f"{way}/state['step']"]) == STEPS  # not 2 * STEPS
    assert p0[f"{way}/grads['w']"].shape[0] == STEPS
    assert_same({"2 processes": p0, "plain JAX": runs.plain("grad")},
                names=[f"{way}/state['dropout']", f"{way}/state['step']"])


def test_gradients_inside_and_outside_agree(runs):
    p0 = runs.two("grad")[0]
    inside = {k.split("/", 1)[1]: v for k, v in p0.items() if k.startswith("inside/")}
    outside = {k.split("/", 1)[1]: v for k, v in p0.items() if k.startswith("outside/")}
    assert_same({"tx.value_and_grad": inside, "jax.value_and_grad of pure": outside},
                exact=False, rtol=RTOL, atol=ATOL)


# ---- 5. harvest and capture under shard_map ----------------------------------

def test_reap_and_capture_in_shard_map_are_stacked_per_shard_and_gathered(runs):
    p0 = agree(runs, "harvest", exact_across_runs=True)
    assert p0["['reap']['shard_mean']"].shape == (N_DEVICES,)  # one row per shard
    assert p0["['reap']['h']"].shape == p0["['capture']['h']"].shape == (B, H)
    np.testing.assert_array_equal(p0["['reap']['h']"], p0["['capture']['h']"])


def test_reap_and_capture_of_a_per_shard_value_from_outside_are_clear_errors(runs):
    p0 = runs.two("harvest")[0]
    # (harvest's error is a ValueError subclass; capture names the site)
    for key, kind, name in (("reap_outside_error", "PerShardReapError", "sow 'h'"),
                            ("capture_outside_error", "ValueError", "site 'layer/tanh'")):
        error = str(p0[key])
        assert error.startswith(f"{kind}: ") and name in error, error
        assert "differs across the shards" in error and "inside the body" in error, error


# ---- 6. progress bars ---------------------------------------------------------

def test_progress_shows_each_loop_once_on_process_0(runs):
    # A loop of the jitted program and a loop in a shard_map body over the
    # devices of both processes: process 0 shows one bar each, as one
    # process of four devices does; process 1 shows none. The outputs are
    # those of the program without bars everywhere.
    p0, p1 = runs.two("progress")
    one = runs.one("progress")
    values = ("top", "sharded")
    assert_same({"process 0": {k: p0[k] for k in values},
                 "process 1": {k: p1[k] for k in values},
                 "1 process": {k: one[k] for k in values}})
    np.testing.assert_allclose(p0["top"], _scan_by_hand(28.0))
    np.testing.assert_allclose(p0["sharded"], [_scan_by_hand(float(v)) for v in range(8)])
    for loop in ("jit", "shard_map"):
        for shown in (p0, one):
            assert int(shown[f"{loop}.starts"]) == 1, loop
            assert list(shown[f"{loop}.updates"]) == [5, 10], loop
            assert list(shown[f"{loop}.closes"]) == [10], loop
        assert int(p1[f"{loop}.starts"]) == 0 and list(p1[f"{loop}.closes"]) == [-1], loop


def _scan_by_hand(x: float) -> float:
    """``scenario_progress``'s loop in Python: ``c = c * 0.5 + i`` for i < 10."""
    c = np.float32(x)
    for i in range(10):
        c = c * np.float32(0.5) + np.float32(i)
    return float(c)


# ---- 7. checkpoint and restart -----------------------------------------------

def test_checkpoint_holds_the_gathered_state(runs):
    p0 = runs.two("jit_step")[0]
    with np.load(runs.folder("two") / "checkpoint.npz") as saved:
        for name, value in p0.items():
            if name.startswith("at_save/"):
                np.testing.assert_array_equal(saved[name.removeprefix("at_save/")], value,
                                              err_msg=name)


def test_restart_from_the_checkpoint_continues_bit_for_bit(runs):
    # New processes load the checkpoint of step SAVE_AT and run the
    # remaining steps: the same state as the run that never stopped.
    assert 0 < SAVE_AT < STEPS
    r0, r1 = runs.two("resume", run="restart")
    uninterrupted = {k: v for k, v in runs.two("jit_step")[0].items() if k.startswith("state/")}
    assert_same({"uninterrupted": uninterrupted, "restarted, process 0": r0,
                 "restarted, process 1": r1})


# ---- the comparison itself ---------------------------------------------------

def test_the_comparison_catches_a_program_broken_on_one_process(runs):
    # The program of process 1 alone adds PERTURBATION to its parameter
    # update: the processes disagree, and both disagree with one process
    # (process 0's update reads gradients from process 1's rows).
    p0, p1 = runs.two("broken_jit_step")
    with pytest.raises(Mismatch, match=r"params.*process 0 and process 1 differ"):
        assert_same({"process 0": p0, "process 1": p1})
    for broken in (p0, p1):
        with pytest.raises(Mismatch, match="params"):
            assert_same({"1 process": runs.one("jit_step"), "broken": broken},
                        exact=False, rtol=RTOL, atol=ATOL)


def test_a_failing_process_is_reported_with_every_output_and_the_others_ended(tmp_path):
    # Process 1 exits at once; process 0 would wait for it in
    # jax.distributed.initialize for minutes.
    launch = mp_harness.start(tmp_path, ["jit_step"], processes=2, devices=2,
                              worker_args=("--fail-process", "1"))
    began = time.monotonic()
    with pytest.raises(mp_harness.LaunchError) as e:
        launch.wait(120)
    assert time.monotonic() - began < 60
    message = str(e.value)
    assert "a process failed" in message and "process 1 fails on purpose" in message
    assert "process 0 (exit status" in message and "process 1 (exit status 3)" in message
    assert all(proc.poll() is not None for proc in launch.procs)


def test_processes_not_done_in_time_are_ended(tmp_path):
    launch = mp_harness.start(tmp_path, ["jit_step"], processes=2, devices=2,
                              worker_args=("--sleep", "600"))
    with pytest.raises(mp_harness.LaunchError, match="not finished after 1 s"):
        launch.wait(1)
    assert all(proc.poll() is not None for proc in launch.procs)


def test_a_launch_whose_port_was_taken_is_made_again_on_a_new_port(tmp_path, monkeypatch):
    # A stand-in worker (no JAX): on the first port, process 0 fails as
    # JAX's coordinator does when another program took its port between
    # free_port and its start.
    taken, free_port = mp_harness.free_port(), mp_harness.free_port
    ports = iter([taken])
    monkeypatch.setattr(mp_harness, "free_port", lambda: next(ports, None) or free_port())
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import sys\n"
        "arg = lambda name: sys.argv[sys.argv.index(name) + 1]\n"
        f"if arg('--port') == '{taken}' and arg('--process-id') == '0':\n"
        "    print('Failed to add port to server: Address already in use')\n"
        "    sys.exit(1)\n")
    monkeypatch.setattr(mp_harness, "WORKER", worker)
    launch = mp_harness.start(tmp_path / "out", [], processes=2, devices=2)
    first = list(launch.procs)
    launch.wait(60)
    assert launch.procs != first and all(proc.returncode == 0 for proc in launch.procs)
    assert first[0].returncode == 1 and first[1].poll() is not None


# ---- the example -------------------------------------------------------------

def test_the_data_parallel_example_prints_the_same_state_on_one_and_two_processes():
    # `python examples/data_parallel.py` and `... --processes 2` (which
    # starts the two processes itself): the same "final ..." lines.
    script = Path(__file__).resolve().parents[2] / "examples" / "data_parallel.py"
    finals = []
    for args in ([], ["--processes", "2"]):
        done = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                              text=True, timeout=300, env=mp_harness.child_env(4))
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        finals.append([line for line in done.stdout.splitlines() if line.startswith("final ")])
    assert finals[0] and finals[0] == finals[1], finals

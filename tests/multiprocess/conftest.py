"""The multi-process runs, made once per test session.

The tests of this folder compare what JAX's multi-controller runtime gives
(two processes of two CPU devices each, joined by ``jax.distributed``) with
one process of four CPU devices and with plain JAX. The runs are started
once per session, whichever test asks first; under pytest-xdist the
workers share them (a lock file in the session's base temporary folder,
the pytest-xdist recipe), so they run once, not once per worker.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import mp_harness

# The scenarios of the main runs; ``resume`` restarts from the checkpoint
# the main two-process run wrote, in new processes.
MAIN = ["jit_step", "shard_map_step", "per_shard_set", "shard_keys", "grad", "harvest",
        "progress"]
# The two-process run also runs the program broken on one process.
BROKEN = "broken_jit_step"
# Each launch's limit: generous, for a machine busy with the rest of the suite.
TIMEOUT_S = 300


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "multiprocess: starts JAX programs as several processes "
        "(tests/multiprocess; deselect with -m 'not multiprocess')")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.multiprocess)


def _make_runs(root: Path) -> dict:
    """Make the runs; ``{"errors": {run: error text or ""}, "seconds": ...}``."""
    began = time.monotonic()
    errors = {}

    def wait(name, launch):
        try:
            launch.wait(TIMEOUT_S)
            errors[name] = ""
        except mp_harness.LaunchError as e:
            errors[name] = str(e)

    # The two main runs at once (the two-process run's processes often wait
    # on each other); the restart, which needs the two-process run's
    # checkpoint, as soon as that is written.
    launches = [mp_harness.start(root / "two", [*MAIN, BROKEN], processes=2, devices=2)]
    try:
        launches.append(mp_harness.start(root / "one", MAIN, processes=1, devices=4, plain=True))
        wait("two", launches[0])
        if errors["two"]:
            errors["restart"] = "the two-process run failed"
        else:
            launches.append(mp_harness.start(root / "two", ["resume"], processes=2, devices=2))
        wait("one", launches[1])
        if not errors["two"]:
            wait("restart", launches[2])
    finally:
        for launch in launches:  # after an unexpected error: leave no process behind
            launch.kill()
    return {"errors": errors, "seconds": time.monotonic() - began}


class Runs:
    """The results of the session's runs."""

    def __init__(self, root: Path, status: dict):
        self.root = root
        self.errors = status["errors"]
        self.seconds = status["seconds"]

    def folder(self, run: str) -> Path:
        if self.errors[run]:
            raise mp_harness.LaunchError(self.errors[run])
        return self.root / {"restart": "two"}.get(run, run)

    def two(self, scenario: str, run: str = "two") -> list[dict]:
        """Each process's results of ``scenario`` in a two-process run."""
        return mp_harness.load(self.folder(run), scenario, 2)

    def one(self, scenario: str) -> dict:
        """The single-process run's results of ``scenario``."""
        return mp_harness.load(self.folder("one"), scenario, 1)[0]

    def plain(self, scenario: str) -> dict:
        """The plain-JAX reference of ``scenario``."""
        return mp_harness.load_one(self.folder("one"), f"{scenario}.plain")


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the folder every worker of this session shares
    root = base / "taxpr-multiprocess"
    status_file = root / "status.json"
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: each worker runs its own
        fcntl = None
        root = tmp_path_factory.mktemp("taxpr-multiprocess")
        status_file = root / "status.json"
    lock_path = base / "taxpr-multiprocess.lock"
    with open(lock_path, "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not status_file.exists():
                root.mkdir(parents=True, exist_ok=True)
                status_file.write_text(json.dumps(_make_runs(root)))
        finally:
            if fcntl is not None:
                fcntl.flock(lock, fcntl.LOCK_UN)
    return Runs(root, json.loads(status_file.read_text()))

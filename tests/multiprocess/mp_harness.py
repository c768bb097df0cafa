"""Start JAX programs as several processes on this machine and compare
what each reports.

``start`` launches ``mp_worker.py`` as ``processes`` processes of
``devices`` CPU devices each, on loopback (a free port for the coordinator);
``Launch.wait`` waits for all of them within a timeout. Each process's
output goes to a file of its own; when one fails or the time runs out, the
others are ended (by their process ids) and the error shows every
process's output; a launch whose coordinator found its port taken (by
another program, between ``free_port`` and its start) is made once more
on a new port. ``load`` reads back the results the processes wrote and
``assert_same`` compares them, naming each array that differs.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

HERE = Path(__file__).resolve().parent
WORKER = HERE / "mp_worker.py"
# Variables of the caller's environment a launched process must not see: a
# proxy would route the processes' connections to 127.0.0.1 through it.
PROXY_VARIABLES = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy",
                   "ALL_PROXY", "no_proxy", "NO_PROXY", "ftp_proxy", "FTP_PROXY",
                   "grpc_proxy", "GRPC_PROXY")
# How much of each process's output an error shows.
OUTPUT_TAIL = 6000
# What the coordinator says when another program took its port between
# ``free_port`` and its start (JAX versions word it differently): the
# launch is made again, on a new port.
PORT_TAKEN = ("Address already in use", "Failed to add port to server")


class LaunchError(AssertionError):
    """A launched process failed, or they did not finish in time."""


class Mismatch(AssertionError):
    """Two runs' results differ."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(devices: int, extra: dict | None = None) -> dict:
    """The environment of a launched process: the caller's, without proxy
    variables, on the CPU backend with ``devices`` devices (both ways JAX
    versions read the count), other XLA flags kept (a program compiled in
    two runs is compiled alike)."""
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARIABLES}
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "",
                   env.get("XLA_FLAGS", "")).split()
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_NUM_CPU_DEVICES"] = str(devices)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass
class Launch:
    """Processes started by ``start``."""

    name: str
    procs: list[subprocess.Popen]
    logs: list[Path]
    started: float = field(default_factory=time.monotonic)
    # Starts the same processes again (on a new port), once.
    relaunch: Callable[[], "Launch"] | None = None

    def outputs(self) -> str:
        parts = []
        for i, (proc, log) in enumerate(zip(self.procs, self.logs)):
            text = log.read_text(errors="replace") if log.exists() else ""
            if len(text) > OUTPUT_TAIL:
                text = "...\n" + text[-OUTPUT_TAIL:]
            parts.append(f"---- {self.name}: process {i} (exit status {proc.returncode}) ----\n"
                         f"{text}")
        return "\n".join(parts)

    def kill(self) -> None:
        """End every process still running (each by its own id)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass

    def wait(self, timeout: float) -> float:
        """Wait until every process has exited successfully; the seconds
        since the start. A failing process, or the time running out, ends
        the others and raises ``LaunchError`` with every process's output."""
        deadline = self.started + timeout
        try:
            while True:
                codes = [proc.poll() for proc in self.procs]
                if any(c not in (None, 0) for c in codes):
                    # One failed: the others may wait for it forever (a
                    # collective, the coordinator).
                    time.sleep(0.5)  # let its output reach the file
                    self.kill()
                    if self.relaunch is not None and any(m in self.outputs() for m in PORT_TAKEN):
                        again = self.relaunch()
                        self.procs, self.logs, self.relaunch = again.procs, again.logs, None
                        self.started = again.started
                        deadline = self.started + timeout
                        continue
                    raise LaunchError(f"{self.name}: a process failed\n{self.outputs()}")
                if all(c == 0 for c in codes):
                    return time.monotonic() - self.started
                if time.monotonic() > deadline:
                    self.kill()
                    raise LaunchError(f"{self.name}: not finished after {timeout:.0f} s\n"
                                      f"{self.outputs()}")
                time.sleep(0.05)
        except BaseException:
            self.kill()  # also on KeyboardInterrupt: leave no process behind
            raise


def start(out: Path, scenarios: list[str], *, processes: int, devices: int,
          plain: bool = False, env: dict | None = None, name: str | None = None,
          worker_args: tuple[str, ...] = ()) -> Launch:
    """Start ``mp_worker.py`` running ``scenarios`` as ``processes``
    processes of ``devices`` CPU devices each, writing to ``out``
    (``worker_args``: more arguments of ``mp_worker.py``)."""
    out.mkdir(parents=True, exist_ok=True)
    name = name or f"{processes}-process run of {','.join(scenarios)}"
    label = ("-".join(scenarios) or "join") if len(scenarios) < 3 else f"{len(scenarios)}-scenarios"
    port = free_port() if processes > 1 else 0
    procs, logs = [], []
    try:
        for i in range(processes):
            cmd = [sys.executable, str(WORKER), str(out), ",".join(scenarios)]
            if plain:
                cmd.append("--plain")
            cmd += worker_args
            if processes > 1:
                cmd += ["--process-id", str(i), "--processes", str(processes), "--port", str(port)]
            log = out / f"{label}.process{i}.log"
            with open(log, "w") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, cwd=HERE,
                                              env=child_env(devices, env)))
            logs.append(log)
    except BaseException:
        Launch(name, procs, logs).kill()
        raise
    def again() -> Launch:
        return start(out, scenarios, processes=processes, devices=devices, plain=plain,
                     env=env, name=name, worker_args=worker_args)

    return Launch(name, procs, logs, relaunch=again if processes > 1 else None)


def load(out: Path, scenario: str, processes: int) -> list[dict]:
    """The results each of ``processes`` processes wrote for ``scenario``;
    a scenario that raised raises here, with its traceback."""
    return [load_one(out, f"{scenario}.p{i}") for i in range(processes)]


def load_one(out: Path, stem: str) -> dict:
    error = out / f"{stem}.error.txt"
    if error.exists():
        raise AssertionError(f"{stem} raised in the launched process:\n{error.read_text()}")
    with np.load(out / f"{stem}.npz") as f:
        return {k: f[k] for k in f.files}


def assert_same(runs: dict[str, dict], *, exact: bool = True, rtol: float = 0.0,
                atol: float = 0.0, names: list[str] | None = None) -> None:
    """Every run of ``runs`` (``{label: results}``) has the same arrays as
    the first: the same names (or ``names`` only), each equal bit for bit
    (``exact``) or within ``rtol`` / ``atol`` (integers and key data always
    exactly). Raises ``Mismatch`` naming each array that differs, by how
    much, in which run."""
    (first_label, first), *others = runs.items()
    problems = []
    for label, other in others:
        keys = names if names is not None else sorted(set(first) | set(other))
        for k in keys:
            if k not in first or k not in other:
                problems.append(f"{k}: only in {first_label if k in first else label}")
                continue
            a, b = np.asarray(first[k]), np.asarray(other[k])
            if a.shape != b.shape or a.dtype != b.dtype:
                problems.append(f"{k}: {a.dtype}{list(a.shape)} in {first_label}, "
                                f"{b.dtype}{list(b.shape)} in {label}")
                continue
            if a.dtype.kind in "fc" and not exact:
                ok = np.allclose(a, b, rtol=rtol, atol=atol)
            else:
                ok = np.array_equal(a, b)
            if not ok:
                diff = (f"max |difference| {np.max(np.abs(a - b)):.3g}" if a.dtype.kind in "fc"
                        else f"{int(np.sum(a != b))} of {a.size} elements differ")
                problems.append(f"{k}: {first_label} and {label} differ ({diff})")
    if problems:
        raise Mismatch("results mismatch:\n  " + "\n  ".join(problems))

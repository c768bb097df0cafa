"""``tx.progress`` in a real terminal: a script runs under ``tmux``, and
the screen (``tmux capture-pane``) is what a person would see: a ``tqdm``
bar at 100% for a scan, one bar for a ``vmap`` batch, nested bars."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax import lax
    import taxpr as tx

    def simulate(x):
        return lax.scan(lambda c, i: (c * 0.999 + jnp.sin(i), None), x, jnp.arange(1000.0))[0]

    def nested(x):
        def outer(c, _):
            return lax.scan(lambda d, _: (d * 1.01, None), c, None, length=40)[0], None
        return lax.scan(outer, x, None, length=3)[0]

    jax.block_until_ready(tx.progress(simulate, desc="steps")(1.0))
    jax.block_until_ready(jax.vmap(tx.progress(simulate, desc="batch"))(jnp.ones(4)))
    jax.block_until_ready(tx.progress(nested, nested=True, every=1, desc="nest")(1.0))
    jax.effects_barrier()
    print("DONE")
""")


def _screen(target: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", target, "-S", "-50"],
                          capture_output=True, text=True, check=True).stdout


def test_bars_in_a_terminal(tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (Debian: apt-get install tmux)")
    pytest.importorskip("tqdm", reason="tqdm is not installed (pip install 'taxpr[progress]')")
    script = tmp_path / "bars.py"
    script.write_text(SCRIPT)
    target = f"taxpr-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    command = f"{sys.executable} {script}; sleep 30"
    subprocess.run(["tmux", "new-session", "-d", "-s", target, "-x", "120", "-y", "40",
                    command], check=True, env=env)
    try:
        deadline = time.monotonic() + 120
        screen = ""
        while time.monotonic() < deadline:
            screen = _screen(target)
            if "DONE" in screen or "Error" in screen:
                break
            time.sleep(0.5)
        assert "DONE" in screen, screen
        lines = screen.splitlines()
        steps = [line for line in lines if line.startswith("steps:")]
        assert steps and "100%|" in steps[-1] and "1000/1000" in steps[-1], screen
        batch = [line for line in lines if line.startswith("batch:")]
        assert len(batch) == 1 and "1000/1000" in batch[0], screen  # one bar for the batch
        nest = [line for line in lines if line.startswith("nest:")]
        assert nest and "3/3" in nest[-1], screen
    finally:
        subprocess.run(["tmux", "kill-session", "-t", target], capture_output=True)

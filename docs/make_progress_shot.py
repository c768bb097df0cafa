"""The Watching loops page's screenshot: ``tx.progress`` run in a real
terminal (``tmux``), the screen read with ``capture-pane`` and drawn as a
PNG (``docs/images/progress_bars.png``).

Run: ``python docs/make_progress_shot.py PYTHON`` where ``PYTHON`` has
taxpr and ``tqdm`` installed (this script needs matplotlib).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "images" / "progress_bars.png"

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax import lax
    import taxpr as tx

    def simulate(x):
        def step(c, i):
            return c * 0.999 + jnp.sin(c + i) * 1e-3, None
        return lax.scan(step, x, jnp.arange(200_000.0))[0]

    def train(x):
        def epoch(c, _):
            return lax.scan(lambda d, _: (jnp.tanh(d + 0.1), None), c, None, length=30_000)[0], None
        return lax.scan(epoch, x, None, length=5)[0]

    print("$ python simulate.py")
    jax.block_until_ready(tx.progress(simulate, desc="steps")(jnp.ones(256)))
    jax.block_until_ready(jax.vmap(tx.progress(simulate, desc="one bar for a vmap batch"))(
        jnp.ones((8, 16))))
    jax.block_until_ready(tx.progress(train, nested=True, desc="epochs / steps")(jnp.ones(64)))
    jax.effects_barrier()
    print("$")
""")


def capture(python: str) -> str:
    script = ROOT / "docs" / "images" / "_progress_shot.py"
    script.write_text(SCRIPT)
    session = f"taxpr-shot-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "100", "-y", "12",
                    f"{python} {script}; sleep 60"], check=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                                    capture_output=True, text=True).stdout
            if screen.rstrip().endswith("$"):
                return screen
            time.sleep(0.5)
        raise TimeoutError(screen)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        script.unlink()


def draw(screen: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lines = screen.rstrip().splitlines()
    fig = plt.figure(figsize=(10, 0.28 * len(lines) + 0.3), facecolor="#1e1e1e")
    for k, line in enumerate(lines):
        fig.text(0.01, 1 - (k + 1) / (len(lines) + 1), line, family="DejaVu Sans Mono",
                 fontsize=9.5, color="#e0e0e0", va="center")
    fig.savefig(OUT, dpi=110, facecolor=fig.get_facecolor())


if __name__ == "__main__":
    shot = capture(sys.argv[1] if len(sys.argv) > 1 else sys.executable)
    print(shot)
    draw(shot)
    print(f"wrote {OUT}")

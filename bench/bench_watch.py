"""Cost of ``tx.progress`` and ``tx.tap`` on a long loop.

The program: a 10,000-step ``lax.scan`` of a small RNN cell (width 128, a
batch of 8: a matrix product and a ``tanh`` per step), under ``jax.jit``.
Each update of a bar is a host callback, which costs tens of microseconds
on a CPU: the ratio depends on the program's length (a loop that ends in a
millisecond needs no bar).
Compared with the same program without the bar (interleaved paired
repetitions in one process, as ``bench_state``):

* ``tx.progress`` with its default throttling (about 20 updates, each a
  host callback; the scan runs in chunks between them), its display a
  no-op (what is measured is the program's cost, not the terminal's);
* ``tx.progress(every=1)``: an update per iteration, the worst case;
* ``tx.tap`` of the cell's output at every step (a host callback per
  iteration).

Figures: run time ratio against the plain program (target for the default
progress: at most 1.05; the others are reported without one).

Run: ``python bench/bench_watch.py [--quick]``.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax import lax

import taxpr as tx

from bench_state import compare_runtime  # noqa: E402 - bench/ is on the path
from _common import print_figures, ratio_figure  # noqa: E402

STEPS, WIDTH, BATCH = 10_000, 128, 8
TARGET = 1.05


class _Silent:
    def start(self, loop):
        pass

    def update(self, loop, n):
        pass

    def close(self, loop, n):
        pass


def make_simulate(steps: int):
    def simulate(w, h):
        def step(h, _):
            with jax.named_scope("cell"):
                h = jnp.tanh(h @ w)
            return h, None
        return lax.scan(step, h, None, length=steps)[0]
    return simulate


def run(quick: bool = False) -> dict:
    reps, calls = (3, 2) if quick else (11, 5)
    simulate = make_simulate(1_000 if quick else STEPS)
    w = jax.random.normal(jax.random.key(0), (WIDTH, WIDTH)) / WIDTH ** 0.5
    h = jnp.ones((BATCH, WIDTH))
    variants = {
        "progress (default throttling)": (tx.progress(simulate, display=_Silent()), TARGET),
        "progress(every=1)": (tx.progress(simulate, display=_Silent(), every=1), None),
        "tap of the cell each step": (tx.tap(simulate, "cell/tanh", lambda *a: None), None),
    }
    want = jax.jit(simulate)(w, h)
    result, figures = {}, []
    for name, (fn, target) in variants.items():
        assert (jax.jit(fn)(w, h) == want).all(), name  # bit for bit
        r = compare_runtime(fn, simulate, (w, h), reps, calls)
        result[name] = r
        figures.append(ratio_figure(f"run time {name} / plain", r["ratio"], target))
    result["figures"] = figures
    return result


if __name__ == "__main__":
    print_figures(run("--quick" in sys.argv)["figures"])

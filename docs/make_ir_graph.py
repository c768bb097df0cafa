"""Render the graph shown in docs/ir.md and the README (``taxpr.ir.render``).

Writes ``docs/images/ir_graph.svg`` (committed; needs Graphviz's ``dot``):
a scan whose body holds a cond and a debug print, after ``optimize_jaxpr``.

Run: ``python docs/make_ir_graph.py [PATH]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's taxpr

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from taxpr import ir  # noqa: E402

OUT = Path(__file__).resolve().parent / "images" / "ir_graph.svg"


def program(x):
    def body(c, _):
        c = lax.cond(c > 0, jnp.sin, lambda v: v * 2.0, c) + 1.0 * c
        jax.debug.print("c = {}", c)
        return c, c * 3.0
    return lax.scan(body, x, None, length=4)


def main(path: Path = OUT) -> Path:
    jaxpr = ir.optimize_jaxpr(jax.make_jaxpr(program)(jnp.float32(0.5)))
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(ir.render(jaxpr, path))


if __name__ == "__main__":
    print(main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))

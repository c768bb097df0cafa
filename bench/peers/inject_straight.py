"""``inject`` / ``jax.make_jaxpr`` time on straight-line programs, for
whichever ``taxpr`` is importable: this project's, or taxpr 0.0.3 (the
original PyPI package, Python >= 3.13) in its own venv.

The workload is ``bench/bench_inject.py``'s, imported from it: its
``straight_fn(n)`` (``x = x * 1.0001 + tag(x, op=...)``, ``n`` tags, three
distinct ``op`` values) and its ``injector``. taxpr 0.0.3's ``tag(token,
**params)`` and ``inject(closed_jaxpr, injector, ctx, predicate=None)`` have
the same shape as ours, with one difference: 0.0.3 converts ``ctx`` with
``jnp.array`` and so needs concrete arrays, not the
``jax.ShapeDtypeStruct`` ``bench_inject.CTX``; for it ``ctx`` is
``{"acc": zeros((), float32)}``. Both versions produce
``(*ctx, x) -> (out, *ctx)``.

Timing (see ``_timing.py``): per repetition a fresh function is traced
(``make``) and the jaxpr of the previous repetition's function injected
(``inject``), in alternating order; the figure is
``median(inject) / median(make)`` in this one process. Before timing, each
injected program is evaluated on a short (30-tag) program and compared with
the eager semantics.

Run: ``python bench/peers/inject_straight.py [--quick] [--sizes 1600,10000]``;
prints one line per size, then a ``JSON {...}`` line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib.metadata import version
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_inject as bi  # noqa: E402  (bench/bench_inject.py: the workload)
from _timing import interleaved  # noqa: E402

import taxpr as tx  # noqa: E402

VERSION = version("taxpr")
OLD = VERSION.startswith("0.0.")
CTX = {"acc": jnp.zeros((), jnp.float32)} if OLD else bi.CTX


def inject(closed):
    return tx.inject(closed, bi.injector, CTX)


def expected(n: int, x: np.ndarray):
    """The eager semantics of ``bi.straight_fn(n)`` with ``bi.injector``."""
    acc = np.float32(0)
    for i in range(n):
        op = bi.OPS[i % len(bi.OPS)]
        token = x * np.float32(2.0) if op == "scale" else x
        if op == "acc":
            acc = acc + x.sum()
        x = x * np.float32(1.0001) + token
    return x, acc


def check(n: int = 30) -> bool:
    x = jnp.ones((3,), jnp.float32)
    injected = inject(jax.make_jaxpr(bi.straight_fn(n))(x))
    out, acc = jax.core.eval_jaxpr(injected.jaxpr, injected.consts, jnp.float32(0), x)
    want_x, want_acc = expected(n, np.ones(3, np.float32))
    return bool(np.allclose(out, want_x, rtol=1e-4) and np.allclose(acc, want_acc, rtol=1e-4))


def measure(n: int, reps: int) -> dict:
    x = jnp.ones((3,), jnp.float32)
    last = {"closed": jax.make_jaxpr(bi.straight_fn(n))(x)}
    inject(last["closed"])  # warm-up

    def make():
        last["closed"] = jax.make_jaxpr(bi.straight_fn(n))(x)

    med = interleaved({"make": make, "inject": lambda: inject(last["closed"])}, reps)
    return {"tags": n, "make_jaxpr_s": med["make"], "inject_s": med["inject"],
            "ratio": med["inject"] / med["make"]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    p.add_argument("--sizes", default=None, help="comma-separated tag counts (default 1600,10000)")
    p.add_argument("--reps", type=int, default=None)
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else ([50] if a.quick else [1600, 10_000])
    reps = a.reps or (3 if a.quick else 7)
    out = {"library": "taxpr", "version": VERSION, "python": platform.python_version(),
           "jax": jax.__version__, "reps": reps, "equivalent": check(),
           "straight": [measure(n, reps if n < 5000 else max(3, reps - 2)) for n in sizes]}
    print(f"taxpr {VERSION} (python {out['python']}, jax {out['jax']}),"
          f" matches eager semantics: {out['equivalent']}")
    for s in out["straight"]:
        print(f"  {s['tags']:6d} tags: make_jaxpr {s['make_jaxpr_s'] * 1e3:8.1f} ms"
              f"   inject {s['inject_s'] * 1e3:8.1f} ms   ratio {s['ratio']:.3f}")
    print("JSON " + json.dumps(out))
    return out


if __name__ == "__main__":
    main()

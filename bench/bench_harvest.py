"""Cost of ``taxpr.harvest`` under nesting.

Workload: ``lax.scan`` nested 1..8 deep (length 2) with 10 sows at every
level (outside the outermost scan and inside each body), alternating
``append`` and ``clobber`` mode, each with its own name, so ``reap`` returns
one value per name (append sows stacked along one axis per enclosing scan)
and ``plant`` replaces every one. Several sows per level make the walk, not
the fixed per-call cost, dominate.

Timed at each depth, each a tracing cost (nothing is executed):

* ``reap``: ``jax.make_jaxpr(h.reap(f, tag="t"))(x)``;
* ``jit_reap``: ``jax.jit(h.reap(f, tag="t")).trace(x)``, the trace ``jax.jit``
  does before lowering;
* ``plant``: ``jax.make_jaxpr(h.plant(f, tag="t"))(plants, x)``, every sow
  planted (``plants`` given as ``jax.ShapeDtypeStruct`` of the reaped
  values);
* ``make_jaxpr``: ``jax.make_jaxpr(f)(x)``, the same program without
  harvest (context: the overhead ratio of each transformation over it).

Figures: t(8)/t(4) of ``reap``, ``jit_reap`` and ``plant``, target
<= 2.5, i.e. cost grows at most linearly with depth (a tracer that re-traces
each loop body twice grows as 2**depth). The overhead at the deepest depth
(transformation time / plain ``make_jaxpr`` time) is reported with no target.

Timing: medians over repetitions, the depths and the four operations
interleaved (the order alternating between repetitions), with the garbage
collector run before and disabled during each timed call (as ``timeit``
does). taxpr's harvest re-traces the user function on every call and
``jax.make_jaxpr`` / ``jax.jit`` cache per function object, so every timed
call uses a freshly built function: no cache hits anywhere.

Run: ``python bench/bench_harvest.py [--quick]``.
"""

from __future__ import annotations

import statistics
import sys

import jax
import jax.numpy as jnp

from taxpr import harvest as h

from _common import nested_scans, print_figures, timed  # noqa: E402

TAG = "t"
SOWS_PER_LEVEL = 10
LENGTH = 2
DEPTH_TARGET = 2.5
KINDS = ("make_jaxpr", "reap", "jit_reap", "plant")
FIGURE_KINDS = {
    "reap": 'make_jaxpr(reap(f, tag="t"))',
    "jit_reap": 'jit(reap(f, tag="t")).trace',
    "plant": 'make_jaxpr(plant(f, tag="t"))',
}





def sow_name(d: int, i: int) -> str:
    """The name of sow ``i`` at nesting level ``d``; its mode is ``sow_mode(i)``."""
    return f"{sow_mode(i)[0]}{d}_{i}"


def sow_mode(i: int) -> str:
    return "append" if i % 2 == 0 else "clobber"


def nested_sow_fn(depth: int, length: int = LENGTH, per_level: int = SOWS_PER_LEVEL):
    """A fresh function (so no trace cache ever hits): ``depth`` nested scans
    of ``length`` steps with ``per_level`` sows at every level."""
    def step(d, x):
        for i in range(per_level):
            x = x * 1.0001 + h.sow(x, tag=TAG, name=sow_name(d, i), mode=sow_mode(i))
        return x

    return nested_scans(depth, length, step)


def _operations(depth: int, x, plants) -> dict:
    """The timed operations at ``depth``, each building a fresh function."""
    return {
        "make_jaxpr": lambda: jax.make_jaxpr(nested_sow_fn(depth))(x),
        "reap": lambda: jax.make_jaxpr(h.reap(nested_sow_fn(depth), tag=TAG))(x),
        "jit_reap": lambda: jax.jit(h.reap(nested_sow_fn(depth), tag=TAG)).trace(x),
        "plant": lambda: jax.make_jaxpr(h.plant(nested_sow_fn(depth), tag=TAG))(plants, x),
    }


def _reaped_shapes(depth: int, x) -> dict:
    """The reaped values' shapes (checked), to plant them back."""
    shapes = jax.eval_shape(h.reap(nested_sow_fn(depth), tag=TAG), x)
    want = {sow_name(d, i): ((LENGTH,) * d if sow_mode(i) == "append" and d else
                             (1,) if sow_mode(i) == "append" else ()) + x.shape
            for d in range(depth + 1) for i in range(SOWS_PER_LEVEL)}
    got = {k: tuple(v.shape) for k, v in shapes.items()}
    assert got == want, (got, want)
    return shapes


def bench_nested(max_depth: int, reps: int) -> dict:
    x = jnp.ones((3,), jnp.float32)
    depths = list(range(1, max_depth + 1))
    ops = {d: _operations(d, x, _reaped_shapes(d, x)) for d in depths}
    for d in depths:  # warm-up
        for op in ops[d].values():
            op()
    times = {k: {d: [] for d in depths} for k in KINDS}
    for r in range(reps):
        kinds = KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]
        for d in (depths if r % 2 == 0 else depths[::-1]):
            for k in kinds:
                dt, _ = timed(ops[d][k])
                times[k][d].append(dt)
    top, half = max_depth, max_depth // 2
    out = {"length": LENGTH, "sows_per_level": SOWS_PER_LEVEL, "reps": reps,
           "ratio_key": f"t{top}/t{half}"}
    for k, per_depth in times.items():
        med = {d: statistics.median(ts) for d, ts in per_depth.items()}
        out[f"{k}_s"] = {str(d): med[d] for d in depths}
        out[f"{k}_ratio"] = med[top] / med[half]
        if k != "make_jaxpr":
            out[f"{k}_overhead"] = med[top] / statistics.median(times["make_jaxpr"][top])
    out["ratio"] = out["reap_ratio"]
    return out


def run(quick: bool = False) -> dict:
    """Measure harvest costs.

    Returns ``{"jax", "nested_scan", "figures"}``; ``figures`` are
    ``{name, value, target, pass}`` rows for ``bench/run.py``'s table.
    """
    max_depth, reps = (4, 1) if quick else (8, 15)
    out: dict = {"jax": jax.__version__}
    ns = out["nested_scan"] = bench_nested(max_depth, reps)
    figures = []
    for k, label in FIGURE_KINDS.items():
        v = ns[f"{k}_ratio"]
        figures.append({"name": f"{label} nested scan {ns['ratio_key']}", "value": v,
                        "target": f"<= {DEPTH_TARGET}", "pass": v <= DEPTH_TARGET})
    for k, label in FIGURE_KINDS.items():
        figures.append({"name": f"{label} / make_jaxpr(f), depth {max_depth}",
                        "value": ns[f"{k}_overhead"], "target": None, "pass": None})
    out["figures"] = figures
    return out


def main(argv: list[str]) -> None:
    res = run(quick="--quick" in argv)
    ns = res["nested_scan"]
    print(f"jax {res['jax']}")
    for k in KINDS:
        print(f"  {k:10s} (ms): "
              + "  ".join(f"d{d}={t * 1e3:.2f}" for d, t in ns[f"{k}_s"].items())
              + f"   {ns['ratio_key']} = {ns[f'{k}_ratio']:.2f}")
    print_figures(res["figures"])


if __name__ == "__main__":
    main(sys.argv[1:])

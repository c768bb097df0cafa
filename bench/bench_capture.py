"""Cost of ``taxpr.capture`` against the same capture written by hand.

Workload: a residual MLP of 8 layers of width 256 run with ``lax.scan``
over its stacked weights (a scan-over-layers model), batch 64; each layer
in ``jax.named_scope("layer")``.

* ``capture``: ``tx.capture(model, "layer/tanh", "layer/add:1")``, the
  model's code untouched;
* ``by hand``: the same model with ``h.sow(..., mode="append")`` written at
  the same two values, under ``h.call_and_reap``: what a user would write
  after editing the model.

Figures (both jitted, the same inputs):

* HLO instructions of the compiled captured program / of the hand-sown one
  (target <= 1.0: capture adds nothing);
* run time, captured / by hand (median of interleaved calls, target <= 1.02);
* sites listing: ``tx.sites(closed)`` of a traced program of about 10,000
  equations / ``jax.make_jaxpr`` of it (target <= 0.5); ``tx.sites(fn, x)``,
  which traces ``fn`` as taxpr's transformations do and lists it (trace +
  listing), / ``jax.make_jaxpr`` is reported with no target.

Run: ``python bench/bench_capture.py [--quick]``.
"""

from __future__ import annotations

import statistics
import sys

import jax
import jax.numpy as jnp

import taxpr as tx
from taxpr import harvest as h

from _common import print_figures, timed  # noqa: E402

LAYERS, WIDTH, BATCH = 8, 256, 64


def model(params, x, sow=False):
    def layer(x, p):
        w, b = p
        with jax.named_scope("layer"):
            a = jnp.tanh(x @ w + b)
            if sow:
                a = h.sow(a, tag="t", name="tanh", mode="append")
            y = x + a
            if sow:
                y = h.sow(y, tag="t", name="add", mode="append")
        return y, None
    return jnp.sum(jax.lax.scan(layer, x, params)[0] ** 2)


def hlo_instructions(compiled) -> int:
    return sum(" = " in line for line in compiled.as_text().splitlines())


def inputs():
    k1, k2 = jax.random.split(jax.random.key(0))
    params = (jax.random.normal(k1, (LAYERS, WIDTH, WIDTH)) / WIDTH ** 0.5,
              jnp.zeros((LAYERS, WIDTH)))
    return params, jax.random.normal(k2, (BATCH, WIDTH))


def bench_compiled(reps: int) -> dict:
    params, x = inputs()
    captured = jax.jit(tx.capture(model, "layer/tanh", "layer/add:1"))
    by_hand = jax.jit(h.call_and_reap(lambda p, x: model(p, x, sow=True), tag="t"))
    out_c, acts_c = captured(params, x)
    out_h, acts_h = by_hand(params, x)
    assert jnp.allclose(out_c, out_h) and jnp.allclose(acts_c["layer/add:1"], acts_h["add"])
    n_c = hlo_instructions(captured.lower(params, x).compile())
    n_h = hlo_instructions(by_hand.lower(params, x).compile())
    times: dict = {"capture": [], "by_hand": []}
    for r in range(reps):
        order = (("capture", captured), ("by_hand", by_hand))
        for name, f in (order if r % 2 == 0 else order[::-1]):
            t, out = timed(lambda: jax.block_until_ready(f(params, x)))
            times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"hlo_capture": n_c, "hlo_by_hand": n_h, "hlo_ratio": n_c / n_h,
            "run_s": med, "run_ratio": med["capture"] / med["by_hand"]}


def big_program(n_eqns: int):
    def f(x):
        for i in range(n_eqns // 2):
            with jax.named_scope(f"block_{i % 50}"):
                x = jnp.sin(x) * 1.0001
        return x
    return f


def bench_sites(reps: int, n_eqns: int) -> dict:
    x = jnp.ones(4)
    times: dict = {"make_jaxpr": [], "listing": [], "sites": []}
    for _ in range(reps):
        f = big_program(n_eqns)  # fresh: no trace cache hits
        t, closed = timed(lambda: jax.make_jaxpr(f)(x))
        times["make_jaxpr"].append(t)
        t, listed = timed(lambda: tx.sites(closed))
        times["listing"].append(t)
        t, _ = timed(lambda: tx.sites(big_program(n_eqns), x))
        times["sites"].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"eqns": len(listed), "s": med, "listing_ratio": med["listing"] / med["make_jaxpr"],
            "sites_ratio": med["sites"] / med["make_jaxpr"]}


def run(quick: bool = False) -> dict:
    """Measure capture's costs. Returns ``{"jax", "compiled", "sites", "figures"}``."""
    reps, n_eqns = (3, 1000) if quick else (201, 10_000)
    out: dict = {"jax": jax.__version__}
    c = out["compiled"] = bench_compiled(reps)
    s = out["sites"] = bench_sites(3 if quick else 7, n_eqns)
    out["figures"] = [
        {"name": "capture: HLO instructions / hand-written sows (scan of 8 layers)",
         "value": c["hlo_ratio"], "target": "<= 1.0", "pass": c["hlo_ratio"] <= 1.0},
        {"name": "capture: run time / hand-written sows (jit, scan of 8 layers)",
         "value": c["run_ratio"], "target": "<= 1.02", "pass": c["run_ratio"] <= 1.02},
        {"name": f"sites listing / make_jaxpr ({s['eqns']} equations)",
         "value": s["listing_ratio"], "target": "<= 0.5", "pass": s["listing_ratio"] <= 0.5},
        {"name": f"tx.sites (trace + listing) / make_jaxpr ({s['eqns']} equations)",
         "value": s["sites_ratio"], "target": None, "pass": None},
    ]
    return out


def main(argv: list[str]) -> None:
    res = run(quick="--quick" in argv)
    print(f"jax {res['jax']}: HLO {res['compiled']['hlo_capture']} vs "
          f"{res['compiled']['hlo_by_hand']}")
    print_figures(res["figures"])


if __name__ == "__main__":
    main(sys.argv[1:])

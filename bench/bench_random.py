"""Cost of ``tx.next_key``: a dropout MLP through ``uncurry`` vs hand-written
key threading.

The program: an MLP (width 256, 6 hidden layers, batch 128) whose layers
are applied by a raw ``lax.scan`` over stacked weights, each layer under
``jax.checkpoint`` and followed by dropout (rate 0.2). The taxpr version
draws each mask with ``tx.next_key()`` and is made pure by ``tx.uncurry``;
the hand-written one carries the key in the scan carry and splits it before
each mask (``key, sub = split(key)``), so both compute the same numbers
(checked before timing). Two programs: the forward (loss) and an SGD step
(``jax.value_and_grad`` through the checkpointed scan, then the update).
Both take and return the key as ``{"rng": key}``.

Figures (as ``bench_state``'s, with its helpers): optimized HLO instruction
count taxpr / hand (target == 1), run time taxpr / hand (interleaved paired
repetitions in one process, target <= 1.03) and compile time taxpr / hand
(target <= 1.1).

Run: ``python bench/bench_random.py [--quick]``.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax import lax

import taxpr as tx

from bench_state import (  # noqa: E402 - bench/ is on the path (run.py, or run from bench/)
    COMPILE_TARGET, HLO_TARGET, RUN_TARGET, _close, _model_figures, compare_compile,
    compare_hlo, compare_runtime,
)
from _common import timed  # noqa: E402

WIDTH, DEPTH, BATCH, RATE, LR = 256, 6, 128, 0.2, 1e-2


def init_params(key, width: int = WIDTH, depth: int = DEPTH) -> dict:
    kw, kh = jax.random.split(key)
    return {"w": jax.random.normal(kw, (depth, width, width)) / width ** 0.5,
            "b": jnp.zeros((depth, width)),
            "head": jax.random.normal(kh, (width,)) / width ** 0.5}


def _layer(h, w, b, key):
    h = jax.nn.relu(h @ w + b)
    keep = jax.random.bernoulli(key, 1.0 - RATE, h.shape)
    return jnp.where(keep, h / (1.0 - RATE), 0.0)


def loss_stateful(params, x, y):
    def body(h, wb):
        return _layer(h, *wb, tx.next_key()), None
    h, _ = lax.scan(jax.checkpoint(body), x, (params["w"], params["b"]))
    return jnp.mean((h @ params["head"] - y) ** 2)


def make_loss_reference():
    def loss_reference(state, params, x, y):
        def body(carry, wb):
            h, key = carry
            key, sub = jax.random.split(key)
            return (_layer(h, *wb, sub), key), None
        (h, key), _ = lax.scan(jax.checkpoint(body), (x, state["rng"]),
                               (params["w"], params["b"]))
        return jnp.mean((h @ params["head"] - y) ** 2), {"rng": key}
    return loss_reference


def make_sgd_step(loss):
    """``step(state, params, x, y) -> ((loss, new_params), new_state)``."""
    def step(state, params, x, y):
        (value, new_state), grads = jax.value_and_grad(
            lambda p: loss(state, p, x, y), has_aux=True)(params)
        new = jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)
        return (value, new), new_state
    return step


def bench_program(label: str, make_tx, make_ref, args, reps: int, calls: int,
                  creps: int) -> dict:
    fn_tx, fn_ref = make_tx(), make_ref()
    assert _close(jax.jit(fn_tx)(*args), jax.jit(fn_ref)(*args), 1e-5), f"{label}: results differ"
    return {"hlo": compare_hlo(fn_tx, fn_ref, *args),
            "runtime": compare_runtime(fn_tx, fn_ref, args, reps, calls),
            "compile": compare_compile(make_tx, make_ref, args, creps)}


def run(quick: bool = False) -> dict:
    """Measure ``next_key`` against explicit key threading.

    Returns ``{"jax", "sizes", "uncurry_s", "forward", "sgd_step", "figures"}``.
    """
    width, depth, batch = (32, 3, 8) if quick else (WIDTH, DEPTH, BATCH)
    reps, calls, creps = (1, 5, 1) if quick else (31, 50, 9)
    kp, kx = jax.random.split(jax.random.key(0))
    params = init_params(kp, width, depth)
    x = jax.random.normal(kx, (batch, width))
    y = jnp.sin(x.sum(axis=1))
    t_uncurry, (pure, state0) = timed(tx.uncurry, loss_stateful, params, x, y)
    state = {"rng": jax.random.key(1)}
    args = (state, params, x, y)
    out: dict = {"jax": jax.__version__, "sizes": {"width": width, "depth": depth,
                                                    "batch": batch},
                 "uncurry_s": t_uncurry}
    out["forward"] = bench_program(
        "forward", lambda: lambda s, p, a, b: pure(s, p, a, b), make_loss_reference,
        args, reps, calls, creps)
    out["sgd_step"] = bench_program(
        "SGD step", lambda: make_sgd_step(pure), lambda: make_sgd_step(make_loss_reference()),
        args, reps, calls, creps)
    out["figures"] = [*_model_figures(f"dropout MLP {depth} layers forward", out["forward"]),
                      *_model_figures(f"dropout MLP {depth} layers SGD step",
                                      out["sgd_step"])]
    return out


def main(argv: list[str]) -> None:
    res = run(quick="--quick" in argv)
    print(f"jax {res['jax']}  sizes {res['sizes']}  uncurry {res['uncurry_s'] * 1e3:.1f} ms")
    for key in ("forward", "sgd_step"):
        h, rt, c = res[key]["hlo"], res[key]["runtime"], res[key]["compile"]
        print(f"  {key}: HLO instructions taxpr {h['taxpr']} hand {h['reference']}"
              f"   identical {h['identical']}   opcode diff {h['opcode_diff'] or 'none'}")
        print(f"    run     taxpr {rt['taxpr_s'] * 1e6:9.1f} us  hand "
              f"{rt['reference_s'] * 1e6:9.1f} us  ratio {rt['ratio']:.3f}")
        print(f"    compile taxpr {c['taxpr_s'] * 1e3:9.1f} ms  hand "
              f"{c['reference_s'] * 1e3:9.1f} ms  ratio {c['ratio']:.3f}")
    for f in res["figures"]:
        print(f"  {f['name']}: {f['value']:.3f} (target {f['target']}, "
              f"{'pass' if f['pass'] else 'FAIL'})")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Dispatch overhead of tags left in a jitted function.

Compares the per-call time of a jitted function with 20 tags left in against
the same function without tags, in one process, with interleaved repetitions
(median of the per-repetition means). Two cases:

* ``jit``: ``jax.jit(f)``: plain tags carry no effect, so the function keeps
  JAX's fast C++ dispatch path. Target: ratio <= 1.2.
* ``jit_grad``: ``jax.jit(jax.grad(f))``: outside a taxpr transformation a
  differentiated tag stays plain too (see docs/semantics.md, "How tags stay
  alive"). Target: ratio <= 1.2.
* ``uncurry_jit_grad``: ``jax.jit(jax.value_and_grad)`` of the pure function
  ``tx.uncurry`` makes of a function with a state counter and the 20 tags,
  which uncurry does not consume (a model with ``sow`` calls trained through
  ``uncurry`` without reaping them), against the same without the tags: the
  tags a transformation leaves are plain outside every transformation.
  Target: ratio <= 1.2.

Run: ``python bench/bench_dispatch.py [--quick]``.
"""

from __future__ import annotations

import statistics
import sys
import time

import jax
import jax.numpy as jnp

import taxpr as tx

NUM_TAGS = 20
TARGET = 1.2  # target: dispatch ratio with tags left in


def _f(x, tags: bool):
    for i in range(NUM_TAGS):
        if tags:
            x = tx.tag(x, id=i, op="get")
        x = x * 1.5 + 0.5 if i % 5 == 0 else x
    return jnp.sum(x * x)


def _stateful(x, tags: bool):
    tx.set_state("steps", tx.get_state("steps", jnp.int32(0)) + 1)
    return _f(x, tags)


def _uncurried_value_and_grad(tags: bool, x):
    pure, state0 = tx.uncurry(lambda x: _stateful(x, tags), x)
    return jax.jit(jax.value_and_grad(lambda x: pure(state0, x)[0]))


def _time_calls(fn, x, n: int) -> float:
    """Mean seconds per call over ``n`` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(x)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


def _compare(with_tags, without_tags, x, reps: int, calls: int) -> dict:
    for fn in (with_tags, without_tags):  # compile and warm up
        for _ in range(max(10, calls // 10)):
            jax.block_until_ready(fn(x))
    t_tags, t_plain = [], []
    for r in range(reps):
        # Interleave, alternating which one goes first.
        order = [(with_tags, t_tags), (without_tags, t_plain)]
        if r % 2:
            order.reverse()
        for fn, acc in order:
            acc.append(_time_calls(fn, x, calls))
    tags_us = statistics.median(t_tags) * 1e6
    plain_us = statistics.median(t_plain) * 1e6
    return {"tags_us": tags_us, "plain_us": plain_us, "ratio": tags_us / plain_us}


def run(quick: bool = False) -> dict:
    """Measure dispatch times.

    Returns ``{"jit": {...}, "jit_grad": {...}, "uncurry_jit_grad": {...},
    "figures": [...]}``; each case
    has ``tags_us``, ``plain_us`` (median microseconds per call) and
    ``ratio``; ``figures`` are the rows for ``bench/run.py``'s table.
    """
    reps, calls = (15, 200) if quick else (41, 1000)
    x = jnp.ones((8,), jnp.float32)

    def with_tags(x):
        return _f(x, True)

    def without_tags(x):
        return _f(x, False)

    out = {"jax": jax.__version__, "num_tags": NUM_TAGS}
    out["jit"] = _compare(jax.jit(with_tags), jax.jit(without_tags), x, reps, calls)
    out["jit_grad"] = _compare(jax.jit(jax.grad(with_tags)),
                               jax.jit(jax.grad(without_tags)), x, reps, calls)
    out["uncurry_jit_grad"] = _compare(_uncurried_value_and_grad(True, x),
                                       _uncurried_value_and_grad(False, x), x, reps, calls)
    out["figures"] = [
        {"name": f"dispatch jit, {NUM_TAGS} tags / none", "value": out["jit"]["ratio"],
         "target": f"<= {TARGET}", "pass": out["jit"]["ratio"] <= TARGET},
        {"name": f"dispatch jit(grad), {NUM_TAGS} tags / none",
         "value": out["jit_grad"]["ratio"], "target": f"<= {TARGET}",
         "pass": out["jit_grad"]["ratio"] <= TARGET},
        {"name": f"dispatch jit(value_and_grad) of uncurry's pure, {NUM_TAGS} tags / none",
         "value": out["uncurry_jit_grad"]["ratio"], "target": f"<= {TARGET}",
         "pass": out["uncurry_jit_grad"]["ratio"] <= TARGET},
    ]
    return out


def main(argv: list[str]) -> None:
    res = run(quick="--quick" in argv)
    print(f"jax {res['jax']}, {res['num_tags']} tags, per-call dispatch (median)")
    for case in ("jit", "jit_grad", "uncurry_jit_grad"):
        r = res[case]
        print(f"  {case:16s} tags {r['tags_us']:7.2f} us   no tags {r['plain_us']:7.2f} us"
              f"   ratio {r['ratio']:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])

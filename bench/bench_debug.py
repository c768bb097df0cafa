"""Cost of ``tx.debug_nans`` and ``tx.checked`` when nothing goes wrong.

The program: an SGD step of an MLP (width 256, 6 layers, batch 128):
``jax.value_and_grad`` of a squared loss, then the update. Compared, each
under ``jax.jit``, with the step itself (interleaved paired repetitions in
one process, as ``bench_state``):

* ``tx.debug_nans(step)``: one finiteness check of the outputs (the loss
  and the new parameters), the eager diagnosis never runs;
* ``tx.debug_nans`` around the loss, differentiated inside the step (the
  loss and, in its custom_vjp's backward pass, the gradients are checked);
* ``checkify.checkify(step, errors=checkify.float_checks)``: JAX's own
  checks (a NaN check after every floating-point operation), what a user
  would pick instead;
* ``tx.checked`` of the step with a ``tx.error_if`` on the loss.

Figures: run time ratio against the plain step (targets: ``debug_nans`` at
most 1.3, as the rest; checkify has none: it is the comparison).

Run: ``python bench/bench_debug.py [--quick]``.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax.experimental import checkify

import taxpr as tx

from bench_state import compare_runtime  # noqa: E402 - bench/ is on the path
from _common import print_figures, ratio_figure  # noqa: E402

WIDTH, DEPTH, BATCH, LR = 256, 6, 128, 1e-2
TARGET = 1.3


def init(key):
    kw, kx = jax.random.split(key)
    params = [jax.random.normal(k, (WIDTH, WIDTH)) / WIDTH ** 0.5
              for k in jax.random.split(kw, DEPTH)]
    x = jax.random.normal(kx, (BATCH, WIDTH))
    return params, x, jnp.tanh(x)


def loss(params, x, y):
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean((h - y) ** 2)


def make_step(loss_fn):
    def step(params, x, y):
        value, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return value, [p - LR * g for p, g in zip(params, grads)]
    return step


def _error_if_step(params, x, y):
    value, new = make_step(loss)(params, x, y)
    tx.error_if(~jnp.isfinite(value), "loss is {}", value)
    return value, new


def run(quick: bool = False) -> dict:
    reps, calls = (3, 5) if quick else (15, 40)
    args = init(jax.random.key(0))
    step = make_step(loss)
    variants = {
        "debug_nans(step)": tx.debug_nans(step),
        "step of debug_nans(loss)": make_step(tx.debug_nans(loss)),
        "checkify float_checks": checkify.checkify(step, errors=checkify.float_checks),
        "checked(step) with error_if": tx.checked(_error_if_step),
    }
    want = jax.jit(step)(*args)
    result, figures = {}, []
    for name, fn in variants.items():
        got = jax.jit(fn)(*args)
        got = got[1] if name.startswith("checkify") else got
        assert jnp.allclose(got[0], want[0]), name
        r = compare_runtime(fn, step, args, reps, calls)
        result[name] = r
        target = None if name.startswith("checkify") else TARGET
        figures.append(ratio_figure(f"run time {name} / step", r["ratio"], target))
    result["figures"] = figures
    return result


if __name__ == "__main__":
    print_figures(run("--quick" in sys.argv)["figures"])

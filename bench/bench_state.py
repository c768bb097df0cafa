"""Cost of taxpr state: ``uncurry`` vs hand-written pure code.

Three parts, each measured as ratios within one process:

* ``rnn``: an RNN (input 32, hidden 128, batch 8) whose hidden state is taxpr
  state read and written inside a raw ``lax.scan`` of 2,000 steps (quick:
  50), made pure by ``tx.uncurry``, against the same RNN written by hand with
  the hidden state as the scan carry. Both take and return the state as a
  dict ``{"h": ...}``.
* ``mlp``: an SGD training step (``jax.value_and_grad`` + update) of an
  equinox MLP (64 -> 256 -> 256 -> 1, batch 256) whose two hidden layers keep
  batch-norm-like running mean/variance in taxpr state, against the same
  step written by hand with the statistics passed in and returned.
* ``nested_scan``: ``tx.uncurry`` time (trace, state discovery, inject and
  the run for the initial values) for ``lax.scan`` nested 1..8 deep with
  a get/set at each level; figure t(8)/t(4), target <= 2.5. Most of
  it is the initial-value run, which XLA-compiles the program; the same
  ratio for ``tx.make_jaxpr`` (trace, discovery and rewrite only) is a
  second figure.

* ``tbptt``: the RNN trained by truncated backpropagation through time:
  a ``lax.scan`` over 4 chunks of the sequence, each an SGD step whose
  gradient ``tx.value_and_grad`` takes through the hidden state within the
  chunk (the hidden state a taxpr state carried across chunks), against
  the same training written by hand (the hidden state a carry, cut from the
  gradient by ``stop_gradient`` at each chunk's start).

For ``rnn``, ``mlp`` and ``tbptt``, three figures compare ``jax.jit`` of the taxpr
function with ``jax.jit`` of the hand-written one:

* optimized HLO instruction count, taxpr / hand-written (target == 1): the
  instructions of ``jax.jit(f).lower(*args).compile().as_text()`` (lines
  ``name = type opcode(...)``; names and metadata ignored). The result also
  says whether the instruction texts are identical once names and metadata
  are removed (``identical``) and lists any opcode-count difference;
* run time, taxpr / hand-written (target <= 1.03): per repetition the mean
  over back-to-back calls of each function, the two interleaved (alternating
  which goes first); the figure is the median over repetitions of the
  per-repetition ratio (paired, so slow drifts of the machine cancel);
* compile time, taxpr / hand-written (target <= 1.1): trace + lower + XLA
  compile of ``jax.jit`` of a freshly built function (so no trace or
  executable cache hits), interleaved, median of the paired ratios. On the
  taxpr side this is ``jax.jit`` of the ``pure`` function ``uncurry``
  returned (its jaxpr was made by ``uncurry``); the one-off cost of
  ``uncurry`` itself is reported as ``uncurry_s`` (no target).

Run: ``python bench/bench_state.py [--quick]``.
"""

from __future__ import annotations

import collections
import gc
import re
import statistics
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax

import taxpr as tx

from _common import nested_scans, timed  # noqa: E402

HLO_TARGET = 1.0
RUN_TARGET = 1.03
COMPILE_TARGET = 1.1
DEPTH_TARGET = 2.5


# -- helpers ---------------------------------------------------------------------




_INSTR = re.compile(r"^\s+(?:ROOT\s+)?[%\w.\-]+\s*=\s*(.*)$")
_OPCODE = re.compile(r"([a-z][a-z0-9\-]*)\(")


_NAME = re.compile(r"[%\w\-]+\.\d+(?:\.\d+)*\b")
_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")


def hlo_normalized(text: str) -> list[str]:
    """The instruction lines with numbered names and metadata removed."""
    return [_NAME.sub("N", _METADATA.sub("", line)) for line in text.splitlines()
            if _INSTR.match(line)]


def hlo_opcodes(text: str) -> list[str]:
    """The opcode of every instruction of an optimized HLO module text."""
    ops = []
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m:
            op = _OPCODE.search(m.group(1))
            ops.append(op.group(1) if op else "?")
    return ops


def compiled_hlo(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def compare_hlo(fn_tx, fn_ref, *args) -> dict:
    text_tx, text_ref = compiled_hlo(fn_tx, *args), compiled_hlo(fn_ref, *args)
    ops_tx, ops_ref = hlo_opcodes(text_tx), hlo_opcodes(text_ref)
    c_tx, c_ref = collections.Counter(ops_tx), collections.Counter(ops_ref)
    diff = {op: c_tx[op] - c_ref[op] for op in sorted(set(c_tx) | set(c_ref))
            if c_tx[op] != c_ref[op]}
    return {"taxpr": len(ops_tx), "reference": len(ops_ref),
            "ratio": len(ops_tx) / len(ops_ref), "opcode_diff": diff,
            "identical": hlo_normalized(text_tx) == hlo_normalized(text_ref)}


def _paired_ratio(times: dict) -> float:
    """Median over repetitions of taxpr time / reference time, each pair
    measured back to back: robust to the machine's speed drifting during
    the run (a shared 2-core machine drifts by several percent)."""
    return statistics.median(t / r for t, r in zip(times["taxpr"], times["reference"]))


def compare_runtime(fn_tx, fn_ref, args, reps: int, calls: int) -> dict:
    jitted = {"taxpr": jax.jit(fn_tx), "reference": jax.jit(fn_ref)}
    for f in jitted.values():  # compile and warm up
        for _ in range(3):
            jax.block_until_ready(f(*args))
    times = {k: [] for k in jitted}

    def many(f):
        out = None
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)

    for r in range(reps):
        order = list(jitted) if r % 2 == 0 else list(reversed(jitted))
        for k in order:
            dt, _ = timed(many, jitted[k])
            times[k].append(dt / calls)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"taxpr_s": med["taxpr"], "reference_s": med["reference"],
            "ratio": _paired_ratio(times), "calls": calls, "reps": reps}


def compare_compile(make_tx, make_ref, args, reps: int) -> dict:
    """``make_*()`` builds a fresh function; time jit-lower-compile of it."""
    def compile_fresh(make):
        return jax.jit(make()).lower(*args).compile()

    makers = {"taxpr": make_tx, "reference": make_ref}
    for m in makers.values():  # warm-up
        compile_fresh(m)
    times = {k: [] for k in makers}
    for r in range(reps):
        order = list(makers) if r % 2 == 0 else list(reversed(makers))
        for k in order:
            dt, _ = timed(compile_fresh, makers[k])
            times[k].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"taxpr_s": med["taxpr"], "reference_s": med["reference"],
            "ratio": _paired_ratio(times), "reps": reps}


def _close(a, b, tol) -> bool:
    return all(bool(jnp.allclose(x, y, rtol=tol, atol=tol))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


# -- (a) the RNN -----------------------------------------------------------------

RNN_IN, RNN_HIDDEN, RNN_BATCH = 32, 128, 8


def rnn_params(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"wx": jax.random.normal(k1, (RNN_IN, RNN_HIDDEN)) / RNN_IN ** 0.5,
            "wh": jax.random.normal(k2, (RNN_HIDDEN, RNN_HIDDEN)) / RNN_HIDDEN ** 0.5,
            "b": jnp.zeros((RNN_HIDDEN,)),
            "wo": jax.random.normal(k3, (RNN_HIDDEN, RNN_IN)) / RNN_HIDDEN ** 0.5}


def rnn_stateful(params, xs):
    def body(carry, x):
        h = tx.get_state("h", jnp.zeros((RNN_BATCH, RNN_HIDDEN), jnp.float32))
        h = jnp.tanh(x @ params["wx"] + h @ params["wh"] + params["b"])
        tx.set_state("h", h)
        return carry, h @ params["wo"]

    _, ys = lax.scan(body, None, xs)
    return ys


def make_rnn_reference():
    def rnn_reference(state, params, xs):
        def body(h, x):
            h = jnp.tanh(x @ params["wx"] + h @ params["wh"] + params["b"])
            return h, h @ params["wo"]

        h, ys = lax.scan(body, state["h"], xs)
        return ys, {"h": h}
    return rnn_reference


def bench_rnn(steps: int, reps: int, calls: int, compile_reps: int) -> dict:
    kp, kx = jax.random.split(jax.random.key(0))
    params = rnn_params(kp)
    xs = jax.random.normal(kx, (steps, RNN_BATCH, RNN_IN))
    t_uncurry, (pure, state0) = timed(tx.uncurry, rnn_stateful, params, xs)
    ref = make_rnn_reference()
    args = (state0, params, xs)
    assert _close(jax.jit(pure)(*args), jax.jit(ref)(*args), 1e-4), "RNN results differ"
    return {"steps": steps, "uncurry_s": t_uncurry,
            "hlo": compare_hlo(pure, ref, *args),
            "runtime": compare_runtime(pure, ref, args, reps, calls),
            "compile": compare_compile(lambda: lambda s, p, x: pure(s, p, x),
                                       make_rnn_reference, args, compile_reps)}


# -- (b) the MLP with running statistics -------------------------------------------

MLP_SIZES, MLP_BATCH, MOMENTUM, EPS, LR = (64, 256, 256, 1), 256, 0.9, 1e-5, 1e-2


class MLP(eqx.Module):
    hidden: list
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, len(MLP_SIZES) - 1)
        self.hidden = [eqx.nn.Linear(a, b, key=k)
                       for a, b, k in zip(MLP_SIZES[:-2], MLP_SIZES[1:-1], keys)]
        self.head = eqx.nn.Linear(MLP_SIZES[-2], MLP_SIZES[-1], key=keys[-1])


def _normalise(a, mean, var):
    m, v = jnp.mean(a, axis=0), jnp.var(a, axis=0)
    new = (MOMENTUM * mean + (1 - MOMENTUM) * m, MOMENTUM * var + (1 - MOMENTUM) * v)
    return (a - m) / jnp.sqrt(v + EPS), new


def mlp_stateful(model, x):
    """Training-mode forward pass; running statistics in taxpr state."""
    for i, layer in enumerate(model.hidden):
        a = jax.vmap(layer)(x)
        n = a.shape[-1]
        mean = tx.get_state(f"l{i}.mean", jnp.zeros((n,), jnp.float32))
        var = tx.get_state(f"l{i}.var", jnp.ones((n,), jnp.float32))
        x, (mean, var) = _normalise(a, mean, var)
        tx.set_state(f"l{i}.mean", mean)
        tx.set_state(f"l{i}.var", var)
        x = jax.nn.relu(x)
    return jax.vmap(model.head)(x)[:, 0]


def mlp_reference(state, model, x):
    """The same forward pass with the statistics passed in and returned."""
    new = {}
    for i, layer in enumerate(model.hidden):
        a = jax.vmap(layer)(x)
        x, (new[f"l{i}.mean"], new[f"l{i}.var"]) = _normalise(
            a, state[f"l{i}.mean"], state[f"l{i}.var"])
        x = jax.nn.relu(x)
    return jax.vmap(model.head)(x)[:, 0], new


def make_sgd_step(forward):
    """A fresh SGD step around ``forward(state, model, x) -> (pred, state)``."""
    def sgd_step(model, state, x, y):
        def loss(model):
            pred, new_state = forward(state, model, x)
            return jnp.mean((pred - y) ** 2), new_state

        (value, new_state), g = jax.value_and_grad(loss, has_aux=True)(model)
        model = jax.tree_util.tree_map(lambda p, d: p - LR * d, model, g)
        return model, new_state, value
    return sgd_step


def bench_mlp(reps: int, calls: int, compile_reps: int) -> dict:
    km, kx = jax.random.split(jax.random.key(1))
    model = MLP(km)
    x = jax.random.normal(kx, (MLP_BATCH, MLP_SIZES[0]))
    y = jnp.sin(x[:, 0]) + x[:, 1] * x[:, 2]
    t_uncurry, (pure, state0) = timed(tx.uncurry, mlp_stateful, model, x)
    step_tx, step_ref = make_sgd_step(pure), make_sgd_step(mlp_reference)
    args = (model, state0, x, y)
    assert _close(jax.jit(step_tx)(*args), jax.jit(step_ref)(*args), 1e-4), "MLP results differ"
    return {"sizes": MLP_SIZES, "batch": MLP_BATCH, "uncurry_s": t_uncurry,
            "hlo": compare_hlo(step_tx, step_ref, *args),
            "hlo_forward": compare_hlo(pure, mlp_reference, state0, model, x),
            "runtime": compare_runtime(step_tx, step_ref, args, reps, calls),
            "compile": compare_compile(lambda: make_sgd_step(pure),
                                       lambda: make_sgd_step(mlp_reference), args,
                                       compile_reps)}


# -- (d) truncated backpropagation through time with tx.value_and_grad ----------------

TBPTT_CHUNKS, TBPTT_LR = 4, 1e-2


def _chunk_loss_stateful(params, xs):
    ys = rnn_stateful(params, xs)
    return jnp.mean((ys[1:] - xs[:-1]) ** 2)


def make_tbptt_stateful():
    """Chunks of a sequence, each an SGD step differentiated through the
    hidden state within the chunk (``tx.value_and_grad``); the hidden state
    carries over between chunks in a taxpr state."""
    def train(params, chunks):
        def chunk(params, xs):
            value, g = tx.value_and_grad(_chunk_loss_stateful)(params, xs)
            return jax.tree_util.tree_map(lambda p, d: p - TBPTT_LR * d, params, g), value
        return lax.scan(chunk, params, chunks)
    return train


def make_tbptt_reference():
    """The same training written by hand: the hidden state a carry, cut from
    the gradient at each chunk's start."""
    rnn = make_rnn_reference()

    def train(state, params, chunks):
        def chunk(carry, xs):
            params, h = carry

            def loss(params):
                ys, new = rnn({"h": lax.stop_gradient(h)}, params, xs)
                return jnp.mean((ys[1:] - xs[:-1]) ** 2), new["h"]

            (value, h), g = jax.value_and_grad(loss, has_aux=True)(params)
            return (jax.tree_util.tree_map(lambda p, d: p - TBPTT_LR * d, params, g), h), value
        (params, h), values = lax.scan(chunk, (params, state["h"]), chunks)
        return (params, values), {"h": h}
    return train


def bench_tbptt(steps: int, reps: int, calls: int, compile_reps: int) -> dict:
    kp, kx = jax.random.split(jax.random.key(2))
    params = rnn_params(kp)
    chunks = jax.random.normal(kx, (TBPTT_CHUNKS, steps // TBPTT_CHUNKS, RNN_BATCH, RNN_IN))
    t_uncurry, (pure, state0) = timed(tx.uncurry, make_tbptt_stateful(), params, chunks)
    ref = make_tbptt_reference()
    args = (state0, params, chunks)
    assert _close(jax.jit(pure)(*args), jax.jit(ref)(*args), 1e-4), "TBPTT results differ"
    return {"steps": steps, "chunks": TBPTT_CHUNKS, "uncurry_s": t_uncurry,
            "hlo": compare_hlo(pure, ref, *args),
            "runtime": compare_runtime(pure, ref, args, reps, calls),
            "compile": compare_compile(lambda: lambda s, p, c: pure(s, p, c),
                                       make_tbptt_reference, args, compile_reps)}


# -- (c) uncurry of nested scans -----------------------------------------------------

def nested_scan_fn(depth: int, length: int):
    """``depth`` nested scans; each level (and the top) reads and writes its
    own state and a shared counter."""
    def step(d, x):
        s = tx.get_state(f"s{d}", jnp.zeros((3,), jnp.float32))
        tx.set_state(f"s{d}", s * 0.5 + x)
        n = tx.get_state("count", jnp.zeros((), jnp.int32))
        tx.set_state("count", n + 1)
        return x * 1.0001 + s

    return nested_scans(depth, length, step)


def bench_nested(max_depth: int, length: int, reps: int) -> dict:
    """``tx.uncurry`` time per depth (the figure), and ``tx.make_jaxpr`` time
    (trace + state discovery + rewrite, without ``uncurry``'s run of the
    program for the initial values, which compiles it with XLA)."""
    x = jnp.ones((3,), jnp.float32)
    depths = list(range(1, max_depth + 1))
    for d in depths:  # warm-up
        tx.uncurry(nested_scan_fn(d, length), x)
        tx.make_jaxpr(nested_scan_fn(d, length))(x)
    times = {k: {d: [] for d in depths} for k in ("uncurry", "make_jaxpr")}
    for r in range(reps):
        for d in (depths if r % 2 == 0 else depths[::-1]):
            # Fresh functions: no trace cache hits.
            dt, _ = timed(tx.uncurry, nested_scan_fn(d, length), x)
            times["uncurry"][d].append(dt)
            dt, _ = timed(tx.make_jaxpr(nested_scan_fn(d, length)), x)
            times["make_jaxpr"][d].append(dt)
    # Check the counter once: 1 + L + L^2 + ... + L^depth accesses.
    pure, s0 = tx.uncurry(nested_scan_fn(max_depth, length), x)
    _, s1 = pure(s0, x)
    assert int(s1["count"]) == sum(length ** k for k in range(max_depth + 1)), s1["count"]
    top, half = max_depth, max_depth // 2
    out = {"length": length, "ratio_key": f"t{top}/t{half}"}
    for k, per_depth in times.items():
        med = {d: statistics.median(ts) for d, ts in per_depth.items()}
        out[f"{k}_s"] = {str(d): med[d] for d in depths}
        out[f"{k}_ratio"] = med[top] / med[half]
    out["ratio"] = out["uncurry_ratio"]
    return out


# -- entry points ------------------------------------------------------------------

def _model_figures(label: str, r: dict) -> list[dict]:
    h, rt, c = r["hlo"], r["runtime"], r["compile"]
    return [
        {"name": f"{label}: HLO instructions taxpr/hand ({h['taxpr']}/{h['reference']})",
         "value": float(h["ratio"]), "target": f"== {HLO_TARGET}",
         "pass": h["taxpr"] == h["reference"]},
        {"name": f"{label}: run time taxpr/hand", "value": rt["ratio"],
         "target": f"<= {RUN_TARGET}", "pass": rt["ratio"] <= RUN_TARGET},
        {"name": f"{label}: compile time taxpr/hand", "value": c["ratio"],
         "target": f"<= {COMPILE_TARGET}", "pass": c["ratio"] <= COMPILE_TARGET},
    ]


def run(quick: bool = False) -> dict:
    """Measure the cost of taxpr state.

    Returns ``{"jax", "rnn", "mlp", "tbptt", "nested_scan", "figures"}``; ``figures``
    are ``{name, value, target, pass}`` rows for ``bench/run.py``'s table.
    """
    if quick:
        steps, reps, rnn_calls, mlp_calls, creps, max_depth, nreps = 50, 1, 5, 5, 1, 4, 1
    else:
        steps, reps, rnn_calls, mlp_calls, creps, max_depth, nreps = 2000, 31, 20, 100, 9, 8, 11
    out: dict = {"jax": jax.__version__}
    out["rnn"] = bench_rnn(steps, reps, rnn_calls, creps)
    out["mlp"] = bench_mlp(reps, mlp_calls, creps)
    out["tbptt"] = bench_tbptt(steps // 4, reps, rnn_calls, creps)
    out["nested_scan"] = bench_nested(max_depth, 2, nreps)
    ns = out["nested_scan"]
    out["figures"] = [
        *_model_figures(f"RNN scan {steps}", out["rnn"]),
        *_model_figures("MLP running stats SGD step", out["mlp"]),
        *_model_figures(f"RNN truncated BPTT, tx.value_and_grad, {steps // 4} steps",
                        out["tbptt"]),
        {"name": f"uncurry nested scan {ns['ratio_key']}", "value": ns["ratio"],
         "target": f"<= {DEPTH_TARGET}", "pass": ns["ratio"] <= DEPTH_TARGET},
        {"name": f"tx.make_jaxpr nested scan {ns['ratio_key']}",
         "value": ns["make_jaxpr_ratio"], "target": f"<= {DEPTH_TARGET}",
         "pass": ns["make_jaxpr_ratio"] <= DEPTH_TARGET},
    ]
    return out


def main(argv: list[str]) -> None:
    res = run(quick="--quick" in argv)
    print(f"jax {res['jax']}")
    for key in ("rnn", "mlp", "tbptt"):
        r = res[key]
        h, rt, c = r["hlo"], r["runtime"], r["compile"]
        print(f"  {key}: uncurry {r['uncurry_s'] * 1e3:.1f} ms")
        print(f"    HLO instructions taxpr {h['taxpr']} hand {h['reference']}"
              f"   identical {h['identical']}   opcode diff {h['opcode_diff'] or 'none'}")
        if "hlo_forward" in r:
            hf = r["hlo_forward"]
            print(f"    forward HLO instructions taxpr {hf['taxpr']} hand {hf['reference']}"
                  f"   identical {hf['identical']}   opcode diff {hf['opcode_diff'] or 'none'}")
        print(f"    run     taxpr {rt['taxpr_s'] * 1e6:9.1f} us  hand {rt['reference_s'] * 1e6:9.1f} us"
              f"  ratio {rt['ratio']:.3f}")
        print(f"    compile taxpr {c['taxpr_s'] * 1e3:9.1f} ms  hand {c['reference_s'] * 1e3:9.1f} ms"
              f"  ratio {c['ratio']:.3f}")
    ns = res["nested_scan"]
    for k in ("uncurry", "make_jaxpr"):
        print(f"  nested scan {k} (ms): "
              + "  ".join(f"d{d}={t * 1e3:.1f}" for d, t in ns[f"{k}_s"].items())
              + f"   {ns['ratio_key']} = {ns[f'{k}_ratio']:.2f}")
    for f in res["figures"]:
        print(f"  {'ok ' if f['pass'] else 'MISS'} {f['name']}: {f['value']:.3f} ({f['target']})")


if __name__ == "__main__":
    main(sys.argv[1:])

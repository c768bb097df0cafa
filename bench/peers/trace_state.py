"""Tracing cost of a stateful program: Haiku vs taxpr, each as a ratio to
``jax.make_jaxpr`` of the same program written without state.

Programs (hidden size ``H``; ``w`` and ``xs`` are arguments, not parameters,
so the three versions compute exactly the same thing):

* ``unrolled-T``: an RNN unrolled by a Python loop of ``T`` steps; the hidden
  state ``h`` is read and written at every step. Plain version: ``h`` is a
  Python variable, ``h0`` an argument and the final ``h`` an output.
* ``scan-L``: an ``L``-layer stacked RNN in one scan body; each layer's hidden
  state is a separate state. Haiku uses ``hk.scan`` (its own wrapper: raw
  ``lax.scan`` leaks tracers, see README.md), taxpr raw ``lax.scan``, the
  plain version ``lax.scan`` with the hidden states as carry.

Timed steps, every one on a freshly built function (``jax.make_jaxpr``
caches its trace per function object):

* ``plain``: ``jax.make_jaxpr(plain)(h0, w, xs)``
* ``haiku_apply``: ``jax.make_jaxpr(hk.transform_with_state(f).apply)
  (params, state, None, w, xs)`` (the pure program a Haiku user runs)
* ``haiku_init``: ``jax.make_jaxpr(hk.transform_with_state(f).init)
  (None, w, xs)`` (Haiku needs this trace too, to get the initial state)
* ``taxpr``: ``tx.make_jaxpr(f)(w, xs)`` (trace, find the states, thread
  them: the pure program, ``uncurry``'s trace)

The figure for each tool is ``median(tool) / median(plain)`` in one
process. With both libraries importable (``--tools haiku,taxpr``) all steps
are interleaved in one process; otherwise run it once per venv. Before
timing, each tool's jaxpr is evaluated and checked against the plain one
(same outputs and final hidden state).

Run: ``python bench/peers/trace_state.py [--tools haiku,taxpr] [--quick]``;
prints one line per program and tool, then a ``JSON {...}`` line.
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
from jax import lax
from jax.extend.core import jaxpr_as_fun

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import count_eqns, interleaved  # noqa: E402

H = 16


# ---------------------------------------------------------------- programs
def plain_unrolled(T):
    def plain(h, w, xs):
        ys = []
        for t in range(T):
            h = jnp.tanh(w @ h + xs[t])
            ys.append(h)
        return jnp.stack(ys), h
    return plain


def plain_scan(L):
    def plain(hs, w, xs):
        def step(hs, x):
            new, inp = [], x
            for l in range(L):
                inp = jnp.tanh(w[l] @ hs[l] + inp)
                new.append(inp)
            return tuple(new), inp
        hs, ys = lax.scan(step, tuple(hs), xs)
        return ys, hs
    return plain


def stateful_unrolled(T, get, set_):
    def f(w, xs):
        ys = []
        for t in range(T):
            h = jnp.tanh(w @ get("h") + xs[t])
            set_("h", h)
            ys.append(h)
        return jnp.stack(ys)
    return f


def stateful_scan(L, get, set_, scan):
    def f(w, xs):
        def step(carry, x):
            inp = x
            for l in range(L):
                inp = jnp.tanh(w[l] @ get(f"h{l}") + inp)
                set_(f"h{l}", inp)
            return carry, inp
        return scan(step, jnp.zeros((), jnp.float32), xs)[1]
    return f


def programs(quick: bool):
    if quick:
        return [("unrolled", 20), ("scan", 2)]
    return [("unrolled", 250), ("unrolled", 1000), ("scan", 8)]


def example(kind, size, seed=0):
    rng = np.random.default_rng(seed)
    n_layers = size if kind == "scan" else 1
    T = size if kind == "unrolled" else 50
    w = jnp.asarray(0.3 * rng.standard_normal((n_layers, H, H)), jnp.float32)
    if kind == "unrolled":
        w = w[0]
    xs = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    names = ["h"] if kind == "unrolled" else [f"h{l}" for l in range(size)]
    h0 = {n: jnp.asarray(0.1 * rng.standard_normal(H), jnp.float32) for n in names}
    return w, xs, names, h0


def plain_fn(kind, size):
    return plain_unrolled(size) if kind == "unrolled" else plain_scan(size)


def plain_h0(kind, h0, names):
    return h0["h"] if kind == "unrolled" else tuple(h0[n] for n in names)


# ------------------------------------------------------------------ tools
def haiku_steps(kind, size, w, xs, names, h0):
    import haiku as hk

    def get(name):
        return hk.get_state(name, [H], jnp.float32, init=jnp.zeros)

    def make():
        if kind == "unrolled":
            return hk.transform_with_state(stateful_unrolled(size, get, hk.set_state))
        return hk.transform_with_state(stateful_scan(size, get, hk.set_state, hk.scan))

    state = {"~": dict(h0)}
    steps = {
        "haiku_apply": lambda: jax.make_jaxpr(make().apply)({}, state, None, w, xs),
        "haiku_init": lambda: jax.make_jaxpr(make().init)(None, w, xs),
    }

    def check(plain_out):
        closed = steps["haiku_apply"]()
        ys, st = jax.jit(make().apply)({}, state, None, w, xs)
        ok = _close(ys, plain_out[0]) and all(
            _close(st["~"][n], h) for n, h in zip(names, _final_hs(kind, plain_out)))
        return ok, count_eqns(closed)

    return steps, check, hk.__version__


def taxpr_steps(kind, size, w, xs, names, h0):
    import taxpr as tx

    zeros = np.zeros(H, np.float32)

    def get(name):
        return tx.get_state(name, zeros)

    def make():
        if kind == "unrolled":
            return stateful_unrolled(size, get, tx.set_state)
        return stateful_scan(size, get, tx.set_state, lax.scan)

    steps = {"taxpr": lambda: tx.make_jaxpr(make())(w, xs)}

    def check(plain_out):
        closed, infos = steps["taxpr"]()
        assert [i.name for i in infos] == sorted(names), infos
        outs = jax.jit(jaxpr_as_fun(closed))(*(h0[i.name] for i in infos), w, xs)
        finals = dict(zip(sorted(names), outs[1:]))
        ok = _close(outs[0], plain_out[0]) and all(
            _close(finals[n], h) for n, h in zip(names, _final_hs(kind, plain_out)))
        return ok, count_eqns(closed)

    return steps, check, version("taxpr")


TOOLS = {"haiku": haiku_steps, "taxpr": taxpr_steps}


def _final_hs(kind, plain_out):
    return [plain_out[1]] if kind == "unrolled" else list(plain_out[1])


def _close(a, b):
    return bool(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5))


# ------------------------------------------------------------------- main
def measure(kind, size, tools, reps):
    w, xs, names, h0 = example(kind, size)
    hp = plain_h0(kind, h0, names)
    steps = {"plain": lambda: jax.make_jaxpr(plain_fn(kind, size))(hp, w, xs)}
    plain_closed = steps["plain"]()
    plain_out = jax.jit(plain_fn(kind, size))(hp, w, xs)
    checks, versions = {}, {}
    for tool in tools:
        tool_steps, check, versions[tool] = TOOLS[tool](kind, size, w, xs, names, h0)
        steps.update(tool_steps)
        checks[tool] = check(plain_out)  # also the warm-up of each step
    med = interleaved(steps, reps)
    res = {"program": f"{kind}-{size}", "plain_s": med["plain"],
           "plain_eqns": count_eqns(plain_closed), "tools": {}}
    for tool in tools:
        ok, eqns = checks[tool]
        entry = {"version": versions[tool], "equivalent": ok, "eqns": eqns}
        for step in [s for s in med if s.startswith(tool)]:
            entry[f"{step}_s"] = med[step]
            entry[f"{step}_ratio"] = med[step] / med["plain"]
        res["tools"][tool] = entry
    return res


def run(tools, quick=False, reps=None, only=None):
    reps = reps or (3 if quick else 9)
    progs = [(k, s) for k, s in programs(quick) if not only or f"{k}-{s}" in only]
    if only:  # sizes not in the default list, e.g. "unrolled-100"
        progs += [(n.split("-")[0], int(n.split("-")[1])) for n in only
                  if n not in {f"{k}-{s}" for k, s in progs}]
    return {"python": platform.python_version(), "jax": jax.__version__,
            "reps": reps, "results": [measure(k, s, tools, reps) for k, s in progs]}


def _available():
    out = []
    for tool, mod in (("haiku", "haiku"), ("taxpr", "taxpr")):
        try:
            __import__(mod)
            out.append(tool)
        except ImportError:
            pass
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tools", default=None,
                   help="comma-separated subset of haiku,taxpr (default: those importable)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--programs", default=None,
                   help="comma-separated, e.g. unrolled-250,scan-8 (default: all)")
    a = p.parse_args(argv)
    tools = a.tools.split(",") if a.tools else _available()
    out = run(tools, a.quick, a.reps, a.programs.split(",") if a.programs else None)
    print(f"python {out['python']}, jax {out['jax']}, {out['reps']} reps")
    for r in out["results"]:
        print(f"  {r['program']:14s} plain make_jaxpr {r['plain_s'] * 1e3:8.1f} ms"
              f"  ({r['plain_eqns']} eqns)")
        for tool, e in r["tools"].items():
            ratios = "  ".join(f"{k[:-6]} {v:.2f}x" for k, v in e.items() if k.endswith("_ratio"))
            print(f"    {tool} {e['version']}: {ratios}  ({e['eqns']} eqns,"
                  f" {'equivalent' if e['equivalent'] else 'NOT EQUIVALENT'})")
    print("JSON " + json.dumps(out))
    return out


if __name__ == "__main__":
    main()

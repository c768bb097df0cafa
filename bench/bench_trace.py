"""Tracing cost of stateful programs: ``tx.make_jaxpr`` vs JAX's mutable refs.

Three programs (hidden size H = 16), each written three ways:

* ``plain``: explicit carries, traced by ``jax.make_jaxpr`` (the reference);
* ``refs``: JAX's mutable array references (``jax.new_ref``, ``ref[...] = v``,
  ``jax.freeze``), traced by ``jax.make_jaxpr`` (``refs``) and then
  discharged into pure code (``refs + discharge``, what ``jax.jit`` does);
* ``taxpr``: ``tx.get_state`` / ``tx.set_state``, traced and made pure by
  ``tx.make_jaxpr``; ``taxpr tags only`` is its trace alone, before the
  pass that threads the states (what ``refs`` is to ``refs + discharge``).

Programs: ``rnn_scan`` (an RNN in ``lax.scan`` of 2,000 steps, state ``h``),
``layers_scan`` (8 layers of state in one ``lax.scan`` of 500 steps),
``rnn_unrolled`` (an RNN unrolled in Python, 1,000 steps). The taxpr
versions give ``get_state`` a callable init (``lambda: jnp.zeros(H)``, as
the README's example does), evaluated once per trace and state, while the
plain and refs versions start at the input ``h0``; the ``input init`` rows
start taxpr's state at ``h0`` too, and the ``zeros init everywhere`` rows
start every version at zeros made in the trace (the same program three ways). Figures: each
variant's tracing time divided by ``plain``'s (thread CPU time, the minimum
over repetitions, interleaved, fresh functions every time so no trace cache
hits). Targets: ``taxpr <= refs + discharge``.

A second group compares ``tx.uncurry`` (trace, state discovery, initial
values) with the first ``jax.jit`` call of the plain program (trace, compile,
run), on the two scan programs with an input-dependent init and with
constant inits only: targets <= 1.25 and <= 1.05.

Run: ``python bench/bench_trace.py [--quick]``.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

import taxpr as tx

from _common import timed  # noqa: E402

H = 16


def _discharge(closed) -> Any:
    from jax._src.state.discharge import discharge_state
    return discharge_state(closed)


# ---- the three programs, three ways each ----------------------------------------------

def _start(h0, zeros_everywhere: bool):
    """The plain and refs versions' initial state: the input ``h0``, or (the
    same program as taxpr's callable zeros init) zeros made in the trace."""
    return jnp.zeros(H) if zeros_everywhere else h0


def rnn_scan(steps: int, const_init: bool = True, zeros_everywhere: bool = False
             ) -> dict[str, Callable]:
    def cell(w, h, x):
        return jnp.tanh(w @ h + x)

    def plain(w, xs, h0):
        h, _ = lax.scan(lambda h, x: (cell(w, h, x), None), _start(h0, zeros_everywhere), xs)
        return h

    def refs(w, xs, h0):
        r = jax.new_ref(_start(h0, zeros_everywhere))

        def body(_, x):
            r[...] = cell(w, r[...], x)
            return None, None

        lax.scan(body, None, xs)
        return jax.freeze(r)

    def stateful(w, xs, h0):
        init = (lambda: jnp.zeros(H)) if const_init else h0

        def body(_, x):
            h = tx.get_state("h", init)
            tx.set_state("h", cell(w, h, x))
            return None, None

        lax.scan(body, None, xs)
        return tx.get_state("h", init)

    args = (jnp.eye(H) * 0.5, jnp.ones((steps, H)) * 0.01, jnp.zeros(H))
    return {"plain": plain, "refs": refs, "taxpr": stateful, "args": args}


def layers_scan(steps: int, layers: int = 8, const_init: bool = True,
                zeros_everywhere: bool = False) -> dict[str, Callable]:
    def plain(w, xs, h0):
        def body(hs, x):
            new, inp = [], x
            for h in hs:
                inp = jnp.tanh(w @ h + inp)
                new.append(inp)
            return tuple(new), None

        hs, _ = lax.scan(body, tuple(_start(h0, zeros_everywhere) for _ in range(layers)), xs)
        return hs[-1]

    def refs(w, xs, h0):
        rs = [jax.new_ref(_start(h0, zeros_everywhere)) for _ in range(layers)]

        def body(_, x):
            inp = x
            for r in rs:
                inp = jnp.tanh(w @ r[...] + inp)
                r[...] = inp
            return None, None

        lax.scan(body, None, xs)
        return jax.freeze(rs[-1])

    def stateful(w, xs, h0):
        init = (lambda: jnp.zeros(H)) if const_init else h0

        def body(_, x):
            inp = x
            for i in range(layers):
                inp = jnp.tanh(w @ tx.get_state(f"h{i}", init) + inp)
                tx.set_state(f"h{i}", inp)
            return None, None

        lax.scan(body, None, xs)
        return tx.get_state(f"h{layers - 1}", init)

    args = (jnp.eye(H) * 0.5, jnp.ones((steps, H)) * 0.01, jnp.zeros(H))
    return {"plain": plain, "refs": refs, "taxpr": stateful, "args": args}


def rnn_unrolled(steps: int, const_init: bool = True, zeros_everywhere: bool = False
                 ) -> dict[str, Callable]:
    def plain(w, xs, h0):
        h = _start(h0, zeros_everywhere)
        for t in range(steps):
            h = jnp.tanh(w @ h + xs[t])
        return h

    def refs(w, xs, h0):
        r = jax.new_ref(_start(h0, zeros_everywhere))
        for t in range(steps):
            r[...] = jnp.tanh(w @ r[...] + xs[t])
        return jax.freeze(r)

    def stateful(w, xs, h0):
        for t in range(steps):
            h = tx.get_state("h", (lambda: jnp.zeros(H)) if const_init else h0)
            tx.set_state("h", jnp.tanh(w @ h + xs[t]))
        return tx.get_state("h", (lambda: jnp.zeros(H)) if const_init else h0)

    args = (jnp.eye(H) * 0.5, jnp.ones((steps, H)) * 0.01, jnp.zeros(H))
    return {"plain": plain, "refs": refs, "taxpr": stateful, "args": args}


# ---- measurements ----------------------------------------------------------------------

def _fresh(fn: Callable) -> Callable:
    """A new function object with the same code (no JAX trace cache hits)."""
    return lambda *a: fn(*a)


def _tags_only(fn: Callable, args: tuple) -> Any:
    """The first half of ``tx.make_jaxpr``: the program traced with its
    state tags kept (inits staged for their types, as ``tx.make_jaxpr``
    does), before the pass that threads the states (what ``refs`` is to
    ``refs + discharge``)."""
    from taxpr._state._inits import tracing_for_types

    with tracing_for_types():
        return jax.make_jaxpr(fn)(*args)


def _trace_times(make: Callable[[], dict], reps: int, more_if_cheap: bool = True
                 ) -> dict[str, float]:
    variants = {
        "plain": lambda p: jax.make_jaxpr(_fresh(p["plain"]))(*p["args"]),
        "refs": lambda p: jax.make_jaxpr(_fresh(p["refs"]))(*p["args"]),
        "refs + discharge": lambda p: _discharge(jax.make_jaxpr(_fresh(p["refs"]))(*p["args"])),
        "taxpr tags only": lambda p: _tags_only(_fresh(p["taxpr"]), p["args"]),
        "taxpr": lambda p: tx.make_jaxpr(_fresh(p["taxpr"]))(*p["args"]),
    }
    best = {k: float("inf") for k in variants}
    # Cheap programs (a scan body traces in milliseconds) get more
    # repetitions, so that the minimum is not one noisy sample.
    if more_if_cheap:
        t_plain, _ = timed(variants["plain"], make(), clock=time.thread_time)
        reps = max(reps, min(40, int(0.25 / max(t_plain, 1e-4))))
    names = list(variants)
    for rep in range(reps):
        # Interleaved, so that drifts hit all alike, and in an order rotated
        # every repetition: a trace measured right after refs + discharge
        # (the largest heap churn) is about 20% slower, so no variant is
        # always the one that follows it.
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            program = make()
            t, _ = timed(variants[name], program, clock=time.thread_time)
            best[name] = min(best[name], t)
    return best


def _uncurry_vs_jit(make: Callable[[], dict], reps: int) -> float:
    ratios = []
    for _ in range(reps):
        p = make()
        t_jit, _ = timed(lambda: jax.block_until_ready(jax.jit(_fresh(p["plain"]))(*p["args"])))
        p = make()
        t_unc, _ = timed(lambda: jax.block_until_ready(tx.uncurry(_fresh(p["taxpr"]), *p["args"])))
        ratios.append(t_unc / t_jit)
    return min(ratios)


def run(quick: bool = False) -> dict:
    """Returns ``{"trace": {program: {variant: ratio}}, "uncurry": {...}, "figures"}``."""
    scale = 20 if quick else 1
    reps = 1 if quick else 5
    programs = {
        "rnn_scan": lambda: rnn_scan(2000 // scale),
        "layers_scan": lambda: layers_scan(500 // scale),
        "rnn_unrolled": lambda: rnn_unrolled(1000 // scale),
        # The same programs with the state starting at the input h0, as the
        # plain and refs versions do (no init to evaluate at trace time).
        "rnn_scan, input init": lambda: rnn_scan(2000 // scale, const_init=False),
        "layers_scan, input init": lambda: layers_scan(500 // scale, const_init=False),
        "rnn_unrolled, input init": lambda: rnn_unrolled(1000 // scale, const_init=False),
        # The same programs with zeros as initial state in every version:
        # plain and refs make them in the trace, taxpr's callable init.
        "rnn_scan, zeros init everywhere": lambda: rnn_scan(2000 // scale, zeros_everywhere=True),
        "layers_scan, zeros init everywhere": lambda: layers_scan(
            500 // scale, zeros_everywhere=True),
        "rnn_unrolled, zeros init everywhere": lambda: rnn_unrolled(
            1000 // scale, zeros_everywhere=True),
    }
    out: dict = {"trace": {}, "uncurry": {}, "figures": []}
    for name, make in programs.items():
        times = _trace_times(make, reps, more_if_cheap=not quick)
        ratios = {k: v / times["plain"] for k, v in times.items() if k != "plain"}
        out["trace"][name] = {**ratios, "plain_s": times["plain"]}
        for variant in ("refs", "refs + discharge", "taxpr tags only", "taxpr"):
            target = ratios["refs + discharge"] if variant == "taxpr" else None
            out["figures"].append({
                "name": f"trace {name}: {variant} / plain", "value": ratios[variant],
                "target": None if target is None else f"<= {target:.2f} (refs + discharge)",
                "pass": None if target is None else ratios[variant] <= target})
    unc = {
        "rnn_scan, input init": (lambda: rnn_scan(2000 // scale, const_init=False), 1.25),
        "layers_scan, input init": (lambda: layers_scan(500 // scale, const_init=False), 1.25),
        "rnn_scan, constant init": (lambda: rnn_scan(2000 // scale), 1.05),
        "layers_scan, constant init": (lambda: layers_scan(500 // scale), 1.05),
    }
    for name, (make, target) in unc.items():
        ratio = _uncurry_vs_jit(make, reps)
        out["uncurry"][name] = ratio
        out["figures"].append({"name": f"uncurry / first jit call: {name}", "value": ratio,
                               "target": f"<= {target}", "pass": ratio <= target})
    return out


if __name__ == "__main__":
    res = run(quick="--quick" in sys.argv)
    for f in res["figures"]:
        print(f"{f['name']:55s} {f['value']:.3f}  {f['target'] or ''}")

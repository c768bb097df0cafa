"""What each progress tool shows on the same compiled loops.

Each case is a program written once in plain JAX (a scan, a ``fori_loop``,
a ``while_loop``, ``vmap`` and ``grad`` of the scan, nested scans, a
diffrax solve, a warm second call), run with:

* ``tx.progress``, wrapped around the unmodified program;
* jax-tqdm, as its docs show: ``@scan_tqdm(n)`` / ``@loop_tqdm(n)`` on each
  step function (and, under ``vmap``, also its ``PBar`` ids);
* brainstate's ``ProgressBar``: the loops written with
  ``brainstate.transform.scan`` / ``for_loop`` and ``pbar=ProgressBar()``;
* jax-tap: ``with tap.record(on_step=..., select=lambda _: ())`` around the
  call of the unmodified program. It draws no bar (a caller builds one from
  its step events), so its cells describe the events.

A program takes the loop functions as ``loops`` (``jax.lax`` unless a tool
needs the loop itself edited); the diffrax solve takes none, its loop being
inside the library.

How the cells are observed:

* ``tx.progress``: a ``display=`` that records ``start``, ``update`` and
  ``close``, read after ``jax.effects_barrier()``;
* jax-tqdm and brainstate: the ``tqdm`` class they create bars from is
  replaced by one that records each bar's total and final count (jax-tqdm
  reads ``jax_tqdm.base.tqdm.<type>.tqdm`` when a step function is
  decorated; brainstate imports ``tqdm.auto.tqdm`` when a bar starts);
* jax-tap: the ``TapEvent`` objects given to ``on_step``: a stream is a run
  of steps of one loop path, its count the last step + 1, its total the
  event's ``total``.

Where a tool has no entry point for a case (a ``while_loop`` of unknown
length), the cell says which is missing; this is read from the installed
package (its public names, its function's signature), so a release that
adds one fails here instead of leaving the cell stale. Every run's outputs
are checked against the un-instrumented program's (``assert_allclose``): a
cell says **wrong result** where they differ.

Run: ``python bench/progress_tools.py`` (needs ``pip install -e
'.[peers,ecosystem]'``); writes ``bench/results_progress_tools.json``, from
which the Watching page's table (``docs/make_plots.py``'s
``progress_tools_table``, marker ``progress-tools-table``) is made.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import json
import platform
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import taxpr as tx

RESULTS = Path(__file__).resolve().parent / "results_progress_tools.json"
N = 1000


# -- The programs, each written once. ---------------------------------------

def scan_program(x, loops=lax):
    def step(c, i):
        return c * 0.999 + jnp.sin(i) * 0.001, c
    return loops.scan(step, x, jnp.arange(N))


def fori_program(x, loops=lax):
    return loops.fori_loop(0, N, lambda i, c: c * 0.999 + jnp.sin(i) * 0.001, x)


def while_program(x, loops=lax):
    # Runs until the value decays below 1e-3 (688 iterations from 1.0): a
    # length the program finds out as it runs.
    return loops.while_loop(lambda s: s[1] > 1e-3, lambda s: (s[0] + 1, s[1] * 0.99), (0, x))


def vmap_program(xs, loops=lax):
    return jax.vmap(lambda x: scan_program(x, loops))(xs)


def nested_program(x, loops=lax):
    def outer(c, i):
        return loops.scan(lambda d, j: (d * 1.01 + j, None), c, jnp.arange(4))[0] + i, None
    return loops.scan(outer, x, jnp.arange(3))[0]


def diffrax_program(y0):
    import diffrax
    return diffrax.diffeqsolve(diffrax.ODETerm(lambda t, y, a: -y), diffrax.Tsit5(), 0.0, 3.0,
                               0.1, y0,
                               stepsize_controller=diffrax.PIDController(1e-5, 1e-5)).ys


def grad_program(x, loops=lax):
    return jax.grad(lambda x: scan_program(x, loops)[1].sum())(x)


# name -> (program, its argument, whether the cell is the second call's)
CASES = {
    f"`lax.scan`, {N} steps": (scan_program, jnp.float32(1.0), False),
    f"`lax.fori_loop`, {N} steps": (fori_program, jnp.float32(1.0), False),
    "`lax.while_loop`, length not known": (while_program, jnp.float32(1.0), False),
    "`vmap` of the scan, batch of 8": (vmap_program, jnp.linspace(0.5, 1.5, 8), False),
    "nested scans, 3 x 4": (nested_program, jnp.float32(1.0), False),
    "diffrax solve (library code)": (diffrax_program, jnp.ones(3), False),
    "`grad` of the scan": (grad_program, jnp.float32(1.0), False),
    "warm second call of the jitted scan": (scan_program, jnp.float32(1.0), True),
}


# -- Observing what each tool shows. -----------------------------------------

class NoEntryPoint(Exception):
    """The tool offers nothing to apply to this loop."""


class Bar:
    """Stands in for ``tqdm.tqdm``: keeps each bar's total and count."""

    made: list[Bar] = []

    def __init__(self, iterable=None, total=None, desc=None, **kwargs):
        self.total = total if total is not None or iterable is None else len(iterable)
        self.label, self.n, self.closed = desc, 0, False
        Bar.made.append(self)

    def update(self, n=1):
        self.n += n

    def set_description(self, desc=None, refresh=True):
        self.label = desc if self.label is None else self.label

    def clear(self):
        pass

    def close(self):
        self.closed = True


class Display:
    """A ``tx.progress`` display that keeps the bars it is told of."""

    def __init__(self):
        self.bars: list[list] = []
        self.open: dict[str, list] = {}

    def start(self, loop):
        self.open[loop.name] = [loop.name, loop.total, 0, False]
        self.bars.append(self.open[loop.name])

    def update(self, loop, n):
        self.open[loop.name][2] = n

    def close(self, loop, n):
        self.open[loop.name][2:] = [n, True]


def _describe(bars, noun: str, labelled: bool = False) -> str:
    """``bars``: ``(label, total, count, closed)``, in the order they
    started; those of the same total (and label, where ``labelled``) are
    one group."""
    if not bars:
        return f"no {noun}"
    groups: dict[tuple, list] = {}
    for label, total, n, closed in bars:
        groups.setdefault((label if labelled else None, total), []).append((n, closed))
    parts = []
    for (label, total), runs in groups.items():
        counts = sorted({n for n, _ in runs})
        count = str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
        what = f"to {count}/{total}" if total is not None else f"counting to {count}"
        text = f"{noun} {what}" if len(runs) == 1 else f"{len(runs)} {noun}s {what}"
        if not all(closed for _, closed in runs):
            text += " (left open)"
        parts.append(f"`{label}`: {text}" if labelled and len(groups) > 1 else text)
    return " + ".join(parts)


def _annotated(case: str, bars, text: str, backward: bool | None = None) -> str:
    """What the count of bars means for the case; under ``grad``,
    ``backward``: whether the backward (reversed) loop calls the host."""
    if case.startswith("`vmap`") and bars:
        return text + (" (one for the batch)" if len(bars) == 1
                       else " (one per example)" if len(bars) == 8 else "")
    if case.startswith("`grad`") and bars:
        return text + (" (forward; none for the backward loop)" if backward is False
                       else " (forward and backward)" if backward and len(bars) == 2 else "")
    if case.startswith("warm"):
        return text.replace("no ", "no new ") if not bars else "new " + text
    return text


def _calls_back_backward(closed) -> bool:
    """Whether a host callback is inside a reversed scan (the backward loop
    of ``grad``) of the traced program."""
    def jaxprs(params):
        for v in params.values():
            for item in v if isinstance(v, (tuple, list)) else (v,):
                if hasattr(item, "eqns"):
                    yield item
                elif hasattr(getattr(item, "jaxpr", None), "eqns"):
                    yield item.jaxpr

    def walk(jaxpr, reversed_):
        for eqn in jaxpr.eqns:
            if reversed_ and "callback" in eqn.primitive.name:
                return True
            inner = reversed_ or (eqn.primitive.name == "scan" and eqn.params["reverse"])
            if any(walk(sub, inner) for sub in jaxprs(eqn.params)):
                return True
        return False
    return walk(closed.jaxpr, False)


def _check(out, program, arg) -> bool:
    expected = jax.jit(program)(arg)
    try:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                             rtol=1e-6), out, expected)
    except AssertionError:
        return False
    return True


def _error(e: Exception) -> str:
    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"no: {type(e).__name__}: {message[:80]}"


# -- The tools. --------------------------------------------------------------

def run_taxpr(case, program, arg, warm) -> str:
    display = Display()
    # Nested bars are asked for (by default the outermost loops show).
    nested = case.startswith("nested")
    f = jax.jit(tx.progress(program, display=display, nested=nested))
    out = jax.block_until_ready(f(arg))
    jax.effects_barrier()
    if warm:
        display.bars.clear()
        out = jax.block_until_ready(f(arg))
        jax.effects_barrier()
    if not _check(out, program, arg):
        return "**wrong result**"
    text = _annotated(case, display.bars, _describe(display.bars, "bar"),
                      backward=any("reverse" in bar[0] for bar in display.bars))
    if case.startswith("`grad`"):
        # Also the bar differentiated from outside: grad(progress(f)).
        inside = Display()
        g = jax.jit(jax.grad(tx.progress(lambda x: scan_program(x)[1].sum(), display=inside)))
        out = jax.block_until_ready(g(arg))
        jax.effects_barrier()
        text += "; `grad(tx.progress(f))`: " + (
            "**wrong result**" if not _check(out, program, arg)
            else _annotated(case, inside.bars, _describe(inside.bars, "bar"),
                            backward=any("reverse" in bar[0] for bar in inside.bars)))
    return text + (" (`nested=True`)" if nested else "")


@contextlib.contextmanager
def _bars_recorded(module, attribute, replacement):
    saved = getattr(module, attribute)
    setattr(module, attribute, replacement)
    Bar.made.clear()
    try:
        yield Bar.made
    finally:
        jax.effects_barrier()
        setattr(module, attribute, saved)


def _run_with_loops(case, program, arg, warm, loops, recorded, needs: str) -> str:
    if "loops" not in inspect.signature(program).parameters:
        # The loop is inside the library: run it as it is, to show no bar.
        with recorded() as bars:
            out = jax.block_until_ready(jax.jit(program)(arg))
        if not _check(out, program, arg):
            return "**wrong result**"
        return f"{_describe([], 'bar')}: {needs}" if not bars else _describe(
            [(b.label, b.total, b.n, b.closed) for b in bars], "bar")
    try:
        with recorded() as bars:
            f = jax.jit(lambda x: program(x, loops))
            out = jax.block_until_ready(f(arg))
            if warm:
                jax.effects_barrier()
                bars.clear()
                out = jax.block_until_ready(f(arg))
            backward = _calls_back_backward(jax.make_jaxpr(f)(arg))
    except NoEntryPoint as e:
        return f"no: {e}"
    except Exception as e:  # noqa: BLE001 - what the tool raises is the measurement
        return _error(e)
    if not _check(out, program, arg):
        return "**wrong result**"
    found = [(b.label, b.total, b.n, b.closed) for b in bars]
    return _annotated(case, found, _describe(found, "bar"), backward)


def _jax_tqdm_loops():
    import jax_tqdm

    class Loops:
        @staticmethod
        def scan(step, init, xs):
            return lax.scan(jax_tqdm.scan_tqdm(len(xs))(step), init, xs)

        @staticmethod
        def fori_loop(lower, upper, body, init):
            return lax.fori_loop(lower, upper, jax_tqdm.loop_tqdm(upper - lower)(body), init)

        @staticmethod
        def while_loop(cond, body, init):
            public = [n for n in dir(jax_tqdm) if not n.startswith("_")]
            if any("while" in n.lower() for n in public):
                raise RuntimeError("jax-tqdm now has a while-loop decorator: use it here")
            need_n = all("n" in inspect.signature(getattr(jax_tqdm, d)).parameters
                         for d in ("scan_tqdm", "loop_tqdm"))
            raise NoEntryPoint("`scan_tqdm(n)` and `loop_tqdm(n)` need the length"
                               if need_n else "no while-loop decorator")

    return Loops


def run_jax_tqdm(case, program, arg, warm) -> str:
    import jax_tqdm
    import jax_tqdm.base

    # build_tqdm reads getattr(tqdm, tqdm_type).tqdm from its module's tqdm
    kinds = types.SimpleNamespace(tqdm=Bar)
    recorded = lambda: _bars_recorded(jax_tqdm.base, "tqdm", types.SimpleNamespace(  # noqa: E731
        auto=kinds, std=kinds, notebook=kinds))
    cell = _run_with_loops(case, program, arg, warm, _jax_tqdm_loops(), recorded,
                           "needs the loop body edited (a decorator on the step function)")
    if case.startswith("`vmap`"):
        # The docs' way to a bar per example: the carry wrapped in PBar(id=i).
        def per_example(xs):
            @jax_tqdm.scan_tqdm(N)
            def step(c, i):
                return c * 0.999 + jnp.sin(i) * 0.001, c

            def one(x, i):
                c, ys = lax.scan(step, jax_tqdm.PBar(id=i, carry=x), jnp.arange(N))
                return c.carry, ys
            return jax.vmap(one)(xs, jnp.arange(xs.shape[0]))
        with recorded() as bars:
            out = jax.block_until_ready(jax.jit(per_example)(arg))
        found = [(b.label, b.total, b.n, b.closed) for b in bars]
        pbar = ("**wrong result**" if not _check(out, program, arg)
                else _annotated(case, found, _describe(found, "bar")))
        cell += f"; with `PBar` ids: {pbar}"
    return cell


def run_brainstate(case, program, arg, warm) -> str:
    import brainstate
    import tqdm.auto

    bt = brainstate.transform

    class Loops:
        @staticmethod
        def scan(step, init, xs):
            return bt.scan(step, init, xs, pbar=bt.ProgressBar())

        @staticmethod
        def fori_loop(lower, upper, body, init):
            state = brainstate.State(init)

            def each(i):
                state.value = body(i, state.value)
            bt.for_loop(each, jnp.arange(lower, upper), pbar=bt.ProgressBar())
            return state.value

        @staticmethod
        def while_loop(cond, body, init):
            if "pbar" in inspect.signature(bt.while_loop).parameters:
                raise RuntimeError("brainstate's while_loop now takes pbar: use it here")
            raise NoEntryPoint("`brainstate.transform.while_loop` takes no `pbar`")

    # ProgressBarRunner imports tqdm.auto.tqdm when a bar starts.
    return _run_with_loops(case, program, arg, warm, Loops,
                           lambda: _bars_recorded(tqdm.auto, "tqdm", Bar),
                           "needs the loop rewritten with brainstate's `scan` / `for_loop`")


def run_jax_tap(case, program, arg, warm) -> str:
    import jaxtap as tap

    events: list = []
    # A function of its own: jit's cache of `program`, traced untapped by
    # the other tools' runs, would be reused (jax-tap taps when it traces).
    f = jax.jit(lambda x: program(x))
    try:
        for _ in range(2 if warm else 1):
            events.clear()
            # The docs' progress idiom: only the step crosses to the host.
            with tap.record(on_step=events.append, select=lambda _: ()):
                out = jax.block_until_ready(f(arg))
                jax.effects_barrier()
                backward = _calls_back_backward(jax.make_jaxpr(lambda x: program(x))(arg))
    except Exception as e:  # noqa: BLE001 - what the tool raises is the measurement
        return _error(e)
    if not _check(out, program, arg):
        return "**wrong result**"
    streams, last = [], {}
    for e in events:
        step = int(np.max(np.asarray(e.step)))
        if e.path not in last or step <= last[e.path][2] - 1:
            last[e.path] = [e.path, e.total, 0, True]
            streams.append(last[e.path])
        last[e.path][2] = step + 1
    return _annotated(case, streams, _describe(streams, "event stream", labelled=True),
                      backward)


def _version(dist: str) -> str:
    return importlib.metadata.version(dist)


TOOLS = {
    "tx.progress": (run_taxpr, "`jax.jit(tx.progress(f))`, `f` unmodified"),
    f"jax-tqdm {_version('jax-tqdm')}": (
        run_jax_tqdm, "`@scan_tqdm(n)` / `@loop_tqdm(n)` on each step function"),
    f"brainstate {_version('brainstate')} `ProgressBar`": (
        run_brainstate, "loops written with `brainstate.transform.scan` / `for_loop`, "
                        "`pbar=ProgressBar()`"),
    f"jax-tap {_version('jax-tap')}": (
        run_jax_tap, "`with tap.record(on_step=...)` around the call, `f` unmodified; "
                     "draws no bar: the cells are its step events"),
}


def main() -> dict:
    rows = {}
    for case, (program, arg, warm) in CASES.items():
        rows[case] = {tool: run(case, program, arg, warm) for tool, (run, _) in TOOLS.items()}
        print(case, rows[case], flush=True)
    result = {"jax": jax.__version__, "python": platform.python_version(),
              "how": {tool: how for tool, (_, how) in TOOLS.items()}, "rows": rows}
    RESULTS.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    return result


if __name__ == "__main__":
    main()

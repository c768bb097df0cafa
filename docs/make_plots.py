"""Draw the performance page's plots from the committed benchmark results.

Reads ``bench/results.json`` (``python bench/run.py``), the results of the
same benchmarks on other JAX versions (``bench/results-jax-*.json``) and
``bench/peers/results.json`` (``python bench/peers/run_peers.py``); writes
SVG files into ``docs/plots/`` and the performance page's tables (through
``docs/hooks.py``). The plots are written into ``docs/plots/``, which is not tracked: the site build
(``mkdocs build``, through ``docs/hooks.py``) runs this script every time,
so the plots always show the results that are committed, and a new
benchmark run needs no separate step to update them.

Run alone: ``python docs/make_plots.py [--out DIR]`` (needs matplotlib, in
the ``docs`` extra). The functions that read the results (``*_series``) need
only the standard library; the test suite checks them against the
committed results (``tests/test_docs.py``).
"""

from __future__ import annotations

import argparse
import io
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results.json"
PEER_RESULTS = ROOT / "bench" / "peers" / "results.json"
PLOTS_DIR = Path(__file__).resolve().parent / "plots"

Series = dict[str, tuple[list[int], list[float]]]


def load_results(path: Path = RESULTS) -> dict:
    """The parsed JSON of ``bench/run.py``'s output file."""
    return json.loads(path.read_text())


def load_all_results(bench_dir: Path = RESULTS.parent) -> list[dict]:
    """``bench/results.json`` and then every ``bench/results-jax-*.json``
    (full runs of ``bench/run.py --out ...`` on other JAX versions), sorted
    by JAX version."""
    runs = [load_results(bench_dir / "results.json")]
    runs += [load_results(p) for p in bench_dir.glob("results-jax-*.json")]

    def version(run: dict) -> tuple:
        return tuple(int(n) if n.isdigit() else 0 for n in run["jax"].split("."))

    return sorted(runs, key=version)


def load_peer_results(path: Path = PEER_RESULTS) -> dict:
    """The parsed JSON of ``bench/peers/run_peers.py``'s output file."""
    return json.loads(path.read_text())


def _by_depth(seconds: dict[str, float]) -> tuple[list[int], list[float]]:
    depths = sorted(int(d) for d in seconds)
    return depths, [seconds[str(d)] * 1e3 for d in depths]


def nesting_series(results: dict) -> Series:
    """Milliseconds per nesting depth of each nested-``scan`` benchmark.

    Arguments:
        results: ``bench/results.json``.

    Returns:
        ``{label: (depths, milliseconds)}``; the harvest workloads (10 sows
        per level) share one program, so ``jax.make_jaxpr`` of it is the
        baseline; ``inject`` and the state ones use their own programs (10
        tags per level; one get/set per level).
    """
    benches = results["benches"]
    harvest = benches["bench_harvest"]["nested_scan"]
    inject = benches["bench_inject"]["nested_scan"]
    state = benches["bench_state"]["nested_scan"]
    return {
        "jax.make_jaxpr(f), no transformation": _by_depth(harvest["make_jaxpr_s"]),
        "make_jaxpr(reap(f))": _by_depth(harvest["reap_s"]),
        "jit(reap(f)).trace": _by_depth(harvest["jit_reap_s"]),
        "make_jaxpr(plant(f))": _by_depth(harvest["plant_s"]),
        "tx.inject (10 tags per level)": _by_depth(inject["inject_s"]),
        "tx.make_jaxpr (state, get/set per level)": _by_depth(state["make_jaxpr_s"]),
    }


def inject_ratio_series(results: dict, peers: dict) -> dict[str, dict[int, float]]:
    """``inject`` time / ``jax.make_jaxpr`` time on the straight-line
    workload, per number of tags.

    Returns:
        ``{label: {tags: ratio}}`` for taxpr (``bench/results.json``), and
        taxpr and taxpr 0.0.3 measured side by side by the peers run.
    """
    def per_tags(rows: list[dict]) -> dict[int, float]:
        return {int(r["tags"]): float(r["ratio"]) for r in rows}

    ours = peers["inject_straight"]["ours"]
    old = peers["inject_straight"]["tx003"]
    return {
        "taxpr (bench/results.json, wall clock)":
            per_tags(results["benches"]["bench_inject"]["straight"]),
        f"taxpr {ours['version']} (peers run, CPU time)": per_tags(ours["straight"]),
        f"taxpr {old['version']} (peers run, CPU time)": per_tags(old["straight"]),
    }


def trace_series(peers: dict) -> dict[str, dict[str, float]]:
    """Tracing a stateful RNN, each tool's time / plain ``make_jaxpr``.

    Returns:
        ``{program: {tool: ratio}}`` from the peers run (Haiku's ``apply``,
        its ``init``, the two together, and ``tx.make_jaxpr``).
    """
    out: dict[str, dict[str, float]] = {}
    for run in peers["trace_state"]:
        for row in run["results"]:
            tools = row["tools"]
            entry = {}
            if "haiku" in tools:
                hk = tools["haiku"]
                entry["Haiku make_jaxpr(apply)"] = hk["haiku_apply_ratio"]
                entry["Haiku make_jaxpr(init)"] = hk["haiku_init_ratio"]
                entry["Haiku apply + init"] = hk["haiku_apply_ratio"] + hk["haiku_init_ratio"]
            if "taxpr" in tools:
                entry["tx.make_jaxpr"] = tools["taxpr"]["taxpr_ratio"]
            out[row["program"]] = entry
    return out


def dispatch_series(results: dict) -> dict[str, dict[str, float]]:
    """Per-call dispatch time in microseconds of a jitted function with 20
    tags left in and without them, for ``jax.jit(f)`` and
    ``jax.jit(jax.grad(f))``."""
    d = results["benches"]["bench_dispatch"]
    return {
        "jax.jit(f)": {"tags": d["jit"]["tags_us"], "no tags": d["jit"]["plain_us"]},
        "jax.jit(jax.grad(f))": {"tags": d["jit_grad"]["tags_us"],
                                 "no tags": d["jit_grad"]["plain_us"]},
    }


_TARGET = re.compile(r"^\s*(<=|==)\s*([0-9.eE+-]+)\s*$")


def target_series(results: dict) -> list[tuple[str, float, str, float, bool]]:
    """Every figure of ``bench/results.json`` that has a numeric target.

    Returns:
        ``(name, value, comparison, bound, passed)`` per figure, comparison
        ``"<="`` or ``"=="``.
    """
    rows = []
    for fig in results["figures"]:
        match = _TARGET.match(fig.get("target") or "")
        if match:
            rows.append((fig["name"], float(fig["value"]), match.group(1),
                         float(match.group(2)), bool(fig["pass"])))
    return rows


def measured_on(results: dict) -> str:
    """Where and with what a results file was measured, as a phrase:
    ``"JAX 0.10.2, Python 3.11.7, 2-core x86_64 Linux machine, CPU backend"``."""
    kind = results.get("machine", {}).get("kind", "machine not recorded")
    return f"JAX {results['jax']}, Python {results['python']}, {kind}"


# The performance page's summary table: one row per headline figure, one
# column per results file. Each row is (label, cell template, figure-name
# prefixes): ``{}`` in the template takes the figures in order, formatted
# as ratios (two decimals); ``{counts}`` takes the ``(a/b)`` instruction
# counts from the first figure's name. The target is the first figure's.
HEADLINE_ROWS: list[tuple[str, str, list[str]]] = [
    ("dispatch of `jax.jit(f)`, 20 tags left in / no tags", "{}",
     ["dispatch jit, 20 tags / none"]),
    ("dispatch of `jax.jit(jax.grad(f))`, tags left in / no tags", "{}",
     ["dispatch jit(grad), 20 tags / none"]),
    ("dispatch of `jax.jit(jax.value_and_grad)` of `uncurry`'s pure function, tags left in / "
     "no tags", "{}", ["dispatch jit(value_and_grad) of uncurry's pure, 20 tags / none"]),
    ("`inject` / `make_jaxpr`, 1,600 tags", "{}", ["inject/make_jaxpr, 1600 tags"]),
    ("`inject` / `make_jaxpr`, 10,000 tags", "{}", ["inject/make_jaxpr, 10000 tags"]),
    ("`inject`, nested scans, time at depth 8 / depth 4", "{}", ["inject nested scan t8/t4"]),
    ("`uncurry`, nested scans, depth 8 / depth 4", "{}", ["uncurry nested scan t8/t4"]),
    ("`make_jaxpr(reap(f))`, nested scans, depth 8 / depth 4", "{}",
     ['make_jaxpr(reap(f, tag="t")) nested scan t8/t4']),
    ("`make_jaxpr(plant(f))`, nested scans, depth 8 / depth 4", "{}",
     ['make_jaxpr(plant(f, tag="t")) nested scan t8/t4']),
    ("peak memory of `inject` / of `make_jaxpr`, 100,000 equations", "{}",
     ["inject/make_jaxpr peak memory, 100000 eqns"]),
    ("RNN (state in raw `lax.scan`, 2,000 steps): HLO instructions, uncurry / hand-written",
     "{counts}", ["RNN scan 2000: HLO instructions"]),
    ("RNN: run time, uncurry / hand-written", "{}", ["RNN scan 2000: run time"]),
    ("RNN: compile time, uncurry / hand-written", "{}", ["RNN scan 2000: compile time"]),
    ("MLP with running statistics, SGD step: HLO instructions", "{counts}",
     ["MLP running stats SGD step: HLO instructions"]),
    ("MLP: run time", "{}", ["MLP running stats SGD step: run time"]),
    ("MLP: compile time", "{}", ["MLP running stats SGD step: compile time"]),
    ("RNN trained by truncated BPTT, gradients by `tx.value_and_grad` through the hidden "
     "state in a state (500 steps in 4 chunks): HLO instructions, uncurry / hand-written",
     "{counts}", ["RNN truncated BPTT, tx.value_and_grad, 500 steps: HLO instructions"]),
    ("truncated BPTT: run time", "{}", ["RNN truncated BPTT, tx.value_and_grad, 500 steps: run time"]),
    ("truncated BPTT: compile time", "{}",
     ["RNN truncated BPTT, tx.value_and_grad, 500 steps: compile time"]),
    ("dropout MLP (`tx.next_key`), SGD step: HLO instructions, uncurry / keys threaded by hand",
     "{counts}", ["dropout MLP 6 layers SGD step: HLO instructions"]),
    ("dropout MLP: run time, forward and SGD step", "{}, {}",
     ["dropout MLP 6 layers forward: run time", "dropout MLP 6 layers SGD step: run time"]),
    ("trace of an RNN in `lax.scan` (2,000 steps): `tx.make_jaxpr_with_states` / plain, "
     "vs JAX refs + discharge / plain", "{} vs {}",
     ["trace rnn_scan: taxpr / plain", "trace rnn_scan: refs + discharge / plain"]),
    ("trace, 8 layers of state in one `lax.scan` (500 steps)", "{} vs {}",
     ["trace layers_scan: taxpr / plain", "trace layers_scan: refs + discharge / plain"]),
    ("trace, RNN unrolled in Python (1,000 steps)", "{} vs {}",
     ["trace rnn_unrolled: taxpr / plain", "trace rnn_unrolled: refs + discharge / plain"]),
    ("trace, the same three as written, before the state pass: taxpr tags only / plain, "
     "vs JAX refs alone / plain", "{}, {}, {} vs {}, {}, {}",
     [f"trace {p}: {w} / plain" for w in ("taxpr tags only", "refs")
      for p in ("rnn_scan", "layers_scan", "rnn_unrolled")]),
    ("trace, the same three with the state starting at an input (as refs do)",
     "{}, {}, {} vs {}, {}, {}",
     [f"trace {p}, input init: {w} / plain" for w in ("taxpr", "refs + discharge")
      for p in ("rnn_scan", "layers_scan", "rnn_unrolled")]),
    ("trace, the same three starting at zeros in every version", "{}, {}, {} vs {}, {}, {}",
     [f"trace {p}, zeros init everywhere: {w} / plain" for w in ("taxpr", "refs + discharge")
      for p in ("rnn_scan", "layers_scan", "rnn_unrolled")]),
    ("`uncurry` / first `jax.jit` call, the two scan programs, init from an input", "{}, {}",
     ["uncurry / first jit call: rnn_scan, input init",
      "uncurry / first jit call: layers_scan, input init"]),
    ("`uncurry` / first `jax.jit` call, constant inits", "{}, {}",
     ["uncurry / first jit call: rnn_scan, constant init",
      "uncurry / first jit call: layers_scan, constant init"]),
    ("`taxpr.ir.optimize_jaxpr` / `make_jaxpr`, 10,000 equations", "{}",
     ["optimize_jaxpr/make_jaxpr at 10000 eqns"]),
    ("`optimize_jaxpr`, time per doubling of the program, up to 40,000", "{}",
     ["optimize_jaxpr time per doubling"]),
    ("`taxpr.ir.to_dot` / `make_jaxpr`, 10,000 equations", "{}",
     ["to_dot/make_jaxpr at 10000 eqns"]),
]

_COUNTS = re.compile(r"\((\d+)/(\d+)\)")


def find_figure(results: dict, prefix: str) -> dict:
    """The one figure of ``results`` whose name starts with ``prefix``."""
    found = [f for f in results["figures"] if f["name"].startswith(prefix)]
    if len(found) != 1:
        raise KeyError(f"{len(found)} figures of JAX {results['jax']}'s results start "
                       f"with {prefix!r}")
    return found[0]


def _cell(results: dict, template: str, prefixes: list[str]) -> str:
    figures = [find_figure(results, p) for p in prefixes]
    if template == "{counts}":
        a, b = _COUNTS.search(figures[0]["name"]).groups()
        return f"{int(a):,} / {int(b):,}"
    return template.format(*(f"{f['value']:.2f}" for f in figures))


def _target(figure: dict) -> str:
    target = figure.get("target") or "(none)"
    if target.replace(" ", "") == "==1.0":
        return "equal"
    # "<= 1.60 (refs + discharge)": the bound is the other measurement.
    return re.sub(r"^<=\s*[0-9.]+\s*\((.*)\)$", r"<= \1", target)


def headline_table(runs: list[dict]) -> str:
    """The summary table (``HEADLINE_ROWS``) as Markdown: one column per
    results file, each headed by its JAX and Python versions, then the
    target; a line under it names the machine of each run."""
    heads = [f"JAX {r['jax']} (Python {r['python'].rsplit('.', 1)[0]})" for r in runs]
    lines = ["| figure | " + " | ".join(heads) + " | target |",
             "|---|" + "---|" * len(runs) + "---|"]
    for label, template, prefixes in HEADLINE_ROWS:
        cells = [_cell(r, template, prefixes) for r in runs]
        target = _target(find_figure(runs[0], prefixes[0]))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {target} |")
    lines.append("")
    lines.append("Measured on: " + "; ".join(measured_on(r) for r in runs) + ".")
    return "\n".join(lines) + "\n"


def dispatch_table(runs: list[dict]) -> str:
    """Per-call dispatch time with tags left in and without, per run."""
    heads = [f"JAX {r['jax']} (Python {r['python'].rsplit('.', 1)[0]})" for r in runs]
    lines = ["| jitted function | " + " | ".join(heads) + " |",
             "|---|" + "---|" * len(runs)]
    for label, key in (("`jax.jit(f)`", "jit"), ("`jax.jit(jax.grad(f))`", "jit_grad"),
                       ("`jax.jit(jax.value_and_grad)` of `uncurry`'s pure function",
                        "uncurry_jit_grad")):
        cells = []
        for r in runs:
            d = r["benches"]["bench_dispatch"].get(key)
            cells.append("not measured in this run" if d is None else
                         f"{d['tags_us']:.1f} us / {d['plain_us']:.1f} us = "
                         f"**{d['ratio']:.2f}x**")
        lines.append(f"| {label}, tags / no tags | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Measured on: " + "; ".join(measured_on(r) for r in runs) + ".")
    return "\n".join(lines) + "\n"


STATES_RESULTS = RESULTS.parent / "results_states.json"


def states_table(path: Path = STATES_RESULTS) -> str:
    """``bench/states_scaling.py``'s runs: per number of effects and per
    program, taxpr's time over the hand-written program's and the growth
    of taxpr's time per doubling, one table per JAX version."""
    results = json.loads(Path(path).read_text())
    lines = []
    for version in sorted(results):
        run = results[version]
        programs = run["programs"]
        lines += [f"JAX {run['jax']} (Python {run['python']}, {run['machine']}): "
                  "taxpr / by hand (growth per doubling)", "",
                  "| n | " + " | ".join(f"`{p}`" for p in programs) + " |",
                  "|---|" + "---|" * len(programs)]
        for i, first in enumerate(next(iter(programs.values()))):
            cells = []
            for rows in programs.values():
                row = rows[i]
                growth = f" ({row['growth']:.2f}x)" if "growth" in row else ""
                cells.append(f"{row['taxpr_s']:.2f} s / {row['hand_s']:.2f} s = "
                             f"**{row['ratio']:.1f}**{growth}")
            lines.append(f"| {first['n']:,} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


DEBUG_TOOLS_RESULTS = RESULTS.parent / "results_debug_tools.json"


def debug_tools_table(path: Path = DEBUG_TOOLS_RESULTS) -> str:
    """``bench/debug_tools.py``'s run: per program, what each NaN-debugging
    tool reported."""
    return _tools_table(json.loads(Path(path).read_text()), "bench/debug_tools.py")


PROGRESS_TOOLS_RESULTS = RESULTS.parent / "results_progress_tools.json"


def progress_tools_table(path: Path = PROGRESS_TOOLS_RESULTS) -> str:
    """``bench/progress_tools.py``'s run: how each progress tool was applied,
    then per program what it showed."""
    return _tools_table(json.loads(Path(path).read_text()), "bench/progress_tools.py")


def _tools_table(results: dict, script: str) -> str:
    """A run of tools on programs (``{"rows": {program: {tool: cell}}}``,
    and ``"how"``: each tool's way of being applied, when given) as a
    Markdown table, one column per tool."""
    rows, how = results["rows"], results.get("how")
    tools = list(how) if how else list(next(iter(rows.values())))
    lines = ["| program | " + " | ".join(tools) + " |", "|---|" + "---|" * len(tools)]
    if how:
        lines.append("| *applied as* | " + " | ".join(how[t] for t in tools) + " |")
    for case, cells in rows.items():
        lines.append(f"| {case} | " + " | ".join(cells[t] for t in tools) + " |")
    lines.append("")
    lines.append(f"Measured with Python {results['python']}, JAX {results['jax']} "
                 f"(`python {script}`).")
    return "\n".join(lines) + "\n"


VIEW_RESULTS = RESULTS.parent / "results_view.json"


def view_table(path: Path = VIEW_RESULTS) -> str:
    """``bench/bench_view.py``'s run: per program size, generating the
    viewer's page as a ratio to ``jax.make_jaxpr``, the page's size, and the
    page in headless Chromium (load, search, opening the last equation)."""
    results = json.loads(Path(path).read_text())
    lines = ["| equations | `ir.view` / `jax.make_jaxpr` | page | loaded in Chromium | "
             "search | opening the last equation |", "|---|---|---|---|---|---|"]
    for row in results["rows"]:
        page = ("| — | — | — |" if "load_ms" not in row else
                f"| {row['load_ms']:.0f} ms | {row['search_ms']:.0f} ms | "
                f"{row['reveal_ms']:.0f} ms |")
        lines.append(f"| {row['eqns']:,} | **{row['ratio']:.2f}** "
                     f"({row['view_s']:.2f} s / {row['make_jaxpr_s']:.2f} s) | "
                     f"{row['html_mb']:.1f} MB {page}")
    lines.append("")
    lines.append(f"Generating: thread CPU time, best of {results['repeats']} runs; in the "
                 f"browser: median of {results['repeats']} loads. Python {results['python']}, "
                 f"JAX {results['jax']}, {results['browser']}, {results['machine']} "
                 f"(`python bench/bench_view.py`).")
    return "\n".join(lines) + "\n"


COMING_FROM_RESULTS = RESULTS.parent / "results_coming_from.json"


def coming_from_table(path: Path = COMING_FROM_RESULTS) -> str:
    """``bench/coming_from.py``'s run: a brainstate LIF simulation and its
    taxpr port, warm-call times and their ratio per population size."""
    results = json.loads(Path(path).read_text())
    lines = ["| neurons | steps | brainstate (ms) | taxpr (ms) | taxpr / brainstate |",
             "|---|---|---|---|---|"]
    for row in results["rows"]:
        lines.append(f"| {row['neurons']} | {row['steps']} | {row['brainstate_ms']:.3g} | "
                     f"{row['taxpr_ms']:.3g} | {row['ratio']:.2f} |")
    lines.append("")
    lines.append(f"Median of {results['repeats']} interleaved warm calls, brainstate "
                 f"{results['brainstate']}, Python {results['python']}, JAX {results['jax']}, "
                 f"{results['backend'].upper()} backend, {results['machine']} "
                 f"(`python bench/coming_from.py`).")
    return "\n".join(lines) + "\n"


GPU_RESULTS = RESULTS.parent / "results-gpu.json"


def gpu_table(results: dict) -> str:
    """The GPU run (``bench/results-gpu.json``): its figures, the device they
    were measured on and the outcome of the test suite on the same machine."""
    device = results["machine"]["device"]
    lines = [f"Measured on one {device} with {measured_on(results)}.", "",
             "| benchmark | figure | value | target | met |", "|---|---|---|---|---|"]
    for fig in results["figures"]:
        met = {True: "yes", False: "**no**", None: ""}[fig.get("pass")]
        lines.append(f"| `{fig['bench']}` | {fig['name']} | {fig['value']:.3g} | "
                     f"{fig.get('target') or ''} | {met} |")
    t = results["tests"]
    failed = "".join(f" `{i}`" for i in t["failed_ids"])
    lines += ["", f"The test suite on the same machine (`{t['command']}`): "
                  f"{t['passed']} passed, {t['failed'] + t['errors']} failed{failed}, "
                  f"{t['skipped']} skipped, {t['xfailed']} expected failures, "
                  f"in {t['seconds']:.0f} s."]
    return "\n".join(lines) + "\n"


def figures_table(results: dict) -> str:
    """A Markdown table of every figure in ``bench/results.json``."""
    lines = [f"Measured with {measured_on(results)} "
             f"({'quick run' if results.get('quick') else 'full run'}).", "",
             "| benchmark | figure | value | target | met |", "|---|---|---|---|---|"]
    for fig in results["figures"]:
        met = {True: "yes", False: "**no**", None: ""}[fig.get("pass")]
        name = fig["name"].replace("|", "\\|")
        lines.append(f"| `{fig['bench']}` | {name} | {fig['value']:.3g} | "
                     f"{fig.get('target') or ''} | {met} |")
    return "\n".join(lines) + "\n"


# ---- drawing (matplotlib) ----------------------------------------------------------

def _figure(width: float = 7.0, height: float = 4.2):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Reproducible SVG (fixed ids, no date), so an unchanged plot is an
    # unchanged file and `mkdocs serve` does not rebuild in a loop.
    plt.rcParams["svg.hashsalt"] = "taxpr-docs"
    plt.rcParams["font.size"] = 10
    return plt.subplots(figsize=(width, height))


def _svg(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    plt.close(fig)
    return buf.getvalue()


def plot_nesting(results: dict) -> bytes:
    """Cost vs nesting depth, log scale, with a doubling-per-level guide."""
    series = nesting_series(results)
    fig, ax = _figure()
    for label, (depths, ms) in series.items():
        ax.plot(depths, ms, marker="o", label=label)
    depths, ms = series["make_jaxpr(reap(f))"]
    ax.plot(depths, [ms[0] * 2 ** (d - depths[0]) for d in depths], "k--", linewidth=1,
            label="x2 per level (exponential; not measured)")
    ax.set_yscale("log")
    ax.set_xlabel("nesting depth (lax.scan inside lax.scan, length 2)")
    ax.set_ylabel("time per call (ms, log scale)")
    ax.set_title(f"Cost vs nesting depth (JAX {results['jax']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _svg(fig)


def _grouped_bars(ax, groups: list[str], bars: dict[str, list[float]], fmt: str) -> None:
    width = 0.8 / max(len(bars), 1)
    for i, (label, values) in enumerate(bars.items()):
        xs = [g + (i - (len(bars) - 1) / 2) * width for g in range(len(groups))]
        rects = ax.bar(xs, values, width, label=label)
        ax.bar_label(rects, [fmt.format(v) for v in values], fontsize=7, padding=2)
    ax.set_xticks(range(len(groups)), groups)


def plot_inject_ratio(results: dict, peers: dict) -> bytes:
    """inject / make_jaxpr per number of tags, taxpr vs taxpr 0.0.3."""
    series = inject_ratio_series(results, peers)
    tags = sorted({t for per in series.values() for t in per})
    fig, ax = _figure()
    _grouped_bars(ax, [f"{t:,} tags" for t in tags],
                  {label: [per.get(t, float("nan")) for t in tags]
                   for label, per in series.items()}, "{:.2f}")
    ax.axhline(0.25, color="k", linestyle="--", linewidth=1, label="target: <= 0.25")
    ax.set_yscale("log")
    ax.set_ylabel("inject time / jax.make_jaxpr time (log scale)")
    ax.set_title("inject on a straight-line program: cost relative to tracing it")
    ax.legend(fontsize=8)
    return _svg(fig)


def plot_trace_time(peers: dict) -> bytes:
    """Tracing a stateful RNN: Haiku vs taxpr, relative to plain make_jaxpr."""
    series = trace_series(peers)
    programs = list(series)
    tools = [t for t in ("Haiku make_jaxpr(apply)", "Haiku make_jaxpr(init)",
                         "Haiku apply + init", "tx.make_jaxpr")
             if any(t in series[p] for p in programs)]
    fig, ax = _figure()
    _grouped_bars(ax, programs, {t: [series[p].get(t, float("nan")) for p in programs]
                                 for t in tools}, "{:.2f}")
    ax.axhline(1.0, color="k", linewidth=1, label="plain jax.make_jaxpr = 1")
    ax.set_ylabel("trace time / plain jax.make_jaxpr")
    ax.set_title("Tracing a stateful RNN (same program, same process)")
    ax.legend(fontsize=8)
    return _svg(fig)


def plot_dispatch(results: dict) -> bytes:
    """Per-call dispatch time with 20 tags left in vs without."""
    series = dispatch_series(results)
    fig, ax = _figure(6.0, 3.6)
    _grouped_bars(ax, list(series), {kind: [series[g][kind] for g in series]
                                     for kind in ("no tags", "tags")}, "{:.1f} us")
    ax.set_ylabel("time per call (microseconds)")
    ax.set_title(f"Dispatch of a jitted function, 20 tags (JAX {results['jax']})")
    ax.legend(fontsize=8)
    return _svg(fig)


def plot_targets(results: dict) -> bytes:
    """Every figure with a target, as measured / bound (<= 1 meets it)."""
    rows = target_series(results)
    fig, ax = _figure(9.0, 0.35 * len(rows) + 1.4)
    names = [name for name, *_ in rows]
    ratios = [value / bound for _, value, _, bound, _ in rows]
    colors = ["tab:green" if passed else "tab:red" for *_, passed in rows]
    ax.barh(range(len(rows)), ratios, color=colors)
    ax.axvline(1.0, color="k", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("measured / target bound (<= 1: target met)")
    ax.set_xlim(0, max(1.1, max(ratios) * 1.05))
    ax.set_title(f"Every figure with a target (JAX {results['jax']})")
    return _svg(fig)


def render_all(results: dict, peers: dict) -> dict[str, bytes]:
    """Every plot, as ``{file name: SVG bytes}``."""
    return {
        "nesting_depth.svg": plot_nesting(results),
        "inject_ratio.svg": plot_inject_ratio(results, peers),
        "trace_time.svg": plot_trace_time(peers),
        "dispatch.svg": plot_dispatch(results),
        "targets.svg": plot_targets(results),
    }


def write_plots(out_dir: Path = PLOTS_DIR) -> list[Path]:
    """Write every plot into ``out_dir``; a file whose content is unchanged
    is not rewritten.

    Returns:
        The paths of the plots.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, svg in render_all(load_results(), load_peer_results()).items():
        path = out_dir / name
        if not path.exists() or path.read_bytes() != svg:
            path.write_bytes(svg)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PLOTS_DIR, help="output folder")
    args = parser.parse_args(argv)
    for path in write_plots(args.out):
        print(path)


if __name__ == "__main__":
    main()

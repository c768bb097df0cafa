"""Draw the performance page's plots from the committed benchmark results.

Reads ``bench/results.json`` (``python bench/run.py``) and
``bench/peers/results.json`` (``python bench/peers/run_peers.py``) and writes
SVG files into ``docs/plots/``, which is not tracked: the site build
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


def figures_table(results: dict) -> str:
    """A Markdown table of every figure in ``bench/results.json``."""
    lines = [f"Measured with JAX {results['jax']} on Python {results['python']} "
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

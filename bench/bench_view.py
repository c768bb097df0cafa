"""The viewer (``taxpr.ir.view``) on large programs: generating the page,
as a ratio to ``jax.make_jaxpr`` of the same function, and the page in
headless Chromium: load time, search and opening a deep equation.

Programs: ``tests/view_programs.py``'s ``unrolled_program`` (blocks of
about ten equations in named scopes, with scans and jitted calls), at about
10,000 and 50,000 equations.

Times are thread CPU times, the best of three runs (one with ``--quick``,
at 1,000 equations and without the browser, as ``bench/run.py --quick``
runs it). Targets: the page in at most half ``make_jaxpr``'s time at 10,000
equations, loaded in Chromium within a second.

Run: ``python bench/bench_view.py [--quick]`` (needs Chromium for the
page's numbers: ``apt-get install chromium``); a full run writes
``bench/results_view.json``, from which the jaxpr toolchain page's table
(``docs/make_plots.py``'s ``view_table``, marker ``bench-view-table``) is
made.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402

from taxpr import ir  # noqa: E402

from headless_chromium import Browser, chromium  # noqa: E402
from view_programs import unrolled_program  # noqa: E402

from _common import timed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results_view.json"
SIZES = {10_000: 1_080, 50_000: 5_400}  # target equations -> blocks
QUICK_SIZES = {1_000: 108}
REPEATS = 3
RATIO_TARGET = 0.5  # ir.view / jax.make_jaxpr at 10,000 equations
LOAD_TARGET_MS = 1000  # the 10,000-equation page loaded in Chromium


def _best_time(fn, repeats: int) -> float:
    """The best of ``repeats`` calls' thread CPU times (the cyclic collector
    off during each, as for every taxpr benchmark: ``_common.timed``)."""
    return min(timed(fn, clock=time.thread_time)[0] for _ in range(repeats))


def _page_times(browser: Browser, path: Path, n_blocks: int) -> dict:
    """Median load (navigation to load event) and script-ready times, then
    a search and opening the program's last equation."""
    loads, ready = [], []
    for _ in range(REPEATS):
        loads.append(browser.open(path) * 1000)
        ready.append(browser.eval("window.taxprView.readyMs"))
    query = f"layer_{n_blocks - 1}/tanh"
    search_ms = browser.eval(f"""(() => {{ const t = performance.now();
        const n = window.taxprView.search({json.dumps(query)}).length;
        return [performance.now() - t, n]; }})()""")
    reveal_ms = browser.eval("""(() => { const p = window.taxprView.panes[0];
        const t = performance.now(); const el = p.reveal(p.E.length - 1);
        el.scrollIntoView(); return performance.now() - t; })()""")
    return {"load_ms": statistics.median(loads), "ready_ms": statistics.median(ready),
            "search_ms": search_ms[0], "search_hits": search_ms[1], "reveal_ms": reveal_ms}


def run(quick: bool = False) -> dict:
    """Measure every size (``QUICK_SIZES`` and no browser when ``quick``).

    Returns:
        ``rows`` (one per size: equations, times, ratio, page size and, with
        Chromium, the page's times), ``browser`` and ``figures`` (the ratio
        at the first size and, with Chromium, its page's load time).
    """
    rows = []
    sizes = QUICK_SIZES if quick else SIZES
    repeats = 1 if quick else REPEATS
    browser = None if quick or chromium() is None else Browser()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for blocks in sizes.values():
                f, args = unrolled_program(blocks)
                # A new function each time: JAX caches a function's trace.
                trace_s = _best_time(
                    lambda: jax.make_jaxpr(unrolled_program(blocks)[0])(*args), repeats)
                closed = jax.make_jaxpr(f)(*args)
                view_s = _best_time(lambda: ir.view(closed), repeats)
                page = ir.view(closed)
                n = len(page.data["panes"][0]["E"])
                row = {"eqns": n, "make_jaxpr_s": trace_s, "view_s": view_s,
                       "ratio": view_s / trace_s, "html_mb": len(page.html.encode()) / 1e6}
                if browser is not None:
                    path = Path(tmp) / f"view_{n}.html"
                    page.save(path)
                    row.update(_page_times(browser, path, blocks))
                rows.append(row)
    finally:
        if browser is not None:
            browser.close()
    first = rows[0]
    figures = [{"name": f"ir.view/make_jaxpr at {first['eqns']} eqns",
                "value": float(first["ratio"]), "target": f"<= {RATIO_TARGET}",
                "pass": bool(first["ratio"] <= RATIO_TARGET)}]
    if "load_ms" in first:
        figures.append({"name": f"page load in Chromium at {first['eqns']} eqns (ms)",
                        "value": float(first["load_ms"]), "target": f"<= {LOAD_TARGET_MS}",
                        "pass": bool(first["load_ms"] <= LOAD_TARGET_MS)})
    version = "no browser"
    if browser is not None:
        version = subprocess.run([chromium(), "--version"], capture_output=True,
                                 text=True).stdout.strip()
    return {"jax": jax.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()}, {platform.system()}", "browser": version,
            "repeats": repeats, "rows": rows, "figures": figures}


def main() -> None:
    result = run(quick="--quick" in sys.argv)
    for row in result["rows"]:
        print(json.dumps(row))
    if "--quick" not in sys.argv:
        RESULTS.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

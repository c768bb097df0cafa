"""The viewer (``taxpr.ir.view``) on large programs: generating the page,
as a ratio to ``jax.make_jaxpr`` of the same function, and the page in
headless Chromium: load time, search and opening a deep equation.

Programs: ``tests/view_programs.py``'s ``unrolled_program`` (blocks of
about ten equations in named scopes, with scans and jitted calls), at about
10,000 and 50,000 equations.

Run: ``python bench/bench_view.py`` (needs Chromium for the page's
numbers: ``apt-get install chromium``); writes ``bench/results_view.json``,
from which the jaxpr toolchain page's table (``docs/make_plots.py``'s
``view_table``, marker ``bench-view-table``) is made.
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

RESULTS = Path(__file__).resolve().parent / "results_view.json"
SIZES = {10_000: 1_080, 50_000: 5_400}  # target equations -> blocks
REPEATS = 3


def _median_time(fn, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _page_times(browser: Browser, path: Path, n_blocks: int) -> dict:
    """Median load (navigation to load event) and script-ready times, then
    a search and opening the last block's equation."""
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


def main() -> None:
    rows = []
    have_browser = chromium() is not None
    browser = Browser() if have_browser else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for target, blocks in SIZES.items():
                f, args = unrolled_program(blocks)
                # A new function each time: JAX caches a function's trace.
                trace_s = _median_time(
                    lambda: jax.make_jaxpr(unrolled_program(blocks)[0])(*args))
                closed = jax.make_jaxpr(f)(*args)
                view_s = _median_time(lambda: ir.view(closed))
                page = ir.view(closed)
                n = len(page.data["panes"][0]["E"])
                row = {"eqns": n, "make_jaxpr_s": trace_s, "view_s": view_s,
                       "ratio": view_s / trace_s, "html_mb": len(page.html.encode()) / 1e6}
                if browser is not None:
                    path = Path(tmp) / f"view_{n}.html"
                    page.save(path)
                    row.update(_page_times(browser, path, blocks))
                rows.append(row)
                print(json.dumps(row))
    finally:
        if browser is not None:
            browser.close()
    version = "none"
    if have_browser:
        version = subprocess.run([chromium(), "--version"], capture_output=True,
                                 text=True).stdout.strip()
    RESULTS.write_text(json.dumps({
        "jax": jax.__version__, "python": platform.python_version(),
        "machine": f"{platform.machine()}, {platform.system()}", "browser": version,
        "repeats": REPEATS, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

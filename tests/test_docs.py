"""The documentation site (docs/, mkdocs.yml) stays true.

* Every ```python block of every docs page runs: a page's blocks run in
  order in one namespace (a page reads as one script), each page in a
  fresh one. A page that needs an optional library names it at its top
  (`<!-- requires: flax -->`) and is skipped where it is missing.
* Every page is in the site's navigation, and every public name has an
  entry in the API reference.
* The performance plots' data (docs/make_plots.py) is read from the
  committed benchmark results: a change to their format fails here, not
  only in the docs build (which needs matplotlib).
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import pytest

import taxpr
from taxpr import harvest

from helpers import thread_rules_restored

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
# A page whose code needs an optional library says so in its first lines,
# `<!-- requires: flax -->` (several: `<!-- requires: flax, brainstate -->`);
# where one is missing the page is skipped, naming it.
REQUIRES = re.compile(r"^<!--\s*requires:\s*([\w.,\s-]+?)\s*-->", re.MULTILINE)


def _requires(page: Path) -> list[str]:
    head = "\n".join(page.read_text().splitlines()[:5])
    return [name.strip() for m in REQUIRES.finditer(head) for name in m.group(1).split(",")
            if name.strip()]


def _blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in BLOCK.finditer(text)]


def _make_plots():
    spec = importlib.util.spec_from_file_location("taxpr_docs_make_plots", DOCS / "make_plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PAGES_WITH_CODE = [p for p in PAGES if _blocks(p)]


def test_docs_pages_exist_and_most_have_code():
    names = {p.name for p in PAGES}
    for required in ("index.md", "getting-started.md", "tags.md", "state.md", "harvest.md",
                     "inject.md", "utilities.md", "semantics.md", "performance.md",
                     "peers.md", "limitations.md", "api.md", "ir.md", "extending.md"):
        assert required in names, required
    assert len(PAGES_WITH_CODE) >= 8


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=[p.stem for p in PAGES_WITH_CODE])
def test_docs_page_code_runs(page):
    for module in _requires(page):
        pytest.importorskip(module, reason=f"docs/{page.name} runs {module}, not installed")
    namespace = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    # A page may register a thread rule (extending.md): restored after it.
    with warnings.catch_warnings(), thread_rules_restored():
        # A page may show a warning on purpose (state.md: forgetting uncurry);
        # it records it itself, so keep the run's output clean.
        warnings.simplefilter("ignore", taxpr.StateNotUncurriedWarning)
        for line, code in _blocks(page):
            exec(compile(code, f"docs/{page.name}:{line}", "exec"), namespace)


def test_every_page_is_in_the_navigation():
    config = (ROOT / "mkdocs.yml").read_text()
    for page in PAGES:
        assert re.search(rf":\s*{re.escape(page.name)}\s*$", config, re.MULTILINE), page.name


def test_api_reference_covers_every_public_name():
    # Each public name has an entry, except the compatibility names, which
    # the "Compatibility names" table lists beside the name they equal.
    api = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^::: (taxpr(?:\.\w+)+)\s*$", api, re.MULTILINE))
    aliases = {f"taxpr.{old}" for old in taxpr._COMPATIBILITY_NAMES}
    public = {f"taxpr.{n}" for n in taxpr.__all__ if n not in ("harvest", "select")}
    public |= {f"taxpr.harvest.{n}" for n in harvest.__all__}
    public |= {f"taxpr.select.{n}" for n in taxpr.select.__all__}
    assert public - aliases - documented == set(), "add these to docs/api.md"
    assert documented - public == set(), "docs/api.md names non-public objects"
    assert documented & aliases == set(), "document the recommended name, not the alias"
    table = api.split("## Compatibility names", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `tx\.(\w+)[`(]", table, re.MULTILINE)
    assert rows == list(taxpr._COMPATIBILITY_NAMES)


def test_plot_data_is_read_from_the_committed_bench_results():
    mp = _make_plots()
    results, peers = mp.load_results(), mp.load_peer_results()

    nesting = mp.nesting_series(results)
    assert len(nesting) >= 5
    for label, (depths, ms) in nesting.items():
        assert depths == list(range(1, 9)), label
        assert all(t > 0 for t in ms), label

    inject = mp.inject_ratio_series(results, peers)
    assert all(set(per) == {1600, 10000} for per in inject.values())
    ours = [per for label, per in inject.items() if "0.0.3" not in label]
    (old,) = [per for label, per in inject.items() if "0.0.3" in label]
    assert all(per[n] < old[n] for per in ours for n in per)  # as performance.md says

    trace = mp.trace_series(peers)
    assert set(trace) == {"unrolled-250", "unrolled-1000", "scan-8"}
    assert all("tx.make_jaxpr" in tools and "Haiku make_jaxpr(apply)" in tools
               for tools in trace.values())

    dispatch = mp.dispatch_series(results)
    assert dispatch["jax.jit(f)"]["tags"] / dispatch["jax.jit(f)"]["no tags"] <= 1.2

    targets = mp.target_series(results)
    assert len(targets) >= 10
    table = mp.figures_table(results)
    assert table.count("\n| `bench_") == len(results["figures"])

    # The performance page's summary: one row per headline figure, one
    # column per committed run, each run's machine named.
    runs = mp.load_all_results()
    headline = mp.headline_table(runs)
    rows = [line for line in headline.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(mp.HEADLINE_ROWS)
    assert all(line.count(" | ") == len(runs) + 1 for line in rows)
    assert all(r["machine"]["kind"] in headline for r in runs)
    # jit, jit(grad), and jit(value_and_grad) of uncurry's pure, per run
    assert mp.dispatch_table(runs).count(" us / ") == 3 * len(runs)

    # The GPU run: its device named, every figure, the suite's counts.
    gpu = mp.load_results(mp.GPU_RESULTS)
    assert gpu["machine"]["backend"] == "gpu"
    table = mp.gpu_table(gpu)
    assert gpu["machine"]["device"] in table and "GPU backend" in table
    assert table.count("\n| `bench_") == len(gpu["figures"])
    assert f"{gpu['tests']['passed']} passed" in table


def test_coming_from_brainstate_bench_table_is_read_from_its_results():
    mp = _make_plots()
    table = mp.coming_from_table()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    results = mp.json.loads(mp.COMING_FROM_RESULTS.read_text())
    assert len(rows) == 1 + len(results["rows"])
    assert all(f"{r['ratio']:.2f}" in table for r in results["rows"])
    assert "<!-- coming-from-brainstate-bench -->" in (DOCS / "coming-from-brainstate.md").read_text()


def test_progress_tools_table_is_read_from_its_results():
    mp = _make_plots()
    table = mp.progress_tools_table()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    results = mp.json.loads(mp.PROGRESS_TOOLS_RESULTS.read_text())
    # the header, how each tool was applied, one row per program
    assert len(rows) == 2 + len(results["rows"])
    assert all(line.count(" | ") == len(results["how"]) for line in rows)
    assert "<!-- progress-tools-table -->" in (DOCS / "watching.md").read_text()


def test_docs_extra_pins_the_site_tools():
    pyproject = (ROOT / "pyproject.toml").read_text()
    docs_extra = pyproject.split("docs = [", 1)[1].split("\n]", 1)[0]
    for tool in ("mkdocs", "mkdocs-material", "mkdocstrings", "matplotlib"):
        assert re.search(rf'"{tool}(\[\w+\])?==', docs_extra), tool

"""Smoke test of the benchmarks: ``bench/run.py``'s main logic with tiny sizes.

Checks that every benchmark runs and reports the expected keys. It does not
check the timing targets: at quick sizes the figures are noise.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load_runner():
    spec = importlib.util.spec_from_file_location("_taxpr_bench_run", BENCH / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    runner = _load_runner()
    out = tmp_path_factory.mktemp("bench") / "results.json"
    # The benchmarks collect garbage before each of their ~230 measurements
    # (bench/_common.py's ``timed``). After the rest of the suite, the heap
    # holds millions of objects (JAX's caches), each full collection walking
    # all of them: freezing them first keeps each collection to the
    # benchmark's own objects (about 4x faster in a full run).
    gc.collect()
    gc.freeze()
    try:
        results = runner.main(["--quick", "--out", str(out)])
    finally:
        gc.unfreeze()
    return runner, results, out


def test_discovers_every_bench_module(quick_results):
    runner, results, _ = quick_results
    names = {p.stem for p in runner.discover()}
    assert "bench_inject" in names
    assert set(results["benches"]) == names


def test_no_bench_raised(quick_results):
    _, results, _ = quick_results
    errors = {n: r["traceback"] for n, r in results["benches"].items() if "error" in r}
    assert not errors, errors
    assert results["errors"] == []
    assert results["ok"] is True


def test_top_level_keys(quick_results):
    _, results, _ = quick_results
    assert {"quick", "python", "jax", "platform", "benches", "seconds", "figures",
            "errors", "ok"} <= set(results)
    assert results["quick"] is True


def test_figures_rows(quick_results):
    _, results, _ = quick_results
    assert results["figures"]
    for row in results["figures"]:
        assert set(row) == {"bench", "name", "value", "target", "pass"}
        assert isinstance(row["value"], float) and math.isfinite(row["value"]), row
        assert row["value"] > 0
        assert row["pass"] in (True, False, None)
    benches = {row["bench"] for row in results["figures"]}
    assert set(results["benches"]) <= benches


def test_inject_bench_keys(quick_results):
    _, results, _ = quick_results
    r = results["benches"]["bench_inject"]
    assert {"jax", "straight", "nested_scan", "figures"} <= set(r)
    for s in r["straight"]:
        assert {"tags", "make_jaxpr_s", "inject_s", "ratio"} <= set(s)
    ns = r["nested_scan"]
    assert {"length", "tags_per_level", "inject_s", "ratio_key", "ratio"} <= set(ns)
    depths = sorted(int(d) for d in ns["inject_s"])
    assert depths == list(range(1, depths[-1] + 1))
    names = [f["name"] for f in r["figures"]]
    assert any(n.startswith("inject/make_jaxpr") for n in names)
    assert any(n.startswith("inject nested scan") for n in names)


def test_results_json_written(quick_results):
    _, results, out = quick_results
    data = json.loads(out.read_text())
    assert data["jax"] == results["jax"]
    assert set(data["benches"]) == set(results["benches"])
    assert len(data["figures"]) == len(results["figures"])
    assert not out.with_name(out.name + ".tmp").exists()


def test_quick_run_leaves_the_checkout_clean():
    """``bench/run.py --quick`` (no ``--out``) must not overwrite the tracked
    ``bench/results.json`` with smoke-size figures."""
    import shutil
    import subprocess

    root = BENCH.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("needs a git checkout")
    tracked = (BENCH / "results.json").read_bytes()
    runner = _load_runner()
    runner.main(["--quick", "--only", "bench_dispatch"])
    assert (BENCH / "results.json").read_bytes() == tracked
    assert runner.QUICK_OUT.exists()
    status = subprocess.run(["git", "status", "--porcelain", "--", "bench"], cwd=root,
                            capture_output=True, text=True, check=True).stdout
    assert status == "", status

"""README.md, the front page: every ```python block runs (each in a fresh
namespace), the Quickstart's two commands are the ones CI runs, and the
performance figures it quotes are those of ``bench/results.json``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import thread_rules_restored

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def _blocks() -> list[tuple[int, str]]:
    text = README.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in BLOCK.finditer(text)]


def test_readme_has_python_blocks():
    assert len(_blocks()) >= 1


@pytest.mark.parametrize("line,code", _blocks(), ids=[f"line{n}" for n, _ in _blocks()])
def test_readme_block_runs(line, code, capsys):
    namespace = {"__name__": f"readme_block_line{line}"}
    with thread_rules_restored():  # a block may register a thread rule
        exec(compile(code, f"README.md:{line}", "exec"), namespace)


def test_quickstart_has_two_commands():
    text = README.read_text()
    quick = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^```bash\n(.*?)^```", quick, re.DOTALL | re.MULTILINE)
    commands = [c.strip() for c in commands]
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    assert "examples/running_sum.py" in commands[0]
    assert commands[1].endswith("python -m pytest -q")
    # .ci/run runs the same test command.
    ci = (ROOT / ".ci" / "run").read_text()
    assert "TEST_CMD=(-m pytest -q)" in ci


# README's performance rows (by the start of their label) and the figure of
# bench/results.json each quotes, rounded to two decimals.
QUOTED_FIGURES = {
    "RNN in `lax.scan`": "RNN scan 2000: run time taxpr/hand",
    "RNN trained by truncated BPTT": "RNN truncated BPTT, tx.value_and_grad, 500 steps: run time "
                                     "taxpr/hand",
    "dropout MLP": "dropout MLP 6 layers SGD step: run time taxpr/hand",
    "`tx.inject` / `jax.make_jaxpr`": "inject/make_jaxpr, 10000 tags",
    "dispatch of `jax.jit(f)`": "dispatch jit, 20 tags / none",
    "dispatch of `jax.jit(jax.value_and_grad)`": "dispatch jit(value_and_grad) of uncurry's pure, "
                                                 "20 tags / none",
    "`tx.capture` of a scan-over-layers model": "capture: run time / hand-written sows (jit, "
                                                "scan of 8 layers)",
}


def test_quoted_performance_figures_are_those_of_the_bench_results():
    results = json.loads((ROOT / "bench" / "results.json").read_text())
    values = {f["name"]: f["value"] for f in results["figures"]}
    section = README.read_text().split("## Performance", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 2 and cells[1] not in ("ratio", "---"):
            rows[cells[0]] = cells[1]
    assert len(rows) == len(QUOTED_FIGURES), rows
    for start, figure in QUOTED_FIGURES.items():
        (quoted,) = [v for label, v in rows.items() if label.startswith(start)]
        assert quoted == f"{values[figure]:.2f}", (start, quoted, values[figure])
    # The machine and versions the figures were measured on are named.
    assert f"JAX {results['jax']}" in section
    assert f"Python {results['python'].rsplit('.', 1)[0]}" in section
    assert results["machine"]["kind"] in " ".join(section.split())

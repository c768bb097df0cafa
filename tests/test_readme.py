"""Every ```python block of README.md runs (each in a fresh namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def _blocks() -> list[tuple[int, str]]:
    text = README.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1)) for m in BLOCK.finditer(text)]


def test_readme_has_python_blocks():
    assert len(_blocks()) >= 4


@pytest.mark.parametrize("line,code", _blocks(), ids=[f"line{n}" for n, _ in _blocks()])
def test_readme_block_runs(line, code, capsys, monkeypatch):
    # A block may register a thread rule: keep it out of the other tests.
    from taxpr import _engine
    monkeypatch.setattr(_engine, "THREAD_RULES", dict(_engine.THREAD_RULES))
    namespace = {"__name__": f"readme_block_line{line}"}
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

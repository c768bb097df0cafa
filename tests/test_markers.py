"""The everyday suite, the README's `python -m pytest -q` (`-m 'not slow'`
in pyproject.toml's addopts), leaves out what tests/conftest.py marks slow
(and every long test); `-m "slow and not long"` runs the rest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ["tests/test_fuzz.py", "tests/test_examples.py", "tests/test_bench_smoke.py",
         "tests/test_inject.py", "tests/test_engine.py"]


def _collected(*marker_args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         *marker_args, *FILES],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def test_fast_subset_leaves_out_slow_and_long_tests():
    fast = _collected()  # the README's command: pyproject.toml's addopts
    assert fast, "the fast subset selected nothing"
    assert all(t.startswith(("tests/test_inject.py::", "tests/test_engine.py::"))
               for t in fast), fast[:5]
    assert not [t for t in fast if "test_predicate_matches_eager" in t]
    assert [t for t in fast if "test_matches_eager[" in t]  # each program still runs


def test_the_readme_command_and_the_slow_rest_split_what_ci_runs():
    fast, rest = _collected(), _collected("-m", "slow and not long")
    everything = _collected("-m", "not long")
    assert rest and not set(fast) & set(rest)
    assert sorted(fast + rest) == sorted(everything)
    assert any(t.startswith("tests/test_fuzz.py::") for t in rest)
    assert any("test_predicate_matches_eager" in t for t in rest)

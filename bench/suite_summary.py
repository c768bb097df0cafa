"""Add a test suite run's outcome to a results file of ``bench/run.py``.

Used where the benchmarks and the test suite run on another machine (a GPU
one): ``python -m pytest ... --junitxml=J`` there, then
``python bench/suite_summary.py J RESULTS "COMMAND"`` adds ``"tests"`` to
``RESULTS``: ``{"command", "passed", "failed", "errors", "skipped",
"xfailed", "seconds", "failed_ids"}``, read from pytest's JUnit XML, so
that the performance page quotes the counts from one file.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def summary(junit: Path, command: str) -> dict:
    """The counts of one pytest run's JUnit XML file."""
    suite = ET.parse(junit).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = dict(passed=0, failed=0, errors=0, skipped=0, xfailed=0)
    failed_ids = []
    for case in suite.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
            elif child.tag == "skipped":
                # pytest writes an xfailed test as skipped, typed "pytest.xfail".
                outcome = "xfailed" if child.get("type") == "pytest.xfail" else "skipped"
        counts[outcome] += 1
        if outcome in ("failed", "errors"):
            failed_ids.append(f"{case.get('classname')}::{case.get('name')}")
    return {"command": command, **counts, "seconds": float(suite.get("time", "nan")),
            "failed_ids": failed_ids}


def main(argv: list[str]) -> None:
    junit, results, command = Path(argv[0]), Path(argv[1]), argv[2]
    data = json.loads(results.read_text())
    data["tests"] = summary(junit, command)
    results.write_text(json.dumps(data, indent=2) + "\n")
    print(data["tests"])


if __name__ == "__main__":
    main(sys.argv[1:])

"""Side-by-side peer timings (optional, not in CI): each measurement runs in
its own venv through a subprocess, and this driver prints one table.

* ``--haiku PYTHON``: an interpreter with dm-haiku. Runs ``trace_state.py``
  there: tracing time of a stateful program under
  ``hk.transform_with_state`` (``apply`` and ``init``) and, if taxpr is also
  installed in that venv (``pip install -e . --no-deps`` plus equinox), under
  ``tx.make_jaxpr`` in the same process, each as a ratio to
  ``jax.make_jaxpr`` of the same program without state. If taxpr is not
  importable there, taxpr's side runs under ``--taxpr`` instead.
* ``--tx003 PYTHON``: an interpreter with taxpr 0.0.3 (Python >= 3.13).
  Runs ``inject_straight.py`` there and under ``--taxpr``: inject time /
  ``jax.make_jaxpr`` time on ``bench/bench_inject.py``'s straight-line
  programs with 1,600 and 10,000 tags.
* ``--taxpr PYTHON``: the interpreter with this project's taxpr (default:
  the one running this script).

Every figure is a ratio of medians measured in one process (each tool
against its own ``jax.make_jaxpr``), so tools in different venvs, even on
different Python versions, compare by ratio, not by absolute time.

Run, e.g.::

    python bench/peers/run_peers.py --haiku /work/peers311/bin/python \\
        --tx003 /work/tx003venv/bin/python [--quick] [--out PATH]

It writes the collected results as JSON to ``--out`` (default
``bench/peers/results.json``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results.json"


def run_script(python: str, script: str, *args: str) -> dict:
    """Run ``bench/peers/<script>`` under ``python``; echo its output and
    return the dict on its ``JSON`` line."""
    cmd = [python, str(HERE / script), *args]
    print(f"$ {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("JSON "):
            result = json.loads(line[5:])
        else:
            print("  | " + line)
    if proc.returncode != 0 or result is None:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"{script} under {python} failed (exit {proc.returncode})")
    return result


def importable(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"],
                          capture_output=True).returncode == 0


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def state_table(runs: list[dict]) -> str:
    by_prog: dict[str, dict] = {}
    env: dict[str, str] = {}
    for run in runs:
        for r in run["results"]:
            row = by_prog.setdefault(r["program"], {"plain_ms": {}})
            for tool, e in r["tools"].items():
                row[tool] = e
                row["plain_ms"][tool] = r["plain_s"] * 1e3
                env[tool] = f"{tool} {e['version']} (python {run['python']}, jax {run['jax']})"
    rows = [("program", "plain make_jaxpr ms", "haiku apply/plain", "haiku init/plain",
             "taxpr tx.make_jaxpr/plain", "same result")]
    for prog, row in by_prog.items():
        hk, tx = row.get("haiku"), row.get("taxpr")
        plain = "/".join(f"{v:.1f}" for v in dict.fromkeys(round(x, 1) for x in row["plain_ms"].values()))
        same = all(e["equivalent"] for e in (hk, tx) if e)
        rows.append((prog, plain,
                     f"{hk['haiku_apply_ratio']:.2f}" if hk else "-",
                     f"{hk['haiku_init_ratio']:.2f}" if hk else "-",
                     f"{tx['taxpr_ratio']:.2f}" if tx else "-",
                     "yes" if same else "NO"))
    return ("Tracing a stateful program (ratio to jax.make_jaxpr of it without state)\n"
            + "; ".join(env.values()) + "\n" + _table(rows))


def inject_table(ours: dict, old: dict) -> str:
    rows = [("tags", f"taxpr {ours['version']} inject/make_jaxpr",
             f"taxpr {old['version']} inject/make_jaxpr", "0.0.3 inject / ours inject")]
    old_by = {s["tags"]: s for s in old["straight"]}
    for s in ours["straight"]:
        o = old_by.get(s["tags"])
        rows.append((str(s["tags"]), f"{s['ratio']:.3f}",
                     f"{o['ratio']:.3f}" if o else "-",
                     # a ratio of ratios: each tool's inject time in units of
                     # its own make_jaxpr time
                     f"{o['ratio'] / s['ratio']:.1f}x" if o else "-"))
    head = (f"inject on straight-line programs (ratio to jax.make_jaxpr of the same "
            f"program); taxpr {ours['version']}: python {ours['python']}, jax {ours['jax']}; "
            f"taxpr {old['version']}: python {old['python']}, jax {old['jax']}; "
            f"both match eager semantics: {ours['equivalent'] and old['equivalent']}")
    return head + "\n" + _table(rows)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--haiku", metavar="PYTHON", help="interpreter with dm-haiku")
    p.add_argument("--tx003", metavar="PYTHON", help="interpreter with taxpr 0.0.3")
    p.add_argument("--taxpr", metavar="PYTHON", default=sys.executable,
                   help="interpreter with this project's taxpr (default: this one)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = p.parse_args(argv)
    if not (a.haiku or a.tx003):
        p.error("nothing to compare: give --haiku and/or --tx003")
    quick = ["--quick"] if a.quick else []
    out: dict = {"quick": a.quick}
    tables = []
    if a.haiku:
        runs = []
        if importable(a.haiku, "taxpr"):
            runs.append(run_script(a.haiku, "trace_state.py", "--tools", "haiku,taxpr", *quick))
        else:
            runs.append(run_script(a.haiku, "trace_state.py", "--tools", "haiku", *quick))
            runs.append(run_script(a.taxpr, "trace_state.py", "--tools", "taxpr", *quick))
        out["trace_state"] = runs
        tables.append(state_table(runs))
    if a.tx003:
        old = run_script(a.tx003, "inject_straight.py", *quick)
        ours = run_script(a.taxpr, "inject_straight.py", *quick)
        if not old["version"].startswith("0.0."):
            raise SystemExit(f"--tx003 {a.tx003} has taxpr {old['version']}, not 0.0.x")
        out["inject_straight"] = {"ours": ours, "tx003": old}
        tables.append(inject_table(ours, old))
    print()
    print("\n\n".join(tables))
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {a.out}")
    return out


if __name__ == "__main__":
    main()

"""Run every benchmark, print a table and write ``bench/results.json``.

Every ``bench/bench_*.py`` module is discovered by glob, imported by path and
its ``run(quick: bool) -> dict`` called, in one process, in name order.

The table has one row per figure. A module reports its figures in its result
as ``"figures": [{"name", "value", "target", "pass"}, ...]``; for a module
that does not, every entry of its result that is a dict with a ``"ratio"`` is
a figure, with the target from ``KNOWN_TARGETS`` if one is listed (else no
target). A module that raises is reported as a failed row and the others
still run.

Run: ``python bench/run.py [--quick] [--out PATH]`` (``--quick`` writes
``bench/results.quick.json``, ignored by git, unless ``--out`` is given). The exit status is 1 if a
benchmark raised or (except with ``--quick``, whose tiny sizes make the
figures meaningless) a figure missed its target.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = BENCH_DIR / "results.json"
# ``--quick`` (smoke-size, noisy figures) never overwrites the tracked results.
QUICK_OUT = BENCH_DIR / "results.quick.json"

# Targets for modules that return ratios but no "figures":
# (module, key) -> upper bound on result[key]["ratio"].
KNOWN_TARGETS = {
    ("bench_dispatch", "jit"): 1.2,
}


def discover() -> list[Path]:
    """The benchmark modules, ``bench/bench_*.py``, sorted by name."""
    return sorted(BENCH_DIR.glob("bench_*.py"))


def load(path: Path):
    """Import the module at ``path`` (its directory made importable)."""
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_taxpr_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    # Registered so dataclass-based code (equinox modules) can resolve it.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def figures_of(name: str, result: dict) -> list[dict]:
    """The table rows of one module's result (see module docstring)."""
    if "figures" in result:
        rows = []
        for f in result["figures"]:
            rows.append({"bench": name, "name": f["name"], "value": f["value"],
                         "target": f.get("target"), "pass": f.get("pass")})
        return rows
    rows = []
    for key, value in result.items():
        if isinstance(value, dict) and "ratio" in value:
            bound = KNOWN_TARGETS.get((name, key))
            ratio = value["ratio"]
            rows.append({"bench": name, "name": f"{key} ratio", "value": ratio,
                         "target": None if bound is None else f"<= {bound}",
                         "pass": None if bound is None else bool(ratio <= bound)})
    return rows


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The machine the figures are measured on: ``kind`` (a phrase such as
    ``"2-core x86_64 Linux machine, CPU backend"``, quoted wherever a figure
    is), ``cpus``, ``cpu`` (the processor's model name), ``backend`` and
    ``device`` (JAX's default backend and its first device's kind)."""
    import jax

    cpus = os.cpu_count() or 1
    backend = jax.default_backend()
    return {"kind": f"{cpus}-core {platform.machine()} {platform.system()} machine, "
                    f"{backend.upper()} backend",
            "cpus": cpus, "cpu": _cpu_model(), "backend": backend,
            "device": jax.devices()[0].device_kind}


def run_all(quick: bool = False, only: list[str] | None = None) -> dict:
    """Run the benchmarks; returns the dict written to ``results.json``.

    Keys: ``quick``, ``python``, ``jax``, ``platform``, ``machine`` (see
    :func:`machine`), ``benches``
    (``{module: result}``; a module that raised has ``{"error": ...}``),
    ``seconds`` (``{module: wall time}``), ``figures`` (the table rows:
    ``{bench, name, value, target, pass}``), ``errors`` (modules that raised)
    and ``ok`` (no error and, unless quick, every target met).
    """
    import jax

    out = {"quick": bool(quick), "python": platform.python_version(),
           "jax": jax.__version__, "platform": platform.platform(),
           "machine": machine(), "benches": {}, "seconds": {}, "figures": []}
    for path in discover():
        name = path.stem
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            result = load(path).run(quick)
            rows = figures_of(name, result)
        except Exception as e:  # report and go on with the other benches
            result = {"error": f"{type(e).__name__}: {e}",
                      "traceback": traceback.format_exc()}
            rows = [{"bench": name, "name": "error", "value": None,
                     "target": None, "pass": False}]
        out["seconds"][name] = time.perf_counter() - t0
        out["benches"][name] = result
        out["figures"].extend(rows)
    out["errors"] = sorted(n for n, r in out["benches"].items() if "error" in r)
    # Quick sizes are too small for the targets to mean anything: there only
    # an error fails the run.
    out["ok"] = not out["errors"] and (
        quick or all(r["pass"] is not False for r in out["figures"]))
    return out


def _jsonable(x):
    """``x`` with numpy/JAX scalars and arrays turned into plain Python."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, bool, int)) or x is None:
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if hasattr(x, "tolist"):  # numpy / jax scalars and arrays
        return _jsonable(x.tolist())
    return str(x)


def write(results: dict, path: Path = DEFAULT_OUT) -> None:
    """Write ``results`` as JSON to ``path`` (atomically, via ``path.tmp``)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(results), indent=2) + "\n")
    os.replace(tmp, path)


def table(results: dict) -> str:
    """The figures as a text table."""
    rows = [("bench", "figure", "value", "target", "pass")]
    for f in results["figures"]:
        v = f["value"]
        value = "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
        ok = {True: "yes", False: "NO", None: "-"}[f["pass"]]
        rows.append((f["bench"], f["name"], value, f["target"] or "-", ok))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    head = (f"python {results['python']}, jax {results['jax']}, "
            f"{results.get('machine', {}).get('kind', 'machine not recorded')}"
            f"{', quick' if results['quick'] else ''}")
    return head + "\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes (a smoke test; the figures are noisy)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write the JSON (default {DEFAULT_OUT}; "
                             f"with --quick {QUICK_OUT}, which git ignores)")
    parser.add_argument("--only", nargs="*", metavar="MODULE",
                        help="run only these modules, e.g. bench_inject")
    args = parser.parse_args(argv)
    results = run_all(args.quick, args.only)
    print(table(results))
    for name, r in results["benches"].items():
        if "error" in r:
            print(f"\n{name} raised:\n{r['traceback']}", file=sys.stderr)
    out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    write(results, out)
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)

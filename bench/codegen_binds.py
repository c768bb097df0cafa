"""How much of ``ir.jaxpr_to_python_code``'s output still binds primitives.

For every program of the codegen corpus (tests/codegen_corpus.py: the ir
fuzzer's programs, the families of tests/test_ir_codegen.py, realistic
programs, the examples' programs and those of the JAX libraries installed:
equinox, diffrax, optimistix, lineax, optax, flax), the generated code is scanned for ``<primitive>.bind(`` calls;
each is resolved to the primitive it binds (in the loaded module) and
listed with why no public JAX function writes it. Also counted: programs
whose code reads ``OBJECTS`` (none should).

Run: ``PYTHONPATH=. python bench/codegen_binds.py [--docs]`` from the
checkout. ``bench/results_codegen.json`` holds the last run per JAX
version; ``--docs`` also rewrites the table between the ``codegen-binds``
markers of docs/ir.md from it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import jax  # noqa: E402
from jax._src import ad_util  # noqa: E402

import codegen_corpus  # noqa: E402
from taxpr import ir  # noqa: E402
from taxpr.ir._codegen_locate import location  # noqa: E402
from taxpr.primitives import _tag  # noqa: E402

RESULTS = ROOT / "bench" / "results_codegen.json"
DOCS = ROOT / "docs" / "ir.md"
START, END = "<!-- codegen-binds:start -->", "<!-- codegen-binds:end -->"
BIND = re.compile(r"([A-Za-z_][\w.]*)\.bind\(")

# Why a primitive the corpus still binds has no public function (keyed by
# the primitive).
WHY = {
    ad_util.add_jaxvals_p: "the sum of a weakly typed and a strongly typed cotangent keeps "
                           "the weak type; `lax.add` would not",
    getattr(_tag, "tag_tangent_p", None): "taxpr's own primitive for a tag's tangent (no "
                                          "public function)",
    getattr(sys.modules.get("jax._src.lax.parallel"), "psum_invariant_p", None):
        "shard_map's sum over mesh axes; `lax.psum` binds it only after making its operand "
        "vary over those axes (`pvary`), which would change the jaxpr",
    getattr(sys.modules.get("taxpr._random"), "key_p", None):
        "taxpr's own primitive marking a key drawn from a `next_key` stream (an identity; no "
        "public function)",
    getattr(sys.modules.get("taxpr._engine"), "ctx_through_p", None):
        "taxpr's own primitive passing a state through a `custom_vjp` call that does not "
        "write it (its value after the call, its tangent from before; no public function)",
    getattr(sys.modules.get("jax._src.lax.lax"), "empty2_p", None):
        "an uninitialised array that JAX's autodiff makes for an integer carry of a loop "
        "(`jax._src.lax.lax.empty2`, no public function)",
    jax.lax.convert_element_type_p:
        "a conversion with a weakly typed result; `lax.convert_element_type` binds "
        "`weak_type=False`",
}


def why(prim) -> str:
    """Why the generated code binds ``prim``: ``WHY``'s reason, or, for a
    primitive a library other than JAX and taxpr defines, that library's."""
    if prim in WHY:
        return WHY[prim]
    where = location(prim) or ""
    top = where.split(".")[0]
    if top and top not in ("jax", "jaxlib", "taxpr"):
        return f"{top}'s own primitive (`{where}`): JAX has no function for it"
    return "no public function known"


def count() -> dict:
    """The corpus's bind counts, in all and per source of programs (taxpr's
    own, or the library whose programs they are: ``by_source``), with the
    libraries installed (``libraries``): a run with fewer libraries
    installed compares the sources it has."""
    binds: Counter = Counter()
    by_source: dict[str, dict] = {}
    reading_objects = []
    cases = codegen_corpus.cases()
    sources = codegen_corpus.sources()
    for name, j, _ in cases:
        code = ir.jaxpr_to_python_code(j)
        if code.objects:
            reading_objects.append(name)
        namespace: dict = {"OBJECTS": code.objects}
        exec(compile(str(code), name, "exec"), namespace)
        mine = by_source.setdefault(sources[name], {"programs": 0, "binds": 0, "bound": Counter()})
        mine["programs"] += 1
        for expr in BIND.findall(str(code)):
            prim = eval(expr, namespace)  # noqa: S307 - the generated code's own names
            binds[prim] += 1
            mine["binds"] += 1
            mine["bound"][prim.name] += 1
    return {
        "programs": len(cases),
        "binds": sum(binds.values()),
        "libraries": list(codegen_corpus.installed_libraries()),
        "by_source": {s: {**r, "bound": dict(sorted(r["bound"].items()))}
                      for s, r in sorted(by_source.items())},
        "programs_reading_objects": reading_objects,
        "bound": {p.name: {"count": n, "why": why(p)} for p, n in binds.most_common()},
    }


def docs_table(results: dict) -> str:
    rows = []
    for version, r in sorted(results.items()):
        bound = "; ".join(f"`{name}` x{b['count']}: {b['why']}" for name, b in sorted(r["bound"].items()))
        rows.append(f"| {version} | {r['programs']} | {r['binds']} | "
                    f"{len(r['programs_reading_objects'])} | {bound or '-'} |")
    return "\n".join([
        START,
        "| JAX | programs | `_p.bind(` calls | programs reading `OBJECTS` | still bound, and why |",
        "|---|---|---|---|---|",
        *rows,
        END,
    ])


def main() -> None:
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[jax.__version__] = count()
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    print(json.dumps(results[jax.__version__], indent=1))
    if "--docs" in sys.argv:
        text = DOCS.read_text()
        start, end = text.index(START), text.index(END) + len(END)
        DOCS.write_text(text[:start] + docs_table(results) + text[end:])


if __name__ == "__main__":
    main()

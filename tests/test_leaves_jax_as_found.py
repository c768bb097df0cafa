"""``import taxpr`` leaves JAX as it found it for programs without tags.

taxpr registers rules on JAX's primitives (partial evaluation of ``cond`` /
``while`` / ``scan``, batching of ``cond`` / ``while``, custom-derivative
calls under partial evaluation, linearization). Every tag-free program of
``tag_free_programs.py`` (vmap, grad, jvp, vjp, linearize, hessian,
checkpoint, custom_jvp / custom_vjp, scan, while, cond, switch, debug
callbacks, shard_map) must trace to the same jaxpr and lower to the same
StableHLO in a process that imported taxpr as in one that did not.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "tag_free_programs.py"


def _programs_text(*flags: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    done = subprocess.run([sys.executable, str(SCRIPT), *flags], env=env, cwd=HERE.parent,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def _by_program(text: str) -> dict[str, str]:
    blocks = text.split("==== ")[1:]
    return {b.split("\n", 1)[0]: b for b in blocks}


def test_tag_free_programs_trace_and_lower_alike_with_and_without_taxpr():
    without = _by_program(_programs_text())
    with_taxpr = _by_program(_programs_text("--import-taxpr"))
    assert len(without) >= 20 and set(with_taxpr) == set(without)
    for name, text in without.items():
        assert "---- lowered" in text and "func.func public @main" in text, name
        assert with_taxpr[name] == text, f"{name}: traced or lowered differently with taxpr"


def test_the_script_imports_taxpr_only_when_asked():
    probe = "import runpy, sys; sys.argv = [sys.argv[0]] + sys.argv[1:]; " \
            "import tag_free_programs; print('taxpr' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent)]))
    for flags, want in (([], "False"), (["--import-taxpr"], "True")):
        done = subprocess.run([sys.executable, "-c", probe, *flags], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        assert done.stdout.strip() == want


# What ``import taxpr`` replaces of JAX's own rules and functions: exactly the
# table in ``taxpr/_patches/__init__.py``'s docstring.
_SNAPSHOT = r"""
import sys
from jax._src.interpreters import ad, batching, partial_eval as pe
from jax._src.lax.control_flow import loops

def snapshot():
    tables = {"batching.fancy_primitive_batchers": getattr(batching, "fancy_primitive_batchers", {}),
              "pe.custom_partial_eval_rules": pe.custom_partial_eval_rules,
              "pe.partial_eval_jaxpr_custom_rules": pe.partial_eval_jaxpr_custom_rules,
              "pe.dce_rules": pe.dce_rules, "ad.primitive_jvps": ad.primitive_jvps,
              "ad.primitive_transposes": ad.primitive_transposes,
              "ad.primitive_linearizations": getattr(ad, "primitive_linearizations", {})}
    out = {f"{name}[{prim}]": id(rule) for name, table in tables.items()
           if isinstance(table, dict) for prim, rule in list(table.items())}
    out.update({f"ad.{n}": id(getattr(ad, n, None)) for n in ("linearize_from_jvp",)})
    out.update({f"loops.{n}": id(getattr(loops, n, None)) for n in ("_scan_known_hoisting",)})
    out.update({f"pe.JaxprTrace.{n}": id(getattr(pe.JaxprTrace, n))
                for n in ("process_custom_jvp_call", "process_custom_vjp_call")})
    return out

before = snapshot()
import taxpr
from taxpr.primitives import _tag
after = snapshot()
own = {str(p) for p in (_tag.tag_p, _tag.tag_tangent_p, _tag.tag_cotangent_p)}
# (entries new after the import are primitives of modules imported with it)
changed = sorted(k for k in before if before[k] != after[k])
for k in changed:
    if not any(f"[{p}]" in k for p in own) and "taxpr" not in k:
        print(k)
"""


def test_import_taxpr_replaces_only_what_its_overrides_module_lists():
    done = subprocess.run([sys.executable, "-c", _SNAPSHOT], capture_output=True, text=True,
                          timeout=600, cwd=HERE.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    changed = set(done.stdout.split())
    # Entries for taxpr's own primitives are not listed (they are taxpr's).
    always = {"batching.fancy_primitive_batchers[cond]", "batching.fancy_primitive_batchers[while]",
              "pe.custom_partial_eval_rules[cond]", "pe.custom_partial_eval_rules[remat2]",
              "pe.custom_partial_eval_rules[while]", "pe.partial_eval_jaxpr_custom_rules[scan]",
              "pe.partial_eval_jaxpr_custom_rules[while]",
              "pe.JaxprTrace.process_custom_jvp_call", "pe.JaxprTrace.process_custom_vjp_call"}
    # where JAX has them (scan's JaxprTrace rule is wrapped where it lacks
    # the hoisting function)
    where_present = {"ad.linearize_from_jvp", "loops._scan_known_hoisting",
                     "pe.custom_partial_eval_rules[scan]"}
    assert always <= changed <= always | where_present, changed
    from taxpr import _patches
    for listed in ("batching rule of ``cond``", "batching rule of ``while``",
                   "partial-eval rule of ``cond``", "partial-eval rule of ``checkpoint``",
                   "partial-eval rule of ``while``", "``partial_eval_jaxpr_custom`` rule of ``while``",
                   "``ad.linearize_from_jvp``", "``loops._scan_known_hoisting``",
                   "``JaxprTrace.process_custom_jvp_call``"):
        assert listed in _patches.__doc__, listed

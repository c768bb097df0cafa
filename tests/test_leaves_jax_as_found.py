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
# table in ``taxpr/_patches/__init__.py``'s docstring. The snapshot covers
# every attribute of the JAX modules taxpr touches, every attribute of the
# classes they define and every entry of their dict-valued tables.
_SNAPSHOT = r"""
import importlib
names = ["jax._src.interpreters.ad", "jax._src.interpreters.batching",
         "jax._src.interpreters.partial_eval", "jax._src.interpreters.mlir",
         "jax._src.lax.control_flow.loops", "jax._src.lax.control_flow.conditionals",
         "jax._src.core", "jax._src.custom_derivatives", "jax._src.ad_checkpoint",
         "jax._src.pjit", "jax._src.shard_map", "jax._src.lax.lax", "jax._src.api"]
mods = [importlib.import_module(n) for n in names]

def snapshot():
    out = {}
    for m in mods:
        for name, val in list(vars(m).items()):
            key = f"{m.__name__.removeprefix('jax._src.')}.{name}"
            out[key] = id(val)
            if isinstance(val, type) and val.__module__ == m.__name__:
                for attr, v in list(vars(val).items()):
                    out[f"{key}.{attr}"] = id(v)
            elif isinstance(val, dict) and name != "__builtins__":
                for k, v in list(val.items()):
                    out[f"{key}[{k}]"] = id(v)
    return out

before = snapshot()
import taxpr
after = snapshot()
# (keys new after the import are taxpr's own primitives' rules)
print("\n".join(sorted(k for k in before if k in after and before[k] != after[k])))
"""

# Each replaced object, and how the table in ``taxpr._patches`` names it.
_REPLACED = {
    "interpreters.batching.fancy_primitive_batchers[cond]": "batching rule of ``cond``",
    "interpreters.batching.fancy_primitive_batchers[while]": "batching rule of ``while``",
    "interpreters.partial_eval.custom_partial_eval_rules[cond]": "partial-eval rule of ``cond``",
    "interpreters.partial_eval.custom_partial_eval_rules[remat2]":
        "partial-eval rule of ``checkpoint``",
    "interpreters.partial_eval.custom_partial_eval_rules[while]": "partial-eval rule of ``while``",
    "interpreters.partial_eval.partial_eval_jaxpr_custom_rules[while]":
        "``partial_eval_jaxpr_custom`` rule of ``while``",
    "interpreters.partial_eval.partial_eval_jaxpr_custom_rules[scan]":
        "partial-eval rules of ``while`` and ``scan``",
    "interpreters.partial_eval.JaxprTrace.process_custom_jvp_call":
        "``JaxprTrace.process_custom_jvp_call``",
    "interpreters.partial_eval.JaxprTrace.process_custom_vjp_call":
        "``process_custom_vjp_call``",
    "interpreters.partial_eval._memoize": "``pe._memoize``",
    "interpreters.ad.JVPTrace.process_custom_vjp_call": "``JVPTrace``",
    "custom_derivatives.CustomJVPCallPrimitive.bind_with_trace":
        "``bind_with_trace`` of ``custom_jvp_call``",
    "custom_derivatives.CustomVJPCallPrimitive.bind_with_trace": "``custom_vjp_call``",
}
# Where JAX has them (scan's JaxprTrace rule is wrapped where JAX lacks the
# hoisting function).
_REPLACED_WHERE_PRESENT = {
    "interpreters.ad.linearize_from_jvp": "``ad.linearize_from_jvp``",
    "interpreters.ad.LinearizeTrace.process_custom_vjp_call":
        "``LinearizeTrace.process_custom_vjp_call``",
    "lax.control_flow.loops._scan_known_hoisting": "``loops._scan_known_hoisting``",
    "interpreters.partial_eval.custom_partial_eval_rules[scan]":
        "partial-eval rules of ``while`` and ``scan``",
}


def test_import_taxpr_replaces_only_what_its_patches_list():
    done = subprocess.run([sys.executable, "-c", _SNAPSHOT], capture_output=True, text=True,
                          timeout=600, cwd=HERE.parent)
    assert done.returncode == 0, done.stderr[-4000:]
    changed = set(done.stdout.split())
    assert set(_REPLACED) <= changed <= set(_REPLACED) | set(_REPLACED_WHERE_PRESENT), (
        sorted(changed - set(_REPLACED) - set(_REPLACED_WHERE_PRESENT)),
        sorted(set(_REPLACED) - changed))
    from taxpr import _patches
    for listed in {**_REPLACED, **_REPLACED_WHERE_PRESENT}.values():
        assert listed in _patches.__doc__, listed

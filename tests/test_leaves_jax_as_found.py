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

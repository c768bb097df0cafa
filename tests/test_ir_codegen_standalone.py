"""The generated Python code of every program of the codegen corpus
(tests/codegen_corpus.py: the ir fuzzer's programs, the families of
tests/test_ir_codegen.py, realistic programs, the programs of examples/ and
those of the JAX libraries installed) runs as a standalone file
in a fresh Python process, with no ``OBJECTS`` handed over, and computes
what the jaxpr computes in this process, bit for bit: the same outputs, the
same printed text, the same number of host callback calls. All programs
run in one subprocess (one JAX start)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path

import jax
import numpy as np
import pytest

import codegen_corpus
import ir_fuzz.build
from taxpr import ir

from ir_helpers import assert_bitwise, run

# What every program prints and calls is told apart by these markers.
MARK = "=== program "

DRIVER = textwrap.dedent('''
    """Run each generated file of a folder as a fresh module (as ``python
    file.py`` would), jitted, and save its outputs and host calls."""
    import json, runpy, sys
    from pathlib import Path

    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    import codegen_corpus, ir_fuzz.build

    def plain(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    def raw(x):  # (npz keeps no bfloat16: its bits, as unsigned integers)
        return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind == "V" else x

    folder = Path(sys.argv[1])
    calls = {}
    for script in sorted(folder.glob("*.py")):
        name = script.stem
        print(%r + name, flush=True)
        namespace = runpy.run_path(str(script), run_name="generated")
        inputs = np.load(folder / (name + ".inputs.npz"))
        dtypes = json.loads((folder / (name + ".dtypes.json")).read_text())
        args = [inputs[f"arg{i}"].view(jax.numpy.dtype(d)) for i, d in enumerate(dtypes)]
        codegen_corpus.CALLS.clear()
        ir_fuzz.build.CALLS.clear()
        out = jax.jit(namespace["f"])(*args)
        outs = [plain(o) for o in jax.tree_util.tree_leaves(out)]
        jax.effects_barrier()
        sys.stdout.flush()
        np.savez(folder / (name + ".outputs.npz"), *[raw(o) for o in outs])
        (folder / (name + ".out_dtypes.json")).write_text(json.dumps([str(o.dtype) for o in outs]))
        calls[name] = dict(codegen_corpus.CALLS + ir_fuzz.build.CALLS)
    (folder / "calls.json").write_text(json.dumps(calls))
''' % MARK)


def _raw(x: np.ndarray) -> np.ndarray:
    """npz keeps no bfloat16: its bits, as unsigned integers."""
    return x.view(f"u{x.dtype.itemsize}") if x.dtype.kind == "V" else x


def _plain(x) -> np.ndarray:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _in_process(j, args) -> tuple[list, str, dict]:
    """Outputs, printed text and host calls of the jaxpr evaluated here."""
    codegen_corpus.CALLS.clear()
    ir_fuzz.build.CALLS.clear()
    printed = StringIO()
    with redirect_stdout(printed):
        outs = run(j, *args)
        jax.effects_barrier()
    return ([_plain(o) for o in outs], printed.getvalue(),
            dict(codegen_corpus.CALLS + ir_fuzz.build.CALLS))


@pytest.fixture(scope="module")
def standalone_runs(tmp_path_factory):
    """Every corpus program: its code, what it computes here and what its
    generated file computed in a fresh process."""
    folder = tmp_path_factory.mktemp("generated")
    here = {}
    for name, j, args in codegen_corpus.cases():
        code = ir.jaxpr_to_python_code(j)
        (folder / f"{name}.py").write_text(str(code))
        arrays = [np.asarray(a) for a in args]
        np.savez(folder / f"{name}.inputs.npz", **{f"arg{i}": _raw(a)
                                                   for i, a in enumerate(arrays)})
        (folder / f"{name}.dtypes.json").write_text(json.dumps([str(a.dtype) for a in arrays]))
        here[name] = (code, *_in_process(j, args))
    (folder.parent / "driver.py").write_text(DRIVER)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [tests, os.path.dirname(tests), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(folder.parent / "driver.py"), str(folder)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    printed = dict(re.findall(f"^{MARK}(\\S+)\\n(.*?)(?=^{MARK}|\\Z)", proc.stdout,
                              re.M | re.S))
    calls = json.loads((folder / "calls.json").read_text())
    there = {}
    for name in here:
        dtypes = json.loads((folder / f"{name}.out_dtypes.json").read_text())
        with np.load(folder / f"{name}.outputs.npz") as saved:
            outs = [saved[f"arr_{i}"].view(jax.numpy.dtype(d)) for i, d in enumerate(dtypes)]
        there[name] = (outs, printed[name], calls[name])
    return here, there


def test_the_corpus_covers_the_primitive_families():
    names = [name for name, _, _ in codegen_corpus.cases()]
    assert len(names) == len(set(names)) >= 30
    assert {"fuzz_plain_0", "fuzz_batched_0", "fuzz_differentiated_1"} <= set(names)


def test_the_corpus_runs_the_examples_and_the_installed_libraries_programs():
    names = {name for name, _, _ in codegen_corpus.cases()}
    examples = {p.stem for p in codegen_corpus.EXAMPLES.glob("*.py")}
    if not codegen_corpus.has("equinox"):  # (these examples' models are equinox modules)
        examples -= {"dropout_mlp", "mlp_running_stats"}
    for example in examples:
        assert any(n.startswith(f"example_{example}") for n in names), example
    for library, (_, modules) in codegen_corpus.LIBRARIES.items():
        assert any(n.startswith(f"{library}_") for n in names) == codegen_corpus.has(*modules), \
            library


def test_generated_files_run_standalone_and_compute_the_same_bits(standalone_runs):
    here, there = standalone_runs
    for name, (code, want, _, _) in here.items():
        got = there[name][0]
        assert not code.objects, (name, list(code.objects))
        assert "OBJECTS" not in code, name
        assert_bitwise(got, want, f"{name}:\n{code}")


def test_generated_files_print_and_call_back_as_the_jaxpr(standalone_runs):
    here, there = standalone_runs
    for name, (_, _, printed, calls) in here.items():
        assert there[name][1] == printed, name
        assert there[name][2] == calls, name
    assert here["debug_prints"][2].count("x is [") == 1
    assert here["host_callbacks"][3] == {"host_count": 1}
    assert sum(Counter(c).get("io", 0) for _, _, _, c in here.values()) > 0


def test_generated_code_reads_like_jax(standalone_runs):
    here, _ = standalone_runs
    code = {name: str(c[0]) for name, c in here.items()}
    expected = {
        "scatter_updates": ["lax.scatter_add(", "lax.scatter_mul(", "lax.scatter_min(",
                            "lax.scatter(", "mode=lax.GatherScatterMode.FILL_OR_DROP"],
        "debug_prints": ["jax.debug.print('x is {} and {y}', a, y=b)",
                         "jax.debug.print('sum {s:.3f}', s=", "ordered=True)"],
        "gathers": ["lax.gather(", "dimension_numbers=lax.GatherDimensionNumbers("],
        "matmuls": ["lax.dot_general(", "preferred_element_type=np.float32"],
        "reductions": ["lax.reduce_sum(", "lax.reduce_max(", "lax.argmax(", "lax.reduce((",
                       "lax.reduce_or(", "lax.reduce_xor("],
        "cumulative_and_sorts": ["lax.cumsum(", "lax.sort((", "lax.top_k("],
        "convolution": ["lax.conv_general_dilated(", "dimension_numbers=lax.ConvDimensionNumbers("],
        "dynamic_slices": ["lax.dynamic_slice(", "lax.dynamic_update_slice(",
                           "allow_negative_indices=False"],
        "shapes": ["lax.iota(np.int32, 6)", "lax.broadcasted_iota(", "lax.clamp(", "lax.pad(",
                   "lax.concatenate((", "lax.select_n("],
        "random_numbers": ["jax.random.key(", "jax.random.split(", "jax.random.fold_in(",
                           "jax.random.bits(", "impl='threefry2x32'"],
        "rng_bit_generator": ["lax.rng_bit_generator("],
        "host_callbacks": ["jax.pure_callback(_M_codegen_corpus.host_square, ",
                           "jax.pure_callback(np.sort, ", "vmap_method='sequential'",
                           "jax.experimental.io_callback(_M_codegen_corpus.host_count, "],
        "linear_algebra": ["lax.custom_linear_solve(", "lax.linalg.lu(",
                           "lax.linalg.triangular_solve("],
    }
    for name, snippets in expected.items():
        for snippet in snippets:
            assert snippet in code[name], (name, snippet, code[name])
    for name, text in code.items():
        assert "import " in text.split("\ndef ")[0], name  # imports at the top


def _bench_module():
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "bench" / "codegen_binds.py"
    spec = importlib.util.spec_from_file_location("taxpr_bench_codegen_binds", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reported_bind_counts_are_those_of_the_generated_code():
    # bench/results_codegen.json holds them per JAX version (written by
    # bench/codegen_binds.py); docs/ir.md's table is made from it.
    # The counts are recorded with every library of the corpus installed; with
    # fewer installed (the README's `[test]` extra), the programs of taxpr and
    # of each library installed are compared, source by source.
    bench = _bench_module()
    results = json.loads(bench.RESULTS.read_text())
    assert jax.__version__ in results, "run: python bench/codegen_binds.py --docs"
    recorded, now = results[jax.__version__], bench.count()
    missing = set(now["by_source"]) - set(recorded["by_source"])
    assert not missing, f"no counts recorded for {sorted(missing)}: run bench/codegen_binds.py"
    for source, counts in now["by_source"].items():
        assert counts == recorded["by_source"][source], source
    if now["libraries"] == recorded["libraries"]:
        assert now == recorded
    else:
        left_out = sorted(set(recorded["libraries"]) - set(now["libraries"]))
        print(f"the programs of {left_out} are not compared: not installed")
    assert bench.docs_table(results) in bench.DOCS.read_text()
    for r in results.values():
        assert not r["programs_reading_objects"]
        assert all(b["why"] != "no public function known" for b in r["bound"].values())

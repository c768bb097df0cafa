import os

# 4 simulated CPU devices for shard_map tests; must precede importing jax.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# XLA may otherwise skip rounding bfloat16 intermediates inside a fusion, so
# that the same bf16 computation rounds differently in two programs that
# fuse differently (the ir fuzzer compares programs bit for bit:
# test_ir_fuzz.py's test_bf16_chains_are_compared_without_xla_excess_precision).
if "xla_allow_excess_precision" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_allow_excess_precision=false"
# On a GPU, XLA times candidate convolution algorithms in each process and
# keeps the fastest, so one program may round differently in two processes
# (test_ir_codegen_standalone.py compares a generated file run in a fresh
# process with the original, bit for bit): the default algorithm everywhere.
if "xla_gpu_autotune_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_gpu_autotune_level=0"


def _cpu_only() -> bool:
    """Whether JAX can only use its CPU backend here (no accelerator plugin
    is installed, or ``JAX_PLATFORMS`` names only ``cpu``)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return {p.strip() for p in platforms.split(",")} <= {"cpu", ""}
    import importlib.metadata
    import importlib.util

    if tuple(importlib.metadata.entry_points(group="jax_plugins")):
        return False
    return importlib.util.find_spec("jax_plugins") is None


# Compiling is about half of the suite's time on a CPU (thousands of small
# programs, most run once). LLVM's optimisation level 0 compiles them about
# a sixth faster (XLA's HLO passes, fusion included, still run); the code
# runs slower, which the suite's small programs do not feel, and may round
# differently from the default level (a sum vectorised otherwise): every
# process of a run, those tests start included, uses the same level, so
# programs compared bit for bit are compiled alike. Accelerators keep their
# default.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"] and _cpu_only():
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

# One persistent compilation cache per test run, shared by the pytest-xdist
# workers and the Python processes tests start: a program that several tests
# compile (a reference and a rewritten program that lower alike; a fuzz
# program checked in several modes) is compiled once. It starts empty in each
# run (a result never depends on an earlier run) and is removed at the end by
# the process that made it. A JAX_COMPILATION_CACHE_DIR of the user's is used
# as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit  # noqa: E402
    import shutil  # noqa: E402
    import tempfile  # noqa: E402

    _CACHE_DIR = tempfile.mkdtemp(prefix="taxpr-tests-jax-cache-")
    atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_checks", True)


def _check_each_jaxpr_once() -> None:
    """Under ``jax_enable_checks`` JAX type-checks a jaxpr each time it is
    traced, lowered or nested in another one being checked, so a scan body
    inside a jit inside a ``custom_vjp`` is checked again with every
    enclosing jaxpr (a fifth to a third of a differentiated program's
    trace time). A jaxpr is immutable: one that passed is not checked again
    (the same object, under the same checking flags). Every jaxpr JAX
    checks is still checked once; a failing one fails every time."""
    import weakref

    from jax._src import config, core

    check = getattr(core, "check_jaxpr", None)
    if check is None:
        return
    flags = [getattr(config, name) for name in ("mutable_array_checks", "debug_key_reuse")
             if hasattr(config, name)]
    passed: "weakref.WeakKeyDictionary[core.Jaxpr, set]" = weakref.WeakKeyDictionary()

    def check_jaxpr(jaxpr):
        key = tuple(flag.value for flag in flags)
        try:
            seen = passed.get(jaxpr)
        except TypeError:  # not weakly referable: checked as JAX would
            return check(jaxpr)
        if seen is not None and key in seen:
            return None
        check(jaxpr)
        passed.setdefault(jaxpr, set()).add(key)
        return None

    check_jaxpr.__wrapped__ = check
    core.check_jaxpr = check_jaxpr


_check_each_jaxpr_once()
# Tests compare programs with eager/NumPy references at float32 tolerances:
# full float32 matmuls on every backend (GPUs default to TF32).
jax.config.update("jax_default_matmul_precision", "highest")

# The everyday suite, the README's `python -m pytest -q` (`addopts` in
# pyproject.toml: `-m 'not slow'`), leaves out the tests marked `slow`: these modules (the
# differential fuzzer, the benchmark smoke run and the examples compile whole
# programs many times: more than half of the full run), the cross product
# of inject's predicates and programs (test_engine.py; each program alone
# stays, in test_matches_eager), the rendering of the built site in Chromium
# (test_site.py) and of the viewer's pages (test_ir_view_browser.py), the
# generated code run standalone, the multi-process
# runs, the markers' own collections, the longest library and x64 tests and
# every `long` test. Marked here, in one place, rather than in each module.
SLOW_MODULES = frozenset({"test_fuzz.py", "test_bench_smoke.py", "test_examples.py",
                          "test_site.py", "test_ir_codegen_standalone.py",
                          "test_multiprocess.py", "test_markers.py",
                          "test_progress_terminal.py", "test_ir_view_browser.py"})
SLOW_TESTS = frozenset({("test_engine.py", "test_predicate_matches_eager"),
                        ("test_diffrax.py", "test_grad_of_a_harvest_of_a_solve_whose_vector_field_sows"),
                        ("test_diffrax.py",
                         "test_tx_value_and_grad_through_a_state_passed_as_the_solves_args"),
                        ("test_diffrax.py", "test_vmap_inside_pure_vector_field_reads_state"),
                        ("test_diffrax.py",
                         "test_grad_inside_of_vmap_inside_pure_vector_field_reads_state"),
                        ("test_capture_diffrax.py",
                         "test_the_gradient_of_the_solution_with_step_sizes_captured"),
                        ("test_capture_flax.py", "test_capture_under_grad_and_vmap"),
                        ("test_capture_flax.py", "test_the_attention_probabilities_of_every_"
                                                 "layer_are_flaxs_own_sown_weights"),
                        ("test_capture_equinox.py",
                         "test_attention_probabilities_and_a_head_ablated"),
                        ("test_capture_diffrax.py",
                         "test_step_sizes_under_vmap_per_initial_condition"),
                        ("test_diffrax.py",
                         "test_grad_from_outside_pure_of_solves_in_a_scan_reading_a_float_state"),
                        ("test_diffrax.py",
                         "test_grad_wrt_a_value_planted_in_the_vector_field_is_an_error_naming_it"),
                        ("test_x64.py", "test_ir_passes_and_codegen_on_programs_traced_with_x64"),
                        ("test_ir_codegen.py", "test_no_name_clashes_with_20_000_variables"),
                        ("test_ir_codegen.py",
                         "test_generated_code_reproduces_a_20_000_equation_fuzz_program"),
                        ("test_ir_view.py", "test_command_line_in_a_fresh_process"),
                        ("test_capture_in_library_rules.py",
                         "test_a_patch_in_a_diffrax_vector_field_under_grad_is_the_patched_derivative_or_an_error"),
                        ("test_capture_in_library_rules.py",
                         "test_a_patched_relu_in_a_neural_ode_differentiates_like_the_relu_patched_by_hand"),
                        ("test_diffrax.py", "test_grad_from_outside_pure"),
                        ("test_diffrax.py", "test_grad_inside_pure"),
                        ("test_diffrax.py", "test_vmap_over_states"),
                        ("test_capture_flax.py",
                         "test_patching_one_head_of_one_layer_is_the_hand_ablated_model"),
                        ("test_capture_flax.py",
                         "test_gradient_of_the_loss_with_respect_to_each_layers_attention_in_one_pass"),
                        ("test_equinox.py",
                         "test_gru_trained_with_its_hidden_state_in_a_state_by_truncated_bptt"),
                        ("test_ir_codegen.py", "test_code_without_objects_runs_in_a_fresh_process"),
                        ("test_optax.py", "test_lbfgs_zoom_linesearch_value_fn_reads_and_counts_state"),
                        ("test_diffrax.py", "test_sde_brownian_key_from_next_key"),
                        ("test_capture_flax.py",
                         "test_logit_lens_reads_the_residual_stream_after_each_block"),
                        ("test_capture_diffrax.py",
                         "test_the_step_sizes_the_controller_chose_are_the_solves_steps"),
                        ("test_equinox.py", "test_checkpointed_loop_grad_inside_draws_the_forwards_keys"),
                        ("test_equinox.py",
                         "test_checkpointed_loop_in_a_scan_grad_inside_draws_the_forwards_keys"),
                        ("test_equinox.py", "test_dropout_keys_from_next_key_match_hand_threaded"),
                        ("test_equinox.py",
                         "test_kv_cache_of_layers_stacked_with_filter_vmap_under_scan"),
                        ("test_capture_in_library_rules.py",
                         "test_a_patched_relu_in_an_equinox_mlp_differentiates_like_the_mlp_patched_by_hand"),
                        ("test_debug_libraries.py", "test_an_equinox_mlp_with_a_bad_initialization"),
                        ("test_capture_custom_rules.py",
                         "test_a_patch_inside_an_equinox_checkpointed_loop_matches_the_loop_written_patched"),
                        ("test_ir_fuzz.py",
                         "test_integer_division_by_a_zero_xla_can_prove_does_not_crash_the_fuzzer"),
                        ("test_random.py", "test_shard_map_gives_each_shard_fold_in_of_its_index"),
                        ("test_transforms.py", "test_perturb_under_vmap_per_example"),
                        # one parametrization: a docs page's code (test_docs.py)
                        ("test_docs.py", "test_docs_page_code_runs[coming-from-brainstate]"),
                        ("test_docs.py", "test_docs_page_code_runs[coming-from-flax-nnx]"),
                        ("test_docs.py", "test_docs_page_code_runs[coming-from-equinox]")})


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        name = getattr(item, "originalname", item.name)
        if (item.path.name in SLOW_MODULES or (item.path.name, name) in SLOW_TESTS
                or (item.path.name, item.name) in SLOW_TESTS
                or item.get_closest_marker("long")):
            item.add_marker(pytest.mark.slow)


# Modules whose tests share what they compute once per process (the
# benchmark smoke run's results; the codegen corpus, `codegen_corpus.cases()`,
# and its standalone run): under `pytest -n N` each runs in one worker, so
# that is computed once; every other test is dispatched on its own.
SHARED_FIXTURE_MODULES = frozenset({"test_bench_smoke.py", "test_ir_codegen_standalone.py"})


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            module = nodeid.split("::", 1)[0]
            return module if module.rsplit("/", 1)[-1] in SHARED_FIXTURE_MODULES else nodeid

    return Scheduling(config, log)

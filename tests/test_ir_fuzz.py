"""Differential fuzzing of the taxpr.ir passes: the tests. The generator,
the checks and the profiles are the package ``ir_fuzz`` (tests/ir_fuzz/)."""

from __future__ import annotations

import os
from collections import Counter

import jax
import numpy as np
import pytest

from taxpr import _jaxpr, _traverse, ir

from ir_fuzz.build import traced_program
from ir_fuzz.checks import check_program
from ir_fuzz.generator import VMAP_REJECTIONS, VMAP_REJECTS, _walk, program, vmappable
from ir_fuzz.profiles import (BATCHED_SEEDS, CI_COUNT, DIFFERENTIATED_SEEDS, LONG_COUNT,
                              LONG_SEED, _log, long_profile_modes)
from ir_fuzz.regressions import (BF16_CHAIN_AFTER_FOLDED_COND, NAN_EXP_PROGRAMS,
                                 PROVABLE_ZERO_DIVISOR, SCAN_OF_FOLDED_CONSTANTS,
                                 UNUSED_CALLS_OF_TAG_ONLY_JAXPRS,
                                 WHILE_OF_TAGS_IN_A_JIT_CALLED_TWICE,
                                 XLA_FOLDING_DEPARTS_FROM_EAGER)
from ir_helpers import assert_bitwise, run


def test_generator_covers_every_feature():
    kinds: Counter = Counter(s[0] for seed in range(CI_COUNT) for s in _walk(program(seed)))
    for k in ("bin", "un", "constexpr", "copy", "tag", "callback", "bf_bin", "ibin",
              "scan", "cond", "while", "jit", "ckpt"):
        assert kinds[k] > 0, (k, kinds)


@pytest.mark.parametrize("seed", range(CI_COUNT))
def test_passes_preserve_outputs_effects_and_tags(seed):
    check_program(seed)


@pytest.mark.parametrize("seed", BATCHED_SEEDS)
def test_passes_preserve_outputs_effects_and_tags_of_vmapped_programs(seed):
    check_program(seed, batched=True)


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("seed", DIFFERENTIATED_SEEDS)
def test_passes_preserve_outputs_effects_and_tags_of_differentiated_programs(seed, batched):
    # What jax.jvp makes of a program (tangent equations beside the primal
    # ones, jvp-named jits, symbolic zeros instantiated), vmapped too when
    # vmappable; tangents include NaN, inf and -0.0.
    if batched and not vmappable(program(seed)):
        pytest.skip("vmap rejects an io_callback in a cond/while")
    check_program(seed, batched=batched, differentiated=True)


def test_vmapped_programs_hold_what_vmap_makes_of_control_flow():
    # The condition the batched mode creates: a cond whose predicate vmap
    # batches runs both branches and selects (select_n, no cond left); a
    # while whose predicate it batches keeps a predicate per example (its
    # cond_jaxpr returns bool[3]: while_p loops while any holds and selects
    # each example's carry, which lax.while_loop cannot express).
    written, traced = Counter(), Counter()
    for seed in BATCHED_SEEDS:
        stmts, _, j = traced_program(seed, batched=True)
        written.update(s[0] for s in _walk(stmts))
        traced.update(e.primitive.name for e, _ in _traverse.iter_eqns(j))
    assert written["cond"] > traced["cond"], (written, traced)  # some became selects
    assert traced["select_n"], traced
    batched_whiles = [e for seed in BATCHED_SEEDS
                      for e, _ in _traverse.iter_eqns(traced_program(seed, batched=True)[2])
                      if e.primitive.name == "while"
                      and _jaxpr.jaxpr_parts(e.params["cond_jaxpr"]).outvars[0].aval.shape]
    assert batched_whiles, traced


def test_programs_vmap_rejects_are_exactly_those_with_an_io_callback_in_a_cond_or_while():
    for seed in range(CI_COUNT * 2):
        stmts = program(seed)
        if vmappable(stmts):
            continue
        with pytest.raises(Exception, match=VMAP_REJECTS) as rejected:
            traced_program(seed, batched=True)
        (message,) = [m for m in VMAP_REJECTIONS if m in str(rejected.value)]
        assert type(rejected.value) is VMAP_REJECTIONS[message], (seed, rejected.value)


def test_integer_division_by_a_zero_xla_can_prove_does_not_crash_the_fuzzer():
    # JAX 0.10's XLA folds rem(1, i0 - i0) at compile time and the process
    # dies of SIGFPE (the original program, before any taxpr pass). Run in a
    # subprocess, so that a crash fails this test only.
    import subprocess
    import sys
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import jax; "
            "jax.config.update('jax_enable_checks', True); import ir_fuzz.checks; "
            f"ir_fuzz.checks.check_program({PROVABLE_ZERO_DIVISOR})")
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", code, here, os.path.dirname(here)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert ("ibin", "i0", "sub", "i0", "i0") in program(PROVABLE_ZERO_DIVISOR)
    assert ("ibin", "i1", "rem", ("lit", 1), "i0") in program(PROVABLE_ZERO_DIVISOR)


def test_bf16_chains_are_compared_without_xla_excess_precision():
    # Folding a cond index lets XLA fuse a bfloat16 chain differently, and
    # with excess precision allowed it skips a bf16 rounding in one program
    # only (1.1992188 vs 1.203125). tests/conftest.py turns excess precision
    # off, so both programs round every bf16 op.
    assert "--xla_allow_excess_precision=false" in os.environ["XLA_FLAGS"]
    check_program(BF16_CHAIN_AFTER_FOLDED_COND)


@pytest.mark.parametrize("seed", [
    *(pytest.param(seed, id=name) for name, seed in UNUSED_CALLS_OF_TAG_ONLY_JAXPRS.items()),
    *(pytest.param(seed, id=name) for name, seed in WHILE_OF_TAGS_IN_A_JIT_CALLED_TWICE.items()),
])
def test_dce_keeps_unused_calls_of_jaxprs_holding_tags(seed):
    # JAX's DCE rules drop an unused cond / scan / while whose body holds
    # only (effect-free) tags, and JAX's caches of DCE results (filled while
    # jitting the original) would bypass taxpr's rules.
    check_program(seed)


def test_folding_a_computation_that_reads_known_constants_evaluates_it():
    # A scan whose inputs are folded constants is evaluated with those
    # inputs (JAX 0.12's DCE moves the constants into the jaxpr's inputs).
    check_program(SCAN_OF_FOLDED_CONSTANTS)


@pytest.mark.parametrize("seed, output, departs_on",
                         [pytest.param(*case, id=name) for name, case
                          in XLA_FOLDING_DEPARTS_FROM_EAGER.items()])
def test_folded_constants_equal_what_jax_computes_eagerly(seed, output, departs_on):
    # XLA's compile-time folding of the original (-0.0 - -0.0 -> -0.0;
    # tanh(1.5) 1 ulp off) differs from the same program evaluated eagerly;
    # constant_fold follows eager.
    _, args, j = traced_program(seed)
    folded = run(ir.constant_fold(j), *args)
    eager = run(j, *args, jit=False)
    assert_bitwise(folded, eager, f"seed={seed}")
    if jax.default_backend() in departs_on:  # XLA's own folding is the odd one out
        with pytest.raises(AssertionError):
            assert_bitwise([folded[output]], [run(j, *args)[output]])
    check_program(seed)


@pytest.mark.parametrize("seed, output", [pytest.param(*case, id=name) for name, case
                                          in NAN_EXP_PROGRAMS.items()])
def test_outputs_xla_computes_wrongly_are_compared_eagerly(seed, output):
    # JAX 0.10.2's XLA CPU backend computes exp of a fused NaN constant as
    # garbage, in the original program as in the folded one. Eagerly both
    # give NaN, as IEEE says: constant_fold keeps the program's meaning, and
    # the fuzzer judges it by that.
    _, args, j = traced_program(seed)
    folded = ir.constant_fold(j)
    assert np.isnan(run(j, *args, jit=False)[output]).all()
    assert np.isnan(run(folded, *args, jit=False)[output]).all()
    check_program(seed)


@pytest.mark.long
def test_passes_preserve_outputs_effects_and_tags_long():
    # Every program runs (a finding does not hide the next ones); progress
    # goes to TAXPR_IR_FUZZ_LOG when set, so a long run can be followed.
    log = os.environ.get("TAXPR_IR_FUZZ_LOG")
    failures = []
    transformed_runs = 0
    for n, seed in enumerate(range(LONG_SEED, LONG_SEED + LONG_COUNT), 1):
        modes = long_profile_modes(seed)
        transformed_runs += len(modes) - 1
        for batched, differentiated in modes:
            try:
                check_program(seed, batched, differentiated)
            except Exception as e:  # noqa: BLE001 - every finding is reported below
                failures.append(f"seed {seed} batched={batched} differentiated="
                                f"{differentiated}: {type(e).__name__}: {str(e)[:2000]}")
                _log(log, failures[-1])
        if n % 100 == 0 or n == LONG_COUNT:
            _log(log, f"{n} programs up to seed {seed} ({transformed_runs} also transformed): "
                      f"{len(failures)} failures")
    assert not failures, "\n".join(failures)

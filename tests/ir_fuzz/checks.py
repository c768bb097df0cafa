"""Running a program through every pass and comparing it with the original.

``check_program(seed, batched, differentiated)`` traces the program of
``seed`` (``build.traced_program``) and runs each of ``VARIANTS`` (every
pass, the pipeline and Python code generation, ``regenerate``) on it:
``check_jaxpr`` passes, each output is bitwise equal to the jitted
original's or else to the eager original's
(``assert_bitwise_to_jit_or_eager``, ``_EagerReference``), and the host
callback calls (``_calls``, counted in ``build.CALLS``) and the tags are
unchanged.
"""

from __future__ import annotations

import jax
import numpy as np

import taxpr as tx
from taxpr import _jaxpr, ir

from ir_helpers import assert_bitwise, check, run

from .build import CALLS, traced_program


VARIANTS = {
    "constant_fold": ir.constant_fold,
    "algebraic_simplification": ir.algebraic_simplification,
    "copy_propagation": ir.copy_propagation,
    "common_subexpression_elimination": ir.common_subexpression_elimination,
    "dead_code_elimination": ir.dead_code_elimination,
    "optimize_jaxpr": ir.optimize_jaxpr,
    "jaxpr_to_python_code": lambda j: regenerate(j),
}


def regenerate(j):
    """The jaxpr of the Python code generated from ``j`` (its function traced
    at ``j``'s input types): codegen is checked like a pass."""
    code = ir.jaxpr_to_python_code(j)
    avals = [v.aval for v in _jaxpr.jaxpr_parts(j).invars]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    return jax.make_jaxpr(code.load())(*specs)


def _identity(j) -> tuple:
    """What determines ``j``'s results: its text and its constants' bytes."""
    consts = _jaxpr.jaxpr_parts(j).consts or ()
    return str(j), tuple((np.asarray(c).dtype.str, np.asarray(c).shape, np.asarray(c).tobytes())
                         for c in consts)


class _EagerReference:
    """The original's outputs evaluated equation by equation (computed only
    when needed: it is slow).

    XLA folds constant-only expressions itself when it compiles the original,
    and not always as it computes them at run time: ``-0.0 - -0.0`` becomes
    ``-0.0`` (its ``A - 0 -> A`` also matches -0.0) where IEEE and the
    eager op give ``+0.0``; ``tanh`` of a constant is folded with the C
    library's ``tanh``, 1 ulp from XLA's own kernel. taxpr folds with
    JAX's eager semantics, so an output may equal the eager original where
    the jitted original differs: both are what JAX computes for the program.
    """

    def __init__(self, j, args):
        self._j, self._args, self._out = j, args, None

    def outputs(self):
        if self._out is None:
            self._out = run(self._j, *self._args, jit=False)
        return self._out


def _bitwise_equal(a, b) -> bool:
    try:
        assert_bitwise([a], [b])
    except AssertionError:
        return False
    return True


def assert_bitwise_to_jit_or_eager(got, want, eager: _EagerReference,
                                   variant_eager: _EagerReference, what: str) -> None:
    """Each output bitwise equal to the jitted original's, or else to the
    eager original's (see :class:`_EagerReference`), or else judged by what
    the variant says.

    Where the compiled variant equals neither, XLA compiled the variant or
    the original (or both) to something other than what the program says:
    the variant evaluated eagerly must then equal the original evaluated
    eagerly. Seen on JAX 0.10.2's CPU backend: ``exp`` of a fused NaN
    constant (``exp(0.5 / nan + x)``) returns garbage that changes from run
    to run (``NAN_EXP_PROGRAMS``), in the original as in the variant, and
    is sometimes NaN in one of them only.
    """
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if _bitwise_equal(g, w):
            continue
        reference = eager.outputs()[i]
        if _bitwise_equal(g, reference):
            continue
        departs = "the compiled original too" if not _bitwise_equal(w, reference) else "only it"
        assert_bitwise([variant_eager.outputs()[i]], [reference],
                       f"{what} output={i} (the compiled variant departs from eager, "
                       f"{departs}; both eager)")


def _tags(j):
    return sorted(str(s.path) for s in tx.find_tags(j))


def _calls(j, args):
    CALLS.clear()
    out = run(j, *args)
    jax.effects_barrier()
    return out, dict(CALLS)


def check_program(seed: int, batched: bool = False, differentiated: bool = False) -> None:
    stmts, args, j = traced_program(seed, batched, differentiated)
    want, want_calls = _calls(j, args)
    eager = _EagerReference(j, args)
    tags = _tags(j)
    # A variant identical to the original or to an earlier variant (same
    # text, same constants) computes what that one did: it is not compiled
    # and run again (compiling dominates the fuzzer's time).
    ran = {_identity(j): (want, want_calls)}
    for name, p in VARIANTS.items():
        what = (f"seed={seed} batched={batched} differentiated={differentiated} pass={name} "
                f"program={stmts}")
        o = p(j)
        check(o)
        key = _identity(o)
        if key not in ran:
            ran[key] = _calls(o, args)
        got, got_calls = ran[key]
        assert_bitwise_to_jit_or_eager(got, want, eager, _EagerReference(o, args), what)
        assert got_calls == want_calls, (what, got_calls, want_calls)
        assert _tags(o) == tags, what

"""The replacements of JAX's rules (``taxpr._patches``): each checks the
signature of what it wraps when it is installed, and installing again
wraps nothing twice."""

from __future__ import annotations

import pytest
from jax._src.interpreters import partial_eval as pe

import taxpr  # noqa: F401  (installs the replacements)
from taxpr import _patches
from taxpr._patches._wrap import expect_signature


def test_a_jax_function_whose_signature_changed_is_an_import_error_naming_it():
    def process_custom_vjp_call(self, primitive, fun, tracers, *, out_trees):
        """JAX's method as a future JAX might define it: no fwd / bwd."""

    with pytest.raises(ImportError, match=r"JAX's JVPTrace\.process_custom_vjp_call takes "
                                          r"\(self, primitive, fun, tracers, \*, out_trees\); "
                                          r"taxpr wraps it passing 6 arguments by position "
                                          r"and out_trees, symbolic_zeros by name"):
        expect_signature(process_custom_vjp_call, "JVPTrace.process_custom_vjp_call", 6,
                         ("out_trees", "symbolic_zeros"))


def test_the_signatures_of_this_jax_are_the_ones_wrapped():
    expect_signature(lambda self, prim, fun, fwd, bwd, tracers, /, *, out_trees, symbolic_zeros:
                     None, "a method as JAX defines it", 6, ("out_trees", "symbolic_zeros"))
    expect_signature(lambda *args, **kwargs: None, "a rule taking anything", 6, ("branches",))


def test_installing_again_wraps_nothing_twice():
    before = {name: getattr(pe.JaxprTrace, name)
              for name in ("process_custom_jvp_call", "process_custom_vjp_call")}
    rules = dict(pe.custom_partial_eval_rules)
    memoize = pe._memoize
    _patches.install()
    assert pe._memoize is memoize
    assert {n: getattr(pe.JaxprTrace, n) for n in before} == before
    assert dict(pe.custom_partial_eval_rules) == rules

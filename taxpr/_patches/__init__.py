"""Every change taxpr makes to JAX's own rules and functions, in one place.

Only ``taxpr/__init__`` imports this package, and calls ``install()`` once. taxpr's own primitives (tags,
``taxpr_key``, replay reads) register their rules where they are defined;
what is listed here replaces or wraps something JAX defines for its own
primitives. Each replacement falls through to JAX's original whenever the
program holds no tag, so a tag-free program traces to the same jaxpr and
lowers to the same StableHLO with and without taxpr
(``tests/test_leaves_jax_as_found.py`` checks it in two processes).

| What is replaced | By | Why | What taxpr relies on |
|---|---|---|---|
| batching rule of ``cond`` | ``_guards.cond_batching_rule`` | a batched index runs every branch for every example: tags there get a per-example guard | JAX's rule for a cond without tags, or with an unbatched index |
| batching rule of ``while`` | ``_guards.while_batching_rule`` | a batched predicate runs the body while any example runs: tags there get a guard (also equinox's loops, which reduce the predicate over the batch) | JAX's rule otherwise |
| partial-eval rule of ``cond`` (``JaxprTrace``) | ``_partial_eval.cond_partial_eval`` | a ``cond`` whose branches hold kept tags is staged whole (JAX dropped a staged cond without used outputs, and a ``set_state`` with it) | JAX's rule otherwise |
| partial-eval rule of ``while`` (``JaxprTrace``, around the staging scope below) | ``_partial_eval.while_partial_eval`` | while a loop is split, a ``while`` of known inputs holding kept tags is staged whole (not hoisted out of a scan) | JAX's rule otherwise |
| partial-eval rule of ``checkpoint`` | ``_partial_eval.remat_partial_eval`` | while a loop is split, a checkpoint holding kept tags is staged whole (not hoisted out of a scan, not run by both parts of a while) | JAX's rule otherwise |
| ``partial_eval_jaxpr_custom`` rule of ``while`` (``checkpoint``'s partial evaluation, a scan's) | ``_partial_eval.while_partial_eval_custom`` | a ``while`` holding kept tags is staged whole: JAX's rule runs a known loop and then the whole loop again (the tags twice), and fails on a kept tag whose known output feeds the carry | JAX's rule otherwise |
| partial-eval rules of ``while`` and ``scan``; ``loops._scan_known_hoisting`` | the same rule in a staging scope (``_jax.flags.in_staging_scope``) | inside them, kept tags with known inputs are staged: eager runs them once per step | the rules themselves, unchanged |
| ``ad.linearize_from_jvp`` | the same function in a scope that evaluates known kept tags | a custom_jvp rule under ``grad`` must keep its primal outputs known | the function itself, unchanged |
| ``JaxprTrace.process_custom_jvp_call`` / ``process_custom_vjp_call`` | ``_wrap.unhoisted_custom_call`` | while a loop is split, a custom function holding kept tags stays in the loop | the methods themselves, unchanged |
| ``pe._memoize`` (the thunk that traces a staged custom rule once) | one memoized thunk per taxpr scope (``_wrap.install_custom_vjp_scopes``) | a staged custom_vjp fwd / custom_jvp rule differentiated again in another scope (equinox's checkpointed loop: speculatively, then in its bwd) is traced again there, as JAX's trace caches do per trace context | ``_memoize`` itself, unchanged |
| ``bind_with_trace`` of ``custom_jvp_call`` / ``custom_vjp_call`` | the same method with the rules (jvp; fwd and bwd) run in the ``tx.scope`` of the call (``_state._scope.rules_in_call_scope``) | JAX traces a rule when it differentiates, outside the scope: its states must have the function's names | the method itself, unchanged; outside scopes and taxpr's transformations the rules are not wrapped |
| ``JVPTrace`` / ``LinearizeTrace.process_custom_vjp_call`` | the same method with the fwd and bwd run in a new scope (``primitives._tag.scoped_fwd_bwd``) | inside a taxpr transformation, tags in a fwd are the forward pass's and those in a bwd's recomputation replay it (not applied twice) | the method itself, unchanged; outside taxpr's transformations the fwd and bwd are not wrapped |

Every wrapper is marked ``_taxpr_wrapped``, so installing twice (a reload)
wraps once.
"""
from __future__ import annotations

from .. import _compat
from .._guards import cond_batching_rule, while_batching_rule
from .._state._scope import rules_in_call_scope
from ..primitives._tag import current_scope_key, holds_kept_tags, scoped_fwd_bwd
from . import _partial_eval
from ._wrap import (install_custom_vjp_scopes, install_known_kept_tag_scopes,
                    install_rules_in_call_scope, wrap_batching_rule, wrap_partial_eval_custom_rule,
                    wrap_partial_eval_rule)


def install() -> None:
    """Make every replacement of the table above (once)."""
    wrap_batching_rule(_compat.cond_p, cond_batching_rule)
    wrap_batching_rule(_compat.while_p, while_batching_rule)
    wrap_partial_eval_rule(_compat.cond_p, _partial_eval.cond_partial_eval)
    wrap_partial_eval_rule(_compat.remat_p, _partial_eval.remat_partial_eval)
    wrap_partial_eval_custom_rule(_compat.while_p, _partial_eval.while_partial_eval_custom)
    install_known_kept_tag_scopes(holds_kept_tags)
    # Around the while rule's staging scope: it reads the enclosing one.
    wrap_partial_eval_rule(_compat.while_p, _partial_eval.while_partial_eval)
    install_custom_vjp_scopes(scoped_fwd_bwd, current_scope_key)
    install_rules_in_call_scope(rules_in_call_scope)

"""taxpr's partial-evaluation rules of JAX's ``cond``, ``while`` and
``checkpoint``: a loop or branch holding kept tags is staged whole where
JAX's rule would run its tags a different number of times than eagerly
(see the table in ``taxpr._patches``). Each falls through to JAX's rule
(``original``) for everything else."""

from __future__ import annotations

from .._jax.internals import core

from .. import _compat
from .._jax import flags
from ..primitives._tag import holds_kept_tags


def staged_whole(trace, prim, tracers, params: dict):
    """``prim`` bound as one staged equation, all its inputs made unknown
    (the partial evaluator keeps an effectful one)."""
    tracers = [trace.instantiate_const(t) for t in tracers]
    return trace.default_process_primitive(prim, tracers, params)


def cond_partial_eval(original, trace, index, *operands, branches, **params):
    """Partial evaluation stages a ``cond`` whose branches hold kept tags
    whole. JAX's rule (index known) splits each branch into a known and a
    staged part, but keeps the staged ``cond`` only when its outputs are used:
    a ``set_state`` in a branch (no used output) was dropped, e.g. under
    ``jax.vjp`` of a ``scan`` whose body has such a ``cond``. Staged whole, the
    ``cond`` is an effectful equation the partial evaluator always keeps.
    Not while JAX linearizes from a JVP (as ``_tag_partial_eval``): there
    JAX's split keeps the known kept tags in its known ``cond``."""
    if index.pval.is_known() and flags.staging_known_kept_tags() and any(
            holds_kept_tags(b.effects) for b in branches):
        return staged_whole(trace, _compat.cond_p, (index, *operands),
                             dict(branches=branches, **params))
    return original(trace, index, *operands, branches=branches, **params)


def remat_partial_eval(original, trace, *tracers, jaxpr, **params):
    """While partial evaluation splits a loop (``flags.splitting_a_loop``),
    a ``checkpoint`` holding kept tags is staged whole. JAX's rule splits its
    body with ``partial_eval_jaxpr_custom``, which puts a tag with known inputs
    in the known part: hoisted out of a scan (run once) or run by a while's
    known loop and again by its staged loop (twice)."""
    if (flags.staging_known_kept_tags() and flags.splitting_a_loop()
            and holds_kept_tags(jaxpr.effects)):
        return staged_whole(trace, _compat.remat_p, tracers, dict(jaxpr=jaxpr, **params))
    return original(trace, *tracers, jaxpr=jaxpr, **params)


def while_partial_eval(original, trace, *tracers, body_jaxpr, cond_jaxpr, **params):
    """While a loop is split, a ``while`` whose inputs are all known and
    whose body or predicate holds kept tags is staged whole: JAX's rule
    evaluates it as known, and a differentiated scan then hoists it out of
    its loop (run once instead of every step)."""
    params = dict(body_jaxpr=body_jaxpr, cond_jaxpr=cond_jaxpr, **params)
    if (flags.staging_known_kept_tags() and flags.splitting_a_loop()
            and all(t.pval.is_known() for t in tracers)
            and holds_kept_tags((*body_jaxpr.effects, *cond_jaxpr.effects))):
        return staged_whole(trace, _compat.while_p, tracers, params)
    return original(trace, *tracers, **params)


def while_partial_eval_custom(original, saveable, unks_in, inst_in, eqn):
    """``partial_eval_jaxpr_custom`` (a ``checkpoint``'s partial evaluation,
    a differentiated scan's) of a ``while`` whose body or predicate holds
    kept tags. JAX's rule splits the body into a known loop and runs the
    whole loop again as the staged part, so the tags would run twice; and a
    kept tag in the known part whose output feeds the carry would have to be
    a per-step residual, which a while cannot save (JAX asserts). A loop
    whose inputs are all known is known whole (it runs once, in the known
    part, as a known effectful equation would); one with unknown inputs is
    staged whole, as JAX's rule does for an unknown predicate, where
    partial evaluation stages kept tags (not while JAX linearizes from a
    JVP: its primal outputs must stay known, and JAX's rule applies)."""
    params = eqn.params
    if not holds_kept_tags((*params["body_jaxpr"].effects, *params["cond_jaxpr"].effects)):
        return original(saveable, unks_in, inst_in, eqn)
    n_carry = len(eqn.outvars)
    if not any(unks_in):
        return eqn, None, [False] * n_carry, [False] * n_carry, []
    if flags.staging_known_kept_tags():
        residuals = [x for x, inst in zip(eqn.invars, inst_in)
                     if type(x) is core.Var and not inst]
        return None, eqn, [True] * n_carry, [True] * n_carry, residuals
    return original(saveable, unks_in, inst_in, eqn)

"""Guards: tags inside a ``cond`` / ``while_loop`` whose predicate vmap batches.

Under ``vmap``, JAX turns a ``cond`` whose index is batched into running
every branch for every example and selecting the outputs, and a
``while_loop`` whose predicate is batched into running the body for every
example while any example still runs. The tags inside then run for examples
that eagerly would not run them. Their effects must not happen there.

taxpr wraps the batching rules of ``cond`` and ``while`` (only when the
predicate is batched and the sub-jaxprs contain tags; JAX's own rule is used
untouched otherwise) so that every tag inside gets a *guard*: an extra last
operand, a boolean that is true exactly for the examples that really execute
the tag (``index == i`` in branch ``i``; the loop's predicate in a while
body). Guards of nested conds/loops are and-ed. The site rules then make
each effect a masked update where that has a per-example meaning, and raise
a clear error where it has none (see ``_inject``, ``_state``, ``harvest``).

The guard is threaded through nested primitives (scan, while, cond, jit,
checkpoint, custom_jvp/vjp, shard_map) by the threading engine itself, with
the guard as the context.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
from ._jax.internals import core
from ._jax.internals import batching

from . import _compat, _jaxpr, _per_example, _traverse
from ._engine import Engine, Level, inline
from .primitives._tag import is_guarded, meta, tag_p, with_meta

_BOOL = core.ShapedArray((), jnp.bool_)


def batch_closed_jaxpr(closed: Any, axis_data: Any, in_axes: Sequence[Any],
                       out_axes: Sequence[Any]) -> Any:
    """``closed`` batched by ``axis_data`` (in/out batch axes, None unbatched)."""
    return batching.batch_jaxpr_axes(closed, axis_data, list(in_axes), list(out_axes))[0]


def batched_outputs(closed: Any, axis_data: Any, in_batched: Sequence[bool],
                    instantiate: Any) -> list[bool]:
    """Which outputs of ``closed`` are batched given which inputs are."""
    return list(batching.batch_jaxpr(closed, axis_data, list(in_batched), instantiate)[1])


def batch_at_front(x: Any, dim: Any, axis_data: Any) -> Any:
    """``x`` with its batch axis first (broadcast when unbatched)."""
    return batching.bdim_at_front(x, dim, axis_data.size)


def has_tags(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` contains a tag (at any depth)."""
    return any(eqn.primitive is tag_p for eqn, _ in _traverse.iter_eqns(jaxpr))


class _GuardSites:
    """Site rule that guards every tag by the context (the guard)."""

    def __init__(self, label: str):
        self.label = label
        self._and: dict = {}

    def _combine(self, level: Level, old: Any, new: Any) -> Any:
        avals = (old.aval, new.aval)
        key = (avals, id(level.context))
        closed = self._and.get(key)
        if closed is None:
            fn = lambda a, b: [jnp.logical_and(a, b)]  # noqa: E731
            closed = self._and[key] = level.trace(fn, avals)
        return inline(level, closed, [old, new])[0]

    def __call__(self, engine: Engine, eqn, level: Level, ctx: list) -> list:
        if eqn.primitive is not tag_p:  # tangents have no effect of their own
            level.emit(eqn)
            return ctx
        (guard,) = ctx
        ins = [level.atom(v) for v in eqn.invars]
        where = self.label + ("/" + "/".join(level.path) if level.path else "")
        if is_guarded(eqn.params):
            ins[-1] = self._combine(level, ins[-1], guard)
            params = with_meta(eqn.params, guard_from=(where, *meta(eqn.params).guard_from))
        else:
            ins.append(guard)
            params = with_meta(eqn.params, guard=(), guard_from=(where,))
        level.eqns.append(eqn.replace(invars=ins, params=params))
        return ctx


def guard_jaxpr(closed: Any, label: str) -> Any:
    """``closed`` taking a boolean guard as a new first input, every tag in it
    (at any depth) guarded by it. ``label`` names the part (for messages)."""
    engine = Engine(_GuardSites(label), None, [_BOOL])
    n_out = len(_jaxpr.jaxpr_parts(closed).outvars)
    threaded = engine.thread_jaxpr(closed, (), 0, n_out)
    return _jaxpr.with_parts(threaded, outvars=_jaxpr.jaxpr_parts(threaded).outvars[:n_out])


# ---- cond ---------------------------------------------------------------------------

def cond_batching_rule(original, axis_data, args, dims, *, branches, **params):
    """JAX's rule runs every branch and selects; here every branch's tags are
    guarded by ``index == i``. Unlike JAX's rule, unbatched operands stay
    unbatched (JAX broadcasts them, which would make e.g. a state's init read
    in a branch look per-example)."""
    if dims[0] is None or params.get("branches_platforms") \
            or not any(has_tags(b) for b in branches):
        return original(axis_data, args, dims, branches=branches, **params)
    index = batch_at_front(args[0], dims[0], axis_data)
    ops = [x if d is None else batch_at_front(x, d, axis_data)
           for x, d in zip(args[1:], dims[1:])]
    op_axes = [None if d is None else 0 for d in dims[1:]]
    n_out = len(_jaxpr.jaxpr_parts(branches[0]).outvars)
    outs = []
    for i, branch in enumerate(branches):
        # As JAX's rule: an example's inputs to an untaken branch do not
        # get derivatives (no NaN gradients from the untaken branch).
        taken = jnp.equal(index, i)
        safe = [x if a is None else _untaken_stopped(taken, x) for x, a in zip(ops, op_axes)]
        if not has_tags(branch):  # nothing to guard: the branch as JAX batches it
            batched = batch_closed_jaxpr(branch, axis_data, op_axes, [0] * n_out)
            outs.append(_jaxpr.jaxpr_as_fun(batched)(*safe))
            continue
        # The branch's tags guarded by whether each example takes it.
        guarded = guard_jaxpr(branch, f"cond[branch={i}]")
        batched = batch_closed_jaxpr(guarded, axis_data, [0, *op_axes], [0] * n_out)
        outs.append(_jaxpr.jaxpr_as_fun(batched)(taken, *safe))
    return [jax.lax.select_n(_bcast(index, o[0]), *o) for o in zip(*outs)], [0] * n_out


def _untaken_stopped(taken, x):
    """``x`` where an example takes the branch, ``stop_gradient(x)`` where
    not (in the order JAX's rule binds them)."""
    stopped = jax.lax.stop_gradient(x)
    return jax.lax.select_n(_bcast(taken, x), stopped, x)


def _bcast(pred, x):
    """``pred`` (batch axis only) broadcast to the shape of ``x``."""
    if jnp.ndim(x) == jnp.ndim(pred):
        return pred
    return jax.lax.broadcast_in_dim(pred, jnp.shape(x), (0,))


# ---- while --------------------------------------------------------------------------

def while_batching_rule(original, axis_data, args, dims, *, cond_nconsts, cond_jaxpr,
                         body_nconsts, body_jaxpr):
    params = dict(cond_nconsts=cond_nconsts, cond_jaxpr=cond_jaxpr,
                  body_nconsts=body_nconsts, body_jaxpr=body_jaxpr)
    if not (has_tags(cond_jaxpr) or has_tags(body_jaxpr)):
        return original(axis_data, args, dims, **params)
    cc, bc = cond_nconsts, body_nconsts
    batched = [d is not None for d in dims]
    cconst_bat, bconst_bat, carry_bat = batched[:cc], batched[cc:cc + bc], batched[cc + bc:]
    for _ in range(1 + len(carry_bat)):  # the fixpoint JAX's rule computes
        out_bat = batched_outputs(body_jaxpr, axis_data, bconst_bat + carry_bat, carry_bat)
        if out_bat == carry_bat:
            break
        carry_bat = [a or b for a, b in zip(carry_bat, out_bat)]
    (pred_bat,) = batched_outputs(cond_jaxpr, axis_data, cconst_bat + carry_bat, False)
    if not pred_bat:
        # A predicate reduced over the batch (equinox's loops, and so
        # diffrax's and optimistix's solves, run while any example runs):
        # the loop is per example all the same, with each example's own
        # predicate the reduction's operand.
        own = _own_predicate(cond_jaxpr)
        if own is None or not batched_outputs(own, axis_data, cconst_bat + carry_bat, False)[0]:
            return original(axis_data, args, dims, **params)
        return _while_guarded_by_own_predicate(original, axis_data, args, dims, own, **params)
    return _masked_while(axis_data, args, dims, **params)


def _while_guarded_by_own_predicate(original, axis_data, args, dims, own, *, cond_nconsts,
                                    cond_jaxpr, body_nconsts, body_jaxpr):
    """JAX's rule for a loop that runs while any example runs and masks its
    own carry, its body's tags guarded by each example's own predicate at the
    start of the step (the library's carry, step counter included, stays as
    JAX batches it)."""
    cc, bc = cond_nconsts, body_nconsts
    own_fn = _jaxpr.jaxpr_as_fun(own)
    guarded = _jaxpr.jaxpr_as_fun(guard_jaxpr(body_jaxpr, "while[body]"))

    def body(*a):
        cvals, bvals, carry = a[:cc], a[cc:cc + bc], a[cc + bc:]
        (running,) = own_fn(*cvals, *carry)
        return guarded(running, *bvals, *carry)

    avals = [*_jaxpr.in_avals(cond_jaxpr)[:cc], *_jaxpr.in_avals(body_jaxpr)]
    new_body = _jaxpr.trace_flat(body, avals, "while_body_guarded")
    cconsts, rest = args[:cc], args[cc:]
    return original(axis_data, [*cconsts, *cconsts, *rest], [*dims[:cc], *dims[:cc], *dims[cc:]],
                    cond_nconsts=cc, cond_jaxpr=cond_jaxpr, body_nconsts=cc + bc,
                    body_jaxpr=new_body)


def _own_predicate(cond_jaxpr: Any) -> Any | None:
    """``cond_jaxpr`` giving each example's own predicate where it reduces
    its predicate over a vmap batch (``_per_example``), else None."""
    parts = _jaxpr.jaxpr_parts(cond_jaxpr)
    eqns = list(parts.eqns)
    own = _per_example.per_example_value(parts.eqns, parts.outvars[0], eqns.append)
    if own is None:
        return None
    # Only what the example's predicate needs: the reductions are left out
    # (batched, they would reduce over the batch again: equinox's
    # ``nonbatchable`` raises), and the body evaluates this again each step,
    # so a predicate that needs an effect or a tag is not taken apart.
    kept = [eqns[i] for i in _per_example.producers(eqns, own)]
    for eqn in kept:
        if eqn.effects or eqn.primitive is tag_p or any(
                has_tags(sj) for _, sj in _traverse.subjaxprs(eqn)):
            raise NotImplementedError(
                f"taxpr: a while loop that runs while any example of a vmap batch runs "
                f"(equinox's loops) computes each example's predicate with "
                f"'{eqn.primitive.name}', which has an effect or holds tags: its body's "
                f"tags cannot be guarded per example. vmap the transformed function "
                f"instead, or keep effects out of the loop's condition")
    return _jaxpr.with_parts(cond_jaxpr, eqns=kept, outvars=[own], effects=core.no_effects)


def _masked_while(axis_data, args, dims, *, cond_nconsts, cond_jaxpr, body_nconsts,
                  body_jaxpr):
    """A while loop whose predicate is batched, as a loop with a scalar
    predicate (any example still running) that carries each example's
    predicate ``p`` and runs ``if p: carry = body(carry); p = cond(carry)``
    per example: body and cond tags are guarded by ``p``, and the cond runs
    once per real iteration, as eagerly (plus once before the loop)."""
    cc, bc = cond_nconsts, body_nconsts
    cconsts, bconsts, init = args[:cc], args[cc:cc + bc], args[cc + bc:]
    cdims, bdims, idims = dims[:cc], dims[cc:cc + bc], dims[cc + bc:]
    carry_avals = _jaxpr.in_avals(body_jaxpr)[bc:]
    body = _jaxpr.jaxpr_as_fun(guard_jaxpr(body_jaxpr, "while[body]"))
    cond = (_jaxpr.jaxpr_as_fun(guard_jaxpr(cond_jaxpr, "while[cond]"))
            if has_tags(cond_jaxpr) else None)
    plain_cond = _jaxpr.jaxpr_as_fun(cond_jaxpr)

    def step(*a):
        cvals, bvals, (p, *carry) = a[:cc], a[cc:cc + bc], a[cc + bc:]
        new = body(p, *bvals, *carry)
        (p_new,) = cond(p, *cvals, *new) if cond is not None else plain_cond(*cvals, *new)
        kept = [jax.lax.select_n(p, c, n) for c, n in zip(carry, new)]
        return [jnp.logical_and(p, p_new), *kept]

    step_avals = [*_jaxpr.in_avals(cond_jaxpr)[:cc], *_jaxpr.in_avals(body_jaxpr)[:bc],
                  _BOOL, *carry_avals]
    per_example = _jaxpr.trace_flat(step, step_avals, "while_body_masked")
    n = len(init)
    step_batched = batch_closed_jaxpr(
        per_example, axis_data, [*cdims, *bdims, 0, *[0] * n], [0] * (n + 1))
    init = [batch_at_front(x, d, axis_data) for x, d in zip(init, idims)]
    cond_batched = batch_closed_jaxpr(cond_jaxpr, axis_data, [*cdims, *[0] * n], [0])
    (p0,) = _jaxpr.jaxpr_as_fun(cond_batched)(*cconsts, *init)
    loop_avals = _jaxpr.in_avals(step_batched)[cc + bc:]
    any_running = _jaxpr.trace_flat(lambda p, *c: [jnp.any(p)], loop_avals, "any_running")
    outs = _compat.while_p.bind(*cconsts, *bconsts, p0, *init, cond_nconsts=0,
                                cond_jaxpr=any_running, body_nconsts=cc + bc,
                                body_jaxpr=step_batched)
    return outs[1:], [0] * n


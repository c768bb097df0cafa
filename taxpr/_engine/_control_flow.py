"""Thread rules of JAX's calls and control flow: jit and closed calls,
``scan``, ``while``, ``cond``, ``checkpoint`` and ``shard_map``."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import jax

from .._jax.internals import config, core, shard_map_internals
from .. import _compat, _jaxpr, _per_example, _traverse
from ._api import (Level, NO_CHANNELS, aval_of, emit_rebuilt_eqn, format_path, inline,
                   register_thread_rule, sub_label)


def _call_rule(key: str, sharded: bool):
    """jit / closed_call: ctx enters first and leaves last; the call stays a call."""

    def rule(engine, eqn, level, ctx, subs):
        n = len(ctx)
        sub = eqn.params[key]
        path = level.path + (sub_label(subs, key),)
        new = engine.thread_jaxpr(sub, path, 0, len(_jaxpr.jaxpr_parts(sub).outvars),
                                  level.context)
        ctx_out = engine.fresh_ctx()
        feeds, collects = engine.pass_channels(level, new)
        updates = {}
        if sharded:
            p = eqn.params
            unspec = _jaxpr.unspecified_sharding()
            nf, nk = len(feeds), len(collects)
            updates = dict(
                in_shardings=(unspec,) * n + tuple(p["in_shardings"]) + (unspec,) * nf,
                out_shardings=tuple(p["out_shardings"]) + (unspec,) * (n + nk),
                in_layouts=(None,) * n + tuple(p["in_layouts"]) + (None,) * nf,
                out_layouts=tuple(p["out_layouts"]) + (None,) * (n + nk),
                donated_invars=(False,) * n + tuple(p["donated_invars"]) + (False,) * nf,
            )
        emit_rebuilt_eqn(level, eqn, {(key, None): new}, [*ctx, *eqn.invars, *feeds],
                      [*eqn.outvars, *ctx_out, *collects], **updates)
        return ctx_out

    return rule


register_thread_rule(_compat.jit_p, _call_rule("jaxpr", sharded=True))
for _p in _compat.CLOSED_CALL_PRIMITIVES:
    register_thread_rule(_p, _call_rule("call_jaxpr", sharded=False))


def _scan_rule(engine, eqn, level, ctx, subs):
    p = eqn.params
    n = len(ctx)
    nc, nk = _jaxpr.scan_counts(p)
    nx = len(eqn.invars) - nc - nk
    ny = len(eqn.outvars) - nk
    body = engine.thread_jaxpr(p["jaxpr"], level.path + (sub_label(subs, "jaxpr"),), nc, 0,
                               level.context)
    ctx_out = engine.fresh_ctx()
    feeds, collects = engine.pass_channels(level, body, length=p["length"])
    updates = _jaxpr.scan_params(p, nc, nk + n, nx + len(feeds), ny + len(collects))
    updates = {k: v for k, v in updates.items() if k != "jaxpr"}
    emit_rebuilt_eqn(level, eqn, {("jaxpr", None): body},
                  [*eqn.invars[:nc], *ctx, *eqn.invars[nc:], *feeds],
                  [*ctx_out, *eqn.outvars, *collects], **updates)
    return ctx_out


register_thread_rule(_compat.scan_p, _scan_rule)


def _with_unused_inputs(closed, at: int, avals) -> Any:
    invars = _jaxpr.jaxpr_parts(closed).invars
    new = [_jaxpr.new_var(a) for a in avals]
    return _jaxpr.with_parts(closed, invars=[*invars[:at], *new, *invars[at:]])


def _while_rule(engine, eqn, level, ctx, subs):
    """The cond runs before each iteration and once more at the end, so with
    tags in the cond the loop carries ``(ctx, pred, carry)`` and the body
    re-evaluates the cond (as checkify does). A cond that reduces its
    predicate over a vmap batch (equinox's loops) also carries the predicate
    per example, which masks the body's ctx updates (``_per_example``)."""
    p = eqn.params
    cc, bc = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, carry = (eqn.invars[:cc], eqn.invars[cc:cc + bc], eqn.invars[cc + bc:])
    body = engine.thread_jaxpr(p["body_jaxpr"], level.path + ("while[body]",), bc, 0,
                               level.context)
    engine.pass_channels(level, body, where="while_loop")
    ctx_out = engine.fresh_ctx()
    over_batch = any(e.primitive in _per_example.OVER_BATCH_PRIMITIVES
                     for e in _jaxpr.jaxpr_parts(p["cond_jaxpr"]).eqns)
    if not over_batch and not engine.has_selected(p["cond_jaxpr"]):
        cond = _with_unused_inputs(p["cond_jaxpr"], cc, engine.ctx_avals)
        emit_rebuilt_eqn(level, eqn, {("cond_jaxpr", None): cond, ("body_jaxpr", None): body},
                      [*cconsts, *bconsts, *ctx, *carry], [*ctx_out, *eqn.outvars])
        return ctx_out
    cond = engine.thread_jaxpr(p["cond_jaxpr"], level.path + ("while[cond]",), cc, 1,
                               level.context)
    engine.pass_channels(level, cond, where="while_loop")
    # With a per-example predicate the cond returns (pred, *ctx, pred per example).
    per_example_cond = _per_example.with_per_example_output(cond, 0) if over_batch else None
    masked = per_example_cond is not None
    cond = per_example_cond if masked else cond
    n = len(ctx)
    # Before the loop: evaluate the cond once.
    pred0, *rest = inline(level, cond, [*map(level.atom, cconsts), *ctx, *map(level.atom, carry)])
    ctx1, keep0 = rest[:n], rest[n:]
    # New body: (cconsts, bconsts, ctx, pred, [keep,] carry) -> (ctx, pred, [keep,] carry).
    inner = Level(level.path + ("while[body]",), level.context)
    v_cc = [_jaxpr.new_var(v.aval) for v in cconsts]
    v_bc = [_jaxpr.new_var(v.aval) for v in bconsts]
    v_ctx = engine.fresh_ctx()
    v_pred = _jaxpr.new_var(core.ShapedArray((), jax.numpy.bool_))
    v_keep = [_jaxpr.new_var(v_pred.aval) for _ in keep0]
    v_carry = [_jaxpr.new_var(v.aval) for v in carry]
    outs = inline(inner, body, [*v_bc, *v_ctx, *v_carry])
    ctx2, carry2 = outs[:n], outs[n:]
    pred2, *rest2 = inline(inner, cond, [*v_cc, *ctx2, *carry2])
    ctx3, keep2 = rest2[:n], rest2[n:]
    if masked:
        # An example whose own predicate was false ran this step only because
        # another one had not finished: its ctx stays as it was.
        ctx3 = _keep_where(inner, lambda keep: keep, v_keep, ctx3, v_ctx)
    hv, hc = inner.hoisted()
    body_effects = _traverse.effects_of_eqns(inner.eqns)
    new_body = _jaxpr.make_closed(hv, hc, [*v_cc, *v_bc, *v_ctx, v_pred, *v_keep, *v_carry],
                                   inner.eqns, [*ctx3, pred2, *keep2, *carry2], body_effects,
                                   _jaxpr.jaxpr_parts(p["body_jaxpr"]).debug_info)
    c_ctx = engine.fresh_ctx()
    c_pred = _jaxpr.new_var(v_pred.aval)
    c_keep = [_jaxpr.new_var(v.aval) for v in v_keep]
    c_carry = [_jaxpr.new_var(v.aval) for v in carry]
    new_cond = _jaxpr.make_closed([], [], [*c_ctx, c_pred, *c_keep, *c_carry], [], [c_pred],
                                   core.no_effects, _jaxpr.jaxpr_parts(p["cond_jaxpr"]).debug_info)
    emit_rebuilt_eqn(level, eqn, {("cond_jaxpr", None): new_cond, ("body_jaxpr", None): new_body},
                  [*cconsts, *bconsts, *ctx1, pred0, *keep0, *carry],
                  [*ctx_out, core.DropVar(v_pred.aval), *(core.DropVar(v.aval) for v in v_keep),
                   *eqn.outvars],
                  cond_nconsts=0, body_nconsts=cc + bc)
    return ctx_out


def _keep_where(level: Level, keep_fn: Callable, keep_atoms: Sequence[Any], new: Sequence[Any],
                old: Sequence[Any]) -> list:
    """``new`` where ``keep_fn(*keep_atoms)`` (a boolean scalar) holds, else
    ``old``, leaf by leaf; leaves that did not change are passed through."""
    changed = [i for i, (a, b) in enumerate(zip(new, old)) if a is not b]
    if not changed:
        return list(new)
    k = len(keep_atoms)

    def select(*args):
        keep = keep_fn(*args[:k])
        news, olds = args[k:k + len(changed)], args[k + len(changed):]
        return [jax.lax.select(keep, a, b) for a, b in zip(news, olds)]

    avals = [*(aval_of(a) for a in keep_atoms), *(aval_of(new[i]) for i in changed),
             *(aval_of(old[i]) for i in changed)]
    selected = inline(level, level.trace(select, avals),
                      [*keep_atoms, *(new[i] for i in changed), *(old[i] for i in changed)])
    result = list(new)
    for i, v in zip(changed, selected):
        result[i] = v
    return result


register_thread_rule(_compat.while_p, _while_rule)


def _cond_rule(engine, eqn, level, ctx, subs):
    """Every branch threads ctx (untaken branches pass it through)."""
    branches = eqn.params["branches"]
    threaded = []
    for i, b in enumerate(branches):
        path = level.path + (sub_label(subs, "branches", i),)
        threaded.append(engine.thread_jaxpr(b, path, 0, len(_jaxpr.jaxpr_parts(b).outvars),
                                            level.context))
    chans = [engine.channels(t) for t in threaded]
    engine.hooks.branches([c.collects for c in chans], level.path)
    # Every branch takes every fed value (in one order), used or not.
    feed_sig = dict(kv for c in chans for kv in c.feeds)
    new = {("branches", i): _with_feeds(engine, t, c.feeds, feed_sig)
           for i, (t, c) in enumerate(zip(threaded, chans))}
    ctx_out = engine.fresh_ctx()
    here = lambda k: level.channel(k.site, k.stacked)  # noqa: E731
    feeds = [a for k, avals in feed_sig.items() for a in level.feed(here(k), avals)]
    collects = []
    for k, avals in chans[0].collects:
        vs = [_jaxpr.new_var(a) for a in avals]
        level.collect(here(k), vs)
        collects.extend(vs)
    emit_rebuilt_eqn(level, eqn, new, [eqn.invars[0], *ctx, *eqn.invars[1:], *feeds],
                  [*eqn.outvars, *ctx_out, *collects])
    # A branch index reduced over a vmap batch (equinox's bounded loop runs a
    # step while any example runs): an example whose own index is false took
    # the first branch eagerly, so its ctx is that branch's.
    index = level.atom(eqn.invars[0])
    if (_per_example.reduces_an_inner_batch(level.eqns, index)
            and any(engine.has_selected(b) for b in branches)):
        raise NotImplementedError(
            f"taxpr: the cond at {format_path(level.path)} takes one branch for a whole "
            f"batch of a vmap inside the transformed function (its index is reduced over "
            f"that batch, as in equinox's bounded loop), and its branches hold tags: which "
            f"examples take a branch is not known there. Apply the taxpr transformation "
            f"inside the vmap, or vmap the transformed function")
    per_example = _per_example.per_example_value(level.eqns, index, level.eqns.append)
    if per_example is not None:
        own_ctx = ctx
        if engine.has_selected(branches[0]):
            first = threaded[0]
            if _jaxpr.jaxpr_parts(first).effects or chans[0] != NO_CHANNELS:
                raise NotImplementedError(
                    f"taxpr: the cond at {format_path(level.path)} takes one branch for a "
                    f"whole vmap batch (its index is reduced over the batch); an example "
                    f"whose own index is false takes the first branch eagerly, and that "
                    f"branch has effects or collects values that cannot be given per example")
            n_out = len(eqn.outvars)
            own_ctx = inline(level, first, [*ctx, *map(level.atom, eqn.invars[1:])])[n_out:]
        ctx_out = _keep_where(level, lambda own, batch: own == batch, [per_example, index],
                              ctx_out, own_ctx)
    return ctx_out


def _with_feeds(engine, threaded, has: tuple, want: dict) -> Any:
    """``threaded`` taking the fed values ``want`` (in that order) last."""
    if tuple(k for k, _ in has) == tuple(want):
        return threaded
    invars = _jaxpr.jaxpr_parts(threaded).invars
    n_has = sum(len(avals) for _, avals in has)
    base, fed = invars[:len(invars) - n_has], iter(invars[len(invars) - n_has:])
    own = {k: [next(fed) for _ in avals] for k, avals in has}
    new_feeds = [v for k, avals in want.items()
                 for v in own.get(k, [_jaxpr.new_var(a) for a in avals])]
    return _jaxpr.with_parts(threaded, invars=[*base, *new_feeds])


register_thread_rule(_compat.cond_p, _cond_rule)


def _open_call_rule(key: str, extra_in_params: Callable | None = None,
                    body_context: Callable | None = None):
    """remat / shard_map: the sub-jaxpr is open, so consts the engine added
    become leading inputs fed from the enclosing jaxpr."""

    def rule(engine, eqn, level, ctx, subs):
        sub = eqn.params[key]
        path = level.path + (sub_label(subs, key),)
        context = body_context(eqn) if body_context else level.context
        threaded = engine.thread_jaxpr(sub, path, 0, len(_jaxpr.jaxpr_parts(sub).outvars), context)
        constvars, consts, invars, eqns, outvars, effects, dbg = _jaxpr.jaxpr_parts(threaded)
        new = _jaxpr.make_jaxpr_like(sub, [], [], [*constvars, *invars], eqns, outvars,
                                      effects, dbg)
        hoisted = [level.const_var(c) for c in consts]
        ctx_out = engine.fresh_ctx()
        feeds, collects = engine.pass_channels(level, threaded)
        updates = (extra_in_params(eqn, len(hoisted), len(ctx), len(feeds), len(collects))
                   if extra_in_params else {})
        emit_rebuilt_eqn(level, eqn, {(key, None): new}, [*hoisted, *ctx, *eqn.invars, *feeds],
                      [*eqn.outvars, *ctx_out, *collects], **updates)
        return ctx_out

    return rule


register_thread_rule(_compat.remat_p, _open_call_rule("jaxpr"))


def shard_map_body_context(params: dict) -> contextlib.ExitStack:
    """The tracing context of a shard_map body (manual axes, abstract mesh,
    vma checking), so code traced for the body gets the body's types."""
    sm, use_abstract_mesh = shard_map_internals()
    mesh, axes = params["mesh"], params.get("newly_manual_axes", frozenset())
    stack = contextlib.ExitStack()
    stack.enter_context(sm._extend_axis_env(mesh, axes))
    stack.enter_context(use_abstract_mesh(sm._as_manual_mesh(mesh, axes)))
    stack.enter_context(config._check_vma(params.get("check_vma", True)))
    return stack


class ShardMapBody:
    """Tracing context of one shard_map's body (see ``Level.context``)."""

    def __init__(self, params: dict):
        self.params = params
        # Without vma checking, values carry no varying axes: site rules
        # cannot see whether a value is the same on every shard.
        self.checks_vma = _jaxpr.shard_map_checks_vma(params)

    def __call__(self):
        return shard_map_body_context(self.params)


def _shard_map_specs(eqn, n_hoisted: int, n_ctx: int, n_feeds: int, n_collects: int) -> dict:
    """ctx, hoisted consts and channels enter and leave replicated (site
    rules make sure what they store is the same on every shard)."""
    from jax.sharding import PartitionSpec
    p = eqn.params
    rep = PartitionSpec()
    return dict(in_specs=(rep,) * (n_hoisted + n_ctx) + tuple(p["in_specs"]) + (rep,) * n_feeds,
                out_specs=tuple(p["out_specs"]) + (rep,) * (n_ctx + n_collects))


register_thread_rule(_compat.shard_map_p, _open_call_rule(
    "jaxpr", _shard_map_specs, lambda eqn: ShardMapBody(eqn.params)))

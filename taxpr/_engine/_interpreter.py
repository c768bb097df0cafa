"""The interpreter: ``Engine`` walks a jaxpr's equations, rewrites the
selected tags by the client's site rule and hands a higher-order primitive
holding one to its thread rule."""

from __future__ import annotations

import itertools
import operator
from typing import Any, Callable, Sequence

from .._jax.internals import core
from .. import _compat, _jaxpr, _replay, _traverse
from .._find import TAG_PRIMITIVES, is_selected
from ..primitives._tag import meta, site_key, tag_cotangent_p, tag_p, tag_tangent_p, user_params
from ._api import (Channels, Hooks, Level, NO_CHANNELS, RULE_PATH_SUFFIXES, THREAD_RULES,
                   aval_of, describe_site, describe_tag, format_path,
                   in_custom_vjp, inline)


class Engine:
    """Threads a context (fixed leaf avals) through a jaxpr.

    Arguments:
        site_rule: ``site_rule(engine, eqn, level, ctx) -> new ctx`` rewrites a
            selected tag (or tag tangent/cotangent) equation.
        predicate: selects tags (``None``: all).
        ctx_avals: avals of the ctx leaves.
    """

    def __init__(self, site_rule: Callable, predicate: Callable | None,
                 ctx_avals: Sequence[core.AbstractValue], hooks: Hooks | None = None):
        self.site_rule = site_rule
        self.hooks = hooks or Hooks()
        self._channels = _traverse.IdMemo()  # threaded jaxpr -> its Channels
        self.predicate = predicate
        self.ctx_avals = list(ctx_avals)
        self._selected = _traverse.IdMemo()  # (jaxpr, maybe_rules) -> has_selected
        # (jaxpr, ctx positions, context) -> (threaded jaxpr, context kept alive)
        self._threaded = _traverse.IdMemo()
        # The ctx leaves that a site inside each threaded jaxpr changes
        # (``writes``), collected while threading: one set per jaxpr being
        # threaded, innermost last.
        self._written = _traverse.IdMemo()  # threaded jaxpr -> frozenset of ctx leaves
        self._writing: list[set[int]] = []
        # Whether a bwd's tags are threaded as a replay (``_replay``; not
        # where only the forward pass matters: the states' values at first use).
        self.replays = True
        # What the forward passes wrote and collected: per custom_vjp scope
        # (``TagMeta.fwd_scopes``) and per site key (for ``TagMeta.function_sites``).
        self._fwd_written: dict[int, set[int]] = {}
        self._written_by_site: dict[frozenset, set[int]] = {}
        self._fwd_collecting: dict[int, set[frozenset]] = {}
        self._collecting_sites: set[frozenset] = set()
        # Whether a replay read was left after a level's cleanup (checked
        # once the outermost jaxpr is threaded).
        self._replay_reads_left = False

    def writes(self, threaded: Any) -> frozenset[int]:
        """The ctx leaves a site in ``threaded`` (a result of ``thread_jaxpr``)
        may change, in it or in any jaxpr nested in it."""
        return self._written.get(threaded, default=frozenset())

    # ---- selection ----------------------------------------------------------
    def has_selected(self, jaxpr: Any, maybe_rules: bool = False) -> bool:
        """Whether ``jaxpr`` holds a selected tag, in itself, a nested jaxpr
        or a custom_jvp rule that ``RulePolicy.has_selected`` answers for.
        ``maybe_rules``: also count the custom_jvp functions whose rules may
        hold one (``RulePolicy.may_hold_sites``), outside custom_vjp
        functions (a bwd replays its forward: what it runs is the body's)."""
        found = self._selected.get(jaxpr, maybe_rules)
        if found is not None:
            return found
        found = False
        for eqn in _jaxpr.jaxpr_parts(jaxpr).eqns:
            if is_selected(eqn, self.predicate) or self._rule_selected(eqn, maybe_rules):
                found = True
                break
            inner_maybe = maybe_rules and eqn.primitive is not _compat.custom_vjp_call_p
            if any(self.has_selected(sj, inner_maybe) for _, sj in _traverse.subjaxprs(eqn)):
                found = True
                break
        return self._selected.set(jaxpr, found, maybe_rules)

    def _rule_selected(self, eqn, maybe_rules: bool = False) -> bool:
        if eqn.primitive is _compat.custom_vjp_call_p:
            return self.hooks.rules.has_selected(self, eqn)
        if eqn.primitive is not _compat.custom_jvp_call_p:
            return False
        return (self.hooks.rules.has_selected(self, eqn)
                or (maybe_rules and self.hooks.rules.may_hold_sites))

    # ---- the interpreter ----------------------------------------------------
    def thread_eqns(self, eqns: Sequence[core.JaxprEqn], level: Level, ctx: list) -> list:
        for eqn in eqns:
            prim = eqn.primitive
            if prim is tag_p or prim is tag_tangent_p or prim is tag_cotangent_p:
                if is_selected(eqn, self.predicate):
                    ctx = self.thread_site(eqn, level, ctx)
                    continue
            else:
                subs = _traverse.subjaxprs(eqn)
                maybe = not in_custom_vjp(level.path)
                inner_maybe = maybe and prim is not _compat.custom_vjp_call_p
                if subs and (any(self.has_selected(sj, inner_maybe) for _, sj in subs)
                             or self._rule_selected(eqn, maybe)):
                    rule = THREAD_RULES.get(prim)
                    if rule is None:
                        inner = next((e for _, sj in subs for e, _ in _traverse.iter_eqns(sj)
                                      if is_selected(e, self.predicate)), None)
                        if inner is None and self.hooks.rules.may_hold_sites:
                            level.emit(eqn)  # only rules that may hold none: left as is
                            continue
                        held = (describe_tag(user_params(inner.params)) if inner is not None
                                else "selected tags in its derivative rule")
                        # In a derivative rule JAX runs when the result is
                        # differentiated from outside, the primitive's own
                        # implementation cannot stand in for a thread rule.
                        in_rule = any(p.endswith(RULE_PATH_SUFFIXES) for p in level.path)
                        raise NotImplementedError(
                            f"taxpr: cannot thread a context through primitive "
                            f"'{prim.name}' at {format_path(level.path)}: it holds {held} "
                            f"and taxpr has no rule for it. "
                            + ("It is in a derivative rule JAX runs when the transformed "
                               "function is differentiated from outside: take the derivative "
                               "inside the transformed function instead (docs/limitations.md), "
                               "or register a rule" if in_rule else "Register one")
                            + " with taxpr.register_thread_rule(primitive, rule) (see "
                            "'Adding a primitive' in taxpr's documentation, docs/extending.md)")
                    ctx = rule(self, eqn, level, ctx, subs)
                    continue
                if prim is _replay.replay_read_p:  # left by another layer's replay
                    self._replay_reads_left = True
            level.emit(eqn)
        return ctx

    def thread_site(self, eqn: core.JaxprEqn, level: Level, ctx: list) -> list:
        """A selected tag's equation rewritten by ``site_rule``; a tag that a
        custom_vjp's bwd binds is a replay of the forward pass (``_replay``)."""
        params = eqn.params
        marks = meta(params)
        replay = marks.replay_scope if self.replays else None
        replayed: set[int] = set()
        if replay is not None:
            replayed.update(self._fwd_written.get(replay, ()))
            for key in marks.function_sites:
                replayed.update(self._written_by_site.get(key, ()))
        site_ctx = ctx
        if replayed:
            site_ctx = list(ctx)
            for i in replayed:
                site_ctx[i], = inline(level, _replay.replay_read(
                    aval_of(ctx[i]), i, replay), [ctx[i]])
                level.dropped.append(site_ctx[i])
        n_collected = len(level.collected)
        new_ctx = self.site_rule(self, eqn, level, site_ctx)
        if len(level.collected) > n_collected:
            self._collects(params, replay, level, n_collected)
        if replayed:
            new_ctx = list(new_ctx)
            for i in replayed:
                if new_ctx[i] is not site_ctx[i]:
                    level.dropped.append(new_ctx[i])
                new_ctx[i] = ctx[i]
        told, level.changed = level.changed, None
        if told is not None and told[0] is new_ctx and site_ctx is ctx:
            changed = set(told[1])
        elif new_ctx is ctx:  # (a site rule never mutates the ctx it is given)
            changed = set()
        else:
            changed = set(changed_positions(ctx, new_ctx))
        if self._writing:
            self._writing[-1].update(changed)
        if changed:
            for k in marks.fwd_scopes:
                if replay is None or k < replay:
                    self._fwd_written.setdefault(k, set()).update(changed)
            if replay is None:
                self._written_by_site.setdefault(site_key(params), set()).update(changed)
        return new_ctx

    def _collects(self, params: dict, replay: int | None, level: Level, since: int) -> None:
        """A site collected values (``level.collected[since:]``): recorded as
        the forward's, or dropped where a replay collects them again."""
        key = site_key(params)
        if replay is None:
            self._collecting_sites.add(key)
            for k in meta(params).fwd_scopes:
                self._fwd_collecting.setdefault(k, set()).add(key)
        elif key in self._fwd_collecting.get(replay, ()) or (
                key in meta(params).function_sites and key in self._collecting_sites):
            for _, atoms in level.collected[since:]:
                level.dropped.extend(atoms)
            del level.collected[since:]

    def thread_jaxpr(self, jaxpr: Any, path: tuple[str, ...], in_pos: int, out_pos: int,
                     context: Callable | None = None):
        """``jaxpr`` with ctx inputs at ``in_pos`` and ctx outputs at
        ``out_pos``, as a closed jaxpr (consts the engine added included)."""
        key = (in_pos, out_pos, id(context))
        hit = self._threaded.get(jaxpr, *key)
        if hit is not None:
            if self._writing:
                self._writing[-1].update(self.writes(hit[0]))
            return hit[0]
        constvars, consts, invars, eqns, outvars, effects, dbg = _jaxpr.jaxpr_parts(jaxpr)
        if consts is None:
            raise NotImplementedError(
                f"taxpr: open jaxpr with free constvars at {format_path(path)}")
        level = Level(path, context)
        ctx_in = [_jaxpr.new_var(a) for a in self.ctx_avals]
        self._writing.append(set())
        try:
            ctx_out = self.thread_eqns(eqns, level, ctx_in)
        finally:
            written = frozenset(self._writing.pop())
        if self._writing:
            self._writing[-1].update(written)
        outs = [level.atom(v) for v in outvars]
        if level.dropped:
            level.eqns = drop_unused_producers(
                level.eqns, level.dropped,
                [*outs, *ctx_out, *(a for _, atoms in level.collected for a in atoms)])
            self._replay_reads_left |= _replay.holds_replay_read(level.eqns)
        hv, hc = level.hoisted()
        feed_vars = [v for vs in level.feeds.values() for v in vs]
        collected = [a for _, atoms in level.collected for a in atoms]
        result = _jaxpr.make_closed(
            [*constvars, *hv], [*consts, *hc],
            [*invars[:in_pos], *ctx_in, *invars[in_pos:], *feed_vars],
            level.eqns,
            [*outs[:out_pos], *ctx_out, *outs[out_pos:], *collected],
            _traverse.recompute_effects(effects, eqns, level.eqns), dbg)
        if level.collected or level.feeds:
            self._channels.set(result, Channels(
                tuple((k, tuple(aval_of(a) for a in atoms)) for k, atoms in level.collected),
                tuple((k, tuple(v.aval for v in vs)) for k, vs in level.feeds.items())))
        self._threaded.set(jaxpr, (result, context), *key)
        self._written.set(result, written)
        if self._replay_reads_left and not self._writing:
            self._replay_reads_left = False
            live = _replay.live_replay_read(result)
            if live is not None:
                raise self.hooks.replay_read(live[0], live[1])
        return result

    def thread_read_only(self, jaxpr: Any, path: tuple[str, ...], in_pos: int,
                         context: Callable | None = None) -> Any:
        """``jaxpr`` taking the ctx leaves as inputs at ``in_pos`` and
        returning only its own outputs, for primitives whose outputs are
        fixed (e.g. ``custom_linear_solve``): the tags in it may read ctx but
        not change it.

        Raises:
            NotImplementedError: a selected tag in ``jaxpr`` changes ctx, or
                collects or is fed values (names the tags and ``path``).
        """
        n_out = len(_jaxpr.jaxpr_parts(jaxpr).outvars)
        threaded = self.thread_jaxpr(jaxpr, path, in_pos, n_out, context)
        parts = _jaxpr.jaxpr_parts(threaded)
        n = len(self.ctx_avals)
        ctx_in, ctx_out = parts.invars[in_pos:in_pos + n], parts.outvars[n_out:n_out + n]
        changed = any(o is not i for o, i in zip(ctx_out, ctx_in))
        if changed or self.channels(threaded) != NO_CHANNELS:
            tags = [describe_site(user_params(e.params), path + p)
                    for e, p in _traverse.iter_eqns(jaxpr) if is_selected(e, self.predicate)]
            raise NotImplementedError(
                f"taxpr: the selected tags in {format_path(path)} change the context or "
                f"collect/feed values, but there it can only be read: {'; '.join(tags)}")
        return _jaxpr.with_parts(threaded, outvars=parts.outvars[:n_out])

    def channels(self, threaded: Any) -> Channels:
        return self._channels.get(threaded, default=NO_CHANNELS)

    def pass_channels(self, level: Level, threaded: Any, length: int | None = None,
                      where: str | None = None) -> tuple[list, list]:
        """Connect ``threaded``'s channels to ``level``: returns the extra
        (inputs, outputs) of the equation calling it. With ``length`` (scan)
        fed values are sliced and collected values stacked along a new
        leading axis; with ``where`` (a loop that cannot) any channel is an
        error."""
        ch = self.channels(threaded)
        if where is not None and (ch.collects or ch.feeds):
            key = (ch.collects or ch.feeds)[0][0]
            raise self.hooks.loop_channel(key, where, level.path)
        stacked = length is not None
        stack = (lambda a: a.update(shape=(length, *a.shape))) if stacked else (lambda a: a)
        here = lambda k: level.channel(k.site, k.stacked or stacked)  # noqa: E731
        ins = [a for k, avals in ch.feeds for a in level.feed(here(k), [stack(x) for x in avals])]
        outs = []
        for k, avals in ch.collects:
            vs = [_jaxpr.new_var(stack(a)) for a in avals]
            level.collect(here(k), vs)
            outs.extend(vs)
        return ins, outs

    def fresh_ctx(self) -> list:
        return [_jaxpr.new_var(a) for a in self.ctx_avals]


def changed_positions(before: Sequence[Any], after: Sequence[Any]) -> list[int]:
    """The positions where ``after`` holds another object than ``before``
    (ctx leaves a site changed), compared in C: a site runs per state, and
    ctx has one leaf per state."""
    return list(itertools.compress(range(len(before)), map(operator.is_not, before, after)))


def drop_unused_producers(eqns: list, dropped: Sequence[Any], roots: Sequence[Any]) -> list:
    """``eqns`` without the equations that computed only ``dropped`` atoms
    (and, transitively, only their inputs), where nothing else uses them.
    Equations with effects, and calls holding tags, are kept."""
    uses: dict = {}
    for a in roots:
        if type(a) is core.Var:
            uses[a] = uses.get(a, 0) + 1
    producer: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if type(v) is core.Var:
                uses[v] = uses.get(v, 0) + 1
        for o in eqn.outvars:
            producer[o] = i
    removed: set = set()
    todo = [a for a in dropped if type(a) is core.Var]
    while todo:
        i = producer.get(todo.pop())
        if i is None or i in removed:
            continue
        eqn = eqns[i]
        if any(uses.get(o, 0) for o in eqn.outvars) or not _removable(eqn):
            continue
        removed.add(i)
        for v in eqn.invars:
            if type(v) is core.Var:
                uses[v] -= 1
                if not uses[v]:
                    todo.append(v)
    return [e for i, e in enumerate(eqns) if i not in removed] if removed else eqns


def _removable(eqn: core.JaxprEqn) -> bool:
    if eqn.effects or eqn.primitive in TAG_PRIMITIVES:
        return False
    return not _traverse.holds(eqn, lambda e: e.primitive in TAG_PRIMITIVES)

"""The threading engine: rewrite selected tags into explicit context threading.

One interpreter (``Engine.thread_eqns``) walks a jaxpr's equations; a tag
that is selected is replaced by an inlined copy of the injector's jaxpr;
a higher-order primitive whose sub-jaxprs contain a selected tag is handed
to its thread rule (one small rule per primitive, keyed by the ``Primitive``
object and registered with ``register_thread_rule``, which is public so that
other libraries can add their primitives). Every other equation is kept as
it is.

The engine works by jaxpr surgery rather than by re-tracing the program:
only the injector is traced (once per distinct signature), and inlining it
is a copy of a few equations, which keeps ``inject`` far cheaper than
tracing the program in the first place.

Convention: a threaded jaxpr takes the ctx leaves as inputs at ``in_pos``
and returns them as outputs at ``out_pos``; the rules pick the positions the
primitive needs (e.g. scan: after the consts / before the carry).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import operator
from typing import Any, Callable, Iterator, NamedTuple, Protocol, Sequence

import jax
import numpy as np
from ._jax.internals import config, core, shard_map_internals
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _compat, _dependence, _jaxpr, _per_example, _replay, _traverse
from ._find import TAG_PRIMITIVES, is_selected
from .primitives._tag import (evaluated_fun, keep_tags, keeping_tags, meta, site_key,
                              tag_cotangent_p, tag_p, tag_tangent_p, user_params)


class InjectError(ValueError):
    """An injector returned something of the wrong structure, shape or dtype."""


def format_path(path: Sequence[str]) -> str:
    return "/".join(path) if path else "<top level>"


def describe_tag(params: dict) -> str:
    """``tag(k=v, ...)`` with the params a user passed."""
    return "tag(" + ", ".join(f"{k}={v!r}" for k, v in params.items()) + ")"


def describe_site(params: dict, path: Sequence[str]) -> str:
    return f"{describe_tag(params)} at {format_path(path)}"


# Path labels of the derivative rules JAX traces when it differentiates a
# custom function (a custom_jvp rule, a custom_vjp fwd or bwd).
_RULE_SUFFIXES = ("[rule]", "[jvp rule]", "[fwd]", "[bwd]")


def trace_in(context: Callable | None, fn: Callable, avals: Sequence[Any]) -> Any:
    """``fn`` traced to a closed jaxpr, inside ``context()`` (a shard_map
    body's tracing context) when given."""
    if context is None:
        return _jaxpr.trace_flat(fn, avals)
    with context():
        return _jaxpr.trace_flat(fn, avals)


class ChannelKey(NamedTuple):
    """Names a channel: values collected from (or fed to) one site besides
    ctx, carried out of (into) every jaxpr around it. ``site`` is the
    layer's own hashable description of the site; ``occurrence`` numbers
    the channels of one ``site`` afresh in every jaxpr they pass through
    (``Level.channel``), so that sites in different calls (two jits, two
    scans) never share a key there; ``stacked``: the values come out of (go
    into) a scan, one row per step."""

    site: Any
    occurrence: int
    stacked: bool


class Level:
    """Equations being emitted for one jaxpr under construction."""

    __slots__ = ("eqns", "env", "consts", "path", "context", "collected", "feeds", "dropped",
                 "changed", "_local", "_occurrences")

    def __init__(self, path: tuple[str, ...], context: Callable | None = None):
        # ``context()`` enters the tracing context of this jaxpr's body (set
        # inside shard_map), used when tracing injectors for its sites.
        self.context = context
        self.eqns: list = []
        self.env: dict = {}
        self.consts = _traverse.IdMemo()  # const value -> its var
        self.path = path
        # Channels besides ctx: values collected per site (scan stacks them
        # into ys) and values fed to sites (scan slices them from xs).
        self.collected: list[tuple[Any, list]] = []
        self.feeds: dict[Any, list] = {}
        # Atoms a site rewrite stopped using (e.g. a get_state's init, which
        # the state read replaces): their producers are dropped at the end
        # if nothing else uses them (``drop_unused_producers``).
        self.dropped: list = []
        # ``(new ctx, the positions it changed)`` as a site rule that knows
        # them records it (one state's set changes one leaf of n): the
        # engine then does not compare all n leaves per site.
        self.changed: tuple | None = None
        self._local: dict = {}
        self._occurrences: dict = {}  # site -> channels of it so far

    def channel(self, site: Any, stacked: bool = False) -> ChannelKey:
        """The key of a new channel of ``site`` in this jaxpr."""
        n = self._occurrences.get(site, 0)
        self._occurrences[site] = n + 1
        return ChannelKey(site, n, stacked)

    def local(self, owner: Any) -> dict:
        """A table private to ``owner`` (a site rule) for what it keeps while
        this jaxpr is built, e.g. what a tag's site saw for the tag's tangent
        bound right after it."""
        table = self._local.get(owner)
        if table is None:
            table = self._local[owner] = {}
        return table

    def collect(self, key: ChannelKey, atoms: Sequence[Any]) -> None:
        self.collected.append((key, list(atoms)))

    def trace(self, fn: Callable, avals: Sequence[Any]) -> Any:
        """``fn`` traced to a closed jaxpr in this jaxpr's tracing context."""
        return trace_in(self.context, fn, avals)

    def feed(self, key: ChannelKey, avals: Sequence[Any]) -> list:
        """Inputs fed to this jaxpr under ``key`` (the same vars if asked twice)."""
        if key not in self.feeds:
            self.feeds[key] = [_jaxpr.new_var(a) for a in avals]
        return self.feeds[key]

    def atom(self, v: Any) -> Any:
        if type(v) is core.Var:
            return self.env.get(v, v)
        return v

    def const_var(self, value: Any) -> core.Var:
        return self.consts.get_or_compute(value, lambda: _jaxpr.new_var(_jaxpr.abstractify(value)))

    def emit(self, eqn: core.JaxprEqn) -> None:
        env = self.env
        if env and any(type(v) is core.Var and v in env for v in eqn.invars):
            eqn = eqn.replace(invars=[self.atom(v) for v in eqn.invars])
        self.eqns.append(eqn)

    def emit_rebuilt(self, eqn: core.JaxprEqn, new_subs: dict, invars: Sequence[Any],
                     outvars: Sequence[Any], **params: Any) -> None:
        """Emit ``eqn`` with sub-jaxprs replaced (``new_subs``: ``{(key,
        index): jaxpr}``, ``index`` None for a jaxpr-valued param), new
        inputs and outputs and updated ``params``; its effects are
        recomputed from the new sub-jaxprs."""
        _emit_rebuilt(self, eqn, new_subs, invars, outvars, **params)

    def hoisted(self) -> tuple[list, list]:
        pairs = self.consts.items()
        return [v for _, v in pairs], [c for c, _ in pairs]


def inline(level: Level, closed: Any, in_atoms: Sequence[Any]) -> list:
    """Copy ``closed``'s equations into ``level`` with fresh variables."""
    constvars, consts, invars, eqns, outvars, _, _ = _jaxpr.jaxpr_parts(closed)
    env: dict = {}
    for v, c in zip(constvars, consts):
        env[v] = level.const_var(c)
    for v, a in zip(invars, in_atoms):
        env[v] = a
    get = env.get
    for e in eqns:
        outs = []
        for o in e.outvars:
            if isinstance(o, core.DropVar):
                outs.append(o)
            else:
                n = _jaxpr.new_var(o.aval)
                env[o] = n
                outs.append(n)
        ins = [get(v, v) if type(v) is core.Var else v for v in e.invars]
        level.eqns.append(e.replace(invars=ins, outvars=outs))
    return [get(v, v) if type(v) is core.Var else v for v in outvars]


class Channels(NamedTuple):
    """What a threaded jaxpr collects (extra outputs, appended last) and is
    fed (extra inputs, appended last): ``((key, avals), ...)`` each."""

    collects: tuple = ()
    feeds: tuple = ()


NO_CHANNELS = Channels()


class RulePolicy:
    """How a layer treats its tags in custom derivative rules: a custom_jvp
    rule, a custom_vjp fwd or bwd, which JAX traces only when it
    differentiates the call, after the rewrite. Two semantics:

    * eager (``in_place``; state and keys): the rule runs in the function's
      place with ctx threaded through it, so the effects of what runs happen
      once, in program order;
    * oryx's (harvest): the function's own effects stand; a rule whose tags
      the layer rewrites (``has_selected``) acts on ctx after the function,
      and other selected tags in rules go to ``untraced_site``.

    The defaults are oryx's with nothing rewritten in rules.
    """

    in_place = False

    # Whether any custom_jvp rule may hold a selected tag (rules are not
    # traced ahead of JAX): custom_jvp functions outside custom_vjp functions
    # are then threaded, their rules when JAX runs them; a primitive without
    # a thread rule whose only reason to be threaded is such a rule is left
    # as it is.
    may_hold_sites = False

    # Whether ``untraced_site`` can raise (tracing a bwd to look costs a trace).
    checks_untraced = False

    def has_selected(self, engine: "Engine", eqn: core.JaxprEqn) -> bool:
        """Whether the custom JVP rule of ``eqn`` (a ``custom_jvp_call``), or
        its fwd (a ``custom_vjp_call``), traced only when differentiated,
        holds tags to rewrite there; if so, without ``in_place``, ctx is
        threaded through the rule after the function when JAX
        differentiates ``eqn``."""
        return False

    def prepare(self, engine: "Engine", rule: Any, n_primals: int, eqn: core.JaxprEqn) -> Any:
        """The custom JVP rule jaxpr ``rule`` (inputs: ``n_primals`` primals,
        then tangents) of the custom call ``eqn``, as it should be threaded:
        its ctx outputs must not depend on the tangents, or reverse mode
        cannot linearize it."""
        return rule

    def untraced_site(self, params: dict, path: tuple[str, ...]) -> Exception | None:
        """A selected tag inside a user's derivative rule that runs only when
        the rewritten program is differentiated from outside, after the
        rewrite, where the layer does not thread it: the error to raise, or
        None to leave it a tag (oryx's harvest does)."""
        return None

    def check(self, rule: Any, path: tuple[str, ...]) -> None:
        """Called with a threaded rule, or a traced custom_vjp bwd, before it
        runs: raise for tags left in it that the layer owns but could not
        thread."""


class Hooks:
    """How an effect layer reports channel misuse (harvest overrides these
    to give oryx's messages) and treats derivative rules (``rules``)."""

    rules = RulePolicy()

    def loop_channel(self, key: Any, loop: str, path: tuple[str, ...]) -> Exception:
        return NotImplementedError(
            f"taxpr: values collected or fed per iteration ({key!r}) are not supported "
            f"inside {loop} at {format_path(path)}")

    def describe_ctx(self, index: int) -> str:
        """How an error names ctx leaf ``index``."""
        return f"the context's entry {index}"

    def differentiated_write(self, index: int, path: tuple[str, ...]) -> Exception:
        """A ctx leaf that a custom_vjp call writes from its differentiated
        inputs, whose cotangent the user's bwd cannot give (the fwd ran in
        the function's place, the function may not be reversible)."""
        name = self.describe_ctx(index)
        return NotImplementedError(
            f"taxpr: {name} is written by the custom_vjp call at {format_path(path)} from "
            f"inputs JAX differentiates, and its derivative is needed: the call's bwd gives "
            f"no derivative for it")

    def differentiated_into_loop(self, what: str, path: tuple[str, ...]) -> Exception:
        """A ctx leaf or fed value (``what``, as ``describe_ctx`` or
        ``_site_name`` name it) that JAX differentiates and that reaches a
        while loop inside a custom_vjp function: its cotangent would need
        the loop reversed, which JAX cannot do, and the user's bwd does not
        give it (it knows only the function's own inputs)."""
        return NotImplementedError(
            f"taxpr: {what} is differentiated, and it reaches a "
            f"while loop inside the custom_vjp function at {format_path(path)}: the call's "
            f"bwd gives derivatives of the function's own inputs only (a library's "
            f"checkpointed loop or adjoint), and JAX cannot reverse a while loop. Pass the "
            f"value in as an argument of the function instead")

    def replay_read(self, index: int, path: tuple[str, ...]) -> Exception:
        """The error for a custom_vjp bwd whose cotangents depend on ctx
        leaf ``index``, which the forward pass changes."""
        return NotImplementedError(
            f"taxpr: the custom_vjp bwd at {format_path(path)} recomputes the forward pass "
            f"with {self.describe_ctx(index)}, which the forward pass changes: what it reads "
            f"there depends on the order in which the bwd recomputes (a checkpointed loop "
            f"restarts from saved steps), which taxpr cannot see")

    def replay_write(self, index: int, path: tuple[str, ...]) -> Exception:
        """The error for a custom_vjp bwd (run as a replay of its forward
        pass) that writes ctx leaf ``index``, which the forward does not."""
        return NotImplementedError(
            f"taxpr: the custom_vjp bwd at {format_path(path)} changes "
            f"{self.describe_ctx(index)}, which the function's forward pass does not: a "
            f"backward pass replays the forward pass (it sees what the forward saw and its "
            f"effects are not repeated), so an effect of its own has no place in the "
            f"program's order")

    def branches(self, collects: list[tuple], path: tuple[str, ...]) -> None:
        if len(set(collects)) > 1:
            raise ValueError(f"taxpr: cond branches at {format_path(path)} collect "
                             f"different values: {collects}")


class ThreadRule(Protocol):
    """How to thread a context through one higher-order primitive.

    The engine calls the rule for an equation of the primitive only when one
    of its sub-jaxprs contains a selected tag; other equations are kept as
    they are.
    """

    def __call__(self, engine: "Engine", eqn: core.JaxprEqn, level: Level,
                 ctx: list, subs: list) -> list:
        """Emit the rewritten ``eqn`` into ``level``; return the ctx after it.

        Arguments:
            engine: the ``Engine``. ``engine.thread_jaxpr(sub, path, in_pos,
                out_pos, level.context)`` gives a sub-jaxpr that takes the ctx
                leaves as inputs at ``in_pos`` and returns them at
                ``out_pos`` (a closed jaxpr; consts the engine added are
                attached); ``engine.thread_read_only(sub, path, in_pos,
                level.context)`` one that takes the ctx leaves but returns only
                its own outputs (for primitives whose outputs are fixed).
                ``engine.fresh_ctx()`` gives new variables for the
                ctx after the equation; ``engine.ctx_avals`` their types;
                ``engine.pass_channels(level, threaded)`` connects values
                that the threaded sub-jaxpr collects or is fed (harvest's
                reap/plant) and returns the equation's extra (inputs,
                outputs); ``engine.has_selected(sub)`` says whether a
                sub-jaxpr contains a selected tag.
            eqn: the equation, as in the jaxpr being rewritten. Its inputs
                are variables of the enclosing jaxpr (``level`` substitutes
                renamed ones when the equation is emitted).
            level: the jaxpr under construction: ``level.emit(eqn)`` appends
                an equation, ``level.emit_rebuilt(eqn, new_subs, invars,
                outvars, **params)`` one with new sub-jaxprs, ``level.path`` is the path of enclosing
                primitives (for sub-jaxpr paths and error messages),
                ``level.context`` the tracing context to pass on.
            ctx: the ctx leaves (atoms of the enclosing jaxpr) before ``eqn``.
            subs: ``[(Sub(key, index, label), jaxpr), ...]``, the sub-jaxprs
                of ``eqn`` as ``taxpr._traverse.subjaxprs`` finds them
                (``label`` is the path element naming the sub-jaxpr).

        Returns:
            The ctx leaves after ``eqn`` (one atom per leaf of ``ctx``).
        """
        ...


# Keyed by the Primitive object: names are not unique (two libraries may
# define a "call"), objects are.
THREAD_RULES: dict[core.Primitive, ThreadRule] = {}


def register_thread_rule(primitive: core.Primitive, rule: ThreadRule) -> ThreadRule:
    """Teach taxpr to thread state, reaps/plants and ``inject``'s ctx
    through a higher-order primitive.

    Arguments:
        primitive: the ``jax.extend.core.Primitive`` (the object an
            equation's ``eqn.primitive`` is, not its name).
        rule: a ``ThreadRule``: ``rule(engine, eqn, level, ctx, subs) ->
            ctx_out`` emits the rewritten equation and returns the ctx after
            it. A rule registered again for the same primitive replaces the
            previous one.

    Returns:
        ``rule`` itself.

    Raises:
        TypeError: ``primitive`` is not a JAX ``Primitive`` or ``rule`` is not
            callable.
    """
    if not isinstance(primitive, core.Primitive):
        raise TypeError(f"taxpr.register_thread_rule: expected a jax Primitive, got "
                        f"{type(primitive).__name__}: {primitive!r}")
    if not callable(rule):
        raise TypeError(f"taxpr.register_thread_rule: the rule for '{primitive.name}' "
                        f"must be callable, got {type(rule).__name__}")
    THREAD_RULES[primitive] = rule
    return rule


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
                        in_rule = any(p.endswith(_RULE_SUFFIXES) for p in level.path)
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
                    _aval(ctx[i]), i, replay), [ctx[i]])
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
        changed = set(told[1] if told is not None and told[0] is new_ctx and site_ctx is ctx
                      else changed_positions(ctx, new_ctx))
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
                tuple((k, tuple(_aval(a) for a in atoms)) for k, atoms in level.collected),
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


def _aval(atom) -> Any:
    return atom.aval


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


def _zeros(aval) -> Any:
    if aval.dtype == jax.dtypes.float0:
        return np.zeros(aval.shape, aval.dtype)
    return jax.numpy.zeros(aval.shape, aval.dtype)


# ---- rules -----------------------------------------------------------------------

def _label(subs, key, index=None) -> str:
    for sub, _ in subs:
        if sub.key == key and sub.index == index:
            return sub.label
    raise KeyError(key)


def _emit_rebuilt(level: Level, eqn, new_subs: dict, invars, outvars, **params) -> None:
    new = _traverse.with_subjaxprs(eqn, new_subs, **params)
    level.emit(new.replace(invars=list(invars), outvars=list(outvars)))


def _call_rule(key: str, sharded: bool):
    """jit / closed_call: ctx enters first and leaves last; the call stays a call."""

    def rule(engine, eqn, level, ctx, subs):
        n = len(ctx)
        sub = eqn.params[key]
        path = level.path + (_label(subs, key),)
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
        _emit_rebuilt(level, eqn, {(key, None): new}, [*ctx, *eqn.invars, *feeds],
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
    body = engine.thread_jaxpr(p["jaxpr"], level.path + (_label(subs, "jaxpr"),), nc, 0,
                               level.context)
    ctx_out = engine.fresh_ctx()
    feeds, collects = engine.pass_channels(level, body, length=p["length"])
    updates = _jaxpr.scan_params(p, nc, nk + n, nx + len(feeds), ny + len(collects))
    updates = {k: v for k, v in updates.items() if k != "jaxpr"}
    _emit_rebuilt(level, eqn, {("jaxpr", None): body},
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
        _emit_rebuilt(level, eqn, {("cond_jaxpr", None): cond, ("body_jaxpr", None): body},
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
    _emit_rebuilt(level, eqn, {("cond_jaxpr", None): new_cond, ("body_jaxpr", None): new_body},
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

    avals = [*(_aval(a) for a in keep_atoms), *(_aval(new[i]) for i in changed),
             *(_aval(old[i]) for i in changed)]
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
        path = level.path + (_label(subs, "branches", i),)
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
    _emit_rebuilt(level, eqn, new, [eqn.invars[0], *ctx, *eqn.invars[1:], *feeds],
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
        path = level.path + (_label(subs, key),)
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
        _emit_rebuilt(level, eqn, {(key, None): new}, [*hoisted, *ctx, *eqn.invars, *feeds],
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


def in_custom_vjp(path: tuple[str, ...]) -> bool:
    """Whether ``path`` runs through a custom_vjp function (its body or rules)."""
    return any(p.startswith("custom_vjp") for p in path)


def _custom_jvp_rule(engine, eqn, level, ctx, subs):
    """custom_jvp: ctx enters first as an ordinary input. The new JVP takes
    the outputs' tangents w.r.t. the original inputs from the user's rule,
    and everything that flows through ctx and the channels (ctx_out,
    collected values, and the outputs' dependence on ctx_in and fed values)
    from the derivative of the threaded function."""
    p = eqn.params
    n, nc, n_out, n_all = len(ctx), p["num_consts"], len(eqn.outvars), len(eqn.invars)
    call = p["call_jaxpr"]
    threaded = engine.thread_jaxpr(call, level.path + (_label(subs, "call_jaxpr"),), 0, n_out,
                                   level.context)
    feeds, collects = engine.pass_channels(level, threaded)
    threaded_fn = evaluated_fun(threaded)
    user_jvp = p["jvp_jaxpr_fun"]
    in_avals = [*engine.ctx_avals, *(v.aval for v in eqn.invars), *(v.aval for v in feeds)]
    user = slice(n + nc, n + n_all)  # the user's rule sees the original non-const inputs
    cache: dict = {}
    rule_path = level.path + ("custom_jvp[rule]",)
    rule_context = level.context
    thread_rule = engine._rule_selected(eqn)  # definite: harvest's hooks
    if engine.hooks.rules.in_place:
        jvp_jaxpr_fun = _jvp_of_threaded_rule(engine, eqn, user_jvp, p["symbolic_zeros"], threaded,
                                              in_avals, user, n_out,
                                              level.path + ("custom_jvp[jvp rule]",),
                                              rule_context)
        ctx_out = engine.fresh_ctx()
        # Symbolic zeros: JAX then tells the rule which inputs (ctx
        # included) it differentiates, as it decides whether to run a rule.
        _emit_rebuilt(level, eqn, {("call_jaxpr", None): threaded}, [*ctx, *eqn.invars, *feeds],
                      [*eqn.outvars, *ctx_out, *collects], num_consts=0, symbolic_zeros=True,
                      jvp_jaxpr_fun=_jaxpr.wrap_fun(jvp_jaxpr_fun, user_jvp))
        return ctx_out

    def jvp_jaxpr_fun(*zeros):
        zeros = tuple(zeros)
        ctx_only = _DIFFERENTIATING_CTX_ONLY.get()
        key = (zeros, ctx_only, keeping_tags())  # what is left in it is kept or plain
        if key in cache:
            return cache[key]
        # Traced keeping its tags (as the function's are): this layer threads
        # them, and a rule of an inner layer's rewrite holds tags for it.
        nz_avals = [a.to_tangent_aval() for a, z in zip(in_avals, zeros) if not z]
        k = len(in_avals)
        if all(zeros[user]) or ctx_only:
            # Only ctx and fed values are differentiated (a planted value, an
            # array a patch closes over): the rule defines no derivative for
            # them, and JAX runs no rule for a call whose inputs it does not
            # differentiate. Autodiff of the threaded function gives them
            # (a rule that calls its function would otherwise be
            # differentiated w.r.t. ctx through its own call, without end).
            def by_function(*args):
                primals, tangents = args[:k], iter(args[k:])
                nz = [i for i, z in enumerate(zeros) if not z]
                outs, outs_t = _jvp_again(threaded_fn, primals, nz,
                                          [next(tangents) for _ in nz])
                return [*outs, *outs_t]

            closed = _jaxpr.trace_flat(by_function, [*in_avals, *nz_avals])
            n_all_out = len(_jaxpr.jaxpr_parts(threaded).outvars)
            result = (*_jaxpr.open_with_constvars(closed), [False] * n_all_out)
            cache[key] = result
            return result
        with keep_tags():
            jvp_jaxpr, jvp_consts, out_zeros = user_jvp.call_wrapped(*zeros[user])
        _reject_rule_sites(engine, jvp_jaxpr, level.path + ("custom_jvp[jvp rule]",))
        rule = None
        if thread_rule:  # tags in the user's rule: thread ctx through it too
            rule = _thread_rule(engine, eqn, jvp_jaxpr, jvp_consts, n_all - nc, rule_path,
                                rule_context)

        def f(*args):
            primals, tangents = args[:k], iter(args[k:])
            per_input = [_zeros(a.to_tangent_aval()) if z else next(tangents)
                         for a, z in zip(in_avals, zeros)]
            user_t = [t for t, z in zip(per_input[user], zeros[user]) if not z]
            res = (evaluated_fun(_jaxpr.close_traced(jvp_jaxpr, jvp_consts))(
                *primals[user], *user_t) if rule is None else None)
            # Tangents through the differentiated ctx / fed values only, the
            # original inputs (and those with symbolic-zero tangents) held
            # as constants: a custom_vjp in the function that does not
            # depend on them is then not differentiated (JAX has no forward
            # mode for it; of an instantiated zero tangent, its linear part
            # runs when JAX linearizes this rule: "can't apply forward-mode
            # autodiff").
            wrt = [i for i in range(k) if not n <= i < n + n_all and not zeros[i]]
            with _differentiating_ctx_only():
                outs, through_t = _jvp_again(threaded_fn, primals, wrt,
                                             [per_input[i] for i in wrt])
            outs_t_ctx = through_t[:n_out]
            # ctx's tangents w.r.t. every differentiated input (the reaped
            # values' own derivatives), the others held likewise.
            nz = [i for i, z in enumerate(zeros) if not z]
            rest_t = _jvp_again(threaded_fn, primals, nz, [per_input[i] for i in nz])[1][n_out:]
            if rule is not None:
                # The rule's tags act on ctx after the function's; what they
                # write is a constant (tangent zero), other entries keep theirs.
                n_res = len(_jaxpr.jaxpr_parts(jvp_jaxpr).outvars)
                rule_fn = evaluated_fun(rule)
                args = [*primals[user], *user_t]
                ctx_body = list(outs[n_out:n_out + n])
                with _differentiating_ctx_only():
                    r_out, r_t = jax.jvp(lambda *c: rule_fn(*c, *args), ctx_body,
                                         list(rest_t[:n]))
                res = r_out[:n_res]  # the rule's outputs (with its plants)
                outs = [*outs[:n_out], *r_out[n_res:], *outs[n_out + n:]]
                rest_t = [*r_t[n_res:], *rest_t[n:]]
            # JAX's outputs of a differentiated call are its rule's (they may
            # differ from the function's: a rule of a function rewritten for
            # state also writes the state), ctx and collected values are the
            # function's, then the rule's tags'.
            outs = [*res[:n_out], *outs[n_out:]]
            user_out_t = iter(res[len(out_zeros):])
            out_t = [t if z else _add_ct(next(user_out_t), t)
                     for t, z in zip(outs_t_ctx, out_zeros)]
            return [*outs, *out_t, *rest_t]

        closed = _jaxpr.trace_flat(f, [*in_avals, *nz_avals])
        n_rest = len(_jaxpr.jaxpr_parts(threaded).outvars) - n_out
        result = (*_jaxpr.open_with_constvars(closed), [False] * (n_out + n_rest))
        cache[key] = result
        return result

    ctx_out = engine.fresh_ctx()
    _emit_rebuilt(level, eqn, {("call_jaxpr", None): threaded}, [*ctx, *eqn.invars, *feeds],
                  [*eqn.outvars, *ctx_out, *collects], num_consts=0,
                  jvp_jaxpr_fun=_jaxpr.wrap_fun(jvp_jaxpr_fun, user_jvp))
    return ctx_out


def _thread_rule(engine, eqn, jvp_jaxpr, jvp_consts, n_primals, path, context):
    """The jaxpr of a rule of the custom call ``eqn`` (a JVP rule, or a
    custom_vjp fwd), threaded (ctx in first, out last)."""
    closed = _jaxpr.close_traced(jvp_jaxpr, jvp_consts)
    closed = engine.hooks.rules.prepare(engine, closed, n_primals, eqn)
    rule = engine.thread_jaxpr(closed, path, 0, len(_jaxpr.jaxpr_parts(closed).outvars),
                               context)
    ch = engine.channels(rule)
    if ch.collects or ch.feeds:
        raise NotImplementedError(
            f"taxpr: tags in the custom rule at {format_path(path)} collect or are fed "
            f"values per site ({_site_name((ch.collects or ch.feeds)[0][0])}); only values "
            f"carried in ctx (e.g. non-append sows) are supported in a derivative rule")
    engine.hooks.rules.check(rule, path)
    return rule


def _site_name(key: ChannelKey) -> str:
    """A channel's site for an error: a layer's site records a ``kind`` and
    a ``name`` (harvest: "reap 'a'")."""
    kind, name = getattr(key.site, "kind", None), getattr(key.site, "name", None)
    return repr(key.site) if kind is None or name is None else f"{kind} {name!r}"


def _inexact(aval) -> bool:
    return jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact)


def _jvp_of_threaded_rule(engine, eqn, user_jvp, user_symbolic: bool, threaded, in_avals,
                          user: slice, n_out: int, path, context):
    """The ``jvp_jaxpr_fun`` of a rewritten custom_jvp function for a layer
    whose rules run in the function's place (``RulePolicy.in_place``), as
    eagerly:

    - where some of the function's own inputs have nonzero tangents, its
      rule runs instead of it, threaded with the ctx before the call: the
      outputs, the ctx after the call and the outputs' tangents w.r.t. the
      inputs come from the rule. What the rule writes is a constant w.r.t.
      the inputs (a rule runs on primal values); tangents through ctx (of
      the outputs and ctx w.r.t. the ctx before) are autodiff's of the
      function w.r.t. ctx, in which nested custom functions see zero
      tangents for their inputs and so run their bodies, not their rules;
    - where only ctx has nonzero tangents (``_DIFFERENTIATING_CTX_ONLY``, or
      symbolic zeros for every input), the function runs (JAX calls no rule
      when no input is differentiated): autodiff of the threaded function
      w.r.t. ctx.

    ``in_avals`` are ``[*ctx, *consts, *inputs, *feeds]``; the rule takes
    ``in_avals[user]`` (the inputs)."""
    n = len(engine.ctx_avals)
    k = len(in_avals)
    cache: dict = {}
    threaded_fn = evaluated_fun(threaded)
    out_tangent_avals = [v.aval.to_tangent_aval() for v in _jaxpr.jaxpr_parts(threaded).outvars]

    def jvp_through_ctx(ctx_zeros: tuple) -> Callable:
        """``(primals, tangents) -> output tangents`` of the threaded function
        w.r.t. the ctx leaves with nonzero tangents: only the outputs that
        depend on them are differentiated (the others get zeros), so that a
        body whose outputs ignore ctx is not differentiated again (the JVP of
        a custom_vjp in it would fail)."""
        live = _dependence.dependence(threaded, [not z for z in ctx_zeros]
                                      + [False] * (k - n)).outputs
        pruned = evaluated_fun(threaded if all(live) else _jaxpr.dce_closed(threaded, live))
        wrt = [i for i, z in enumerate(ctx_zeros) if not z]

        def jvp(primals, tangents):
            _, live_t = (_jvp_again(pruned, primals, wrt, [tangents[i] for i in wrt])
                         if any(live) else (None, []))
            given = iter(live_t)
            return [next(given) if l else _zeros(a) for l, a in zip(live, out_tangent_avals)]
        return jvp

    def jvp_jaxpr_fun(*zeros):
        zeros = tuple(zeros)
        by_function = all(zeros[user]) or _DIFFERENTIATING_CTX_ONLY.get()
        key = (zeros, by_function, keeping_tags())
        if key in cache:
            return cache[key]
        nz_avals = [a.to_tangent_aval() for a, z in zip(in_avals, zeros) if not z]
        ctx_t_in = not all(zeros[:n])

        def tangents_of(args):
            primals, tangents = args[:k], iter(args[k:])
            return primals, [_zeros(a.to_tangent_aval()) if z else next(tangents)
                             for a, z in zip(in_avals, zeros)]

        if by_function:
            # Tangents through ctx and fed values only (consts and inputs
            # held, as for a rule: JAX differentiates a custom function's
            # inputs). A ctx leaf the function hands on unchanged passes its
            # tangent through without differentiating the body (which may
            # hold what JAX cannot differentiate: a library's nextafter).
            passing = [j for j in range(n) if not zeros[j]
                       and _passes_through(engine, threaded, j, j, n_out + j)]
            wrt = [i for i, z in enumerate(zeros)
                   if not z and not n <= i < user.stop and i not in passing]

            def f(*args):
                primals, per_input = tangents_of(args)
                if wrt:
                    outs, outs_t = jax.jvp(_of_some_inputs(threaded_fn, primals, wrt),
                                           [primals[i] for i in wrt], [per_input[i] for i in wrt])
                else:
                    outs, outs_t = threaded_fn(*primals), list(map(_zeros, out_tangent_avals))
                outs_t = list(outs_t)
                for j in passing:
                    outs_t[n_out + j] = _add_ct(outs_t[n_out + j], per_input[j])
                return [*outs, *outs_t]
        else:
            # A rule defined without symbolic zeros gets them instantiated.
            user_zeros = zeros[user] if user_symbolic else (False,) * (user.stop - user.start)
            # The rule runs in a rewritten function (its tags are kept as the
            # function's are): an unused sow in it must outlive the DCE below.
            with keep_tags():
                jvp_jaxpr, jvp_consts, out_zeros = user_jvp.call_wrapped(*user_zeros)
            n_rule = len(jvp_jaxpr.outvars)  # outputs, then their nonzero tangents
            if any(e.primitive is tag_p and engine.predicate(e.params)
                   for e, _ in _traverse.iter_eqns(jvp_jaxpr)):
                rule = _thread_rule(engine, eqn, jvp_jaxpr, jvp_consts, user.stop - user.start,
                                    path, context)
                rule_fn = evaluated_fun(rule)
            else:  # a rule without sites runs as JAX runs it, ctx passing by
                user_rule = evaluated_fun(_jaxpr.close_traced(jvp_jaxpr, jvp_consts))

                def rule_fn(*a):
                    return [*user_rule(*a[n:]), *a[:n]]

            ctx_jvp = jvp_through_ctx(zeros[:n]) if ctx_t_in else None

            def f(*args):
                primals, per_input = tangents_of(args)
                user_t = [t for t, z in zip(per_input[user], user_zeros) if not z]
                ins = list(primals[user])

                def run(*c):
                    return rule_fn(*c, *ins, *user_t)

                outs = run(*primals[:n])
                via_ctx = None
                if ctx_t_in:
                    # Through the function, not the rule: a rule may hold
                    # what forward mode cannot differentiate again (the JVP
                    # of a custom_vjp in it), and the function's tangents
                    # w.r.t. ctx are what eagerly flows through a closure.
                    rest = list(primals[n:])
                    through = [*per_input[:n], *(_zeros(a.to_tangent_aval())
                                                 for a in in_avals[n:])]
                    with _differentiating_ctx_only():
                        via_ctx = ctx_jvp([*primals[:n], *rest], through)
                rule_t = iter(outs[n_out:n_rule])
                out_t = []
                for i, z in enumerate(out_zeros):
                    t = _zeros(core.typeof(outs[i]).to_tangent_aval()) if z else next(rule_t)
                    out_t.append(t if via_ctx is None else _add_ct(t, via_ctx[i]))
                ctx_t = (list(via_ctx[n_out:n_out + n]) if via_ctx is not None else
                         [_zeros(a.to_tangent_aval()) for a in engine.ctx_avals])
                return [*outs[:n_out], *outs[n_rule:], *out_t, *ctx_t]

        closed = _jaxpr.trace_flat(f, [*in_avals, *nz_avals])
        n_rest = (len(_jaxpr.jaxpr_parts(closed).outvars) - 2 * n_out) // 2
        # With no tangent for ctx and the fed values, ctx and what is
        # collected after the call have none either: symbolic zeros, so that
        # JAX goes on differentiating only what depends on the inputs (a
        # rule downstream runs as JAX would run it, or not at all).
        rest_zero = all(zeros[:n]) and all(zeros[user.stop:])
        if rest_zero and n_rest:
            n_all_out = 2 * n_out + 2 * n_rest
            closed = _jaxpr.dce_closed(closed, [True] * (n_all_out - n_rest) + [False] * n_rest)
        result = (*_jaxpr.open_with_constvars(closed),
                  [False] * n_out + [rest_zero] * n_rest)
        cache[key] = result
        return result

    return jvp_jaxpr_fun


# Set while a rule is differentiated w.r.t. ctx alone (its inputs held): the
# custom functions it calls see zero tangents for their inputs and run their
# bodies, not their rules (JAX calls no rule then, and a rule that calls its
# own function would otherwise recurse without end). JAX instantiates zero
# tangents before calling a rule, so this cannot be read off the tangents.
_DIFFERENTIATING_CTX_ONLY = contextvars.ContextVar("taxpr_differentiating_ctx_only",
                                                   default=False)


@contextlib.contextmanager
def _differentiating_ctx_only() -> Iterator[None]:
    token = _DIFFERENTIATING_CTX_ONLY.set(True)
    try:
        yield
    finally:
        _DIFFERENTIATING_CTX_ONLY.reset(token)


register_thread_rule(_compat.custom_jvp_call_p, _custom_jvp_rule)


# ``ctx_through(after, before) -> after`` with ``before``'s tangent: a ctx
# leaf that a custom_vjp function passes through unchanged. JAX gives every
# output of a custom_vjp call a tangent (a linearization of its bwd), which
# would make a state the call does not touch look differentiated after it;
# its value is still what the call returns (a fwd rule may write it, and
# what a rule writes is a constant w.r.t. the inputs), its tangent the one
# it had before the call (the function's identity on it).
ctx_through_p = Primitive("taxpr_ctx_through")
ctx_through_p.def_impl(lambda after, before: after)
ctx_through_p.def_abstract_eval(lambda after, before: after)
ad.primitive_jvps[ctx_through_p] = lambda primals, tangents: (primals[0], tangents[1])
batching.primitive_batchers[ctx_through_p] = lambda args, dims: (args[0], dims[0])
mlir.register_lowering(ctx_through_p, lambda ctx, after, before: [after])


def _ctx_through(level: Level, after: Any, before: Any) -> Any:
    out = _jaxpr.new_var(after.aval)
    level.emit(core.new_jaxpr_eqn([after, before], [out], ctx_through_p, {}, core.no_effects))
    return out


def _custom_vjp_rule(engine, eqn, level, ctx, subs):
    """custom_vjp: ctx enters last (so the residual forwarding indices of
    ``out_trees`` stay valid) and leaves last. The forward pass takes
    residuals from the user's fwd and outputs (and ctx) from the threaded
    function; the backward pass takes the inputs' cotangents w.r.t. the
    outputs from the user's bwd, and everything that flows through ctx from
    the VJP of the threaded function (whose inputs are forwarded residuals).
    Consts become ordinary inputs (``num_consts=0``)."""
    p = eqn.params
    n, n_all, n_out = len(ctx), len(eqn.invars), len(eqn.outvars)
    nc = p["num_consts"]
    call = p["call_jaxpr"]
    threaded = engine.thread_jaxpr(call, level.path + (_label(subs, "call_jaxpr"),), n_all, n_out,
                                   level.context)
    feeds, collects = engine.pass_channels(level, threaded)
    # Extra inputs (ctx, fed values) and outputs (ctx, collected values).
    n_x, n_y = n + len(feeds), n + len(collects)
    rest_avals = [*engine.ctx_avals, *(v.aval for v in collects)]
    threaded_fn = evaluated_fun(threaded)
    user_fwd, user_bwd, user_out_trees = p["fwd_jaxpr_thunk"], p["bwd"], p["out_trees"]
    in_avals = [*(v.aval for v in eqn.invars), *engine.ctx_avals, *(v.aval for v in feeds)]
    n_prims = n_all - nc
    fwd_cache: dict = {}

    def out_trees():
        out_tree, res_tree, fwds = user_out_trees()
        ones = lambda k: [0] * k
        res = jax.tree_util.tree_unflatten(res_tree, ones(res_tree.num_leaves))
        outs = jax.tree_util.tree_unflatten(out_tree, ones(out_tree.num_leaves))
        return (jax.tree_util.tree_structure((outs, ones(n_y))),
                jax.tree_util.tree_structure((res, ones(n_all + n_x))),
                [*fwds, *range(n_all + n_x)])

    fwd_path = level.path + ("custom_vjp[fwd]",)
    threads_fwd = engine.hooks.rules.in_place
    # Without ``RulePolicy.in_place``, a fwd holding tags the layer rewrites in
    # rules (harvest: names its function does not sow) acts on ctx after the
    # function.
    fwd_after_function = not threads_fwd and engine._rule_selected(eqn)
    # The ctx leaves and fed values JAX differentiates the call w.r.t. (seen
    # by the fwd): only their cotangents are computed through the function.
    differentiated_ctx: set[int] = set()
    # With ``RulePolicy.in_place`` the user's fwd, threaded, runs in the function's
    # place: ``(*ctx, *inputs) -> (*residuals, *outputs, *ctx)``; the ctx
    # flows of the backward pass are the function's (``_bwd_through_ctx``).

    def fwd_jaxpr_thunk(*nonzeros):
        nonzeros = tuple(nonzeros)
        key = (nonzeros, keeping_tags())
        if key in fwd_cache:
            return fwd_cache[key]
        # A speculative trace (harvest looking for sows) differentiates every
        # input: it neither checks nor records what JAX differentiates, and
        # its result is not cached for JAX's own call.
        speculative = _SPECULATIVE.get()
        with keep_tags():  # as the JVP rule of a custom_jvp
            fwd_jaxpr, fwd_consts = user_fwd.call_wrapped(*nonzeros[nc:nc + n_prims])
        if not speculative:
            differentiated_ctx.update(i for i in range(n_x) if nonzeros[n_all + i])
            if not threads_fwd:
                _reject_differentiated_into_loops(
                    engine, threaded, nonzeros[n_all:], n_all,
                    level.path + (_label(subs, "call_jaxpr"),))
        if threads_fwd:
            rule = _thread_rule(engine, eqn, fwd_jaxpr, fwd_consts, n_prims, fwd_path,
                                level.context)
            if not speculative:
                _reject_differentiated_ctx(engine, rule, nonzeros[n_all:n_all + n], fwd_path)
            rule_fn = evaluated_fun(rule)

            def f(*primals):
                return rule_fn(*primals[n_all:n_all + n], *primals[nc:nc + n_prims])
        elif fwd_after_function:
            rule_fn = evaluated_fun(
                _thread_rule(engine, eqn, fwd_jaxpr, fwd_consts, n_prims, fwd_path,
                             level.context))

            def f(*primals):
                # The function's ctx and collected values, then the fwd's
                # tags on that ctx: (*residuals, *outputs, *ctx).
                by_function = threaded_fn(*primals)
                ran = rule_fn(*by_function[n_out:n_out + n], *primals[nc:nc + n_prims])
                return [*ran, *by_function[n_out + n:]]
        else:
            _reject_rule_sites(engine, fwd_jaxpr, fwd_path)

            def f(*primals):
                # The fwd's residuals and outputs (JAX's outputs of a
                # differentiated call), the function's ctx and collected values.
                res_and_outs = evaluated_fun(_jaxpr.close_traced(fwd_jaxpr, fwd_consts))(
                    *primals[nc:nc + n_prims])
                return [*res_and_outs, *threaded_fn(*primals)[n_out:]]

        result = _jaxpr.open_with_constvars(_jaxpr.trace_flat(f, in_avals))
        if not speculative:
            fwd_cache[key] = result
        return result

    out_avals = [v.aval for v in eqn.outvars]

    def bwd(*args):
        n_res = len(args) - n_out - n_y
        user_res, primals = args[:n_res - n_all - n_x], args[n_res - n_all - n_x:n_res]
        ct_outs, ct_rest = args[n_res:n_res + n_out], args[n_res + n_out:]
        # The call is rebuilt with symbolic zeros (so that a cotangent nothing
        # flows into is known to be zero); the user's bwd gets them as
        # registered.
        user_ct_outs = ct_outs if p["symbolic_zeros"] else list(
            map(_instantiate, ct_outs, out_avals))
        if threads_fwd:
            _reject_differentiated_writes(engine, threaded, ct_rest[:n], nc, n_all, n_out,
                                          level.path + ("custom_vjp[bwd]",))
        user_cts, logs = _replayed_bwd(engine, user_bwd, user_res, user_ct_outs,
                                       primals[n_all:], threaded,
                                       level.path + ("custom_vjp[bwd]",), level.context)
        if threads_fwd or all(map(_is_zero_ct, ct_rest)):
            # Nothing flows back into ctx or the collected values (harvest:
            # no reaped value is differentiated): the function itself is
            # differentiated only w.r.t. the ctx leaves JAX differentiates,
            # so a function JAX cannot reverse (a while loop under equinox's
            # or diffrax's checkpointing) is left to the user's bwd.
            handed_on = {i for i in differentiated_ctx if i < n and _passes_through(
                engine, threaded, i, n_all + i, n_out + i)}
            return _compat.custom_vjp_bwd_result(
                _bwd_through_ctx(threaded_fn, primals, user_cts, ct_outs, ct_rest, out_avals,
                                 rest_avals, nc, n_all, differentiated_ctx, handed_on),
                logs)
        _, vjp_fn = jax.vjp(threaded_fn, *primals)
        via_ctx = vjp_fn([*map(_zeros_like_ct, out_avals), *map(_instantiate, ct_rest, rest_avals)])
        via_outs = vjp_fn([*map(_instantiate, ct_outs, out_avals), *map(_zeros_like_ct, rest_avals)])
        cts = [*via_ctx[:nc],
               *(_add_ct(u, c) for u, c in zip(user_cts, via_ctx[nc:n_all])),
               *(_add_ct(a, b) for a, b in zip(via_ctx[n_all:], via_outs[n_all:]))]
        return _compat.custom_vjp_bwd_result(cts, logs)

    ctx_out = engine.fresh_ctx()
    _emit_rebuilt(level, eqn, {("call_jaxpr", None): threaded}, [*eqn.invars, *ctx, *feeds],
                  [*eqn.outvars, *ctx_out, *collects], num_consts=0, out_trees=out_trees,
                  fwd_jaxpr_thunk=_jaxpr.wrap_fun(fwd_jaxpr_thunk, user_fwd),
                  bwd=_jaxpr.wrap_fun(bwd, user_bwd), symbolic_zeros=True)
    written = engine.writes(threaded)
    return [_ctx_through(level, after, before)
            if i not in written and _inexact(engine.ctx_avals[i]) and type(before) is core.Var
            else after for i, (after, before) in enumerate(zip(ctx_out, ctx))]


def _reject_differentiated_into_loops(engine, threaded, differentiated: Sequence[bool],
                                      at: int, path: tuple[str, ...]) -> None:
    """A ctx leaf or fed value (a planted value: ``differentiated`` per ctx
    leaf, then per fed value, from input ``at`` of ``threaded``) that JAX
    differentiates and that reaches a while loop of the custom_vjp function (outside the custom rules nested
    in it, which give their own derivatives): its cotangent could only come
    from reversing the loop, which JAX cannot do, and the user's bwd knows
    nothing of it (a library rule may even stop its gradient: equinox's
    checkpointed loops stop the gradient of a loop whose own inputs are not
    differentiated), so an error naming the value instead of a zero."""
    if not any(differentiated):
        return
    own_loops = set()
    pending = [threaded]
    while pending:
        for eqn in _jaxpr.jaxpr_parts(pending.pop()).eqns:
            if eqn.primitive is _compat.while_p:
                own_loops.add(id(eqn))
            if eqn.primitive not in _compat.CUSTOM_CALL_PRIMITIVES:
                pending.extend(sj for _, sj in _traverse.subjaxprs(eqn))
    if not own_loops:
        return
    n_in = len(_jaxpr.jaxpr_parts(threaded).invars)
    n = len(engine.ctx_avals)
    names = [*map(engine.hooks.describe_ctx, range(n)),
             *(f"the value fed to {_site_name(k)}"
               for k, avals in engine.channels(threaded).feeds for _ in avals)]
    for j, d in enumerate(differentiated):
        if not d or not _inexact(_jaxpr.jaxpr_parts(threaded).invars[at + j].aval):
            continue
        reached: list = []

        def visit(eqn, ins, looked_into):
            if id(eqn) in own_loops and any(ins):
                reached.append(eqn)
        dep = _dependence.dependence(threaded, [i == at + j for i in range(n_in)], visit=visit)
        if reached and any(dep.outputs):
            raise engine.hooks.differentiated_into_loop(names[j], path)


def _reject_differentiated_writes(engine, threaded, ct_ctx, nc: int, n_all: int, n_out: int,
                                  path: tuple[str, ...]) -> None:
    """A ctx leaf the function writes from its (inexact) inputs, with a
    nonzero cotangent: its derivative would be dropped (a fwd ran in the
    function's place, and the user's bwd knows nothing of ctx), a silent
    zero. The layer's error instead."""
    written = engine.writes(threaded)
    live = [i for i, ct in enumerate(ct_ctx) if i in written and not _is_zero_ct(ct)]
    if not live:
        return
    invars = _jaxpr.jaxpr_parts(threaded).invars
    wrt = [nc <= j < n_all and _inexact(v.aval) for j, v in enumerate(invars)]
    dep = _dependence.dependence(threaded, wrt).outputs
    for i in live:
        if dep[n_out + i]:
            raise engine.hooks.differentiated_write(i, path)


def _replayed_bwd(engine, user_bwd, res: Sequence[Any], ct_outs: Sequence[Any],
                  ctx_and_feeds: Sequence[Any], fn_threaded: Any, path: tuple[str, ...],
                  context: Callable | None) -> tuple[list, Any]:
    """Run a custom_vjp's bwd as a replay of its forward pass: ``(cts, logs)``.

    A bwd that runs the function again (``jax.vjp(f, ...)`` in it, equinox's
    checkpointed loops, diffrax's adjoints) recomputes the forward pass, so its
    tags see what the forward saw: the ctx at the call (``ctx_and_feeds``
    starts with it) and the values fed to the function (planted values).
    Its effects already happened in the forward pass: what it writes to ctx
    and collects is dropped, and a bwd that writes a ctx entry or collects a
    value the function does not is an error (an effect of the backward pass
    itself, which has no place in the program's order)."""
    closed, results = traced_bwd(user_bwd, [*res, *ct_outs], context)
    engine.hooks.rules.check(closed, path)
    n_outs = len(_jaxpr.jaxpr_parts(closed).outvars)
    if engine.has_selected(closed):
        outs = _run_replay(engine, closed, n_outs, ctx_and_feeds, fn_threaded, path, context)
    else:
        outs = evaluated_fun(closed)()
    return results(outs)


def traced_bwd(user_bwd, args: Sequence[Any], context: Callable | None = None
               ) -> tuple[Any, Callable[[Sequence[Any]], tuple[list, Any]]]:
    """A custom_vjp's flat bwd traced at the very values JAX passes it
    (closed over: concrete values stay concrete, as when JAX calls it),
    keeping its tags: ``(closed jaxpr, results)``, ``results(outs)`` giving
    ``(cts, logs)`` from the jaxpr's outputs (symbolic zeros kept)."""
    shape: dict = {}

    def flat():
        cts, logs = _compat.call_custom_vjp_bwd(user_bwd, args)
        shape["cts"] = [c if _is_symbolic_zero(c) else None for c in cts]
        log_leaves, shape["logs"] = jax.tree_util.tree_flatten(logs)
        return [*(c for c in cts if not _is_symbolic_zero(c)), *log_leaves]

    with keep_tags():  # as the JVP rule of a custom_jvp
        closed = trace_in(context, flat, [])

    def results(outs: Sequence[Any]) -> tuple[list, Any]:
        given = iter(outs)
        cts = [next(given) if c is None else c for c in shape["cts"]]
        return cts, jax.tree_util.tree_unflatten(shape["logs"], list(given))

    return closed, results


def _run_replay(engine, closed, n_outs: int, ctx_and_feeds: Sequence[Any], fn_threaded: Any,
                path: tuple[str, ...], context: Callable | None) -> list:
    """``closed`` (a traced bwd) threaded from the ctx and fed values of its
    function's call; its own ctx writes and collected values dropped."""
    n = len(engine.ctx_avals)
    threaded = engine.thread_jaxpr(closed, path, 0, n_outs, context)
    parts = _jaxpr.jaxpr_parts(threaded)
    fn_channels, channels = engine.channels(fn_threaded), engine.channels(threaded)
    written = engine.writes(fn_threaded)
    own_writes = sorted(engine.writes(threaded) - written)
    if own_writes:
        raise engine.hooks.replay_write(own_writes[0], path)
    # A replay reads the ctx of the call's entry; a leaf the forward pass
    # changes reads right only if the bwd recomputes in the forward's order,
    # from the start (checkpointed loops restart from saved steps): so the
    # cotangents may depend only on leaves the forward leaves unchanged.
    for i in sorted(written):
        dep = _dependence.dependence(threaded, [j == i for j in range(len(parts.invars))])
        if any(dep.outputs[:n_outs]) or dep.reaches_effect:
            raise engine.hooks.replay_read(i, path)
    fn_collected = {k for k, _ in fn_channels.collects}
    fed: dict = {}
    values = iter(ctx_and_feeds[n:])
    for k, avals in fn_channels.feeds:
        fed[k] = [next(values) for _ in avals]
    for k in [k for k, _ in channels.collects if k not in fn_collected] + [
            k for k, _ in channels.feeds if k not in fed]:
        raise NotImplementedError(
            f"taxpr: the custom_vjp bwd at {format_path(path)} collects or is fed values "
            f"({k!r}) that its function's forward pass does not: a backward pass replays the "
            f"forward pass, and a value of its own cannot be reaped or planted")
    feeds = [v for k, _ in channels.feeds for v in fed[k]]
    outs = evaluated_fun(threaded)(*ctx_and_feeds[:n], *feeds)
    return list(outs[:n_outs])


def _passes_through(engine, threaded, leaf: int, in_index: int, out_index: int) -> bool:
    """Whether ``threaded`` (a result of ``thread_jaxpr``) hands ctx leaf
    ``leaf`` (its input ``in_index``, output ``out_index``) on unchanged,
    also through the nested calls that thread it: no site writes it and no
    other output depends on it. Its derivative there is the identity."""
    if leaf in engine.writes(threaded):
        return False
    n_in = len(_jaxpr.jaxpr_parts(threaded).invars)
    dep = _dependence.dependence(threaded, [j == in_index for j in range(n_in)])
    return not any(d for k, d in enumerate(dep.outputs) if k != out_index)


def _reject_differentiated_ctx(engine, rule, nonzeros: Sequence[bool], path) -> None:
    """Derivatives w.r.t. ctx entries that a threaded custom_vjp fwd reads
    (a state differentiated from outside, read inside the function) would
    reach them only through the VJP of the function, which libraries' custom
    VJPs (equinox's checkpointed loops, diffrax's adjoints) do not provide:
    rather than a zero gradient, an error naming the entry."""
    # A ctx entry the fwd hands on unchanged is not read: its derivative is
    # the identity, which the function's VJP gives. Handed on directly, or
    # through nested calls that thread it (the fwd calling its function,
    # whose body uses another state): no site writes it and no other output
    # depends on it.
    invars, outvars = _jaxpr.jaxpr_parts(rule).invars, _jaxpr.jaxpr_parts(rule).outvars
    n = len(nonzeros)
    handed_on = {len(outvars) - n + i for i in range(n) if outvars[len(outvars) - n + i] is invars[i]}
    used = _jaxpr.used_invars(rule, [i not in handed_on for i in range(len(outvars))])[:n]
    for i, (nz, u, aval) in enumerate(zip(nonzeros, used, engine.ctx_avals)):
        if (nz and u and _inexact(aval)
                and not _passes_through(engine, rule, i, i, len(outvars) - n + i)):
            raise NotImplementedError(
                f"taxpr: differentiating w.r.t. {engine.hooks.describe_ctx(i)}, which the "
                f"custom_vjp function at {format_path(path)} reads, is not supported: the "
                f"function's own rules give no derivative for it. Differentiate w.r.t. the "
                f"function's arguments (pass the value in), or hold the state constant "
                f"(jax.lax.stop_gradient) around the call")


def _of_some_inputs(fn: Callable, inputs, positions) -> Callable:
    """``fn`` as a function of its inputs at ``positions`` alone, the others
    held at ``inputs``: differentiated w.r.t. those only, nested custom
    functions whose inputs do not depend on them are not differentiated at
    all (as JAX does with symbolic zeros)."""
    def of_some(*leaves):
        full = list(inputs)
        for i, leaf in zip(positions, leaves):
            full[i] = leaf
        return fn(*full)
    return of_some


# The name of the jit through which a rule taxpr generates runs a custom
# function's threaded body again, next to the user's rule (to differentiate
# it w.r.t. ctx or the inputs): a layer above that looks into the rule
# (harvest, for a rule's own sows) tells the function's tags from the rule's.
FUNCTION_AGAIN = "taxpr_function_again"


def _jvp_again(fn: Callable, primals: Sequence[Any], positions: Sequence[int],
               tangents: Sequence[Any]) -> tuple[list, list]:
    """``jax.jvp`` of ``fn`` (a custom function's threaded body) w.r.t. its
    inputs at ``positions`` (tangents ``tangents``), the others held at
    ``primals`` (``_of_some_inputs``), through a jit named
    ``FUNCTION_AGAIN``."""
    def again(held, xs, ts):
        return jax.jvp(_of_some_inputs(fn, held, positions), xs, ts)
    again.__name__ = again.__qualname__ = FUNCTION_AGAIN  # the jit's name
    outs, outs_t = jax.jit(again)(list(primals), [primals[i] for i in positions], list(tangents))
    return list(outs), list(outs_t)


def _bwd_through_ctx(threaded_fn, primals, user_cts, ct_outs, ct_rest, out_avals, rest_avals,
                     nc, n_all, differentiated: set[int], handed_on: set[int] = frozenset()):
    """The cotangents of a custom_vjp's inputs ``[*consts, *args, *ctx,
    *feeds]`` where what the function adds to ctx or collects is a constant
    w.r.t. its args (a fwd ran in its place, as eagerly; or no cotangent
    flows there): the args' from the user's bwd, those of ctx and fed values
    from the VJP of the threaded function ``threaded_fn(*consts, *args, *ctx,
    *feeds) -> (*outputs, *ctx, *collects)`` w.r.t. those JAX differentiates
    (``differentiated``, positions after the args), taken only where a
    nonzero cotangent flows there. A ctx leaf the function hands on
    unchanged (``handed_on``) takes its output's cotangent, without
    differentiating the function (which JAX may not reverse: a while loop
    under a library's checkpointing)."""
    in_avals = [core.typeof(p) for p in primals]
    held = [_zeros_like_ct(a) for a in in_avals[:nc]]
    args_ct = [_instantiate(c, a) for c, a in zip(user_cts, in_avals[nc:n_all])]
    ctx_ct = [_zeros_like_ct(a) for a in in_avals[n_all:]]
    for i in handed_on:
        if _inexact(in_avals[n_all + i]):
            ctx_ct[i] = _instantiate(ct_rest[i], rest_avals[i])
    wrt = [i for i in sorted(differentiated)
           if _inexact(in_avals[n_all + i]) and i not in handed_on]
    if not wrt or (all(map(_is_zero_ct, ct_outs)) and all(map(_is_zero_ct, ct_rest))):
        return [*held, *args_ct, *ctx_ct]
    positions = [n_all + i for i in wrt]
    through = _of_some_inputs(threaded_fn, primals, positions)
    _, vjp_fn = jax.vjp(through, *(primals[i] for i in positions))
    cts = vjp_fn([*map(_instantiate, ct_outs, out_avals),
                  *map(_instantiate, ct_rest, rest_avals)])
    for i, ct in zip(wrt, cts):
        ctx_ct[i] = ct
    return [*held, *args_ct, *ctx_ct]


def _is_zero_ct(ct) -> bool:
    return _is_symbolic_zero(ct) or getattr(ct, "dtype", None) == jax.dtypes.float0


class RuleNotTraceable(Exception):
    """Raised instead of a rule-site error while a rule is traced only to
    look into it (``speculative_rule_traces``): nothing runs the rule yet."""


_SPECULATIVE = contextvars.ContextVar("taxpr_speculative_rule_traces", default=False)


@contextlib.contextmanager
def speculative_rule_traces() -> Iterator[None]:
    """Rules traced in this block are looked into, not run (harvest's search
    for sows in custom JVP rules): one whose tags cannot be threaded raises
    ``RuleNotTraceable``, and its real error comes if JAX ever runs it (its
    trace is not cached)."""
    token = _SPECULATIVE.set(True)
    try:
        yield
    finally:
        _SPECULATIVE.reset(token)


def _reject_rule_sites(engine, rule_jaxpr, path: tuple[str, ...]) -> None:
    """A selected tag inside a user's derivative rule (custom_jvp rule,
    custom_vjp fwd/bwd) traced when the rewritten program is differentiated
    from outside cannot be threaded: the rule is traced after the rewrite.
    Eagerly the rule's effects would happen (instead of the function's), so
    rather than drop or misplace them this is an error naming the tag."""
    if not engine.hooks.rules.checks_untraced:
        return
    for eqn, sub_path in _traverse.iter_eqns(rule_jaxpr, path):
        if eqn.primitive is tag_p and is_selected(eqn, engine.predicate):
            error = engine.hooks.rules.untraced_site(user_params(eqn.params), sub_path)
            if error is not None:
                if _SPECULATIVE.get():
                    raise RuleNotTraceable(str(error)) from error
                raise error


def _zeros_like_ct(aval) -> Any:
    return _zeros(aval.to_tangent_aval())


def _is_symbolic_zero(ct) -> bool:
    return ct is None or type(ct) is ad.Zero or type(ct).__name__ == "SymbolicZero"


def _instantiate(ct, aval) -> Any:
    return _zeros_like_ct(aval) if _is_symbolic_zero(ct) else ct


def _add_ct(a, b) -> Any:
    if a is None or type(a) is ad.Zero:
        return b
    if b is None or type(b) is ad.Zero or getattr(b, "dtype", None) == jax.dtypes.float0:
        return a
    return a + b


register_thread_rule(_compat.custom_vjp_call_p, _custom_vjp_rule)

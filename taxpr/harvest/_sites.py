"""Harvest's site rule for the engine: a selected sow becomes a carried
value (strict / clobber / cond_clobber), a collected one (append), or takes
a planted value; with the hooks that name harvest's errors."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from .._jax.internals import core

from .. import _compat, _dependence, _jaxpr, _traverse
from .._engine import (FUNCTION_AGAIN, Engine, Hooks, Level, RulePolicy, ShardMapBody,
                       format_path, inline, speculative_rule_traces)
from .._find import dissolve_tags, forward_dissolved
from .._expand import describe_named_tag
from .._inject import guarded_place
from ..primitives._tag import meta, n_values, tag_p, tag_tangent_p, user_params
from ._checks import display_name


class _ChannelSite(NamedTuple):
    """The site of a channel (``ChannelKey.site``): an append sow's reaped
    values, or the values planted into it."""

    kind: str  # "reap" (collected) or "plant" (fed)
    name: str  # the sow's name


def _dissolve_rule_sows(engine, jaxpr, dependent: Sequence[bool],
                        kept: Callable[[Any], bool]) -> Any:
    """``jaxpr`` (a derivative rule) with its selected sows dissolved (plain
    identities) where their value depends on the inputs ``dependent`` (per
    input; the dependence analysis follows values into calls, branches and
    loops; inside another primitive that takes such a value every sow is
    dissolved, conservatively) or ``kept(eqn)`` is false."""
    on_dependent, opaque = set(), set()

    def visit(eqn, ins, looked_into):
        if eqn.primitive is tag_p:
            if any(ins[:n_values(eqn.params, len(eqn.invars))]):
                on_dependent.add(id(eqn))
        elif not looked_into:
            opaque.add(id(eqn))

    _dependence.dependence(jaxpr, dependent, visit=visit)

    def rewrite(eqn, path, env):
        if eqn.primitive is tag_p and engine.predicate(eqn.params):
            return (forward_dissolved(eqn, env) if id(eqn) in on_dependent or not kept(eqn)
                    else None)
        if id(eqn) not in opaque:
            return None  # sub-jaxprs are rewritten by map_jaxpr
        eqn = _traverse.with_subjaxprs(eqn, {
            (sub.key, sub.index): dissolve_tags(sj, lambda p, s: engine.predicate(p))
            for sub, sj in _traverse.subjaxprs(eqn)})
        return [eqn.replace(invars=[env.get(v, v) if type(v) is core.Var else v
                                    for v in eqn.invars])]

    return _traverse.map_jaxpr(jaxpr, rewrite)


def _sows_with_origin(engine, jaxpr, in_custom: bool = False):
    """The selected sows of ``jaxpr`` (a rule) that run when JAX runs it, in
    program order, each with whether it is known to be a custom function's
    own: inside a custom call the rule makes (it calls its function), or
    with a ``tag_tangent`` companion (the rule took the JVP of the function,
    whose sows then carry their tangents). Left out: those of the function
    run again in a rule a layer below generated (``FUNCTION_AGAIN``, to
    differentiate it), which eagerly do not run."""
    eqns = _jaxpr.jaxpr_parts(jaxpr).eqns
    # (by identity: a literal operand is not hashable)
    companions = {tuple(map(id, e.invars[:len(e.invars) // 2])) for e in eqns
                  if e.primitive is tag_tangent_p}
    for e in eqns:
        if e.primitive is tag_p and engine.predicate(e.params):
            values = e.invars[:n_values(e.params, len(e.invars))]
            yield e, in_custom or tuple(map(id, values)) in companions
        if e.primitive is _compat.jit_p and e.params.get("name") == FUNCTION_AGAIN:
            continue
        inner = in_custom or e.primitive in _compat.CUSTOM_CALL_PRIMITIVES
        for _, sj in _traverse.subjaxprs(e):
            yield from _sows_with_origin(engine, sj, inner)


class _HarvestRules(RulePolicy):
    """oryx's semantics for sows in derivative rules: the function's own
    sows are reaped from the function; a rule's sows of other names (and
    planted ones) are rewritten in the rule, after the function's, when JAX
    runs it (``JvpRules`` traces the rules ahead to find them). A rule's
    own sow of a name the function sows too is rewritten there when it is
    the last of that name the rule makes (eagerly it clobbers the
    function's)."""

    def __init__(self, sites: "HarvestSites", traced: "JvpRules"):
        self.sites = sites
        self.traced = traced
        # custom call eqn -> how many sows of each name its body makes
        self._body_sow_counts = _traverse.IdMemo()

    def _body_counts(self, engine, eqn) -> dict:
        def count():
            counts: dict = {}
            for e, _ in _traverse.iter_eqns(eqn.params["call_jaxpr"]):
                if e.primitive is tag_p and engine.predicate(e.params):
                    counts[e.params["name"]] = counts.get(e.params["name"], 0) + 1
            return counts
        return self._body_sow_counts.get_or_compute(eqn, count)

    def _rule_own_last(self, engine, eqn, rule) -> list:
        """The sows in ``rule`` (a rule of the custom call ``eqn``) that are
        the rule's own last sow of a name the function's body sows too: the
        last sow of that name, not known to be the function's
        (``_sows_with_origin``), and not one of as many sows as the body
        makes (a rule calling the function plainly sows them again,
        unmarked: those are the function's)."""
        counts = self._body_counts(engine, eqn)
        by_name: dict = {}
        for e, functions in _sows_with_origin(engine, rule):
            by_name.setdefault(e.params["name"], []).append((e, functions))
        return [sows[-1][0] for name, sows in by_name.items()
                if name in counts and not sows[-1][1]
                and (any(f for _, f in sows) or len(sows) > counts[name])]

    def _rewritten(self, engine, eqn, own_last: list) -> Callable[[Any], bool]:
        """``sow eqn -> bool``: whether a sow in a rule of the custom call
        ``eqn`` is rewritten there. A sow of a name the function's body does
        not sow is, and so is a planted one (not in append mode: its
        per-site values cannot be fed into a rule). Of a name the body sows,
        only the rule's own last one (``own_last``, ``_rule_own_last``) is;
        the others are reaped from the function."""
        counts = self._body_counts(engine, eqn)
        own = {id(e) for e in own_last}

        def rewritten(e) -> bool:
            name = e.params["name"]
            if self.sites.planted.get(name, "append") != "append":
                return True
            return name not in counts or id(e) in own
        return rewritten

    def prepare(self, engine, rule, n_primals, eqn):
        """Sows in the rule whose value depends on the tangents, and those
        reaped from the function (``_rewritten``), become plain identities:
        the former so that reverse mode can linearize. A strict sow of a name
        the function sows too, made by the rule that runs in its place, is
        oryx's error for a name sown twice."""
        own = self._rule_own_last(engine, eqn, rule)
        self._reject_rows_in_rule(engine, eqn, rule)
        for e in own:
            if e.params.get("mode") == "strict":
                name = e.params["name"]
                verb = "planted" if name in self.sites.planted else "reaped"
                raise ValueError(f"Variable has already been {verb}: {display_name(name)} (a strict "
                                 f"sow in a derivative rule, after its function's)")
        n_in = len(_jaxpr.jaxpr_parts(rule).invars)
        return _dissolve_rule_sows(engine, rule, [i >= n_primals for i in range(n_in)],
                                   self._rewritten(engine, eqn, own))

    def _reject_rows_in_rule(self, engine, eqn, rule) -> None:
        """A rule that calls its function sows again the names the function
        sows; a name planted in append mode gets one row per sow, fed to the
        function, which the rule cannot be given: its call would compute
        the unplanted value, which JAX then takes for the call's. An error
        naming the sow and the call instead."""
        counts = self._body_counts(engine, eqn)
        for e, _ in _traverse.iter_eqns(rule):
            if e.primitive is tag_p and engine.predicate(e.params) and self._planted_per_row(
                    e, counts):
                raise NotImplementedError(
                    f"taxpr: {describe_named_tag(user_params(e.params))}, planted with one value "
                    f"per sow (per iteration of a scan), is inside the function of the "
                    f"{eqn.primitive.name} whose derivative rule JAX runs in its place, and the "
                    f"rule calls the function again: taxpr cannot give that call its row, and "
                    f"the call would compute the unplanted value. Plant one value for every "
                    f"iteration (a clobber-mode sow), patch it by a function of the value "
                    f"(tx.patch(f, {{site: fn}})), or differentiate inside the planted function")

    def has_selected(self, engine, eqn) -> bool:
        # Sows of names the function does not sow, planted sows and a rule's
        # own last sow of a name: the function's own (sown again when its
        # rule calls it) are reaped from the function; a planted one is
        # planted in the rule too, so that a rule computing the function's
        # JVP gives the planted one's.
        rule = self.traced.jaxpr(eqn)
        if rule is None:
            return False
        rewritten = self._rewritten(engine, eqn, self._rule_own_last(engine, eqn, rule))
        counts = self._body_counts(engine, eqn)
        # (a rule sowing again a name planted per row: ``prepare`` raises)
        return any(e.primitive is tag_p and engine.predicate(e.params)
                   and (rewritten(e) or self._planted_per_row(e, counts))
                   for e, _ in _traverse.iter_eqns(rule))

    def _planted_per_row(self, sow, counts: dict) -> bool:
        name = sow.params["name"]
        return name in counts and self.sites.planted.get(name) == "append"


class HarvestHooks(Hooks):
    """oryx's errors for channels (append sows, their plants) where they
    cannot go; channel sites are ``_ChannelSite``s."""

    def __init__(self, sites: "HarvestSites", traced_rules: "JvpRules"):
        self.sites = sites
        self.rules = _HarvestRules(sites, traced_rules)

    def describe_ctx(self, index):
        for (kind, name), positions in self.sites.ctx_index.items():
            if index in positions:
                return f"the value planted for '{display_name(name)}'" if kind == "plant" else (
                    f"the value reaped for '{display_name(name)}'")
        return super().describe_ctx(index)

    def loop_channel(self, key, loop, path):
        name = key.site.name
        if loop == "while_loop":
            return ValueError(f"Must use clobber or cond_clobber mode for '{display_name(name)}' "
                              f"inside of a `while_loop`.")
        return ValueError(
            f"taxpr.harvest: append-mode sow '{display_name(name)}' inside {loop} at "
            f"{format_path(path)} is not supported yet; use clobber mode there")

    def branches(self, collects, path):
        if len({tuple(k for k, _ in c) for c in collects}) > 1:
            raise ValueError("Mismatching number of `sow`s between branches.")


class HarvestSites:
    """Rewrites selected sows: reap (record) and/or plant (replace)."""

    def __init__(self, reaped: dict, planted: dict, ctx_index: dict, partial: frozenset = frozenset(),
                 perturb: bool = False):
        self.reaped = reaped  # name -> mode, for names to reap
        self.planted = planted  # name -> mode, for names to plant
        self.perturb = perturb  # planted values are added to the sown ones (``perturb``)
        self.partial = partial  # planted names whose plant is ``rows(...)``
        self.ctx_index = ctx_index  # ("reap"|"plant", name) -> ctx leaf positions
        self.rewritten: set = set()  # names of the sows rewritten so far
        self.rule_only: set = set()  # names sown only inside custom JVP rules
        self._fns: dict = {}

    def _apply(self, level: Level, key: str, fn: Callable, atoms: list) -> list:
        avals = tuple(_aval(a) for a in atoms)
        hit = self._fns.get((key, avals, id(level.context)))
        if hit is None:
            hit = self._fns[(key, avals, id(level.context))] = level.trace(fn, avals)
        return inline(level, hit, atoms)

    def __call__(self, engine: Engine, eqn, level: Level, ctx: list) -> list:
        if eqn.primitive is not tag_p:
            # Tangents / cotangents: reaped values pass through unchanged;
            # planted values are constants (derivative 0).
            name = eqn.params["name"]
            n = len(eqn.invars) // 2
            tangents = [level.atom(v) for v in eqn.invars[n:]]
            if name in self.partial:
                raise NotImplementedError(
                    f"taxpr.harvest: a rows(...) plant for '{display_name(name)}' at "
                    f"{format_path(level.path)} reaches a derivative of its sow taken inside the "
                    f"planted function; plant the whole stack there instead")
            if name in self.planted and not self.perturb:
                tangents = self._apply(level, "zeros", lambda *t: [jnp.zeros_like(x) for x in t],
                                       tangents)
            for o, a in zip(eqn.outvars, tangents):
                if not isinstance(o, core.DropVar):
                    level.env[o] = a
            return ctx
        name, mode = eqn.params["name"], eqn.params["mode"]
        self.rewritten.add(name)
        n = n_values(eqn.params, len(eqn.invars))
        ins = [level.atom(v) for v in eqn.invars[:n]]
        guard = level.atom(eqn.invars[n]) if n < len(eqn.invars) else None
        value = ins[:-1] if mode == "cond_clobber" else ins
        written: dict[int, Any] = {}  # ctx position -> new leaf (a reap)
        if guard is not None and mode == "append" and (name in self.planted
                                                       or name in self.reaped):
            raise ValueError(
                f"taxpr.harvest: append-mode sow '{display_name(name)}' at {format_path(level.path)} "
                f"is inside {guarded_place(eqn.params)} whose predicate is batched by vmap: "
                f"vmap runs it for every example although only some examples take it, and "
                f"the appended rows would differ per example; use clobber mode there, or "
                f"reap/plant inside the vmap")
        if name in self.planted:
            want = tuple(v.aval for v in eqn.outvars[:len(value)])
            sown = value
            if mode == "append":
                if meta(eqn.params).replay_scope is not None:
                    raise NotImplementedError(
                        f"taxpr.harvest: append-mode sow '{display_name(name)}' at "
                        f"{format_path(level.path)} is bound again in a backward pass that "
                        f"recomputes the forward pass (a custom_vjp's bwd, or jax.checkpoint "
                        f"under jax_remat3), where plant cannot give it the row its forward "
                        f"occurrence got; use clobber mode, or plant outside the "
                        f"differentiated function")
                key = level.channel(_ChannelSite("plant", name))
                if name in self.partial:
                    # rows(...): a mask row says whether this iteration takes
                    # the fed value or keeps the computed one.
                    fed = level.feed(key, [core.ShapedArray((), jnp.bool_),
                                           *(_aval(a) for a in value)])
                    value = self._apply(level, ("rows", want), _keep_unmasked(want),
                                        [*fed, *value])
                else:
                    value = level.feed(key, [_aval(a) for a in value])
            else:
                value = [ctx[i] for i in self.ctx_index[("plant", name)]]
            value = self._apply(level, ("cast", want), _casts([_aval(a) for a in value], want),
                                value)
            if self.perturb:
                value = self._apply(level, ("add", len(sown)), _added(len(sown)), [*sown, *value])
        elif name in self.reaped:
            if mode == "append":
                if level.context is not None:
                    value = self._apply(
                        level, "replicated",
                        _replicated_check(name, level.path, _checks_vma(level)), value)
                level.collect(level.channel(_ChannelSite("reap", name)), value)
            else:
                pos = self.ctx_index[("reap", name)]
                if mode == "cond_clobber":
                    new = self._apply(level, "select",
                                      lambda p, *vc: _select(p, vc), [ins[-1], *value,
                                                                       *(ctx[i] for i in pos)])
                else:
                    new = value
                if guard is not None:  # only the examples that take the branch/iteration
                    old = [ctx[i] for i in pos]
                    records = meta(eqn.params).guard
                    new = self._apply(
                        level, ("guarded", records),
                        _guarded_update(name, level.path, eqn.params, len(new)),
                        [guard, *new, *old])
                if level.context is not None:
                    new = self._apply(level, "replicated",
                                      _replicated_check(name, level.path, _checks_vma(level)), new)
                written.update(zip(pos, new))
        outs = value if mode != "cond_clobber" else [*value, ins[-1]]
        for o, a in zip(eqn.outvars, outs):
            if not isinstance(o, core.DropVar):
                level.env[o] = a
        if not written:
            return ctx  # (the same list: the engine then knows nothing changed)
        ctx = list(ctx)
        for i, a in written.items():
            ctx[i] = a
        # The positions written, told to the engine: comparing every leaf
        # per site would be quadratic in the number of sows.
        level.changed = (ctx, list(written))
        return ctx


def _aval(atom):
    return atom.aval


def _added(n: int) -> Callable:
    def add(*ab):
        return [a + b for a, b in zip(ab[:n], ab[n:])]
    return add


def _keep_unmasked(want) -> Callable:
    def fn(mask, *planted_and_computed):
        n = len(want)
        return [jnp.where(mask, p, c).astype(w.dtype)
                for p, c, w in zip(planted_and_computed[:n], planted_and_computed[n:], want)]
    return fn


def _select(pred, vc):
    n = len(vc) // 2
    return [jnp.where(pred, v, c) for v, c in zip(vc[:n], vc[n:])]


def _guarded_update(name, path, params: dict, n: int) -> Callable:
    """``(guard, *new, *old) -> leaves``: ``new`` where the guard holds, per
    example. A guarded tag's batched operands have their batch axes in front
    (outermost first), and ``TagMeta.guard`` says which leaf each vmap level
    batched, so the guard is aligned with each leaf's leading axes."""
    levels = meta(params).guard[::-1]  # outermost first, as the guard's axes

    def fn(guard, *leaves):
        out = []
        for k, (new, old) in enumerate(zip(leaves[:n], leaves[n:])):
            index = []
            for guard_batched, *leaf_batched in levels:
                if leaf_batched[k]:
                    index.append(slice(None))
                elif guard_batched:
                    raise ValueError(
                        f"taxpr.harvest: sow '{display_name(name)}' at {format_path(path)} is "
                        f"inside {guarded_place(params)} whose predicate is batched by vmap, "
                        f"and sows a value that vmap does not batch: the reaped value would "
                        f"differ per example (the sown value where the example takes the "
                        f"branch, the previous one elsewhere) but has the sown value's "
                        f"unbatched shape; sow a batched value, or reap inside the vmap")
                else:
                    index.append(0)  # the guard is the same along this axis
            g = guard[tuple(index)]
            g = g.reshape(g.shape + (1,) * (jnp.ndim(new) - g.ndim))
            out.append(jax.lax.select_n(jnp.broadcast_to(g, jnp.shape(new)), old, new))
        return out
    return fn


def _casts(got, want) -> Callable:
    """Give planted values the sow's exact type (weak type; inside shard_map
    the sow's varying axes: a replicated plant is the same on every shard)."""
    def fn(*xs):
        return [_jaxpr.match_varying(_jaxpr.cast_weak_type(x, w), _jaxpr.varying_axes(w))
                for x, w in zip(xs, want)]
    return fn


def _checks_vma(level: Level) -> bool:
    return getattr(level.context, "checks_vma", True)


class PerShardReapError(ValueError):
    """A value reaped from outside a shard_map that differs across its
    shards (or may, without vma checking): ``name`` the sow's, ``path``
    where it is."""

    def __init__(self, message: str, name: Any, path: tuple[str, ...]):
        super().__init__(message)
        self.name, self.path = name, path


def _replicated_check(name, path, checks_vma: bool = True) -> Callable:
    def fn(*xs):
        if not checks_vma:
            raise PerShardReapError(
                f"taxpr.harvest: sow '{display_name(name)}' at {format_path(path)} is reaped inside a "
                f"shard_map without vma checking (check_vma=False, as jax.pmap uses): taxpr "
                f"cannot tell whether the value is the same on every shard (only one shard's "
                f"value would be reaped); use shard_map with check_vma=True, or reap inside "
                f"the body (call_and_reap there, or tx.capture of the body) and return the "
                f"values through out_specs", name, path)
        for x in xs:
            if _jaxpr.varying_axes(core.typeof(x)):
                raise PerShardReapError(
                    f"taxpr.harvest: sow '{display_name(name)}' at {format_path(path)} reaps a value "
                    f"that differs across the shards of a shard_map, and a reap outside the "
                    f"shard_map gets one value for the whole mesh: sow a value that is the same "
                    f"on every shard (e.g. after a psum), or reap inside the body (call_and_reap "
                    f"there, or tx.capture of the body) and return the values through out_specs "
                    f"(stacked per shard)", name, path)
        return list(xs)
    return fn


# The engine's path elements of the derivative rules that run in a custom
# function's place when JAX differentiates it: a custom_jvp's JVP rule and
# a custom_vjp's fwd.
_RULE_OF = {_compat.custom_jvp_call_p: "custom_jvp[rule]",
            _compat.custom_vjp_call_p: "custom_vjp[fwd]"}


# The flags each rule's thunk (keyed by its function, one per staged call)
# was last looked into with: tried alone on a warm cache. A look that fails
# leaves JAX's memoized thunk without the output trees it stores when it
# traces, so that JAX's own next call, a cache hit, would find none.
_FLAGS_THAT_TRACE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _remember_flags(fn: Any, flags: tuple | None = None) -> tuple | None:
    """The flags remembered for ``fn`` (and, given ``flags``, remember
    those); None for a function that cannot be referenced weakly."""
    try:
        if flags is not None:
            _FLAGS_THAT_TRACE[fn] = flags
        return _FLAGS_THAT_TRACE.get(fn)
    except TypeError:
        return None


class JvpRules:
    """The JVP rules of ``custom_jvp_call`` equations and the fwd rules of
    ``custom_vjp_call`` ones, traced once each (as JAX would when
    differentiating), to find the sows inside them."""

    def __init__(self, enabled: bool):
        # Without a differentiation trace around this harvest, no rule runs
        # while it evaluates the program: tracing them would be wasted.
        self.enabled = enabled
        self._rules = _traverse.IdMemo()  # eqn -> the rule's closed jaxpr

    def jaxpr(self, eqn) -> Any:
        """The rule of a ``custom_jvp_call`` or ``custom_vjp_call`` seen by
        ``iter_eqns`` (every input differentiated), or None. A call met only
        inside a rule (the call of its function that a rule makes, given a
        function rewritten by ``tx.patch``) has its rule traced when asked
        for: JAX runs it when it differentiates that call."""
        missing = object()
        rule = self._rules.get(eqn, default=missing)
        if rule is missing:
            if not self.enabled or eqn.primitive not in _RULE_OF:
                return None
            return self._trace(eqn, ())
        return rule

    def _trace(self, eqn, contexts: tuple) -> Any:
        """The rule's closed jaxpr, or None when it cannot be traced before
        it runs (a rule with state: its error comes when JAX runs it).
        ``contexts`` are the tracing contexts of the bodies around ``eqn``
        (``ShardMapBody``), entered as JAX enters them when it runs the rule."""
        n = len(eqn.invars) - eqn.params.get("num_consts", 0)
        jvp = eqn.primitive is _compat.custom_jvp_call_p
        thunk = eqn.params["jvp_jaxpr_fun" if jvp else "fwd_jaxpr_thunk"]
        # Every input differentiated, as JAX's vjp of the whole program would
        # (zeros: none; nonzeros: all); a fwd that refuses tangents for inputs
        # JAX may never perturb (equinox's ``filter_custom_vjp`` for its
        # ``*args``) is looked into with none perturbed instead.
        known = _remember_flags(thunk.f)
        tries = [known] if known is not None else (
            [(False,) * n] if jvp else [(True,) * n, (False,) * n])
        for flags in tries:
            try:
                with speculative_rule_traces(), contextlib.ExitStack() as entered:
                    for context in contexts:
                        entered.enter_context(context())
                    jaxpr, consts, *_ = thunk.call_wrapped(*flags)
            except Exception:  # noqa: BLE001 - a look, not a run: nothing it raises escapes
                # The rule refuses these tangents (equinox's
                # ``nondifferentiable``), or holds tags that cannot be
                # threaded (``RuleNotTraceable``): JAX raises its own error if
                # it ever runs the rule that way.
                continue
            _remember_flags(thunk.f, flags)
            return self._rules.set(eqn, _jaxpr.close_traced(jaxpr, consts))
        return self._rules.set(eqn, None)

    def iter_eqns(self, closed):
        """``_traverse.iter_eqns`` of the program, also into the JVP rules of
        its ``custom_jvp_call``s and the fwd rules of its ``custom_vjp_call``s
        (``in_rule`` flag). Not into rules inside rules (they run only under
        a second derivative, and a rule may call its own function), nor
        inside a custom_vjp function (its bwd replays it). A rule inside a
        ``shard_map`` is traced in the body's context."""
        for eqn, path, contexts in _traverse.walk(closed, _subs_with_body_contexts, ()):
            yield eqn, path, False
            label = _RULE_OF.get(eqn.primitive)
            if (self.enabled and label is not None
                    and not any(p.startswith("custom_vjp") for p in path)):
                rule = self._trace(eqn, contexts)
                for e, p in () if rule is None else _traverse.iter_eqns(rule, (*path, label)):
                    yield e, p, True


def _subs_with_body_contexts(eqn, path, contexts: tuple):
    """``_traverse.walk``'s sub-jaxprs as ``_traverse.iter_eqns`` has them
    (with those a high-level primitive holds), each with the tracing
    contexts of the bodies around it: a shard_map's body adds its own."""
    inner = ((*contexts, ShardMapBody(eqn.params)) if eqn.primitive is _compat.shard_map_p
             else contexts)
    for sub, sj in _traverse.subjaxprs(eqn):
        yield sub, sj, inner
    if _compat.call_hi_primitive_p is not None and eqn.primitive is _compat.call_hi_primitive_p:
        label = _traverse.hi_name(eqn)
        for sj in _traverse.hidden_jaxprs(eqn):
            yield _traverse.Sub("_prim", None, label), sj, contexts

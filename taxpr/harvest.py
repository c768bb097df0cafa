"""Harvest: oryx-compatible ``sow`` / ``reap`` / ``plant`` on the threading engine.

A drop-in replacement for ``oryx.core.interpreters.harvest``: same names,
signatures, semantics and error messages. Built on taxpr's engine:

* ``strict`` / ``clobber`` / ``cond_clobber`` reaps are carried values (ctx);
* ``append`` reaps are collected per site, stacked by ``scan`` along its axis;
* planted values of non-append sows are carried values, planted ``append``
  values are fed per site (``scan`` slices them along its axis).

Better than oryx: planted values are shape/dtype-checked (with JAX's
weak-type promotion); plant of an ``append`` sow inside a scan works, also
for selected rows only (``rows``); sows in ``shard_map`` work or raise a
clear error; ``strict=True`` catches misspelled names; errors never corrupt
JAX's trace state; cost grows linearly with nesting depth. Sows inside a
``custom_jvp`` rule are threaded through the rule when JAX differentiates
the call (the engine's ``rule_has_selected`` / ``prepare_rule`` hooks).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import contextvars
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax._src.interpreters import partial_eval as pe

from . import _compat, _jaxpr, _traverse
from ._engine import (Engine, Hooks, Level, format_path, inline,
                      speculative_rule_traces)
from ._find import dissolve_tags
from ._inject import trace_program
from ._inject import guarded_place
from .primitives._tag import BATCHED, GUARD, REPLAY_SCOPE, TREE, n_values, tag, tag_p

__all__ = ["sow", "sow_cond", "reap", "call_and_reap", "plant", "harvest", "perturb", "nest",
           "rows", "PlantRows", "sow_p"]

sow_p = tag_p  # the primitive behind ``sow``


class _SowOp:
    """The ``op`` param of a sow (compared by identity: never a user's tag)."""

    __slots__ = ()

    def __repr__(self):
        return "sow"

    def batches_values_alike(self, params: dict) -> bool:
        """A ``sow_cond`` whose predicate vmap batches sows per example."""
        return params.get("mode") == "cond_clobber"


SOW = _SowOp()
# The ``nest`` scopes around the code being traced, outermost first.
_SCOPES: contextvars.ContextVar[tuple] = contextvars.ContextVar("taxpr_nest_scopes", default=())
# (tag, name) -> per-leaf avals a sow takes while a plant re-traces the
# program (see ``_plant_types``); set only around that trace.
_RETYPE: contextvars.ContextVar[dict] = contextvars.ContextVar("taxpr_plant_retype", default={})


def _scope() -> tuple:
    return _SCOPES.get()


def sow(value: Any, *, tag: Any, name: Any, mode: str = "strict", key: Any = None) -> Any:
    """Mark ``value`` as an intermediate named ``name`` for harvests of ``tag``.

    Outside a harvest, ``sow`` is the identity (in eager code and under any
    JAX transformation). ``reap`` / ``call_and_reap`` collect sown values,
    ``plant`` replaces them.

    Arguments:
        value: a pytree of arrays (or Python scalars).
        tag: the harvest tag (any hashable value); only harvests of this tag
            see the sow.
        name: the value's name (hashable) in the reaped / planted dict.
        mode: ``"strict"`` (sown at most once per harvest, not in loops),
            ``"clobber"`` (the last value wins; required in ``while_loop``)
            or ``"append"`` (values stacked along a new leading axis, one row
            per time the sow runs; inside ``scan`` one per iteration).
        key: accepted for oryx compatibility and ignored.

    Returns:
        ``value``, or the planted value inside a ``plant``.

    Raises:
        ValueError: ``mode`` is ``"cond_clobber"`` (use ``sow_cond``) or unknown.

    Example:
        >>> def f(x):
        ...     y = sow(x * 2, tag="t", name="y")
        ...     return y + 1
        >>> reap(f, tag="t")(1.0)  # {"y": 2.0}
    """
    del key
    if mode == "cond_clobber":
        raise ValueError("For 'cond_clobber' mode, use `sow_cond`.")
    if mode not in ("strict", "clobber", "append"):
        raise ValueError(f"Invalid mode: {mode}")
    return _tag_sow(value, None, tag, name, mode)


def sow_cond(value: Any, pred: Any, *, tag: Any, name: Any, mode: str = "cond_clobber",
             key: Any = None) -> Any:
    """Sow ``value`` in ``cond_clobber`` mode: a reap keeps the last value whose
    ``pred`` was true (zeros if it never was), e.g. inside ``while_loop``.

    Arguments:
        value: a pytree of arrays.
        pred: a boolean scalar (may be traced).
        tag, name: as for ``sow``.
        mode: must be ``"cond_clobber"`` (oryx's signature).
        key: accepted for oryx compatibility and ignored.

    Returns:
        ``value``, or the planted value inside a ``plant``.

    Raises:
        ValueError: ``mode`` is not ``"cond_clobber"``.

    Example:
        >>> def f(xs):
        ...     def body(c, x):
        ...         sow_cond(x, x > 0, tag="t", name="last_positive")
        ...         return c, None
        ...     return jax.lax.scan(body, 0.0, xs)[0]
        >>> reap(f, tag="t")(jnp.array([1.0, -2.0]))  # {"last_positive": 1.0}
    """
    del key
    if mode != "cond_clobber":
        raise ValueError(f"sow_cond only supports mode='cond_clobber', got {mode!r}")
    return _tag_sow(value, jnp.asarray(pred, bool), tag, name, "cond_clobber")


def _tag_sow(value, pred, tag_, name, mode):
    full = (*_scope(), name) if _scope() else name
    retype = _RETYPE.get().get((tag_, full))
    if retype is not None:  # a plant re-traces this sow with the planted value's type
        leaves, tree = jax.tree_util.tree_flatten(value)
        value = jax.tree_util.tree_unflatten(tree, [
            x if t is None else _compat.cast_weak_type(jax.lax.convert_element_type(x, t.dtype), t)
            for x, t in zip(leaves, retype)])
    if pred is None:
        return tag(value, op=SOW, tag=tag_, name=full, mode=mode)
    return tag((value, pred), op=SOW, tag=tag_, name=full, mode=mode)[0]


def nest(f: Callable, *, scope: str) -> Callable:
    """``f`` with the names of the sows it makes nested under ``scope``.

    Reaps of ``nest(f, scope=s)`` come back as ``{s: {name: value}}``,
    plants are read from ``plants[s][name]``, and an ``allowlist`` /
    ``blocklist`` entry ``s`` selects the whole scope. Scopes nest.

    Arguments:
        f: the function whose sows are scoped (called with the same arguments).
        scope: the scope's name; it may not also be a sow's name in the same
            harvest.

    Returns:
        ``wrapped(*args, **kwargs) -> f(*args, **kwargs)``.

    Raises:
        ValueError (at harvest time): a sow and a scope share a name
            ("Variable has already been reaped: ...", as oryx).

    Example:
        >>> g = nest(lambda x: sow(x, tag="t", name="a"), scope="layer1")
        >>> reap(g, tag="t")(1.0)  # {"layer1": {"a": 1.0}}
    """

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        token = _SCOPES.set((*_SCOPES.get(), scope))
        try:
            return f(*args, **kwargs)
        finally:
            _SCOPES.reset(token)

    return wrapped


# ---- selection and static checks --------------------------------------------------

def _is_sow(params: dict) -> bool:
    return params.get("op") is SOW


class _Filter:
    def __init__(self, tag_, allowlist, blocklist):
        self.tag = tag_
        self.allow = None if allowlist is None else set(allowlist)
        self.block = set(blocklist or ())

    def name_ok(self, name) -> bool:
        head = name[0] if isinstance(name, tuple) else name
        for n in {name, head}:
            if n in self.block:
                return False
        return self.allow is None or name in self.allow or head in self.allow

    def __call__(self, params: dict, shape: Any = None) -> bool:
        return (_is_sow(params) and params["tag"] == self.tag
                and self.name_ok(params["name"]))


def _site_aval(eqn) -> tuple:
    """(value avals, mode) of a sow equation (cond_clobber drops the pred)."""
    avals = tuple(v.aval for v in eqn.invars[:n_values(eqn.params, len(eqn.invars))])
    if eqn.params["mode"] == "cond_clobber":
        avals = avals[:-1]
    return avals


def _disp(name) -> str:
    return ".".join(map(str, name)) if isinstance(name, tuple) else str(name)


class _SowCount(NamedTuple):
    """What ``_check`` knows of a sow name within one jaxpr: how many sows,
    the mode and value avals of the first, whether vmap batched them, and the
    batched-predicate cond it sits in (for the error's explanation)."""
    n: int
    mode: str
    avals: tuple
    batched: bool
    guard: str | None


def _check(jaxpr: Any, select: _Filter, transformed: set, verb: Callable) -> None:
    """oryx's static rules: strict sows once per scope, no strict in scan,
    only clobber modes in while (for the ``transformed`` names), and every
    cond branch sows alike (for every ``select``-ed name, as oryx checks)."""

    def walk(j, in_scan: bool, in_while: bool) -> dict:
        counts: dict = {}
        for eqn in _jaxpr.jaxpr_parts(j).eqns:
            if eqn.primitive is tag_p and select(eqn.params):
                name, mode = eqn.params["name"], eqn.params["mode"]
                if name in transformed:
                    if in_while and mode not in ("clobber", "cond_clobber"):
                        raise ValueError(f"Must use clobber or cond_clobber mode for "
                                         f"'{_disp(name)}' inside of a `while_loop`.")
                    if in_scan and mode == "strict":
                        raise ValueError(
                            f"Cannot use strict mode for '{_disp(name)}' inside `scan`.")
                _count(counts, name, mode, _site_aval(eqn), bool(eqn.params.get(BATCHED)),
                       guarded_place(eqn.params) if GUARD in eqn.params else None)
                continue
            subs = _traverse.subjaxprs(eqn)
            if not subs:
                continue
            prim = eqn.primitive
            inner = [walk(sj, in_scan or prim is _compat.scan_p,
                          in_while or prim is _compat.while_p)
                     for _, sj in subs]
            if prim is _compat.cond_p:
                _check_branches(inner)
                merged = {}
                for branch in inner:
                    for k, v in branch.items():
                        if k not in merged or v.n > merged[k].n:
                            merged[k] = v
                inner = [merged]
            for branch in inner:
                for name, c in branch.items():
                    for _ in range(c.n):
                        _count(counts, name, c.mode, c.avals, c.batched, c.guard)
        return counts

    def _count(counts, name, mode, avals, batched, guard):
        n = counts[name].n if name in counts else 0
        if n and mode == "strict" and name in transformed:
            guard = guard or counts[name].guard
            why = "" if guard is None else (
                f". The sow is inside {guard} whose predicate is batched by vmap: vmap runs "
                f"every branch for every example, so a strict sow in several branches counts "
                f"once per branch; use clobber mode there, or reap inside the vmap.")
            raise ValueError(f"Variable has already been {verb(name)}: {_disp(name)}{why}")
        if n and name in transformed:
            # One reaped value (a carried one, or the rows of one stack) has
            # one type: every sow of the name must sow that type.
            first = counts[name]
            if [a.shape for a in avals] != [a.shape for a in first.avals]:
                raise ValueError(f"Mismatched shape between sows: '{_disp(name)}'."
                                 f"{_vmap_why(batched, first.batched, 'sow')}")
            if mode != "append" and [a.dtype for a in avals] != [a.dtype for a in first.avals]:
                raise ValueError(f"Mismatched dtype between sows: '{_disp(name)}'.")
            if ([_compat.explicit_sharding(a) for a in avals]
                    != [_compat.explicit_sharding(a) for a in first.avals]):
                raise ValueError(
                    f"Mismatched sharding between sows: '{_disp(name)}': "
                    f"{', '.join(a.str_short() for a in first.avals)} and "
                    f"{', '.join(a.str_short() for a in avals)} (JAX's sharding in types: "
                    f"every sow of a name sows one type; reshard one of them).")
        counts[name] = _SowCount(n + 1, mode, avals, batched, guard)

    walk(jaxpr, False, False)


def _vmap_why(batched: bool, other_batched: bool, place: str) -> str:
    """Why two sows of a name differ in shape, when vmap batched only one."""
    if batched == other_batched:
        return ""
    return (f" vmap batches the sown value in one {place} and not in another; reap inside "
            f"the vmap (per example), or sow values that vmap batches alike in every {place}.")


def _check_branches(branches: list[dict[Any, _SowCount]]) -> None:
    """oryx's order: each later branch is compared name by name with the
    first one (``branches[0]``; for ``lax.cond`` that is the false branch)."""
    first = branches[0]
    for other in branches[1:]:
        if len(other) != len(first):
            raise ValueError("Mismatching number of `sow`s between branches.")
        for name, c in other.items():
            if name not in first:
                raise ValueError(f"Missing sow in branch: '{_disp(name)}'.")
            f = first[name]
            if [a.shape for a in c.avals] != [a.shape for a in f.avals]:
                raise ValueError(f"Mismatched shape between branches: '{_disp(name)}'."
                                 f"{_vmap_why(c.batched, f.batched, 'branch')}")
            if [a.dtype for a in c.avals] != [a.dtype for a in f.avals]:
                raise ValueError(f"Mismatched dtype between branches: '{_disp(name)}'.")


class _ChannelKey(NamedTuple):
    """The engine's channel key of one sow's or plant's occurrence."""

    kind: str  # "reap" (collected) or "plant" (fed)
    name: str  # the sow's name
    occurrence: int  # its place among the occurrences of ``name`` at its level
    stacked: bool  # whether its value comes out of a scan (one row per step)


class _HarvestHooks(Hooks):
    """Channel keys are ``(kind, name, occurrence, stacked)``: occurrences are
    numbered afresh in every enclosing jaxpr, so sows in different calls
    (two jits, two scans) never share a key."""

    def __init__(self, sites: "_Sites", rules: "_JvpRules"):
        self.sites = sites
        self.rules = rules

    def prepare_rule(self, engine, rule, n_primals):
        """Sows in the rule whose value depends on the tangents stay plain
        identities (not reaped or planted), so reverse mode can linearize."""
        dep = set(_jaxpr.jaxpr_parts(rule).invars[n_primals:])

        def rewrite(eqn, path, env):
            if path or not any(type(v) is core.Var and v in dep for v in eqn.invars):
                return None
            dep.update(o for o in eqn.outvars if not isinstance(o, core.DropVar))
            ins = [env.get(v, v) if type(v) is core.Var else v for v in eqn.invars]
            if eqn.primitive is tag_p and engine.predicate(eqn.params):
                for o, i in zip(eqn.outvars, ins):
                    if not isinstance(o, core.DropVar):
                        env[o] = i
                return []
            subs = _traverse.subjaxprs(eqn)
            if subs:  # conservatively: every sow inside depends on the tangents
                eqn = _traverse.with_subjaxprs(eqn, {
                    (sub.key, sub.index): dissolve_tags(sj, lambda p, s: engine.predicate(p))
                    for sub, sj in subs})
            return [eqn.replace(invars=ins)]

        return _traverse.map_jaxpr(rule, rewrite)

    def rule_has_selected(self, engine, eqn) -> bool:
        # Sows found nowhere but in JVP rules, and planted sows: the others
        # (e.g. the function's own sows, when its rule calls it) are reaped
        # from the function as usual; a planted one is planted in the rule too,
        # so that a rule computing the function's JVP gives the planted one's.
        rule = self.rules.jaxpr(eqn)
        return rule is not None and any(
            e.primitive is tag_p and engine.predicate(e.params) and self.sites.in_rules(
                e.params["name"]) for e, _ in _traverse.iter_eqns(rule))

    def rekey(self, key, level, stacked):
        return key._replace(occurrence=self.sites.next_occurrence(level, key.kind, key.name),
                            stacked=key.stacked or stacked)

    def loop_channel(self, key, loop, path):
        name = key.name
        if loop == "while_loop":
            return ValueError(f"Must use clobber or cond_clobber mode for '{_disp(name)}' "
                              f"inside of a `while_loop`.")
        return ValueError(
            f"taxpr.harvest: append-mode sow '{_disp(name)}' inside {loop} at "
            f"{format_path(path)} is not supported yet; use clobber mode there")

    def branches(self, collects, path):
        if len({tuple(k for k, _ in c) for c in collects}) > 1:
            raise ValueError("Mismatching number of `sow`s between branches.")


# ---- the site rule ------------------------------------------------------------------

class _Sites:
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
        self._occurrence: dict = {}  # (level, kind, name) -> count (levels kept alive)
        self._fns: dict = {}

    def in_rules(self, name: Any) -> bool:
        """Whether a sow of ``name`` inside a custom JVP rule is rewritten:
        sown only in rules (reaped there), or planted (not in append mode:
        its per-site values cannot be fed into a rule)."""
        return name in self.rule_only or self.planted.get(name, "append") != "append"

    def next_occurrence(self, level: Level, kind: str, name: Any) -> int:
        n = self._occurrence.get((level, kind, name), 0)
        self._occurrence[(level, kind, name)] = n + 1
        return n

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
                    f"taxpr.harvest: a rows(...) plant for '{_disp(name)}' at "
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
        if _RULE in level.path and not self.in_rules(name):
            level.emit(eqn)  # reaped where the function itself sows it
            return ctx
        self.rewritten.add(name)
        n = n_values(eqn.params, len(eqn.invars))
        ins = [level.atom(v) for v in eqn.invars[:n]]
        guard = level.atom(eqn.invars[n]) if n < len(eqn.invars) else None
        value = ins[:-1] if mode == "cond_clobber" else ins
        ctx = list(ctx)
        if guard is not None and mode == "append" and (name in self.planted
                                                       or name in self.reaped):
            raise ValueError(
                f"taxpr.harvest: append-mode sow '{_disp(name)}' at {format_path(level.path)} "
                f"is inside {guarded_place(eqn.params)} whose predicate is batched by vmap: "
                f"vmap runs it for every example although only some examples take it, and "
                f"the appended rows would differ per example; use clobber mode there, or "
                f"reap/plant inside the vmap")
        if name in self.planted:
            want = tuple(v.aval for v in eqn.outvars[:len(value)])
            sown = value
            if mode == "append":
                if eqn.params.get(REPLAY_SCOPE) is not None:
                    raise NotImplementedError(
                        f"taxpr.harvest: append-mode sow '{_disp(name)}' at "
                        f"{format_path(level.path)} is bound again in a backward pass that "
                        f"recomputes the forward pass (a custom_vjp's bwd, or jax.checkpoint "
                        f"under jax_remat3), where plant cannot give it the row its forward "
                        f"occurrence got; use clobber mode, or plant outside the "
                        f"differentiated function")
                key = _ChannelKey("plant", name, self.next_occurrence(level, "plant", name), False)
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
                occurrence = self.next_occurrence(level, "reap", name)
                level.collect(_ChannelKey("reap", name, occurrence, False), value)
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
                    records = eqn.params[GUARD]
                    new = self._apply(
                        level, ("guarded", records),
                        _guarded_update(name, level.path, eqn.params, len(new)),
                        [guard, *new, *old])
                if level.context is not None:
                    new = self._apply(level, "replicated",
                                      _replicated_check(name, level.path, _checks_vma(level)), new)
                for i, a in zip(pos, new):
                    ctx[i] = a
        outs = value if mode != "cond_clobber" else [*value, ins[-1]]
        for o, a in zip(eqn.outvars, outs):
            if not isinstance(o, core.DropVar):
                level.env[o] = a
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
    (outermost first), and ``params[GUARD]`` says which leaf each vmap level
    batched, so the guard is aligned with each leaf's leading axes."""
    levels = params[GUARD][::-1]  # outermost first, as the guard's axes

    def fn(guard, *leaves):
        out = []
        for k, (new, old) in enumerate(zip(leaves[:n], leaves[n:])):
            index = []
            for guard_batched, *leaf_batched in levels:
                if leaf_batched[k]:
                    index.append(slice(None))
                elif guard_batched:
                    raise ValueError(
                        f"taxpr.harvest: sow '{_disp(name)}' at {format_path(path)} is "
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
        return [_compat.match_varying(_compat.cast_weak_type(x, w), _compat.varying_axes(w))
                for x, w in zip(xs, want)]
    return fn


def _checks_vma(level: Level) -> bool:
    return getattr(level.context, "checks_vma", True)


def _replicated_check(name, path, checks_vma: bool = True) -> Callable:
    def fn(*xs):
        if not checks_vma:
            raise ValueError(
                f"taxpr.harvest: sow '{_disp(name)}' at {format_path(path)} is reaped inside a "
                f"shard_map without vma checking (check_vma=False, as jax.pmap uses): taxpr "
                f"cannot tell whether the value is the same on every shard (only one shard's "
                f"value would be reaped); use shard_map with check_vma=True, or reap outside "
                f"the shard_map / pmap")
        for x in xs:
            if _compat.varying_axes(core.typeof(x)):
                raise ValueError(
                    f"taxpr.harvest: sow '{_disp(name)}' at {format_path(path)} reaps a value "
                    f"that differs across the shards of a shard_map; sow a value that is the "
                    f"same on every shard (e.g. after a psum), or reap outside the shard_map")
        return list(xs)
    return fn


# ---- the transformations ------------------------------------------------------------

def _flat_trace(fn: Callable, args, kwargs, retype: dict, select: "_Filter"):
    """Trace ``fn``; while tracing, the sows named in ``retype`` produce the
    given types (added to those an enclosing plant's trace asked for)."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    token = _RETYPE.set({**_RETYPE.get(), **retype})
    try:
        closed, out_tree = trace_program(fn, tree, [_compat.abstractify(x) for x in leaves],
                                         consumes=select)
    finally:
        _RETYPE.reset(token)
    return closed, out_tree, leaves


def _nest_dict(flat: dict) -> dict:
    out: dict = {}
    for name, v in flat.items():
        if isinstance(name, tuple):
            d = out
            for part in name[:-1]:
                d = d.setdefault(part, {})
            d[name[-1]] = v
        else:
            out[name] = v
    return out


_MISSING = object()


def _lookup_plant(plants: dict, name: Any) -> Any:
    """``plants[name]``, or for a nested name ``plants[s1][s2]...``."""
    if not isinstance(name, tuple):
        return (plants or {}).get(name, _MISSING)
    d = plants or {}
    for part in name:
        if not isinstance(d, dict) or part not in d:
            return _MISSING
        d = d[part]
    return d


def _plant_names(plants: dict, site_names) -> list:
    """The names a plants dict gives values for (a nest scope's dict is
    descended into; any other value is one name's value)."""
    scopes = {n[:i] for n in site_names if isinstance(n, tuple) for i in range(1, len(n))}
    out: list = []

    def walk(d, prefix):
        for k, v in d.items():
            path = (*prefix, k)
            if isinstance(v, dict) and path in scopes:
                walk(v, path)
            else:
                out.append(path if prefix else k)

    walk(plants or {}, ())
    return out


def _list(names) -> str:
    return "[" + ", ".join(repr(_disp(n)) for n in sorted(names, key=_disp)) + "]"


def _strict_check(tag_, all_names, allowlist, blocklist, plants, planted) -> None:
    """``strict=True``: every allowlist / blocklist entry and every planted
    name must match a sow of ``tag_`` in the program (a typo raises)."""
    def matches(entry):
        return any(n == entry or (isinstance(n, tuple) and n[0] == entry) for n in all_names)

    problems = []
    for what, entries in (("allowlist", allowlist or ()), ("blocklist", blocklist or ())):
        missing = [e for e in entries if not matches(e)]
        if missing:
            problems.append(f"{what} names {_list(missing)} match no sow")
    unplanted = [n for n in _plant_names(plants, all_names) if n not in planted]
    if unplanted:
        problems.append(f"planted names {_list(unplanted)} were never planted (no selected sow "
                        f"has them)")
    if problems:
        raise ValueError(f"taxpr.harvest (strict=True), tag {tag_!r}: " + "; ".join(problems)
                         + f". Sows of tag {tag_!r} in this program: {_list(all_names)}")


class _Site(NamedTuple):
    mode: str
    avals: tuple
    path: tuple
    tree: Any  # the sown value's pytree structure


class PlantRows:
    """A planted value that replaces only some rows of an ``append`` sow's
    stack (the iterations of a scan, in order); the other rows keep the
    value the program computes. Made by ``rows``."""

    __slots__ = ("index_values", "mask", "values")

    def __init__(self, index_values: dict | None, mask: Any, values: Any):
        self.index_values, self.mask, self.values = index_values, mask, values

    def __repr__(self) -> str:
        if self.index_values is not None:
            return f"rows({{{', '.join(map(str, self.index_values))}: ...}})"
        return "rows(mask=..., values=...)"


def _rows_flatten(r: PlantRows):
    if r.index_values is not None:
        keys = tuple(r.index_values)
        return tuple(r.index_values[k] for k in keys), ("index", keys)
    return (r.mask, r.values), ("mask", None)


def _rows_unflatten(aux, children) -> PlantRows:
    if aux[0] == "index":
        return PlantRows(dict(zip(aux[1], children)), None, None)
    return PlantRows(None, *children)


# A pytree (rows are static, values may be traced), so it passes through jit.
jax.tree_util.register_pytree_node(PlantRows, _rows_flatten, _rows_unflatten)


def rows(index_values: dict | None = None, *, mask: Any = None, values: Any = None) -> PlantRows:
    """A plant value for an ``append`` sow that overrides selected rows of its
    stack, e.g. one layer of a scan-over-layers model.

    The stack of an ``append`` sow has one row per time the sow ran (inside
    ``scan``: one per iteration, in order). ``plant`` normally replaces every
    row; with ``rows`` the unselected rows keep what the program computes
    (the program is not changed and no ``jnp.where`` is needed in it).

    Arguments:
        index_values: ``{row: value}``; each ``value`` has the sow's shape and
            dtype (one row). Negative rows count from the end.
        mask: instead of ``index_values``, a boolean array with one entry per
            row (may be traced) ...
        values: ... and the full stack the selected rows are taken from.

    Returns:
        A value to put in a ``plant`` / ``harvest`` plants dict.

    Raises:
        ValueError: at ``plant`` time, if the sow is not in ``append`` mode,
            a row is out of range, or a value's shape/dtype differs from the
            sow's.

    Example:
        >>> patched = plant(model, tag="acts")({"layer": rows({1: jnp.zeros(8)})}, x)
    """
    if (index_values is None) == (mask is None):
        raise TypeError("rows() takes either {row: value} or mask=..., values=...")
    if mask is not None and values is None:
        raise TypeError("rows(mask=...) needs values=... (the stack to take rows from)")
    if index_values is not None:
        if not isinstance(index_values, dict) or not all(
                isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in index_values):
            raise TypeError(f"rows() takes a dict {{int row: value}}, got {index_values!r}")
    return PlantRows(None if index_values is None else dict(index_values), mask, values)


class _Like:
    """An aval as an argument of ``jax.dtypes.result_type`` (weak type kept)."""

    def __init__(self, aval):
        self.aval, self.dtype, self.shape = aval, aval.dtype, aval.shape


def _plant_fit(value: Any, aval: Any) -> str:
    """How a planted leaf fits a sow leaf of type ``aval`` (shapes equal):
    ``"same"`` dtype; ``"convert"``: the value is weakly typed (a Python
    scalar) and JAX's promotion with the sow's type gives the sow's dtype, so
    it becomes that dtype; ``"retype"``: the sow is weakly typed (it sowed a
    Python scalar) and promotion gives the planted dtype, so the sow takes the
    planted type (the program is traced again); ``""``: refused."""
    vd, v_weak = jax.dtypes.result_type(value, return_weak_type_flag=True)
    if vd == aval.dtype:
        return "same"
    try:
        both = jax.dtypes.result_type(value, _Like(aval))
    except jax.dtypes.TypePromotionError:  # refused by jax_numpy_dtype_promotion="strict"
        return ""
    if v_weak and both == aval.dtype:
        return "convert"
    if getattr(aval, "weak_type", False) and both == vd:
        return "retype"
    return ""


def _type_str(dtype, shape) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


def _plant_mismatch(name, value, aval, where: str, noun: str = "Planted value") -> ValueError:
    return ValueError(
        f"{noun} for '{_disp(name)}' has type "
        f"{_type_str(jax.dtypes.result_type(value), np.shape(value))}, but "
        f"{where.format(type=_type_str(aval.dtype, aval.shape))}"
        f"{' (weakly typed)' if aval.weak_type else ''}; "
        f"a planted value must have the sow's shape and dtype, or be weakly typed (a Python "
        f"scalar) of a kind that promotes to it, or replace a sown Python scalar with a value "
        f"of a kind it promotes to")


def _conform(name, value: Any, aval: Any, where: str, allow_retype: bool,
             noun: str = "Planted value") -> tuple[Any, Any]:
    """(the planted leaf in the sow's type, or ``None`` if the sow must take
    the planted type; that type)."""
    if tuple(np.shape(value)) != tuple(aval.shape):
        raise _plant_mismatch(name, value, aval, where, noun)
    fit = _plant_fit(value, aval)
    if fit == "same":
        return value, None
    if fit == "convert":
        return _compat.cast_weak_type(jax.lax.convert_element_type(value, aval.dtype), aval), None
    if fit == "retype" and allow_retype:
        vd, v_weak = jax.dtypes.result_type(value, return_weak_type_flag=True)
        return None, core.ShapedArray(aval.shape, vd, weak_type=v_weak)
    raise _plant_mismatch(name, value, aval, where, noun)


def _plant_value(name, value, site: _Site, allow_retype: bool,
                 noun: str = "Planted value") -> tuple[list, list | None]:
    """Checked leaves of a non-append plant (or perturbation: ``noun``), or
    the types its sow must take."""
    leaves = jax.tree_util.tree_leaves(value)
    if len(leaves) != len(site.avals):
        raise ValueError(f"{noun} for '{_disp(name)}' has {len(leaves)} leaves, "
                         f"expected {len(site.avals)}")
    where = f"the sow at {format_path(site.path)} has type {{type}}"
    fitted = [_conform(name, v, a, where, allow_retype, noun)
              for v, a in zip(leaves, site.avals)]
    if any(v is None for v, _ in fitted):
        return [], [t for _, t in fitted]
    return [v for v, _ in fitted], None


_RULE = "custom_jvp[rule]"  # the engine's path element for a custom JVP rule


class _JvpRules:
    """The JVP rules of ``custom_jvp_call`` equations, traced once each (as
    JAX would when differentiating), to find the sows inside them."""

    def __init__(self, enabled: bool):
        # Without a differentiation trace around this harvest, no rule runs
        # while it evaluates the program: tracing them would be wasted.
        self.enabled = enabled
        self._rules = _traverse.IdMemo()  # eqn -> the rule's closed jaxpr

    def jaxpr(self, eqn) -> Any:
        """The rule of a ``custom_jvp_call`` seen by ``iter_eqns`` (all input
        tangents nonzero), or None."""
        return self._rules.get(eqn)

    def _trace(self, eqn) -> Any:
        """The rule's closed jaxpr, or None when it cannot be traced before
        it runs (a rule with state: its error comes when JAX runs it)."""
        fun = eqn.params["jvp_jaxpr_fun"]
        n = len(eqn.invars) - eqn.params.get("num_consts", 0)
        try:
            with speculative_rule_traces():
                jaxpr, consts, _ = fun.call_wrapped(*([False] * n))
        except Exception:  # noqa: BLE001 - a look, not a run: nothing it raises escapes
            # The rule refuses tangents for inputs JAX may never perturb
            # (equinox's ``nondifferentiable``), or holds tags that cannot be
            # threaded (``RuleNotTraceable``): JAX raises its own error if it
            # ever runs the rule that way.
            return self._rules.set(eqn, None)
        return self._rules.set(eqn, _jaxpr.close_traced(jaxpr, consts))

    def iter_eqns(self, closed):
        """``_traverse.iter_eqns`` of the program, also into the JVP rules of
        its ``custom_jvp_call``s (``in_rule`` flag). Not into rules inside
        rules (they run only under a second derivative, and a rule may call
        its own function), nor inside ``shard_map`` (whose rules trace only
        in the body's context)."""
        for eqn, path in _traverse.iter_eqns(closed):
            yield eqn, path, False
            if (self.enabled and eqn.primitive is _compat.custom_jvp_call_p
                    and "shard_map" not in path):
                rule = self._trace(eqn)
                for e, p in () if rule is None else _traverse.iter_eqns(rule, (*path, _RULE)):
                    yield e, p, True


def _may_differentiate(values) -> bool:
    """Whether JAX may differentiate the program while a harvest evaluates
    it: some input is a tracer of a trace that is not plain jit staging
    (``jvp`` / ``grad`` / ``vmap`` / ..., conservatively)."""
    return any(isinstance(x, core.Tracer) and not isinstance(x, pe.DynamicJaxprTracer)
               for x in values)


def _find_sites(closed, select: _Filter, tag_, rules: _JvpRules) -> tuple[dict, list, set]:
    """The selected sows (first occurrence of each name), the names of all
    sows of ``tag_``, and the selected names found only in custom JVP rules."""
    sites: dict = {}
    all_names: dict = {}
    outside: set = set()
    for eqn, path, in_rule in rules.iter_eqns(closed):
        if eqn.primitive is not tag_p or not _is_sow(eqn.params) or eqn.params["tag"] != tag_:
            continue
        all_names.setdefault(eqn.params["name"], None)
        if not in_rule:
            outside.add(eqn.params["name"])
        if select(eqn.params):
            mode, tree = eqn.params["mode"], eqn.params[TREE]
            if mode == "cond_clobber":  # the tag holds (value, pred)
                tree = jax.tree_util.tree_structure(
                    jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves)[0])
            sites.setdefault(eqn.params["name"], _Site(mode, _site_aval(eqn), path, tree))
    return sites, list(all_names), set(sites) - outside


@dataclasses.dataclass(frozen=True)
class _HarvestSpec:
    """What a harvest transformation (``reap``, ``plant``, ``harvest``,
    ``perturb``) was asked for: the arguments it shares."""

    tag: Any
    allowlist: Iterable | None
    blocklist: Iterable
    exclusive: bool
    strict: bool
    reaps: bool  # whether it returns reaped values
    perturb: bool = False  # plants are perturbations, added to the sown values


def _run(fn: Callable, spec: _HarvestSpec, plants: dict, args, kwargs):
    tag_, allowlist, blocklist = spec.tag, spec.allowlist, spec.blocklist
    strict, perturb = spec.strict, spec.perturb
    select = _Filter(tag_, allowlist, blocklist)
    retype: dict = {}  # (tag, name) -> the types the sow takes (see _plant_fit)
    while True:
        closed, out_tree, leaves = _flat_trace(fn, args, kwargs, retype, select)
        rules = _JvpRules(_may_differentiate([*leaves, *_jaxpr.jaxpr_parts(closed).consts,
                                              *jax.tree_util.tree_leaves(plants)]))
        sites, all_names, rule_only = _find_sites(closed, select, tag_, rules)
        for name in sites:  # oryx: a nest scope and a sow may not share a name
            if isinstance(name, tuple) and name[0] in sites:
                verb = "planted" if _lookup_plant(plants, name[0]) is not _MISSING else "reaped"
                raise ValueError(f"Variable has already been {verb}: {_disp(name[0])}")
        planted_values = {n: v for n in sites if (v := _lookup_plant(plants, n)) is not _MISSING}
        if strict:
            _strict_check(tag_, all_names, allowlist, blocklist, plants, planted_values)
        ctx_plants, more = {}, {}
        for name, value in planted_values.items():
            site = sites[name]
            if isinstance(value, PlantRows) and perturb:
                raise ValueError(f"rows(...) given as the perturbation of '{_disp(name)}': a "
                                 f"perturbation is added to every row; give the whole stack")
            if isinstance(value, PlantRows) and site.mode != "append":
                raise ValueError(f"rows(...) planted for '{_disp(name)}', but its sow at "
                                 f"{format_path(site.path)} is in {site.mode!r} mode; rows "
                                 f"select rows of an 'append' sow's stack")
            if site.mode == "append":
                continue
            # A sow already re-traced keeps its type: a mismatch now is an error.
            # A perturbation is added to the sown value: it never retypes it.
            fitted, types = _plant_value(name, value, site,
                                         (tag_, name) not in retype and not perturb,
                                         "Perturbation" if perturb else "Planted value")
            if types is not None:
                more[(tag_, name)] = types
            ctx_plants[name] = fitted
        if not more:
            break
        retype.update(more)
    planted = {n: sites[n].mode for n in planted_values}
    partial = frozenset(n for n, v in planted_values.items() if isinstance(v, PlantRows))
    reaped = {n: s.mode for n, s in sites.items() if n not in planted} if spec.reaps else {}
    # Only the sows this call transforms are rewritten (the others stay, for
    # an enclosing harvest) and follow oryx's static rules.
    transformed = _Filter(tag_, allowlist, blocklist)
    transformed.allow = set(planted) | set(reaped)
    _check(closed, select, set(transformed.allow),
           lambda name: "planted" if name in planted else "reaped")

    # ctx: carried reaps (zeros first) and planted non-append values.
    ctx_leaves, ctx_index = [], {}
    for name, mode in reaped.items():
        if mode != "append":
            avals = sites[name].avals
            ctx_index[("reap", name)] = list(range(len(ctx_leaves), len(ctx_leaves) + len(avals)))
            ctx_leaves.extend(np.zeros(a.shape, a.dtype) for a in avals)
    for name, value in ctx_plants.items():
        ctx_index[("plant", name)] = list(range(len(ctx_leaves), len(ctx_leaves) + len(value)))
        ctx_leaves.extend(value)
    ctx_avals = [_compat.abstractify(x) for x in ctx_leaves]
    site_rule = _Sites(reaped, planted, ctx_index, partial, perturb)
    site_rule.rule_only = rule_only
    engine = Engine(site_rule, transformed, ctx_avals, _HarvestHooks(site_rule, rules))
    threaded = engine.thread_jaxpr(closed, (), 0, len(_jaxpr.jaxpr_parts(closed).outvars))
    if spec.exclusive:
        threaded = dissolve_tags(threaded, lambda p, s: _is_sow(p))
    chans = engine.channels(threaded)
    feeds = []
    for key, avals in chans.feeds:
        feeds.extend(_plant_for_feed(key, avals, planted_values, sites, chans.feeds))
    outs = _jaxpr.jaxpr_as_fun(threaded)(*ctx_leaves, *leaves, *feeds)
    n_out = out_tree.num_leaves
    out = jax.tree_util.tree_unflatten(out_tree, outs[:n_out])
    ctx_out = outs[n_out:n_out + len(ctx_leaves)]
    collected = outs[n_out + len(ctx_leaves):]
    reaps = {}
    for name, mode in reaped.items():
        if mode != "append":
            vals = [ctx_out[i] for i in ctx_index[("reap", name)]]
            reaps[name] = _unflatten_value(sites[name], vals)
    appended: dict = {}
    it = iter(collected)
    for key, avals in chans.collects:
        vals = [next(it) for _ in avals]
        appended.setdefault(key.name, []).append((key, vals))
    for name, items in appended.items():
        stacked = [_stack_occurrences([v[i] for _, v in items], [k for k, _ in items])
                   for i in range(len(items[0][1]))]
        reaps[name] = _unflatten_value(sites[name], stacked)
    # oryx: a sow in a custom JVP rule is reaped only when the rule ran (JAX
    # differentiated the call while this harvest evaluated it).
    for name in rule_only & set(reaps):
        if name not in site_rule.rewritten:
            del reaps[name]
    for name, mode in reaped.items():  # append sows that never ran (e.g. zero-length scan)
        if mode == "append" and name not in reaps and name not in rule_only:
            reaps[name] = _unflatten_value(
                sites[name], [np.zeros((0, *a.shape), a.dtype) for a in sites[name].avals])
    return out, _nest_dict(reaps)


def _stack_occurrences(values: list, keys: list) -> Any:
    # A collected value straight from a sow gets a new leading axis; one that
    # came out of a scan is already stacked along it.
    parts = [jnp.asarray(v) if k.stacked else jnp.asarray(v)[None] for v, k in zip(values, keys)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _unflatten_value(site: "_Site", vals):
    return jax.tree_util.tree_unflatten(site.tree, [jnp.asarray(v) for v in vals])


def _rows_stack(name, plant: PlantRows, total: int, site: _Site) -> list:
    """``[mask, *stacked leaves]`` (``total`` rows each) for a rows(...) plant."""
    where = f"a row of its append sows (at {format_path(site.path)}) has type {{type}}"
    if plant.index_values is None:
        mask = jnp.asarray(plant.mask)
        if mask.shape != (total,) or mask.dtype != jnp.bool_:
            raise ValueError(f"rows(mask=...) for '{_disp(name)}' has type "
                             f"{_type_str(mask.dtype, mask.shape)}, but its append sows (at "
                             f"{format_path(site.path)}) stack to {total} rows: want "
                             f"bool[{total}]")
        return [mask, *jax.tree_util.tree_leaves(plant.values)]
    mask = np.zeros((total,), bool)
    stacks = [jnp.zeros((total, *a.shape), a.dtype) for a in site.avals]
    for row, value in plant.index_values.items():
        if not -total <= row < total:
            raise ValueError(f"rows(...) for '{_disp(name)}': row {row} is out of range; its "
                             f"append sows (at {format_path(site.path)}) stack to {total} rows")
        row %= total
        mask[row] = True
        leaves = jax.tree_util.tree_leaves(value)
        if len(leaves) != len(site.avals):
            raise ValueError(f"Planted row {row} for '{_disp(name)}' has {len(leaves)} leaves, "
                             f"expected {len(site.avals)}")
        for i, (v, a) in enumerate(zip(leaves, site.avals)):
            v, _ = _conform(name, v, a, where, allow_retype=False)
            stacks[i] = stacks[i].at[row].set(v)
    return [jnp.asarray(mask), *stacks]


def _plant_for_feed(key, avals, plants, sites, all_feeds) -> list:
    """The planted values for one fed occurrence: the occurrences of a name
    at the top level split the planted stack along its leading axis (one
    row per direct sow, one block per scan); its length must match."""
    name = key.name
    start, total = 0, 0
    for k, kav in all_feeds:
        if k.name != name:
            continue
        size = kav[0].shape[0] if k.stacked else 1
        if k == key:
            start, mine = total, size
        total += size
    value = plants[name]
    if isinstance(value, PlantRows):
        value = _rows_stack(name, value, total, sites[name])
    out = []
    leaves = jax.tree_util.tree_leaves(value)
    if len(leaves) != len(avals):
        raise ValueError(f"Planted value for '{_disp(name)}' has {len(leaves)} leaves, "
                         f"expected {len(avals)}")
    for v, a in zip(leaves, avals):
        row = a.update(shape=a.shape[1:]) if key.stacked else a
        want = core.ShapedArray((total, *row.shape), row.dtype)
        where = f"its append sows (at {format_path(sites[name].path)}) stack to {{type}}"
        v, _ = _conform(name, v, want, where, allow_retype=False)
        v = jnp.asarray(v)
        out.append(v[start:start + mine] if key.stacked else v[start])
    return out


_TRANSFORM_ARGS = """
    Arguments:
        f: the function to transform (any JAX-traceable function; raw
            ``scan`` / ``while_loop`` / ``cond`` / ``jit`` / ``shard_map`` /
            custom derivatives inside are handled).
        tag: only sows with this ``tag`` are transformed.
        allowlist: if given, only sows with these names (or nest scopes) are
            transformed.
        blocklist: sows with these names (or nest scopes) are left alone.
        exclusive: also remove the sows this call does not transform (of any
            tag), so enclosing harvests see none of them.
        strict: raise if a name in ``allowlist`` / ``blocklist``{plants} matches
            no sow of ``tag`` (a typo); oryx, and the default, return normally."""


def _wraps_taking_plants(f: Callable, first: str = "plants") -> Callable:
    """``functools.wraps(f)`` for a wrapper that takes ``plants`` (or
    ``first``) before ``f``'s arguments: its signature (what
    ``inspect.signature`` and so ``eqx.filter_jit`` read) is ``f``'s with
    it in front."""
    def decorate(wrapper: Callable) -> Callable:
        wrapper = functools.wraps(f)(wrapper)
        del wrapper.__wrapped__  # else inspect.signature follows it to f
        try:
            sig = inspect.signature(f)
        except (TypeError, ValueError):  # no signature (a builtin): the wrapper's own
            return wrapper
        params = list(sig.parameters.values())
        name = first
        while name in sig.parameters:  # f has an argument of that name
            name = "_" + name
        params.insert(0, inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY))
        wrapper.__signature__ = sig.replace(parameters=params)
        return wrapper
    return decorate


def call_and_reap(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
                  blocklist: Iterable = frozenset(), exclusive: bool = False,
                  strict: bool = False) -> Callable:
    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        return _run(f, _HarvestSpec(tag, allowlist, blocklist, exclusive, strict, reaps=True),
                    {}, args, kwargs)

    return wrapped


call_and_reap.__doc__ = """Run ``f`` and collect the values it sows with ``tag``.

    ``call_and_reap(f, tag=t)(*args, **kwargs) -> (out, reaps)``: ``out`` is
    ``f(*args, **kwargs)``; ``reaps`` maps each sow's name to its value:
    ``strict`` / ``clobber``: the (last) sown value; ``cond_clobber``: the last
    value whose predicate was true (zeros if none); ``append``: the values
    stacked along a new leading axis (inside ``scan``: one row per
    iteration). Names under ``nest`` scopes come back nested:
    ``{scope: {name: value}}``. Reaped sows are removed from the result.
""" + _TRANSFORM_ARGS.format(plants="") + """

    Returns:
        ``wrapped(*args, **kwargs) -> (out, reaps)``.

    Raises:
        ValueError: oryx's errors (a strict sow twice, strict mode in ``scan``,
            non-clobber mode in ``while_loop``, ``cond`` branches that sow
            differently), a value that differs across ``shard_map`` shards,
            ``strict=True`` and an unmatched name.

    Example:
        >>> def f(x):
        ...     y = sow(x * 2, tag="t", name="y")
        ...     return y + 1
        >>> call_and_reap(f, tag="t")(1.0)  # (3.0, {"y": 2.0})
"""


def reap(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
         blocklist: Iterable = frozenset(), exclusive: bool = False,
         strict: bool = False) -> Callable:
    car = call_and_reap(f, tag=tag, allowlist=allowlist, blocklist=blocklist,
                        exclusive=exclusive, strict=strict)

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        return car(*args, **kwargs)[1]

    return wrapped


reap.__doc__ = """The values ``f`` sows with ``tag`` (``call_and_reap`` without ``out``).
""" + _TRANSFORM_ARGS.format(plants="") + """

    Returns:
        ``wrapped(*args, **kwargs) -> reaps``, a dict name -> value (see
        ``call_and_reap``).

    Raises:
        ValueError: as ``call_and_reap``.

    Example:
        >>> reap(lambda x: sow(x * 2, tag="t", name="y") + 1, tag="t")(1.0)  # {"y": 2.0}
"""


def plant(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
          blocklist: Iterable = frozenset(), exclusive: bool = False,
          strict: bool = False) -> Callable:
    @_wraps_taking_plants(f)
    def wrapped(plants, *args, **kwargs):
        return _run(f, _HarvestSpec(tag, allowlist, blocklist, exclusive, strict, reaps=False),
                    plants, args, kwargs)[0]

    return wrapped


_PLANTS_DOC = """
    Planted values: a non-``append`` sow takes ``plants[name]`` everywhere it
    runs; an ``append`` sow's plant is a stack with one row per time it runs
    (inside ``scan``: one per iteration); ``rows({i: value})`` replaces only
    some rows. Names under ``nest`` scopes are read from ``plants[scope]``.
    A planted value must have the sow's shape and dtype, with JAX's weak-type
    promotion: a weakly typed value (a Python scalar) is converted to the
    sow's dtype when promotion with it gives that dtype (``2.0`` into a
    ``float16`` sow); a sow of a Python scalar takes the planted value's type
    when promotion gives the planted dtype (``15.0`` into ``sow(717)``, the
    program is traced again so later arithmetic promotes as it would with
    ``15.0`` written there). Names with no plant keep their sown value, and
    stay sows for an enclosing harvest. Planted values have derivative zero
    with respect to the sown value and their own derivative flows through.
"""


plant.__doc__ = """``f`` with the values sown with ``tag`` replaced by planted ones.
""" + _PLANTS_DOC + _TRANSFORM_ARGS.format(plants=", or a key of ``plants``") + """

    Returns:
        ``wrapped(plants, *args, **kwargs) -> out``.

    Raises:
        ValueError: a planted value of the wrong structure, shape or dtype
            (naming the sow and where it is), the static errors of
            ``call_and_reap`` for the planted names, ``cond`` branches that
            sow differently, ``strict=True`` and an unmatched name.

    Example:
        >>> f = lambda x: sow(x * 2, tag="t", name="y") + 1
        >>> plant(f, tag="t")({"y": 10.0}, 1.0)  # 11.0
"""


def harvest(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
            blocklist: Iterable = frozenset(), exclusive: bool = False,
            strict: bool = False) -> Callable:
    @_wraps_taking_plants(f)
    def wrapped(plants, *args, **kwargs):
        return _run(f, _HarvestSpec(tag, allowlist, blocklist, exclusive, strict, reaps=True),
                    plants, args, kwargs)

    return wrapped


harvest.__doc__ = """``plant`` and ``call_and_reap`` in one: plant some names, reap the others.
""" + _PLANTS_DOC + _TRANSFORM_ARGS.format(plants=", or a key of ``plants``") + """

    Returns:
        ``wrapped(plants, *args, **kwargs) -> (out, reaps)``; planted names
        are not reaped.

    Raises:
        ValueError: as ``plant`` and ``call_and_reap``.

    Example:
        >>> def f(x):
        ...     return sow(x, tag="t", name="a") + sow(x * 2, tag="t", name="b")
        >>> harvest(f, tag="t")({"a": 5.0}, 1.0)  # (7.0, {"b": 2.0})
"""


def perturb(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
            blocklist: Iterable = frozenset(), exclusive: bool = False,
            strict: bool = False) -> Callable:
    @_wraps_taking_plants(f, "perturbations")
    def wrapped(perturbations, *args, **kwargs):
        spec = _HarvestSpec(tag, allowlist, blocklist, exclusive, strict, reaps=False,
                            perturb=True)
        return _run(f, spec, perturbations, args, kwargs)[0]

    return wrapped


perturb.__doc__ = """``f`` with ``perturbations[name]`` added to the values sown with ``tag``.

    The gradient of the output with respect to a sown value (an activation,
    a residual stream) is the gradient with respect to its perturbation at
    zero, in the same backward pass as the gradients of ``f``'s arguments
    (as flax's ``perturb``, with no change to the model's code)::

        zeros = jax.tree.map(jnp.zeros_like, reap(loss, tag="act")(x))
        d_acts, d_x = jax.grad(perturb(loss, tag="act"), argnums=(0, 1))(zeros, x)

    A perturbation has the structure, shape and dtype of the sown value
    (JAX's weak-type promotion as for ``plant``); an ``append`` sow's is a
    stack with one row per time it runs (inside ``scan``: one per
    iteration), each row added to that run's value. Names with no
    perturbation are left alone, and stay sows for an enclosing harvest.
    Unlike a planted value, the sown value keeps its derivative.
""" + _TRANSFORM_ARGS.format(plants=", or a key of ``perturbations``") + """

    Returns:
        ``wrapped(perturbations, *args, **kwargs) -> out``.

    Raises:
        ValueError: as ``plant`` (a perturbation of the wrong structure,
            shape or dtype names the sow), or ``rows(...)`` as a perturbation.

    Example:
        >>> f = lambda x: sow(x * 2, tag="t", name="y") ** 2
        >>> jax.grad(perturb(f, tag="t"))({"y": 0.0}, 1.0)  # {"y": 4.0}
"""

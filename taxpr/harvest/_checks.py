"""Which sows a harvest selects, and the static checks oryx makes (sows
per branch, per loop, under vmap) before any rewrite."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from .. import _compat, _traverse
from .._inject import guarded_place
from ..primitives._tag import is_guarded, meta, n_values, site_key, tag_p
from ._sow import SOW


def is_sow(params: dict) -> bool:
    return params.get("op") is SOW


class SowFilter:
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
        return (is_sow(params) and params["tag"] == self.tag
                and self.name_ok(params["name"]))


def site_aval(eqn) -> tuple:
    """(value avals, mode) of a sow equation (cond_clobber drops the pred)."""
    avals = tuple(v.aval for v in eqn.invars[:n_values(eqn.params, len(eqn.invars))])
    if eqn.params["mode"] == "cond_clobber":
        avals = avals[:-1]
    return avals


def display_name(name) -> str:
    return ".".join(map(str, name)) if isinstance(name, tuple) else str(name)


class _SowCount(NamedTuple):
    """What ``check_sows`` knows of a sow name within one jaxpr: how many sows,
    the mode and value avals of the first, whether vmap batched them, and the
    batched-predicate cond it sits in (for the error's explanation)."""
    n: int
    mode: str
    avals: tuple
    batched: bool
    guard: str | None


class _Scope(NamedTuple):
    """One jaxpr as ``check_sows`` walks it: the counts of its sows, and whether
    it runs inside a scan or a while loop."""
    counts: dict
    in_scan: bool
    in_while: bool


def check_sows(jaxpr: Any, select: SowFilter, transformed: set, verb: Callable) -> None:
    """oryx's static rules: strict sows once per scope, no strict in scan,
    only clobber modes in while (for the ``transformed`` names), and every
    cond branch sows alike (for every ``select``-ed name, as oryx checks)."""

    def subs(eqn, path, scope: _Scope):
        # Each sub-jaxpr counts its own sows; then they count in this jaxpr
        # (the most any branch of a cond sows).
        prim = eqn.primitive
        inner = []
        for sub, sj in _traverse.subjaxprs(eqn):
            inner.append({})
            yield sub, sj, _Scope(inner[-1], scope.in_scan or prim is _compat.scan_p,
                                  scope.in_while or prim is _compat.while_p)
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
                    _count(scope.counts, name, c.mode, c.avals, c.batched, c.guard)

    def _count(counts, name, mode, avals, batched, guard):
        n = counts[name].n if name in counts else 0
        if n and mode == "strict" and name in transformed:
            guard = guard or counts[name].guard
            why = "" if guard is None else (
                f". The sow is inside {guard} whose predicate is batched by vmap: vmap runs "
                f"every branch for every example, so a strict sow in several branches counts "
                f"once per branch; use clobber mode there, or reap inside the vmap.")
            raise ValueError(f"Variable has already been {verb(name)}: {display_name(name)}{why}")
        if n and name in transformed:
            # One reaped value (a carried one, or the rows of one stack) has
            # one type: every sow of the name must sow that type.
            first = counts[name]
            if [a.shape for a in avals] != [a.shape for a in first.avals]:
                raise ValueError(f"Mismatched shape between sows: '{display_name(name)}'."
                                 f"{_vmap_why(batched, first.batched, 'sow')}")
            if mode != "append" and [a.dtype for a in avals] != [a.dtype for a in first.avals]:
                raise ValueError(f"Mismatched dtype between sows: '{display_name(name)}'.")
            if ([_compat.explicit_sharding(a) for a in avals]
                    != [_compat.explicit_sharding(a) for a in first.avals]):
                raise ValueError(
                    f"Mismatched sharding between sows: '{display_name(name)}': "
                    f"{', '.join(a.str_short() for a in first.avals)} and "
                    f"{', '.join(a.str_short() for a in avals)} (JAX's sharding in types: "
                    f"every sow of a name sows one type; reshard one of them).")
        counts[name] = _SowCount(n + 1, mode, avals, batched, guard)

    forward_sites = _ForwardSites(jaxpr)
    for eqn, _, scope in _traverse.walk(jaxpr, subs, _Scope({}, False, False)):
        if eqn.primitive is not tag_p or not select(eqn.params):
            continue
        if _replays_the_forward(eqn.params, forward_sites):
            continue  # the forward's sow again: not reaped a second time
        name, mode = eqn.params["name"], eqn.params["mode"]
        if name in transformed:
            if scope.in_while and mode not in ("clobber", "cond_clobber"):
                raise ValueError(f"Must use clobber or cond_clobber mode for "
                                 f"'{display_name(name)}' inside of a `while_loop`.")
            if scope.in_scan and mode == "strict":
                raise ValueError(
                    f"Cannot use strict mode for '{display_name(name)}' inside `scan`.")
        _count(scope.counts, name, mode, site_aval(eqn), meta(eqn.params).batched,
               guarded_place(eqn.params) if is_guarded(eqn.params) else None)


class _ForwardSites:
    """``(custom_vjp scope, site)`` of every tag a fwd binds in ``jaxpr``,
    collected on the first question (most programs replay nothing)."""

    def __init__(self, jaxpr: Any):
        self.jaxpr = jaxpr
        self.sites: set | None = None

    def __contains__(self, scope_and_site: tuple) -> bool:
        if self.sites is None:
            self.sites = {(scope, site_key(eqn.params))
                          for eqn, _ in _traverse.iter_eqns(self.jaxpr)
                          if eqn.primitive is tag_p for scope in meta(eqn.params).fwd_scopes}
        return scope_and_site in self.sites


def _replays_the_forward(params: dict, forward_sites: _ForwardSites) -> bool:
    """Whether a sow is bound by a custom_vjp bwd that recomputes the forward
    pass, at a site its fwd or function binds too (``primitives._tag``'s
    ``TagMeta``): the engine drops what it reaps there (``_engine``)."""
    marks = meta(params)
    if marks.replay_scope is None:
        return False
    key = site_key(params)
    return key in marks.function_sites or (marks.replay_scope, key) in forward_sites


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
                raise ValueError(f"Missing sow in branch: '{display_name(name)}'.")
            f = first[name]
            if [a.shape for a in c.avals] != [a.shape for a in f.avals]:
                raise ValueError(f"Mismatched shape between branches: '{display_name(name)}'."
                                 f"{_vmap_why(c.batched, f.batched, 'branch')}")
            if [a.dtype for a in c.avals] != [a.dtype for a in f.avals]:
                raise ValueError(f"Mismatched dtype between branches: '{display_name(name)}'.")

"""The capturable values of a traced program: one ``Site`` per output of
each first-order equation the engine can reach, named by the equation's
scope (its name stack, without transformation frames) and primitive."""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any, Iterator, NamedTuple

from .._jax.internals import core
from .._jax.internals import source_info_util

from .. import _compat, _jaxpr, _traverse
from .._engine import THREAD_RULES
from ..primitives._tag import tag_p
from ._carry import CARRIED_SCOPE


class Loop(NamedTuple):
    """A loop enclosing a site: ``kind`` is ``"scan"`` or ``"while_loop"``;
    ``length`` the scan's length (None for a while loop). Equal to the
    tuple ``(kind, length)``."""

    kind: str
    length: int | None


@dataclasses.dataclass(frozen=True, eq=False)
class Site:
    """One capturable value of a traced program.

    Attributes:
        name: unique and readable: ``scope/primitive``, with ``:1``, ``:2``,
            ... on the second, third, ... equation of the same scope and
            primitive, and ``#i`` for output ``i`` of an equation with
            several outputs (``"MLP/fc1/dot_general"``).
        scope: the name stack where the value is computed, without JAX's
            transformation frames (flax module paths, equinox module names,
            ``jax.named_scope``): ``"MLP/fc1"``; ``""`` at the top.
        primitive: the name of the primitive that computes it.
        shape, dtype: the value's per-example type (inside a scan: one
            iteration's).
        loops: the loops around it, outermost first, each a ``Loop``
            (``(("scan", 12),)``).
        in_cond: whether it is computed in a branch of a ``cond`` / ``switch``.
        path: the enclosing higher-order primitives (as in taxpr's errors).
        leaves: the scopes (prefixes of ``scope``) that the value leaves:
            used by an equation outside them, or returned from the program
            or from an enclosing call's body to its caller's scope.
    """

    name: str
    scope: str
    primitive: str
    shape: tuple[int, ...]
    dtype: Any
    loops: tuple[Loop, ...]
    in_cond: bool
    path: tuple[str, ...]
    leaves: tuple[str, ...]
    aval: Any = dataclasses.field(repr=False)
    # A cond branch around a scan around the site: its rows cannot be
    # matched by a placeholder in the other branches.
    scan_in_cond: bool = dataclasses.field(repr=False)
    ordinal: int = dataclasses.field(repr=False)  # the equation's place in the walk
    output: int = dataclasses.field(repr=False)  # which output of the equation
    source_info: tuple = dataclasses.field(repr=False)  # the equation's, then its callers'
    # The enclosing equations, outermost first: (ordinal, primitive) each.
    enclosing: tuple = dataclasses.field(repr=False, default=())

    @property
    def _frame(self) -> Any:
        # An equation JAX made (inside jit(relu), a custom rule's body) may
        # have no user frame: the enclosing equation's says where it comes from.
        for info in self.source_info:
            frame = source_info_util.user_frame(info.traceback)
            if frame is not None:
                return frame
        return None

    @property
    def file(self) -> str | None:
        """The user's source file that computes the value (None if unknown)."""
        frame = self._frame
        return None if frame is None else frame.file_name

    @property
    def line(self) -> int | None:
        frame = self._frame
        return None if frame is None else frame.start_line

    @property
    def function(self) -> str | None:
        frame = self._frame
        return None if frame is None else frame.function_name

    @property
    def source(self) -> str:
        """``"model.py:12 (Block.__call__)"``, or ``"unknown"``."""
        frame = self._frame
        if frame is None:
            return "unknown"
        return f"{os.path.basename(frame.file_name)}:{frame.start_line} ({frame.function_name})"


@dataclasses.dataclass(frozen=True)
class _WalkCtx:
    """Where the walk is: the scope of the enclosing equation, its loops,
    and whether values there are capturable (the engine threads through
    every primitive above)."""

    scope: tuple[str, ...] = ()
    loops: tuple[Loop, ...] = ()
    in_cond: bool = False
    scan_in_cond: bool = False
    capturable: bool = True
    callers: tuple = ()  # the source infos of the enclosing equations, innermost first
    # Which visit of a jaxpr this is (0: the program): JAX shares one traced
    # jaxpr between calls with the same types (``jnp.tril`` in every layer,
    # a user's jitted block), so its variables are told apart per visit.
    frame: int = 0
    enclosing: tuple = ()  # (ordinal, primitive) of the enclosing equations


def scope_of(info: Any) -> tuple[str, ...]:
    """The named scopes of a source info's name stack (without JAX's
    transformation frames, nor the mark of a patched site's equations)."""
    return tuple(s.name for s in info.name_stack.stack
                 if isinstance(s, source_info_util.Scope) and s.name != CARRIED_SCOPE)


def _scope_names(eqn: core.JaxprEqn) -> tuple[str, ...]:
    return scope_of(eqn.source_info)


def _subs(eqn: core.JaxprEqn, path: tuple[str, ...], ctx: _WalkCtx, frames: Iterator[int],
          ordinal: int = -1):
    """The sub-jaxprs of ``eqn`` with their contexts. Every sub-jaxpr is
    walked (the rewrite numbers equations in the same order), each visit
    numbered from ``frames``; values are capturable only where the engine
    threads (not in a while's predicate, nor in primitives without a thread
    rule)."""
    scope = ctx.scope + _scope_names(eqn)
    reachable = ctx.capturable and eqn.primitive in THREAD_RULES
    for sub, sj in _traverse.subjaxprs(eqn):
        loops, in_cond, ok = ctx.loops, ctx.in_cond, reachable
        scan_in_cond = ctx.scan_in_cond
        if eqn.primitive is _compat.scan_p:
            loops = loops + (Loop("scan", int(eqn.params["length"])),)
            scan_in_cond = scan_in_cond or in_cond
        elif eqn.primitive is _compat.while_p:
            loops = loops + (Loop("while_loop", None),)
            ok = ok and sub.key == "body_jaxpr"
        elif eqn.primitive is _compat.cond_p:
            in_cond = True
        yield sub, sj, _WalkCtx(scope, loops, in_cond, scan_in_cond, ok,
                                (eqn.source_info, *ctx.callers), next(frames),
                                (*ctx.enclosing, (ordinal, eqn.primitive)))


class _Named(NamedTuple):
    """A capturable equation of the walk, with its sites' name stem."""

    ordinal: int  # its place in the walk
    eqn: Any
    path: tuple[str, ...]
    ctx: _WalkCtx
    scope: str
    stem: str  # ``scope/primitive``, ``:k`` on the k+1-th of the same


def _named_eqns(closed: Any, consumers: dict | None = None) -> Iterator[_Named]:
    """The capturable equations of ``closed`` in program order, named: the
    one naming of sites (``list_sites``, ``site_names``). With
    ``consumers``, the scopes of each variable's consumers are recorded
    there, keyed by ``(visit of its jaxpr, var)``."""
    counts: dict[str, int] = {}
    frames = itertools.count(1)
    at = [0]  # the ordinal of the equation whose sub-jaxprs are walked next

    def subs(eqn, path, ctx):
        return _subs(eqn, path, ctx, frames, at[0])

    for ordinal, (eqn, path, ctx) in enumerate(_traverse.walk(closed, subs, _WalkCtx())):
        at[0] = ordinal
        ctx = ctx or _WalkCtx()
        scope = ctx.scope + _scope_names(eqn)
        if consumers is not None:
            for v in eqn.invars:
                if type(v) is core.Var:
                    consumers.setdefault((ctx.frame, v), []).append(scope)
        if (not ctx.capturable or eqn.primitive is tag_p or _traverse.subjaxprs(eqn)
                or (_compat.call_hi_primitive_p is not None
                    and eqn.primitive is _compat.call_hi_primitive_p)):
            continue
        scope_str = "/".join(scope)
        base = f"{scope_str}/{eqn.primitive.name}" if scope_str else eqn.primitive.name
        k = counts.get(base, 0)
        counts[base] = k + 1
        yield _Named(ordinal, eqn, path, ctx, scope_str, base if k == 0 else f"{base}:{k}")


def _output_names(stem: str, outvars) -> Iterator[tuple[int, str]]:
    many = len(outvars) > 1
    for i, v in enumerate(outvars):
        if not isinstance(v, core.DropVar):
            yield i, f"{stem}#{i}" if many else stem


def site_names(closed: Any) -> dict[int, list[str]]:
    """The names of ``list_sites(closed)`` by equation (its place in a walk
    of every nested jaxpr, ``_traverse.walk``'s order), without the rest
    of the records: for tools that show a program's sites."""
    return {n.ordinal: [name for _, name in _output_names(n.stem, n.eqn.outvars)]
            for n in _named_eqns(closed)}


def list_sites(closed: Any) -> tuple[Site, ...]:
    """Every capturable value of ``closed`` (a closed jaxpr), in program order."""
    # Within each jaxpr: the scopes of each var's consumers (to find what
    # leaves a scope); a jaxpr's outputs are used in its caller's scope.
    # (Variables are keyed by the visit of their jaxpr: ``_WalkCtx.frame``.)
    consumers: dict[Any, list[tuple[str, ...]]] = {}
    pending: list[tuple[Site, Any]] = []  # (site, its var)
    for ordinal, eqn, path, ctx, scope_str, stem in _named_eqns(closed, consumers):
        for i, name in _output_names(stem, eqn.outvars):
            v = eqn.outvars[i]
            aval = v.aval
            site = Site(
                name=name, scope=scope_str,
                primitive=eqn.primitive.name, shape=tuple(getattr(aval, "shape", ())),
                dtype=getattr(aval, "dtype", None), loops=ctx.loops, in_cond=ctx.in_cond,
                path=path, leaves=(), aval=aval, scan_in_cond=ctx.scan_in_cond, ordinal=ordinal, output=i, source_info=(eqn.source_info, *ctx.callers),
                enclosing=ctx.enclosing)
            pending.append((site, (ctx.frame, v)))
    _note_outputs(closed, consumers)
    return tuple(_with_leaves(site, consumers.get(v, ())) for site, v in pending)


def _note_outputs(closed: Any, consumers: dict) -> None:
    """Record where each jaxpr's outputs go: output ``i`` of a sub-jaxpr
    whose equation has as many outputs is that equation's output ``i`` (a
    call's result, a cond's, a scan's carry and stacked outputs), used where
    that is; every output is also returned to the caller's scope (a value
    returned from a loop body or a call leaves the scopes inside it). The
    program's outputs are used outside every scope. Variables are keyed by
    the visit of their jaxpr, numbered as ``list_sites`` numbers them."""
    forward: dict = {}
    frames = itertools.count(1)

    def subs(eqn, path, caller):
        scope_above, frame_above = caller
        scope = scope_above + _scope_names(eqn)
        for sub, sj in _traverse.subjaxprs(eqn):
            frame = next(frames)
            outs = _jaxpr.jaxpr_parts(sj).outvars
            for i, v in enumerate(outs):
                if type(v) is not core.Var:
                    continue
                consumers.setdefault((frame, v), []).append(scope)
                if len(outs) == len(eqn.outvars):
                    forward.setdefault((frame, v), []).append((frame_above, eqn.outvars[i]))
            yield sub, sj, (scope, frame)

    for v in _jaxpr.jaxpr_parts(closed).outvars:
        if type(v) is core.Var:
            consumers.setdefault((0, v), []).append(())
    for _ in _traverse.walk(closed, subs, ((), 0)):
        pass
    # A forwarded output is used wherever the equation's output is.
    resolved: dict = {}

    def uses(v, seen=()):
        if v in resolved:
            return resolved[v]
        found = list(consumers.get(v, ()))
        for w in forward.get(v, ()):
            if w not in seen:
                found.extend(uses(w, seen + (v,)))
        resolved[v] = found
        return found

    for v in list(forward):
        consumers[v] = uses(v)


def _with_leaves(site: Site, used_in) -> Site:
    parts = tuple(site.scope.split("/")) if site.scope else ()
    left = tuple("/".join(parts[:n]) for n in range(1, len(parts) + 1)
                 if any(tuple(u[:n]) != parts[:n] for u in used_in))
    return dataclasses.replace(site, leaves=left)

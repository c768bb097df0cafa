"""A traced program run again with its selected loops watched.

``run_watched(closed, args, choose, hooks)`` evaluates ``closed`` on
``args`` (inside the caller's trace: ``jit``, ``vmap``, ``grad``), binding
every equation as it is, except the loops ``choose`` selects: each is bound
again through ``lax.scan`` / ``lax.while_loop`` with the same body and one
more carry, its iteration count, and ``hooks`` called around it and every
``every`` iterations (``Hooks``). Equations holding a selected loop deeper
in (``jit``, ``custom_jvp`` / ``custom_vjp`` calls, ``checkpoint``) are
bound again with their jaxprs rewritten the same way; their rules are
kept (what they compute is unchanged).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from .._jax.internals import core, source_info_util
from .. import _compat, _jaxpr, _traverse


@dataclasses.dataclass(frozen=True)
class Loop:
    """A loop of the program: its ordinal, kind, path and trip count."""

    key: int
    kind: str
    name: str
    total: int | None
    depth: int


class Hooks:
    """What runs around and in a watched loop, traced into the program:
    ``start(loop, token) -> token`` before it, ``tick(loop, i) -> i`` after
    each iteration (``i``: how many are done), ``end(loop, i) -> token``
    after it. Each returns a value that what follows depends on: host
    callbacks stay in program order (the token of one loop's ``end`` is
    the next loop's ``start``'s)."""

    def start(self, loop: Loop, token: Any) -> Any:
        return token

    def tick(self, loop: Loop, i: Any) -> Any:
        return i

    def end(self, loop: Loop, i: Any) -> Any:
        return i


class LoopIndex:
    """The loops of a traced program (scans and while loops, in any nested
    jaxpr) in walk order, their ``key`` their position; which loops each
    equation and jaxpr holds. Keeps ``closed`` alive (it is keyed by the
    identity of its parts)."""

    def __init__(self, closed: Any):
        self.closed = closed
        self.loops: list[Loop] = []
        self._key_of: dict[int, int] = {}  # id(loop eqn) -> key
        self._inside: dict[int, frozenset] = {}  # id(jaxpr) -> keys of the loops in it
        self._walk(closed, (), 0)

    def _walk(self, jaxpr, path: tuple[str, ...], depth: int) -> frozenset:
        keys: set = set()
        for eqn in _jaxpr.jaxpr_parts(jaxpr).eqns:
            subs = _traverse.subjaxprs(eqn)
            kind = {_compat.scan_p: "scan", _compat.while_p: "while"}.get(eqn.primitive)
            inner_depth = depth
            if kind is not None:
                label = subs[0][0].label if kind == "scan" else "while"
                total = eqn.params["length"] if kind == "scan" else None
                key = len(self.loops)
                self.loops.append(Loop(key, kind, "/".join(path + (label,)), total, depth))
                self._key_of[id(eqn)] = key
                keys.add(key)
                inner_depth = depth + 1
            for sub, sj in subs:
                keys |= self._walk(sj, path + (sub.label,), inner_depth)
        found = frozenset(keys)
        self._inside[id(jaxpr)] = found
        return found

    def key(self, eqn) -> int | None:
        return self._key_of.get(id(eqn))

    def inside(self, jaxpr) -> frozenset:
        return self._inside.get(id(jaxpr), frozenset())


def run_watched(closed: Any, args: Sequence[Any], index: LoopIndex, chosen: dict[int, Loop],
                hooks: Hooks) -> list:
    """``closed`` (indexed by ``index``) evaluated on ``args`` with the
    loops ``chosen`` (by key) watched; the outputs."""
    return _Run(index, chosen, hooks).jaxpr(closed, args)


class _Run:
    def __init__(self, index: LoopIndex, chosen: dict[int, Loop], hooks: Hooks):
        self.index, self.chosen, self.hooks = index, chosen, hooks

    def holds(self, jaxpr) -> bool:
        return any(k in self.chosen for k in self.index.inside(jaxpr))

    def jaxpr(self, jaxpr: Any, args: Sequence[Any]) -> list:
        parts = _jaxpr.jaxpr_parts(jaxpr)
        env: dict = {}
        for v, c in zip(parts.constvars, parts.consts or ()):
            env[v] = c
        for v, a in zip(parts.invars, args):
            env[v] = a

        def read(atom):
            return atom.val if type(atom) is core.Literal else env[atom]

        token = None  # the last watched loop's end here: the next one starts after it
        for eqn in parts.eqns:
            ins = [read(v) for v in eqn.invars]
            key = self.index.key(eqn)
            if key is not None and key in self.chosen:
                watch = _watched_scan if eqn.primitive is _compat.scan_p else _watched_while
                outs, token = watch(self, eqn, ins, self.chosen[key], token)
            elif any(self.holds(sj) for _, sj in _traverse.subjaxprs(eqn)):
                outs = self.rebound(eqn, ins)
            else:
                outs = _bind(eqn, ins)
            for v, o in zip(eqn.outvars, outs):
                if not isinstance(v, core.DropVar):
                    env[v] = o
        return [read(v) for v in parts.outvars]

    def body(self, jaxpr: Any) -> Callable:
        """``jaxpr`` as a function of its inputs (its inner chosen loops
        watched too)."""
        return lambda *a: self.jaxpr(jaxpr, a)

    def rebound(self, eqn, ins: list) -> list:
        """``eqn`` bound again with its jaxprs that hold chosen loops
        rewritten (traced again through this ``_Run``), its rules kept."""
        new = {}
        for sub, sj in _traverse.subjaxprs(eqn):
            if not self.holds(sj):
                continue
            avals = [v.aval for v in _jaxpr.jaxpr_parts(sj).invars]
            traced = jax.make_jaxpr(lambda *a, sj=sj: self.jaxpr(sj, a))(*avals)
            if isinstance(sj, core.Jaxpr) and not _compat.MERGED_JAXPR:
                open_jaxpr, consts = _jaxpr.open_with_constvars(traced)
                if consts:
                    raise NotImplementedError(
                        f"taxpr: cannot watch a loop inside '{eqn.primitive.name}': the "
                        f"rewritten {sub.label} holds constants, which its open jaxpr cannot")
                traced = open_jaxpr
            new[(sub.key, sub.index)] = traced
        return _bind(_traverse.with_subjaxprs(eqn, new), ins)


def _bind(eqn, ins: list) -> list:
    """``eqn`` bound as ``core.eval_jaxpr`` binds it (its source kept)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
          eqn.ctx.manager):
        out = eqn.primitive.bind(*ins, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _start_token(token: Any) -> Any:
    """The previous loop's end token (a count, never negative), or 0."""
    return jnp.zeros((), jnp.int32) if token is None else jnp.asarray(token, jnp.int32)


def _zero_after(token: Any) -> Any:
    """0, computed from ``token`` (a count) so that what uses it runs after
    what made ``token`` (``token * 0`` would be simplified away)."""
    return jnp.minimum(token, 0)


def _watched_scan(run: _Run, eqn, ins: list, loop: Loop, token: Any) -> tuple[list, Any]:
    p = eqn.params
    (nc, ncarry), length = _jaxpr.scan_counts(p), p["length"]
    consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    body, hooks = run.body(p["jaxpr"]), run.hooks

    def step(state, x):
        i, c = state[0], state[1:]
        outs = body(*consts, *c, *x)
        return (hooks.tick(loop, i + 1), *outs[:ncarry]), outs[ncarry:]

    i0 = _zero_after(hooks.start(loop, _start_token(token)))
    (i, *carry), ys = lax.scan(step, (i0, *carry), xs, length=length, reverse=p["reverse"],
                               unroll=p.get("unroll", 1))
    return [*carry, *ys], hooks.end(loop, i)


def _watched_while(run: _Run, eqn, ins: list, loop: Loop, token: Any) -> tuple[list, Any]:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    cond, body, hooks = run.body(p["cond_jaxpr"]), run.body(p["body_jaxpr"]), run.hooks

    def step(state):
        i, c = state[0], state[1:]
        outs = body(*body_consts, *c)
        return (hooks.tick(loop, i + 1), *outs)

    i0 = _zero_after(hooks.start(loop, _start_token(token)))
    i, *carry = lax.while_loop(lambda s: cond(*cond_consts, *s[1:])[0], step, (i0, *carry))
    return list(carry), hooks.end(loop, i)

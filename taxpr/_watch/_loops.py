"""A traced program run again with its selected loops watched.

``run_watched(closed, args, index, chosen, hooks, taps)`` evaluates
``closed`` on ``args`` (inside the caller's trace: ``jit``, ``vmap``,
``grad``), binding every equation as it is, except the loops ``chosen``
(``LoopIndex`` keys): each is bound again through ``lax.scan`` /
``lax.while_loop`` with the same body and one more carry, its iteration
count, and ``hooks`` called around it and in it (``Hooks``); the
equations ``taps`` lists give their outputs to ``Hooks.value``.
Equations holding a chosen loop or a tapped equation deeper in (``jit``,
``custom_jvp`` / ``custom_vjp`` calls, ``checkpoint``) are bound again with
their jaxprs rewritten the same way; their rules are kept (what they
compute is unchanged).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from .._jax.internals import core, source_info_util
from .. import _compat, _jaxpr, _traverse
from .._engine._control_flow import shard_map_body_context
from .._host import gated


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
    the next loop's ``start``'s). Each is given ``io``: whether JAX allows
    an io callback where it is traced (not in a while loop's body, which
    ``vmap`` may batch, nor in a custom derivative rule's function)."""

    def every(self, loop: Loop) -> int:
        """Iterations between two ``tick``s that matter: a scan is run as
        chunks of that many, ``tick`` called after each chunk only (a
        check per iteration would cost more than a small body)."""
        return 1

    def start(self, loop: Loop, token: Any, io: bool) -> Any:
        return token

    def tick(self, loop: Loop, i: Any, io: bool) -> Any:
        return i

    def poll(self, loop: Loop, i: Any, next_at: Any, io: bool) -> Any:
        """After a chunk of a scan (``every``): the iteration count at which
        to poll next (``next_at`` when ``i`` has not reached it)."""
        return next_at

    def end(self, loop: Loop, i: Any, io: bool) -> Any:
        return i

    def value(self, site: Any, value: Any, steps: tuple) -> Any:
        """A tapped equation's output ``value`` (``site``: what the caller
        tapped), ``steps`` the iteration of each enclosing loop. Returns
        what the program uses in its place (the same value, perhaps marked
        for the backward pass), or None: ``value`` itself."""


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
        self._enclosing: dict[int, tuple] = {}  # id(eqn) -> keys of the loops around it
        self._eqns_in: dict[int, frozenset] = {}  # id(jaxpr) -> ids of its eqns, nested too
        self._walk(closed, (), 0, ())

    def _walk(self, jaxpr, path: tuple[str, ...], depth: int, around: tuple) -> frozenset:
        keys: set = set()
        eqn_ids: set = set()
        for eqn in _jaxpr.jaxpr_parts(jaxpr).eqns:
            self._enclosing[id(eqn)] = around
            eqn_ids.add(id(eqn))
            subs = _traverse.subjaxprs(eqn)
            kind = {_compat.scan_p: "scan", _compat.while_p: "while"}.get(eqn.primitive)
            inner_depth, inner_around = depth, around
            if kind is not None:
                label = subs[0][0].label if kind == "scan" else "while"
                total = eqn.params["length"] if kind == "scan" else None
                key = len(self.loops)
                self.loops.append(Loop(key, kind, "/".join(path + (label,)), total, depth))
                self._key_of[id(eqn)] = key
                keys.add(key)
                inner_depth, inner_around = depth + 1, around + (key,)
            for sub, sj in subs:
                keys |= self._walk(sj, path + (sub.label,), inner_depth, inner_around)
                eqn_ids |= self._eqns_in[id(sj)]
        found = frozenset(keys)
        self._inside[id(jaxpr)] = found
        self._eqns_in[id(jaxpr)] = frozenset(eqn_ids)
        return found

    def enclosing(self, eqn) -> tuple:
        """The keys of the loops around ``eqn``, outermost first."""
        return self._enclosing.get(id(eqn), ())

    def eqns_in(self, jaxpr) -> frozenset:
        """The ids of the equations of ``jaxpr`` and of its nested jaxprs."""
        return self._eqns_in.get(id(jaxpr), frozenset())

    def key(self, eqn) -> int | None:
        return self._key_of.get(id(eqn))

    def inside(self, jaxpr) -> frozenset:
        return self._inside.get(id(jaxpr), frozenset())


def run_watched(closed: Any, args: Sequence[Any], index: LoopIndex, chosen: dict[int, Loop],
                hooks: Hooks, taps: dict[int, list] | None = None) -> list:
    """``closed`` (indexed by ``index``) evaluated on ``args`` with the
    loops ``chosen`` (by key) watched and the equations ``taps`` lists (by
    id: ``[(site, output index)]``) tapped (``Hooks.value``); the
    outputs."""
    return _Run(index, chosen, hooks, taps or {}).jaxpr(closed, args)


class _Run:
    def __init__(self, index: LoopIndex, chosen: dict[int, Loop], hooks: Hooks, taps: dict):
        self.index, self.chosen, self.hooks, self.taps = index, chosen, hooks, taps
        self.steps: list = []  # the iteration of each watched loop being traced
        self.last_token: Any = None  # the last watched loop's end in the jaxpr just run
        self.io: list[bool] = [True]  # whether io callbacks may be traced here

    def holds(self, jaxpr) -> bool:
        return (any(k in self.chosen for k in self.index.inside(jaxpr))
                or (bool(self.taps) and not self.index.eqns_in(jaxpr).isdisjoint(self.taps)))

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
            elif (eqn.primitive is _compat.jit_p and self.steps
                  and self.holds(eqn.params["jaxpr"])):
                # Inside a watched loop a jit call is inlined (the same
                # computation), so that the loop's iteration is in scope.
                outs = self.jaxpr(eqn.params["jaxpr"], ins)
            elif any(self.holds(sj) for _, sj in _traverse.subjaxprs(eqn)):
                outs = self.rebound(eqn, ins)
            else:
                outs = _bind(eqn, ins)
            for site, k in self.taps.get(id(eqn), ()):
                replaced = self.hooks.value(site, outs[k], tuple(self.steps))
                if replaced is not None:
                    outs[k] = replaced
            for v, o in zip(eqn.outvars, outs):
                if not isinstance(v, core.DropVar):
                    env[v] = o
        self.last_token = token  # (a loop around this jaxpr ticks after it)
        return [read(v) for v in parts.outvars]

    def body(self, jaxpr: Any) -> Callable:
        """``jaxpr`` as a function of its inputs (its inner chosen loops
        watched too)."""
        return lambda *a: self.jaxpr(jaxpr, a)

    def rebound(self, eqn, ins: list) -> list:
        """``eqn`` bound again with its jaxprs that hold chosen loops
        rewritten (traced again through this ``_Run``), its rules kept."""
        new = {}
        # (JAX allows no io effect in a custom derivative rule's function on
        # every version, nor in a checkpoint it differentiates)
        self.io.append(self.io[-1] and eqn.primitive not in _compat.CUSTOM_CALL_PRIMITIVES
                       and eqn.primitive is not _compat.remat_p)
        try:
            for sub, sj in _traverse.subjaxprs(eqn):
                if self.holds(sj):
                    with _tracing_context(eqn):
                        new[(sub.key, sub.index)] = self._retraced(eqn, sub, sj)
        finally:
            self.io.pop()
        return _bind(_traverse.with_subjaxprs(eqn, new), ins)

    def _retraced(self, eqn, sub, sj) -> Any:
        """``sj`` (a jaxpr of ``eqn``) traced again through this ``_Run``, of
        the same kind (closed or open)."""
        avals = [v.aval for v in _jaxpr.jaxpr_parts(sj).invars]

        def body(*a):
            with _in_body(eqn):
                return self.jaxpr(sj, a)
        traced = jax.make_jaxpr(body)(*avals)
        if any(isinstance(c, core.Tracer) for c in _jaxpr.jaxpr_parts(traced).consts or ()):
            raise NotImplementedError(
                f"taxpr: cannot watch inside '{eqn.primitive.name}' ({sub.label}) within a "
                f"watched loop: the loop's iteration would be captured by its jaxpr; "
                f"watch the outer loop only (tx.progress's loops=) or tap a site "
                f"outside '{eqn.primitive.name}'")
        if not isinstance(sj, _compat.ClosedJaxpr):  # an open jaxpr (0.10's checkpoint)
            open_jaxpr, consts = _jaxpr.open_with_constvars(traced)
            if consts:
                raise NotImplementedError(
                    f"taxpr: cannot watch a loop inside '{eqn.primitive.name}': the "
                    f"rewritten {sub.label} holds constants, which its open jaxpr cannot")
            traced = open_jaxpr
        return traced


@contextlib.contextmanager
def _tracing_context(eqn) -> Iterator[None]:
    """Where ``eqn``'s jaxprs are traced again: a shard_map's body in its
    manual axes, its host callbacks on the mesh's first shard only (one bar
    for the whole mesh; every process runs the program, and the first
    shard is process 0's first device)."""
    if eqn.primitive is not _compat.shard_map_p:
        yield
        return
    with shard_map_body_context(eqn.params):
        yield


def _in_body(eqn) -> contextlib.AbstractContextManager:
    """What a retraced jaxpr of ``eqn`` is traced in (inside its trace): a
    shard_map body's host callbacks gated to the mesh's first shard."""
    if eqn.primitive is not _compat.shard_map_p:
        return contextlib.nullcontext()
    axes = [a for a in eqn.params["mesh"].axis_names
            if a in eqn.params.get("newly_manual_axes", eqn.params["mesh"].axis_names)]
    return gated(functools.reduce(jnp.logical_and, [lax.axis_index(a) == 0 for a in axes],
                                  jnp.bool_(True)))


def _bind(eqn, ins: list) -> list:
    """``eqn`` bound as ``core.eval_jaxpr`` binds it (its source kept)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
          eqn.ctx.manager):
        out = eqn.primitive.bind(*ins, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _start_token(token: Any, run: "_Run") -> Any:
    """What a loop's start waits for: the previous loop's end here, else the
    iteration of the loop around (the previous iteration's tick), else
    nothing (each a count, never negative)."""
    if token is None and run.steps:
        token = run.steps[-1]
    return jnp.zeros((), jnp.int32) if token is None else jnp.asarray(token, jnp.int32)


def _after(i: Any, token: Any) -> Any:
    """``i``, computed after ``token`` (an inner loop's end) where there is one."""
    return i if token is None else i + _zero_after(token)


def _zero_after(token: Any) -> Any:
    """0, computed from ``token`` (a count) so that what uses it runs after
    what made ``token`` (``token * 0`` would be simplified away)."""
    return jnp.minimum(token, 0)


def _watched_scan(run: _Run, eqn, ins: list, loop: Loop, token: Any) -> tuple[list, Any]:
    p = eqn.params
    (nc, ncarry), length = _jaxpr.scan_counts(p), p["length"]
    consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    body, hooks = run.body(p["jaxpr"]), run.hooks
    unroll, every = p.get("unroll", 1), hooks.every(loop)

    def iteration(state, x):
        i, c = state[0], state[1:]
        run.steps.append(i)
        try:
            outs = body(*consts, *c, *x)
        finally:
            run.steps.pop()
        return (_after(i + 1, run.last_token), *outs[:ncarry]), outs[ncarry:]

    def ticked(state, x):
        (i, *c), ys = iteration(state, x)
        return (hooks.tick(loop, i, run.io[-1]), *c), ys

    i0 = _zero_after(hooks.start(loop, _start_token(token, run), run.io[-1]))
    state = (i0, *carry)
    if every > 1 and length >= every and not p["reverse"]:
        # Chunks of ``every`` iterations (the same body, in the same order),
        # polled after each chunk; the rest ticked per iteration.
        chunks, done = length // every, (length // every) * every

        def chunk(state, xs_chunk):
            next_at, state = state[0], state[1:]
            state, ys = lax.scan(iteration, state, xs_chunk, length=every, unroll=unroll)
            return (hooks.poll(loop, state[0], next_at, run.io[-1]), *state), ys

        first = jnp.asarray(every, jnp.int32) + i0
        (_, *state), ys = lax.scan(chunk, (first, *state),
                                   [x[:done].reshape(chunks, every, *x.shape[1:]) for x in xs],
                                   length=chunks)
        # (a barrier: XLA would otherwise fuse what reads the rows with the
        # reshape, and sum them in another order than the plain scan's)
        ys = list(lax.optimization_barrier([y.reshape(done, *y.shape[2:]) for y in ys]))
        if done < length:
            state, rest = lax.scan(ticked, tuple(state), [x[done:] for x in xs],
                                   length=length - done, unroll=unroll)
            ys = [jnp.concatenate([a, b]) for a, b in zip(ys, rest)]
    else:
        state, ys = lax.scan(ticked, state, xs, length=length, reverse=p["reverse"],
                             unroll=unroll)
    i, *carry = state
    return [*carry, *ys], hooks.end(loop, i, run.io[-1])


def _watched_while(run: _Run, eqn, ins: list, loop: Loop, token: Any) -> tuple[list, Any]:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    cond, body, hooks = run.body(p["cond_jaxpr"]), run.body(p["body_jaxpr"]), run.hooks

    # (no io callback in the body: vmap may batch the loop's predicate, and
    # JAX then allows none)
    def step(state):
        i, c = state[0], state[1:]
        run.steps.append(i)
        run.io.append(False)
        try:
            outs = body(*body_consts, *c)
        finally:
            run.steps.pop()
            run.io.pop()
        return (hooks.tick(loop, _after(i + 1, run.last_token), False), *outs)

    i0 = _zero_after(hooks.start(loop, _start_token(token, run), run.io[-1]))
    i, *carry = lax.while_loop(lambda s: cond(*cond_consts, *s[1:])[0], step, (i0, *carry))
    return list(carry), hooks.end(loop, i, run.io[-1])

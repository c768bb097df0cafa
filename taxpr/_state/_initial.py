"""Initial values of the states: from the program where every first use is
certain from its structure, else by running it once with the example
arguments; and the init of a state the example run never reaches."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from .._jax.internals import core
from .._jax.internals import debug_callback_p

from .. import _compat, _jaxpr
from .._engine import format_path
from .._find import dissolve_tags
from .._inject import InjectPolicy, inject_with
from .. import _traverse
from ..primitives._tag import is_guarded, meta, tag_p
from ._collect import StateInfo
from ._ops import GET, StateError, is_state_tag
from ._rewrite import FirstUse, init_injector, reached_by_any_example


def initial_states(closed: Any, states: dict[str, StateInfo], args: Sequence[Any]) -> dict:
    """Each state's value at first use when ``closed`` runs on ``args``:
    without running it where every first use is certain from the program's
    structure (``_initial_states_without_run``), else by running it once
    (only what the initial values need is compiled). A state the run never
    reaches starts at the ``init`` of its first ``get_state`` in trace order,
    computed exactly from the program (``unreached_init``), or at zeros if
    it is only ever set."""
    known = _initial_states_without_run(closed, states, args)
    if known is not None:
        return known
    zeros = {n: FirstUse(jnp.zeros(s.shape, s.dtype), jnp.zeros(s.shape, s.dtype),
                          np.zeros((), bool)) for n, s in states.items()}
    init = inject_with(closed, init_injector, zeros, is_state_tag, InjectPolicy(
        guard_merge=reached_by_any_example,
        # sets in a shard_map without vma checking are refused by
        # collect_states; reads record their (replicated) init
        check_per_shard=False,
        # a bwd's replay of the forward pass is never a first use
        replays=False))
    if any(isinstance(a, core.Tracer) for a in args):
        init = _without_effects_of_its_own(init)
    leaves = jax.tree_util.tree_leaves(zeros)
    n_out = len(_jaxpr.jaxpr_parts(closed).outvars)
    # Only (initial, seen) of each state are needed: the program's outputs
    # and what only they need are pruned before compiling (effects stay).
    wanted = {n: FirstUse(False, True, True) for n in zeros}
    needed = [False] * n_out + jax.tree_util.tree_leaves(wanted)
    outs = iter(jax.jit(_jaxpr.jaxpr_as_fun(_jaxpr.dce_closed(init, needed)))(*leaves, *args))
    # ctx leaves are in the flattened dict's (sorted) key order.
    final = {n: FirstUse(None, next(outs), next(outs)) for n in sorted(zeros)}
    first_gets = _first_gets(closed)
    result = {}
    for n, (_, initial, seen) in final.items():
        if not isinstance(seen, jax.core.Tracer) and bool(seen):
            result[n] = initial
            continue
        if n not in first_gets:  # only ever set: zeros (already in ``initial``)
            result[n] = initial
            continue
        chain, path = first_gets[n]
        if isinstance(seen, jax.core.Tracer):
            # uncurry inside a traced function: whether the example run
            # reaches the state is itself traced.
            try:
                fallback = unreached_init(chain, path, n, args)
            except StateError as e:
                raise StateError(
                    f"{e} (uncurry is called inside a traced function, so whether the "
                    f"example run reaches it is unknown at trace time)") from None
            result[n] = jax.lax.select(seen, initial, fallback)
        else:
            result[n] = unreached_init(chain, path, n, args)
    return result


def _without_effects_of_its_own(program: Any) -> Any:
    """The example run of ``program`` as it may be traced into an enclosing
    program (``uncurry`` or ``tx.value_and_grad`` called inside a trace):
    there it runs every time the enclosing program does, so the effects it
    would repeat are taken out. Its tags are plain (an enclosing reap would
    collect its sows a second time) and its ``jax.debug`` callbacks, which
    have no outputs, are dropped."""
    program = dissolve_tags(program)

    def rewrite(eqn, path, env):
        return [] if eqn.primitive is debug_callback_p else None

    return _traverse.map_jaxpr(program, rewrite)


def _initial_states_without_run(closed: Any, states: dict[str, StateInfo],
                                args: Sequence[Any]) -> dict | None:
    """Each state's value at first use, found without running the program
    when every state's first use is certain from the program's structure;
    None where it is not (the example run decides then).

    A state's first access is certain when, walking the program in execution
    order, it is met before any place that may or may not run (a cond
    branch, a while loop, a scan of length 0, a shard_map body, a site
    guarded by vmap) that also accesses the state: the equations of a jaxpr
    run in order, and calls and scans of length >= 1 run their bodies'
    equations in order. A first ``set_state`` means zeros; a first
    ``get_state`` its init, computed from only the part of the program that
    computes it (``unreached_init``; an init that needs a loop's carry or
    another state leaves it to the example run). Constant inits need no
    computation at all."""
    first: dict[str, tuple | None] = {}
    uses_state = _traverse.IdMemo()  # jaxpr -> the states it uses

    def names_in(jaxpr) -> frozenset:
        return uses_state.get_or_compute(jaxpr, lambda: frozenset(
            e.params["name"] for e, _ in _traverse.iter_eqns(jaxpr)
            if e.primitive is tag_p and is_state_tag(e.params)))

    def subs(eqn, path, at: _Chain):
        # Into the sub-jaxprs that use a state not met yet, where they run in
        # order; one that may not run ends the walk.
        runs_in_order = (eqn.primitive in _compat.CALL_PRIMITIVES
                         or (eqn.primitive is _compat.scan_p and eqn.params["length"] >= 1))
        for sub, sj in _traverse.subjaxprs(eqn):
            if names_in(sj) - first.keys():
                if not runs_in_order:
                    raise _Uncertain
                yield sub, sj, at.into(eqn, sub, sj)

    try:
        for eqn, path, at in _traverse.walk(closed, subs, _Chain(closed, ())):
            p = eqn.params
            if eqn.primitive is not tag_p or not is_state_tag(p) or p["name"] in first:
                continue
            if is_guarded(p) or meta(p).batched:
                return None
            first[p["name"]] = ([*at.chain, (at.jaxpr, eqn, None)], path) if p["op"] is GET \
                else None
    except _Uncertain:
        return None
    if first.keys() != states.keys():
        return None
    got = [n for n in states if first[n] is not None]
    try:
        inits = dict(zip(got, unreached_inits([(*first[n], n) for n in got], args)))
    except StateError:
        return None
    result = {}
    copied = []
    for n, info in states.items():
        aval = core.ShapedArray(info.shape, info.dtype)
        if first[n] is None:  # first set: zeros, as in the example run
            result[n] = jnp.zeros(info.shape, info.dtype)
            continue
        result[n] = _jaxpr.cast_weak_type(inits[n], aval)
        if not isinstance(result[n], core.Tracer):
            copied.append(n)
    # Fresh arrays, as the example run gives: an init may be the user's own
    # array (or a const of the program), and state0 may be donated. One
    # copy of them all (a copy per state costs a dispatch each), made now
    # also inside a trace (``uncurry`` called in a jitted function), where
    # the arrays are constants.
    with jax.ensure_compile_time_eval():
        copies = jax.device_put([result[n] for n in copied], may_alias=False)
    result.update(zip(copied, copies))
    return result


def _first_gets(closed: Any) -> dict[str, tuple[list, tuple[str, ...]]]:
    """Each state's first ``get_state`` in trace order: ``name -> (chain,
    path)``, ``chain`` the enclosing ``(jaxpr, eqn, sub)`` from the top level
    down, ending with ``(jaxpr, tag_eqn, None)``."""
    out: dict = {}
    clamped = _traverse.IdMemo()  # jaxpr -> outputs of its clamps (lax.switch's index)

    def subs(eqn, path, at: _Chain):
        found = _traverse.subjaxprs(eqn)
        if eqn.primitive is _compat.cond_p and len(eqn.params["branches"]) == 2:
            here = clamped.get_or_compute(at.jaxpr, lambda: {
                v for e in _jaxpr.jaxpr_parts(at.jaxpr).eqns if e.primitive is jax.lax.clamp_p
                for v in e.outvars})
            if not _is_switch_index(eqn.invars[0], here):
                found = found[::-1]  # lax.cond traces the true branch (index 1) first
        return ((sub, sj, at.into(eqn, sub, sj)) for sub, sj in found)

    for eqn, path, at in _traverse.walk(closed, subs, _Chain(closed, ())):
        p = eqn.params
        if eqn.primitive is tag_p and p.get("op") is GET and p["name"] not in out:
            out[p["name"]] = ([*at.chain, (at.jaxpr, eqn, None)], path)
    return out


class _Chain(NamedTuple):
    """Where a walk is: ``jaxpr``, reached through ``chain``, the enclosing
    ``(jaxpr, eqn, sub)`` from the top level down."""

    jaxpr: Any
    chain: tuple

    def into(self, eqn, sub, sj) -> "_Chain":
        return _Chain(sj, (*self.chain, (self.jaxpr, eqn, sub)))


class _Uncertain(Exception):
    """A state's first access may or may not run."""


def _is_switch_index(index: Any, clamped: set) -> bool:
    """Whether a two-branch ``cond``'s index comes from ``lax.switch``
    (which traces its branches in index order, and clamps its index) rather
    than ``lax.cond`` (which traces its true branch, index 1, first)."""
    return not isinstance(index, core.Literal) and index in clamped


def _outer_operand(eqn, sub, i: int) -> Any | None:
    """The operand of ``eqn`` that input ``i`` of its sub-jaxpr ``sub`` is
    bound to, the same in every iteration; None if there is none (a loop's
    carry or xs, a shard_map's shard)."""
    prim = eqn.primitive
    if prim in _compat.CALL_PRIMITIVES:
        return eqn.invars[i] if i < len(eqn.invars) else None
    if prim is _compat.cond_p:
        return eqn.invars[1 + i]
    if prim is _compat.scan_p:
        nc, _ = _jaxpr.scan_counts(eqn.params)
        return eqn.invars[i] if i < nc else None
    if prim is _compat.while_p:
        cc, bc = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        if sub.key == "cond_jaxpr":
            return eqn.invars[i] if i < cc else None
        return eqn.invars[cc + i] if i < bc else None
    return None


def _unreached_inits(chain: list, tag_eqns: list, path: tuple[str, ...], name: str,
                     args: Sequence[Any]) -> list:
    """The values of the init operands of ``tag_eqns`` (``get_state`` calls
    in the innermost jaxpr of ``chain``; ``name`` and ``path`` are the first's,
    for errors) that the example run never reaches, computed from the
    program and ``args`` (the top-level inputs) in one slice.

    The init's computation is sliced out of each enclosing jaxpr, from the
    site outwards; an input of a nested jaxpr is followed to the enclosing
    equation's operand when that operand is the same on every run of the
    body (jit/checkpoint/custom rule arguments, cond operands, loop consts).

    Raises:
        StateError: the init depends on a value that differs per run of its
            body (a loop's carry or xs), on a state, or on an effect.
    """
    where = f"get_state({name!r}) at {format_path(path)}"

    def fail(why: str) -> StateError:
        return StateError(
            f"taxpr: state {name!r}: {where} is never reached when running the example "
            f"arguments, and its init {why}, so its initial value cannot be computed; give "
            f"an init that does not depend on traced values (e.g. a callable), or example "
            f"arguments that reach it")

    def values(level: int, atoms: list) -> list:
        jaxpr = chain[level][0]
        constvars, consts, invars, eqns, _, _, dbg = _jaxpr.jaxpr_parts(jaxpr)
        needed = {a for a in atoms if type(a) is _compat.Var}
        kept = []
        for eqn in reversed(eqns):
            if not any(type(o) is _compat.Var and o in needed for o in eqn.outvars):
                continue
            if eqn.primitive is tag_p:
                if is_state_tag(eqn.params) and eqn.params["op"] is GET:
                    raise fail(f"depends on state {eqn.params['name']!r}")
            elif eqn.effects:
                raise fail(f"depends on an effect ({eqn.primitive.name})")
            kept.append(eqn)
            needed.update(v for v in eqn.invars if type(v) is _compat.Var)
        kept.reverse()
        ins = [v for v in invars if v in needed]
        if ins:
            if level == 0:
                index = {v: k for k, v in enumerate(invars)}
                in_vals = [args[index[v]] for v in ins]
            else:
                _, eqn, sub = chain[level - 1]
                pos = {v: k for k, v in enumerate(invars)}
                outer = [_outer_operand(eqn, sub, pos[v]) for v in ins]
                if any(o is None for o in outer):
                    raise fail(f"depends on a value that changes on every run of "
                               f"{sub.label} (e.g. a loop's carry or xs)")
                in_vals = values(level - 1, outer)
        else:
            in_vals = []
        if consts is None and any(v in needed for v in constvars):
            raise fail("depends on a free variable of an open jaxpr")
        sliced = _jaxpr.make_closed(constvars, consts or [], ins, kept, list(atoms),
                                     _traverse.effects_of_eqns(kept), dbg)
        return list(_jaxpr.jaxpr_as_fun(sliced)(*in_vals))

    # A jaxpr that returns a const returns it as it is (e.g. a NumPy array).
    return [v if isinstance(v, jax.Array) else jnp.asarray(v)
            for v in values(len(chain) - 1, [e.invars[0] for e in tag_eqns])]


def unreached_init(chain: list, path: tuple[str, ...], name: str, args: Sequence[Any]) -> Any:
    """The value of a ``get_state``'s init operand that the example run never
    reaches, computed from the program and ``args`` (``_unreached_inits``).

    Raises:
        StateError: the init depends on a value that differs per run of its
            body (a loop's carry or xs), on a state, or on an effect.
    """
    return _unreached_inits(chain, [chain[-1][1]], path, name, args)[0]


def unreached_inits(requests: Sequence[tuple[list, tuple[str, ...], str]],
                    args: Sequence[Any]) -> list:
    """``unreached_init`` of each ``(chain, path, name)``, the inits of
    ``get_state`` calls in the same jaxpr (reached through the same equations)
    computed by one slice of the program: linear in the number of states.

    Raises:
        StateError: as ``unreached_init``, naming the state.
    """
    groups: dict = {}
    for i, (chain, path, name) in enumerate(requests):
        key = (tuple((id(j), id(e), None if sub is None else (sub.key, sub.index))
                     for j, e, sub in chain[:-1]), id(chain[-1][0]))
        groups.setdefault(key, []).append(i)
    out: list = [None] * len(requests)
    for members in groups.values():
        chain, path, name = requests[members[0]]
        try:
            values = _unreached_inits(chain, [requests[i][0][-1][1] for i in members], path,
                                      name, args)
        except StateError:
            for i in members:  # (the error names the state whose init fails)
                unreached_init(*requests[i], args)
            raise
        for i, v in zip(members, values):
            out[i] = v
    return out

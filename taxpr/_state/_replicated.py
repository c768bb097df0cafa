"""Which ``set_state`` values are provably the same on every device of a
``shard_map`` without vma checking (``check_vma=False``, which ``jax.pmap``
lowers to).

There the types do not say what differs per shard, so ``collect_states``
refuses a set there unless this analysis proves its value replicated (a
state holds one value, and ctx leaves the shard_map replicated: only one
shard's would be kept). The analysis is a conservative dataflow over the
shard_map's body: every variable gets the set of mesh axes it may vary
over, starting from the axes of each input's ``in_specs`` entry. Collective
reductions (``psum``, ``pmax``, ``pmin``, ``all_gather``; ``pmean`` is a
``psum`` and a division) remove the axes they reduce over; ``axis_index``
and every other primitive naming mesh axes (``ppermute``, ``all_to_all``,
``psum_scatter``, ``pvary``, ...) add them; callbacks and the stateful
``rng_uniform`` may give anything. Any other primitive computes the same
result from the same operands on every device, so its outputs vary over
what its operands vary over.

Sets are followed into ``jit`` / ``closed_call`` / ``checkpoint`` /
``custom_jvp`` bodies, ``cond`` branches and ``scan`` / ``while_loop``
bodies (carries to a fixed point); a ``cond`` / ``while_loop`` whose
predicate may vary runs its sets on only some devices, so those are not
proven. Other nested jaxprs (a nested shard_map, a ``custom_vjp``) are
summarized: their outputs vary over their operands' axes and the axes any
primitive inside names, and sets inside them are not proven.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from .._jax.internals import core
from .._jax.internals import callback, lax_internal
from .._jax.internals import parallel as _parallel

from .. import _compat, _jaxpr, _traverse
from ..primitives._tag import tag_p
from ._ops import SET, is_state_tag

Axes = frozenset
_NONE: Axes = frozenset()
# Varies in a way no axis names (a callback's result, a reference's
# contents): never proven replicated.
_PER_DEVICE: Axes = frozenset({"<per device>"})

# Reductions over mesh axes: the result is the same across the axes reduced
# over (without ``axis_index_groups``), keyed to the param naming them.
# ``pmean`` is ``psum`` then a division. Primitives a JAX version lacks are
# skipped.
_REDUCTIONS: dict[core.Primitive, str] = {
    p: key for p, key in (
        (getattr(_parallel, "psum_p", None), "axes"),
        (getattr(_parallel, "psum_invariant_p", None), "axes"),
        (getattr(_parallel, "pmax_p", None), "axes"),
        (getattr(_parallel, "pmin_p", None), "axes"),
        (getattr(_parallel, "all_gather_p", None), "axis_name"),
        (getattr(_parallel, "all_gather_invariant_p", None), "axis_name"),
    ) if p is not None}

# Params naming the mesh axes a primitive works over (``axis_index``,
# ``ppermute``, ``all_to_all``, ``psum_scatter``, ``pvary``, ...): a
# primitive that names axes and is not a reduction above may make its
# result differ across them.
_AXIS_PARAMS = ("axes", "axis_name")


def _per_device_primitives() -> frozenset:
    return frozenset(p for p in (getattr(callback, "pure_callback_p", None),
                                 getattr(callback, "io_callback_p", None),
                                 getattr(lax_internal, "rng_uniform_p", None))
                     if p is not None)


# Primitives whose results may differ per device whatever their operands:
# host callbacks (run once per device) and XLA's stateful RNG.
_PER_DEVICE_PRIMITIVES: frozenset = _per_device_primitives()


def _names(value: Any) -> Axes:
    """The mesh axis names in an ``axes`` / ``axis_name`` param (a name or
    a tuple of them); positional (int) axes of array reductions are not."""
    items = value if isinstance(value, (tuple, list, frozenset, set)) else (value,)
    return frozenset(a for a in items
                     if a is not None and not isinstance(a, (int, bool)))


def _named_axes(eqn: core.JaxprEqn) -> Axes:
    """The mesh axes ``eqn``'s params name."""
    out: Axes = _NONE
    for key in _AXIS_PARAMS:
        if key in eqn.params:
            out |= _names(eqn.params[key])
    return out


def _spec_axes(spec: Any) -> Axes:
    """The mesh axes a ``PartitionSpec`` (or an older ``in_names`` dict)
    shards over; anything else may vary over anything."""
    if isinstance(spec, jax.sharding.PartitionSpec):
        entries = tuple(spec)
    elif isinstance(spec, dict):
        entries = tuple(spec.values())
    else:
        return _PER_DEVICE
    out: set = set()
    for entry in entries:
        if entry is None:
            continue
        if isinstance(entry, (tuple, list)):
            out.update(entry)
        else:
            out.add(entry)  # a name (or P.UNCONSTRAINED: counts as varying)
    return frozenset(out)


def _is_array(v: Any) -> bool:
    """Whether ``v`` is a plain array value: a reference (``AbstractRef``)
    or token carries values beside the dataflow followed here."""
    return isinstance(getattr(v, "aval", None), core.ShapedArray)


class ReplicatedSets:
    """The state sets proven the same on every device, over the shard_maps
    without vma checking analyzed so far (``add_shard_map``). A set reached
    from several places (a jaxpr JAX shares) is proven only if it is in each."""

    def __init__(self) -> None:
        self._proven = _traverse.IdMemo()  # set eqn -> proven everywhere it was reached
        self._summaries = _traverse.IdMemo()  # summarized eqn -> ``summarize(eqn)``

    def add_shard_map(self, eqn: core.JaxprEqn) -> None:
        """Analyze one shard_map eqn without vma checking (one not nested in
        another such shard_map: inside it, its analysis decides)."""
        p = eqn.params
        specs = p.get("in_specs", p.get("in_names"))
        if specs is None:  # an unknown form: nothing is proven
            specs = (None,) * len(eqn.invars)
        # An input varies over the axes its spec splits it along, and over
        # those it varies over already (an enclosing shard_map checking vma).
        ins = [_spec_axes(s) | _jaxpr.varying_axes(v.aval) for s, v in zip(specs, eqn.invars)]
        _Analysis(self).run(p["jaxpr"], ins, _NONE)

    def record(self, eqn: core.JaxprEqn, proven: bool) -> None:
        """The verdict on the set ``eqn`` at one place the analysis reached."""
        self._proven.set(eqn, self._proven.get(eqn, default=True) and proven)

    def proves(self, eqn: core.JaxprEqn) -> bool:
        """Whether the set ``eqn`` was proven replicated everywhere it was
        reached (a set no analysis reached is not)."""
        return self._proven.get(eqn, default=False)

    def summarize(self, eqn: core.JaxprEqn) -> Axes:
        """What the outputs of ``eqn``, whose jaxprs are not followed, may
        vary over beyond its operands: the axes of every primitive inside
        that names axes and is not a reduction, and anything where a
        callback, stateful RNG or reference is inside. The sets inside are
        recorded as not proven (a jaxpr JAX shares may be followed
        elsewhere, where they may be)."""
        return self._summaries.get_or_compute(eqn, lambda: self._summarize(eqn))

    def _summarize(self, eqn: core.JaxprEqn) -> Axes:
        out: Axes = _named_axes(eqn)
        for _, sj in _traverse.subjaxprs(eqn):
            for e, _ in _traverse.iter_eqns(sj):
                if e.primitive is tag_p and is_state_tag(e.params) and e.params["op"] is SET:
                    self.record(e, False)
                elif e.primitive in _PER_DEVICE_PRIMITIVES or not all(
                        map(_is_array, (*e.invars, *e.outvars))):
                    out |= _PER_DEVICE
                elif e.primitive not in _REDUCTIONS:
                    out |= _named_axes(e)
        return out


class _Analysis:
    """One walk of a shard_map body: ``run`` gives the axes each output of a
    jaxpr may vary over, recording the verdict on each set it reaches."""

    def __init__(self, sets: ReplicatedSets):
        self.sets = sets

    def run(self, jaxpr: Any, ins: Sequence[Axes], guard: Axes) -> list[Axes]:
        """The axes ``jaxpr``'s outputs may vary over.

        Arguments:
            jaxpr: a closed or open jaxpr.
            ins: per input, the axes it may vary over.
            guard: the axes over which whether this jaxpr runs may vary (a
                predicate of an enclosing ``cond`` / ``while_loop``): a set
                here is proven only when it is empty.

        Returns:
            Per output, the axes it may vary over.
        """
        parts = _jaxpr.jaxpr_parts(jaxpr)
        # Consts are the same on every device; an open jaxpr's free
        # constvars (``consts`` None) are whatever its caller passes.
        env: dict = {v: _NONE if parts.consts is not None else _PER_DEVICE
                     for v in parts.constvars}
        env.update(zip(parts.invars, ins))

        def read(v: Any) -> Axes:
            if type(v) is not core.Var:  # a Literal
                return _NONE
            return env.get(v, _PER_DEVICE)

        for eqn in parts.eqns:
            outs = self.eqn(eqn, [read(v) for v in eqn.invars], guard)
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in parts.outvars]

    def eqn(self, eqn: core.JaxprEqn, ins: list[Axes], guard: Axes) -> list[Axes]:
        """The axes ``eqn``'s outputs may vary over."""
        prim, n_out = eqn.primitive, len(eqn.outvars)
        joined = frozenset().union(*ins)
        if prim is tag_p and is_state_tag(eqn.params) and eqn.params["op"] is SET:
            self.sets.record(eqn, not (joined | guard))
            return [joined] * n_out
        if not all(map(_is_array, (*eqn.invars, *eqn.outvars))):
            self.sets.summarize(eqn)  # (sets inside it are not proven)
            return [_PER_DEVICE] * n_out
        if prim in _PER_DEVICE_PRIMITIVES:
            return [joined | _PER_DEVICE] * n_out
        key = _REDUCTIONS.get(prim)
        if key is not None:
            axes = _names(eqn.params[key])
            if eqn.params.get("axis_index_groups") is not None:  # reduces within groups only
                return [joined | axes] * n_out
            if len(ins) == n_out:  # psum of several operands reduces each
                return [s - axes for s in ins]
            return [joined - axes] * n_out
        subs = _traverse.subjaxprs(eqn)
        if not subs:
            return [joined | _named_axes(eqn)] * n_out
        if prim is _compat.cond_p:
            return self._cond(eqn, ins, guard)
        if prim is _compat.scan_p:
            return self._scan(eqn, ins, guard)
        if prim is _compat.while_p:
            return self._while(eqn, ins, guard)
        if prim in _CALLS and len(subs) == 1:
            parts = _jaxpr.jaxpr_parts(subs[0][1])
            if len(parts.invars) == len(ins) and len(parts.outvars) == n_out:
                return self.run(subs[0][1], ins, guard)
        return [joined | self.sets.summarize(eqn)] * n_out

    def _cond(self, eqn: core.JaxprEqn, ins: list[Axes], guard: Axes) -> list[Axes]:
        index = ins[0]
        outs = [index] * len(eqn.outvars)  # which branch ran may differ over these
        for branch in eqn.params["branches"]:
            got = self.run(branch, ins[1:], guard | index)
            outs = [a | b for a, b in zip(outs, got)]
        return outs

    def _scan(self, eqn: core.JaxprEqn, ins: list[Axes], guard: Axes) -> list[Axes]:
        nc, ncar = _jaxpr.scan_counts(eqn.params)
        carry = list(ins[nc:nc + ncar])
        while True:  # the sets only grow, over finitely many axes
            outs = self.run(eqn.params["jaxpr"], [*ins[:nc], *carry, *ins[nc + ncar:]], guard)
            new = [a | b for a, b in zip(carry, outs[:ncar])]
            if new == carry:
                return [*carry, *outs[ncar:]]
            carry = new

    def _while(self, eqn: core.JaxprEqn, ins: list[Axes], guard: Axes) -> list[Axes]:
        cc, bc = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        carry, pred = list(ins[cc + bc:]), _NONE
        while True:  # the sets only grow, over finitely many axes
            # How often the cond and body run differs over the predicate's
            # axes, and so does every carry.
            new_pred = self.run(eqn.params["cond_jaxpr"], [*ins[:cc], *carry], guard | pred)[0]
            outs = self.run(eqn.params["body_jaxpr"], [*ins[cc:cc + bc], *carry],
                            guard | new_pred)
            new = [a | b | new_pred for a, b in zip(carry, outs)]
            if new == carry and new_pred == pred:
                return carry
            carry, pred = new, new_pred


# Primitives that run their one jaxpr once on their operands, in order: sets
# in them are followed (a custom_vjp is summarized: its fwd rule runs in its
# place under differentiation).
_CALLS: frozenset = frozenset(
    p for p in (_compat.jit_p, *_compat.CLOSED_CALL_PRIMITIVES, getattr(core, "call_p", None),
                _compat.remat_p, _compat.custom_jvp_call_p)
    if p is not None)


def replicated_sets(closed: Any) -> ReplicatedSets:
    """The state sets of ``closed`` proven the same on every device, for
    each outermost shard_map without vma checking."""
    sets = ReplicatedSets()

    def subs(eqn, path, inside: bool):
        if not inside and is_unchecked_shard_map(eqn):
            sets.add_shard_map(eqn)
            inside = True
        return _traverse.every_sub(eqn, path, inside)

    for _ in _traverse.walk(closed, subs, False):
        pass
    return sets


def is_unchecked_shard_map(eqn: core.JaxprEqn) -> bool:
    """Whether ``eqn`` is a shard_map without vma checking."""
    return eqn.primitive is _compat.shard_map_p and not _jaxpr.shard_map_checks_vma(eqn.params)

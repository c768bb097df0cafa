"""Loops that run for a whole batch while any example runs.

equinox's loops (``equinox.internal.while_loop`` of every kind, and so
diffrax's and optimistix's solves) reduce their predicate over a ``vmap``
batch with ``unvmap_any``: the batched loop runs while *any* example runs,
and the library masks its own carry for the examples that have finished.
Run one example at a time, as eager Python would, the loop runs while *that*
example's predicate holds, so the effects of the extra steps must not
happen for it either. The engine asks this module for the predicate per
example (the reduction's operand, where the batched predicate used its
reduction) and keeps ctx unchanged where the two differ.

Without ``vmap`` the reduction is the identity, the two predicates are the
same value and the mask keeps every update.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ._jax.internals import core

from . import _compat, _jaxpr, _libraries

# Primitives whose output is, for each example of a batch, at least their
# operand (a reduction with ``any``) or exactly it (a value asserted to be
# the same across the batch). Each reads its operand at position 0.
OVER_BATCH_PRIMITIVES: set[core.Primitive] = set()


def register_over_batch(primitive: core.Primitive) -> core.Primitive:
    """Declare that, for each example of a ``vmap`` batch, ``primitive``'s
    boolean output is true where its first operand is (``any`` over the
    batch, or the operand itself), so a loop or branch it guards runs at
    least every step an example runs eagerly.

    Arguments:
        primitive: the ``Primitive`` object.

    Returns:
        ``primitive``.
    """
    OVER_BATCH_PRIMITIVES.add(primitive)
    return primitive


for _primitive in _libraries.equinox_over_batch_primitives():
    register_over_batch(_primitive)


_LOOPS = frozenset({_compat.while_p, _compat.scan_p})


def per_example_value(eqns: Sequence[core.JaxprEqn], atom: Any,
                      emit: Callable[[core.JaxprEqn], None]) -> Any | None:
    """The value ``atom`` takes for each example when the batch reductions
    among ``eqns`` that it depends on are read per example.

    Arguments:
        eqns: equations in program order, ``atom``'s producers among them.
        atom: a variable computed by ``eqns`` (or an input / literal).
        emit: receives the copies of the equations after a reduction, with
            the reduction's operand in place of its output.

    Returns:
        The per-example atom, or None when ``atom`` depends on no reduction
        (or when a copy would repeat an effect: the caller then keeps the
        batched value, which is exact without ``vmap``).
    """
    if not OVER_BATCH_PRIMITIVES or type(atom) is not core.Var:
        return None
    per_example: dict = {}
    copies = []
    for i in producers(eqns, atom):
        eqn = eqns[i]
        if eqn.primitive in OVER_BATCH_PRIMITIVES:
            if _over_an_inner_batch(eqn):
                # The batching rules guard the tags of that loop per example
                # (``_guards``).
                return None
            operand = eqn.invars[0]
            if type(operand) is core.Var:
                operand = per_example.get(operand, operand)
            per_example[eqn.outvars[0]] = operand
        elif any(type(v) is core.Var and v in per_example for v in eqn.invars):
            if eqn.primitive in _LOOPS:
                # A loop's outputs depend on a reduction through its number
                # of steps, and the library masks its carry per example:
                # they are the example's own already.
                continue
            if eqn.effects:
                return None
            outs = [_jaxpr.new_var(o.aval) for o in eqn.outvars]
            ins = [per_example.get(v, v) if type(v) is core.Var else v for v in eqn.invars]
            copies.append(eqn.replace(invars=ins, outvars=outs))
            per_example.update(zip(eqn.outvars, outs))
    if atom not in per_example:
        return None
    for eqn in copies:
        emit(eqn)
    return per_example[atom]


def producers(eqns: Sequence[core.JaxprEqn], atom: Any) -> list[int]:
    """Indices of the equations ``atom`` depends on, in program order."""
    if type(atom) is not core.Var:
        return []
    producer = {o: i for i, e in enumerate(eqns) for o in e.outvars}
    needed, todo = set(), [atom]
    while todo:
        i = producer.get(todo.pop())
        if i is None or i in needed:
            continue
        needed.add(i)
        todo.extend(v for v in eqns[i].invars if type(v) is core.Var)
    return sorted(needed)


def reduces_an_inner_batch(eqns: Sequence[core.JaxprEqn], atom: Any) -> bool:
    """Whether ``atom`` depends on a reduction over a ``vmap`` inside the
    program (the reduction's operand has the batch axis the result lacks)."""
    if not OVER_BATCH_PRIMITIVES or type(atom) is not core.Var:
        return False
    return any(eqns[i].primitive in OVER_BATCH_PRIMITIVES and _over_an_inner_batch(eqns[i])
               for i in producers(eqns, atom))


def _over_an_inner_batch(eqn: core.JaxprEqn) -> bool:
    """Whether a reduction's operand has a batch axis its result lacks (a
    ``vmap`` inside the program, rather than one around it)."""
    return eqn.invars[0].aval.shape != eqn.outvars[0].aval.shape


def with_per_example_output(closed: Any, index: int) -> Any | None:
    """``closed`` with one more output, last: output ``index`` read per
    example (``per_example_value``); None when it depends on no reduction."""
    parts = _jaxpr.jaxpr_parts(closed)
    eqns = list(parts.eqns)
    value = per_example_value(parts.eqns, parts.outvars[index], eqns.append)
    if value is None:
        return None
    return _jaxpr.with_parts(closed, eqns=eqns, outvars=[*parts.outvars, value])

"""The viewer's compare mode: the equations of two programs matched, and
those removed, added or rewritten (``diff``)."""

from __future__ import annotations

import difflib
from typing import Any, NamedTuple

from ._view_program import Pane


def _paths(pane: Pane) -> list[str]:
    """Per node: the labels of the enclosing sub-jaxprs and scopes."""
    out: list[str] = []
    for n in pane.nodes:
        out.append("" if n.parent < 0 else f"{out[n.parent]}/{n.label}")
    return out


def _keys(pane: Pane) -> tuple[list[str], list[str]]:
    """Per equation: where it is and what it computes (``coarse``), and
    that plus its operands' and results' types and params (``fine``); value
    names are left out, so renamed programs compare equal."""
    paths = _paths(pane)
    coarse, fine = [], []
    for e in pane.eqns:
        c = f"{paths[e.node]}|{pane.prims[e.prim]}"
        ins = ",".join(pane.types[pane.values[a][0]] if isinstance(a, int) else f"={a}"
                       for a in e.ins)
        outs = ",".join(pane.types[pane.values[o][0]] if o >= 0 else "_" for o in e.outs)
        coarse.append(c)
        fine.append(f"{c}|{ins}|{outs}|{pane.params[e.params] if e.params >= 0 else ''}")
    return coarse, fine


def _origin(pane: Pane, a: Any) -> tuple:
    """Where an operand comes from: a literal, a constant, output ``k`` of
    equation ``e``, or input ``k`` of its container."""
    if not isinstance(a, int):
        return ("literal", a)
    producer = pane.values[a][1]
    if producer is None:
        return ("const",)
    if producer >= 0:
        return ("eqn", producer, pane.eqns[producer].outs.index(a))
    return ("input", pane.nodes[-producer - 1].ins.index(a))


def _same_operands(left: Pane, right: Pane, i: int, j: int, matched: dict) -> bool:
    for a, b in zip(left.eqns[i].ins, right.eqns[j].ins):
        oa, ob = _origin(left, a), _origin(right, b)
        if oa[0] == "eqn" == ob[0]:
            if matched.get(oa[1]) != ob[1] or oa[2] != ob[2]:
                return False
        elif oa != ob:
            return False
    return True


class Diff(NamedTuple):
    """What changed between two programs: equation indices of the left
    program (``removed``; ``rewritten``'s first items) and of the right
    (``added``; ``rewritten``'s second items)."""

    removed: list[int]
    added: list[int]
    rewritten: list[tuple[int, int]]


def diff(left: Pane, right: Pane) -> Diff:
    """Match the equations of two programs in program order.

    Equations equal in place, primitive, types and params, whose operands
    come from equations matched alike, are unchanged; equal ones reading
    other values are rewritten. In the stretches between them, those with
    the same place and primitive are paired as rewritten (their operands'
    types or params differ), the rest of the left program's are removed and
    of the right's added.

    Arguments:
        left, right: the programs (``program``).

    Returns:
        A ``Diff``; the panes' equations are marked too (``Eqn.mark``).
    """
    lc, lf = _keys(left)
    rc, rf = _keys(right)
    removed, added, rewritten = [], [], []
    fine = difflib.SequenceMatcher(None, lf, rf, autojunk=False)
    opcodes = fine.get_opcodes()
    matched = {i1 + k: j1 + k for op, i1, i2, j1, j2 in opcodes if op == "equal"
               for k in range(i2 - i1)}
    for op, i1, i2, j1, j2 in opcodes:
        if op == "equal":
            # Equal alike, but reading other values (CSE pointed an operand
            # at another equation): rewritten.
            rewritten.extend((i, matched[i]) for i in range(i1, i2)
                             if not _same_operands(left, right, i, matched[i], matched))
            continue
        coarse = difflib.SequenceMatcher(None, lc[i1:i2], rc[j1:j2], autojunk=False)
        for op2, a1, a2, b1, b2 in coarse.get_opcodes():
            if op2 == "equal":
                rewritten.extend((i1 + a, j1 + b) for a, b in zip(range(a1, a2), range(b1, b2)))
                continue
            removed.extend(range(i1 + a1, i1 + a2))
            added.extend(range(j1 + b1, j1 + b2))
    for i in removed:
        left.eqns[i] = left.eqns[i]._replace(mark="r")
    for j in added:
        right.eqns[j] = right.eqns[j]._replace(mark="a")
    for i, j in rewritten:
        left.eqns[i] = left.eqns[i]._replace(mark="w")
        right.eqns[j] = right.eqns[j]._replace(mark="w")
    return Diff(removed, added, rewritten)



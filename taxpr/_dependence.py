"""Which outputs of a jaxpr depend on which of its inputs: a data-dependence
analysis through every nested jaxpr.

JAX's dead-code elimination answers "which inputs are used", but it keeps
what it cannot prune: every input of a ``custom_vjp`` call, every carry of a
``while_loop`` under the two-argument DCE rules of older JAX. Dependence
follows values instead: through the function a custom-derivative call runs,
through loop carries to a fixed point, through the branches of a ``cond``.
An equation with effects (a callback, another layer's tag) that takes a
dependent value is reported too, so that a value which only reaches an
effect still counts as used.

Per-primitive rules are registered against the Primitive in ``RULES``; an
equation without a rule depends on all its inputs (every output depends on
every input), and a jaxpr with references (``AbstractRef``) is
conservatively dependent throughout.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

from ._jax.internals import core

from . import _compat, _jaxpr
from ._traverse import IdMemo, any_eqn, subjaxprs


class Dependence(NamedTuple):
    """What depends on the chosen inputs (or sources) of a jaxpr."""

    outputs: tuple[bool, ...]  # per output: whether it depends on them
    reaches_effect: bool  # whether an equation with effects takes a dependent value


class _Analysis:
    """One analysis: the equations whose outputs are sources regardless of
    their inputs, the effectful equations that are not sinks, and a memo of
    nested jaxprs."""

    def __init__(self, source: Callable[[core.JaxprEqn], bool] | None,
                 not_a_sink: Callable[[core.JaxprEqn], bool] | None,
                 visit: Callable[[core.JaxprEqn, list[bool], bool], None] | None = None):
        self.source = source
        self.not_a_sink = not_a_sink
        self.visit = visit
        self.memo = IdMemo()
        self.entered: set[int] = set()  # ids of the jaxprs analysed (visit's "looked into")

    def jaxpr(self, jaxpr: Any, tainted_in: Sequence[bool]) -> Dependence:
        key = tuple(bool(t) for t in tainted_in)
        self.entered.add(id(jaxpr))
        return self.memo.get_or_compute(jaxpr, lambda: self._jaxpr(jaxpr, key), key)

    def _jaxpr(self, jaxpr: Any, tainted_in: tuple[bool, ...]) -> Dependence:
        parts = _jaxpr.jaxpr_parts(jaxpr)
        tainted = {v for v, t in zip(parts.invars, tainted_in) if t}
        effect = False
        for eqn in parts.eqns:
            ins = [type(v) is core.Var and v in tainted for v in eqn.invars]
            if self.source is not None and self.source(eqn):
                outs, reached = (True,) * len(eqn.outvars), False
            elif not any(ins) and not self._holds_source(eqn):
                continue
            elif any(_is_ref(v) for v in (*eqn.invars, *eqn.outvars)):
                # References carry values between equations beside the dataflow.
                return Dependence((True,) * len(parts.outvars), True)
            else:
                rule = RULES.get(eqn.primitive)
                dep = rule(self, eqn, ins) if rule is not None else None
                if dep is None:  # every output depends on every input
                    dep = Dependence((True,) * len(eqn.outvars), bool(eqn.effects) and not (
                        self.not_a_sink is not None and self.not_a_sink(eqn)))
                outs, reached = dep
                if self.visit is not None:
                    self.visit(eqn, ins, all(id(sj) in self.entered for _, sj in subjaxprs(eqn)))
            effect |= reached
            tainted.update(v for v, t in zip(eqn.outvars, outs) if t)
        outs = tuple(type(v) is core.Var and v in tainted for v in parts.outvars)
        return Dependence(outs, effect)

    def _holds_source(self, eqn: core.JaxprEqn) -> bool:
        if self.source is None:
            return False
        return any(self.memo.get_or_compute(sj, lambda: any_eqn(sj, self.source), "source")
                   for _, sj in subjaxprs(eqn))


def _is_ref(v: Any) -> bool:
    return type(getattr(v, "aval", None)).__name__ == "AbstractRef"


# ---- rules ------------------------------------------------------------------

def _call(analysis: _Analysis, eqn: core.JaxprEqn, ins: list[bool]) -> Dependence | None:
    """A primitive that runs its one jaxpr once on its operands (jit, a
    custom-derivative call undifferentiated, checkpoint, shard_map)."""
    subs = [sj for sub, sj in subjaxprs(eqn)]
    if len(subs) != 1:
        return None
    parts = _jaxpr.jaxpr_parts(subs[0])
    if len(parts.invars) != len(ins) or len(parts.outvars) != len(eqn.outvars):
        return None
    return analysis.jaxpr(subs[0], ins)


def _cond(analysis: _Analysis, eqn: core.JaxprEqn, ins: list[bool]) -> Dependence:
    if ins[0]:  # which branch runs depends on them
        return Dependence((True,) * len(eqn.outvars), _effects_in(eqn))
    outs = [False] * len(eqn.outvars)
    effect = False
    for branch in eqn.params["branches"]:
        dep = analysis.jaxpr(branch, ins[1:])
        outs = [a or b for a, b in zip(outs, dep.outputs)]
        effect |= dep.reaches_effect
    return Dependence(tuple(outs), effect)


def _scan(analysis: _Analysis, eqn: core.JaxprEqn, ins: list[bool]) -> Dependence:
    nc, ncar = _jaxpr.scan_counts(eqn.params)
    body = eqn.params["jaxpr"]
    carry = list(ins[nc:nc + ncar])
    while True:
        dep = analysis.jaxpr(body, [*ins[:nc], *carry, *ins[nc + ncar:]])
        new = [a or b for a, b in zip(carry, dep.outputs[:ncar])]
        if new == carry:
            return Dependence((*carry, *dep.outputs[ncar:]), dep.reaches_effect)
        carry = new


def _while(analysis: _Analysis, eqn: core.JaxprEqn, ins: list[bool]) -> Dependence:
    cc, bc = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    carry = list(ins[cc + bc:])
    while True:
        dep = analysis.jaxpr(eqn.params["body_jaxpr"], [*ins[cc:cc + bc], *carry])
        new = [a or b for a, b in zip(carry, dep.outputs)]
        if new == carry:
            break
        carry = new
    pred = analysis.jaxpr(eqn.params["cond_jaxpr"], [*ins[:cc], *carry])
    if pred.outputs[0]:  # how often the body runs depends on them
        return Dependence((True,) * len(eqn.outvars), _effects_in(eqn))
    return Dependence(tuple(carry), dep.reaches_effect or pred.reaches_effect)


def _effects_in(eqn: core.JaxprEqn) -> bool:
    return bool(eqn.effects)


RULES: dict[core.Primitive, Callable[[_Analysis, core.JaxprEqn, list[bool]],
                                     Dependence | None]] = {
    **{p: _call for p in _compat.CALL_PRIMITIVES},
    _compat.shard_map_p: _call,
    _compat.cond_p: _cond,
    _compat.scan_p: _scan,
    _compat.while_p: _while,
}


def dependence(jaxpr: Any, tainted_inputs: Sequence[bool], *,
               source: Callable[[core.JaxprEqn], bool] | None = None,
               not_a_sink: Callable[[core.JaxprEqn], bool] | None = None,
               visit: Callable[[core.JaxprEqn, list[bool], bool], None] | None = None
               ) -> Dependence:
    """Which outputs of ``jaxpr`` depend on the chosen inputs.

    Arguments:
        jaxpr: a closed or open jaxpr (its consts depend on nothing chosen).
        tainted_inputs: per input, whether it is chosen.
        source: equations (at any depth) whose outputs count as chosen too.
        not_a_sink: effectful equations whose dependent inputs do not count
            as reaching an effect (their outputs still depend on them).
        visit: called as ``visit(eqn, ins, looked_into)`` for each equation
            (at any depth) that takes a dependent value: ``ins`` per input
            whether it depends, ``looked_into`` whether the analysis followed
            values into all its jaxprs (else everything in them counts as
            dependent). A jaxpr analysed under several masks (a loop body
            to its fixed point) visits its equations under each.

    Returns:
        A ``Dependence``: per output whether it depends on what was chosen,
        and whether an equation with effects takes a dependent value.
    """
    return _Analysis(source, not_a_sink, visit).jaxpr(jaxpr, tainted_inputs)

"""Patches and captures inside custom derivative rules.

A custom_jvp rule, a custom_vjp fwd and bwd are Python callables that JAX
traces only when it differentiates the call, after ``_rewrite.insert``
rewrote the traced program: a change made to the traced function never
reaches them. Eagerly, a patch written into the function by hand is seen by
every call of the function, the calls its rules make included
(``jax.nn.relu``'s rule computes its output by calling relu). So the rules
of a rewritten custom call are wrapped: the jaxpr JAX traces of a rule is
rewritten in turn, each call of the function in it (a custom call whose
function is the same program) getting the rewritten function; a rule that
evaluates the function's code instead is traced again carrying the patches
(``_carry``). A rule that neither calls its function nor evaluates its code
cannot be given a patch: that is an error naming the site and the rule,
never the unpatched value.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from .._jax.internals import core

from .. import _compat, _jaxpr, _traverse
from .._engine import traced_bwd
from ..primitives._tag import evaluated_fun
from . import _carry
from ._sites import Site, scope_of

# The params holding a custom call's rules that return a traced jaxpr.
RULES_OF = {_compat.custom_jvp_call_p: "jvp_jaxpr_fun",
             _compat.custom_vjp_call_p: "fwd_jaxpr_thunk"}


class CustomRuleError(ValueError):
    """A patched site is inside the function of a custom derivative rule
    that does not call the function, so the rule would compute the
    derivative (and, under differentiation, the value) of the unpatched
    function."""


@dataclasses.dataclass(frozen=True)
class _RewrittenCall:
    """A custom call whose function was rewritten: its function before and
    after, and the sites changed or recorded inside it."""

    primitive: Any
    name: str | None
    where: str  # the path of the call, for errors
    before: Any
    after: Any
    sites: tuple[Any, ...]  # the Insertions inside it
    # The rewritten calls of the same program (this one and those nested in
    # its function): a rule evaluating the function's code re-binds copies
    # of the nested calls, whose rules are then given the change too.
    family: list = dataclasses.field(compare=False, repr=False, default_factory=list)

    @property
    def described(self) -> str:
        named = f" {self.name!r}" if self.name else ""
        return f"the {self.primitive.name}{named} at {self.where}"

    @property
    def patched(self) -> list[Site]:
        return [i.site for i in self.sites if i.changes]


def _call_name(eqn) -> str | None:
    """The custom function's name, for errors (None where only a library's
    generic wrapper is named: equinox's ``fn_wrapped``, ``fn_jvp_wrapper``)."""
    p = eqn.params
    names = [p.get("name"), getattr(_jaxpr.jaxpr_parts(p["call_jaxpr"]).debug_info,
                                    "func_name", None)]
    for fun in (p.get("jvp_jaxpr_fun"), p.get("fwd_jaxpr_thunk")):
        names.append(getattr(getattr(fun, "debug_info", None), "func_name", None))
    for name in names:
        if isinstance(name, str) and not name.endswith(("_wrapped", "_wrapper")):
            return name
    return None


def with_carrying_rules(new_eqn, old_eqn, after: Any, sites: tuple[Any, ...],
                         path: tuple[str, ...], family: list):
    """``new_eqn`` (``old_eqn`` with its function rewritten to ``after``,
    holding ``sites``; at ``path``) with its rules wrapped to carry the
    change. ``family``: the rewritten calls of the same program, this one
    appended."""
    call = _RewrittenCall(old_eqn.primitive, _call_name(old_eqn), "/".join(path) or "<top level>",
                          old_eqn.params["call_jaxpr"], after, sites, family)
    family.append(call)
    return new_eqn.replace(params=_carrying_params(new_eqn.params, old_eqn.params, call))


def _carrying_params(params: dict, rules_from: dict, call: _RewrittenCall) -> dict:
    """``params`` with the rules of ``rules_from`` wrapped to carry
    ``call``'s change."""
    key = RULES_OF[call.primitive]
    params = {**params, key: _carrying_rule(rules_from[key], call)}
    if "bwd" in params and call.patched:
        params["bwd"] = _checked_bwd(rules_from["bwd"], call)
    return params


def _copies_carrying(call: _RewrittenCall):
    """For ``_carry``: the params of a custom call re-evaluated while a rule
    of ``call`` is traced, its rules carrying the change where its function
    is one of the rewritten calls of ``call``'s program (its function stays:
    re-evaluated there, it is patched as it runs)."""

    def wrap(params: dict) -> dict:
        fun = params.get("call_jaxpr")
        for other in call.family:
            if other.primitive in RULES_OF and fun is not None \
                    and _same_program(fun, other.before):
                return _carrying_params(params, params, other)
        return params

    return wrap


def _program_key(closed: Any) -> tuple:
    """What makes two traces of a function the same program: the printed
    jaxpr (variables named in order) and its constants."""
    parts = _jaxpr.jaxpr_parts(closed)
    jaxpr, consts = _jaxpr.open_with_constvars(closed)
    return (str(jaxpr), tuple((np.shape(c), str(getattr(c, "dtype", type(c))),
                               np.asarray(c).tobytes() if not isinstance(c, core.Tracer)
                               else id(c)) for c in consts), len(parts.invars))


_KEYS = _traverse.IdMemo()


def _same_program(a: Any, b: Any) -> bool:
    if a is b:
        return True
    key = lambda j: _KEYS.get_or_compute(j, lambda: _program_key(j))  # noqa: E731
    return key(a) == key(b)


def _carry_into(rule: Any, call: _RewrittenCall) -> tuple[Any, int]:
    """``rule`` (a closed jaxpr) with every call of ``call``'s function
    given the rewritten function (and its rules wrapped in turn), and how
    many calls it found."""
    found = [0]

    def rewrite(eqn, path, env):
        if eqn.primitive is call.primitive and _same_program(eqn.params["call_jaxpr"],
                                                             call.before):
            found[0] += 1
            key = RULES_OF[call.primitive]
            eqn = _traverse.with_subjaxprs(eqn, {("call_jaxpr", None): call.after},
                                           **{key: _carrying_rule(eqn.params[key], call)})
            return [eqn.replace(invars=[_traverse._sub(env, v) for v in eqn.invars])]
        return None

    return _traverse.map_jaxpr(rule, rewrite), found[0]


def _carrying_rule(rule_fun: Any, call: _RewrittenCall) -> Any:
    """``rule_fun`` (a custom_jvp's ``jvp_jaxpr_fun`` or a custom_vjp's
    ``fwd_jaxpr_thunk``: ``(*flags) -> (jaxpr, consts, ...)``) whose traced
    rule carries ``call``'s rewrite."""
    kind = "custom_jvp rule" if call.primitive is _compat.custom_jvp_call_p else "custom_vjp fwd"

    def traced(*flags):
        jaxpr, consts, *rest = rule_fun.call_wrapped(*flags)
        closed, found = _carry_into(_jaxpr.close_traced(jaxpr, consts), call)
        if not found and call.patched:
            # The rule may evaluate the function's code as a jaxpr it was
            # given: traced again, with the patches carried into it.
            carry = _carry_plan(call, kind)
            with _carry.carrying(carry):
                jaxpr, consts, *rest = rule_fun.call_wrapped(*flags)
            closed = _jaxpr.close_traced(jaxpr, consts)
            _check_carried(closed, carry, call, kind)
        return (*_jaxpr.open_with_constvars(closed), *rest)

    return _jaxpr.wrap_fun(traced, rule_fun)


def _carry_plan(call: _RewrittenCall, kind: str) -> _carry.CarryPlan:
    try:
        return _carry.plan(call.before, call.sites, _copies_carrying(call))
    except _carry.NotCarried as e:
        raise CustomRuleError(
            f"taxpr.patch: site {e.site!r} is inside the function of {call.described}, whose "
            f"{kind} does not call the function, and the patch cannot be given to the rule: "
            f"{e}. "
            f"Differentiated, JAX runs the rule in the function's place, and the rule "
            f"would compute the unpatched value and its derivative. Patch a value outside "
            f"that function (its inputs or outputs), or differentiate without it") from None


def _check_carried(closed: Any, carry: _carry.CarryPlan, call: _RewrittenCall,
                   kind: str) -> None:
    """A rule traced while carrying ``carry`` must have computed every
    patched site as patched: a site it never evaluates means the rule does
    not run the function's code (its derivative is the unpatched one's), one
    it traces afresh from Python cannot be patched."""
    # (a site whose patch the rule's evaluation of its code was given is
    # not looked for by scope: the rule's derivative equations of the same
    # primitive share the site's scope)
    applied = carry.applied_sites()
    fresh = _carry.uncarried_equations(closed, carry) or [
        site.name for site in call.patched
        if site.name not in applied and _recomputes(closed, site)]
    if fresh:
        raise CustomRuleError(
            f"taxpr.patch: site {fresh[0]!r} is inside the function of {call.described}, "
            f"whose {kind} computes it again from Python code without the patch: "
            f"differentiated, JAX runs the rule in the function's place, and the rule "
            f"computes the unpatched value and its derivative. Patch a value outside that "
            f"function (its inputs or outputs), or differentiate without it")
    missing = carry.unapplied_sites()
    if missing:
        raise CustomRuleError(
            f"taxpr.patch: site {missing[0]!r} is inside the function of {call.described}, "
            f"whose {kind} does not call the function nor evaluate its code: "
            f"differentiated, JAX runs the rule in the function's place, and the rule "
            f"computes the unpatched value and its derivative. Patch a value outside that "
            f"function (its inputs or outputs), or differentiate without it")


def _recomputes(closed: Any, site: Site) -> bool:
    """Whether ``closed`` (a traced rule) computes ``site`` again without
    its patch: an equation of its primitive in the same innermost scope
    (or, for a site in no scope, of its primitive and type) that no carried
    patch bound."""
    scope = scope_of(site.source_info[0])
    for eqn, _ in _traverse.iter_eqns(closed):
        if eqn.primitive.name != site.primitive or _carry.carried_in(eqn.source_info.name_stack):
            continue
        if scope:
            if scope_of(eqn.source_info)[-len(scope):] == scope:
                return True
        elif any(getattr(v.aval, "shape", None) == site.shape
                 and getattr(v.aval, "dtype", None) == site.dtype for v in eqn.outvars):
            return True
    return False


def _checked_bwd(user_bwd: Any, call: _RewrittenCall) -> Any:
    """``user_bwd`` (a custom_vjp's flat bwd) given ``call``'s patches where
    it evaluates the function's code again (``_carry``: equinox's
    checkpointed loops), and refusing to compute a patched site again from
    its own Python code (``jax.vjp`` of the function), where no patch is: it
    would differentiate the unpatched function. It runs as traced, closed
    over the values JAX passes."""

    def refuse(site_name: str) -> CustomRuleError:
        return CustomRuleError(
            f"taxpr.patch: site {site_name!r} is inside the function of {call.described}, "
            f"whose custom_vjp bwd computes it again without the patch (it recomputes the "
            f"function): its cotangents would be those of the unpatched function. Patch a "
            f"value outside that function, or differentiate without it")

    def bwd(*args):
        try:
            carry = _carry.plan(call.before, call.sites, _copies_carrying(call))
        except _carry.NotCarried:
            carry = None
        if carry is None:
            closed, results = traced_bwd(user_bwd, args)
            for site in call.patched:
                if _recomputes(closed, site):
                    raise refuse(site.name)
        else:
            with _carry.carrying(carry):
                closed, results = traced_bwd(user_bwd, args)
            fresh = _carry.uncarried_equations(closed, carry)
            if fresh:
                raise refuse(fresh[0])
            applied = carry.applied_sites()
            for site in call.patched:
                if site.name not in applied and _recomputes(closed, site):
                    raise refuse(site.name)
        return _compat.custom_vjp_bwd_result(*results(evaluated_fun(closed)()))

    return _jaxpr.wrap_fun(bwd, user_bwd)

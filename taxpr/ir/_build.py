"""Building jaxprs from equations, and inlining jit calls."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .._jax.internals import UnspecifiedValue, core

from .. import _compat, _jaxpr, _traverse

__all__ = ["eqns_to_closed_jaxpr", "eqns_to_jaxpr", "inline_jit"]


def _free_and_defined(eqns: Sequence[core.JaxprEqn]) -> tuple[list, list]:
    """Variables read before being defined (first-use order), and the
    outputs nothing after them reads (definition order)."""
    defined: set = set()
    free: list = []
    seen_free: set = set()
    read: set = set()
    for eqn in eqns:
        for a in eqn.invars:
            if isinstance(a, core.Literal):
                continue
            read.add(a)
            if a not in defined and a not in seen_free:
                seen_free.add(a)
                free.append(a)
        defined.update(v for v in eqn.outvars if not isinstance(v, core.DropVar))
    unread = [v for e in eqns for v in e.outvars
              if not isinstance(v, core.DropVar) and v not in read]
    return free, unread


def _effects(eqns) -> Any:
    return _traverse.effects_of_eqns(eqns) or core.no_effects


def eqns_to_jaxpr(eqns: Sequence[core.JaxprEqn], invars: Sequence[core.Var] | None = None,
                  outvars: Sequence[Any] | None = None,
                  constvars: Sequence[core.Var] | None = None) -> core.Jaxpr:
    """An open jaxpr of ``eqns`` whose effects are those of its equations.

    Arguments:
      eqns: equations in program order.
      invars: the inputs; default: every variable read before it is defined
        (in order of first use), except ``constvars``.
      outvars: the outputs; default: every output no later equation reads.
      constvars: variables bound as constants (in JAX 0.12, where jaxprs
        carry their consts, these are leading inputs of the open jaxpr).

    Returns:
      A ``Jaxpr`` (``check_jaxpr`` passes when the equations are well typed).
    """
    free, unread = _free_and_defined(eqns)
    constvars = list(constvars or ())
    if invars is None:
        cset = set(constvars)
        invars = [v for v in free if v not in cset]
    if outvars is None:
        outvars = unread
    dbg = _jaxpr._fit_debug_info(_jaxpr.debug_info("eqns_to_jaxpr"), len(invars),
                                  len(outvars))
    return core.Jaxpr(constvars, list(invars), list(outvars), list(eqns), _effects(eqns), dbg,
                      _jaxpr.is_high(eqns))


def eqns_to_closed_jaxpr(eqns: Sequence[core.JaxprEqn], invars: Sequence[core.Var] | None = None,
                         outvars: Sequence[Any] | None = None,
                         consts: Sequence[Any] | dict | None = None) -> Any:
    """A closed jaxpr of ``eqns``.

    Arguments:
      eqns: equations in program order.
      invars: the inputs; default: the variables read before being defined
        that are not given a value in ``consts``.
      outvars: the outputs; default: every output no later equation reads.
      consts: values of the constants: a dict ``{var: value}``, or a
        sequence paired in order with the free variables that are not in
        ``invars`` (``invars`` must then be given).

    Returns:
      A ``ClosedJaxpr`` (a ``Jaxpr`` with consts in JAX 0.12).
    """
    free, unread = _free_and_defined(eqns)
    if isinstance(consts, dict):
        constvars, values = list(consts), list(consts.values())
    elif consts:
        if invars is None:
            raise ValueError("eqns_to_closed_jaxpr: pass invars when consts is a sequence "
                             "(or pass consts as a {var: value} dict)")
        iset = set(invars)
        constvars = [v for v in free if v not in iset]
        values = list(consts)
        if len(constvars) != len(values):
            raise ValueError(f"eqns_to_closed_jaxpr: {len(values)} consts for "
                             f"{len(constvars)} free variables {constvars}")
    else:
        constvars, values = [], []
    if invars is None:
        cset = set(constvars)
        invars = [v for v in free if v not in cset]
    if outvars is None:
        outvars = unread
    return _jaxpr.make_closed(constvars, values, list(invars), list(eqns), list(outvars),
                               _effects(eqns), _jaxpr.debug_info("eqns_to_closed_jaxpr"))


def jit_inlining_loses_nothing(params: dict) -> bool:
    """Whether a jit equation's params ask for nothing but the call itself:
    no shardings, layouts, donation or compiler options that inlining its
    body would drop."""
    def unspecified(xs):
        return all(isinstance(s, UnspecifiedValue) or s is None for s in xs)

    return (unspecified(params.get("in_shardings", ()))
            and unspecified(params.get("out_shardings", ()))
            and all(x is None for x in params.get("in_layouts", ()))
            and all(x is None for x in params.get("out_layouts", ()))
            and not any(params.get("donated_invars", ()))
            and not params.get("compiler_options_kvs"))


def inline_jit(jaxpr: Any, predicate: Callable[[core.JaxprEqn], bool] | None = None) -> Any:
    """Replace jit calls by their bodies, at any depth (also inside scan,
    while, cond, checkpoint, ... and inside other jits).

    A jit is kept when ``predicate(eqn)`` is false, or when inlining would
    lose what its params ask for (in/out shardings, layouts, donated
    inputs, compiler options) or its body has non-scalar consts.

    Arguments:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
      predicate: which jit equations to inline (default: all).

    Returns:
      The same kind of jaxpr; every inlined call gets fresh variables, so a
      function called twice is inlined twice (effects included).
    """
    memo = _traverse.IdMemo()  # jit body -> its inlined body

    def rewrite(eqn, path, env):
        if eqn.primitive is not _compat.jit_p or not jit_inlining_loses_nothing(eqn.params):
            return None
        if predicate is not None and not predicate(eqn):
            return None
        body = eqn.params["jaxpr"]
        inlined = memo.get_or_compute(body, lambda: inline_jit(body, predicate))
        constvars, consts, invars, eqns, outvars, _, _ = _jaxpr.jaxpr_parts(inlined)
        if any(getattr(c, "shape", ()) != () for c in consts or ()):
            return None
        rename: dict = {v: _jaxpr.literal(c, v.aval) for v, c in zip(constvars, consts or ())}
        rename.update(zip(invars, [_sub(env, a) for a in eqn.invars]))
        new_eqns = []
        for e in eqns:
            outs = [v if isinstance(v, core.DropVar) else _fresh(rename, v) for v in e.outvars]
            new_eqns.append(e.replace(invars=[_sub(rename, a) for a in e.invars], outvars=outs))
        for v, a in zip(eqn.outvars, outvars):
            if not isinstance(v, core.DropVar):
                env[v] = _sub(rename, a)
        return new_eqns

    return _traverse.map_jaxpr(jaxpr, rewrite)


def _sub(env: dict, a: Any) -> Any:
    return a if isinstance(a, core.Literal) else env.get(a, a)


def _fresh(rename: dict, v: core.Var) -> core.Var:
    nv = _jaxpr.new_var(v.aval)
    rename[v] = nv
    return nv

"""Building and reading jaxprs, the same on every supported JAX.

The neutral form used by the rest of taxpr for a jaxpr is its parts, a
``JaxprParts`` (constvars, consts, invars, eqns, outvars, effects,
debug_info): ``jaxpr_parts`` reads them from an open or closed jaxpr, and
``make_closed`` / ``make_jaxpr_like`` / ``with_parts`` build one back.
Tracing (``trace_flat``), evaluating (``jaxpr_as_fun``), dead-code
elimination (``dce_closed``, ``dce_level``, ``used_invars``) and checking
(``check_jaxpr``) are here too, and the building blocks of values and avals
(``abstractify``, ``cast_weak_type``, the varying manual axes of
``varying_axes`` / ``match_varying``) and of the functions custom-derivative
params hold (``wrap_fun``, ``called_jaxpr``). What differs between JAX
versions is detected in ``_compat``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
from jax._src import core
from jax._src.interpreters import partial_eval as pe

from ._compat import JAXPR_TYPES, MERGED_JAXPR, ClosedJaxpr, call_hi_primitive_p


def new_var(aval: core.AbstractValue) -> core.Var:
    return core.Var(aval)


def is_jaxpr(x: Any) -> bool:
    return isinstance(x, JAXPR_TYPES)


def is_closed(j: Any) -> bool:
    """Whether ``j`` is (or, with merged jaxprs, may stand for) a ClosedJaxpr."""
    return isinstance(j, ClosedJaxpr)


class JaxprParts(NamedTuple):
    """The parts of a jaxpr, the same in every JAX version.

    ``consts`` holds the values of ``constvars``; for an open 0.10 jaxpr with
    constvars it is None (the constvars are free variables supplied by the
    caller).
    """

    constvars: list
    consts: list | None
    invars: list
    eqns: list
    outvars: list
    effects: Any
    debug_info: Any


def jaxpr_parts(j: Any) -> JaxprParts:
    """The ``JaxprParts`` of a (closed or open) jaxpr."""
    if MERGED_JAXPR:
        return JaxprParts(j.constvars, list(j.consts), j.invars, j.eqns, j.outvars,
                          j.effects, j.debug_info)
    if isinstance(j, core.ClosedJaxpr):
        jj = j.jaxpr
        return JaxprParts(jj.constvars, list(j.consts), jj.invars, jj.eqns, jj.outvars,
                          jj.effects, jj.debug_info)
    return JaxprParts(j.constvars, None if j.constvars else [], j.invars, j.eqns,
                      j.outvars, j.effects, j.debug_info)


def make_jaxpr_like(
    like: Any,
    constvars: Sequence[core.Var],
    consts: Sequence[Any],
    invars: Sequence[core.Var],
    eqns: Sequence[core.JaxprEqn],
    outvars: Sequence[Any],
    effects: Any,
    debug_info: Any,  # noqa: F811 (shadows the helper below on purpose)
):
    """Build a jaxpr of the same kind (closed/open) as ``like``.

    An open ``like`` cannot hold consts: callers hoist them first.
    """
    debug_info = _fit_debug_info(debug_info, len(invars), len(outvars))
    high = is_high(eqns)
    if MERGED_JAXPR:
        return core.Jaxpr(list(constvars), list(invars), list(outvars), list(eqns),
                          effects, debug_info, high, consts=list(consts))
    jaxpr = core.Jaxpr(list(constvars), list(invars), list(outvars), list(eqns),
                       effects, debug_info, high)
    if isinstance(like, core.ClosedJaxpr) or like is None:
        return core.ClosedJaxpr(jaxpr, list(consts))
    assert not consts, "open jaxpr cannot carry consts"
    return jaxpr


def is_high(eqns: Sequence[core.JaxprEqn]) -> bool:
    """Whether a jaxpr of ``eqns`` is *high*: it holds a high-level primitive
    (``call_hi_primitive``), directly or in a nested jaxpr. JAX lowers such a
    jaxpr to ordinary primitives before compiling only when it is marked so,
    so every jaxpr taxpr builds carries the mark of its equations."""
    if call_hi_primitive_p is None:
        return False
    for e in eqns:
        if e.primitive is call_hi_primitive_p:
            return True
        for v in e.params.values():
            if isinstance(v, JAXPR_TYPES):
                if v.is_high:
                    return True
            elif type(v) is tuple and any(isinstance(x, JAXPR_TYPES) and x.is_high for x in v):
                return True
    return False


def _fit_debug_info(dbg: Any, n_in: int, n_out: int) -> Any:
    """``dbg`` with arg names / result paths dropped where their counts no
    longer match (checks assert on them)."""
    if dbg is None:
        return debug_info("taxpr")
    updates = {}
    names = getattr(dbg, "arg_names", None)
    if names is not None and len(names) != n_in:
        updates["arg_names"] = None
    paths = getattr(dbg, "result_paths", None)
    if isinstance(paths, tuple) and len(paths) != n_out:
        updates["result_paths"] = None
    elif paths is not None and not isinstance(paths, tuple):
        updates["result_paths"] = None
    return dbg._replace(**updates) if updates else dbg


def make_closed(constvars, consts, invars, eqns, outvars, effects, debug_info):
    return make_jaxpr_like(None, constvars, consts, invars, eqns, outvars,
                           effects, debug_info)


def with_parts(closed: Any, **changes: Any) -> Any:
    """``closed`` (a closed jaxpr) rebuilt with some of its ``JaxprParts``
    replaced, e.g. ``with_parts(j, outvars=...)``."""
    return make_closed(*jaxpr_parts(closed)._replace(**changes))


def debug_info(name: str) -> Any:
    return core.DebugInfo("taxpr", name, None, None)


def scan_counts(params: dict) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a scan eqn's params."""
    if "ft_in" in params:
        consts_g, carry_g, _ = params["ft_in"].unpack()
        return len(consts_g), len(carry_g)
    return params["num_consts"], params["num_carry"]


def scan_params(params: dict, num_consts: int, num_carry: int, num_xs: int,
                num_ys: int, **updates) -> dict:
    """Scan params with new operand counts (and any other updates)."""
    new = dict(params, **updates)
    if "ft_in" in params:
        from jax._src import flattree as ft
        new["ft_in"] = ft.pack((ft.nones(num_consts), ft.nones(num_carry), ft.nones(num_xs)))
        new["ft_out"] = ft.pack((ft.nones(num_carry), ft.nones(num_ys)))
    else:
        new["num_consts"] = num_consts
        new["num_carry"] = num_carry
    return new


def dce_jaxpr(jaxpr: core.Jaxpr, used_outputs, instantiate=False):
    return pe.dce_jaxpr(jaxpr, used_outputs, instantiate)


def jaxpr_as_fun(j):
    from jax.extend.core import jaxpr_as_fun as f
    return f(j)


def trace_flat(fn: Callable, avals: Sequence[core.AbstractValue], name: str = "taxpr"):
    """Trace ``fn(*flat) -> list`` at ``avals`` (kept exactly, e.g. the
    varying manual axes inside shard_map) into a closed jaxpr."""
    from jax._src import linear_util as lu
    wrapped = lu.wrap_init(lambda *a: list(fn(*a)), debug_info=debug_info(name))
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(avals))
    return close_traced(jaxpr, consts)


def close_traced(jaxpr: Any, consts: Sequence[Any]) -> Any:
    """The closed jaxpr of an open one and its separately returned consts (as
    ``trace_to_jaxpr_dynamic`` or a custom_jvp rule's thunk return them). A
    merged open jaxpr has no constvars: its first invars take the consts."""
    if MERGED_JAXPR and not jaxpr.consts:
        all_in = jaxpr.all_invars
        constvars, invars = all_in[:len(consts)], all_in[len(consts):]
    else:
        constvars, invars = jaxpr.constvars, jaxpr.invars
    return make_closed(constvars, consts, invars, jaxpr.eqns, jaxpr.outvars,
                       jaxpr.effects, jaxpr.debug_info)


def used_invars(closed: Any, used_outputs: Sequence[bool] | None = None) -> list[bool]:
    """Which of a closed jaxpr's (non-const) inputs its outputs (those of
    ``used_outputs``, default all) depend on."""
    constvars, consts, invars, eqns, outvars, effects, dbg = jaxpr_parts(closed)
    open_j = core.Jaxpr([], [*constvars, *invars], outvars, eqns, effects, dbg, is_high(eqns))
    _, used = pe.dce_jaxpr(open_j, [True] * len(outvars) if used_outputs is None
                           else list(used_outputs))
    return list(used[len(constvars):])


def open_with_constvars(closed: Any) -> tuple[Any, list]:
    """``(jaxpr, consts)`` as ``core.eval_jaxpr(jaxpr, consts, *args)`` takes them."""
    constvars, consts, invars, eqns, outvars, effects, dbg = jaxpr_parts(closed)
    dbg = _fit_debug_info(dbg, len(constvars) + len(invars) if MERGED_JAXPR else len(invars),
                          len(outvars))
    return core.Jaxpr(constvars, invars, outvars, eqns, effects, dbg, is_high(eqns)), list(consts)


def dce_closed(closed: Any, used_outputs: Sequence[bool]) -> Any:
    """``closed`` with only the used outputs and the equations they need
    (nested jaxprs pruned by JAX's own DCE rules); inputs are all kept."""
    constvars, consts, invars, eqns, outvars, effects, dbg = jaxpr_parts(closed)
    open_j = core.Jaxpr([], [*constvars, *invars], outvars, eqns, effects,
                        _fit_debug_info(dbg, len(constvars) + len(invars), len(outvars)),
                        is_high(eqns))
    new, _ = pe.dce_jaxpr(open_j, list(used_outputs), instantiate=True)
    nc = len(constvars)
    return make_closed(new.invars[:nc], consts, new.invars[nc:], new.eqns, new.outvars,
                       new.effects, dbg)


def in_avals(closed: Any) -> list:
    return [v.aval for v in jaxpr_parts(closed).invars]


def dce_level(constvars, invars, eqns, outvars, effects, dbg):
    """JAX's DCE of one jaxpr keeping every input (nested equations are
    pruned by ``pe.dce_rules``): ``(used_constvars, eqns, effects)``."""
    open_j = core.Jaxpr([], [*constvars, *invars], outvars, eqns, effects,
                        _fit_debug_info(dbg, len(constvars) + len(invars), len(outvars)),
                        is_high(eqns))
    instantiate = [False] * len(constvars) + [True] * len(invars)
    new, used = pe.dce_jaxpr(open_j, [True] * len(outvars), instantiate)
    return list(used[:len(constvars)]), new.eqns, new.effects


def literal(value: Any, aval: core.AbstractValue) -> core.Literal:
    """A Literal of ``value`` (converted to ``aval``'s dtype) typed ``aval``."""
    import numpy as np
    return core.Literal(np.asarray(value, dtype=aval.dtype), aval)


def check_jaxpr(j: Any) -> None:
    """``core.check_jaxpr`` of a Jaxpr or ClosedJaxpr (raises if ill-typed)."""
    if not MERGED_JAXPR and isinstance(j, core.ClosedJaxpr):
        j = j.jaxpr
    core.check_jaxpr(j)


# ---- values and their avals ----------------------------------------------------

def abstractify(x: Any) -> core.AbstractValue:
    """The ShapedArray of a value (weak type kept) or of a ShapeDtypeStruct."""
    if isinstance(x, core.AbstractValue):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return core.ShapedArray(x.shape, x.dtype, weak_type=bool(getattr(x, "weak_type", False)))
    return core.shaped_abstractify(x)


def cast_weak_type(x: Any, aval: core.AbstractValue) -> Any:
    """``x`` with ``aval``'s weak type (same dtype), so types stay exact."""
    xa = core.typeof(x) if isinstance(x, core.Tracer) else core.shaped_abstractify(x)
    if (getattr(xa, "weak_type", False) == getattr(aval, "weak_type", False)
            or xa.dtype != aval.dtype or xa.shape != aval.shape):
        return x  # equal already, or a real mismatch the caller reports
    from jax._src.lax import lax as lax_internal
    return lax_internal._convert_element_type(x, aval.dtype, weak_type=aval.weak_type)


def varying_axes(aval: Any) -> frozenset:
    """The manual mesh axes over which a value inside shard_map varies."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def match_varying(x: Any, axes: frozenset) -> Any:
    """Mark ``x`` (inside shard_map) as varying over ``axes`` it lacks."""
    missing = tuple(sorted(axes - varying_axes(core.typeof(x))))
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying")


def unspecified_sharding() -> Any:
    """JAX's marker of a ``jit`` input or output sharding left unspecified."""
    from jax._src.sharding_impls import UNSPECIFIED
    return UNSPECIFIED


# ---- functions in custom-derivative params -------------------------------------

def wrap_fun(fn: Callable, like: Any) -> Any:
    """An ``lu.WrappedFun`` of ``fn`` with the debug info of ``like``."""
    from jax._src import linear_util as lu
    return lu.wrap_init(fn, debug_info=like.debug_info)


def called_jaxpr(fun: Any) -> Any:
    """The jaxpr a custom-derivative call evaluates when the call comes from
    an equation (``lu.wrap_init(core.jaxpr_as_fun(jaxpr))``, a partial
    application); None where that jaxpr cannot be seen."""
    for arg in getattr(getattr(fun, "f", None), "args", ()):
        if isinstance(arg, JAXPR_TYPES):
            return arg
    return None


def shard_map_checks_vma(params: dict) -> bool:
    """Whether a shard_map eqn checks varying manual axes (``check_vma``);
    without it (e.g. ``jax.pmap``) types do not say what varies per shard."""
    return bool(params.get("check_vma", True))

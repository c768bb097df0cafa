"""Every difference between the supported JAX versions (0.10.x and 0.12.x).

No other module of taxpr branches on the JAX version: they call the helpers
here. The neutral form used by the rest of taxpr for a jaxpr is its parts
``(constvars, consts, invars, eqns, outvars, effects, debug_info)``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax._src import core
from jax._src.interpreters import partial_eval as pe

JAX_VERSION: tuple[int, ...] = tuple(
    int(p) for p in jax.__version__.split(".")[:3] if p.isdigit()
)

# 0.12 merged ClosedJaxpr into Jaxpr: a Jaxpr carries its consts.
MERGED_JAXPR: bool = not hasattr(core, "ClosedJaxpr")
ClosedJaxpr: type = core.Jaxpr if MERGED_JAXPR else core.ClosedJaxpr
Jaxpr: type = core.Jaxpr
Var = core.Var
Literal = core.Literal
JaxprEqn = core.JaxprEqn
JAXPR_TYPES: tuple[type, ...] = (core.Jaxpr,) if MERGED_JAXPR else (core.Jaxpr, core.ClosedJaxpr)

# closed_call: 0.10 ClosedCallPrimitive `closed_call`; 0.12 `eval_jaxpr`.
closed_call_p = core.closed_call_p


def new_var(aval: core.AbstractValue) -> core.Var:
    return core.Var(aval)


def is_jaxpr(x: Any) -> bool:
    return isinstance(x, JAXPR_TYPES)


def is_closed(j: Any) -> bool:
    """Whether ``j`` is (or, in 0.12, may stand for) a ClosedJaxpr."""
    return isinstance(j, ClosedJaxpr)


def jaxpr_parts(j: Any):
    """``(constvars, consts, invars, eqns, outvars, effects, debug_info)``.

    For an open 0.10 jaxpr with constvars, ``consts`` is None (the constvars
    are free variables supplied by the caller).
    """
    if MERGED_JAXPR:
        return (j.constvars, list(j.consts), j.invars, j.eqns, j.outvars,
                j.effects, j.debug_info)
    if isinstance(j, core.ClosedJaxpr):
        jj = j.jaxpr
        return (jj.constvars, list(j.consts), jj.invars, jj.eqns, jj.outvars,
                jj.effects, jj.debug_info)
    return (j.constvars, None if j.constvars else [], j.invars, j.eqns,
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
    if MERGED_JAXPR:
        return core.Jaxpr(list(constvars), list(invars), list(outvars), list(eqns),
                          effects, debug_info, consts=list(consts))
    jaxpr = core.Jaxpr(list(constvars), list(invars), list(outvars), list(eqns),
                       effects, debug_info)
    if isinstance(like, core.ClosedJaxpr) or like is None:
        return core.ClosedJaxpr(jaxpr, list(consts))
    assert not consts, "open jaxpr cannot carry consts"
    return jaxpr


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


def debug_info(name: str) -> Any:
    return core.DebugInfo("taxpr", name, None, None)


def open_jaxpr_kind(j: Any) -> bool:
    """True when ``j`` is an open jaxpr (no consts may be attached)."""
    if MERGED_JAXPR:
        return False
    return not isinstance(j, core.ClosedJaxpr)


# ---- scan --------------------------------------------------------------------

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


# ---- dead-code elimination rules ---------------------------------------------

def register_dce_rule(prim: core.Primitive,
                      rule: Callable[[list[bool], core.JaxprEqn], tuple[list[bool], Any]]):
    """Register ``rule(used_outputs, eqn)`` with either DCE-rule arity."""
    if JAX_VERSION >= (0, 11):
        pe.dce_rules[prim] = lambda used_outs, live_ins, eqn: rule(used_outs, eqn)
    else:
        pe.dce_rules[prim] = rule


def dce_jaxpr(jaxpr: core.Jaxpr, used_outputs, instantiate=False):
    return pe.dce_jaxpr(jaxpr, used_outputs, instantiate)


def pp_eqn_rules() -> dict:
    return core.pp_eqn_rules


def jaxpr_as_fun(j):
    from jax.extend.core import jaxpr_as_fun as f
    return f(j)


def abstractify(x: Any) -> core.AbstractValue:
    """The ShapedArray of a value (weak type kept) or of a ShapeDtypeStruct."""
    if isinstance(x, core.AbstractValue):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return core.ShapedArray(x.shape, x.dtype, weak_type=bool(getattr(x, "weak_type", False)))
    return core.shaped_abstractify(x)


def trace_flat(fn: Callable, avals: Sequence[core.AbstractValue], name: str = "taxpr"):
    """Trace ``fn(*flat) -> list`` at ``avals`` (kept exactly, e.g. the
    varying manual axes inside shard_map) into a closed jaxpr."""
    from jax._src import linear_util as lu
    wrapped = lu.wrap_init(lambda *a: list(fn(*a)), debug_info=debug_info(name))
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(wrapped, list(avals))
    if MERGED_JAXPR:
        all_in = jaxpr.all_invars
        constvars, invars = all_in[:len(consts)], all_in[len(consts):]
    else:
        constvars, invars = jaxpr.constvars, jaxpr.invars
    return make_closed(constvars, consts, invars, jaxpr.eqns, jaxpr.outvars,
                       jaxpr.effects, jaxpr.debug_info)


def shard_map_body_context(params: dict):
    """The tracing context of a shard_map body (manual axes, abstract mesh,
    vma checking), so code traced for the body gets the body's types."""
    import contextlib
    from jax._src import config, shard_map as sm
    from jax._src.mesh import use_abstract_mesh
    mesh, axes = params["mesh"], params.get("newly_manual_axes", frozenset())
    stack = contextlib.ExitStack()
    stack.enter_context(sm._extend_axis_env(mesh, axes))
    stack.enter_context(use_abstract_mesh(sm._as_manual_mesh(mesh, axes)))
    stack.enter_context(config._check_vma(params.get("check_vma", True)))
    return stack


def varying_axes(aval: Any) -> frozenset:
    """The manual mesh axes over which a value inside shard_map varies."""
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", ()) or ())


def used_invars(closed: Any) -> list[bool]:
    """Which of a closed jaxpr's (non-const) inputs its outputs depend on."""
    constvars, consts, invars, eqns, outvars, effects, dbg = jaxpr_parts(closed)
    open_j = core.Jaxpr([], [*constvars, *invars], outvars, eqns, effects, dbg)
    _, used = pe.dce_jaxpr(open_j, [True] * len(outvars))
    return list(used[len(constvars):])


def unspecified_sharding() -> Any:
    from jax._src.sharding_impls import UNSPECIFIED
    return UNSPECIFIED


def open_with_constvars(closed: Any) -> tuple[Any, list]:
    """``(jaxpr, consts)`` as ``core.eval_jaxpr(jaxpr, consts, *args)`` takes them."""
    constvars, consts, invars, eqns, outvars, effects, dbg = jaxpr_parts(closed)
    dbg = _fit_debug_info(dbg, len(constvars) + len(invars) if MERGED_JAXPR else len(invars),
                          len(outvars))
    return core.Jaxpr(constvars, invars, outvars, eqns, effects, dbg), list(consts)


def wrap_fun(fn: Callable, like: Any) -> Any:
    """An ``lu.WrappedFun`` of ``fn`` with the debug info of ``like``."""
    from jax._src import linear_util as lu
    return lu.wrap_init(fn, debug_info=like.debug_info)


def call_custom_vjp_bwd(bwd: Any, args: Sequence[Any]) -> tuple[list, Any]:
    """Call a custom_vjp eqn's flat ``bwd``: ``(cts_in, logs)`` (0.10: no logs)."""
    out = bwd.call_wrapped(*args)
    if JAX_VERSION >= (0, 11):
        cts, logs = out
        return list(cts), logs
    return list(out), None


def custom_vjp_bwd_result(cts: list, logs: Any) -> Any:
    return (cts, logs) if JAX_VERSION >= (0, 11) else cts


def match_varying(x: Any, axes: frozenset) -> Any:
    """Mark ``x`` (inside shard_map) as varying over ``axes`` it lacks."""
    missing = tuple(sorted(axes - varying_axes(core.typeof(x))))
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying")


def cast_weak_type(x: Any, aval: core.AbstractValue) -> Any:
    """``x`` with ``aval``'s weak type (same dtype), so types stay exact."""
    xa = core.typeof(x) if isinstance(x, core.Tracer) else core.shaped_abstractify(x)
    if (getattr(xa, "weak_type", False) == getattr(aval, "weak_type", False)
            or xa.dtype != aval.dtype or xa.shape != aval.shape):
        return x  # equal already, or a real mismatch the caller reports
    from jax._src.lax import lax as lax_internal
    return lax_internal._convert_element_type(x, aval.dtype, weak_type=aval.weak_type)


def dce_closed(closed: Any, used_outputs: Sequence[bool]) -> Any:
    """``closed`` with only the used outputs and the equations they need
    (nested jaxprs pruned by JAX's own DCE rules); inputs are all kept."""
    constvars, consts, invars, eqns, outvars, effects, dbg = jaxpr_parts(closed)
    open_j = core.Jaxpr([], [*constvars, *invars], outvars, eqns, effects,
                        _fit_debug_info(dbg, len(constvars) + len(invars), len(outvars)))
    new, _ = pe.dce_jaxpr(open_j, list(used_outputs), instantiate=True)
    nc = len(constvars)
    return make_closed(new.invars[:nc], consts, new.invars[nc:], new.eqns, new.outvars,
                       new.effects, dbg)


def register_linearization(prim, primal_fn: Callable, tangent_fn: Callable) -> None:
    """A direct linearization rule: ``primal_fn(*primals, **params)`` gives
    the primal outputs and ``tangent_fn(primals, tangents, **params)`` the
    tangents (residuals are the primals)."""
    from jax._src.interpreters import ad

    def lin(is_vjp, nzs, *primals, **params):
        out = primal_fn(*primals, **params)
        nzs_out = [any(nzs)] * len(out)

        def linearized(residuals, *rest):
            tangents = rest[1:] if JAX_VERSION >= (0, 11) else rest
            return tangent_fn(residuals, tangents, nzs, **params)

        if JAX_VERSION >= (0, 11):
            return out, nzs_out, list(primals), None, linearized
        return out, nzs_out, list(primals), linearized

    ad.primitive_linearizations[prim] = lin


# ---- taxpr flags that JAX's trace caches key on --------------------------------

def trace_context_flag(name: str, help: str) -> Any:
    """A thread-local boolean flag that is part of JAX's trace context.

    JAX caches traces (jit's jaxpr, the bodies of scan/while/cond, checkpoint,
    custom_jvp/custom_vjp) by function identity and ``config.trace_context()``;
    a flag that changes what tracing produces must be in that key, or a trace
    made with the flag off is reused with it on. Returns an object ``flag``
    with ``flag.value`` and ``with flag(True): ...``.
    """
    import inspect
    from jax._src import config
    if name in getattr(config, "config_states", {}):
        return config.config_states[name]  # module reloaded: reuse the registered flag
    if "include_in_trace_context" not in inspect.signature(config.bool_state).parameters:
        raise ImportError("taxpr: this JAX has no trace-context config flags "
                          "(config.bool_state(include_in_trace_context=...))")
    return config.bool_state(name, False, help, include_in_trace_context=True)

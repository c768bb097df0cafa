"""Every difference between the supported JAX versions (0.10.x to 0.12.x).

No other module of taxpr knows about JAX versions: they call the helpers
here, or the jaxpr building blocks of ``_jaxpr`` (which use the features
detected here). Each difference is decided by detecting the feature itself (a class or
attribute that exists, the arity of JAX's own registered rules), never by
comparing version numbers, so that a release in the range, or the next one
where nothing relevant changed, works without a code change.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Sequence

import jax
from jax._src import core
from jax._src import custom_derivatives as _custom_derivatives
from jax._src import config as _config
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as pe

# Higher-order primitives taxpr has threading rules for: the same modules
# define them in every supported JAX.
from jax._src.ad_checkpoint import remat_p as remat_p
from jax._src.custom_derivatives import (
    custom_jvp_call_p as custom_jvp_call_p,
    custom_vjp_call_p as custom_vjp_call_p,
)
from jax._src.lax.control_flow.conditionals import cond_p as cond_p
from jax._src.lax.control_flow.loops import scan_p as scan_p, while_p as while_p
from jax._src.lax.eval_jaxpr import eval_jaxpr_p
from jax._src.pjit import jit_p as jit_p
from jax._src.shard_map import shard_map_p as shard_map_p
# Expanded into its implementation when it holds tags (see taxpr._expand); its
# batching rule is a user's, not vmap of that implementation.
from jax._src.custom_batching import custom_vmap_p as custom_vmap_p

# ---- jaxpr objects -------------------------------------------------------------

# 0.11 merged ClosedJaxpr into Jaxpr: a Jaxpr carries its consts.
MERGED_JAXPR: bool = not hasattr(core, "ClosedJaxpr")
ClosedJaxpr: type = core.Jaxpr if MERGED_JAXPR else core.ClosedJaxpr
Jaxpr: type = core.Jaxpr
Var = core.Var
Literal = core.Literal
JaxprEqn = core.JaxprEqn
JAXPR_TYPES: tuple[type, ...] = (core.Jaxpr,) if MERGED_JAXPR else (core.Jaxpr, core.ClosedJaxpr)


# ---- higher-order primitives ---------------------------------------------------
# closed_call: 0.10 has two call primitives taking ``call_jaxpr`` (core's
# ``closed_call`` and lax's ``eval_jaxpr``); from 0.11 they are one object.
closed_call_p = core.closed_call_p
CLOSED_CALL_PRIMITIVES: tuple[core.Primitive, ...] = tuple(
    {id(p): p for p in (core.closed_call_p, eval_jaxpr_p)}.values())
# Primitives that call their sub-jaxpr once with their operands (in order).
CALL_PRIMITIVES: frozenset[core.Primitive] = frozenset(
    p for p in (jit_p, *CLOSED_CALL_PRIMITIVES, getattr(core, "call_p", None), remat_p,
                custom_jvp_call_p, custom_vjp_call_p,
                getattr(_custom_derivatives, "custom_vjp_call_jaxpr_p", None))
    if p is not None)

# High-level primitives (``call_hi_primitive``: one equation whose param is an
# object holding jaxprs and ``Traced`` functions), where JAX has them.
try:
    from jax._src import hijax as _hijax
    call_hi_primitive_p: Any = _hijax.call_hi_primitive_p
except (ImportError, AttributeError):
    _hijax, call_hi_primitive_p = None, None
# The operation objects' base classes (``HiPrim``; earlier ``VJPHiPrimitive``).
HI_PRIM_TYPE: tuple[type, ...] = tuple(
    getattr(_hijax, name) for name in ("HiPrim", "VJPHiPrimitive")
    if _hijax is not None and isinstance(getattr(_hijax, name, None), type))
try:
    from jax._src.stages import Traced as _Traced
    TRACED_TYPE: type | None = _Traced if hasattr(_Traced, "jaxpr") else None
except ImportError:
    TRACED_TYPE = None


# ---- dead-code elimination rules ---------------------------------------------

def _positional_arity(fn: Callable) -> int:
    params = inspect.signature(fn).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


# DCE rules: 0.10/0.11 call ``rule(used_outs, eqn)``, 0.12 ``rule(used_outs,
# live_ins, eqn)``. JAX's own rule for closed_call follows the calling
# convention of the JAX it ships with, so its arity tells which one is used.
_DCE_RULE_ARITY: int = _positional_arity(pe.dce_rules[core.closed_call_p])
if _DCE_RULE_ARITY not in (2, 3):
    raise ImportError(
        f"taxpr: JAX {jax.__version__}'s dead-code-elimination rules take "
        f"{_DCE_RULE_ARITY} arguments; taxpr knows rules of 2 (used_outputs, eqn) "
        f"or 3 (used_outputs, live_inputs, eqn)")
DCE_RULES_TAKE_LIVE_INPUTS: bool = _DCE_RULE_ARITY == 3


def _dce_rule_arity_adapter(rule: Callable[[list[bool], core.JaxprEqn], tuple[list[bool], Any]]
                            ) -> Callable:
    """``rule(used_outputs, eqn)`` under JAX's DCE-rule convention."""
    if DCE_RULES_TAKE_LIVE_INPUTS:
        return lambda used_outs, live_ins, eqn: rule(used_outs, eqn)
    return rule


def register_dce_rule(prim: core.Primitive,
                      rule: Callable[[list[bool], core.JaxprEqn], tuple[list[bool], Any]]):
    """Register ``rule(used_outputs, eqn)`` under JAX's DCE-rule convention."""
    pe.dce_rules[prim] = _dce_rule_arity_adapter(rule)


# The rematerialization of ``jax_remat3`` (``jax._src.interpreters.remat``, where
# JAX has it) takes per-primitive rules. Their convention differs: a rule gets
# ``(policy, *args)`` or ``(trace, *args)`` and returns ``(outputs, recompute)``,
# ``recompute(*args)`` running in the backward pass; where the trace asks for
# ``(outputs, residuals, recompute)``, ``recompute(residuals, *args)``.
try:
    from jax._src.interpreters import remat as _remat
    _REMAT_RULES: dict | None = _remat.rules
    _REMAT_RULES_RETURN_RESIDUALS: bool = "res, rem = rules[prim]" in inspect.getsource(
        _remat.RematTrace.process_primitive)
except (ImportError, AttributeError, OSError, TypeError):
    _REMAT_RULES, _REMAT_RULES_RETURN_RESIDUALS = None, False


def register_remat_rule(prim: core.Primitive, rule: Callable[..., tuple[Any, Any]]) -> None:
    """Register ``rule(*args, **params) -> (outputs, recompute)`` as
    ``prim``'s rematerialization rule where JAX has the table: it binds
    ``prim`` in the forward pass; the backward pass computes the outputs
    again with ``recompute(saved_outputs, *args)``, or, where ``recompute``
    is None, by binding ``prim`` again."""
    if _REMAT_RULES is None:
        return

    def again(outs, recompute, params):
        if recompute is None:
            return lambda *args_: prim.bind(*args_, **params)
        return lambda *args_: recompute(outs, *args_)

    if _REMAT_RULES_RETURN_RESIDUALS:
        def adapted(_trace, *args, **params):
            outs, recompute = rule(*args, **params)
            if recompute is None:
                return outs, (), lambda _, *args_: prim.bind(*args_, **params)
            return outs, outs, lambda res, *args_: recompute(res, *args_)
    else:
        def adapted(_trace_or_policy, *args, **params):
            outs, recompute = rule(*args, **params)
            # closed over: the recomputation's jaxpr takes the outputs as residuals
            return outs, again(outs, recompute, params)
    _REMAT_RULES[prim] = adapted


def pp_eqn_rules() -> dict:
    return core.pp_eqn_rules


def abstractify(x: Any) -> core.AbstractValue:
    """The ShapedArray of a value (weak type kept) or of a ShapeDtypeStruct."""
    if isinstance(x, core.AbstractValue):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return core.ShapedArray(x.shape, x.dtype, weak_type=bool(getattr(x, "weak_type", False)))
    return core.shaped_abstractify(x)


def explicit_sharding(aval: Any) -> tuple | None:
    """How ``aval``'s type shards it over Explicit mesh axes (JAX's sharding
    in types, ``float32[8@x]``): its PartitionSpec, one entry per axis; None
    where its mesh has no Explicit axis (or JAX has no sharding in types),
    where every type agrees."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if axis_type is None or not any(t == axis_type.Explicit
                                    for t in getattr(mesh, "axis_types", ())):
        return None
    spec = tuple(sharding.spec)
    return spec + (None,) * (len(aval.shape) - len(spec))


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


def unspecified_sharding() -> Any:
    from jax._src.sharding_impls import UNSPECIFIED
    return UNSPECIFIED


def trace_custom_vjp_fwd(eqn: core.JaxprEqn) -> Any:
    """The fwd jaxpr of a ``custom_vjp_call`` equation, as differentiating it
    w.r.t. every input would trace it; or w.r.t. none, where that raises
    JAX's ``CustomVJPException`` (a fwd lifted by ``vmap`` refuses nonzero
    tangents for the values it closes over). Either way it runs the user's
    fwd, which is what callers look into."""
    n = len(eqn.invars) - eqn.params["num_consts"]
    thunk = eqn.params["fwd_jaxpr_thunk"]
    try:
        return thunk.call_wrapped(*([True] * n))[0]
    except _ad.CustomVJPException:
        return thunk.call_wrapped(*([False] * n))[0]


def wrap_fun(fn: Callable, like: Any) -> Any:
    """An ``lu.WrappedFun`` of ``fn`` with the debug info of ``like``."""
    from jax._src import linear_util as lu
    return lu.wrap_init(fn, debug_info=like.debug_info)


# custom_vjp backward-pass logs (``custom_vjp.defvjp_with_logs``, 0.11+): with
# them, the flat ``bwd`` of a custom_vjp_call eqn returns ``(cts, logs)``
# instead of ``cts``.
CUSTOM_VJP_BWD_RETURNS_LOGS: bool = hasattr(_custom_derivatives.custom_vjp, "defvjp_with_logs")


def call_custom_vjp_bwd(bwd: Any, args: Sequence[Any]) -> tuple[list, Any]:
    """Call a custom_vjp eqn's flat ``bwd``: ``(cts_in, logs)`` (logs None
    where JAX has none)."""
    out = bwd.call_wrapped(*args)
    if CUSTOM_VJP_BWD_RETURNS_LOGS:
        cts, logs = out
        return list(cts), logs
    return list(out), None


def custom_vjp_bwd_result(cts: list, logs: Any) -> Any:
    """What a flat ``bwd`` returns, from ``call_custom_vjp_bwd``'s parts."""
    return (cts, logs) if CUSTOM_VJP_BWD_RETURNS_LOGS else cts


def match_varying(x: Any, axes: frozenset) -> Any:
    """Mark ``x`` (inside shard_map) as varying over ``axes`` it lacks."""
    missing = tuple(sorted(axes - varying_axes(core.typeof(x))))
    if not missing:
        return x
    return jax.lax.pcast(x, missing, to="varying")


def enclosing_traces() -> list:
    """The trace JAX binds into now and the traces enclosing it (following
    ``parent_trace``), innermost first; empty when evaluating eagerly."""
    chain = []
    trace = core.trace_ctx.trace
    while trace is not None and not isinstance(trace, core.EvalTrace):
        chain.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return chain


def outermost_trace() -> Any | None:
    """The outermost trace enclosing the one JAX binds into now (e.g. the
    ``make_jaxpr`` trace around a scan body's trace, a vmap's or jvp's
    trace), following ``parent_trace``; None when evaluating eagerly."""
    traces = enclosing_traces()
    return traces[-1] if traces else None


def cast_weak_type(x: Any, aval: core.AbstractValue) -> Any:
    """``x`` with ``aval``'s weak type (same dtype), so types stay exact."""
    xa = core.typeof(x) if isinstance(x, core.Tracer) else core.shaped_abstractify(x)
    if (getattr(xa, "weak_type", False) == getattr(aval, "weak_type", False)
            or xa.dtype != aval.dtype or xa.shape != aval.shape):
        return x  # equal already, or a real mismatch the caller reports
    from jax._src.lax import lax as lax_internal
    return lax_internal._convert_element_type(x, aval.dtype, weak_type=aval.weak_type)


# Linearization rules: where ``LinearizeTrace`` collects structured residuals
# (0.11+), a rule returns ``(out, nzs_out, residuals, structured_residuals,
# linearized)`` and ``linearized(residuals, structured_binders, *tangents)``
# is called; before, ``(out, nzs_out, residuals, linearized)`` and
# ``linearized(residuals, *tangents)``. The trace declares the attribute as a
# class annotation, which is the presence test.
LINEARIZE_STRUCTURED_RESIDUALS: bool = (
    "structured_residuals" in inspect.get_annotations(_ad.LinearizeTrace))


def register_linearization(prim, primal_fn: Callable, tangent_fn: Callable) -> None:
    """A direct linearization rule: ``primal_fn(*primals, **params)`` gives
    the primal outputs and ``tangent_fn(primals, tangents, nzs, **params)``
    the tangents (residuals are the primals)."""

    def lin(is_vjp, nzs, *primals, **params):
        out = primal_fn(*primals, **params)
        nzs_out = [any(nzs)] * len(out)

        def linearized(residuals, *rest):
            tangents = rest[1:] if LINEARIZE_STRUCTURED_RESIDUALS else rest
            return tangent_fn(residuals, tangents, nzs, **params)

        if LINEARIZE_STRUCTURED_RESIDUALS:
            return out, nzs_out, list(primals), None, linearized
        return out, nzs_out, list(primals), linearized

    _ad.primitive_linearizations[prim] = lin


# ---- batching rules of control flow (vmap with a batched predicate) -----------

def control_flow_primitives() -> tuple[Any, Any]:
    """``(cond_p, while_p)``."""
    return cond_p, while_p


try:
    from jax._src.linear_util import WrappedFun as WRAPPED_FUN_TYPE
except ImportError:  # pragma: no cover
    WRAPPED_FUN_TYPE = type(None)


def called_jaxpr(fun: Any) -> Any:
    """The jaxpr a custom-derivative call evaluates when the call comes from
    an equation (``lu.wrap_init(core.jaxpr_as_fun(jaxpr))``, a partial
    application); None where that jaxpr cannot be seen."""
    for arg in getattr(getattr(fun, "f", None), "args", ()):
        if isinstance(arg, JAXPR_TYPES):
            return arg
    return None


def batch_closed_jaxpr(closed: Any, axis_data: Any, in_axes: Sequence[Any],
                       out_axes: Sequence[Any]) -> Any:
    """``closed`` batched by ``axis_data`` (in/out batch axes, None unbatched)."""
    from jax._src.interpreters import batching
    return batching.batch_jaxpr_axes(closed, axis_data, list(in_axes), list(out_axes))[0]


def batched_outputs(closed: Any, axis_data: Any, in_batched: Sequence[bool],
                    instantiate: Any) -> list[bool]:
    """Which outputs of ``closed`` are batched given which inputs are."""
    from jax._src.interpreters import batching
    return list(batching.batch_jaxpr(closed, axis_data, list(in_batched), instantiate)[1])


def batch_at_front(x: Any, dim: Any, axis_data: Any) -> Any:
    """``x`` with its batch axis first (broadcast when unbatched)."""
    from jax._src.interpreters import batching
    return batching.bdim_at_front(x, dim, axis_data.size)


def shard_map_checks_vma(params: dict) -> bool:
    """Whether a shard_map eqn checks varying manual axes (``check_vma``);
    without it (e.g. ``jax.pmap``) types do not say what varies per shard."""
    for key in ("check_vma", "check_rep"):
        if key in params:
            return bool(params[key])
    return True


# ---- taxpr.ir ------------------------------------------------------------------

@contextlib.contextmanager
def _dce_rules_replaced(prims: Sequence[core.Primitive],
                        make_rule: Callable[[Callable | None], Callable]):
    """``pe.dce_rules[p] = make_rule(previous rule or None)`` for each of
    ``prims`` while in the block (the previous rules restored on exit)."""
    saved = {p: pe.dce_rules.get(p) for p in prims}
    for p, old in saved.items():
        pe.dce_rules[p] = make_rule(old)
    try:
        yield
    finally:
        for p, rule in saved.items():
            if rule is None:
                pe.dce_rules.pop(p, None)
            else:
                pe.dce_rules[p] = rule


def keep_in_dce(prims: Sequence[core.Primitive]):
    """A context in which ``pe.dce_jaxpr`` keeps every equation of ``prims``
    (their previous DCE rules are restored on exit)."""
    keep_all = _dce_rule_arity_adapter(lambda used_outputs, eqn: ([True] * len(eqn.invars), eqn))
    return _dce_rules_replaced(prims, lambda old: keep_all)


def clear_dce_caches() -> None:
    """Empty JAX's caches of DCE results (``_dce_jaxpr`` and, where they
    exist, the closed-call and jit DCE caches: JAX 0.10's jit rule caches
    its callee's DCE per jaxpr, so a result made while jitting, with JAX's
    rules, would be reused under taxpr's)."""
    from jax._src import pjit
    for module, name in ((pe, "_dce_jaxpr"), (pe, "_cached_closed_call_dce"),
                         (pjit, "_dce_jaxpr_pjit")):
        clear = getattr(getattr(module, name, None), "cache_clear", None)
        if clear is not None:
            clear()


@contextlib.contextmanager
def keep_unused_in_dce(prims, keep: Callable[[core.JaxprEqn], bool]):
    """A context in which ``pe.dce_jaxpr`` keeps, whole, an equation of
    ``prims`` whose outputs are all unused when ``keep(eqn)`` (e.g. a cond
    holding tags, which JAX's rule would drop since tags have no effect)."""
    def make_rule(old):
        base = old or pe._default_dce_rule

        def rule(*args):
            used_outs, eqn = args[0], args[-1]
            if not any(used_outs) and keep(eqn):
                return [True] * len(eqn.invars), eqn
            return base(*args)
        return rule

    # JAX caches DCE results per jaxpr: results made with other rules (e.g.
    # while jitting) must not be reused here, nor ours later.
    clear_dce_caches()
    try:
        with _dce_rules_replaced(prims, make_rule):
            yield
    finally:
        clear_dce_caches()


_EXTENDED_DTYPE: dict = {}


def is_plain_array_aval(aval: Any) -> bool:
    """A ShapedArray of a numeric/bool dtype that a Literal or a const can
    stand for: no extended dtype (PRNG keys), no ref, no mesh sharding and
    no varying manual axes (inside shard_map)."""
    if type(aval) is not core.ShapedArray:
        return False
    extended = _EXTENDED_DTYPE.get(aval.dtype)
    if extended is None:
        extended = _EXTENDED_DTYPE[aval.dtype] = bool(
            jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended))
    if extended:
        return False
    if varying_axes(aval):
        return False
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not getattr(mesh, "empty", True):
        return False
    return True


def has_aval_sharding_param(params: dict) -> bool:
    """Whether an equation's params pin a sharding/device (never folded)."""
    for key in ("sharding", "devices", "out_sharding"):
        v = params.get(key)
        if v is not None and not (isinstance(v, (tuple, list)) and all(x is None for x in v)):
            return True
    return False


def is_jit(eqn: core.JaxprEqn) -> bool:
    return eqn.primitive is jit_p


def jit_inlining_loses_nothing(params: dict) -> bool:
    """Whether a jit equation's params ask for nothing but the call itself:
    no shardings, layouts, donation or compiler options that inlining its
    body would drop."""
    from jax._src.sharding_impls import UnspecifiedValue

    def unspecified(xs):
        return all(isinstance(s, UnspecifiedValue) or s is None for s in xs)

    return (unspecified(params.get("in_shardings", ()))
            and unspecified(params.get("out_shardings", ()))
            and all(x is None for x in params.get("in_layouts", ()))
            and all(x is None for x in params.get("out_layouts", ()))
            and not any(params.get("donated_invars", ()))
            and not params.get("compiler_options_kvs"))


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


def trace_context_string(name: str, help: str) -> Any:
    """A thread-local optional string that is part of JAX's trace context
    (see ``trace_context_flag``): ``state.value`` (None by default) and
    ``with state(value): ...``."""
    from jax._src import config
    if name in getattr(config, "config_states", {}):
        return config.config_states[name]
    return config.optional_string_state(name, None, help, include_in_trace_context=True)


def wrapped_fun_in(fun: Any, context: Callable[[], Any]) -> Any:
    """``fun`` (a ``lu.WrappedFun``) that runs inside ``with context():``."""
    from jax._src import linear_util as lu
    with_accums = getattr(_ad, "CustomBwdWithAccums", None)
    if with_accums is not None and not fun.transforms and isinstance(fun.f, with_accums):
        # JAX calls such a bwd's ``call_with_accums`` directly (no transforms).
        inner = fun.f

        class InContext(with_accums):
            def call_with_accums(self, *args):
                with context():
                    return inner.call_with_accums(*args)

            def __call__(self, *args):
                with context():
                    return inner(*args)

        f = InContext()
        return lu.WrappedFun(f, f, (), (), fun.params, fun.in_type, fun.debug_info)

    def in_context(f, *args, **kwargs):
        with context():
            return f(*args, **kwargs)

    return fun.wrap(in_context, (), None)


# ---- random keys (taxpr._random) -----------------------------------------------

def register_axis_batcher(prim: Any, rule: Callable) -> None:
    """Register ``rule(axis_data, args, dims, **params) -> (out, out_dim)`` as
    ``prim``'s batching rule. JAX calls such an axis-data rule for every
    equation a vmap traces, also when no operand is batched (a plain rule is
    skipped then), which is what lets ``next_key`` see that it runs under a
    vmap whose examples would otherwise share its key."""
    from jax._src.interpreters import batching
    if not hasattr(batching, "fancy_primitive_batchers"):
        raise NotImplementedError(  # a JAX without axis-data batching rules
            f"taxpr: cannot register an axis-data batching rule for {prim}")
    batching.fancy_primitive_batchers[prim] = rule


def axis_has_name(axis_data: Any) -> bool:
    """Whether a vmap axis has a name (``vmap(..., axis_name=...)``)."""
    return axis_data.name is not core.no_axis_name


def manual_mesh_axes() -> tuple:
    """The mesh axes that are manual where code is being traced (inside a
    ``shard_map`` / ``pmap`` body), in the mesh's order; ``()`` elsewhere."""
    from jax.sharding import get_abstract_mesh
    mesh = get_abstract_mesh()
    manual = frozenset(getattr(mesh, "manual_axes", ()) or ())
    if not manual:
        return ()
    return tuple(a for a in mesh.axis_names if a in manual)


def is_jacfwd_axis(axis_data: Any) -> bool:
    """Whether the vmap axis ``axis_data`` is the one ``jax.jacfwd`` (and so
    ``jax.hessian``) maps over its tangent basis, or ``jax.jacrev`` over its
    cotangent basis (a checkpoint recomputes the primal there): the primal
    computation is the same for every element of that axis, so one key for
    all of them is right. Decided from the Python stack (the frame of JAX's batching that
    made the vmap's trace for this very ``axis_data``, called from
    ``jacfwd``'s / ``jacrev``'s inner function);
    when the stack does not show it, the answer is False (the caller then
    raises its error rather than share a key silently)."""
    import sys
    frame = sys._getframe(1)
    seen_axis = False  # passed the frame that made the vmap's BatchTrace
    while frame is not None:
        if not seen_axis:
            seen_axis = (frame.f_code.co_name == "_batch_inner"
                         and frame.f_locals.get("axis_data") is axis_data)
        elif frame.f_code.co_name == "vmap_f":
            caller = frame.f_back
            while caller is not None and caller.f_globals.get("__name__") == \
                    "jax._src.traceback_util":  # vmap_f's api_boundary wrapper
                caller = caller.f_back
            return (caller is not None and caller.f_code.co_name == "jacfun"
                    and caller.f_globals.get("__name__") == "jax._src.api")
        frame = frame.f_back
    return False


def eager_constant_folding() -> bool:
    """Whether traces evaluate primitives of constants at once
    (``jax.ensure_compile_time_eval()``)."""
    flag = getattr(_config, "eager_constant_folding", None)
    return bool(flag is not None and flag.value)


def no_eager_constant_folding() -> Any:
    """A context in which traces stage primitives of constants again."""
    return _config.eager_constant_folding(False)

"""Feature detection and version adapters for the supported JAX (0.10.x to 0.12.x).

Only what depends on the installed JAX is here: flags saying which
behaviour it has, thin adapters whose body depends on them, and aliases of
JAX's primitives and objects whose location differs between versions.
Helpers that are the same on every supported JAX live with the modules that
use them (the jaxpr and aval building blocks in ``_jaxpr``). Each difference is
decided by detecting the feature itself (a class or attribute that exists,
the arity of JAX's own registered rules), never by comparing version
numbers, so that a release in the range, or the next one where nothing
relevant changed, works without a code change.
"""

from __future__ import annotations

import contextlib
import inspect
import os
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
# The identity on values that marks a value as varying across a shard_map's
# shards (a type, for check_vma): None where JAX has no such primitive.
pvary_p: core.Primitive | None = getattr(core, "pvary_p", None)


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
# The calls of a function with custom derivative rules.
CUSTOM_CALL_PRIMITIVES: frozenset[core.Primitive] = frozenset(
    p for p in (custom_jvp_call_p, custom_vjp_call_p,
                getattr(_custom_derivatives, "custom_vjp_call_jaxpr_p", None))
    if p is not None)
# Primitives that call their sub-jaxpr once with their operands (in order).
CALL_PRIMITIVES: frozenset[core.Primitive] = frozenset(
    p for p in (jit_p, *CLOSED_CALL_PRIMITIVES, getattr(core, "call_p", None), remat_p)
    if p is not None) | CUSTOM_CALL_PRIMITIVES
# Higher-order primitives whose bind takes closed jaxprs as params and
# keeps or copies them (re-evaluating their equation binds none of theirs).
REEVALUATED_HIGHER_ORDER: frozenset[core.Primitive] = frozenset(
    (jit_p, scan_p, while_p, cond_p, *CLOSED_CALL_PRIMITIVES))

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

# The functions a custom-derivative call's params hold (``lu.WrappedFun``).
try:
    from jax._src.linear_util import WrappedFun as WRAPPED_FUN_TYPE
except ImportError:  # pragma: no cover
    WRAPPED_FUN_TYPE = type(None)


# ---- dead-code elimination rules -----------------------------------------------

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


def dce_rule_arity_adapter(rule: Callable[[list[bool], core.JaxprEqn], tuple[list[bool], Any]]
                           ) -> Callable:
    """``rule(used_outputs, eqn)`` under JAX's DCE-rule convention."""
    if DCE_RULES_TAKE_LIVE_INPUTS:
        return lambda used_outs, live_ins, eqn: rule(used_outs, eqn)
    return rule


def register_dce_rule(prim: core.Primitive,
                      rule: Callable[[list[bool], core.JaxprEqn], tuple[list[bool], Any]]):
    """Register ``rule(used_outputs, eqn)`` under JAX's DCE-rule convention."""
    pe.dce_rules[prim] = dce_rule_arity_adapter(rule)


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


# ---- rematerialization rules ---------------------------------------------------

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


# ---- custom derivatives --------------------------------------------------------

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


# ---- linearization rules -------------------------------------------------------

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


# ---- batching rules ------------------------------------------------------------

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


# ---- sharding ------------------------------------------------------------------

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


# ---- flags that JAX's trace caches key on --------------------------------------

def trace_context_flag(name: str, help: str) -> Any:
    """A thread-local boolean flag that is part of JAX's trace context.

    JAX caches traces (jit's jaxpr, the bodies of scan/while/cond, checkpoint,
    custom_jvp/custom_vjp) by function identity and ``config.trace_context()``;
    a flag that changes what tracing produces must be in that key, or a trace
    made with the flag off is reused with it on. Returns an object ``flag``
    with ``flag.value`` and ``with flag(True): ...``.
    """
    if name in getattr(_config, "config_states", {}):
        return _config.config_states[name]  # module reloaded: reuse the registered flag
    if "include_in_trace_context" not in inspect.signature(_config.bool_state).parameters:
        raise ImportError("taxpr: this JAX has no trace-context config flags "
                          "(config.bool_state(include_in_trace_context=...))")
    return _config.bool_state(name, False, help, include_in_trace_context=True)


def eager_constant_folding() -> bool:
    """Whether traces evaluate primitives of constants at once
    (``jax.ensure_compile_time_eval()``)."""
    flag = getattr(_config, "eager_constant_folding", None)
    return bool(flag is not None and flag.value)


# ---- source locations --------------------------------------------------------

_TAXPR_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


@contextlib.contextmanager
def own_source_info():
    """Equations traced in the block get their own tracebacks, not those of
    a transformation running around them (JAX's backward pass gives every
    equation it traces the traceback of the one it transposes)."""
    from jax._src import source_info_util
    context = source_info_util._source_info_context
    previous = context.context
    context.context = source_info_util.new_source_info()
    try:
        yield
    finally:
        context.context = previous


def traceback_codes(traceback: Any) -> tuple:
    """The code objects of the frames of a traced equation's traceback
    (innermost first): which Python functions were running when it was
    bound."""
    return tuple(traceback.raw_frames()[0]) if traceback is not None else ()


# The code of ``jax.core.eval_jaxpr``: a bind called from it re-evaluates a
# recorded equation (and carries that equation's traceback).
EVAL_JAXPR_CODE = core.eval_jaxpr.__code__


def recorded_traceback() -> Any:
    """The traceback JAX gives equations bound now when it is a recorded
    one (``jax.core.eval_jaxpr`` and the backward pass bind each equation
    with the traceback it was traced with), else None (a bind from Python
    gets a traceback of its own)."""
    from jax._src import source_info_util
    return source_info_util._source_info_context.context.traceback


def stack_key(traceback: Any) -> tuple | None:
    """``((file, line), ...)`` of every frame of a traceback, innermost
    first, or None: the program point an equation was traced at, the same
    for every equation re-evaluated from it."""
    if traceback is None:
        return None
    return tuple((f.file_name, f.line_num) for f in traceback.frames)


def user_frame_key(traceback: Any) -> tuple[str, int] | None:
    """``(file, line)`` of the innermost frame of a traceback that is
    neither JAX's nor taxpr's, or None: where a user's code bound it."""
    from jax._src import source_info_util
    for frame in source_info_util.user_frames(traceback):
        if not frame.file_name.startswith(_TAXPR_DIR):
            return frame.file_name, frame.start_line
    return None


def user_line(traceback: Any) -> str | None:
    """``"model.py:12, in Block.__call__"``: the innermost frame of a traced
    equation's traceback that is neither JAX's nor taxpr's, or None."""
    from jax._src import source_info_util
    for frame in source_info_util.user_frames(traceback):
        if not frame.file_name.startswith(_TAXPR_DIR):
            return (f"{os.path.basename(frame.file_name)}:{frame.start_line}, "
                    f"in {frame.function_name}")
    return None

"""Rules writing ``lax`` primitives as the calls of their public functions
(see ``FunctionWriter.rules``): elementwise operations (``lax.add(a, b)``),
structural ones with their params as keywords (``lax.broadcast_in_dim``,
``lax.dot_general``, ``lax.gather``, reductions, ...), sorts, iotas,
dynamic slices, scatters, ``lax.reduce``, ``lax.custom_linear_solve``,
copies, ``jax.device_put`` and linear algebra. ``lax_rules()`` maps the
primitives the installed JAX defines to them."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import jax
import numpy as np
from jax import lax

from .. import _jaxpr
from .._jax.internals import core
from ._codegen_functions import FunctionWriter, Single
from ._codegen_public import add_rule, keyword_args, keywords, public_rule
from ._codegen_source import dtype_src, same_value, tuple_src

__all__ = ["lax_rules"]

# Elementwise primitives whose ``lax`` function only binds the primitive
# (written ``lax.add(a, b)`` when all their params are None).
_LAX_FUNCTION = {"and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
                 "not": "bitwise_not"}
_READABLE = frozenset({
    "add", "sub", "mul", "div", "rem", "max", "min", "and", "or", "xor", "not", "neg",
    "eq", "ne", "lt", "le", "gt", "ge", "sign", "floor", "ceil", "abs", "select_n",
    "sin", "cos", "tan", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
    "sqrt", "rsqrt", "cbrt", "atan2", "pow", "nextafter", "is_finite", "asin", "acos",
    "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "square", "integer_pow",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count",
    "clz", "erf", "erfc", "erf_inv", "lgamma", "digamma", "clamp", "one_minus_square",
    "real", "imag", "complex", "igamma", "igammac", "igamma_grad_a", "polygamma", "zeta",
    "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta", "random_gamma_grad",
})


def _elementwise_rule(fn: str) -> Callable:
    """``lax.add(a, b)``, ``lax.integer_pow(a, y=3)``: params other than
    ``y`` (``accuracy``) must be None."""
    def rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        p = eqn.params
        if any(v is not None for k, v in p.items() if k != "y"):
            return None
        extra = [f"y={p['y']!r}"] if "y" in p else []
        return f"{fn}({', '.join(args + extra)})"
    return rule


def _sort_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> Any:
    kw = keyword_args(g, eqn, "lax.sort", ("dimension", "is_stable", "num_keys"))
    if kw is None:
        return None
    if len(args) == 1:  # lax.sort of one array returns it (not a tuple)
        return Single(f"lax.sort({', '.join(args + kw)})")
    return f"lax.sort({', '.join([tuple_src(args)] + kw)})"


def _arg_reduction_rule(fn: str) -> Callable:
    def rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        p = eqn.params
        if set(p) != {"axes", "index_dtype"} or len(p["axes"]) != 1:
            return None
        return f"{fn}({args[0]}, axis={p['axes'][0]!r}, index_dtype={dtype_src(p['index_dtype'])})"
    return rule


def _iota_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    if len(p.get("shape", ())) == 1 and p.get("dimension") == 0 and \
            p.get("sharding") is None and set(p) <= {"dtype", "shape", "dimension", "sharding"}:
        return f"lax.iota({dtype_src(p['dtype'])}, {p['shape'][0]!r})"
    kw = keyword_args(g, eqn, "lax.broadcasted_iota", ("dtype", "shape", "dimension"))
    return None if kw is None else f"lax.broadcasted_iota({', '.join(kw)})"


def _dynamic_indices(eqn: core.JaxprEqn, fn: str, indices: list) -> bool:
    """Whether ``fn`` takes these start indices as they are: with
    ``allow_negative_indices=False`` (otherwise it wraps negative indices,
    where the primitive clamps them) and no negative literal (which it
    refuses)."""
    if "allow_negative_indices" not in keywords(fn):
        return False
    return all(not isinstance(a, core.Literal) or int(np.asarray(a.val)) >= 0 for a in indices)


def _dynamic_slice_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    ndim = len(eqn.invars[0].aval.shape)
    if set(eqn.params) != {"slice_sizes"} or len(args) != 1 + ndim \
            or not _dynamic_indices(eqn, "lax.dynamic_slice", eqn.invars[1:]):
        return None
    return (f"lax.dynamic_slice({args[0]}, {tuple_src(args[1:]) if ndim else '()'}, "
            f"slice_sizes={g.param(eqn.params['slice_sizes'], 'slice_sizes')}, "
            f"allow_negative_indices=False)")


def _dynamic_update_slice_rule(g: FunctionWriter, eqn: core.JaxprEqn,
                               args: list[str]) -> str | None:
    ndim = len(eqn.invars[0].aval.shape)
    if eqn.params or len(args) != 2 + ndim \
            or not _dynamic_indices(eqn, "lax.dynamic_update_slice", eqn.invars[2:]):
        return None
    return (f"lax.dynamic_update_slice({args[0]}, {args[1]}, "
            f"{tuple_src(args[2:]) if ndim else '()'}, allow_negative_indices=False)")


_SCATTER_PARAMS = ("dimension_numbers", "indices_are_sorted", "unique_indices", "mode")


def _scatter_rule(fn: str, combine: core.Primitive | None) -> Callable:
    """``lax.scatter_add(x, idx, upd, dimension_numbers=..., ...)``: the
    function builds the update jaxpr (``combine`` of the two values; none
    for ``lax.scatter``) itself."""
    def rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        p = eqn.params
        if tuple(p.get("update_consts", ())) or not _updates_with(p.get("update_jaxpr"), combine):
            return None
        kw = keyword_args(g, eqn, fn, _SCATTER_PARAMS,
                           fixed={"update_jaxpr": p.get("update_jaxpr"),
                                  "update_consts": p.get("update_consts")})
        return None if kw is None else f"{fn}({', '.join(args + kw)})"
    return rule


def _updates_with(update_jaxpr: Any, combine: core.Primitive | None) -> bool:
    if combine is None:
        return update_jaxpr is None
    if update_jaxpr is None:
        return False
    return [e.primitive for e in _jaxpr.jaxpr_parts(update_jaxpr).eqns] == [combine]


def _reduce_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    """``lax.reduce(operands, init_values, computation, dimensions=...)`` of
    the function computing the reduction's jaxpr."""
    p = eqn.params
    if set(p) - {"computation", "jaxpr", "dimensions", "out_sharding"} \
            or p.get("out_sharding") is not None:
        return None
    n = len(args) // 2
    fn = g.function(p["jaxpr"], "reducer", "tuple")
    if n == 1:  # (one operand: the computation takes and returns arrays)
        return Single(f"lax.reduce({args[0]}, {args[1]}, lambda acc, x: {fn}(acc, x)[0], "
                       f"dimensions={p['dimensions']!r})")
    return (f"lax.reduce({tuple_src(args[:n])}, {tuple_src(args[n:])}, "
            f"lambda acc, x: {fn}(*acc, *x), dimensions={p['dimensions']!r})")


def _linear_solve_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    """``lax.custom_linear_solve`` of the functions computing its jaxprs
    (the matvec, the solve and, when given, the transpose solve)."""
    p = eqn.params
    lengths, jaxprs = p.get("const_lengths"), p.get("jaxprs")
    if set(p) != {"const_lengths", "jaxprs"} or jaxprs.solve is None:
        return None
    offsets = np.cumsum([0, *lengths]).tolist()
    consts = {f: args[offsets[i]:offsets[i + 1]] for i, f in enumerate(lengths._fields)}
    b = args[offsets[-1]:]
    if len(_jaxpr.jaxpr_parts(jaxprs.solve).outvars) != len(b):
        return None  # (solve with auxiliary outputs)

    def call(field: str, hint: str) -> str:
        fn = g.function(getattr(jaxprs, field), hint, "tuple")
        return f"{fn}({', '.join([*consts[field], '*x'])})"

    opts = [f"solve=lambda _, x: {call('solve', 'solve')}"]
    if jaxprs.transpose_solve is not None:
        symmetric = jaxprs.vecmat is jaxprs.matvec
        opts.append(f"transpose_solve=lambda _, x: {call('transpose_solve', 'transpose_solve')}")
        if symmetric:
            opts.append("symmetric=True")
    return (f"lax.custom_linear_solve(lambda x: {call('matvec', 'matvec')}, {tuple_src(b)}, "
            f"{', '.join(opts)})")


def _array_dtype(aval: Any) -> bool:
    return isinstance(getattr(aval, "dtype", None), np.dtype)


def _copy_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    # jnp.copy binds copy_p alone and keeps the weak type.
    return None if eqn.params or not _array_dtype(eqn.invars[0].aval) else f"jnp.copy({args[0]})"


def _stop_gradient_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    return None if eqn.params or not _array_dtype(eqn.invars[0].aval) \
        else f"lax.stop_gradient({args[0]})"


def _add_jaxvals_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    # The sum of two cotangents: lax.add's when its result has the first's
    # type (add_jaxvals keeps it), that is unless only the first is weak.
    a, b = (v.aval for v in eqn.invars)
    if eqn.params or not _array_dtype(a) or np.dtype(a.dtype).kind not in "iufc" \
            or (a.shape, a.dtype) != (b.shape, b.dtype) \
            or getattr(a, "weak_type", False) and not getattr(b, "weak_type", False):
        return None
    return f"lax.add({', '.join(args)})"


def _triangular_solve_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    # The function adds a dimension to a ``b`` of one dimension less than
    # ``a`` and drops ``conjugate_a`` for real ``a``: the params must be
    # what it binds.
    a, b = (v.aval for v in eqn.invars)
    if len(a.shape) != len(b.shape) or eqn.params.get("conjugate_a") \
            and not np.issubdtype(a.dtype, np.complexfloating):
        return None
    return public_rule("lax.linalg.triangular_solve", "left_side", "lower", "transpose_a",
                   "conjugate_a", "unit_diagonal")(g, eqn, args)


@functools.cache
def _device_put_params() -> dict | None:
    """The params ``jax.device_put(x)`` binds (traced once)."""
    try:
        j = jax.make_jaxpr(jax.device_put)(jax.ShapeDtypeStruct((), np.float32))
        (e,) = _jaxpr.jaxpr_parts(j).eqns
    except Exception:  # noqa: BLE001 - no single equation: not written with it
        return None
    return dict(e.params)


def _device_put_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> Any:
    # jax.device_put of a tuple binds once, each param a tuple per operand.
    want, n = _device_put_params(), len(args)
    if want is None or set(want) != set(eqn.params) \
            or any(not same_value(tuple(want[k]) * n, eqn.params[k]) for k in want):
        return None
    return Single(f"jax.device_put({args[0]})") if n == 1 else \
        f"jax.device_put({tuple_src(args)})"


def lax_rules() -> dict:
    """The rules of the ``lax`` primitives the installed JAX defines, keyed
    by the primitive."""
    rules: dict = {}
    add = functools.partial(add_rule, rules)
    for name in _READABLE:
        fn = _LAX_FUNCTION.get(name, name)
        if hasattr(lax, fn):
            add(getattr(lax, f"{name}_p", None), _elementwise_rule(f"lax.{fn}"))
    structural = {
        "broadcast_in_dim": ("shape", "broadcast_dimensions"),
        "reshape": ("new_sizes", "dimensions"),
        "squeeze": ("dimensions",),
        "slice": ("start_indices", "limit_indices", "strides"),
        "transpose": ("permutation",),
        "rev": ("dimensions",),
        "pad": ("padding_config",),
        "split": ("sizes", "axis"),
        "reduce_precision": ("exponent_bits", "mantissa_bits"),
        "bitcast_convert_type": ("new_dtype",),
        "round": ("rounding_method",),
        "dot_general": ("dimension_numbers", "precision", "preferred_element_type"),
        "conv_general_dilated": ("window_strides", "padding", "lhs_dilation", "rhs_dilation",
                                 "dimension_numbers", "feature_group_count",
                                 "batch_group_count", "precision", "preferred_element_type"),
        "gather": ("dimension_numbers", "slice_sizes", "unique_indices", "indices_are_sorted",
                   "mode", "fill_value"),
        "rng_bit_generator": ("shape", "dtype", "algorithm"),
        "top_k": ("k", "axis", "is_stable"),
        "tile": ("reps",),
        "unstack": ("axis",),
        **{f"reduce_{op}": ("axes",) for op in ("sum", "max", "min", "prod", "and", "or", "xor")},
        **{f"cum{op}": ("axis", "reverse") for op in ("sum", "prod", "max", "min", "logsumexp")},
    }
    for name, params in structural.items():
        add(getattr(lax, f"{name}_p", None), public_rule(f"lax.{name}", *params))
    add(lax.convert_element_type_p,
        public_rule("lax.convert_element_type", "new_dtype", fixed={"weak_type": False}))
    add(lax.concatenate_p, public_rule("lax.concatenate", "dimension", seq=True))
    add(getattr(lax, "optimization_barrier_p", None),
        public_rule("lax.optimization_barrier", seq=True))
    add(getattr(lax, "stack_p", None), public_rule("lax.stack", "axis", seq=True))
    add(lax.copy_p, _copy_rule)
    add(getattr(lax, "stop_gradient_p", None), _stop_gradient_rule)
    add(getattr(lax, "device_put_p", None), _device_put_rule)
    ad_util = sys.modules.get("jax._src.ad_util")
    add(getattr(ad_util, "add_jaxvals_p", None), _add_jaxvals_rule)
    linalg = getattr(lax, "linalg", None)
    add(getattr(linalg, "lu_p", None), public_rule("lax.linalg.lu"))
    add(getattr(linalg, "triangular_solve_p", None), _triangular_solve_rule)
    add(lax.sort_p, _sort_rule)
    add(lax.argmax_p, _arg_reduction_rule("lax.argmax"))
    add(lax.argmin_p, _arg_reduction_rule("lax.argmin"))
    add(lax.iota_p, _iota_rule)
    add(lax.dynamic_slice_p, _dynamic_slice_rule)
    add(lax.dynamic_update_slice_p, _dynamic_update_slice_rule)
    add(lax.scatter_p, _scatter_rule("lax.scatter", None))
    for op in ("add", "sub", "mul", "min", "max"):
        add(getattr(lax, f"scatter_{op}_p", None),
            _scatter_rule(f"lax.scatter_{op}", getattr(lax, f"{op}_p")))
    add(getattr(lax, "reduce_p", None), _reduce_rule)
    add(getattr(lax, "linear_solve_p", None), _linear_solve_rule)
    return rules

"""Calls of public JAX functions in generated code: which keywords the
installed JAX's function takes and which values are its defaults
(``keywords``, ``is_default``), the keyword arguments that make it bind
exactly an equation's params (``keyword_args``), and the rule writing such
a call (``public_rule``); ``add_rule`` enters a rule in a table.

A rule writes the call of the public function that binds the primitive with
exactly the equation's params (the same computation, bit for bit), each
param as the function's keyword. It returns None, and the primitive is
bound as it is, when the installed JAX's function has no keyword for a
param, or a param holds a value the function would not bind (an explicit
sharding, a negative literal index it would wrap, ...)."""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable

import numpy as np

from .._jax.internals import core
from ._codegen_functions import FunctionWriter
from ._codegen_source import dtype_src, tuple_src

__all__ = ["add_rule", "is_default", "keyword_args", "keywords", "public_rule"]

# Params the public functions bind as None by default (explicit sharding).
_DEFAULT_NONE = frozenset({"sharding", "out_sharding"})


def _resolve(dotted: str) -> Any:
    """The object named ``dotted`` (``jax.experimental.io_callback``),
    importing modules on the way; None when it does not exist."""
    parts = dotted.split(".")
    if parts[0] in ("lax", "jnp", "np"):  # the generated code's aliases
        parts[:1] = {"lax": ["jax", "lax"], "jnp": ["jax", "numpy"], "np": ["numpy"]}[parts[0]]
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if not hasattr(obj, part):
            try:
                importlib.import_module(".".join(parts[:i + 1]))
            except ImportError:
                return None
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@functools.cache
def _signature(fn: str) -> dict:
    """``{keyword: default}`` of what ``fn``'s signature accepts as keywords
    (``inspect.Parameter.empty`` for no default; empty when ``fn`` does not
    exist in the installed JAX)."""
    try:
        sig = inspect.signature(_resolve(fn))
    except (TypeError, ValueError):
        return {}
    return {n: prm.default for n, prm in sig.parameters.items()
            if prm.kind in (prm.POSITIONAL_OR_KEYWORD, prm.KEYWORD_ONLY)}


def keywords(fn: str) -> frozenset:
    """The keywords ``fn`` takes (none when the installed JAX lacks it)."""
    return frozenset(_signature(fn))


def is_default(fn: str, name: str, value: Any) -> bool:
    """Whether passing ``value`` is passing ``fn``'s default (left out)."""
    default = _signature(fn).get(name, inspect.Parameter.empty)
    if default is inspect.Parameter.empty or type(default) is not type(value):
        return False
    try:
        return bool(default == value)
    except Exception:  # noqa: BLE001 - an array-like default
        return False


def keyword_args(g: FunctionWriter, eqn: core.JaxprEqn, fn: str, params: tuple[str, ...],
                 rename: dict | None = None, fixed: dict | None = None) -> list[str] | None:
    """``keyword=value`` sources of ``params`` (those the equation has) for
    ``fn``, or None when ``fn`` cannot bind the equation's params: a param
    outside ``params`` that is not None (``_DEFAULT_NONE``) or not its
    ``fixed`` value, or a keyword ``fn`` lacks."""
    p, rename, fixed = eqn.params, rename or {}, fixed or {}
    for k, v in p.items():
        if k in params:
            continue
        if k in fixed:
            if not (v is fixed[k] or type(v) is type(fixed[k]) and v == fixed[k]):
                return None
        elif not (k in _DEFAULT_NONE and v is None):
            return None
    accepted = keywords(fn)
    out = []
    for k in params:
        if k not in p:
            continue
        name = rename.get(k, k)
        if name not in accepted:
            return None
        if is_default(fn, name, p[k]):
            continue
        value = dtype_src(p[k]) if isinstance(p[k], np.dtype) else \
            g.param(p[k], f"{eqn.primitive.name}_{k}")
        out.append(f"{name}={value}")
    return out


def public_rule(fn: str, *params: str, seq: bool = False, rename: dict | None = None,
                fixed: dict | None = None) -> Callable:
    """Rule: ``fn(*operands, param=value, ...)``; with ``seq`` the operands
    are passed as one tuple (``lax.concatenate``, ``lax.optimization_barrier``)."""
    def rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        kw = keyword_args(g, eqn, fn, params, rename, fixed)
        if kw is None:
            return None
        return f"{g.public(fn)}({', '.join(([tuple_src(args)] if seq else args) + kw)})"
    return rule


def add_rule(rules: dict, prim: Any, rule: Callable) -> None:
    """``rules[prim] = rule`` when ``prim`` is a primitive (None where the
    installed JAX does not define it)."""
    if isinstance(prim, core.Primitive):
        rules[prim] = rule

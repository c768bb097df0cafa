"""Rules writing ``jax`` primitives that are no ``lax`` operations as the
calls of their public functions (see ``FunctionWriter.rules``):
``jax.debug.print``, ``jax.debug.callback``, ``jax.pure_callback`` and
``jax.experimental.io_callback`` of the user's function, and ``jax.random``
functions of typed keys. ``jax_rules()`` maps the primitives the installed
JAX defines to them."""

from __future__ import annotations

import functools
import importlib
import keyword
import sys
from typing import Any, Callable

import jax
import numpy as np

from .._jax.internals import core
from ._codegen_functions import FunctionWriter, Single
from ._codegen_locate import prng_impl_name
from ._codegen_public import add_rule, is_default, keywords, public_rule
from ._codegen_source import NoSource, Src, tree_src, tuple_src

__all__ = ["jax_rules"]


def _callback_call_args(g: FunctionWriter, in_tree: Any, args: list[str], static: dict,
                        reserved: frozenset) -> list[str] | None:
    """The arguments of a callback call: the ``(args, kwargs)`` pytree
    ``in_tree`` with the equation's operands and static values as leaves."""
    leaves, dynamic = [], iter(args)
    for i in range(len(args) + len(static)):
        leaves.append(Src(g.param(static[i], "static_arg")) if i in static
                      else Src(next(dynamic)))
    try:
        call_args, call_kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        out = [tree_src(a) for a in call_args]
        for k, v in call_kwargs.items():
            if not (isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k)) \
                    or k in reserved:
                return None
            out.append(f"{k}={tree_src(v)}")
    except (NoSource, TypeError, ValueError, AttributeError):
        return None
    return out


def _debug_print_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    if p.get("logging_record") is not None or p.get("in_tree") is None \
            or tuple(p.get("np_printoptions", ())) != tuple(np.get_printoptions().items()):
        return None  # (printed under other numpy print options: bound as it is)
    call = _callback_call_args(g, p["in_tree"], args, dict(p.get("static_args", ())),
                               keywords("jax.debug.print"))
    if call is None or not isinstance(p.get("fmt"), str):
        return None
    opts = [f"{k}=True" for k in ("ordered", "partitioned") if p.get(k)]
    return f"jax.debug.print({', '.join([repr(p['fmt']), *call, *opts])})"


def _closure_vars(fn: Any) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    except ValueError:  # an empty cell
        return {}


def _debug_callback_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    # jax.debug.callback binds a closure over the user's callback, the
    # arguments' tree and their static values (JAX's _flat_callback).
    p = eqn.params
    closure = _closure_vars(p.get("callback"))
    if not {"callback", "in_tree", "static_args"} <= set(closure) \
            or set(p) - {"callback", "effect", "partitioned"}:
        return None
    call = _callback_call_args(g, closure["in_tree"], args, dict(closure["static_args"]),
                               keywords("jax.debug.callback"))
    if call is None:
        return None
    opts = []
    if p.get("effect") is not _debug_effect("debug_effect"):
        if p.get("effect") is not _debug_effect("ordered_debug_effect"):
            return None
        opts.append("ordered=True")
    if p.get("partitioned"):
        opts.append("partitioned=True")
    fn = g.callable_src(closure["callback"], "debug_callback")
    return f"jax.debug.callback({', '.join([fn, *call, *opts])})"


def _debug_effect(name: str) -> Any:
    module = sys.modules.get("jax._src.debugging")
    return getattr(module, name, object())


def _host_callback_rule(fn: str, options: tuple[str, ...]) -> Callable:
    """``io_callback`` / ``pure_callback`` of the user's function (JAX binds
    it wrapped with the arguments' tree), with flat result types."""
    def rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        p = eqn.params
        flat = p.get("callback")
        user, in_tree = getattr(flat, "callback_func", None), getattr(flat, "in_tree", None)
        if user is None or in_tree is None or p.get("sharding") is not None \
                or set(p) - {"callback", "result_avals", "sharding", *options}:
            return None
        specs = [g.spec_src(a) for a in p["result_avals"]]
        if None in specs or any(getattr(a, "weak_type", False) for a in p["result_avals"]):
            return None
        call = _callback_call_args(g, in_tree, args, {}, keywords(fn))
        if call is None or not set(options) <= keywords(fn):
            return None
        opts = [f"{k}={g.param(p[k], k)}" for k in options
                if k in p and not is_default(fn, k, p[k])]
        # One result type for one result, as a user writes it.
        results = specs[0] if len(specs) == 1 else tuple_src(specs)
        public = g.public(fn)  # (its import line before the callback's)
        user_src = g.callable_src(user, "callback")
        src = f"{public}({', '.join([user_src, results, *call, *opts])})"
        return Single(src) if len(specs) == 1 else src
    return rule


# PRNG keys: ``jax.random`` functions of typed keys.

def _random_key_rule(fn: str) -> Callable:
    def rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        name = prng_impl_name(eqn.params.get("impl"))
        if name is None or set(eqn.params) != {"impl"} \
                or fn == "jax.random.key" and eqn.invars[0].aval.shape:
            return None
        return f"{fn}({args[0]}, impl={name!r})"
    return rule


def _random_bits_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    if set(p) - {"bit_width", "shape", "out_sharding"} or p.get("out_sharding") is not None \
            or p.get("bit_width") not in (8, 16, 32, 64):
        return None
    return (f"jax.random.bits({args[0]}, shape={p['shape']!r}, "
            f"dtype=np.uint{p['bit_width']})")


def _random_split_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    if set(p) != {"shape"} or eqn.invars[0].aval.shape:  # (jax.random.split: one key)
        return None
    return f"jax.random.split({args[0]}, {p['shape']!r})"


def _random_fold_in_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    if eqn.params or eqn.invars[0].aval.shape \
            or np.dtype(eqn.invars[1].aval.dtype) != np.uint32:
        return None
    return f"jax.random.fold_in({args[0]}, {args[1]})"


def jax_rules() -> dict:
    """The rules of the ``jax`` primitives (debugging, callbacks, PRNG keys)
    the installed JAX defines, keyed by the primitive."""
    rules: dict = {}
    add = functools.partial(add_rule, rules)
    debugging = sys.modules.get("jax._src.debugging")
    add(getattr(debugging, "debug_print_p", None), _debug_print_rule)
    add(getattr(debugging, "debug_callback_p", None), _debug_callback_rule)
    callback = importlib.import_module("jax._src.callback")
    add(getattr(callback, "io_callback_p", None),
        _host_callback_rule("jax.experimental.io_callback", ("ordered",)))
    add(getattr(callback, "pure_callback_p", None),
        _host_callback_rule("jax.pure_callback", ("vmap_method",)))
    prng = sys.modules.get("jax._src.random.prng") or sys.modules.get("jax._src.prng")
    add(getattr(prng, "random_seed_p", None), _random_key_rule("jax.random.key"))
    add(getattr(prng, "random_wrap_p", None), _random_key_rule("jax.random.wrap_key_data"))
    add(getattr(prng, "random_unwrap_p", None), public_rule("jax.random.key_data"))
    add(getattr(prng, "random_bits_p", None), _random_bits_rule)
    add(getattr(prng, "random_split_p", None), _random_split_rule)
    add(getattr(prng, "random_fold_in_p", None), _random_fold_in_rule)
    return rules

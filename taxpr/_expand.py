"""Operations taxpr threads through their implementation.

Some operations hold the user's code where taxpr's generic traversal does
not rewrite it: JAX's high-level primitives (an object in params), an
equinox filter primitive (a Python function in params, traced only when JAX
compiles it: lineax's ``linear_solve`` of a ``FunctionLinearOperator``),
and primitives with jaxprs in params but no thread rule
(``lax.custom_linear_solve``, ``custom_vmap``). Where such an equation holds
a tag the transformation consumes, taxpr replaces it by a ``jit`` call of
what JAX itself runs for it (``expand_for``): the high-level primitive's
expansion into ordinary primitives (``to_lojax``), or the primitive's
implementation (the function JAX lowers: equinox's vprim impl, else
``Primitive.impl``), traced with the tags kept. That is the eager program,
so the effects inside happen as a Python run would have them. Done once,
right after tracing, by every taxpr transformation; the equation stays as it
is (with its rules) wherever no such tag is inside.

The custom derivative of such an operation is not part of the expansion.
For high-level primitives the expansion is differentiated instead. An
expanded implementation starts with ``expanded_inputs_p`` on its inputs:
differentiating the rewritten program through it from outside (or vmapping
it, for ``custom_vmap``, whose batching rule is the user's) is a clear
error naming the operation and the tag (the operation's own rule would run
the user's code again, outside the rewrite), while derivatives and batching
done inside the transformed function were already done by JAX's rules.

* ``hidden_jaxprs(eqn)`` yields the jaxprs a high-level equation holds (what
  ``find_tags`` and every walk over a program look into).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable

import jax
import numpy as np
from ._jax.internals import core
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _compat, _engine, _jaxpr, _libraries, _traverse
from ._engine import describe_tag, format_path
from ._find import TAG_PRIMITIVES, Predicate, is_selected
from ._traverse import hi_name, hidden_jaxprs
from .primitives._tag import keep_tags, tag_p, user_params

HI_PRIMITIVE = _compat.call_hi_primitive_p  # None where JAX has no high-level primitives


def is_hi(eqn: core.JaxprEqn) -> bool:
    return HI_PRIMITIVE is not None and eqn.primitive is HI_PRIMITIVE


def holds_tags(eqn: core.JaxprEqn) -> bool:
    """Whether a high-level equation holds tags, also in the functions it
    keeps (custom_root's linearized ``f`` runs only in its derivative rule,
    whose expansion is then what JAX runs)."""
    return any(e.primitive is tag_p for j in hidden_jaxprs(eqn, in_functions=True)
               for e, _ in _traverse.iter_eqns(j))


def _expanded_call(eqn: core.JaxprEqn, selects: Predicate | None) -> core.JaxprEqn:
    """A ``jit`` equation computing what ``eqn`` computes, through its
    expansion into ordinary primitives (tags in it kept and expanded too)."""
    params = eqn.params

    def lo(*args):
        return HI_PRIMITIVE.to_lojax(*args, **params)

    with keep_tags():
        body = _jaxpr.trace_flat(lo, [v.aval for v in eqn.invars], hi_name(eqn))
    return _jit_call(eqn, expand_for(body, selects), hi_name(eqn))


def _jit_call(eqn: core.JaxprEqn, body: Any, name: str) -> core.JaxprEqn:
    """``eqn`` replaced by a ``jit`` equation calling ``body`` (same inputs
    and outputs)."""
    n_in, n_out = len(eqn.invars), len(eqn.outvars)
    jit = _jit_template()
    unspec = _jaxpr.unspecified_sharding()
    new_params = dict(jit.params, jaxpr=body, name=name,
                      in_shardings=(unspec,) * n_in, out_shardings=(unspec,) * n_out,
                      in_layouts=(None,) * n_in, out_layouts=(None,) * n_out,
                      donated_invars=(False,) * n_in)
    effects = _traverse.effects_of([body])
    return eqn.replace(primitive=_compat.jit_p, params=new_params, effects=effects)


_TEMPLATE: list = []


def _jit_template() -> core.JaxprEqn:
    """A ``jit`` equation whose params other than the callee and its
    signature are JAX's defaults."""
    if not _TEMPLATE:
        closed = jax.make_jaxpr(jax.jit(lambda x: x))(0.0)
        _TEMPLATE.append(_jaxpr.jaxpr_parts(closed).eqns[0])
    return _TEMPLATE[0]


# ---- implementations ----------------------------------------------------------

# The inputs of an expanded implementation pass through this identity: it
# turns JAX's transformations that the implementation does not stand for
# into clear errors (``derivative_error``: any derivative; ``batching_error``:
# vmap, where the operation's batching rule is a user's, else None).
expanded_inputs_p = Primitive("taxpr_expanded_inputs")
expanded_inputs_p.multiple_results = True


def _identity(*args, **params):
    return list(args)


expanded_inputs_p.def_impl(_identity)
expanded_inputs_p.def_abstract_eval(_identity)
mlir.register_lowering(expanded_inputs_p, mlir.lower_fun(_identity, multiple_results=True))


def _expanded_inputs_jvp(primals, tangents, *, derivative_error, batching_error):
    if any(type(t) is not ad.Zero for t in tangents):
        raise NotImplementedError(derivative_error)
    return (expanded_inputs_p.bind(*primals, derivative_error=derivative_error,
                                   batching_error=batching_error), list(tangents))


def _expanded_inputs_transpose(cts, *args, derivative_error, batching_error):
    raise NotImplementedError(derivative_error)


def _expanded_inputs_batch(args, dims, *, derivative_error, batching_error):
    if batching_error is not None:
        raise NotImplementedError(batching_error)
    return expanded_inputs_p.bind(*args, derivative_error=derivative_error,
                                  batching_error=batching_error), dims


ad.primitive_jvps[expanded_inputs_p] = _expanded_inputs_jvp
ad.primitive_transposes[expanded_inputs_p] = _expanded_inputs_transpose
batching.primitive_batchers[expanded_inputs_p] = _expanded_inputs_batch

# Primitives whose point is a batching rule of the user's.
_CUSTOM_BATCHING = frozenset({_compat.custom_vmap_p})


def keeps_a_function(eqn: core.JaxprEqn) -> bool:
    """Whether ``eqn``'s params hold a function defined outside JAX (a user's
    or a library's), directly or in a tuple."""
    def is_foreign_function(v) -> bool:
        if isinstance(v, functools.partial):
            v = v.func
        return (isinstance(v, (types.FunctionType, types.MethodType))
                and not getattr(v, "__module__", "").startswith(("jax.", "jax", "taxpr")))
    return any(is_foreign_function(v) or (isinstance(v, (tuple, list))
                                          and any(is_foreign_function(x) for x in v))
               for v in eqn.params.values())


def hidden_tags(closed: Any, recorded: dict, selects: Predicate) -> list[dict]:
    """The params of the tags ``selects`` selects that user code bound while
    ``closed`` was traced (``recording_tags``' ``recorded``) but that are
    nowhere in it."""
    missing = set(recorded)
    # A program binds few distinct tags many times (a state read every
    # step): the walk stops once each recorded one was seen.
    for e, _ in _traverse.iter_eqns(closed):
        if not missing:
            break
        if e.primitive is tag_p:
            missing.discard(frozenset(user_params(e.params).items()))
    return [params for key, (params, tree, avals) in recorded.items()
            if key in missing and selects(params, jax.tree_util.tree_unflatten(tree, avals))]


def expand_for(program: Any, selects: Predicate | None) -> Any:
    """``program`` with the operations taxpr threads through their
    implementation expanded (see the module docstring), for a transformation
    consuming the tags ``selects`` selects (None: all).

    Expanded: high-level equations holding tags; equations of primitives
    without a thread rule holding a selected tag in their jaxprs; and the
    equations keeping a Python function whose implementation holds a
    selected tag (the function's own trace may be a cache hit that binds no
    tag, so each such implementation is traced to look). The same object
    when nothing is expanded.
    """
    kept: list[KeptCode] = []

    def rewrite(eqn, path, env):
        prim = eqn.primitive
        if prim in _engine.THREAD_RULES or prim in TAG_PRIMITIVES:
            return None
        if is_hi(eqn):
            if not holds_tags(eqn):
                return None
            return [_expanded_call(eqn.replace(invars=[
                env.get(v, v) if type(v) is core.Var else v for v in eqn.invars]), selects)]
        if not _may_hold_code(eqn):
            return None
        code = _kept_code(eqn, path, selects)
        if code is not None:
            kept.append(code)
        if any(_holds_selected(sj, selects) for _, sj in _traverse.subjaxprs(eqn)):
            return _implementation_call(eqn, path, env, selects, "taxpr has no thread rule for it")
        if keeps_a_function(eqn):
            try:
                return _implementation_call(eqn, path, env, selects,
                                            "it keeps a Python function in its params")
            except Exception:  # noqa: BLE001 - a look for tags: what it raises may not escape
                return None
        return None

    expanded = _traverse.map_jaxpr(program, rewrite)
    return _guard_copies(expanded, kept, selects) if kept else expanded


# ---- code kept for derivative rules ---------------------------------------------
#
# An equation may keep, in its params, code that its derivative rule runs
# again when JAX differentiates it: lineax's ``linear_solve`` keeps a
# ``FunctionLinearOperator``'s matvec (the Python function, or its
# closure-converted jaxpr) and differentiates the solve through it, while the
# traced program runs a copy of the same code elsewhere (LU materializes the
# matrix from the matvec, and stops its gradient: the rule is meant to give
# the derivative). taxpr rewrites the copy in the program, never the kept
# code, so a derivative that comes through a changed value there would be
# that of the unchanged code (for LU: 0). Such a value passes through
# ``expanded_inputs_p`` with an error for any derivative.


@dataclasses.dataclass(frozen=True)
class KeptCode:
    """The code an equation keeps for its rules: ``codes``, the functions'
    code objects (a tag a frame of which runs is a copy); ``lines``, where
    the selected tags of the jaxprs it keeps were bound (``(file, line)``)."""

    primitive: str
    path: tuple[str, ...]
    codes: frozenset
    lines: frozenset

    def copies(self, eqn: core.JaxprEqn) -> bool:
        """Whether ``eqn`` (a tag) runs code this equation keeps."""
        tb = eqn.source_info.traceback
        if self.codes and any(c in self.codes for c in _compat.traceback_codes(tb)):
            return True
        return bool(self.lines) and _compat.user_frame_key(tb) in self.lines


def _kept_code(eqn: core.JaxprEqn, path: tuple[str, ...],
               selects: Predicate | None) -> KeptCode | None:
    codes = frozenset(f.__code__ for f in _foreign_functions(eqn.params.values(), set()))
    lines = frozenset(
        key for _, sj in _traverse.subjaxprs(eqn) for e, _ in _traverse.iter_eqns(sj)
        if is_selected(e, selects)
        and (key := _compat.user_frame_key(e.source_info.traceback)) is not None)
    if not codes and not lines:
        return None
    return KeptCode(eqn.primitive.name, path, codes, lines)


def _foreign_functions(values, seen: set):
    """The functions defined outside JAX and taxpr in ``values`` (through
    tuples, lists, dicts, partials and closures)."""
    for v in values:
        if id(v) in seen:
            continue
        seen.add(id(v))
        if isinstance(v, (tuple, list)):
            yield from _foreign_functions(v, seen)
        elif isinstance(v, dict):
            yield from _foreign_functions(v.values(), seen)
        elif isinstance(v, functools.partial):
            yield from _foreign_functions((v.func, *v.args, *v.keywords.values()), seen)
        elif isinstance(v, types.MethodType):
            yield from _foreign_functions((v.__func__,), seen)
        elif isinstance(v, types.FunctionType) and _is_foreign(v):
            yield v
            cells = []
            for cell in v.__closure__ or ():
                try:
                    cells.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            yield from _foreign_functions(cells, seen)


def _is_foreign(fn: Callable) -> bool:
    return not (getattr(fn, "__module__", None) or "").startswith(("jax.", "jax", "taxpr"))


def describe_named_tag(params: dict) -> str:
    """How an error names a tag: ``describe_tag``, or for a layer's own
    sows what they stand for (capture's: the site)."""
    describe_sow = getattr(params.get("tag"), "describe_sow", None)
    if describe_sow is not None and "name" in params:
        return describe_sow(params["name"])
    return describe_tag(params)


def _guard_copies(program: Any, kept: list[KeptCode], selects: Predicate | None) -> Any:
    """``program`` with each selected tag that copies kept code followed by
    ``expanded_inputs_p``, whose derivative is an error naming the tag."""
    def rewrite(eqn, path, env):
        if eqn.primitive not in TAG_PRIMITIVES or not is_selected(eqn, selects):
            return None
        keeper = next((k for k in kept if k.copies(eqn)), None)
        if keeper is None:
            return None
        eqn = eqn.replace(invars=[env.get(v, v) if type(v) is core.Var else v
                                  for v in eqn.invars])
        fresh = [_jaxpr.new_var(v.aval) for v in eqn.outvars]
        where = _compat.user_line(eqn.source_info.traceback)
        error = (
            f"taxpr: differentiating {describe_named_tag(user_params(eqn.params))} at "
            f"{format_path(path)}{f' ({where})' if where else ''} from outside the transformed "
            f"function is not supported: '{keeper.primitive}' at {format_path(keeper.path)} "
            f"keeps the code that binds it and differentiates the code itself, outside "
            f"taxpr's rewrite (lineax's linear_solve differentiates its operator's matvec), "
            f"so the derivative would be that of the unchanged code. Compute the value "
            f"outside that code and pass it in (close the matvec over it), or take the "
            f"derivative inside the transformed function")
        guard = core.new_jaxpr_eqn(
            fresh, list(eqn.outvars), expanded_inputs_p,
            dict(derivative_error=error, batching_error=None), core.no_effects, eqn.source_info)
        return [eqn.replace(outvars=fresh), guard]

    return _traverse.map_jaxpr(program, rewrite)


# Param values that hold neither a jaxpr nor a function: most equations'
# (lax's arithmetic) have only these, and are skipped at once.
_PLAIN = frozenset({int, float, bool, str, type(None), np.dtype})


def _may_hold_code(eqn: core.JaxprEqn) -> bool:
    for v in eqn.params.values():
        t = type(v)
        if t in _PLAIN or isinstance(v, np.dtype):
            continue
        if t is tuple and all(type(x) in _PLAIN for x in v):
            continue
        return True
    return False


def _holds_selected(jaxpr: Any, selects: Predicate | None) -> bool:
    return any(is_selected(e, selects) for e, _ in _traverse.iter_eqns(jaxpr))


def _same_params(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


def _implementation_call(eqn: core.JaxprEqn, path: tuple[str, ...], env: dict,
                         selects: Predicate | None, why: str) -> list | None:
    """``eqn`` as a ``jit`` call of its implementation traced with kept tags,
    its inputs through ``expanded_inputs_p``. None (keep ``eqn``) when the
    implementation is the primitive itself (an impl that binds it again, as
    pallas_call's does), or when ``eqn`` keeps a Python function and its
    implementation holds no selected tag."""
    prim, params = eqn.primitive, eqn.params
    impl = _libraries.lowering_implementation(prim)
    eqn = eqn.replace(invars=[env.get(v, v) if type(v) is core.Var else v for v in eqn.invars])

    def run(*args):
        args = expanded_inputs_p.bind(*args, derivative_error="", batching_error=None)
        out = impl(*args, **params)
        return out if prim.multiple_results else [out]

    try:
        with keep_tags():
            body = _jaxpr.trace_flat(run, [v.aval for v in eqn.invars], prim.name)
    except NotImplementedError:  # no implementation
        return None
    if any(e.primitive is prim and _same_params(e.params, params)
           for e, _ in _traverse.iter_eqns(body)):
        return None
    body = expand_for(body, selects)
    tags = [e for e, _ in _traverse.iter_eqns(body) if is_selected(e, selects)]
    if not tags:
        if keeps_a_function(eqn):  # the hidden tag is elsewhere
            return None
        # The implementation does not run the tags of the jaxprs in params
        # (lineax's LU solves with the factors it was given, not the matvec).
        tags = [e for _, sj in _traverse.subjaxprs(eqn) for e, _ in _traverse.iter_eqns(sj)
                if is_selected(e, selects)]

    def error(transformation: str, rule: str) -> str:
        return (
            f"taxpr: {transformation} '{prim.name}' at {format_path(path)} from outside the "
            f"transformed function is not supported: it holds "
            f"{describe_tag(user_params(tags[0].params))} and {why}, so taxpr runs its "
            f"implementation, and JAX's {rule} for '{prim.name}' would run the code inside "
            f"again, outside taxpr's rewrite. Apply it inside the function taxpr transforms "
            f"(e.g. jax.grad or jax.vmap inside the function passed to tx.uncurry), or "
            f"compute the tagged value outside '{prim.name}'")

    markers = dict(derivative_error=error("differentiating through", "derivative rule"),
                   batching_error=(error("vmapping", "batching rule")
                                   if prim in _CUSTOM_BATCHING else None))
    body = _traverse.map_jaxpr(body, lambda e, p, env: [e.replace(params=markers)]
                               if e.primitive is expanded_inputs_p else None)
    return [_jit_call(eqn, body, prim.name)]

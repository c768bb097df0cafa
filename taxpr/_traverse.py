"""One generic traversal of nested jaxprs.

Every taxpr walker and rewriter finds sub-jaxprs through ``subjaxprs`` and
rebuilds equations through ``with_subjaxprs``. A primitive needs no entry here
to be walked: any jaxpr-valued param (or tuple of them) is found
generically. ``PATH_LABELS`` only makes paths read well.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import jax
from ._jax.internals import core

from . import _compat, _jaxpr


class Sub(NamedTuple):
    """Where a sub-jaxpr sits in an equation's params."""

    key: str
    index: int | None  # position inside a tuple-valued param
    label: str  # path element naming the enclosing primitive


class IdMemo:
    """A table keyed by objects' identity (jaxprs, equations: hashing them
    by value costs a walk), optionally refined by ``extra`` keys. Each entry
    keeps its object alive, so that an id is not reused while the entry
    exists: the one memo helper of taxpr's walks."""

    __slots__ = ("_table",)

    def __init__(self) -> None:
        self._table: dict[tuple, tuple[Any, Any]] = {}

    def get(self, obj: Any, *extra: Any, default: Any = None) -> Any:
        hit = self._table.get((id(obj), *extra))
        return default if hit is None else hit[1]

    def set(self, obj: Any, value: Any, *extra: Any) -> Any:
        self._table[(id(obj), *extra)] = (obj, value)
        return value

    def get_or_compute(self, obj: Any, compute: Callable[[], Any], *extra: Any) -> Any:
        key = (id(obj), *extra)
        hit = self._table.get(key)
        if hit is None:
            hit = self._table[key] = (obj, compute())
        return hit[1]

    def pop(self, obj: Any, *extra: Any) -> Any:
        """Remove ``obj``'s entry; its value, or None if it had none."""
        hit = self._table.pop((id(obj), *extra), None)
        return None if hit is None else hit[1]

    def items(self) -> list[tuple[Any, Any]]:
        """``(object, value)`` of every entry, in insertion order."""
        return list(self._table.values())

    def __len__(self) -> int:
        return len(self._table)


def _scan_label(eqn, key, index):
    rev = ",reverse" if eqn.params.get("reverse") else ""
    return f"scan[length={eqn.params['length']}{rev}]"


_LINEAR_SOLVE_PARTS = ("matvec", "vecmat", "solve", "transpose_solve")

# Path labels by primitive (one label for both of 0.10's call primitives,
# closed_call and eval_jaxpr).
PATH_LABELS: dict[core.Primitive, Callable[[core.JaxprEqn, str, int | None], str]] = {
    _compat.jit_p: lambda e, k, i: f"jit[{e.params.get('name', '?')}]",
    _compat.scan_p: _scan_label,
    _compat.while_p: lambda e, k, i: "while[cond]" if k == "cond_jaxpr" else "while[body]",
    _compat.cond_p: lambda e, k, i: f"cond[branch={i}]",
    _compat.remat_p: lambda e, k, i: "checkpoint",
    _compat.custom_jvp_call_p: lambda e, k, i: "custom_jvp",
    _compat.custom_vjp_call_p: lambda e, k, i: "custom_vjp",
    _compat.shard_map_p: lambda e, k, i: "shard_map",
    **{p: (lambda e, k, i: "closed_call") for p in _compat.CLOSED_CALL_PRIMITIVES},
    jax.lax.linear_solve_p: lambda e, k, i: (
        f"custom_linear_solve[{_LINEAR_SOLVE_PARTS[i]}]"
        if i is not None and i < 4 else f"custom_linear_solve[{k}]"),
}


def _label(eqn: core.JaxprEqn, key: str, index: int | None) -> str:
    rule = PATH_LABELS.get(eqn.primitive)
    if rule is not None:
        return rule(eqn, key, index)
    name = eqn.primitive.name
    return f"{name}[{key}]" if index is None else f"{name}[{key}={index}]"


def subjaxprs(eqn: core.JaxprEqn) -> list[tuple[Sub, Any]]:
    """The jaxprs nested directly in ``eqn``'s params, in param order."""
    out = []
    jaxpr_types = _compat.JAXPR_TYPES
    for key, value in eqn.params.items():
        t = type(value)
        if t is tuple or t is list or (t not in _PLAIN_PARAM_TYPES
                                       and isinstance(value, (tuple, list))):
            for i, v in enumerate(value):
                if type(v) not in _PLAIN_PARAM_TYPES and isinstance(v, jaxpr_types):
                    out.append((Sub(key, i, _label(eqn, key, i)), v))
        elif t not in _PLAIN_PARAM_TYPES and isinstance(value, jaxpr_types):
            out.append((Sub(key, None, _label(eqn, key, None)), value))
    return out


# Param value types that are never (and never hold) a jaxpr: skipped fast.
_PLAIN_PARAM_TYPES = {type(None), bool, int, float, str, tuple, list}


def register_plain_param_type(t: type) -> None:
    """Declare that params of type ``t`` never are nor hold a jaxpr (a
    record taxpr keeps in its own primitives' params), so that ``subjaxprs``
    does not look into them."""
    _PLAIN_PARAM_TYPES.add(t)


def effects_of(jaxprs) -> set:
    out: set = set()
    for j in jaxprs:
        out |= set(j.effects)
    return out


def with_subjaxprs(eqn: core.JaxprEqn, new: dict[tuple[str, int | None], Any],
                   **param_updates) -> core.JaxprEqn:
    """``eqn`` with some sub-jaxprs replaced (and its effects recomputed)."""
    params = dict(eqn.params)
    old_subs, new_subs = [], []
    for (key, index), value in new.items():
        old = params[key]
        if index is None:
            old_subs.append(old)
            params[key] = value
        else:
            old_subs.append(old[index])
            items = list(old)
            items[index] = value
            params[key] = type(old)(*items) if hasattr(old, "_fields") else type(old)(items)
        new_subs.append(value)
    params.update(param_updates)
    # Compare the effects of all sub-jaxprs, not only the replaced ones: an
    # effect that a replaced jaxpr lost may still come from another one.
    unchanged = [sj for sub, sj in subjaxprs(eqn) if (sub.key, sub.index) not in new]
    return eqn.replace(params=params, effects=_changed_effects(
        eqn.effects, effects_of([*old_subs, *unchanged]), effects_of([*new_subs, *unchanged])))


def _changed_effects(effects, old: set, new: set):
    """``effects`` minus what only ``old`` had, plus what only ``new`` has.

    Effects both had are left as the owner has them: e.g. run_state's body
    effects on its own refs are not effects of the run_state equation."""
    if old == new:
        return effects
    return (set(effects) - (old - new)) | (new - old)


def hi_name(eqn: core.JaxprEqn) -> str:
    """The operation's name, as JAX prints it (``CustomRoot``, ``Scan3``, ...)."""
    return type(eqn.params["_prim"]).__name__


def hidden_jaxprs(eqn: core.JaxprEqn, in_functions: bool = False) -> Iterator[Any]:
    """The jaxprs a ``call_hi_primitive`` equation holds in its object's
    params; with ``in_functions``, also those in the closures of functions
    there (a closure-converted function of JAX's, such as custom_root's
    linearized ``f``: code JAX runs only in a derivative rule, so not part of
    what walks over the program see). A jaxpr held twice (a traced jaxpr and
    the function that evaluates it) is yielded once."""
    yielded: set[tuple[int, ...]] = set()
    for jaxpr in _jaxprs_in(eqn.params["_prim"], set(), in_functions):
        eqns = tuple(map(id, _jaxpr.jaxpr_parts(jaxpr).eqns))
        if eqns not in yielded:
            yielded.add(eqns)
            yield jaxpr


def _jaxprs_in(value: Any, seen: set, in_functions: bool) -> Iterator[Any]:
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, _compat.JAXPR_TYPES):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _jaxprs_in(v, seen, in_functions)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _jaxprs_in(v, seen, in_functions)
    elif isinstance(value, _compat.HI_PRIM_TYPE):
        yield from _jaxprs_in(value.params, seen, in_functions)
    elif _compat.TRACED_TYPE is not None and isinstance(value, _compat.TRACED_TYPE):
        yield value.jaxpr
    elif in_functions and isinstance(value, types.FunctionType):
        for cell in value.__closure__ or ():
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield from _jaxprs_in(contents, seen, in_functions)
    elif in_functions and isinstance(value, functools.partial):
        yield from _jaxprs_in((value.func, value.args, value.keywords), seen, in_functions)


def every_sub(eqn: core.JaxprEqn, path: tuple[str, ...], ctx: Any) -> Iterator[tuple[Sub, Any, Any]]:
    """``walk``'s default: every sub-jaxpr of ``eqn``, in param order, with
    the same ``ctx``."""
    for sub, sj in subjaxprs(eqn):
        yield sub, sj, ctx


def walk(jaxpr: Any, subs: Callable[[core.JaxprEqn, tuple[str, ...], Any],
                                    Iterable[tuple[Sub, Any, Any]]] = every_sub,
         ctx: Any = None, path: tuple[str, ...] = ()
         ) -> Iterator[tuple[core.JaxprEqn, tuple[str, ...], Any]]:
    """Every equation of ``jaxpr`` and of its nested jaxprs, in program order
    (an equation before those of its sub-jaxprs), as ``(eqn, path, ctx)``:
    the one walk of nested jaxprs that taxpr's walkers are clients of.

    Arguments:
        jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
        subs: ``subs(eqn, path, ctx)`` gives the sub-jaxprs of ``eqn`` to
            walk, in order, each with its ctx: ``(Sub, jaxpr, ctx)``. It is
            called once the consumer has handled ``eqn`` and is iterated
            lazily, one sub-jaxpr walked after each item: a generator
            prunes by skipping a sub-jaxpr, and its code after the last
            item runs after the last one was walked (to fold results).
        ctx: the context of ``jaxpr``'s own equations.
        path: the path of ``jaxpr``.

    Returns:
        An iterator; stopping early stops the walk.
    """
    for eqn in _jaxpr.jaxpr_parts(jaxpr).eqns:
        yield eqn, path, ctx
        for sub, sj, sub_ctx in subs(eqn, path, ctx):
            yield from walk(sj, subs, sub_ctx, path + (sub.label,))


def iter_eqns(jaxpr: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[core.JaxprEqn, tuple[str, ...]]]:
    """Every equation of ``jaxpr`` and its nested jaxprs, in program order,
    with the path of enclosing primitives."""
    hi = _compat.call_hi_primitive_p
    for eqn in _jaxpr.jaxpr_parts(jaxpr).eqns:
        yield eqn, path
        for sub, sj in subjaxprs(eqn):
            yield from iter_eqns(sj, path + (sub.label,))
        if hi is not None and eqn.primitive is hi:
            # A high-level primitive's jaxprs sit in an object (see _expand.py):
            # walked here, rewritten only after taxpr expands it.
            for sj in hidden_jaxprs(eqn):
                yield from iter_eqns(sj, path + (hi_name(eqn),))


def any_eqn(jaxpr: Any, pred: Callable[[core.JaxprEqn], bool]) -> bool:
    """Whether an equation of ``jaxpr`` or of its nested jaxprs satisfies ``pred``."""
    return any(pred(eqn) for eqn, _ in iter_eqns(jaxpr))


def holds(eqn: core.JaxprEqn, pred: Callable[[core.JaxprEqn], bool]) -> bool:
    """Whether an equation nested (at any depth) in ``eqn``'s jaxprs satisfies ``pred``."""
    return any(any_eqn(sj, pred) for _, sj in subjaxprs(eqn))


def recompute_effects(old_effects, old_eqns, new_eqns):
    """A jaxpr's effects after its equations changed: drop what only the old
    equations had, add what the new ones have."""
    return _changed_effects(old_effects, effects_of_eqns(old_eqns), effects_of_eqns(new_eqns))


def effects_of_eqns(eqns) -> set:
    out: set = set()
    for e in eqns:
        if e.effects:
            out |= set(e.effects)
    return out


def map_jaxpr(jaxpr: Any, rewrite_eqn: Callable, path: tuple[str, ...] = ()):
    """Rebuild ``jaxpr`` bottom-up.

    ``rewrite_eqn(eqn, path, env)`` returns None to keep ``eqn`` (after
    substituting ``env`` into its inputs and recursing into sub-jaxprs), or a
    list of replacement equations; it may bind ``env[outvar] = atom`` to
    forward a removed equation's outputs. Unchanged jaxprs are returned as
    the same object.
    """
    constvars, consts, invars, eqns, outvars, effects, dbg = _jaxpr.jaxpr_parts(jaxpr)
    env: dict = {}
    new_eqns = []
    changed = False
    for eqn in eqns:
        replaced = rewrite_eqn(eqn, path, env)
        if replaced is not None:
            new_eqns.extend(replaced)
            changed = True
            continue
        new = {}
        for sub, sj in subjaxprs(eqn):
            nj = map_jaxpr(sj, rewrite_eqn, path + (sub.label,))
            if nj is not sj:
                new[(sub.key, sub.index)] = nj
        if new:
            eqn = with_subjaxprs(eqn, new)
            changed = True
        if env and any(type(v) is core.Var and v in env for v in eqn.invars):
            eqn = eqn.replace(invars=[_sub(env, v) for v in eqn.invars])
            changed = True
        new_eqns.append(eqn)
    if not changed:
        return jaxpr
    outvars = [_sub(env, v) for v in outvars]
    effects = recompute_effects(effects, eqns, new_eqns)
    return _jaxpr.make_jaxpr_like(jaxpr, constvars, consts or [], invars, new_eqns,
                                   outvars, effects, dbg)


def _sub(env: dict, v: Any) -> Any:
    if type(v) is core.Var:
        return env.get(v, v)
    return v


# One jaxpr of a nested program, as the parts ``map_levels`` hands to a level
# rewrite (``consts`` is None for an open 0.10 jaxpr's free constvars).
Level = _jaxpr.JaxprParts


def map_levels(jaxpr: Any, rewrite_level: Callable[[Level, tuple[str, ...], bool], Level | None],
               path: tuple[str, ...] = ()) -> Any:
    """Rebuild ``jaxpr`` bottom-up, one whole jaxpr (level) at a time.

    Every nested jaxpr is rewritten first (a callee shared by several
    equations once, so it stays shared), then ``rewrite_level(level, path,
    is_top)`` may return a new ``Level`` for this jaxpr (or None to keep it).
    Unchanged jaxprs are returned as the same object.
    """
    return _map_levels(jaxpr, rewrite_level, path, True, IdMemo())


def _map_levels(jaxpr, rewrite_level, path, is_top, memo):
    constvars, consts, invars, eqns, outvars, effects, dbg = _jaxpr.jaxpr_parts(jaxpr)
    new_eqns = None
    for i, eqn in enumerate(eqns):
        new = {}
        for sub, sj in subjaxprs(eqn):
            mapped = memo.get_or_compute(sj, lambda: _map_levels(
                sj, rewrite_level, path + (sub.label,), False, memo))
            if mapped is not sj:
                new[(sub.key, sub.index)] = mapped
        if new:
            if new_eqns is None:
                new_eqns = list(eqns[:i])
            new_eqns.append(with_subjaxprs(eqn, new))
        elif new_eqns is not None:
            new_eqns.append(eqn)
    if new_eqns is not None:
        effects = recompute_effects(effects, eqns, new_eqns)
        eqns = new_eqns
    level = Level(constvars, consts, invars, eqns, outvars, effects, dbg)
    rewritten = rewrite_level(level, path, is_top)
    if rewritten is None:
        if new_eqns is None:
            return jaxpr
        rewritten = level
    return _jaxpr.make_jaxpr_like(jaxpr, rewritten.constvars, rewritten.consts or [],
                                   rewritten.invars, rewritten.eqns, rewritten.outvars,
                                   rewritten.effects, rewritten.debug_info)

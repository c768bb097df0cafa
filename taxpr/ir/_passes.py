"""Optimization passes on jaxprs, applied inside every nested jaxpr.

Each pass rewrites one jaxpr (a *level*) at a time; ``_traverse.map_levels``
(taxpr's one traversal) applies it bottom-up to every nested jaxpr (jit,
scan, while cond/body, cond branches, checkpoint, custom_jvp/vjp, shard_map,
...) and rebuilds the enclosing equations. A nested jaxpr keeps its exact
signature; only ``dead_code_elimination`` changes the signatures of nested
jaxprs, through JAX's own ``pe.dce_rules`` (which prune scan/while carries,
cond and jit outputs consistently).

Rules shared by every pass:

* an equation with effects, a callback, or a callee holding either is never
  removed, merged, moved or folded; tags (``tag``, ``tag_tangent``,
  ``tag_cotangent``) are never touched;
* a rewrite replaces a value only by one of exactly the same type (shape,
  dtype, weak type) and the same value for every input under IEEE rules
  (``x + 0.0`` is not ``x`` since ``-0.0 + 0.0 == +0.0``; ``x * 0`` is not
  ``0`` for NaN or inf).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from jax import lax
from .._jax.internals import core, pe
from .._jax.internals import lax_internal as _lax_internal

from .. import _compat, _jaxpr, _traverse
from .._collector import collector_paused
from .._traverse import Level
from ..primitives._tag import TAG_PRIMITIVES

__all__ = [
    "algebraic_simplification", "common_subexpression_elimination", "constant_fold",
    "copy_propagation", "dead_code_elimination", "optimize_jaxpr",
]

DEFAULT_MAX_CONSTANT_ELEMENTS = 1000
# Below this many equations a constant subgraph is evaluated op by op; above,
# it is compiled once (one XLA compile beats thousands of dispatches).
_EAGER_FOLD_MAX = 24
# Never evaluated at rewrite time: placement / sharding and stateful RNG.
# By name: several of these exist only in some JAX versions.
_NEVER_FOLD = frozenset({
    "device_put", "sharding_constraint", "mesh_cast", "reshard", "rng_uniform",
    "optimization_barrier", "pcast", "pvary", "axis_index", "create_token", "after_all",
})
_NEVER_CSE = frozenset({"rng_uniform", "optimization_barrier"})


# ---- purity --------------------------------------------------------------------

class _Purity:
    """Whether an equation may be removed, merged or evaluated: no effects,
    no callback and no tag in it or in any jaxpr it calls (memoized per
    callee, so a callee shared by many calls is scanned once)."""

    def __init__(self):
        self._callees = _traverse.IdMemo()  # sub-jaxpr -> whether it is impure

    def impure(self, eqn: core.JaxprEqn) -> bool:
        if eqn.effects or eqn.primitive in TAG_PRIMITIVES or "callback" in eqn.primitive.name:
            return True
        for _, sj in _traverse.subjaxprs(eqn):
            if self._callees.get_or_compute(
                    sj, lambda: any(self.impure(e) for e in _jaxpr.jaxpr_parts(sj).eqns)):
                return True
        return False


class _RoundReport:
    """Whether a round of the default passes (constant folding, the forward
    walk, DCE) left work for a next round. Each pass leaves a jaxpr it would
    not change again, so the next round finds work only where a pass gave an
    earlier one new work; ``reopened`` is set for each way that can happen:

    * folding: a constant is an integer divisor (neither folded nor accepted
      as a divisor by folding, which depends on the equations around it, and
      DCE or the walk may remove some), or a constant equation with several
      outputs stays because one of its used outputs cannot be materialized
      (that use may be dead code);
    * the walk: a variable replaced by a literal, or a ``select_n`` of equal
      operands replaced by its operand (possibly a constant selected by a
      non-constant predicate): their uses may now have only constant inputs;
    * DCE: an equation rewritten by a DCE rule (a call whose pruned inputs
      or outputs leave it with only constant inputs, or equal to another
      call), or an impure equation removed (the jaxpr calling it may now be
      pure). Removing pure equations gives no pass new work.
    """

    __slots__ = ("reopened",)

    def __init__(self):
        self.reopened = False


def _is_collective(eqn: core.JaxprEqn) -> bool:
    return "axis_name" in eqn.params or "axis_index_groups" in eqn.params


# ---- small helpers ---------------------------------------------------------------

def _subst(env: dict, atoms: Sequence[Any]) -> list:
    return [a if isinstance(a, core.Literal) else env.get(a, a) for a in atoms]


def _subst_eqn(env: dict, eqn: core.JaxprEqn) -> core.JaxprEqn:
    if env:
        literal = core.Literal
        for a in eqn.invars:
            if not isinstance(a, literal) and a in env:
                return eqn.replace(invars=_subst(env, eqn.invars))
    return eqn


def _literal_value(lit: core.Literal) -> np.ndarray:
    return np.asarray(lit.val, dtype=lit.aval.dtype)




def _literal_key(lit: core.Literal) -> tuple:
    """Literals compare by value, bit for bit (so -0.0 differs from 0.0 and
    NaN equals the same NaN), and by dtype, weak type and shape."""
    v = lit.val
    aval = lit.aval
    weak = bool(getattr(aval, "weak_type", False))
    if type(v) is float:  # hex is exact and tells -0.0 from 0.0
        return ("float", aval.dtype, weak, v.hex())
    if type(v) in (int, bool):
        return ("int", aval.dtype, weak, v)
    if not (type(v) is np.ndarray and v.dtype == aval.dtype):
        v = _literal_value(lit)
    return ("literal", aval.dtype, weak, v.shape, v.tobytes())


def _finish(level: Level, eqns: list, outvars: list, *, constvars=None,
            consts=None) -> Level:
    effects = _traverse.recompute_effects(level.effects, level.eqns, eqns)
    return level._replace(
        eqns=eqns, outvars=outvars, effects=effects,
        constvars=level.constvars if constvars is None else constvars,
        consts=level.consts if consts is None else consts)


def _size(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) if aval.shape else 1


def _apply(jaxpr: Any, rewrite_level: Callable) -> Any:
    return _traverse.map_levels(jaxpr, rewrite_level)


# ---- copy propagation --------------------------------------------------------------

def _identity_dims(dims, rank: int) -> bool:
    return tuple(dims) == tuple(range(rank))


# Per Primitive: whether an equation of it (one input and output of the same
# type) returns its input unchanged, given ``(params, input aval, n_inputs)``.
_COPY_RULES: dict[core.Primitive, Callable[[dict, Any, int], bool]] = {
    _lax_internal.copy_p: lambda p, a, n: True,
    lax.convert_element_type_p: lambda p, a, n: p.get("sharding") is None,
    lax.reshape_p: lambda p, a, n: p.get("dimensions") is None and n == 1,
    lax.squeeze_p: lambda p, a, n: tuple(p.get("dimensions", ())) == (),
    lax.broadcast_in_dim_p: lambda p, a, n: (
        n == 1 and p.get("sharding") is None
        and _identity_dims(p["broadcast_dimensions"], len(a.shape))),
    lax.transpose_p: lambda p, a, n: _identity_dims(p["permutation"], len(a.shape)),
    lax.rev_p: lambda p, a, n: tuple(p["dimensions"]) == (),
    lax.slice_p: lambda p, a, n: (
        all(s == 0 for s in p["start_indices"]) and tuple(p["limit_indices"]) == tuple(a.shape)
        and (p.get("strides") is None or all(s == 1 for s in p["strides"]))),
}


def _is_copy(eqn: core.JaxprEqn) -> bool:
    """An equation whose single output is its first input, bit for bit and
    with the same type."""
    if len(eqn.outvars) != 1 or not eqn.invars:
        return False
    x = eqn.invars[0]
    if x.aval != eqn.outvars[0].aval:
        return False
    rule = _COPY_RULES.get(eqn.primitive)
    return rule is not None and rule(eqn.params, x.aval, len(eqn.invars))


def _forward_level(purity: _Purity, copies: bool = False, algebra: bool = False,
                   cse: bool = False, report: _RoundReport | None = None):
    """One forward walk over a level doing any of copy propagation,
    algebraic simplification and CSE (the default pipeline does all three in
    one walk; each is a legal rewrite on its own, so their interleaving is
    too). A removed output is replaced, through ``env``, by an atom that is
    already resolved, so each use is substituted once (linear time)."""
    def rewrite(level: Level, path, is_top) -> Level | None:
        env: dict = {}  # removed output -> the atom it equals
        splats: dict = {}  # var -> value, for broadcast literals
        producers: dict = {}  # var -> its (pure, single-output) equation
        seen: dict = {}  # CSE key -> first equation
        eqns = []
        for eqn in level.eqns:
            eqn = _subst_eqn(env, eqn)
            if not eqn.outvars or purity.impure(eqn):
                eqns.append(eqn)
                continue
            single = len(eqn.outvars) == 1 and not eqn.primitive.multiple_results
            if copies and _is_copy(eqn):
                env[eqn.outvars[0]] = eqn.invars[0]
                if report is not None and isinstance(eqn.invars[0], core.Literal):
                    report.reopened = True
                continue
            if algebra and single:
                repl = _simplify(eqn, splats, producers)
                if repl is not None:
                    env[eqn.outvars[0]] = repl
                    if report is not None and (isinstance(repl, core.Literal)
                                               or eqn.primitive is lax.select_n_p):
                        report.reopened = True
                    continue
                producers[eqn.outvars[0]] = eqn
                if (eqn.primitive is lax.broadcast_in_dim_p and len(eqn.invars) == 1
                        and isinstance(eqn.invars[0], core.Literal)):
                    splats[eqn.outvars[0]] = _scalar(eqn.invars[0], splats)
            if (cse and eqn.primitive.name not in _NEVER_CSE
                    and not eqn.params.get("prevent_cse", False)):
                key = _cse_key(eqn)
                if key is not None:
                    try:
                        first = seen.get(key)
                    except Exception:  # a param whose == is not a bool (arrays)
                        first = key = None
                    if first is not None and all(
                            a.aval == b.aval for a, b in zip(first.outvars, eqn.outvars)):
                        for old, new in zip(eqn.outvars, first.outvars):
                            env[old] = new
                        continue
                    if key is not None:
                        seen[key] = eqn
            eqns.append(eqn)
        if not env:
            return None
        return _finish(level, eqns, _subst(env, level.outvars))
    return rewrite


def copy_propagation(jaxpr: Any) -> Any:
    """Remove identity equations (``copy``, same-type ``convert_element_type``,
    same-shape ``reshape``, identity ``broadcast_in_dim`` / ``transpose`` /
    ``squeeze`` / ``slice`` / ``rev``) and use their input instead.

    Arguments:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.

    Returns:
      The same kind of jaxpr (the same object when nothing changed). Linear
      time: replaced variables are resolved once, through one map.
    """
    return _apply(jaxpr, _forward_level(_Purity(), copies=True))


# ---- algebraic simplification ------------------------------------------------------

def _scalar(atom: Any, splats: dict) -> float | int | None:
    """The value of ``atom`` as a Python number when it is a literal (or a
    broadcast literal) with one value; None otherwise. Values are compared
    before rounding to the dtype, which can only miss a rewrite."""
    if not isinstance(atom, core.Literal):
        return splats.get(atom)
    v = atom.val
    if type(v) in (float, int):
        return v
    a = np.asarray(v)
    if a.size != 1 or a.dtype.kind not in "fiuV":
        return None
    x = a.reshape(())
    return int(x) if a.dtype.kind in "iu" else float(x)


def _is_one(v) -> bool:
    return v is not None and v == 1


def _is_pos_zero(v) -> bool:  # +0.0 (or integer 0)
    return v is not None and v == 0 and math.copysign(1.0, v) > 0


def _is_neg_zero(v) -> bool:  # -0.0 (or integer 0)
    return v is not None and v == 0 and (type(v) is int or math.copysign(1.0, v) < 0)


# ---- algebraic identities: one rule per Primitive --------------------------------
#
# A rule returns the atom equal to the single output of ``eqn`` (``_simplify``
# then checks its type), or None. Binary rules take ``(eqn, x_value,
# y_value, producers)``: the scalar values of the two operands where they are
# known (literals, splats), else None; the others ``(eqn, producers)``, the
# equations that computed each variable so far.

def _add(eqn, vx, vy, producers):  # x + (-0.0) == x; x + 0.0 is not (-0.0 + 0.0 == 0.0)
    x, y = eqn.invars
    return x if _is_neg_zero(vy) else y if _is_neg_zero(vx) else None


def _sub(eqn, vx, vy, producers):  # x - 0.0 == x, also for x = -0.0
    return eqn.invars[0] if _is_pos_zero(vy) else None


def _mul(eqn, vx, vy, producers):
    x, y = eqn.invars
    return x if _is_one(vy) else y if _is_one(vx) else None


def _div(eqn, vx, vy, producers):
    return eqn.invars[0] if _is_one(vy) else None


def _idempotent(eqn, vx, vy, producers):  # max(x, x), min, and, or
    x, y = eqn.invars
    return x if x is y else None


def _involution(eqn, producers):  # neg(neg(x)), not(not(x))
    if len(eqn.invars) != 1 or isinstance(eqn.invars[0], core.Literal):
        return None  # a literal: an earlier rewrite made it one (unhashable)
    x = eqn.invars[0]
    inner = producers.get(x)
    return inner.invars[0] if inner is not None and inner.primitive is eqn.primitive else None


def _integer_pow(eqn, producers):
    return eqn.invars[0] if eqn.params.get("y") == 1 else None


def _select_n(eqn, producers):  # select_n(p, x, x, ...) == x
    if len(eqn.invars) < 2:
        return None
    cases = eqn.invars[1:]
    if all(c is cases[0] for c in cases[1:]) and not isinstance(cases[0], core.Literal):
        return cases[0]
    return None


_BINARY_RULES: dict[core.Primitive, Callable] = {
    lax.add_p: _add, lax.sub_p: _sub, lax.mul_p: _mul, lax.div_p: _div,
    lax.max_p: _idempotent, lax.min_p: _idempotent, lax.and_p: _idempotent,
    lax.or_p: _idempotent,
}
_OTHER_RULES: dict[core.Primitive, Callable] = {
    lax.neg_p: _involution, lax.not_p: _involution, lax.integer_pow_p: _integer_pow,
    lax.select_n_p: _select_n,
}


def _simplify(eqn: core.JaxprEqn, splats: dict, producers: dict) -> Any | None:
    """The atom equal to ``eqn``'s single output, or None."""
    binary = _BINARY_RULES.get(eqn.primitive)
    if binary is not None:
        if len(eqn.invars) != 2:
            return None
        x, y = eqn.invars
        atom = binary(eqn, _scalar(x, splats), _scalar(y, splats), producers)
    else:
        rule = _OTHER_RULES.get(eqn.primitive)
        if rule is None:
            return None
        atom = rule(eqn, producers)
    return atom if atom is not None and atom.aval == eqn.outvars[0].aval else None


def algebraic_simplification(jaxpr: Any) -> Any:
    """Apply the algebraic identities that hold bit for bit under IEEE rules
    and keep the exact type: ``x * 1``, ``x / 1``, ``x - 0.0``,
    ``x + (-0.0)``, ``x ** 1`` (``integer_pow``), ``neg(neg(x))``,
    ``not(not(x))``, ``max(x, x)``, ``min(x, x)``, ``and(x, x)``,
    ``or(x, x)`` and ``select_n(p, x, x)`` become ``x`` (a literal operand
    may be broadcast). Never ``x + 0.0`` (``-0.0``), ``x * 0`` (NaN, inf), or
    a rewrite whose result type differs from the original output (e.g.
    ``mul`` of a bfloat16 ``x`` into float32).

    Arguments:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.

    Returns:
      The same kind of jaxpr.
    """
    return _apply(jaxpr, _forward_level(_Purity(), algebra=True))


# ---- common subexpression elimination ----------------------------------------------

def _cse_key(eqn: core.JaxprEqn) -> tuple | None:
    literal = core.Literal
    ins = tuple([_literal_key(a) if isinstance(a, literal) else a for a in eqn.invars])
    try:
        params = tuple(eqn.params.items())
        hash(params)
    except TypeError:
        return None
    return (eqn.primitive, params, ins)


def common_subexpression_elimination(jaxpr: Any) -> Any:
    """Merge equations that apply the same primitive with the same params to
    the same inputs (literals compared by value, dtype and weak type) into
    the first of them. Equations with effects, callbacks (also inside a
    called jaxpr), tags and ``prevent_cse`` checkpoints are never merged.

    Arguments:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.

    Returns:
      The same kind of jaxpr.
    """
    return _apply(jaxpr, _forward_level(_Purity(), cse=True))


# ---- dead code elimination -----------------------------------------------------------

def _eqn_count(eqns) -> int:
    """The equations ``eqns`` and those of their nested jaxprs."""
    return len(eqns) + sum(1 for eqn in eqns for _, sj in _traverse.subjaxprs(eqn)
                           for _ in _traverse.walk(sj))


def _dce_level(level: Level, path, is_top, purity: _Purity | None = None,
               report: _RoundReport | None = None) -> Level | None:
    free_constvars = level.consts is None  # an open 0.10 jaxpr's constvars are its inputs
    used_consts, eqns, effects = _jaxpr.dce_level(
        [] if free_constvars else level.constvars,
        [*level.constvars, *level.invars] if free_constvars else level.invars,
        level.eqns, level.outvars, level.effects, level.debug_info)
    dropped_consts = not free_constvars and not all(used_consts)
    if not dropped_consts and len(eqns) == len(level.eqns) and (
            all(a is b for a, b in zip(eqns, level.eqns))
            or _eqn_count(eqns) == _eqn_count(level.eqns)):
        return None
    if report is not None and not report.reopened:
        report.reopened = _dce_reopens(level.eqns, eqns, purity)
    constvars, consts = level.constvars, level.consts
    if dropped_consts:
        constvars = [v for v, u in zip(level.constvars, used_consts) if u]
        consts = [c for c, u in zip(level.consts, used_consts) if u]
    return level._replace(constvars=constvars, consts=consts, eqns=list(eqns),
                          effects=effects)


def _dce_reopens(before: list, after: Sequence, purity: _Purity) -> bool:
    """Whether DCE, turning ``before`` into ``after``, rewrote an equation or
    removed an impure one (``_RoundReport``). ``after`` is a subsequence of
    ``before`` (the same objects, in order) when DCE only removed pure
    equations."""
    k, n = 0, len(after)
    for eqn in before:
        if k < n and after[k] is eqn:
            k += 1
        elif purity.impure(eqn):
            return True
    return k != n


def dead_code_elimination(jaxpr: Any) -> Any:
    """Remove equations whose outputs are unused, in every nested jaxpr, with
    JAX's own ``pe.dce_jaxpr`` (its rules also drop unused scan/while carries
    and cond/jit outputs). Equations with effects and every tag are kept;
    the signature of ``jaxpr`` is kept (unused consts of a closed jaxpr are
    dropped).

    Arguments:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.

    Returns:
      The same kind of jaxpr.
    """
    return _dead_code_elimination(jaxpr)


@contextlib.contextmanager
def _dce_rules_replaced(prims: Sequence[core.Primitive],
                        make_rule: Callable[[Callable | None], Callable]) -> Iterator[None]:
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


def _keep_in_dce(prims: Sequence[core.Primitive]) -> contextlib.AbstractContextManager[None]:
    """A context in which ``pe.dce_jaxpr`` keeps every equation of ``prims``
    (their previous DCE rules are restored on exit)."""
    keep_all = _compat.dce_rule_arity_adapter(
        lambda used_outputs, eqn: ([True] * len(eqn.invars), eqn))
    return _dce_rules_replaced(prims, lambda old: keep_all)


@contextlib.contextmanager
def _keep_unused_in_dce(prims: Sequence[core.Primitive],
                       keep: Callable[[core.JaxprEqn], bool]) -> Iterator[None]:
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
    _compat.clear_dce_caches()
    try:
        with _dce_rules_replaced(prims, make_rule):
            yield
    finally:
        _compat.clear_dce_caches()


def _dead_code_elimination(jaxpr: Any, report: _RoundReport | None = None) -> Any:
    # An unused call of a jaxpr holding a tag (a cond with tags in its
    # branches, ...) is kept whole: JAX's rules would drop it, tags and all.
    purity = _Purity()
    callers: set = set()
    seen: set = set()

    def subs(eqn, path, ctx):  # primitives that call a jaxpr (each callee walked once)
        for sub, sj in _traverse.subjaxprs(eqn):
            callers.add(eqn.primitive)
            if id(sj) not in seen:
                seen.add(id(sj))
                yield sub, sj, ctx

    for _ in _traverse.walk(jaxpr, subs):
        pass
    callers -= TAG_PRIMITIVES
    with _keep_in_dce(sorted(TAG_PRIMITIVES, key=lambda p: p.name)), \
            _keep_unused_in_dce(sorted(callers, key=lambda p: p.name), purity.impure):
        if report is None:
            return _apply(jaxpr, _dce_level)
        return _apply(jaxpr, lambda level, path, is_top: _dce_level(
            level, path, is_top, purity, report))


# ---- constant folding -------------------------------------------------------------------

# Whether a dtype is extended (PRNG keys), per dtype: asked for every
# folding candidate.
_EXTENDED_DTYPE: dict[Any, bool] = {}


def _is_plain_array_aval(aval: Any) -> bool:
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
    if _jaxpr.varying_axes(aval):
        return False
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not getattr(mesh, "empty", True):
        return False
    return True


def _has_aval_sharding_param(params: dict) -> bool:
    """Whether an equation's params pin a sharding/device (never folded)."""
    for key in ("sharding", "devices", "out_sharding"):
        v = params.get(key)
        if v is not None and not (isinstance(v, (tuple, list)) and all(x is None for x in v)):
            return True
    return False


def _fold_level(purity: _Purity, max_elements: int, report: _RoundReport | None = None):
    def rewrite(level: Level, path, is_top) -> Level | None:
        can_add_consts = is_top and level.consts is not None
        known: dict = {}  # constvar -> value (consts small enough to fold)
        if level.consts is not None:
            for v, c in zip(level.constvars, level.consts):
                if (not isinstance(c, core.Tracer) and _is_plain_array_aval(v.aval)
                        and _size(v.aval) <= max_elements):
                    known[v] = c
        constant = set(known)
        foldable = []
        for i, eqn in enumerate(level.eqns):
            if all(isinstance(a, core.Literal) or a in constant for a in eqn.invars) \
                    and _foldable(eqn, purity, max_elements):
                foldable.append(i)
                constant.update(eqn.outvars)
        if not foldable:
            return None
        folded_idx = set(foldable)
        # Backwards: a folded value used by a kept equation (or returned) is
        # materialized as a literal (scalars) or a new const (top level);
        # where it cannot be, its equation stays and needs its inputs.
        needed: set = {v for v in level.outvars if not isinstance(v, core.Literal)}
        # Never turn an integer divisor into a literal (it may be 0: XLA traps).
        int_divisors = {e.invars[1] for e in level.eqns if e.primitive in (lax.div_p, lax.rem_p)
                        and not isinstance(e.invars[1], core.Literal)
                        and e.invars[1].aval.dtype.kind in "iub"}
        if report is not None and int_divisors and not int_divisors.isdisjoint(constant):
            report.reopened = True
        materialize: list = []
        for i in range(len(level.eqns) - 1, -1, -1):
            eqn = level.eqns[i]
            if i in folded_idx:
                outs = [v for v in eqn.outvars if v in needed]
                if all(_materializable(v, can_add_consts) and v not in int_divisors
                       for v in outs):
                    materialize.extend(outs)
                    continue
                folded_idx.discard(i)
                if report is not None and len(eqn.outvars) > 1:
                    report.reopened = True
            needed.update(a for a in eqn.invars if not isinstance(a, core.Literal))
        if not folded_idx:
            return None
        # Constvars still needed by kept equations or outputs stay. A folded
        # equation may use the value of a constant one that stays (an
        # integer divisor, a value that cannot be materialized): every
        # constant equation is offered to the evaluation, which keeps those
        # the materialized values need.
        values = _evaluate([level.eqns[i] for i in foldable], known, materialize)
        env: dict = {}
        constvars, consts = list(level.constvars), level.consts
        for v, val in zip(materialize, values):
            if v.aval.shape == ():
                env[v] = _jaxpr.literal(val, v.aval)
            else:
                nv = _jaxpr.new_var(v.aval)
                constvars.append(nv)
                consts = [*consts, np.asarray(val, dtype=v.aval.dtype)]
                env[v] = nv
        eqns = [_subst_eqn(env, e) for i, e in enumerate(level.eqns) if i not in folded_idx]
        return _finish(level, eqns, _subst(env, level.outvars), constvars=constvars,
                       consts=consts)
    return rewrite


def _materializable(v, can_add_consts: bool) -> bool:
    return v.aval.shape == () or can_add_consts


def _foldable(eqn: core.JaxprEqn, purity: _Purity, max_elements: int) -> bool:
    if eqn.primitive.name in _NEVER_FOLD or _is_collective(eqn):
        return False
    if _has_aval_sharding_param(eqn.params) or purity.impure(eqn):
        return False
    if eqn.primitive in (lax.div_p, lax.rem_p) and not _nonzero_int_divisor(eqn):
        # XLA's compile-time evaluator traps (SIGFPE) on integer x / 0.
        return False
    return all(_is_plain_array_aval(v.aval) and _size(v.aval) <= max_elements
               for v in eqn.outvars)


def _nonzero_int_divisor(eqn: core.JaxprEqn) -> bool:
    """A float division, or an integer one by a literal without zeros."""
    d = eqn.invars[1]
    if d.aval.dtype.kind not in "iub":
        return True
    return isinstance(d, core.Literal) and bool(np.all(_literal_value(d) != 0))


def _evaluate(eqns: list, known: dict, outs: list) -> list:
    """The values of ``outs`` computed by the constant equations ``eqns``
    (inputs: literals and ``known`` consts): one compiled computation, or op
    by op when there are only a few equations."""
    if not outs:
        return []
    used_known = []
    seen: set = set()
    for e in eqns:
        for a in e.invars:
            if not isinstance(a, core.Literal) and a in known and a not in seen:
                seen.add(a)
                used_known.append(a)
    effects = _traverse.effects_of_eqns(eqns)
    # Identical constant equations (e.g. the same constant built in every
    # iteration of an unrolled loop) are evaluated once.
    level = Level(used_known, list(known.get(v) for v in used_known), [], list(eqns),
                  list(outs), effects, _jaxpr.debug_info("constant_fold"))
    level = _forward_level(_Purity(), cse=True)(level, (), False) or level
    # The known consts enter as inputs: DCE keeps (and prunes) inputs the
    # same way on every JAX (0.12's moves constvars into the inputs).
    jaxpr = core.Jaxpr([], used_known, level.outvars, level.eqns, effects,
                       _jaxpr.debug_info("constant_fold"), _jaxpr.is_high(level.eqns))
    jaxpr, _ = _jaxpr.dce_jaxpr(jaxpr, [True] * len(outs))
    args = [known[v] for v in jaxpr.invars]
    if len(jaxpr.eqns) <= _EAGER_FOLD_MAX:
        values = core.eval_jaxpr(jaxpr, [], *args)
    else:
        values = jax.jit(lambda *a: core.eval_jaxpr(jaxpr, [], *a))(*args)
    fetched = _traverse.IdMemo()  # identical values (CSE'd equations) are fetched once
    return [fetched.get_or_compute(v, lambda: np.asarray(jax.device_get(v))) for v in values]


def constant_fold(jaxpr: Any, max_elements: int = DEFAULT_MAX_CONSTANT_ELEMENTS) -> Any:
    """Evaluate equations whose inputs are all constants, in every nested
    jaxpr, and use their values as literals (scalars) or, at the top level of
    a closed jaxpr, as new consts.

    Equations with effects, callbacks, tags, collectives and placement
    (``device_put``, sharding constraints) are never evaluated, nor any whose
    output has more than ``max_elements`` elements (so no large array is
    embedded in the program). All constant equations of a jaxpr are
    evaluated together, compiled once when there are many.

    Arguments:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
      max_elements: the largest folded value, in elements.

    Returns:
      The same kind of jaxpr.
    """
    return _apply(jaxpr, _fold_level(_Purity(), max_elements))


# ---- pipeline ---------------------------------------------------------------------------

def _simplify_copies_and_cse(jaxpr: Any, report: _RoundReport | None = None) -> Any:
    return _apply(jaxpr, _forward_level(_Purity(), copies=True, algebra=True, cse=True,
                                        report=report))


def _default_round(report: _RoundReport) -> list[Callable[[Any], Any]]:
    """The default passes, algebraic simplification, copy propagation and
    CSE done in one walk per jaxpr, reporting into ``report``."""
    return [
        lambda j: _apply(j, _fold_level(_Purity(), DEFAULT_MAX_CONSTANT_ELEMENTS, report)),
        lambda j: _simplify_copies_and_cse(j, report),
        lambda j: _dead_code_elimination(j, report),
    ]


PASSES: dict[str, Callable[[Any], Any]] = {
    "constant_fold": constant_fold,
    "algebraic_simplification": algebraic_simplification,
    "copy_propagation": copy_propagation,
    "common_subexpression_elimination": common_subexpression_elimination,
    "dead_code_elimination": dead_code_elimination,
}
DEFAULT_PASSES = tuple(PASSES)
_IDEMPOTENT = frozenset({*PASSES.values(), _simplify_copies_and_cse})


def optimize_jaxpr(jaxpr: Any, passes: Sequence[str | Callable] | None = None,
                   max_iterations: int = 3, validate: bool = False) -> Any:
    """Run ``passes`` (names or functions; default: constant folding,
    algebraic simplification, copy propagation, CSE, DCE) in order, repeated
    until an iteration changes nothing or ``max_iterations`` is reached. The
    default does the middle three in one walk per jaxpr, and stops after a
    round that left no pass new work (the next would change nothing); a
    built-in pass is never rerun on a jaxpr it returned (they are idempotent).

    Arguments:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
      passes: the passes, each a name in ``PASSES`` or a function from a
        jaxpr to a jaxpr of the same kind.
      max_iterations: the most rounds of all passes.
      validate: run ``check_jaxpr`` on the result (raises if ill-typed).

    Returns:
      The same kind of jaxpr.
    """
    unknown = [p for p in (passes or ()) if isinstance(p, str) and p not in PASSES]
    if unknown:
        raise ValueError(f"optimize_jaxpr: unknown passes {unknown}; known: {sorted(PASSES)}")
    # The default passes report whether a round left work for the next one
    # (``_RoundReport``): a round after one that ran every pass and left
    # none would change nothing, and is not run.
    report = _RoundReport() if passes is None else None
    if report is not None:
        fns = _default_round(report)
        idempotent = range(len(fns))
    else:
        fns = [PASSES[p] if isinstance(p, str) else p for p in passes]
        idempotent = [i for i, fn in enumerate(fns) if fn in _IDEMPOTENT]
    # A built-in pass is idempotent: it is not run again on a jaxpr it
    # produced (or left unchanged), e.g. DCE after a round whose other passes
    # changed nothing.
    with collector_paused():
        fixed: dict[int, Any] = {}  # pass index -> the jaxpr it last returned
        size = None
        for _ in range(max_iterations):
            before = jaxpr
            ran_every_pass = True
            if report is not None:
                report.reopened = False
            for i, fn in enumerate(fns):
                if fixed.get(i) is jaxpr:
                    ran_every_pass = False
                    continue
                jaxpr = fn(jaxpr)
                if i in idempotent:
                    fixed[i] = jaxpr
            if jaxpr is before or (report is not None and ran_every_pass
                                   and not report.reopened):
                break
            if size is None:
                size = _eqn_count(_jaxpr.jaxpr_parts(before).eqns)
            new_size = _eqn_count(_jaxpr.jaxpr_parts(jaxpr).eqns)
            if new_size == size:
                break
            size = new_size
    if validate:
        _jaxpr.check_jaxpr(jaxpr)
    return jaxpr

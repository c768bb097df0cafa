"""The ``tag`` primitive: an identity that marks a pytree of values.

Design (see docs/semantics.md, "How tags stay alive"):

* A plain tag (traced outside any taxpr transformation: nothing will
  consume it) has no effect and no DCE rule: tracing (make_jaxpr, jit, vmap,
  scan, cond, while) keeps an unused one, dead-code elimination drops it as
  it drops any unused value, and differentiation leaves it plain. So tags
  nothing consumes cost nothing: no dispatch cost (an effect turns off
  JAX's fast C++ dispatch path) and no blocked analysis of a traced body.
* A *kept* tag (``TagMeta.kept``) carries ``TagEffect``, which
  every control-flow primitive, partial evaluation and dead-code
  elimination preserve. Every tag traced under ``keep_tags()`` is kept
  (every taxpr transformation traces user code with it, and a user passing
  ``jax.make_jaxpr``'s result to ``inject`` uses it): then partial
  evaluation never drops, duplicates (``grad`` of ``checkpoint``) or hoists
  (``grad`` of ``scan``) them, also when their inputs are not
  differentiated.
* A transformation's result binds the tags it leaves (not its own) kept
  inside another transformation's trace, which may consume them, and plain
  elsewhere (``evaluated_here``), as if traced there.
* The tangent goes through ``tag_tangent_p`` (and the cotangent through
  ``tag_cotangent_p``) so that ``inject`` can give it the derivative of the
  injected program.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import sys
import weakref
from typing import Any, Callable, Iterator, NamedTuple

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .. import _compat, _jaxpr, _libraries, _traverse
from .._jax import flags
from .._jax.internals import config, core, effects, pe
from .._jax.internals import batching as _batching
from .._jax.flags import CARRY_SCOPE, KEEP_TAGS, VJP_SCOPES

# Users cannot pass param names with this prefix: taxpr's own record on a
# tag is the one param ``META``, a ``TagMeta``.
HIDDEN_PREFIX = "_taxpr_"
META = "_taxpr_meta"


class TagMeta(NamedTuple):
    """What taxpr records on a tag equation, kept apart from the params the
    user passed (``user_params``), in the one param ``META``.

    Fields:
        tree: the tagged pytree's structure.
        kept: the tag carries ``TagEffect`` (see the module docstring).
        batched: vmap batched one of its values.
        guard: for a guarded tag (see ``taxpr._guards``: its last operand is
            a boolean guard, true for the examples of a vmap that really
            execute the tag, in a cond branch or while body that vmap runs for
            every example because its predicate is batched), one record per
            vmap level that batched it since it was guarded, innermost first:
            ``(guard_batched, *value_batched)``; batched operands of a guarded
            tag have their batch axes in front, outermost first. ``None``
            for a tag without a guard.
        guard_from: the cond branches / while parts that guard it.
        fwd_scopes: the custom_vjp calls whose fwd was running when the tag
            was bound (see "custom_vjp scopes" below).
        replay_scope: the call whose bwd was.
        function_sites: the site keys of the tags the replayed call's
            function holds (see ``_FUNCTION_SITES``).
    """

    tree: Any = None
    kept: bool = False
    batched: bool = False
    guard: tuple | None = None
    guard_from: tuple = ()
    fwd_scopes: tuple = ()
    replay_scope: int | None = None
    function_sites: frozenset = frozenset()


_NO_META = TagMeta()
_traverse.register_plain_param_type(TagMeta)


def meta(params: dict) -> TagMeta:
    """taxpr's record on the tag with these params."""
    return params.get(META, _NO_META)


def with_meta(params: dict, **changes: Any) -> dict:
    """``params`` with the named fields of their ``TagMeta`` changed."""
    return {**params, META: meta(params)._replace(**changes)}


@contextlib.contextmanager
def keep_tags():
    """Bind every tag traced inside as a kept tag (with ``TagEffect``).

    taxpr's own transformations trace user code under this: JAX's partial
    evaluation then never hoists a tag out of a differentiated loop nor
    recomputes it in a checkpoint's backward pass, also for tags on values
    that are not differentiated (whose JVP rule never runs). Use it around
    ``jax.make_jaxpr`` when passing the result to ``inject`` yourself.

    ``jax.disable_jit()`` is off inside: under it ``lax.while_loop`` first
    runs the loop in Python and, when a traced predicate stops that attempt,
    stages the loop instead, leaving the attempt's tags in the trace as if
    they had run (a key drawn, a state written, a value sown once more than
    eagerly). So taxpr traces the program ``jax.jit`` would trace.
    """
    with KEEP_TAGS(True), jax.disable_jit(False):
        yield


def keeping_tags() -> bool:
    """Whether tags traced now are kept (inside ``keep_tags()``)."""
    return bool(KEEP_TAGS.value)


# closed jaxpr -> its plain version (None: it holds no kept tag).
_PLAIN_VERSIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def evaluated_here(closed: Any) -> Any:
    """A transformation's rewritten program ``closed``, as its call binds it
    now: as it is inside another taxpr transformation's trace (which may
    consume the tags left in it), else with those tags plain, as if traced
    outside (an effect reaching a top-level ``jax.jit`` turns off JAX's
    fast dispatch path, and ``jax.export`` refuses it)."""
    if KEEP_TAGS.value:
        return closed
    try:
        plain = _PLAIN_VERSIONS[closed]
    except KeyError:
        plain = _traverse.map_jaxpr(closed, _plain_tag)
        plain = _PLAIN_VERSIONS[closed] = None if plain is closed else plain
    return closed if plain is None else plain


def evaluated_fun(closed: Any) -> Callable:
    """``closed`` as a function that binds ``evaluated_here(closed)`` when it
    is called (a rule JAX runs later may run in another keep mode)."""
    return lambda *args: _jaxpr.jaxpr_as_fun(evaluated_here(closed))(*args)


def _plain_tag(eqn, path, env):
    if eqn.primitive is tag_p and meta(eqn.params).kept:
        return [eqn.replace(params=with_meta(eqn.params, kept=False),
                            effects=effects.no_effects)]
    return None


def _keeping_here(params: dict) -> bool:
    """Whether a tag bound now with ``params`` is kept: inside
    ``keep_tags()``, and not in a library's analysis trace
    (``_ANALYSIS_TRACES``) unless its ``op`` is told of untransformed use (a
    state access: the analysis keeps it, and evaluates it as it does a
    ``jax.debug.callback``, also inside a ``checkpoint`` or ``jit`` there)."""
    if not KEEP_TAGS.value:
        return False
    return not _libraries.in_analysis_trace() or _wants_to_be_told(params)



class TagEffect(effects.Effect):
    """Keeps a tag alive through partial evaluation (see module docstring).
    Every instance is equal (``jax.export`` serializes an effect by its
    class and rebuilds it with a nullary constructor)."""

    def __eq__(self, other):
        return type(other) is TagEffect

    def __hash__(self):
        return hash(TagEffect)

    def __repr__(self):
        return "TagEffect"

    __str__ = __repr__


tag_effect = TagEffect()
for _set in (
    effects.lowerable_effects,
    effects.control_flow_allowed_effects,
    effects.custom_derivatives_allowed_effects,
    effects.remat_allowed_effects,
    effects.partial_eval_kept_effects,
):
    _set.add_type(TagEffect)


def user_params(params: dict) -> dict:
    """The params a user passed to ``tag`` (taxpr's ``TagMeta`` removed)."""
    return {k: v for k, v in params.items() if k != META}


def is_guarded(params: dict) -> bool:
    """Whether a tag's last operand is a guard (see ``TagMeta.guard``)."""
    return meta(params).guard is not None


def n_values(params: dict, n_operands: int) -> int:
    """How many of a tag's operands are tagged values (not its guard)."""
    return n_operands - 1 if is_guarded(params) else n_operands


def unguarded(params: dict) -> dict:
    """``params`` without the guard's records (for the tangent tags)."""
    if not is_guarded(params):
        return params
    return with_meta(params, guard=None, guard_from=())


def _identity_impl(*args, **params):
    # Run eagerly (outside any trace, or under ``jax.disable_jit()``): an
    # ``op`` param may ask to be told (state: the user forgot uncurry).
    _tell_untransformed(params, "ran eagerly")
    return args[:n_values(params, len(args))]


def _wants_to_be_told(params: dict) -> bool:
    """Whether the ``op`` param wants ``on_untransformed`` calls."""
    return getattr(params.get("op"), "on_untransformed", None) is not None


def _tell_untransformed(params: dict, how: str) -> None:
    """Call the ``op`` param's ``on_untransformed(user_params, how)`` hook,
    if it has one: the tag ran or compiled with nothing rewriting it."""
    hook = getattr(params.get("op"), "on_untransformed", None)
    if hook is not None:
        hook(user_params(params), how)


def _tag_abstract_eval(*avals, **params):
    effs = {tag_effect} if meta(params).kept else effects.no_effects
    return list(avals[:n_values(params, len(avals))]), effs


class _TagPrimitive(Primitive):
    """The tag primitive: every bind runs the active ``guarding_tags``
    checks, including binds that evaluate a jaxpr holding tags (a library's
    backward pass replaying a traced loop body), not only ``tag`` calls."""

    def bind(self, *args, **params):
        if VJP_SCOPES.value is not None and KEEP_TAGS.value:
            params = _in_scopes(params)
        if _TAG_GUARDS.get():
            values = list(args[:n_values(params, len(args))])
            tree = meta(params).tree
            value = (jax.tree_util.tree_unflatten(tree, values)
                     if tree is not None and tree.num_leaves == len(values) else values)
            _run_guards(user_params(params), value)
        return super().bind(*args, **params)


# ---- custom_vjp scopes ------------------------------------------------------------
# A function differentiated inside a taxpr transformation's trace runs a
# custom_vjp's fwd there, and later (transposing) its bwd. A bwd that runs
# the function again (``jax.vjp(f)`` in it, equinox's checkpointed loops,
# diffrax's adjoints) recomputes the forward pass: the engine threads its
# tags as a replay (their writes to what the forward wrote are not applied
# again; see ``Engine.thread_site``). For that every tag bound while a fwd or
# bwd runs (traced, or bound again evaluating a jaxpr traced before) is
# marked with the call's scope, a number unique in the process. The scopes
# are part of JAX's trace context, so a trace cached in one scope is never
# reused in another.

class VjpScopes(NamedTuple):
    """The custom_vjp calls whose fwd runs (``fwd``) and the outermost one
    whose bwd runs (``replay``) where a tag is bound."""

    fwd: tuple[int, ...] = ()
    replay: int | None = None


_SCOPE_IDS = itertools.count(1)


@functools.lru_cache(maxsize=256)
def _parse_scopes(value: str) -> VjpScopes:
    fwd, replay = value.split("/")
    return VjpScopes(tuple(int(k) for k in fwd.split(",") if k),
                     int(replay) if replay else None)


def current_vjp_scopes() -> VjpScopes:
    """The scopes tags bound now are marked with."""
    value = VJP_SCOPES.value
    return VjpScopes() if value is None else _parse_scopes(value)


@contextlib.contextmanager
def _entered(scopes: VjpScopes) -> Iterator[None]:
    value = ",".join(map(str, scopes.fwd)) + "/" + (
        "" if scopes.replay is None else str(scopes.replay))
    with VJP_SCOPES(value):
        yield


def _in_scopes(params: dict) -> dict:
    scopes = current_vjp_scopes()
    before = meta(params)
    fwd = tuple(sorted({*before.fwd_scopes, *scopes.fwd}))
    replay = before.replay_scope
    if scopes.replay is not None:
        replay = scopes.replay if replay is None else min(replay, scopes.replay)
    marks = {}
    if fwd != before.fwd_scopes:
        marks["fwd_scopes"] = fwd
    if replay != before.replay_scope:
        marks["replay_scope"] = replay
        marks["function_sites"] = _FUNCTION_SITES.get(replay, frozenset())
    return with_meta(params, **marks) if marks else params


def site_key(params: dict) -> frozenset:
    """What identifies a tag's site across traces: its user params."""
    return frozenset(user_params(params).items())


# Per scope whose function is a traced jaxpr, the site keys of the tags in
# it: its fwd, evaluating that jaxpr, binds again only the tags outside
# nested jaxprs (a loop body traced before is bound whole), so the engine
# also counts as the forward's what sites with these keys write. Only a
# bwd of the scope reads it (to mark its tags), so a few are kept.
_FUNCTION_SITES: dict[int, frozenset] = {}


def _function_sites(fun: Any) -> frozenset:
    """The site keys of the tags in the jaxprs ``fun`` evaluates: the one it
    is a partial application of, else those its partial applications and
    closures hold (a library's custom_vjp of a body traced before, such as
    equinox's checkpointed loop, whose fwd binds the tags nested in that
    body's scans and checkpoints whole, unmarked)."""
    jaxpr = _jaxpr.called_jaxpr(fun)
    jaxprs = [jaxpr] if jaxpr is not None else _held_jaxprs(fun)
    if not jaxprs:
        return frozenset()
    return frozenset(site_key(e.params) for j in jaxprs for e, _ in _traverse.iter_eqns(j)
                     if e.primitive is tag_p)


# Objects ``_held_jaxprs`` does not look into: values, and JAX's tracers and
# traces (through them every jaxpr being traced is reachable).
_OPAQUE = (str, bytes, int, float, complex, bool, type(None), type, np.ndarray, np.generic,
           jax.Array, core.Tracer, core.Trace, type(sys))


_PyTreeDef = type(jax.tree_util.tree_structure(()))
_WrappedFun = _compat.WRAPPED_FUN_TYPE


def _held_jaxprs(root: Any, max_objects: int = 2048, max_depth: int = 12) -> list:
    """The jaxprs reachable from ``root`` (a ``lu.WrappedFun``) through
    containers, partial applications, closure cells and instance attributes,
    in a bounded look that runs no code of the user's (no properties, no
    ``__getattr__``)."""
    found: list = []
    seen: set[int] = set()
    todo: list = [(root, 0)]
    while todo and len(seen) < max_objects:
        obj, depth = todo.pop()
        if id(obj) in seen or depth > max_depth or isinstance(obj, _OPAQUE):
            continue
        seen.add(id(obj))
        if isinstance(obj, _compat.JAXPR_TYPES):
            found.append(obj)
            continue
        if isinstance(obj, (tuple, list, set, frozenset)):
            children = list(obj)
        elif isinstance(obj, dict):
            children = list(obj.values())
        elif isinstance(obj, _WrappedFun):  # (slots) its function, transforms' static args
            children = [obj.f, obj.transforms, obj.params]
        elif isinstance(obj, _PyTreeDef):  # static fields of pytree nodes (equinox Modules)
            children = [obj.node_data(), *obj.children()]
        elif isinstance(obj, functools.partial):
            children = [obj.func, *obj.args, *obj.keywords.values()]
        elif callable(obj) and hasattr(obj, "__code__"):  # a Python function
            children = [c.cell_contents for c in (obj.__closure__ or ())
                        if _cell_filled(c)]
        else:
            children = _instance_values(obj)
        todo.extend((c, depth + 1) for c in children)
    return found


def _instance_values(obj: Any) -> list:
    """``obj``'s instance attributes: its ``__dict__`` and its slots, read
    without running descriptors other than slots."""
    values = []
    try:
        values.extend(object.__getattribute__(obj, "__dict__").values())
    except AttributeError:
        pass
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            try:
                values.append(object.__getattribute__(obj, name))
            except AttributeError:  # an unset slot
                pass
    return values


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def scoped_fwd_bwd(fun: Any, fwd: Any, bwd: Any) -> tuple[Any, Any]:
    """A custom_vjp's fwd and bwd run in a new scope (inside a taxpr
    transformation's trace; elsewhere unchanged)."""
    if not KEEP_TAGS.value:
        return fwd, bwd
    k = next(_SCOPE_IDS)
    sites = _function_sites(fun)
    if sites:
        if len(_FUNCTION_SITES) > 256:
            _FUNCTION_SITES.pop(next(iter(_FUNCTION_SITES)))
        _FUNCTION_SITES[k] = sites

    def in_fwd():
        now = current_vjp_scopes()
        return _entered(now._replace(fwd=(*now.fwd, k)))

    def in_bwd():
        now = current_vjp_scopes()
        return _entered(now._replace(replay=k if now.replay is None else now.replay))

    return _compat.wrapped_fun_in(fwd, in_fwd), _compat.wrapped_fun_in(bwd, in_bwd)


def current_scope_key() -> Any:
    """The custom_vjp scopes and carried patches now (what a staged rule's
    trace depends on)."""
    return VJP_SCOPES.value, CARRY_SCOPE.value


tag_p = _TagPrimitive("tag")
tag_p.multiple_results = True
tag_p.def_impl(_identity_impl)
tag_p.def_effectful_abstract_eval(_tag_abstract_eval)

# The tangent of a tag: ``tag_tangent(*primals, *tangents) -> tangents``.
tag_tangent_p = Primitive("tag_tangent")
tag_tangent_p.multiple_results = True
# The cotangent of a tag: ``tag_cotangent(*primals, *cts) -> cts``.
tag_cotangent_p = Primitive("tag_cotangent")
# A tag and the halves JAX differentiates it into: what "a tag" means to a pass.
TAG_PRIMITIVES = frozenset({tag_p, tag_tangent_p, tag_cotangent_p})
tag_cotangent_p.multiple_results = True


def _second_half_impl(*args, **params):
    return args[len(args) // 2:]


def _second_half_abstract_eval(*avals, **params):
    return list(avals[len(avals) // 2:])


for _p in (tag_tangent_p, tag_cotangent_p):
    _p.def_impl(_second_half_impl)
    _p.def_abstract_eval(_second_half_abstract_eval)


# ---- autodiff -----------------------------------------------------------------

def _kept_if_consumed(params: dict) -> dict:
    """A differentiated tag is kept (its effect stops partial evaluation
    from dropping, hoisting or duplicating it) only inside a taxpr
    transformation's trace (``keep_tags()``), where something will consume
    it: an effect reaching a top-level ``jax.jit`` turns off JAX's fast
    dispatch path, which tags nothing consumes must not cost."""
    return (with_meta(params, kept=True) if not meta(params).kept and _keeping_here(params)
            else params)


def _tag_jvp(primals, tangents, **params):
    primals_out = tag_p.bind(*primals, **_kept_if_consumed(params))
    n = n_values(params, len(primals))
    primals, tangents = primals[:n], tangents[:n]  # a guard has no tangent
    if all(type(t) is ad.Zero for t in tangents):
        return primals_out, list(tangents)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    tangents_out = tag_tangent_p.bind(*primals, *tangents, **unguarded(params))
    return primals_out, tangents_out


ad.primitive_jvps[tag_p] = _tag_jvp


def _tag_transpose(cts, *args, **params):
    return list(cts) + [None] * (len(args) - len(cts))


ad.primitive_transposes[tag_p] = _tag_transpose


def _make_half_transpose(other):
    def transpose(cts, *args, **params):
        n = len(args) // 2
        primals = args[:n]
        if any(ad.is_undefined_primal(p) for p in primals):
            raise NotImplementedError(
                "taxpr: the derivative of a tag is not linear in its primal "
                f"(tag params {user_params(params)})")
        if all(type(ct) is ad.Zero for ct in cts):
            return [None] * n + list(cts)
        cts = [ad.instantiate_zeros(ct) for ct in cts]
        return [None] * n + list(other.bind(*primals, *cts, **params))
    return transpose


ad.primitive_transposes[tag_tangent_p] = _make_half_transpose(tag_cotangent_p)
ad.primitive_transposes[tag_cotangent_p] = _make_half_transpose(tag_tangent_p)


def _half_jvp(prim):
    def jvp(primals, tangents, **params):
        n = len(primals) // 2
        out = prim.bind(*primals, **params)
        # Linear in the second half; the first half only selects the rule.
        t_out = prim.bind(*primals[:n], *[ad.instantiate_zeros(t) for t in tangents[n:]],
                          **params)
        return out, t_out
    return jvp


ad.primitive_jvps[tag_tangent_p] = _half_jvp(tag_tangent_p)
ad.primitive_jvps[tag_cotangent_p] = _half_jvp(tag_cotangent_p)


# ---- batching -----------------------------------------------------------------

def _batch_values_alike(args, dims, params):
    """An ``op`` may ask that when vmap batches one of a tag's values, all
    are batched (``op.batches_values_alike(user_params)``): a ``sow_cond``
    whose predicate is per example sows a per-example value, even where the
    value itself is the same for every example."""
    alike = getattr(params.get("op"), "batches_values_alike", None)
    n = n_values(params, len(args))
    batched = [d is not None for d in dims[:n]]
    if alike is None or all(batched) or not any(batched) or not alike(user_params(params)):
        return args, dims
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    values = [_batching.bdim_at_front(a, d, size) for a, d in zip(args[:n], dims[:n])]
    return [*values, *args[n:]], [*([0] * n), *dims[n:]]


def _tag_batch(args, dims, **params):
    args, dims = _batch_values_alike(list(args), list(dims), params)
    if is_guarded(params):
        return _guarded_tag_batch(args, dims, **params)
    if any(d is not None for d in dims) and not meta(params).batched:
        params = with_meta(params, batched=True)
    return tag_p.bind(*args, **params), list(dims)


def _guarded_tag_batch(args, dims, **params):
    """Batched operands go to the front and the guard is batched always, so
    that the guard's axes line up with the leading axes of the values
    (``TagMeta.guard`` records which operands each level batched)."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    *values, guard = args
    *vdims, gdim = dims
    values = [x if d is None else _batching.moveaxis(x, d, 0) for x, d in zip(values, vdims)]
    guard = _batching.bdim_at_front(guard, gdim, size)
    record = (gdim is not None, *(d is not None for d in vdims))
    new = with_meta(params, guard=(*meta(params).guard, record),
                    batched=meta(params).batched or any(d is not None for d in vdims))
    outs = tag_p.bind(*values, guard, **new)
    return outs, [None if d is None else 0 for d in vdims]


batching.primitive_batchers[tag_p] = _tag_batch


def _make_half_batch(prim):
    def batch(args, dims, **params):
        n = len(args) // 2
        # Unbatched operands have batch dim None (batching.not_mapped) in both versions.
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        # Batch both halves alike so each primal leaf lines up with its tangent.
        args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]
        return prim.bind(*args, **params), [0] * (len(args) - n)
    return batch


batching.primitive_batchers[tag_tangent_p] = _make_half_batch(tag_tangent_p)
batching.primitive_batchers[tag_cotangent_p] = _make_half_batch(tag_cotangent_p)


# ---- rematerialization --------------------------------------------------------

def _tag_remat(*args, **params):
    """``jax_remat3``'s rule. Inside a taxpr transformation a tag whose
    ``op`` says how it is recomputed (``op.recomputed(saved, values)``: a
    state access reuses what the forward read, and a write passes its value
    on without writing again) runs once, in the forward pass, as JAX's
    partial evaluation does for effects under ``checkpoint``. Other tags (a
    sow, whose output carries the derivative its site rule gives) are bound
    again by the recomputation as a replay of the forward's (as a custom_vjp
    bwd's recomputation, see ``Engine.thread_site``): a sow there is not
    collected again. A tag nothing consumes is an identity, bound again."""
    if not _keeping_here(params):
        return tag_p.bind(*args, **params), None
    recomputed = getattr(params.get("op"), "recomputed", None)
    if recomputed is not None:
        n = n_values(params, len(args))
        return (tag_p.bind(*args, **params),
                lambda saved, *args_: recomputed(list(saved), list(args_[:n])))
    k = next(_SCOPE_IDS)
    before = meta(params)
    outs = tag_p.bind(*args, **with_meta(params, fwd_scopes=tuple(sorted({*before.fwd_scopes, k}))))
    replayed = with_meta(params, replay_scope=k if before.replay_scope is None
                         else min(k, before.replay_scope))
    return outs, lambda saved, *args_: tag_p.bind(*args_, **replayed)


_compat.register_remat_rule(tag_p, _tag_remat)


# ---- lowering, DCE, printing ----------------------------------------------------

def _tag_lowering(ctx, *args, **params):
    # A tag is an identity in compiled code.
    _tell_untransformed(params, "is being compiled")
    return list(args[:n_values(params, len(args))])


mlir.register_lowering(tag_p, _tag_lowering)
mlir.register_lowering(
    tag_tangent_p, lambda ctx, *args, **params: list(args[len(args) // 2:]))
mlir.register_lowering(
    tag_cotangent_p, lambda ctx, *args, **params: list(args[len(args) // 2:]))


def _tag_dce_rule(used_outputs, eqn):
    """A kept tag's effect keeps it through dead-code elimination (a
    ``set_state`` whose result is unused still happens). A plain tag, which
    nothing will consume, goes where its value goes, so that it blocks no
    analysis of a traced body (flax's ``nn.scan`` asks ``pe.dce_jaxpr`` which
    inputs its broadcast outputs need, as it does for flax's own ``sow``);
    except one whose ``op`` must be told when it is compiled untransformed
    (a ``set_state`` without ``uncurry`` warns)."""
    if any(used_outputs) or meta(eqn.params).kept or _wants_to_be_told(eqn.params):
        return [True] * len(eqn.invars), eqn
    return [False] * len(eqn.invars), None


_compat.register_dce_rule(tag_p, _tag_dce_rule)


def _tag_pp_rule(eqn, context, settings):
    """The user's params, and where a guard comes from (e.g.
    ``guarded_by=('cond[branch=1]',)``); not the rest of ``TagMeta``."""
    shown = user_params(eqn.params)
    if is_guarded(eqn.params):
        shown["guarded_by"] = meta(eqn.params).guard_from
        eqn = eqn.replace(params=shown)
    return core._pp_eqn(eqn, context, settings, params=sorted(shown))


for _p in (tag_p, tag_tangent_p, tag_cotangent_p):
    core.pp_eqn_rules[_p] = _tag_pp_rule


# ---- user API -------------------------------------------------------------------

def _check_params(params: dict) -> None:
    for key, value in params.items():
        if key.startswith(HIDDEN_PREFIX):
            raise TypeError(f"taxpr.tag: parameter names starting with "
                            f"{HIDDEN_PREFIX!r} are reserved: {key!r}")
        try:
            hash(value)
        except TypeError:
            raise TypeError(
                f"taxpr.tag: parameter {key!r} must be hashable, got "
                f"{type(value).__name__}: {value!r}") from None


# Checks that run on every tag bound by user code (``tag``) while they are
# active: each is ``check(user_params, value) -> Exception | None``.
_TAG_GUARDS: contextvars.ContextVar[tuple] = contextvars.ContextVar("taxpr_tag_guards",
                                                                    default=())


@contextlib.contextmanager
def guarding_tags(check: Callable[[dict, Any], Exception | None]) -> Iterator[None]:
    """Run ``check`` on every tag that user code binds inside this block and
    raise what it returns. A transformation wraps the user code that JAX runs
    after it rewrote the program (a derivative rule JAX calls when the
    rewritten program is differentiated): a tag it consumes there cannot be
    rewritten any more, and is an error at the place it is bound."""
    token = _TAG_GUARDS.set((*_TAG_GUARDS.get(), check))
    try:
        yield
    finally:
        _TAG_GUARDS.reset(token)


def _run_guards(params: dict, value: Any) -> None:
    for check in _TAG_GUARDS.get():
        error = check(params, value)
        if error is not None:
            raise error


# While a taxpr transformation traces a program: the params (as a frozenset
# of items) of every tag user code binds, with its value's avals.
_RECORDING: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "taxpr_recorded_tags", default=None)


@contextlib.contextmanager
def recording_tags() -> Iterator[dict]:
    """Record the tags user code binds in this block: ``{frozenset(params.items()):
    (params, avals)}``. A tag recorded but absent from the traced program was
    traced where taxpr cannot see (see ``taxpr._inject.trace_program``)."""
    recorded: dict = {}
    token = _RECORDING.set(recorded)
    try:
        yield recorded
    finally:
        _RECORDING.reset(token)


def _in_trace() -> bool:
    return not isinstance(core.trace_ctx.trace, core.EvalTrace)


def tag(value: Any, **params: Any) -> Any:
    """Mark ``value`` (a pytree of arrays) with ``params``.

    Arguments:
        value: a pytree of array-likes. Python scalars become arrays inside a
            trace, keeping their weak type.
        **params: hashable keyword arguments describing the tag.

    Returns:
        ``value`` unchanged (an identity), marked in any jaxpr traced from it.

    Raises:
        TypeError: a param value is unhashable (the message names the key).
    """
    _check_params(params)
    leaves, tree = jax.tree_util.tree_flatten(value)
    if not leaves:
        return value
    _run_guards(params, value)
    recorded = _RECORDING.get()
    if recorded is not None:
        key = frozenset(params.items())
        if key not in recorded:
            recorded[key] = (params, tree, [core.typeof(x) for x in leaves])
    if not _in_trace() and not any(isinstance(x, core.Tracer) for x in leaves):
        _tell_untransformed(params, "ran eagerly")
        return value
    params = {**params, META: TagMeta(tree, _keeping_here(params))}
    if _compat.eager_constant_folding():
        # Under ``jax.ensure_compile_time_eval()`` a trace evaluates a
        # primitive of constants at once: the tag would vanish from the
        # program (a state read would be the init, a write lost). A tag is
        # staged like an effect.
        with config.eager_constant_folding(False):
            out = tag_p.bind(*leaves, **params)
    else:
        out = tag_p.bind(*leaves, **params)
    return jax.tree_util.tree_unflatten(tree, out)


def _tag_partial_eval(trace, *tracers, **params):
    """Partial evaluation keeps a *kept* tag staged even when all its inputs
    are known, where JAX would otherwise run it a different number of times
    than eagerly: hoisted out of a differentiated ``scan`` (once instead of
    every step), or in both parts of a partially evaluated ``while``. Not
    while JAX linearizes from a JVP (a custom_jvp rule under ``grad``), whose
    primal outputs must stay known (see ``flags.staging_known_kept_tags``)."""
    if (meta(params).kept and flags.staging_known_kept_tags()
            and all(t.pval.is_known() for t in tracers)):
        tracers = [trace.instantiate_const(t) for t in tracers]
    return trace.default_process_primitive(tag_p, tracers, params)


pe.custom_partial_eval_rules[tag_p] = _tag_partial_eval


def holds_kept_tags(effects) -> bool:
    """Whether a jaxpr with these effects holds kept tags."""
    return any(isinstance(e, TagEffect) for e in effects)

# (``taxpr._patches`` puts its partial-evaluation rules of ``cond``,
# ``while`` and ``checkpoint``, which stage kept tags, in place of JAX's.)


def _tag_linearized_primal(*primals, **params):
    return tag_p.bind(*primals, **_kept_if_consumed(params))


def _tag_linearized_tangent(primals, tangents, nzs, **params):
    n = n_values(params, len(primals))
    primals, tangents, nzs = primals[:n], tangents[:n], nzs[:n]
    params = unguarded(params)
    if not any(nzs):
        return [ad.Zero(core.typeof(p).to_tangent_aval()) for p in primals]
    tangents = [ad.instantiate_zeros(t) if type(t) is not ad.Zero
                else ad.instantiate_zeros(ad.Zero(core.typeof(p).to_tangent_aval()))
                for p, t in zip(primals, tangents)]
    return tag_tangent_p.bind(*primals, *tangents, **params)


# Direct linearization (``jax.grad``): the primal tag is bound outside the
# partial evaluator, so it stays known while its kept copy is staged.
_compat.register_linearization(tag_p, _tag_linearized_primal, _tag_linearized_tangent)

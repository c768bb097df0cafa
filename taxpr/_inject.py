"""``inject`` and ``injected``: replace tags by calls to an injector that
threads a context through the whole program."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, NamedTuple

import jax
from ._jax.internals import core

from . import _jaxpr, _libraries, _traverse
from ._collector import collector_paused
from ._engine import (Engine, Hooks, InjectError, Level, describe_site, changed_positions,
                      describe_tag, format_path, inline, trace_in)
from ._find import Predicate
from ._expand import expand_for, hidden_tags, keeps_a_function
from .primitives._tag import (evaluated_fun, is_guarded, keep_tags, meta, n_values,
                              recording_tags, tag_cotangent_p, tag_p, user_params)

class Injected(NamedTuple):
    """What an injector returns: the tag's new value and the new context.

    taxpr passes a context in first and returns it last everywhere: an
    injector is called as ``injector(ctx, value, params)`` and returns
    ``Injected(value=..., ctx=...)``, as ``uncurry``'s
    ``pure(state, *args)`` returns ``(out, state)`` and ``inject``'s result
    maps ``(*ctx, *inputs)`` to ``(*outputs, *ctx)``. A plain
    ``(value, ctx)`` tuple is the same thing.

    Attributes:
        value: replaces the tagged value (same structure, shapes, dtypes).
        ctx: the context after this tag (same structure, shapes, dtypes).
    """

    value: Any
    ctx: Any


Injector = Callable[[Any, Any, dict], "Injected | tuple[Any, Any]"]


def _aval_str(a) -> str:
    return a.str_short() if hasattr(a, "str_short") else str(a)


class _InjectSites:
    """The site rule of ``inject``: inline the (cached) injector jaxpr."""

    def __init__(self, injector: Injector, ctx_tree, ctx_avals,
                 guard_merge: Callable | None = None, direct: Callable | None = None):
        self.injector = injector
        # An effect layer whose injector only moves values between the token
        # and ctx (the state layer) gives ``direct(params, ctx_atoms,
        # token_atoms) -> (new_token_atoms, new_ctx_atoms)``: its sites are
        # rewritten by substituting atoms, without tracing or inlining the
        # injector. Used only where the result has exactly the original
        # types (else, and for derivative / guarded / shard_map sites, the
        # traced injector runs as usual).
        self.direct = direct
        self._same: dict = {}
        # How a guarded site (see ``taxpr._guards``) that changes ctx merges
        # the new ctx: ``guard_merge(guard, old_leaves, new_leaves) -> leaves``
        # (traced); None: such a site is an InjectError.
        self.guard_merge = guard_merge
        # Refuse ctx changes computed from the token in a shard_map without
        # vma checking (off for the state layer's one-off run recording inits;
        # a predicate on the tag's eqn: only at the tags it selects).
        self.check_per_shard: bool | Callable[[core.JaxprEqn], bool] = True
        self.hooks = Hooks()  # how errors name the layer's sites (the engine's hooks)
        self.ctx_tree = ctx_tree
        self.ctx_avals = list(ctx_avals)
        self._traced: dict = {}

    # -- tracing the injector, once per signature --
    def _trace(self, kind: str, params: dict, tree, token_avals, path, context=None,
               batched: bool = False):
        key = (kind, tuple(sorted(params.items(), key=lambda kv: kv[0])), tree, token_avals,
               id(context), batched)
        hit = self._traced.get(key)
        if hit is not None:
            return hit
        nctx, ntok = len(self.ctx_avals), len(token_avals)
        ctx_tree, injector = self.ctx_tree, self.injector
        found: dict = {}

        def call(ctx, token):
            out = injector(ctx, token, dict(params))
            if not (isinstance(out, tuple) and len(out) == 2):
                raise InjectError(
                    f"taxpr.inject: the injector for {describe_site(params, path)} must return "
                    f"tx.Injected(value=..., ctx=...) (or a (value, ctx) tuple), got "
                    f"{type(out).__name__}")
            return out

        if kind == "primal":
            def flat(*leaves):
                ctx = jax.tree_util.tree_unflatten(ctx_tree, leaves[:nctx])
                token = jax.tree_util.tree_unflatten(tree, leaves[nctx:])
                new_token, new_ctx = call(ctx, token)
                tok_leaves, found["token"] = jax.tree_util.tree_flatten(new_token)
                ctx_leaves, found["ctx"] = jax.tree_util.tree_flatten(new_ctx)
                if len(tok_leaves) == ntok:
                    tok_leaves = [_jaxpr.cast_weak_type(x, a)
                                  for x, a in zip(tok_leaves, token_avals)]
                    if context is not None:
                        # Inside shard_map a token replaced by (replicated)
                        # ctx must keep the token's varying axes.
                        tok_leaves = [_jaxpr.match_varying(x, _jaxpr.varying_axes(a))
                                      for x, a in zip(tok_leaves, token_avals)]
                if len(ctx_leaves) == nctx:
                    ctx_leaves = [_jaxpr.cast_weak_type(x, a)
                                  for x, a in zip(ctx_leaves, self.ctx_avals)]
                return [*tok_leaves, *ctx_leaves]
            avals = [*self.ctx_avals, *token_avals]
        else:
            # Derivative of the injector w.r.t. the token, ctx held constant.
            half = ntok // 2

            def flat(*leaves):
                ctx = jax.tree_util.tree_unflatten(ctx_tree, leaves[:nctx])
                primal = jax.tree_util.tree_unflatten(tree, leaves[nctx:nctx + half])
                t = jax.tree_util.tree_unflatten(tree, leaves[nctx + half:])
                f = lambda tok: call(ctx, tok)[0]
                if kind == "tangent":
                    _, t_out = jax.jvp(f, (primal,), (t,))
                else:
                    _, vjp = jax.vjp(f, primal)
                    (t_out,) = vjp(t)
                return jax.tree_util.tree_leaves(t_out)
            avals = [*self.ctx_avals, *token_avals]

        closed = trace_in(context, flat, avals)
        if kind == "primal":
            self._check(closed, found, params, tree, token_avals, path, batched)
            result = (closed, None)
        else:
            used = _jaxpr.used_invars(closed)
            result = (closed, any(used[:nctx]))
        self._traced[key] = result
        return result

    def _check(self, closed, found, params, tree, token_avals, path, batched):
        where = describe_site(params, path)
        out_avals = [v.aval for v in _jaxpr.jaxpr_parts(closed).outvars]
        if found["token"] != tree:
            raise InjectError(f"taxpr.inject: the injector for {where} returned a value of "
                              f"structure {found['token']}, expected {tree}")
        if found["ctx"] != self.ctx_tree:
            raise InjectError(f"taxpr.inject: the injector for {where} returned a ctx of "
                              f"structure {found['ctx']}, expected {self.ctx_tree}")
        ntok = len(token_avals)
        for kind, got, want in (("value", out_avals[:ntok], token_avals),
                                ("ctx", out_avals[ntok:], self.ctx_avals)):
            for i, (g, w) in enumerate(zip(got, want)):
                if g.shape != w.shape or g.dtype != w.dtype:
                    hint = ""
                    # Only where it is true: the tag was batched by vmap and
                    # the leaf has exactly one extra leading axis.
                    if (kind == "ctx" and batched and g.dtype == w.dtype
                            and len(g.shape) == len(w.shape) + 1 and g.shape[1:] == w.shape):
                        hint = (" (it looks batched: under vmap the token is batched, and a "
                                "batched value cannot be stored into an unbatched ctx)")
                    raise InjectError(
                        f"taxpr.inject: the injector for {where} returned {kind} leaf {i} "
                        f"of type {_aval_str(g)}, expected {_aval_str(w)}{hint}")
        for i, g in enumerate(out_avals[ntok:]):
            if _jaxpr.varying_axes(g):
                raise self.hooks.varying_ctx(i, params, path, _jaxpr.varying_axes(g))

    # -- the site rule --
    def __call__(self, engine: Engine, eqn, level: Level, ctx: list) -> list:
        params = user_params(eqn.params)
        if (self.direct is not None and eqn.primitive is tag_p and not is_guarded(eqn.params)
                and level.context is None):
            ins = [level.atom(v) for v in eqn.invars]
            subst = self._substitute(eqn, params, ctx, ins)
            if subst is not None:
                level.local(self)[tuple(map(id, ins))] = ctx
                new_token, new_ctx, changed = subst
                # (an input also left unchanged in ctx may be reported: the
                # producers of dropped atoms are removed only where unused)
                kept = {id(a) for a in new_token}
                kept.update(id(new_ctx[i]) for i in changed)
                level.dropped.extend(a for a in ins if id(a) not in kept)
                for o, a in zip(eqn.outvars, new_token):
                    if not isinstance(o, core.DropVar):
                        level.env[o] = a
                level.changed = (new_ctx, changed)
                return new_ctx
        tree = meta(eqn.params).tree
        n = n_values(eqn.params, len(eqn.invars)) if eqn.primitive is tag_p else len(eqn.invars)
        ins = [level.atom(v) for v in eqn.invars[:n]]
        token_avals = tuple(v.aval for v in eqn.invars[:n])
        if eqn.primitive is tag_p:
            closed, _ = self._trace("primal", params, tree, token_avals, level.path,
                                    level.context, meta(eqn.params).batched)
            # The ctx before the site, keyed by its inputs: the tangent of the
            # same tag (bound right after it by the JVP rule) uses it.
            level.local(self)[tuple(map(id, ins))] = ctx
            outs = inline(level, closed, [*ctx, *ins])
            new_token, new_ctx = outs[:len(ins)], outs[len(ins):]
            if n < len(eqn.invars):
                new_ctx = self._guarded(eqn, level, level.atom(eqn.invars[n]), ctx, new_ctx)
            if (self.check_per_shard and not getattr(level.context, "checks_vma", True)
                    and (self.check_per_shard is True or self.check_per_shard(eqn))):
                self._check_unchecked_shard_map(eqn, level, closed, ctx, new_ctx)
        else:
            kind = "cotangent" if eqn.primitive is tag_cotangent_p else "tangent"
            closed, needs_ctx = self._trace(kind, params, tree, token_avals, level.path,
                                            level.context)
            site_ctx = ctx
            if needs_ctx:
                site_ctx = level.local(self).get(tuple(map(id, ins[:len(ins) // 2])))
                if site_ctx is None:
                    raise NotImplementedError(
                        f"taxpr.inject: the derivative of the injector for "
                        f"{describe_site(params, level.path)} depends on ctx, and the "
                        f"{kind} of this tag is computed away from the tag itself "
                        f"(e.g. reverse mode); make the injector's derivative "
                        f"independent of ctx")
            new_token = inline(level, closed, [*site_ctx, *ins])
            new_ctx = ctx
        for o, a in zip(eqn.outvars, new_token):
            if not isinstance(o, core.DropVar):
                level.env[o] = a
        return list(new_ctx)

    def _substitute(self, eqn, params: dict, ctx: list, ins: list) -> tuple | None:
        """``direct``'s rewrite of a primal site, or None where it does not
        apply or would change a type (weak type, shape, dtype)."""
        out = self.direct(params, ctx, ins)
        if out is None:
            return None
        new_token, new_ctx, *told = out
        if len(new_token) != len(eqn.outvars) or len(new_ctx) != len(self.ctx_avals):
            return None
        same = self._same_type
        for a, o in zip(new_token, eqn.outvars):
            if not same(_aval_of(a), o.aval):
                return None
        changed = list(told[0]) if told else changed_positions(ctx, new_ctx)
        for i in changed:
            if not same(_aval_of(new_ctx[i]), self.ctx_avals[i]):
                return None
        # (ctx itself where nothing changed: a site rule never mutates the
        # ctx it is given, and copying n leaves per site is quadratic)
        return list(new_token), new_ctx if type(new_ctx) is list else list(new_ctx), changed

    def _same_type(self, a, b) -> bool:
        """``a == b`` for avals, remembered per pair of aval objects (a
        program has few distinct ones, and comparing them is not free)."""
        if a is b:
            return True
        key = (id(a), id(b))
        hit = self._same.get(key)
        if hit is None:
            hit = self._same[key] = (a, b, a == b)  # holds a, b: ids stay theirs
        return hit[2]

    def _check_unchecked_shard_map(self, eqn, level: Level, closed, ctx: list,
                                   new_ctx: list) -> None:
        """Inside a shard_map without vma checking (``check_vma=False``,
        ``jax.pmap``) a ctx leaf may only change to a value computed from ctx
        alone (the same on every shard): a value computed from the token
        may differ per shard, and only one shard's would be kept."""
        ntok = len(_jaxpr.jaxpr_parts(closed).outvars) - len(ctx)
        for i, (a, b) in enumerate(zip(ctx, new_ctx)):
            if a is b:
                continue
            mask = [False] * (ntok + len(ctx))
            mask[ntok + i] = True
            used = _jaxpr.used_invars(_jaxpr.dce_closed(closed, mask))
            if any(used[len(ctx):]):
                raise InjectError(
                    f"taxpr.inject: the injector for "
                    f"{describe_site(user_params(eqn.params), level.path)} stores a value computed "
                    f"from the token into ctx leaf {i} inside a shard_map without vma checking "
                    f"(check_vma=False, as jax.pmap uses): taxpr cannot tell whether it is the "
                    f"same on every shard, and ctx leaves shard_map replicated (only one "
                    f"shard's value would be kept); use shard_map with check_vma=True, or "
                    f"move the effect out of the shard_map / pmap")

    def _guarded(self, eqn, level: Level, guard, ctx: list, new_ctx: list) -> list:
        """The ctx after a guarded site: unchanged leaves pass; changed ones
        are merged by ``guard_merge`` or are an error (an unbatched ctx
        cannot hold a value that differs per example)."""
        changed = [i for i, (a, b) in enumerate(zip(ctx, new_ctx)) if a is not b]
        if not changed:
            return list(new_ctx)
        if self.guard_merge is None:
            raise InjectError(
                f"taxpr.inject: the injector for {describe_site(user_params(eqn.params), level.path)} "
                f"changes ctx leaf {changed[0]}, but the tag is inside "
                f"{guarded_place(eqn.params)} whose predicate is batched by vmap: vmap runs "
                f"it for every example although only some examples take it, so the new ctx "
                f"would differ per example, and ctx is not batched (apply vmap outside the "
                f"injected function, e.g. vmap the injected function over a batch of ctx)")
        key = ("guard_merge", guard.aval, tuple(_aval_of(a) for a in ctx), id(level.context))
        closed = self._traced.get(key)
        if closed is None:
            k = len(ctx)
            merge = self.guard_merge

            def fn(g, *leaves):
                return list(merge(g, list(leaves[:k]), list(leaves[k:])))

            avals = [guard.aval, *map(_aval_of, ctx), *map(_aval_of, ctx)]
            closed = self._traced[key] = level.trace(fn, avals)
        return inline(level, closed, [guard, *ctx, *new_ctx])


def _aval_of(atom) -> Any:
    return atom.aval


def guarded_place(params: dict) -> str:
    """Where a guarded tag sits in the program vmap batched, innermost
    first, e.g. ``'cond[branch=1] (inside while[body])'``."""
    places = meta(params).guard_from
    if not places:
        return "a cond/while"
    inner = " (inside " + ", inside ".join(places[1:]) + ")" if len(places) > 1 else ""
    return places[0] + inner


class SplitArguments(NamedTuple):
    """A call's ``(args, kwargs)`` split for tracing: the leaves JAX traces
    (``leaves``, flattened to ``tree``) and the static rest (``static``)."""

    leaves: list
    tree: Any
    static: Any

    def rebuild(self, dyn: Any) -> Any:
        """``(args, kwargs)`` again from the traced leaves' pytree ``dyn``."""
        return _libraries.filter_combine(dyn, self.static)


class IdentityKey:
    """An object in a cache key, equal only to the same object (an
    unhashable static argument, a function's globals): the key holds it, so
    its id is never reused for another object while the entry lives."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: Any) -> bool:
        return type(other) is IdentityKey and other.obj is self.obj


def hashable_static(x: Any) -> Any:
    """``x`` as part of a cache key: itself when hashable, else by identity."""
    try:
        hash(x)
        return x
    except TypeError:
        return IdentityKey(x)


class SignatureCache:
    """What a transformation made per call signature (``jax.jit``'s cache of
    traces), the ``maxsize`` most recently used kept."""

    def __init__(self, maxsize: int = 512):
        self.maxsize = maxsize
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def get_or_make(self, key: Any, make: Callable[[], Any]) -> Any:
        hit = self._entries.get(key, _MISSING)
        if hit is _MISSING:
            with collector_paused():
                hit = self._entries[key] = make()
            if len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return hit

    def __len__(self) -> int:
        return len(self._entries)


_MISSING = object()


def split_arguments(args: tuple, kwargs: dict,
                    traced: Callable[[Any], bool] = _libraries.is_traced_leaf) -> SplitArguments:
    """Split ``(args, kwargs)`` as ``equinox.filter_jit`` does: the leaves
    ``traced`` selects (arrays) are traced, the others (an equinox module's
    activation function, a string) are static."""
    dyn, static = _libraries.filter_partition((args, kwargs), traced)
    leaves, tree = jax.tree_util.tree_flatten(dyn)
    return SplitArguments(leaves, tree, static)


def trace_program(fn: Callable, in_tree, in_avals, name: str = "fn",
                  rebuild: Callable | None = None,
                  consumes: Predicate | None = None) -> tuple[Any, Any]:
    """Trace ``fn(*args, **kwargs)`` (``(args, kwargs)`` flattened to
    ``in_tree`` / ``in_avals``; ``rebuild`` re-inserts static leaves) with kept
    tags, as every taxpr transformation does.

    A tag that ``consumes(params, shape)`` selects and that user code bound
    while tracing, but that is nowhere in the traced program, was traced
    where taxpr cannot see: inside an operation that keeps the function as a
    Python callable and traces it again only when JAX compiles it (an
    equinox filter primitive: lineax's ``linear_solve`` of a
    ``FunctionLinearOperator``). Rewriting the program would ignore it, so
    that is an error.

    Returns:
        ``(closed_jaxpr, out_tree)``.

    Raises:
        NotImplementedError: a consumed tag is hidden as above (names it).
    """
    out_tree = []

    def flat(*leaves):
        tree = jax.tree_util.tree_unflatten(in_tree, leaves)
        args, kwargs = rebuild(tree) if rebuild else tree
        out, t = jax.tree_util.tree_flatten(fn(*args, **kwargs))
        out_tree.append(t)
        return out

    with keep_tags(), recording_tags() as recorded, _libraries.explaining_kept_tag_dependencies():
        closed = expand_for(_jaxpr.trace_flat(flat, in_avals, name), consumes)
    if consumes is not None and recorded:
        check_no_hidden_tags(closed, recorded, consumes)
    return closed, out_tree[0]


def check_no_hidden_tags(closed: Any, recorded: dict, consumes: Predicate) -> None:
    """Raise for a tag ``consumes`` selects that was recorded while tracing
    ``closed`` (``recording_tags``) but is not in it, where an equation of
    ``closed`` keeps a Python function in its params whose implementation
    taxpr could not expand (JAX's own transformations also drop tags, e.g.
    the transposed tangent of a sow in a JVP rule, but never into a
    callable)."""
    hidden = hidden_tags(closed, recorded, consumes)
    if not hidden:
        return
    keepers = [(e, path) for e, path in _traverse.iter_eqns(closed) if keeps_a_function(e)]
    if not keepers:
        return
    eqn, path = keepers[0]
    raise NotImplementedError(
        f"taxpr: {describe_tag(hidden[0])} was traced, but it is not in the traced "
        f"program: '{eqn.primitive.name}' at {format_path(path)} keeps a Python function "
        f"in its params and traces it again only when JAX compiles it, and taxpr could not "
        f"run it through its implementation, where it would rewrite the tag (it would be "
        f"ignored). Compute the tagged value outside that function and close over it, or "
        f"use an operation that JAX traces into the program")


@dataclasses.dataclass(frozen=True)
class InjectPolicy:
    """How an effect layer built on ``inject`` (state, random keys) wants its
    sites rewritten; ``inject`` itself uses the defaults.

    Attributes:
        hooks: how the layer reports misuse (``_engine.Hooks``).
        guard_merge: how a guarded site (``taxpr._guards``) that changes ctx
            merges it: ``guard_merge(guard, old_leaves, new_leaves) ->
            leaves`` (traced); None: such a site is an ``InjectError``.
        check_per_shard: refuse ctx changes computed from the token in a
            ``shard_map`` without vma checking; or a predicate on a tag's
            eqn, ``check_per_shard(eqn) -> bool``: refuse them only at the
            tags it selects (the state layer exempts the sets it proved the
            same on every shard).
        direct: for an injector that only moves values between the token
            and ctx, ``direct(params, ctx_atoms, token_atoms) ->
            (new_token_atoms, new_ctx_atoms[, changed positions])``: sites are
            rewritten by substituting atoms, without tracing the injector
            (telling the positions it changed keeps a site's cost
            independent of the number of ctx leaves).
        replays: whether a tag a ``custom_vjp`` bwd binds is a replay of the
            forward pass (``_replay``).
        expanded: the program was expanded already (``trace_program`` with a
            ``consumes`` that selects at least the tags this ``inject``
            selects): ``expand_for`` would change nothing, so it is skipped.
    """

    hooks: Hooks | None = None
    guard_merge: Callable | None = None
    check_per_shard: bool | Callable[[core.JaxprEqn], bool] = True
    direct: Callable | None = None
    replays: bool = True
    expanded: bool = False


def inject(closed_jaxpr: Any, injector: Injector, ctx: Any,
           predicate: Predicate | None = None) -> Any:
    """Rewrite the selected tags of ``closed_jaxpr`` into calls of ``injector``.

    Arguments:
        closed_jaxpr: the program (a ``ClosedJaxpr``; a plain ``Jaxpr`` is
            taken as closed with no consts).
        injector: ``injector(ctx, value, params) -> Injected(value, ctx)``
            (a ``(value, ctx)`` tuple is the same); ``value`` is the tagged
            pytree, ``params`` the tag's params dict. It must return a value
            and a ctx of the same structures, shapes and dtypes.
        ctx: a pytree of arrays (or ``jax.ShapeDtypeStruct``) giving the
            context's structure and types.
        predicate: ``predicate(params, shape) -> bool`` selects tags; the rest
            stay as tags.

    Returns:
        A closed jaxpr ``(*ctx_leaves, *inputs) -> (*outputs, *ctx_leaves)``
        that computes what the program computes eagerly with ``ctx`` a Python
        variable replaced at each selected tag by the injector.

    Raises:
        InjectError: the injector returned a wrong structure, shape or dtype
            (the message names the tag's params and path).
        NotImplementedError: a selected tag sits inside a primitive taxpr
            cannot thread through (the message names it).
    """
    return inject_with(closed_jaxpr, injector, ctx, predicate, InjectPolicy())


def inject_with(closed_jaxpr: Any, injector: Injector, ctx: Any,
                predicate: Predicate | None, policy: InjectPolicy) -> Any:
    """``inject`` with an effect layer's ``policy``."""
    if not policy.expanded:
        closed_jaxpr = expand_for(closed_jaxpr, predicate)
    leaves, ctx_tree = jax.tree_util.tree_flatten(ctx)
    ctx_avals = [_jaxpr.abstractify(x) for x in leaves]
    sites = _InjectSites(injector, ctx_tree, ctx_avals, policy.guard_merge, policy.direct)
    sites.check_per_shard = policy.check_per_shard
    if policy.hooks is not None:
        sites.hooks = policy.hooks
    engine = Engine(sites, predicate, ctx_avals, policy.hooks)
    engine.replays = policy.replays
    outvars = _jaxpr.jaxpr_parts(closed_jaxpr).outvars
    return engine.thread_jaxpr(closed_jaxpr, (), 0, len(outvars))


def injected(fn: Callable, injector: Injector, *, predicate: Predicate | None = None):
    """The function-level form of ``inject``.

    Arguments:
        fn: a function of pytrees of arrays.
        injector: as for ``inject``.
        predicate: as for ``inject``.

    Returns:
        ``pure(ctx, *args, **kwargs) -> (out, new_ctx)``, traced and injected
        once per input signature (cached like ``jax.jit``).
    """
    cache = SignatureCache()

    def pure(ctx, *args, **kwargs):
        ctx_leaves, ctx_tree = jax.tree_util.tree_flatten(ctx)
        arg_leaves, arg_tree = jax.tree_util.tree_flatten((args, kwargs))
        ctx_avals = tuple(_jaxpr.abstractify(x) for x in ctx_leaves)
        arg_avals = tuple(_jaxpr.abstractify(x) for x in arg_leaves)

        def make():
            closed, out_tree = trace_program(fn, arg_tree, arg_avals,
                                             consumes=predicate or (lambda p, s: True))
            spec = jax.tree_util.tree_unflatten(ctx_tree, ctx_avals)
            return inject(closed, injector, spec, predicate), out_tree
        new, out_tree = cache.get_or_make((ctx_tree, ctx_avals, arg_tree, arg_avals), make)
        outs = evaluated_fun(new)(*ctx_leaves, *arg_leaves)
        n_out = out_tree.num_leaves
        return (jax.tree_util.tree_unflatten(out_tree, outs[:n_out]),
                jax.tree_util.tree_unflatten(ctx_tree, outs[n_out:]))

    return pure

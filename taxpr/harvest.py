"""Harvest: oryx-compatible ``sow`` / ``reap`` / ``plant`` on the threading engine.

A drop-in replacement for ``oryx.core.interpreters.harvest``: same names,
signatures, semantics and error messages. Built on taxpr's engine:

* ``strict`` / ``clobber`` / ``cond_clobber`` reaps are carried values (ctx);
* ``append`` reaps are collected per site, stacked by ``scan`` along its axis;
* planted values of non-append sows are carried values, planted ``append``
  values are fed per site (``scan`` slices them along its axis).

Better than oryx: planted values are shape/dtype-checked; plant of an
``append`` sow inside a scan works; ``append`` outside loops stacks; sows in
``shard_map`` work or raise a clear error; errors never corrupt JAX's trace
state; cost grows linearly with nesting depth.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core

from . import _compat, _traverse
from ._engine import Engine, Hooks, Level, format_path, inline
from ._find import dissolve_tags
from ._inject import trace_program
from ._inject import guarded_place
from .primitives._tag import GUARD, TREE, n_values, tag, tag_p

__all__ = ["sow", "sow_cond", "reap", "call_and_reap", "plant", "harvest", "nest", "sow_p"]

sow_p = tag_p  # the primitive behind ``sow``


class _SowOp:
    """The ``op`` param of a sow (compared by identity: never a user's tag)."""

    __slots__ = ()

    def __repr__(self):
        return "sow"


SOW = _SowOp()
_SCOPES = threading.local()


def _scope() -> tuple:
    return getattr(_SCOPES, "stack", ())


def sow(value: Any, *, tag: Any, name: Any, mode: str = "strict", key: Any = None) -> Any:
    """Mark ``value`` as an intermediate named ``name`` for harvests of ``tag``.

    Arguments:
        value: a pytree of arrays.
        tag: the harvest tag.
        name: the value's name.
        mode: ``"strict"``, ``"clobber"`` or ``"append"``.
        key: accepted for oryx compatibility (a value the sow depends on).

    Returns:
        ``value``, or the planted value inside a ``plant``.
    """
    del key
    if mode == "cond_clobber":
        raise ValueError("For 'cond_clobber' mode, use `sow_cond`.")
    if mode not in ("strict", "clobber", "append"):
        raise ValueError(f"Invalid mode: {mode}")
    return _tag_sow(value, tag, name, mode)


def sow_cond(value: Any, pred: Any, *, tag: Any, name: Any, mode: str = "cond_clobber",
             key: Any = None) -> Any:
    """Sow ``value`` in ``cond_clobber`` mode: a reap keeps the last value whose
    ``pred`` was true (zeros if none).

    Returns:
        ``value`` (or the planted value).
    """
    del key
    if mode != "cond_clobber":
        raise ValueError(f"sow_cond only supports mode='cond_clobber', got {mode!r}")
    out = _tag_sow((value, jnp.asarray(pred, bool)), tag, name, "cond_clobber")
    return out[0]


def _tag_sow(value, tag_, name, mode):
    full = (*_scope(), name) if _scope() else name
    return tag(value, op=SOW, tag=tag_, name=full, mode=mode)


def nest(f: Callable, *, scope: str) -> Callable:
    """``f`` with its sows' names nested under ``scope``: reaps come back as
    ``{scope: {...}}`` and plants are read from ``plants[scope]``."""

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        prev = _scope()
        _SCOPES.stack = (*prev, scope)
        try:
            return f(*args, **kwargs)
        finally:
            _SCOPES.stack = prev

    return wrapped


# ---- selection and static checks --------------------------------------------------

def _is_sow(params: dict) -> bool:
    return params.get("op") is SOW


class _Filter:
    def __init__(self, tag_, allowlist, blocklist):
        self.tag = tag_
        self.allow = None if allowlist is None else set(allowlist)
        self.block = set(blocklist or ())

    def name_ok(self, name) -> bool:
        head = name[0] if isinstance(name, tuple) else name
        for n in {name, head}:
            if n in self.block:
                return False
        return self.allow is None or name in self.allow or head in self.allow

    def __call__(self, params: dict, shape: Any = None) -> bool:
        return (_is_sow(params) and params["tag"] == self.tag
                and self.name_ok(params["name"]))


def _site_aval(eqn) -> tuple:
    """(value avals, mode) of a sow equation (cond_clobber drops the pred)."""
    avals = tuple(v.aval for v in eqn.invars[:n_values(eqn.params, len(eqn.invars))])
    if eqn.params["mode"] == "cond_clobber":
        avals = avals[:-1]
    return avals


def _disp(name) -> str:
    return ".".join(map(str, name)) if isinstance(name, tuple) else str(name)


def _check(jaxpr: Any, select: _Filter, verb: Callable, check_branches: bool) -> None:
    """oryx's static rules: strict sows once per scope, no strict in scan,
    only clobber modes in while, every cond branch sows alike."""

    def walk(j, in_scan: bool, in_while: bool) -> dict:
        counts: dict = {}
        for eqn in _compat.jaxpr_parts(j)[3]:
            if eqn.primitive is tag_p and select(eqn.params):
                name, mode = eqn.params["name"], eqn.params["mode"]
                if in_while and mode not in ("clobber", "cond_clobber"):
                    raise ValueError(f"Must use clobber or cond_clobber mode for "
                                     f"'{_disp(name)}' inside of a `while_loop`.")
                if in_scan and mode == "strict":
                    raise ValueError(f"Cannot use strict mode for '{_disp(name)}' inside `scan`.")
                _count(counts, name, mode, _site_aval(eqn))
                continue
            subs = _traverse.subjaxprs(eqn)
            if not subs:
                continue
            prim = eqn.primitive.name
            inner = [walk(sj, in_scan or prim == "scan", in_while or prim == "while")
                     for _, sj in subs]
            if prim == "cond":
                if check_branches:
                    _check_branches(inner)
                merged = {}
                for branch in inner:
                    for k, v in branch.items():
                        if k not in merged or v[0] > merged[k][0]:
                            merged[k] = v
                inner = [merged]
            for branch in inner:
                for name, (n, mode, avals) in branch.items():
                    for _ in range(n):
                        _count(counts, name, mode, avals)
        return counts

    def _count(counts, name, mode, avals):
        n, _, _ = counts.get(name, (0, mode, avals))
        if n and mode == "strict":
            raise ValueError(f"Variable has already been {verb(name)}: {_disp(name)}")
        counts[name] = (n + 1, mode, avals)

    walk(jaxpr, False, False)


def _check_branches(branches: list[dict]) -> None:
    first = branches[0]
    for other in branches[1:]:
        if len(other) != len(first):
            raise ValueError("Mismatching number of `sow`s between branches.")
        for name, (_, _, avals) in first.items():
            if name not in other:
                raise ValueError(f"Missing sow in branch: '{_disp(name)}'.")
            o = other[name][2]
            if [a.shape for a in avals] != [a.shape for a in o]:
                raise ValueError(f"Mismatched shape between branches: '{_disp(name)}'.")
            if [a.dtype for a in avals] != [a.dtype for a in o]:
                raise ValueError(f"Mismatched dtype between branches: '{_disp(name)}'.")


class _HarvestHooks(Hooks):
    """Channel keys are ``(kind, name, occurrence, stacked)``: occurrences are
    numbered afresh in every enclosing jaxpr, so sows in different calls
    (two jits, two scans) never share a key."""

    def __init__(self, sites: "_Sites"):
        self.sites = sites

    def rekey(self, key, level, stacked):
        kind, name, _, was_stacked = key
        return (kind, name, self.sites.next_occurrence(level, kind, name), was_stacked or stacked)

    def loop_channel(self, key, loop, path):
        name = key[1]
        if loop == "while_loop":
            return ValueError(f"Must use clobber or cond_clobber mode for '{_disp(name)}' "
                              f"inside of a `while_loop`.")
        return ValueError(
            f"taxpr.harvest: append-mode sow '{_disp(name)}' inside {loop} at "
            f"{format_path(path)} is not supported yet; use clobber mode there")

    def branches(self, collects, path):
        if len({tuple(k for k, _ in c) for c in collects}) > 1:
            raise ValueError("Mismatching number of `sow`s between branches.")


# ---- the site rule ------------------------------------------------------------------

class _Sites:
    """Rewrites selected sows: reap (record) and/or plant (replace)."""

    def __init__(self, reaped: dict, planted: dict, ctx_index: dict):
        self.reaped = reaped  # name -> mode, for names to reap
        self.planted = planted  # name -> mode, for names to plant
        self.ctx_index = ctx_index  # ("reap"|"plant", name) -> ctx leaf positions
        self._occurrence: dict = {}  # (level, kind, name) -> count (levels kept alive)
        self._fns: dict = {}

    def next_occurrence(self, level: Level, kind: str, name: Any) -> int:
        n = self._occurrence.get((level, kind, name), 0)
        self._occurrence[(level, kind, name)] = n + 1
        return n

    def _apply(self, level: Level, key: str, fn: Callable, atoms: list) -> list:
        avals = tuple(_aval(a) for a in atoms)
        hit = self._fns.get((key, avals, id(level.context)))
        if hit is None:
            if level.context is None:
                hit = _compat.trace_flat(fn, avals)
            else:
                with level.context():
                    hit = _compat.trace_flat(fn, avals)
            self._fns[(key, avals, id(level.context))] = hit
        return inline(level, hit, atoms)

    def __call__(self, engine: Engine, eqn, level: Level, ctx: list) -> list:
        if eqn.primitive is not tag_p:
            # Tangents / cotangents: reaped values pass through unchanged;
            # planted values are constants (derivative 0).
            name = eqn.params["name"]
            n = len(eqn.invars) // 2
            tangents = [level.atom(v) for v in eqn.invars[n:]]
            if name in self.planted:
                tangents = self._apply(level, "zeros", lambda *t: [jnp.zeros_like(x) for x in t],
                                       tangents)
            for o, a in zip(eqn.outvars, tangents):
                if not isinstance(o, core.DropVar):
                    level.env[o] = a
            return ctx
        name, mode = eqn.params["name"], eqn.params["mode"]
        n = n_values(eqn.params, len(eqn.invars))
        ins = [level.atom(v) for v in eqn.invars[:n]]
        guard = level.atom(eqn.invars[n]) if n < len(eqn.invars) else None
        value = ins[:-1] if mode == "cond_clobber" else ins
        ctx = list(ctx)
        if guard is not None and mode == "append" and (name in self.planted
                                                       or name in self.reaped):
            raise ValueError(
                f"taxpr.harvest: append-mode sow '{_disp(name)}' at {format_path(level.path)} "
                f"is inside {guarded_place(eqn.params)} whose predicate is batched by vmap: "
                f"vmap runs it for every example although only some examples take it, and "
                f"the appended rows would differ per example; use clobber mode there, or "
                f"reap/plant inside the vmap")
        if name in self.planted:
            if mode == "append":
                key = ("plant", name, self.next_occurrence(level, "plant", name), False)
                value = level.feed(key, [_aval(a) for a in value])
            else:
                value = [ctx[i] for i in self.ctx_index[("plant", name)]]
            value = self._apply(level, "cast", _casts([_aval(a) for a in value],
                                                       [v.aval for v in eqn.outvars]), value)
        elif name in self.reaped:
            if mode == "append":
                if level.context is not None:
                    value = self._apply(
                        level, "replicated",
                        _replicated_check(name, level.path, _checks_vma(level)), value)
                level.collect(("reap", name, self.next_occurrence(level, "reap", name), False),
                              value)
            else:
                pos = self.ctx_index[("reap", name)]
                if mode == "cond_clobber":
                    new = self._apply(level, "select",
                                      lambda p, *vc: _select(p, vc), [ins[-1], *value,
                                                                       *(ctx[i] for i in pos)])
                else:
                    new = value
                if guard is not None:  # only the examples that take the branch/iteration
                    old = [ctx[i] for i in pos]
                    records = eqn.params[GUARD]
                    new = self._apply(
                        level, ("guarded", records),
                        _guarded_update(name, level.path, eqn.params, len(new)),
                        [guard, *new, *old])
                if level.context is not None:
                    new = self._apply(level, "replicated",
                                      _replicated_check(name, level.path, _checks_vma(level)), new)
                for i, a in zip(pos, new):
                    ctx[i] = a
        outs = value if mode != "cond_clobber" else [*value, ins[-1]]
        for o, a in zip(eqn.outvars, outs):
            if not isinstance(o, core.DropVar):
                level.env[o] = a
        return ctx


def _aval(atom):
    return atom.aval


def _select(pred, vc):
    n = len(vc) // 2
    return [jnp.where(pred, v, c) for v, c in zip(vc[:n], vc[n:])]


def _guarded_update(name, path, params: dict, n: int) -> Callable:
    """``(guard, *new, *old) -> leaves``: ``new`` where the guard holds, per
    example. A guarded tag's batched operands have their batch axes in front
    (outermost first), and ``params[GUARD]`` says which leaf each vmap level
    batched, so the guard is aligned with each leaf's leading axes."""
    levels = params[GUARD][::-1]  # outermost first, as the guard's axes

    def fn(guard, *leaves):
        out = []
        for k, (new, old) in enumerate(zip(leaves[:n], leaves[n:])):
            index = []
            for guard_batched, *leaf_batched in levels:
                if leaf_batched[k]:
                    index.append(slice(None))
                elif guard_batched:
                    raise ValueError(
                        f"taxpr.harvest: sow '{_disp(name)}' at {format_path(path)} is "
                        f"inside {guarded_place(params)} whose predicate is batched by vmap, "
                        f"and sows a value that vmap does not batch: the reaped value would "
                        f"differ per example (the sown value where the example takes the "
                        f"branch, the previous one elsewhere) but has the sown value's "
                        f"unbatched shape; sow a batched value, or reap inside the vmap")
                else:
                    index.append(0)  # the guard is the same along this axis
            g = guard[tuple(index)]
            g = g.reshape(g.shape + (1,) * (jnp.ndim(new) - g.ndim))
            out.append(jax.lax.select_n(jnp.broadcast_to(g, jnp.shape(new)), old, new))
        return out
    return fn


def _casts(got, want) -> Callable:
    """Give planted values the sow's exact type (weak type; inside shard_map
    the sow's varying axes: a replicated plant is the same on every shard)."""
    def fn(*xs):
        return [_compat.match_varying(_compat.cast_weak_type(x, w), _compat.varying_axes(w))
                for x, w in zip(xs, want)]
    return fn


def _checks_vma(level: Level) -> bool:
    return getattr(level.context, "checks_vma", True)


def _replicated_check(name, path, checks_vma: bool = True) -> Callable:
    def fn(*xs):
        if not checks_vma:
            raise ValueError(
                f"taxpr.harvest: sow '{_disp(name)}' at {format_path(path)} is reaped inside a "
                f"shard_map without vma checking (check_vma=False, as jax.pmap uses): taxpr "
                f"cannot tell whether the value is the same on every shard (only one shard's "
                f"value would be reaped); use shard_map with check_vma=True, or reap outside "
                f"the shard_map / pmap")
        for x in xs:
            if _compat.varying_axes(core.typeof(x)):
                raise ValueError(
                    f"taxpr.harvest: sow '{_disp(name)}' at {format_path(path)} reaps a value "
                    f"that differs across the shards of a shard_map; sow a value that is the "
                    f"same on every shard (e.g. after a psum), or reap outside the shard_map")
        return list(xs)
    return fn


# ---- the transformations ------------------------------------------------------------

def _flat_trace(fn: Callable, args, kwargs):
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    closed, out_tree = trace_program(fn, tree, [_compat.abstractify(x) for x in leaves])
    return closed, out_tree, leaves


def _nest_dict(flat: dict) -> dict:
    out: dict = {}
    for name, v in flat.items():
        if isinstance(name, tuple):
            d = out
            for part in name[:-1]:
                d = d.setdefault(part, {})
            d[name[-1]] = v
        else:
            out[name] = v
    return out


_MISSING = object()


def _lookup_plant(plants: dict, name: Any) -> Any:
    """``plants[name]``, or for a nested name ``plants[s1][s2]...``."""
    if not isinstance(name, tuple):
        return (plants or {}).get(name, _MISSING)
    d = plants or {}
    for part in name:
        if not isinstance(d, dict) or part not in d:
            return _MISSING
        d = d[part]
    return d


class _Site(NamedTuple):
    mode: str
    avals: tuple
    path: tuple
    tree: Any  # the sown value's pytree structure


def _run(fn: Callable, tag_: Any, allowlist, blocklist, exclusive: bool, plants: dict,
         want_reaps: bool, args, kwargs):
    closed, out_tree, leaves = _flat_trace(fn, args, kwargs)
    select = _Filter(tag_, allowlist, blocklist)
    sites: dict = {}
    for eqn, path in _traverse.iter_eqns(closed):
        if eqn.primitive is tag_p and select(eqn.params):
            mode, tree = eqn.params["mode"], eqn.params[TREE]
            if mode == "cond_clobber":  # the tag holds (value, pred)
                tree = jax.tree_util.tree_structure(
                    jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves)[0])
            sites.setdefault(eqn.params["name"], _Site(mode, _site_aval(eqn), path, tree))
    for name in sites:  # oryx: a nest scope and a sow may not share a name
        if isinstance(name, tuple) and name[0] in sites:
            verb = "planted" if _lookup_plant(plants, name[0]) is not _MISSING else "reaped"
            raise ValueError(f"Variable has already been {verb}: {_disp(name[0])}")
    plants = {n: v for n in sites if (v := _lookup_plant(plants, n)) is not _MISSING}
    planted = {n: sites[n].mode for n in plants}
    reaped = {n: s.mode for n, s in sites.items() if n not in plants} if want_reaps else {}
    # Only the sows this call transforms follow oryx's static rules.
    transformed = _Filter(tag_, allowlist, blocklist)
    transformed.allow = set(planted) | set(reaped)
    _check(closed, transformed, lambda name: "planted" if name in planted else "reaped",
           check_branches=want_reaps)

    # ctx: carried reaps (zeros first) and planted non-append values.
    ctx_leaves, ctx_index = [], {}
    for name, mode in reaped.items():
        if mode != "append":
            avals = sites[name].avals
            ctx_index[("reap", name)] = list(range(len(ctx_leaves), len(ctx_leaves) + len(avals)))
            ctx_leaves.extend(np.zeros(a.shape, a.dtype) for a in avals)
    for name, mode in planted.items():
        avals, path = sites[name].avals, sites[name].path
        value = jax.tree_util.tree_leaves(plants[name])
        if mode == "append":
            continue
        _check_plant(name, value, avals, path)
        ctx_index[("plant", name)] = list(range(len(ctx_leaves), len(ctx_leaves) + len(avals)))
        ctx_leaves.extend(value)
    ctx_avals = [_compat.abstractify(x) for x in ctx_leaves]
    site_rule = _Sites(reaped, planted, ctx_index)
    engine = Engine(site_rule, select, ctx_avals, _HarvestHooks(site_rule))
    threaded = engine.thread_jaxpr(closed, (), 0, len(_compat.jaxpr_parts(closed)[4]))
    if exclusive:
        threaded = dissolve_tags(threaded, lambda p, s: _is_sow(p))
    chans = engine.channels(threaded)
    feeds = []
    for key, avals in chans.feeds:
        feeds.extend(_plant_for_feed(key, avals, plants, sites, chans.feeds))
    outs = _compat.jaxpr_as_fun(threaded)(*ctx_leaves, *leaves, *feeds)
    n_out = out_tree.num_leaves
    out = jax.tree_util.tree_unflatten(out_tree, outs[:n_out])
    ctx_out = outs[n_out:n_out + len(ctx_leaves)]
    collected = outs[n_out + len(ctx_leaves):]
    reaps = {}
    for name, mode in reaped.items():
        if mode != "append":
            vals = [ctx_out[i] for i in ctx_index[("reap", name)]]
            reaps[name] = _unflatten_value(sites[name], vals)
    appended: dict = {}
    it = iter(collected)
    for key, avals in chans.collects:
        vals = [next(it) for _ in avals]
        appended.setdefault(key[1], []).append((key, vals))
    for name, items in appended.items():
        stacked = [_stack_occurrences([v[i] for _, v in items], [k for k, _ in items])
                   for i in range(len(items[0][1]))]
        reaps[name] = _unflatten_value(sites[name], stacked)
    for name, mode in reaped.items():  # append sows that never ran (e.g. zero-length scan)
        if mode == "append" and name not in reaps:
            reaps[name] = _unflatten_value(
                sites[name], [np.zeros((0, *a.shape), a.dtype) for a in sites[name].avals])
    return out, _nest_dict(reaps)


def _stack_occurrences(values: list, keys: list) -> Any:
    # A collected value straight from a sow gets a new leading axis; one that
    # came out of a scan is already stacked along it.
    parts = [jnp.asarray(v) if _is_stacked(k) else jnp.asarray(v)[None] for v, k in zip(values, keys)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _is_stacked(key) -> bool:
    return key[3]


def _unflatten_value(site: "_Site", vals):
    return jax.tree_util.tree_unflatten(site.tree, [jnp.asarray(v) for v in vals])


def _check_plant(name, value, avals, path) -> None:
    if len(value) != len(avals):
        raise ValueError(f"Planted value for '{_disp(name)}' has {len(value)} leaves, "
                         f"expected {len(avals)}")
    for v, a in zip(value, avals):
        if tuple(np.shape(v)) != tuple(a.shape) or jnp.result_type(v) != a.dtype:
            raise ValueError(
                f"Planted value for '{_disp(name)}' has type "
                f"{jnp.result_type(v).name}{list(np.shape(v))}, but the sow at "
                f"{format_path(path)} has type {np.dtype(a.dtype).name}{list(a.shape)}")


def _plant_for_feed(key, avals, plants, sites, all_feeds) -> list:
    """The planted values for one fed occurrence: the occurrences of a name
    at the top level split the planted stack along its leading axis (one
    row per direct sow, one block per scan); its length must match."""
    name = key[1]
    start, total = 0, 0
    for k, kav in all_feeds:
        if k[1] != name:
            continue
        size = kav[0].shape[0] if _is_stacked(k) else 1
        if k == key:
            start, mine = total, size
        total += size
    out = []
    for v, a in zip(jax.tree_util.tree_leaves(plants[name]), avals):
        v = jnp.asarray(v)
        want = (total, *(a.shape[1:] if _is_stacked(key) else a.shape))
        if tuple(v.shape) != want or v.dtype != a.dtype:
            raise ValueError(
                f"Planted value for '{_disp(name)}' has type {v.dtype.name}{list(v.shape)}, "
                f"but its append sows (at {format_path(sites[name].path)}) stack to "
                f"{np.dtype(a.dtype).name}{list(want)}")
        out.append(v[start:start + mine] if _is_stacked(key) else v[start])
    return out


def call_and_reap(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
                  blocklist: Iterable = frozenset(), exclusive: bool = False) -> Callable:
    """``call_and_reap(f, tag=t)(*args) -> (out, reaps)``."""

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        return _run(f, tag, allowlist, blocklist, exclusive, {}, True, args, kwargs)

    return wrapped


def reap(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
         blocklist: Iterable = frozenset(), exclusive: bool = False) -> Callable:
    """``reap(f, tag=t)(*args) -> reaps``: the values sown with ``tag``."""
    car = call_and_reap(f, tag=tag, allowlist=allowlist, blocklist=blocklist,
                        exclusive=exclusive)

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        return car(*args, **kwargs)[1]

    return wrapped


def plant(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
          blocklist: Iterable = frozenset(), exclusive: bool = False) -> Callable:
    """``plant(f, tag=t)(plants, *args) -> out`` with sown values replaced."""

    @functools.wraps(f)
    def wrapped(plants, *args, **kwargs):
        return _run(f, tag, allowlist, blocklist, exclusive, plants, False, args, kwargs)[0]

    return wrapped


def harvest(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
            blocklist: Iterable = frozenset(), exclusive: bool = False) -> Callable:
    """``harvest(f, tag=t)(plants, *args) -> (out, reaps)``; planted names are
    not reaped."""

    @functools.wraps(f)
    def wrapped(plants, *args, **kwargs):
        return _run(f, tag, allowlist, blocklist, exclusive, plants, True, args, kwargs)

    return wrapped

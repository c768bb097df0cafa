"""Parity with taxpr 0.0.3's utilities: ``transpose``, ``partition_out``,
``fix_inputs``, ``strip_outputs`` (all correct through nested jaxprs)."""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

import jax
from ._jax.internals import core

from . import _jaxpr
from ._engine import Engine, Hooks, Level, format_path
from ._find import Predicate
from .primitives._tag import is_guarded, meta, tag_p, user_params


class _TagKey(NamedTuple):
    """The channel site of one tag's collected value."""

    order: int  # the tag's place in program order
    params: tuple  # its user params, sorted (hashable)
    tree: Any  # the tagged value's pytree structure


class _TransposeHooks(Hooks):
    def loop_channel(self, key, loop, path):
        params = dict(key.site.params)
        return ValueError(
            f"taxpr.transpose: tag {params} at {format_path(path)} is inside a {loop}: "
            f"it has no single well-defined value (the loop runs a data-dependent "
            f"number of times)")

    def branches(self, collects, path):
        if len({tuple(k for k, _ in c) for c in collects}) > 1:
            raise ValueError(
                f"taxpr.transpose: a tag inside cond/switch at {format_path(path)} has a "
                f"value only when its branch is taken; transpose needs a value for every "
                f"tag")


class _CollectSites:
    """Site rule of ``transpose``: collect each tag's value (scan stacks it)."""

    def __init__(self):
        self.count = 0

    def __call__(self, engine, eqn, level: Level, ctx):
        ins = [level.atom(v) for v in eqn.invars]
        if eqn.primitive is tag_p and is_guarded(eqn.params):
            raise ValueError(
                f"taxpr.transpose: tag {user_params(eqn.params)} at {format_path(level.path)} "
                f"is inside a cond/while whose predicate is batched by vmap: it has a value "
                f"only for the examples that take its branch; transpose needs a value for "
                f"every tag")
        if eqn.primitive is tag_p:
            self.count += 1
            params = tuple(sorted(user_params(eqn.params).items()))
            level.collect(level.channel(_TagKey(self.count, params, meta(eqn.params).tree)), ins)
        else:
            ins = ins[len(ins) // 2:]
        for o, a in zip(eqn.outvars, ins):
            if not isinstance(o, core.DropVar):
                level.env[o] = a
        return ctx


def transpose(closed_jaxpr: Any, predicate: Predicate | None = None):
    """A jaxpr that returns the tagged values instead of the outputs.

    Arguments:
        closed_jaxpr: the program.
        predicate: selects tags (None: all).

    Returns:
        ``(jaxpr, params_list, structures)``: ``jaxpr`` has the original
        inputs and one output per tag leaf (stacked along the scan axis for
        tags inside ``scan``), ``params_list`` the params of each tag and
        ``structures`` each tag's pytree of avals.

    Raises:
        ValueError: a tag has no single value (inside ``while`` or in one
            branch of a ``cond``).
    """
    engine = Engine(_CollectSites(), predicate, [], _TransposeHooks())
    outvars = _jaxpr.jaxpr_parts(closed_jaxpr).outvars
    threaded = engine.thread_jaxpr(closed_jaxpr, (), 0, len(outvars))
    collects = engine.channels(threaded).collects
    tagged = _jaxpr.jaxpr_parts(threaded).outvars[len(outvars):]
    new = _jaxpr.dce_closed(_jaxpr.with_parts(threaded, outvars=tagged), [True] * len(tagged))
    params = [dict(key.site.params) for key, _ in collects]
    structures = [jax.tree_util.tree_unflatten(key.site.tree, list(avals))
                  for key, avals in collects]
    return new, params, structures


def partition_out(closed_jaxpr: Any, outvar_indices: list[list[int]]) -> list[Any]:
    """One closed jaxpr per group of output indices, each computing only
    those outputs (dead code removed, also inside nested jaxprs).

    Returns:
        A list of closed jaxprs with the original inputs.
    """
    outvars = _jaxpr.jaxpr_parts(closed_jaxpr).outvars
    parts = []
    for group in outvar_indices:
        picked = _jaxpr.with_parts(closed_jaxpr, outvars=[outvars[i] for i in group])
        parts.append(_jaxpr.dce_closed(picked, [True] * len(group)))
    return parts


def strip_outputs(closed_jaxpr: Any, indices: Iterable[int]) -> Any:
    """``closed_jaxpr`` without the outputs at ``indices`` (and the code only
    they needed, also inside nested jaxprs)."""
    drop = set(indices)
    n = len(_jaxpr.jaxpr_parts(closed_jaxpr).outvars)
    return partition_out(closed_jaxpr, [[i for i in range(n) if i not in drop]])[0]


def fix_inputs(closed_jaxpr: Any, args: dict[int, Any]) -> Any:
    """Fix some inputs of a closed jaxpr: ``args`` maps input positions to
    values, which become consts of the result (the jaxpr counterpart of
    ``functools.partial``). ``tx.partial`` is the same function (taxpr
    0.0.3's name)."""
    constvars, consts, invars, eqns, outvars, effects, dbg = _jaxpr.jaxpr_parts(closed_jaxpr)
    for i, v in args.items():
        aval = invars[i].aval
        if tuple(jax.numpy.shape(v)) != tuple(aval.shape) or jax.numpy.result_type(v) != aval.dtype:
            raise ValueError(f"taxpr.fix_inputs: value for input {i} has type "
                             f"{jax.numpy.result_type(v)}{list(jax.numpy.shape(v))}, "
                             f"expected {aval.str_short()}")
    fixed = [invars[i] for i in sorted(args)]
    values = [jax.numpy.asarray(args[i], invars[i].aval.dtype) for i in sorted(args)]
    rest = [v for i, v in enumerate(invars) if i not in args]
    return _jaxpr.make_closed([*constvars, *fixed], [*consts, *values], rest, eqns, outvars,
                               effects, dbg)


partial = fix_inputs  # taxpr 0.0.3's name

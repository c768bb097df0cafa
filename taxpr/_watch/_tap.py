"""``tx.tap``: the values of selected sites streamed to the host as a
compiled program computes them, loop iteration by iteration."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import numpy as np

from .._calls import hashable
from .._capture._api import Traced
from .._inject import split_arguments
from .._capture._select import SelectorLike, select
from .. import _traverse
from ._loops import Hooks, LoopIndex, run_watched


class _TapHooks(Hooks):
    def __init__(self, callback: Callable[[str, Any, Any], None]):
        self.callback = callback

    def value(self, site: Any, value: Any, steps: tuple) -> None:
        def host(value, *steps):
            step = int(np.max(steps[-1])) if steps else None
            self.callback(site.name, np.asarray(value), step)
        # A debug callback: JAX keeps it where its output is unused (under
        # grad too); under vmap it runs once per example.
        jax.debug.callback(host, jax.lax.stop_gradient(value), *steps)


def tap(fn: Callable, selector: SelectorLike | Sequence[SelectorLike],
        callback: Callable[[str, Any, Any], None]) -> Callable:
    """``fn`` with the values of the selected sites given to ``callback``
    on the host as they are computed: the live counterpart of
    ``tx.capture`` (nothing is kept in device memory).

    Arguments:
        fn: the function (unmodified: any library's).
        selector: which sites, as ``tx.capture`` selects them (a glob over
            ``tx.sites`` names, a predicate over ``taxpr.Site``, a
            ``taxpr.select`` helper), or a list of them.
        callback: ``callback(name, value, step)``: the site's name, its
            value (a NumPy array; under ``vmap``, one call per example), and the
            iteration of the innermost loop around the site (None outside
            loops).

    Returns:
        The wrapped function, returning what ``fn`` returns (bit for bit);
        it composes with ``jit``, ``vmap`` and ``grad`` (the forward
        values).
    """
    selectors = list(selector) if isinstance(selector, (list, tuple)) else [selector]
    hooks = _TapHooks(callback)
    return watched_per_signature(
        fn, selectors, "tap",
        # the loops around the tapped sites, for their iteration counts
        lambda index, sites: ({k for _, eqn in sites for k in index.enclosing(eqn)}, hooks))


def watched_per_signature(fn: Callable, selectors: Sequence[SelectorLike], what: str,
                          plan: Callable[[LoopIndex, list], tuple[Any, Hooks]]) -> Callable:
    """``fn`` run with the sites ``selectors`` select tapped (``Hooks.value``)
    and loops watched, traced and compiled once per call signature.

    Arguments:
        fn: the function.
        selectors: the sites to tap (``tx.capture``'s selectors).
        what: the transformation's name, for errors.
        plan: ``plan(index, sites) -> (loop_keys, hooks)``: given the
            program's ``LoopIndex`` and the selected ``(site, equation)``
            pairs (in program order), the keys of the loops to watch and the
            ``Hooks``.

    Returns:
        The wrapped function, returning what ``fn`` returns.
    """
    # (key: the traced leaves' types and the static leaves, kept alive with
    # the entry) -> (the compiled run, how to unflatten its outputs)
    compiled: dict = {}

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        split = split_arguments(args, kwargs)
        static = jax.tree_util.tree_leaves(split.static)
        key = (split.tree, tuple((np.shape(x), jax.dtypes.result_type(x)) for x in split.leaves),
               tuple(hashable(v) for v in static))
        if key not in compiled:
            compiled[key] = (*_watched(fn, args, kwargs, selectors, what, plan), static)
        run, unflatten, _ = compiled[key]
        return unflatten(run(*split.leaves))

    return wrapped


def _watched(fn, args, kwargs, selectors, what, plan) -> tuple[Callable, Callable]:
    """``fn`` traced at ``args``, its selected sites tapped and the loops
    ``plan`` picks watched: the compiled function of the traced leaves and
    the unflattening of its outputs."""
    traced = Traced(fn, args, kwargs)
    chosen_sites = {s.name: s for sel in selectors for s in select(traced.sites, sel, what)}
    by_ordinal: dict[int, list] = {}
    for site in chosen_sites.values():
        by_ordinal.setdefault(site.ordinal, []).append(site)
    index = LoopIndex(traced.closed)
    taps: dict[int, list] = {}
    sites: list = []
    for ordinal, (eqn, _, _) in enumerate(_traverse.walk(traced.closed)):
        for site in by_ordinal.get(ordinal, ()):
            taps.setdefault(id(eqn), []).append((site, site.output))
            sites.append((site, eqn))
    loop_keys, hooks = plan(index, sites)
    loops = {k: index.loops[k] for k in loop_keys}
    run = jax.jit(lambda *leaves: run_watched(traced.closed, leaves, index, loops, hooks, taps))
    return run, traced.unflatten

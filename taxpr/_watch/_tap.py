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
    def __init__(self, callback: Callable[[str, Any, Any], None],
                 on_cotangent: Callable[[str, Any, Any], None] | None = None):
        self.callback, self.on_cotangent = callback, on_cotangent

    def value(self, site: Any, value: Any, steps: tuple) -> Any:
        # A debug callback: JAX keeps it where its output is unused (under
        # grad too); under vmap it runs once per example.
        jax.debug.callback(_to_host(self.callback, site.name), jax.lax.stop_gradient(value),
                           *steps)
        if self.on_cotangent is None:
            return None
        return _cotangent_tapped(self.on_cotangent, site.name)(value, *steps)


def _to_host(callback: Callable[[str, Any, Any], None], name: str) -> Callable:
    """The host side of a tap: ``callback(name, value, step)``, ``step`` the
    innermost enclosing loop's iteration (the largest in a batch)."""
    def host(value, *steps):
        step = int(np.max(steps[-1])) if steps else None
        callback(name, np.asarray(value), step)
    return host


def _cotangent_tapped(callback: Callable[[str, Any, Any], None], name: str) -> Callable:
    """The identity on a site's value whose backward pass gives its
    cotangent to ``callback`` (with the iteration its forward value had)."""
    @jax.custom_vjp
    def tapped(value, *steps):
        return value

    def fwd(value, *steps):
        return value, steps

    def bwd(steps, cotangent):
        jax.debug.callback(_to_host(callback, name), cotangent, *steps)
        return (cotangent, *(None for _ in steps))  # (steps: integers, no cotangent)

    tapped.defvjp(fwd, bwd)
    return tapped


def tap(fn: Callable, selector: SelectorLike | Sequence[SelectorLike],
        callback: Callable[[str, Any, Any], None], *,
        cotangents: Callable[[str, Any, Any], None] | None = None) -> Callable:
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
        cotangents: ``cotangents(name, cotangent, step)``, called in the
            backward pass when the wrapped function is differentiated in
            reverse mode (``jax.grad`` of it): the cotangent of each
            selected site's value (the derivative of what is differentiated
            with respect to it), with the iteration its value was computed
            at, in the order the backward pass computes them (the last
            iteration first). Default: none.

    Returns:
        The wrapped function, returning what ``fn`` returns (bit for bit);
        it composes with ``jit``, ``vmap`` and ``grad`` (the forward
        values, and with ``cotangents=`` the backward pass's).
    """
    selectors = list(selector) if isinstance(selector, (list, tuple)) else [selector]
    hooks = _TapHooks(callback, cotangents)
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

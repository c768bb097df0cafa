"""``tx.progress``: progress bars for the loops of a compiled program,
on unmodified code."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .._calls import Signature
from .._capture._select import SelectorLike
from .._host import once, poll, tick
from ._display import LoopInfo, default_display
from ._loops import Hooks, Loop, LoopIndex, run_watched
from ._tap import watched_per_signature


class _ProgressHooks(Hooks):
    """Host callbacks telling ``display`` where each watched loop is: its
    count of iterations, or for a loop shown by a value (``LoopInfo.value``)
    the value of that site."""

    def __init__(self, infos: dict[int, LoopInfo], display: Callable[[], Any],
                 adaptive: bool):
        self.infos, self.display, self.adaptive = infos, display, adaptive
        self.paces: dict[int, _Pace] = {}
        self.by_value = {info.value: key for key, info in infos.items() if info.value is not None}
        self.last_value: dict[int, float] = {}  # loop key -> the value last shown

    def every(self, loop: Loop) -> int:
        return self.infos[loop.key].every

    def start(self, loop: Loop, token: Any, io: bool) -> Any:
        info = self.infos[loop.key]

        def on_host(t):
            self.paces[loop.key] = _Pace(self.adaptive)
            self.last_value[loop.key] = 0.0
            self.display().start(info)
        return once(on_host, [token], io=io)

    def value(self, site: Any, value: Any, steps: tuple) -> None:
        key = self.by_value[site.name]
        info = self.infos[key]

        def on_host(v, i):
            self.last_value[key] = float(v)
            self.display().update(info, float(v))
        # The value loop is the innermost watched loop around the site:
        # steps[-1] is its iteration. An array value shows its smallest
        # element; under vmap, the batch's smallest (the slowest example).
        shown = jnp.min(jnp.asarray(value)).astype(jnp.float32)
        once(on_host, [shown, steps[-1]], reduce=jnp.min, io=False,
             when=(lambda v, i: i % info.every == 0) if info.every > 1 else None)

    def tick(self, loop: Loop, i: Any, io: bool) -> Any:
        info = self.infos[loop.key]
        if info.value is not None:
            return i
        every, total = info.every, info.total
        # Under vmap: the slowest example (a while loop with a batched
        # predicate runs until every example is done).
        return tick(lambda n: self.display().update(info, int(n)), i,
                    when=lambda n: (n % every == 0) | (n == (total or -1)), io=io)

    def poll(self, loop: Loop, i: Any, next_at: Any, io: bool) -> Any:
        info = self.infos[loop.key]
        if info.value is not None:
            return next_at
        if not io:  # (no answer from the host: an update per chunk)
            self.tick(loop, i, io)
            return next_at

        def on_host(n: int) -> int:
            self.display().update(info, n)
            pace = self.paces.setdefault(loop.key, _Pace(self.adaptive))
            return pace.next_at(n, info)
        return poll(on_host, i, next_at)

    def end(self, loop: Loop, i: Any, io: bool) -> Any:
        info = self.infos[loop.key]
        if info.value is not None:
            return once(lambda n: self.display().close(info, self.last_value.get(loop.key, 0.0)),
                        [i], reduce=jnp.max, io=io)
        return once(lambda n: self.display().close(info, int(n)), [i], reduce=jnp.max, io=io)


def progress(fn: Callable, *, loops: str | Callable[[LoopInfo], bool] | None = None,
             nested: bool = False, every: int | None = None, desc: str | None = None,
             total: int | float | None = None, value: SelectorLike | None = None,
             display: Any = None) -> Callable:
    """``fn`` showing the progress of its loops while it runs compiled.

    Every ``lax.scan`` (``fori_loop`` with static bounds) and
    ``lax.while_loop`` of the traced program is found, in ``fn`` or in any
    library it calls, and gets a bar: its total is the scan's length (a
    while loop's ``total=``, or none: a count). The outputs are those of
    ``fn``, bit for bit.

    Arguments:
        fn: the function.
        loops: which loops: a glob over their path names
            (``"*diffeqsolve*/while"``, ``"jit[train]/scan*"``) or a predicate
            over ``LoopInfo``. Default: the outermost loops.
        nested: with ``loops=None``, every loop (nested loops: nested bars).
        every: iterations between two updates. Default: a scan's display
            is updated a few times a second at the loop's measured speed
            (each update is a host callback, tens of microseconds), a while
            loop's every iteration.
        desc: the label (default: the loop's path name).
        total: the number of iterations of a while loop, if known; with
            ``value=``, the value at which its loop is done.
        value: a site whose value shows the progress of the loop around it
            (the innermost one) in place of its count of iterations: a
            selector as ``tx.capture`` takes (a glob over ``tx.sites``
            names, a predicate, a ``tx.select`` helper) that selects one
            site. A diffrax solve's time, from ``t0`` to ``total=t1``:
            ``tx.select.source(function="*body_fun_aux") &
            tx.select.primitive("min")`` (``tprev = min(tprev, t1)`` in
            its loop). An array value shows its smallest element; under
            ``vmap``, the batch's smallest (the slowest example).
        display: what shows the progress: an object with ``start(loop)``,
            ``update(loop, n)`` and ``close(loop, n)`` (default: a ``tqdm``
            bar where ``tqdm`` installs, ``pip install 'taxpr[progress]'``,
            and stderr is a terminal; else plain lines).

    Returns:
        The wrapped function; it composes with ``jit``, ``vmap`` (one bar
        for the batch; a while loop shows its slowest example) and ``grad``
        (the forward loops).
    """
    shown: list = [display]

    def current_display():
        if shown[0] is None:
            shown[0] = default_display()
        return shown[0]

    def chosen_loops(index: LoopIndex, count_total: int | None = total) -> dict[int, LoopInfo]:
        infos = {}
        for loop in index.loops:
            if callable(loops):
                pick = loops(_info(loop, desc, count_total, every))
            elif loops is not None:
                pick = fnmatch.fnmatchcase(loop.name, loops)
            else:
                pick = nested or loop.depth == 0
            if pick:
                infos[loop.key] = _info(loop, desc, count_total, every)
        return infos

    compiled: dict = {}

    if value is not None:
        def by_value(index: LoopIndex, site: Any, eqn: Any) -> dict[int, LoopInfo]:
            around = index.enclosing(eqn)
            if not around:
                raise ValueError(f"taxpr.progress: the site {site.name!r} that value= selects "
                                 f"is not inside a loop")
            key = around[-1]
            infos = {k: _info(index.loops[k], desc, None, every)
                     for k in chosen_loops(index, count_total=None)}
            infos[key] = dataclasses.replace(
                _info(index.loops[key], desc, None, every), total=total, value=site.name,
                every=every or 1)
            return infos

        return watched_per_signature(
            fn, [value], "progress",
            lambda index, sites: _one_value_loop(index, sites, by_value, current_display,
                                                 every))

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        sig, dynamic = Signature.of(args, kwargs)
        key = (sig, tuple((jnp.shape(x), jnp.result_type(x)) for x in dynamic))
        if key not in compiled:
            closed, out_shape = jax.make_jaxpr(lambda *d: sig.call(fn, d),
                                               return_shape=True)(*dynamic)
            index = LoopIndex(closed)
            infos = chosen_loops(index)
            chosen = {k: index.loops[k] for k in infos}
            hooks = _ProgressHooks(infos, current_display, adaptive=every is None)
            out_tree = jax.tree_util.tree_structure(out_shape)
            compiled[key] = (jax.jit(lambda *d: run_watched(closed, d, index, chosen, hooks)),
                             out_tree)
        run, out_tree = compiled[key]
        return jax.tree_util.tree_unflatten(out_tree, run(*dynamic))

    return wrapped


def _one_value_loop(index: LoopIndex, sites: list, by_value: Callable,
                    display: Callable[[], Any], every: int | None) -> tuple[dict, Hooks]:
    """The watched loops and hooks of ``progress(..., value=)``: ``sites``
    (the selected ``(site, eqn)``) must be one site inside a loop."""
    if len(sites) != 1:
        names = [site.name for site, _ in sites]
        raise ValueError(f"taxpr.progress: value= must select one site; it selects "
                         f"{len(names)}: {names[:5]}{' ...' if len(names) > 5 else ''}")
    site, eqn = sites[0]
    infos = by_value(index, site, eqn)
    return infos, _ProgressHooks(infos, display, adaptive=every is None)


class _Pace:
    """When a scan's display is updated next: ``every`` iterations, or by
    default (``adaptive``) a few times a second at the loop's measured
    speed (each update is a host callback, tens of microseconds: a loop
    that ends in milliseconds is updated once or twice)."""

    INTERVAL = 0.2  # seconds between two updates, by default

    def __init__(self, adaptive: bool = True):
        self.adaptive = adaptive
        self.t0 = time.monotonic()

    def next_at(self, n: int, info: LoopInfo) -> int:
        if not self.adaptive or n <= 0:
            return n + info.every
        rate = n / max(time.monotonic() - self.t0, 1e-9)
        return n + max(info.every, int(rate * self.INTERVAL))


def _info(loop: Loop, desc: str | None, total: int | None, every: int | None) -> LoopInfo:
    n = loop.total if loop.total is not None else total
    # A scan runs in chunks of 1% (polled between chunks, by default a few
    # times a second); a while loop, whose length is not known, every
    # iteration.
    step = every if every is not None else (-(-n // 100) if loop.kind == "scan" and n else 1)
    return LoopInfo(loop.key, loop.kind, loop.name, n, loop.depth,
                    desc if desc is not None else loop.name, step)

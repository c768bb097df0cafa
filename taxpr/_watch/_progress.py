"""``tx.progress``: progress bars for the loops of a compiled program,
on unmodified code."""

from __future__ import annotations

import fnmatch
import functools
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .._calls import Signature
from .._host import once, poll, tick
from ._display import LoopInfo, default_display
from ._loops import Hooks, Loop, LoopIndex, run_watched


class _ProgressHooks(Hooks):
    """Host callbacks telling ``display`` where each watched loop is."""

    def __init__(self, infos: dict[int, LoopInfo], display: Callable[[], Any],
                 adaptive: bool):
        self.infos, self.display, self.adaptive = infos, display, adaptive
        self.paces: dict[int, _Pace] = {}

    def every(self, loop: Loop) -> int:
        return self.infos[loop.key].every

    def start(self, loop: Loop, token: Any, io: bool) -> Any:
        info = self.infos[loop.key]

        def on_host(t):
            self.paces[loop.key] = _Pace(self.adaptive)
            self.display().start(info)
        return once(on_host, [token], io=io)

    def tick(self, loop: Loop, i: Any, io: bool) -> Any:
        info = self.infos[loop.key]
        every, total = info.every, info.total
        # Under vmap: the slowest example (a while loop with a batched
        # predicate runs until every example is done).
        return tick(lambda n: self.display().update(info, int(n)), i,
                    when=lambda n: (n % every == 0) | (n == (total or -1)), io=io)

    def poll(self, loop: Loop, i: Any, next_at: Any, io: bool) -> Any:
        info = self.infos[loop.key]
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
        return once(lambda n: self.display().close(info, int(n)), [i], reduce=jnp.max, io=io)


def progress(fn: Callable, *, loops: str | Callable[[LoopInfo], bool] | None = None,
             nested: bool = False, every: int | None = None, desc: str | None = None,
             total: int | None = None, display: Any = None) -> Callable:
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
        total: the number of iterations of a while loop, if known.
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

    def chosen_loops(index: LoopIndex) -> dict[int, LoopInfo]:
        infos = {}
        for loop in index.loops:
            if callable(loops):
                pick = loops(_info(loop, desc, total, every))
            elif loops is not None:
                pick = fnmatch.fnmatchcase(loop.name, loops)
            else:
                pick = nested or loop.depth == 0
            if pick:
                infos[loop.key] = _info(loop, desc, total, every)
        return infos

    compiled: dict = {}

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

"""What a person sees of a loop's progress: a ``tqdm`` bar, or plain
lines where ``tqdm`` is missing or the output is not a terminal.

A display receives ``start(loop)``, ``update(loop, n)`` and ``close(loop,
n)`` from the host callbacks ``tx.progress`` injects (``loop``: a
``LoopInfo``); any object with these three methods can be given to
``tx.progress(..., display=...)``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any


@dataclasses.dataclass(frozen=True)
class LoopInfo:
    """One watched loop of a traced program.

    Attributes:
        key: its ordinal among the program's loops (stable across calls).
        kind: ``"scan"`` or ``"while"``.
        name: its path through the program (``"jit[train]/scan[length=1000]"``).
        total: the number of iterations (a scan's length, a ``fori_loop``'s
            trip count, ``total=`` for a while loop), or None.
        depth: how many watched loops enclose it.
        desc: the label shown.
        every: how many iterations pass between two updates.
        value: the name of the site (as ``tx.sites`` names it) whose value
            the loop's progress is (``tx.progress(..., value=...)``), or
            None: the progress is the count of iterations. ``total`` is
            then the value at which the loop is done (a float).
    """

    key: int
    kind: str
    name: str
    total: int | float | None
    depth: int
    desc: str
    every: int
    value: str | None = None


class PlainDisplay:
    """A line per update, at most every ``interval`` seconds (and the last):
    ``"epochs: 500/1000 (50%)"``."""

    def __init__(self, stream: Any = None, interval: float = 0.5):
        self.stream = stream
        self.interval = interval
        self._last: dict[int, float] = {}

    def _write(self, text: str) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        stream.write(text + "\n")
        stream.flush()

    def _line(self, loop: LoopInfo, n: int | float) -> str:
        indent = "  " * loop.depth
        if loop.value is not None:  # (a carried value: a float)
            if loop.total:
                return (f"{indent}{loop.desc}: {n:g}/{loop.total:g} "
                        f"({int(100 * n / loop.total)}%)")
            return f"{indent}{loop.desc}: {n:g}"
        if loop.total:
            return f"{indent}{loop.desc}: {n}/{loop.total} ({100 * n // loop.total}%)"
        return f"{indent}{loop.desc}: {n}"

    def start(self, loop: LoopInfo) -> None:
        self._last[loop.key] = time.monotonic()
        self._write(self._line(loop, 0))

    def update(self, loop: LoopInfo, n: int) -> None:
        now = time.monotonic()
        if now - self._last.get(loop.key, 0.0) >= self.interval:
            self._last[loop.key] = now
            self._write(self._line(loop, n))

    def close(self, loop: LoopInfo, n: int) -> None:
        self._write(self._line(loop, n) + " done")


class TqdmDisplay:
    """A ``tqdm`` bar per loop (nested loops: nested bars); a warm second
    call of the same loop starts a new bar."""

    def __init__(self, **tqdm_kwargs):
        from tqdm.auto import tqdm  # optional: taxpr[progress]
        self._tqdm = tqdm
        self._kwargs = tqdm_kwargs
        self._bars: dict[int, Any] = {}

    def start(self, loop: LoopInfo) -> None:
        old = self._bars.pop(loop.key, None)
        if old is not None:
            old.close()
        self._bars[loop.key] = self._tqdm(total=loop.total, desc=loop.desc, position=loop.depth,
                                          leave=loop.depth == 0, **self._kwargs)

    def update(self, loop: LoopInfo, n: int) -> None:
        bar = self._bars.get(loop.key)
        if bar is not None and n > bar.n:
            bar.update(n - bar.n)

    def close(self, loop: LoopInfo, n: int) -> None:
        bar = self._bars.pop(loop.key, None)
        if bar is not None:
            if n > bar.n:
                bar.update(n - bar.n)
            bar.close()


def default_display() -> Any:
    """``TqdmDisplay`` where ``tqdm`` installs and stderr is a terminal (or
    ``TAXPR_PROGRESS=tqdm``), else ``PlainDisplay``."""
    choice = os.environ.get("TAXPR_PROGRESS", "")
    if choice != "plain" and (choice == "tqdm" or sys.stderr.isatty()):
        try:
            return TqdmDisplay()
        except ImportError:
            pass
    return PlainDisplay()

"""Python's cyclic garbage collector paused while taxpr rewrites a program.

A trace and its rewrite allocate objects in proportion to the program
(equations, variables, environments) and free them by reference count; the
collections their allocations set off walk the whole heap (the program, its
rewrite, JAX's caches), more of it the larger the program, and find next to
nothing: a third of the time of a large rewrite. One pause around the whole
rewrite leaves a single collection for afterwards."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off in the block (nested blocks: the outermost
    one turns it back on; a collector the user turned off stays off)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()

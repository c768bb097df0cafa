"""A host callback run only when a flag computed on device is set, told
which ``vmap`` examples set it.

``notify(flag, values, host)`` calls ``host(values, example)`` on the host
for the first example whose ``flag`` is true (``example``: its index along
the innermost ``jax.vmap`` around the call, or None outside ``vmap``),
and costs a ``cond`` otherwise. Under ``vmap`` the whole batch goes to the
host in one call (``custom_vmap``), so that the example's index is known.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap


def notify(flag: Any, values: Sequence[Any], host: Callable[[list, int | None], None]) -> None:
    """See the module docstring. ``host`` runs at most once per call (per
    innermost ``vmap`` batch)."""
    # What the host is told is not differentiated (custom_vmap has no JVP).
    flag = jax.lax.stop_gradient(flag)
    values = [jax.lax.stop_gradient(v) for v in values]

    def unbatched(values):
        jax.debug.callback(lambda *vs: host(list(vs), None), *values)

    @custom_vmap
    def call(flag, values):
        jax.lax.cond(flag, lambda: unbatched(values), lambda: None)
        return flag

    @call.def_vmap
    def _batched(axis_size, in_batched, flag, values):
        flag_batched, values_batched = in_batched
        flags = flag if flag_batched else jnp.broadcast_to(flag, (axis_size,))

        def on_host(flags, *vs):
            example = int(np.flatnonzero(np.asarray(flags))[0])
            host([np.asarray(v)[example] if b else v for v, b in zip(vs, values_batched)],
                 example)

        jax.lax.cond(jnp.any(flags), lambda: jax.debug.callback(on_host, flags, *values),
                     lambda: None)
        return flag, flag_batched

    call(flag, values)


# The errors found while a wrapper waits for its call, innermost wrapper
# last (a plain list: callbacks may run on another thread, outside the
# caller's context).
_COLLECTORS: list[list] = []


@contextlib.contextmanager
def collecting() -> Iterator[list]:
    """Errors ``deliver``ed while the block runs (the wrapped call and its
    ``jax.effects_barrier()``) are appended to the yielded list instead of
    raised from their callbacks."""
    found: list = []
    _COLLECTORS.append(found)
    try:
        yield found
    finally:
        _COLLECTORS.remove(found)


def deliver(error: Exception) -> None:
    """``error``, found by a host callback: kept for the wrapper waiting for
    the call (``collecting``), else raised from the callback (JAX reports
    it as its runtime error, with the message)."""
    if _COLLECTORS:
        _COLLECTORS[-1].append(error)
        return
    raise error

"""Host callbacks that know about ``vmap``: the one injection of host
callbacks that debugging (``_debug``) and watching loops (``_watch``)
share.

* ``notify(flag, values, host)``: a host callback run only when a flag
  computed on device is set, told which ``vmap`` example set it;
* ``once(host, values, reduce)``: a host callback run once per call, not
  once per ``vmap`` example (a batch's values reduced on device), whose
  result what follows depends on (callbacks stay in order);
* ``tick(host, i, when)``: a host callback in a loop, once per call where
  ``when(i)`` holds;
* ``poll(host, i, next_at)``: a host callback in a loop when ``i`` reaches
  ``next_at``, the host choosing the next one (updates a few times a
  second, whatever the loop's speed);
* ``collecting()`` / ``deliver(error)``: errors found by callbacks, raised
  by the wrapper waiting for the call when there is one;
* ``gated(pred)``: while code is traced in the block, ``once``, ``tick``
  and ``poll`` call the host only where ``pred`` holds (in a ``shard_map`` body: on its
  first shard, so that a bar is shown once, not once per shard).

``notify(flag, values, host)`` calls ``host(values, example)`` on the host
for the first example whose ``flag`` is true (``example``: its index along
the innermost ``jax.vmap`` around the call, or None outside ``vmap``),
and costs a ``cond`` otherwise. Under ``vmap`` the whole batch goes to the
host in one call (``custom_vmap``), so that the example's index is known.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental import io_callback


_GATE: contextvars.ContextVar[Any] = contextvars.ContextVar("taxpr_host_gate", default=None)


@contextlib.contextmanager
def gated(pred: Any) -> Iterator[None]:
    """See the module docstring: ``pred`` (a traced bool) gates the host
    callbacks ``once``, ``tick`` and ``poll`` trace in the block (where it
    does not hold, they pass their values through)."""
    outer = _GATE.get()
    token = _GATE.set(pred if outer is None else jnp.logical_and(outer, pred))
    try:
        yield
    finally:
        _GATE.reset(token)


def _gate(when: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """``when`` and the active gate (``gated``)."""
    gate = _GATE.get()
    if gate is None:
        return when
    if when is None:
        return lambda *values: gate
    return lambda *values: jnp.logical_and(gate, when(*values))


def once(host: Callable[..., None], values: Sequence[Any],
         reduce: Callable[[Any], Any] | None = None,
         when: Callable[..., Any] | None = None, io: bool = True) -> Any:
    """``host(*values)`` on the host, once per call: under ``vmap``, once
    for the batch, each batched value reduced by ``reduce`` (default: its
    first example); only if ``when(*values)`` (of the reduced values)
    holds, when given. Returns ``values[0]`` as passed through the host, so
    that what uses it runs after the callback (callbacks stay in order).
    Not differentiated. ``io=False`` where JAX allows no io effect (a while
    loop whose predicate ``vmap`` batched, a ``custom_vjp`` on some JAX
    versions): a debug callback, nothing waiting for it."""
    values = [jax.lax.stop_gradient(v) for v in values]
    when = _gate(when)

    def through_host(*vs):
        host(*vs)
        return np.asarray(vs[0])

    def callback(values):
        first = values[0]
        if not io:
            jax.debug.callback(host, *values)
            return first
        return io_callback(through_host, jax.ShapeDtypeStruct(jnp.shape(first), first.dtype),
                           *values)

    @custom_vmap
    def call(values):
        if when is None:
            return callback(values)
        return jax.lax.cond(when(*values), callback, lambda values: values[0], values)

    @call.def_vmap
    def _batched(axis_size, in_batched, values):
        (values_batched,) = in_batched
        reduced = [(reduce(v) if reduce is not None else v[0]) if b else v
                   for v, b in zip(values, values_batched)]
        out = call(reduced)
        if values_batched[0]:  # (the batch's own first values, in order after the call)
            return values[0] + jnp.zeros_like(values[0]) * out, True
        return out, False

    return call(values)


def tick(host: Callable[[Any], None], i: Any, when: Callable[[Any], Any],
         io: bool = True) -> Any:
    """``host(i)`` on the host where ``when(i)`` holds, once per call (under
    ``vmap``: for the batch's largest ``i``); returns ``i``, as passed
    through the host (what uses it runs after the callback). Under
    ``vmap``, a debug callback instead (allowed in a while loop whose
    predicate ``vmap`` batched), whose result nothing waits for."""
    i = jax.lax.stop_gradient(i)
    when = _gate(when)

    def through_host(i):
        host(i)
        return np.asarray(i)

    @custom_vmap
    def call(i):
        if not io:
            jax.lax.cond(when(i), lambda: jax.debug.callback(host, i), lambda: None)
            return i
        return jax.lax.cond(
            when(i), lambda i: io_callback(through_host, jax.ShapeDtypeStruct(i.shape, i.dtype), i),
            lambda i: i, i)

    @call.def_vmap
    def _batched(axis_size, in_batched, i):
        (batched,) = in_batched
        top = jnp.max(i) if batched else i
        jax.lax.cond(when(top), lambda: jax.debug.callback(host, top), lambda: None)
        return i, batched

    return call(i)


def poll(host: Callable[[int], int], i: Any, next_at: Any) -> Any:
    """Where ``i >= next_at``: ``host(i)`` on the host, which returns the
    next ``next_at``; else ``next_at``. Once per call (under ``vmap``: for
    the batch's largest ``i``); the result is not batched. An io callback
    (its result is used): not for a while loop whose predicate ``vmap``
    batched."""
    i, next_at = jax.lax.stop_gradient(i), jax.lax.stop_gradient(next_at)
    due = _gate(lambda i, next_at: i >= next_at)

    def on_host(i):
        return np.asarray(host(int(i)), np.int32)

    @custom_vmap
    def call(i, next_at):
        return jax.lax.cond(
            due(i, next_at),
            lambda: io_callback(on_host, jax.ShapeDtypeStruct((), jnp.int32), i),
            lambda: jnp.asarray(next_at, jnp.int32))

    @call.def_vmap
    def _batched(axis_size, in_batched, i, next_at):
        i_batched, at_batched = in_batched
        return call(jnp.max(i) if i_batched else i,
                    jnp.min(next_at) if at_batched else next_at), False

    return call(i, next_at)


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

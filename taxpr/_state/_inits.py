"""Callable ``init``s of ``get_state``: called once per outermost trace and
state (so every first use of a state in one trace sees the same value),
or staged out when only their types are needed."""

from __future__ import annotations

import contextlib
import contextvars
import types
import weakref
from typing import Any, Callable, Iterator

import jax
from .._jax.internals import core

from .._inject import IdentityKey
from ..primitives._tag import keep_tags, keeping_tags


# Per outermost trace (weakly held, so a finished trace drops its entries):
# the value of each (state name, callable init) already called in it. No
# tracer is held strongly, in keys or values: a tracer held here would keep
# its trace alive after it ends, which ``jax.checking_leaks()`` reports as a
# leaked tracer (and a tracer's trace refers back to it, so the entry would
# live as long as the outermost trace).
_INIT_VALUES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _init_key(init: Callable) -> tuple | None:
    """What makes two callable inits give the same value: the same object,
    or functions with the same code, globals, defaults and closure contents
    (a lambda written in a loop is a new object every iteration). None if
    that cannot be told (an empty closure cell)."""
    if not isinstance(init, types.FunctionType):
        return ("object", IdentityKey(init))
    try:
        cells = tuple(c.cell_contents for c in init.__closure__ or ())
    except ValueError:
        return None
    held = [IdentityKey(x) if not isinstance(x, core.Tracer) else _WeakIdent(x) for x in cells]
    # A closure holding tracers inside another object (a dict of traced
    # params): not cached, rather than held.
    if any(type(h) is IdentityKey and _holds_tracers(h.obj) for h in held):
        return None
    # The objects themselves (not their ids) are held in the key, so an id
    # cannot be reused while the trace lives (a tracer weakly: dead, it
    # equals nothing); compared by identity.
    return ("function", init.__code__, IdentityKey(init.__globals__),
            IdentityKey(init.__defaults__), IdentityKey(init.__kwdefaults__), tuple(held))


def _holds_tracers(x: Any) -> bool:
    return any(isinstance(leaf, core.Tracer) for leaf in jax.tree_util.tree_leaves(x))


class _WeakIdent:
    """``IdentityKey`` of a tracer, held weakly."""

    __slots__ = ("ref", "hash")

    def __init__(self, obj: Any):
        self.ref, self.hash = weakref.ref(obj), id(obj)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: Any) -> bool:
        obj = self.ref()
        return type(other) is _WeakIdent and obj is not None and other.ref() is obj


def _remember(per_trace: dict, key: Any, value: Any) -> Any:
    """Store ``value`` (a tracer weakly; not at all if it holds tracers
    otherwise) under ``key``; return it."""
    if isinstance(value, core.Tracer):
        per_trace[key] = weakref.ref(value)
    elif not _holds_tracers(value):
        per_trace[key] = lambda: value
    return value


def _recall(per_trace: dict, key: Any) -> Any | None:
    """The value stored under ``key``; None if absent or a dead tracer."""
    ref = per_trace.get(key)
    return None if ref is None else ref()


def enclosing_traces() -> list:
    """The trace JAX binds into now and the traces enclosing it (following
    ``parent_trace``), innermost first; empty when evaluating eagerly."""
    chain = []
    trace = core.trace_ctx.trace
    while trace is not None and not isinstance(trace, core.EvalTrace):
        chain.append(trace)
        trace = getattr(trace, "parent_trace", None)
    return chain


def outermost_trace() -> Any | None:
    """The outermost trace enclosing the one JAX binds into now (e.g. the
    ``make_jaxpr`` trace around a scan body's trace, a vmap's or jvp's
    trace), following ``parent_trace``; None when evaluating eagerly."""
    traces = enclosing_traces()
    return traces[-1] if traces else None


def call_init(name: str, init: Callable) -> Any:
    """``init()`` (evaluated at trace time), called once per state and
    trace (the outermost one: a program's scan bodies, branches and jitted
    functions share it).

    Inits with equal code, globals, defaults and closure contents give equal
    values, so one call serves every ``get_state`` of the state; an init
    that draws from a random generator of its own (NumPy's) draws once per
    state, and that draw is the state's value at first use wherever it is.
    Different states never share a call. This keeps a stateful program
    unrolled in Python as cheap to trace as one with explicit carries.

    Only inside taxpr's own transformations (``keep_tags()``), where a
    ``get_state``'s init is used only as the state's initial value (the
    first use's) and for its type: traced without them, every
    ``get_state`` returns its own init, so each is called (an init whose
    closure holds a mutable object changed in between gives a new value).

    Where only the states' types are needed (``make_jaxpr``), ``init`` is
    traced into the current trace instead (cheaper than evaluating it there)
    and the state pass drops what it computed."""
    if keeping_tags() and INITS_FOR_TYPES_ONLY.get():
        return _staged_init(name, init)
    trace = outermost_trace() if keeping_tags() else None
    key = None if trace is None else _init_key(init)
    if key is None:
        with jax.ensure_compile_time_eval():
            return init()
    per_trace = _INIT_VALUES.setdefault(trace, {})
    key = (name, key)
    hit = _recall(per_trace, key)
    if hit is None:
        with jax.ensure_compile_time_eval():
            hit = _remember(per_trace, key, init())
    return hit


def _staged_init(name: str, init: Callable) -> Any:
    """``init()`` traced into the current trace, once per state and trace;
    a value staged in an enclosing trace serves the traces nested in it."""
    traces = enclosing_traces()
    key = _init_key(init)
    if not traces or key is None:
        return init()
    key = ("staged", name, key)
    for trace in traces:
        hit = _recall(_INIT_VALUES.get(trace, {}), key)
        if hit is not None:
            return hit
    return _remember(_INIT_VALUES.setdefault(traces[0], {}), key, init())


# Set by ``make_jaxpr``: inits are needed only for their types (the pure
# program takes every state as an input).
INITS_FOR_TYPES_ONLY = contextvars.ContextVar("taxpr_inits_for_types_only", default=False)


@contextlib.contextmanager
def tracing_for_types() -> Iterator[None]:
    """A trace whose tags are kept and whose callable inits are needed only
    for their types (``make_jaxpr``'s): inits are staged, not evaluated."""
    token = INITS_FOR_TYPES_ONLY.set(True)
    try:
        with keep_tags():
            yield
    finally:
        INITS_FOR_TYPES_ONLY.reset(token)

"""The switches taxpr sets while JAX traces, in one place.

Two kinds:

* flags in JAX's trace context (``config`` states registered with
  ``include_in_trace_context``): JAX caches traces (jit's jaxpr, the bodies
  of scan / while / cond, checkpoint, custom rules) by function identity and
  ``config.trace_context()``, so a flag that changes what tracing produces
  must be in that key, or a trace made under one value is reused under
  another;
* context variables that taxpr's replacements of JAX's partial-evaluation
  rules read, set around JAX's own rules by ``in_staging_scope``.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable

from jax._src import config as _config

from .._compat import trace_context_flag


def trace_context_string(name: str, help: str) -> Any:
    """A thread-local optional string that is part of JAX's trace context
    (see ``trace_context_flag``): ``state.value`` (None by default) and
    ``with state(value): ...``."""
    if name in getattr(_config, "config_states", {}):
        return _config.config_states[name]  # module reloaded: reuse the registered state
    return _config.optional_string_state(name, None, help, include_in_trace_context=True)


# Keep mode (``primitives.keep_tags``): a trace JAX cached with keep mode off
# (the user ran the function before) is never reused under ``keep_tags()``
# and vice versa.
KEEP_TAGS = trace_context_flag(
    "taxpr_keep_tags", "taxpr: bind tags as kept tags (set by taxpr.keep_tags())")

# The custom_vjp fwd / bwd scopes tags are bound in (``primitives._tag``'s
# ``VjpScopes``, as a string): a trace cached in one scope is never reused in
# another.
VJP_SCOPES = trace_context_string(
    "taxpr_vjp_scopes", "taxpr: the custom_vjp fwd/bwd scopes tags are bound in")

# The patches carried into a derivative rule traced now
# (``_capture._carry.carrying``; a number unique in the process): a trace
# cached without them is never reused with them, nor the other way.
CARRY_SCOPE = trace_context_string(
    "taxpr_carried_patches", "taxpr: the patches carried into the rule traced now")

# The ``tx.scope`` states accessed now belong to: "/"-joined scope parts
# ("outer/inner"), or None outside every scope.
STATE_SCOPE = trace_context_string(
    "taxpr_state_scope", "taxpr: the tx.scope the states accessed now belong to")


# ---- where partial evaluation must stage kept tags whose inputs are known -----
#
# A kept tag whose inputs are all known is staged by taxpr's partial-evaluation
# rule where JAX would otherwise run it a different number of times than eager
# execution: a differentiated ``scan`` hoists loop-invariant work out of the
# loop (once instead of every step), a ``while`` runs its known part and then
# the whole loop again (twice). Where JAX linearizes a function from its JVP
# (``ad.linearize_from_jvp``: a custom_jvp rule under ``grad``, and primitives
# without a linearization rule), the primal outputs must stay known, so known
# kept tags are evaluated there (once, as eagerly). The innermost scope wins.

_STAGE_KNOWN_KEPT_TAGS = contextvars.ContextVar("taxpr_stage_known_kept_tags", default=True)


def staging_known_kept_tags() -> bool:
    """Whether partial evaluation now stages kept tags whose inputs are known."""
    return _STAGE_KNOWN_KEPT_TAGS.get()


# While JAX splits a loop into a known and a staged part (a differentiated
# scan's loop-invariant work hoisted out of it; a ``while`` whose known part
# runs before the whole loop runs again), a custom_jvp / custom_vjp call or a
# ``checkpoint`` whose inputs are all known, or a kept tag in a checkpoint
# (split by ``partial_eval_jaxpr_custom``, which consults no JaxprTrace rule),
# would land in the known part: once outside a scan, or twice for a while. One
# that holds kept tags is partially evaluated as unknown instead, so it stays
# in the loop.
_HOISTING = contextvars.ContextVar("taxpr_hoisting_loop_invariants", default=False)


def splitting_a_loop() -> bool:
    """Whether partial evaluation now splits a loop as above."""
    return _HOISTING.get()


def in_staging_scope(stage: bool, fn: Callable, hoisting: bool | None = None) -> Callable:
    """``fn`` run with staging ``stage`` and hoisting ``hoisting`` (None:
    unchanged)."""
    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        token = _STAGE_KNOWN_KEPT_TAGS.set(stage)
        hoisting_token = None if hoisting is None else _HOISTING.set(hoisting)
        try:
            return fn(*args, **kwargs)
        finally:
            if hoisting_token is not None:
                _HOISTING.reset(hoisting_token)
            _STAGE_KNOWN_KEPT_TAGS.reset(token)
    scoped._taxpr_wrapped = True
    return scoped

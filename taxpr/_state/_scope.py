"""Scopes: ``with tx.scope("bn1"):`` gives the states accessed inside their
own names, so one layer used twice keeps two states, and the state dict of
``uncurry`` nests them (``{"bn1": {"mean": ...}, "bn2": {...}}``).

The current scope is part of JAX's trace context (as taxpr's custom_vjp
scopes are), so a function traced and cached under one scope (``jax.jit``,
a ``lax.scan`` body) is traced again under another instead of reusing
names that belong to the first. ``_dicts`` nests the state dict by scope.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

from .. import _jaxpr
from .._jax.flags import STATE_SCOPE as _SCOPE
from ..primitives._tag import keeping_tags


class ScopedName(str):
    """The name of a state accessed inside ``tx.scope``: ``"bn1/mean"``,
    a string so that every message naming the state names its scope;
    ``scope`` (``("bn1",)``) and ``base`` (``"mean"``) are its parts."""

    scope: tuple[str, ...]
    base: str

    def __new__(cls, scope: tuple[str, ...], base: str) -> "ScopedName":
        obj = super().__new__(cls, "/".join((*scope, base)))
        obj.scope, obj.base = scope, base
        return obj

    def __reduce__(self):
        return (ScopedName, (self.scope, self.base))


def current_scope() -> tuple[str, ...]:
    """The parts of the scope states are accessed in now, outermost first."""
    value = _SCOPE.value
    return () if value is None else tuple(value.split("/"))


def scoped(name: str) -> str:
    """``name`` as the state accessed here: inside ``tx.scope``, a
    ``ScopedName`` under the current scope; elsewhere ``name`` itself."""
    parts = current_scope()
    return ScopedName(parts, name) if parts else name


@contextlib.contextmanager
def scope(name: str) -> Iterator[None]:
    """Give the states accessed inside their own names, under ``name``.

    Code run inside ``with tx.scope("bn1"):`` reads and writes the states
    ``bn1/<name>``: the same layer called in two scopes keeps two states.
    ``uncurry``'s state dict nests them by scope (``state0["bn1"]["mean"]``)
    and ``StateInfo.name`` is ``"bn1/mean"``. Scopes nest. The scope is also
    a ``jax.named_scope``, so profiles and ``tx.sites`` show it. Random key
    streams (``tx.next_key``) are not scoped: a stream is one sequence of
    keys wherever it is drawn from.

    Arguments:
        name: the scope's name: a non-empty string without ``"/"``; it may
            not also be the name of a state beside it.
    """
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"taxpr: tx.scope takes a non-empty name without '/', got {name!r}")
    with _SCOPE("/".join((*current_scope(), name))), jax.named_scope(name):
        yield


def scope_path(name: str) -> tuple[str, ...]:
    """The keys of state ``name`` in the nested state dict (its scope's
    parts, then its own name)."""
    return (*name.scope, name.base) if isinstance(name, ScopedName) else (name,)


def rules_in_call_scope(rules: tuple) -> tuple | None:
    """The derivative rules of a custom_jvp / custom_vjp call (its jvp, or
    its fwd and bwd, each an ``lu.WrappedFun``) made to run in the scope the
    call is made in; None where nothing changes (outside every scope and
    outside taxpr's transformations: JAX's own rules, untouched).

    JAX traces a rule later than the call, when it differentiates the
    program (``jax.grad`` of ``pure``, from outside every ``tx.scope``):
    without this, a state accessed there would be named as outside the
    scope, another state than the function's.
    """
    value = _SCOPE.value
    if value is None and not keeping_tags():
        return None

    def in_scope(rule):
        def run(*args):
            with _SCOPE(value):
                return rule.call_wrapped(*args)
        return _jaxpr.wrap_fun(run, rule)

    return tuple(map(in_scope, rules))

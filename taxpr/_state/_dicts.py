"""State dicts nested by scope: ``uncurry``'s ``{name: value}`` with the
states of each ``tx.scope`` in a ``StateScope`` of their own, and splitting
and merging such dicts (``tx.split_states`` / ``tx.merge_states``)."""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Iterator

import jax

from ._ops import StateError
from ._scope import scope_path


class StateScope(dict):
    """The states of one ``tx.scope`` in a state dict: a dict, and a pytree
    flattened as a dict is, whose type tells a scope apart from a state
    whose value is a dict."""


def _flatten_scope(scope: StateScope):
    keys = sorted(scope)
    return [(jax.tree_util.DictKey(k), scope[k]) for k in keys], tuple(keys)


jax.tree_util.register_pytree_with_keys(
    StateScope, _flatten_scope, lambda keys, values: StateScope(zip(keys, values)))


def state_keys(state: dict) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every state of a nested state dict as ``(keys, value)``: its
    scopes' names and its own (a ``StateScope`` is descended into; any
    other value, a dict included, is one state's)."""
    for key, value in state.items():
        if isinstance(value, StateScope):
            for keys, v in state_keys(value):
                yield (key, *keys), v
        else:
            yield (key,), value


def _insert(into: dict, keys: tuple[str, ...], value: Any) -> None:
    """Put a state's value at ``keys``, making its scopes.

    Raises:
        StateError: the place is taken, or a scope and a state there share
            a name (the message names it).
    """
    *parts, last = keys
    for i, part in enumerate(parts):
        at = into.setdefault(part, StateScope())
        if not isinstance(at, StateScope):
            raise _shared_name(keys[:i + 1])
        into = at
    if isinstance(into.get(last), StateScope):
        raise _shared_name(keys)
    if last in into:
        raise StateError(f"taxpr: state {'/'.join(keys)!r} is given twice")
    into[last] = value


def _shared_name(keys: tuple[str, ...]) -> StateError:
    return StateError(f"taxpr: {'/'.join(keys)!r} is both a state and a tx.scope; give one "
                      f"of them another name")


def nest(flat: dict[str, Any]) -> dict:
    """``{name: value}`` per state as the user's dict, scoped states nested
    by scope (``{"bn1": StateScope(mean=v)}``).

    Raises:
        StateError: a scope and a state beside it share a name.
    """
    out: dict = {}
    for name, value in flat.items():
        _insert(out, scope_path(name), value)
    return out


def lookup(state: dict, name: str) -> Any:
    """State ``name``'s value in the user's (nested) dict; KeyError names
    the first key missing."""
    at: Any = state
    for key in scope_path(name):
        if not isinstance(at, dict) or key not in at:
            raise KeyError(key)
        at = at[key]
    return at


def merge(old: dict, new: dict, names: list[str]) -> dict:
    """``old`` with the states ``names`` replaced by their values in
    ``new`` (both nested dicts): the states a call did not use, and the
    other states of the scopes it used, pass through unchanged."""
    out = dict(old)
    for name in names:
        *parts, last = scope_path(name)
        at, src = out, new
        for part in parts:
            # A scope given as a plain dict stays one (a scan carry keeps its
            # pytree structure); a scope the state lacked is a StateScope.
            before = at.get(part)
            at[part] = dict(before) if type(before) is dict else StateScope(before or {})
            at, src = at[part], src[part]
        at[last] = src[last]
    return out


def split_states(state: dict, select: str | Callable[[str], bool]) -> tuple[dict, dict]:
    """Split a state dict in two: the states ``select`` picks, and the rest.

    Arguments:
        state: ``uncurry``'s ``state0`` or a ``pure`` function's new state.
        select: a glob matched against each state's full name, its scopes
            and its name joined by ``"/"`` (``"bn1/*"``: every state of
            scope ``bn1``; ``"*mean"``: every state named ``mean``, in any
            scope), or a predicate of that name.

    Returns:
        ``(selected, rest)``: two nested dicts of the same form as
        ``state``, each holding only its states. ``tx.merge_states(selected,
        rest)`` gives ``state`` back; either part is a pytree an optimizer
        or ``jax.grad`` takes, and ``pure`` takes their merge.

    Scopes are the nested ``StateScope`` dicts ``uncurry`` and ``pure``
    return. A plain dict (a state dict restored or written by hand, whose
    scopes ``pure`` keeps plain) is one state if ``select`` picks it whole;
    otherwise its entries are matched as a scope's, and each part keeps it a
    plain dict.
    """
    pick = select if callable(select) else (lambda n: fnmatch.fnmatchcase(n, select))
    return _split(state, pick, ())


def _split(state: dict, pick: Callable[[str], bool], prefix: tuple[str, ...]
           ) -> tuple[dict, dict]:
    selected, rest = type(state)(), type(state)()
    for key, value in state.items():
        keys = (*prefix, key)
        plain_scope = (type(value) is dict and value
                       and all(isinstance(k, str) for k in value) and not pick("/".join(keys)))
        if isinstance(value, StateScope) or plain_scope:
            inner_selected, inner_rest = _split(value, pick, keys)
            if inner_selected:
                selected[key] = inner_selected
            if inner_rest:
                rest[key] = inner_rest
        elif pick("/".join(keys)):
            selected[key] = value
        else:
            rest[key] = value
    return selected, rest


def merge_states(*parts: dict) -> dict:
    """The state dict made of ``parts`` (``tx.split_states``' results, or
    any state dicts) with their scopes merged.

    Raises:
        StateError: a state is in more than one part.
    """
    out: dict = {}
    for part in parts:
        _merge_into(out, part, ())
    return out


def _merge_into(out: dict, part: dict, prefix: tuple[str, ...]) -> None:
    """``part``'s states put into ``out``; a scope in both (a ``StateScope``,
    or a plain dict that ``split_states`` split as a scope) is merged."""
    for key, value in part.items():
        keys = (*prefix, key)
        have = out.get(key)
        if isinstance(value, StateScope) or (type(value) is dict and type(have) is dict):
            if have is None:
                have = out[key] = type(value)()
            elif not isinstance(have, dict):
                raise _shared_name(keys)
            _merge_into(have, value, keys)
        elif isinstance(have, StateScope):
            raise _shared_name(keys)
        elif key in out:
            raise StateError(f"taxpr: state {'/'.join(keys)!r} is given twice")
        else:
            out[key] = value

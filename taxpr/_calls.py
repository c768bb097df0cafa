"""A call's arguments split into arrays (what a wrapper's ``jit`` takes)
and everything else (functions and flags: equinox modules hold them),
which is part of the signature the wrapper caches by."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np


class Signature:
    """The static part of a call: its pytree structure and the leaves that
    are not arrays. ``Signature.of(args, kwargs) -> (signature, arrays)``;
    ``signature.call(fn, arrays)`` calls ``fn`` with them put back."""

    def __init__(self, in_tree: Any, static: tuple[tuple[int, Any], ...]):
        self.in_tree, self.static = in_tree, static
        self.num_dynamic = in_tree.num_leaves - len(static)
        self._key = (in_tree, tuple((i, hashable(v)) for i, v in static))

    @staticmethod
    def of(args, kwargs) -> "tuple[Signature, list]":
        flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
        static = tuple((i, x) for i, x in enumerate(flat) if not _is_array(x))
        dynamic = [x for x in flat if _is_array(x)]
        return Signature(in_tree, static), dynamic

    def call(self, fn: Callable, dynamic) -> Any:
        flat, given = [], iter(dynamic)
        static = dict(self.static)
        for i in range(self.in_tree.num_leaves):
            flat.append(static[i] if i in static else next(given))
        args, kwargs = jax.tree_util.tree_unflatten(self.in_tree, flat)
        return fn(*args, **kwargs)

    def __eq__(self, other):
        return isinstance(other, Signature) and other._key == self._key

    def __hash__(self):
        return hash(self._key)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def hashable(v: Any) -> Any:
    """``v``, or a key standing for it where it is not hashable (its id:
    the caller keeps ``v`` alive while the key is in use)."""
    try:
        hash(v)
        return v
    except TypeError:
        return ("id", id(v))

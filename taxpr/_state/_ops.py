"""State accesses: ``get_state`` / ``set_state``, the ``StateOp`` that marks
their tags, and the errors and warnings of the state layer."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..primitives._tag import tag
from ._inits import call_init
from ._scope import scoped


class StateOp:
    """The ``op`` param of a state access. Compared by identity, so a user's
    ``op="get"`` string never equals (nor shares a cache entry with) it."""

    __slots__ = ("kind",)

    def __init__(self, kind: str):
        self.kind = kind

    def __repr__(self):
        return f"state.{self.kind}"

    def recomputed(self, saved: list, values: list) -> list:
        """The outputs of this access recomputed in a backward pass
        (``jax_remat3``): a read gives what the forward read, a write passes
        its value on (the derivative flows through) and writes nothing again."""
        return saved if self is GET else values

    def on_untransformed(self, params: dict, how: str) -> None:
        """Called when a state access is compiled or runs eagerly without
        ``uncurry``: ``how`` says which ("is being compiled", "ran eagerly")."""
        if self is SET:
            warnings.warn(
                f"taxpr: set_state({params['name']!r}) {how} without "
                f"tx.uncurry, so the update is lost (get_state returns the init, and "
                f"tx.next_key the same key on every call). Use `pure, state0 = "
                f"tx.uncurry(fn, *args)` and jit `pure` instead (or `tx.seed(fn, key)` "
                f"for a function that only draws keys).",
                StateNotUncurriedWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` called here that names the
    first caller outside taxpr and JAX (the user's line)."""
    taxpr_dir = os.path.dirname(os.path.dirname(__file__))
    inside = (taxpr_dir + os.sep, os.path.dirname(jax.__file__) + os.sep)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


GET, SET = StateOp("get"), StateOp("set")


class StateError(ValueError):
    """A state is used inconsistently (the message names it)."""


class StateNotUncurriedWarning(UserWarning):
    """A ``set_state`` reached compilation (e.g. ``jax.jit(fn)``) or ran
    eagerly (``fn(x)``, or under ``jax.disable_jit()``) without
    ``tx.uncurry``: its update is lost. Turn it into an error with
    ``warnings.simplefilter("error", tx.StateNotUncurriedWarning)``."""


def is_state_tag(params: dict, shape: Any = None) -> bool:
    """Whether a tag's params are a state access's (a tag predicate)."""
    return isinstance(params.get("op"), StateOp)


class LeafName(str):
    """The name of one array of a pytree-valued state: the state's name and
    the leaf's key path (``"stats['mean']"``, ``"t[0]"``), a string so that
    every message naming a state names the leaf; ``state`` and ``path``
    are its parts, and ``scope`` / ``base`` those of the state's name (as a
    scoped state's name has them: ``()`` and the name outside scopes)."""

    state: str
    path: str

    def __new__(cls, state: str, path: str) -> "LeafName":
        obj = super().__new__(cls, f"{state}{path}")
        obj.state, obj.path = state, path
        return obj

    @property
    def scope(self) -> tuple[str, ...]:
        return getattr(self.state, "scope", ())

    @property
    def base(self) -> str:
        return getattr(self.state, "base", str(self.state))

    def __reduce__(self):
        return (LeafName, (self.state, self.path))


def _leaves(name: str, value: Any, what: str) -> tuple[list, Any]:
    """``value`` as a state's arrays: ``([(name, array)], None)`` for one
    array, or ``([(LeafName, array), ...], treedef)`` for a pytree of arrays
    (a tuple, dict, NamedTuple, registered dataclass, optax state). Nested
    lists or tuples of Python scalars are one array literal, as for
    ``jnp.asarray``."""
    if isinstance(value, jax.Array):
        return [(name, value)], None
    if isinstance(value, (list, tuple)) and _scalars_only(value):
        return [(name, jnp.asarray(value))], None
    with_paths, tree = jax.tree_util.tree_flatten_with_path(value)
    if tree.num_nodes == 1 and tree.num_leaves == 1:  # a leaf: one array
        return [(name, jnp.asarray(value))], None
    if not with_paths:
        raise TypeError(f"taxpr: state {name!r}: {what} holds no array ({value!r})")
    return [(LeafName(name, jax.tree_util.keystr(path)),
             _array_leaf(name, jax.tree_util.keystr(path), leaf, what))
            for path, leaf in with_paths], tree


def _array_leaf(name: str, path: str, leaf: Any, what: str) -> Any:
    """``leaf`` of a pytree state as an array; a leaf that is no array (a
    string, a function: an equinox module's activation) is an error naming
    the state and the leaf."""
    if isinstance(leaf, jax.Array):
        return leaf
    try:
        return jnp.asarray(leaf)
    except TypeError:
        shown = repr(leaf)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TypeError(
            f"taxpr: state {name!r}: {what} has a leaf that is not an array at {path}: "
            f"{shown} ({type(leaf).__name__}). A state holds arrays only: keep the static "
            f"parts out of it (e.g. `params, static = equinox.partition(model, "
            f"equinox.is_array)`, the state holding `params`)") from None


def get_state(name: str, init: Any) -> Any:
    """The current value of state ``name``.

    Arguments:
        name: the state's name.
        init: an array-like or a pytree of them (a tuple, a dict, a
            NamedTuple, an optax state, typed PRNG keys as leaves), or a
            zero-argument callable returning one; it fixes the state's
            structure, shapes and dtypes and is its value at first use.

    Returns:
        The state's current value, with ``init``'s structure (``init`` when
        called outside ``uncurry``).

    Inside ``tx.scope(s)`` the state is ``s/name``, another state than
    ``name`` elsewhere.
    """
    return read(scoped(name), init)


def read(name: str, init: Any) -> Any:
    """``get_state`` of the state named ``name`` exactly (no scope added)."""
    if callable(init):
        init = call_init(name, init)
    # The init stays in the jaxpr as the tag's operand: a state the example
    # run never reaches gets it from there (``initial_states``).
    leaves, tree = _leaves(name, init, "get_state's init")
    if tree is None:
        return tag(leaves[0][1], op=GET, name=name)
    return jax.tree_util.tree_unflatten(
        tree, [tag(v, op=GET, name=n, state_tree=tree) for n, v in leaves])


def _scalars_only(value: Any) -> bool:
    return all(_scalars_only(v) if isinstance(v, (list, tuple))
               else isinstance(v, (bool, int, float, complex, np.bool_, np.number))
               for v in value)


def set_state(name: str, value: Any) -> Any:
    """Set state ``name`` to ``value`` and return ``value``.

    Arguments:
        name: the state's name. Setting a state never read creates it (with
            initial value zeros).
        value: the new value; it must have the state's structure (the
            pytree its ``get_state`` init has), shapes and dtypes.

    Returns:
        ``value``.

    Inside ``tx.scope(s)`` the state is ``s/name``, another state than
    ``name`` elsewhere.
    """
    return write(scoped(name), value)


def write(name: str, value: Any, by: str | None = None) -> Any:
    """``set_state`` of the state named ``name`` exactly (no scope added).
    ``by`` names the call that sets it for errors, where it is not
    ``set_state`` (``"next_key"``: a draw advances its stream's key)."""
    leaves, tree = _leaves(name, value, "set_state's value")
    extra = {} if by is None else {"by": by}
    if tree is None:
        return tag(leaves[0][1], op=SET, name=name, **extra)
    return jax.tree_util.tree_unflatten(
        tree, [tag(v, op=SET, name=n, state_tree=tree, **extra) for n, v in leaves])

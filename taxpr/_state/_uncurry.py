"""``uncurry`` and ``make_jaxpr``: tracing a function once per signature and
returning the pure function of ``(state, *args)``."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jaxpr
from .._collector import collector_paused
from .._expand import expand_for
from .._inject import (SignatureCache, SplitArguments, check_no_hidden_tags, hashable_static,
                       split_arguments, trace_program)
from ..primitives._tag import evaluated_fun, recording_tags
from . import _dicts
from ._collect import collect_states, first_differences, tree_paths
from ._dicts import lookup, merge, nest
from ._initial import initial_states
from ._inits import tracing_for_types
from ._ops import LeafName, StateError, is_state_tag
from ._rewrite import keep_written_outputs, pure_jaxpr


class _Traced:
    """One traced signature of ``uncurry``'s function."""

    def __init__(self, fn: Callable, split: SplitArguments, dyn_avals):
        self.closed, self.out_tree = trace_program(
            fn, split.tree, dyn_avals, getattr(fn, "__name__", "fn"),
            rebuild=split.rebuild, consumes=is_state_tag)
        self.states = collect_states(self.closed)
        self.pure = pure_jaxpr(self.closed, self.states)


def uncurry(fn: Callable, *example_args: Any, **example_kwargs: Any):
    """Turn a function that uses ``get_state``/``set_state`` into a pure one.

    Arguments:
        fn: the stateful function. Array leaves of its arguments are traced;
            other leaves are static (as ``equinox.filter_jit`` does).
        *example_args, **example_kwargs: arguments to discover the states
            and compute their initial values with.

    Returns:
        ``(pure, state0)``: ``state0`` is ``{name: initial value}`` and
        ``pure(state, *args, **kwargs) -> (out, new_state)`` is an ordinary
        JAX function (jit, vmap, grad, scan all apply).
    """
    traced = traced_per_signature(fn)
    with collector_paused():
        t0, leaves0 = traced(example_args, example_kwargs)
        state0 = nest_states(initial_states(t0.closed, t0.states, leaves0), t0.states)
    return pure_of(traced), state0


def traced_per_signature(fn: Callable) -> Callable:
    """``fn`` traced, its states found and made pure once per call signature
    (a ``per_signature`` lookup of ``_Traced``)."""
    return per_signature(lambda split, avals: _Traced(fn, split, avals))


def pure_of(traced: Callable) -> Callable:
    """``uncurry``'s pure function of ``(state, *args, **kwargs)`` for the
    per-signature traces ``traced`` (``traced_per_signature``)."""

    def pure(state: dict, *args, **kwargs):
        t, leaves = traced(args, kwargs)
        names = list(t.states)
        flat = flat_states(state, t.states)
        for n in names:
            info, v = t.states[n], flat[n]
            if tuple(np.shape(v)) != info.shape or jnp.result_type(v) != info.dtype:
                raise StateError(
                    f"taxpr: state {n!r} must be {info.dtype.name}{list(info.shape)}, got "
                    f"{jnp.result_type(v).name}{list(np.shape(v))}")
        outs = evaluated_fun(t.pure)(*(flat[n] for n in names), *leaves)
        n_out = t.out_tree.num_leaves
        # Entries this call path does not use pass through unchanged, as
        # they would in a dict (e.g. the state of a whole training run).
        new = nest_states(dict(zip(names, outs[n_out:])), t.states)
        used = list(dict.fromkeys(state_of(n) for n in names))
        return jax.tree_util.tree_unflatten(t.out_tree, outs[:n_out]), merge(state, new, used)

    return pure


def state_of(name: str) -> str:
    """The state an array-level name belongs to (a pytree state's leaf
    names its state)."""
    return name.state if isinstance(name, LeafName) else name


def nest_states(flat: dict, states: dict) -> dict:
    """``{name: array}`` per array (``states``' keys) as the user's state
    dict: each pytree-valued state rebuilt from its arrays, the states of
    each ``tx.scope`` nested under it."""
    leaves_of = {str(n): n for n in states if isinstance(n, LeafName)}
    out: dict = {}
    grouped: dict = {}
    for key, value in flat.items():
        leaf = leaves_of.get(str(key)) if not isinstance(key, LeafName) else key
        if leaf is None:
            out[key] = value
        else:
            grouped.setdefault(leaf.state, {})[leaf.path] = value
    for state, by_path in grouped.items():
        tree = next(info.tree for n, info in states.items()
                    if isinstance(n, LeafName) and n.state == state)
        out[state] = jax.tree_util.tree_unflatten(tree, [by_path[p] for p in tree_paths(tree)])
    return nest(out)


def flat_states(state: dict, states: dict) -> dict:
    """The user's state dict as ``{name: array}`` per array of ``states``
    (a pytree-valued state's arrays by key path), checked for missing
    states and structures (the error names the state and the leaf)."""
    wanted = list(dict.fromkeys(state_of(n) for n in states))
    values: dict = {}
    for n in wanted:
        try:
            values[n] = lookup(state, n)
        except KeyError:
            pass
    missing = [n for n in wanted if n not in values]
    if missing:
        raise StateError(f"taxpr: uncurry's pure function takes states {wanted}; "
                         f"missing {missing} (got {_names_in(state)})")
    flat: dict = {}
    by_state: dict = {}
    for n, info in states.items():
        if not isinstance(n, LeafName):
            flat[n] = values[n]
            continue
        leaves = by_state.get(n.state)
        if leaves is None:
            with_paths, got = jax.tree_util.tree_flatten_with_path(values[n.state])
            if got != info.tree:
                extra, lacks = first_differences(
                    tree_paths(info.tree), [jax.tree_util.keystr(p) for p, _ in with_paths])
                leaf = (f"the value given has no leaf {n.state}{lacks}" if lacks else
                        f"the value given has a leaf {n.state}{extra} the state has not"
                        if extra else "the containers differ")
                raise StateError(f"taxpr: state {n.state!r} must have structure {info.tree}, "
                                 f"got {got}: {leaf}")
            leaves = by_state[n.state] = {jax.tree_util.keystr(p): v for p, v in with_paths}
        flat[n] = leaves[n.path]
    return flat


def _names_in(state: dict) -> list[str]:
    """The full names (``"bn1/mean"``) of the states in a nested state dict."""
    return sorted("/".join(map(str, keys)) for keys, _ in _dicts.state_keys(state))


def per_signature(make: Callable[[SplitArguments, tuple], Any]) -> Callable:
    """A cache of ``make(split, avals)`` per call signature, as
    ``equinox.filter_jit`` keys it: array leaves of ``(args, kwargs)`` are
    traced (their avals count), other leaves are static (hashed, or by
    identity), the most recently used signatures kept (``SignatureCache``).

    Returns:
        ``lookup(args, kwargs) -> (made, array_leaves)``.
    """
    cache = SignatureCache()

    def lookup(args: tuple, kwargs: dict) -> tuple[Any, list]:
        split = split_arguments(args, kwargs)
        avals = tuple(_jaxpr.abstractify(x) for x in split.leaves)
        static_leaves, static_tree = jax.tree_util.tree_flatten(split.static)
        key = (split.tree, avals, static_tree, tuple(map(hashable_static, static_leaves)))
        return cache.get_or_make(key, lambda: make(split, avals)), split.leaves

    return lookup


def make_jaxpr_with_states(fun: Callable, static_argnums: int | Sequence[int] = (),
                           static_argnames: str | Sequence[str] = (), axis_env=None,
                           return_shape: bool = False, return_only_write: bool = False):
    """``jax.make_jaxpr`` for stateful functions: the pure program and its states.

    Unlike ``jax.make_jaxpr``, the function it returns gives a pair
    ``(jaxpr, states)``. ``tx.make_jaxpr`` is the same function (taxpr
    0.0.3's name).

    Arguments:
        fun: a function that may use ``get_state`` / ``set_state``.
        static_argnums, static_argnames, axis_env: as for ``jax.make_jaxpr``.
        return_shape: also return the output's ShapeDtypeStruct pytree.
        return_only_write: only written states are outputs.

    Returns:
        A function of ``fun``'s arguments returning ``(jaxpr, states)`` or
        ``(jaxpr, states, out_shape)``: ``jaxpr`` is the pure program
        ``(*state_inputs, *flat_args) -> (*flat_outs, *state_outputs)`` and
        ``states`` a tuple of ``StateInfo`` in the order of the state inputs.
    """

    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)

    def wrapped(*args, **kwargs):
        static_kw = {k: kwargs.pop(k) for k in names if k in kwargs}
        f = functools.partial(fun, **static_kw) if static_kw else fun
        with tracing_for_types(), recording_tags() as recorded:
            closed, out_shape = jax.make_jaxpr(
                f, static_argnums=static_argnums, axis_env=axis_env,
                return_shape=True)(*args, **kwargs)
            closed = expand_for(closed, is_state_tag)
        check_no_hidden_tags(closed, recorded, is_state_tag)
        states = collect_states(closed)
        infos = tuple(states.values())
        if not states:
            result = closed
        else:
            result = pure_jaxpr(closed, states)
            if return_only_write:
                result = keep_written_outputs(result, infos)
        return (result, infos, out_shape) if return_shape else (result, infos)

    return wrapped


make_jaxpr = make_jaxpr_with_states  # taxpr 0.0.3's name

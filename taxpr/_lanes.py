"""``uncurry_vmap``: a stateful function vmapped with states of its own per
lane, their initial values drawn per lane from a key.

brainstate's ``vmap_new_states`` and Flax NNX's ``nnx.vmap`` of a
constructor with ``split_rngs`` give every lane of a batch its own states,
initialized from its own key (an ensemble, a population of neurons whose
initial potentials differ). With taxpr the states of one lane are what
``uncurry`` returns for that lane's arguments; this module computes them for
every lane at once, the lane's key seeding the random stream that the
states' inits draw from, and vmaps the pure function over them.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax

from ._state import set_state, uncurry


class _Axes(NamedTuple):
    """The mapped axis of each positional argument and the batch size."""

    in_axes: tuple[int | None, ...]
    size: int


def _axes(args: Sequence[Any], in_axes: int | None | Sequence[int | None],
          axis_size: int | None) -> _Axes:
    """Each argument's mapped axis (``jax.vmap``'s ``in_axes``, one per
    positional argument or one for all) and the lane count (``axis_size``,
    else the size of the first mapped argument's axis)."""
    if isinstance(in_axes, (list, tuple)):
        if len(in_axes) != len(args):
            raise ValueError(f"taxpr.uncurry_vmap: in_axes has {len(in_axes)} entries for "
                             f"{len(args)} arguments")
        axes = tuple(in_axes)
    else:
        axes = (in_axes,) * len(args)
    if axis_size is not None:
        return _Axes(axes, int(axis_size))
    for arg, axis in zip(args, axes):
        leaves = jax.tree_util.tree_leaves(arg)
        if axis is not None and leaves:
            return _Axes(axes, int(jax.numpy.shape(leaves[0])[axis]))
    raise ValueError("taxpr.uncurry_vmap: no argument is mapped; give axis_size")


def _lane(args: Sequence[Any], axes: Sequence[int | None]) -> tuple:
    """The arguments of lane 0 (each mapped argument indexed on its axis)."""
    return tuple(a if ax is None else jax.tree_util.tree_map(lambda x: x.take(0, axis=ax), a)
                 for a, ax in zip(args, axes))


def uncurry_vmap(fn: Callable, key: jax.Array, *example_args: Any,
                 in_axes: int | None | Sequence[int | None] = 0, out_axes: Any = 0,
                 axis_size: int | None = None, stream: str = "rng"):
    """``uncurry`` of ``fn`` vmapped, with states of its own per lane.

    Lane ``i``'s states start where ``tx.uncurry(fn, *lane_i_args)`` would
    start them with the random stream ``stream`` seeded by the first key of
    ``jax.random.split(keys[i])`` (``keys = jax.random.split(key, n)``), so
    states whose init draws from ``tx.next_key()`` differ per lane, and so
    do states whose init is computed from the lane's arguments. Where
    ``fn`` draws keys itself, lane ``i``'s stream then continues from the
    second key of that split. The states of all lanes are computed in one
    vmapped trace, as ``uncurry`` inside a traced function computes them: a
    state first used inside a ``cond`` or ``while_loop`` needs an init that
    depends neither on the key nor on the arguments (else a ``StateError``
    says so).

    Arguments:
        fn: the stateful function of one lane (``get_state`` / ``set_state``
            / ``next_key``), positional arguments only.
        key: a typed key (``jax.random.key``) or a raw ``PRNGKey``, split
            into one key per lane.
        *example_args: the batched arguments the states are initialized
            with, mapped as ``in_axes`` says.
        in_axes: ``jax.vmap``'s ``in_axes`` of the positional arguments: one
            int or ``None`` for all, or one per argument.
        out_axes: ``jax.vmap``'s ``out_axes`` of ``fn``'s outputs.
        axis_size: the lane count, needed only when no argument is mapped.
        stream: the random stream seeded per lane (``tx.next_key``'s
            ``stream``); other streams start from the same key in every
            lane.

    Returns:
        ``(pure, states)``: ``states`` is the state dict of every lane, each
        array with a leading lane axis, and ``pure(states, *args) ->
        (out, new_states)`` is ``uncurry``'s pure function vmapped over the
        lanes (states on axis 0, arguments on ``in_axes``, outputs on
        ``out_axes``), an ordinary JAX function.
    """
    axes = _axes(example_args, in_axes, axis_size)
    if not jax.dtypes.issubdtype(jax.numpy.result_type(key), jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    pure_one, single = uncurry(fn, *_lane(example_args, axes.in_axes))

    def seeded(k, *args):
        set_state(stream, k)
        return fn(*args)

    def lane_states(k, *args):
        k_init, k_run = jax.random.split(k)
        states = dict(uncurry(seeded, k_init, *args)[1])
        if stream in single:
            states[stream] = k_run
        else:
            states.pop(stream, None)
        return states

    keys = jax.random.split(key, axes.size)
    states = jax.vmap(lane_states, in_axes=(0, *axes.in_axes), axis_size=axes.size)(
        keys, *example_args)
    pure = jax.vmap(pure_one, in_axes=(0, *axes.in_axes), out_axes=(out_axes, 0),
                    axis_size=axes.size)
    return pure, states

"""Random keys as an effect: ``next_key`` and ``seed``.

A stream is a state (``get_state`` / ``set_state``) holding a typed PRNG
key; ``next_key`` splits it, as eager Python with a key variable would
(``key, sub = split(key)``; return ``sub``), so everything the state layer
threads (raw ``scan`` / ``while_loop`` / ``cond``, ``jit``, ``checkpoint``,
custom derivative rules, ``shard_map``) threads the stream too.

One thing state cannot say is "each example of a vmap needs its own key":
the stream's state is unbatched, so every example would draw the same key.
``next_key`` therefore passes its key through ``key_p``, an identity whose
batching rule runs under every vmap (also when nothing is batched):

* vmap without an axis name: an error naming the stream;
* ``vmap(..., axis_name=name)``: example ``i`` gets ``fold_in(key, i)``
  (``i = axis_index(name)``);
* a key already batched (a vmap over a batch of states): unchanged;
* the vmap of ``jax.jacfwd`` / ``jax.jacrev``: unchanged (every element of
  that axis computes the same primal).

Inside a ``shard_map`` / ``pmap`` body ``key_p`` folds in the index of every
manual mesh axis when it is bound (the ``folded`` param records which, so a
jaxpr evaluated again in the same body does not fold twice).
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
from ._jax.internals import core
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir
from jax.sharding import get_abstract_mesh

from . import _compat
from ._inject import SplitArguments, trace_program
from .primitives._tag import evaluated_fun
from ._state import StateError, collect_states, is_state_tag, per_signature, stream_pure_jaxpr
from ._state._ops import read as read_state, write as write_state

DEFAULT_STREAM = "rng"


def manual_mesh_axes() -> tuple:
    """The mesh axes that are manual where code is being traced (inside a
    ``shard_map`` / ``pmap`` body), in the mesh's order; ``()`` elsewhere."""
    mesh = get_abstract_mesh()
    manual = frozenset(getattr(mesh, "manual_axes", ()) or ())
    if not manual:
        return ()
    return tuple(a for a in mesh.axis_names if a in manual)


class _KeyPrimitive(Primitive):
    """``key_p``: binding it inside a shard_map body folds in the manual axes."""

    def bind(self, key, *, stream: str, folded: tuple = ()):  # type: ignore[override]
        new_axes = tuple(a for a in manual_mesh_axes() if a not in folded)
        for axis in new_axes:
            key = _fold_in(key, jax.lax.axis_index(axis))
        return super().bind(key, stream=stream, folded=tuple(folded) + new_axes)


key_p = _KeyPrimitive("taxpr_key")
key_p.def_impl(lambda key, **_: key)
key_p.def_abstract_eval(lambda aval, **_: aval)
mlir.register_lowering(key_p, lambda ctx, key, **_: [key])


def _key_jvp(primals, tangents, **params):
    # Keys have no derivative (float0 tangents); only reached when JAX
    # instantiates the zero tangent.
    (key,), (tangent,) = primals, tangents
    return key_p.bind(key, **params), tangent


ad.primitive_jvps[key_p] = _key_jvp


def _fold_in(keys: jax.Array, index: Any) -> jax.Array:
    """``fold_in(k, index)`` for every key ``k`` of an array of keys."""
    if keys.ndim == 0:
        return jax.random.fold_in(keys, index)
    return jax.vmap(_fold_in, in_axes=(0, None))(keys, index)


def axis_has_name(axis_data: Any) -> bool:
    """Whether a vmap axis has a name (``vmap(..., axis_name=...)``)."""
    return axis_data.name is not core.no_axis_name


def is_jacfwd_axis(axis_data: Any) -> bool:
    """Whether the vmap axis ``axis_data`` is the one ``jax.jacfwd`` (and so
    ``jax.hessian``) maps over its tangent basis, or ``jax.jacrev`` over its
    cotangent basis (a checkpoint recomputes the primal there): the primal
    computation is the same for every element of that axis, so one key for
    all of them is right. Decided from the Python stack (the frame of JAX's
    batching that made the vmap's trace for this very ``axis_data``, called
    from ``jacfwd``'s / ``jacrev``'s inner function); when the stack does
    not show it, the answer is False (the caller then raises its error
    rather than share a key silently)."""
    frame = sys._getframe(1)
    seen_axis = False  # passed the frame that made the vmap's BatchTrace
    while frame is not None:
        if not seen_axis:
            seen_axis = (frame.f_code.co_name == "_batch_inner"
                         and frame.f_locals.get("axis_data") is axis_data)
        elif frame.f_code.co_name == "vmap_f":
            caller = frame.f_back
            while caller is not None and caller.f_globals.get("__name__") == \
                    "jax._src.traceback_util":  # vmap_f's api_boundary wrapper
                caller = caller.f_back
            return (caller is not None and caller.f_code.co_name == "jacfun"
                    and caller.f_globals.get("__name__") == "jax._src.api")
        frame = frame.f_back
    return False


def _key_batcher(axis_data, args, dims, *, stream: str, folded: tuple):
    (key,), (dim,) = args, dims
    if dim is not None:  # a batch of keys (e.g. a vmap over a batch of states)
        return key_p.bind(key, stream=stream, folded=folded), dim
    if not axis_has_name(axis_data):
        if is_jacfwd_axis(axis_data):
            return key_p.bind(key, stream=stream, folded=folded), None
        raise StateError(
            f"taxpr: next_key({stream!r}) runs under jax.vmap without an axis name, so every "
            f"example would draw the same key from stream {stream!r} (whose state is one "
            f"unbatched key). Give the vmap an axis name (jax.vmap(..., axis_name='batch')): "
            f"each example then gets fold_in(key, axis_index('batch')); or vmap uncurry's "
            f"pure function over a batch of keys (state[{stream!r}] of shape (n,))")
    index = jnp.arange(axis_data.size, dtype=jnp.uint32)
    batched = jax.vmap(_fold_in, in_axes=(None, 0))(key, index)
    # Bound again so that an enclosing vmap folds in its index too.
    return key_p.bind(batched, stream=stream, folded=folded), 0


_compat.register_axis_batcher(key_p, _key_batcher)


# ---- the init of a stream ----------------------------------------------------

# {stream: key impl}, set by seed while it traces.
_STREAM_IMPLS: contextvars.ContextVar[dict] = contextvars.ContextVar("taxpr_stream_impls",
                                                                      default={})
_default_keys: dict[Any, jax.Array] = {}


def _init_key(stream: str) -> jax.Array:
    """``jax.random.key(0)`` of the stream's impl (the one of the key ``seed``
    gives it, else JAX's default impl), made once per impl."""
    impl = _STREAM_IMPLS.get().get(stream)
    cache_key = impl if impl is not None else ("default", jax.config.jax_default_prng_impl)
    key = _default_keys.get(cache_key)
    if key is None:
        with jax.ensure_compile_time_eval():
            key = _default_keys[cache_key] = jax.random.key(0, impl=impl)
    return key


def next_key(stream: str = DEFAULT_STREAM) -> jax.Array:
    """A fresh typed PRNG key from stream ``stream``, different on every call.

    The stream is a state named ``stream`` holding a typed key (initially
    ``jax.random.key(0)``): each call does what eager Python with a key
    variable does, ``key, sub = jax.random.split(key)``, and returns ``sub``.
    ``tx.uncurry`` / ``tx.make_jaxpr`` list the stream among the states; put
    another key in the state dict (or use ``tx.seed``) to reseed.

    Under ``jax.vmap`` every example needs its own key: with
    ``vmap(..., axis_name=name)`` example ``i`` gets ``fold_in(sub, i)``;
    without an axis name it is an error. Inside ``shard_map`` each shard gets
    ``fold_in(sub, axis_index(axis))`` for every manual mesh axis. The
    stream's state stays unbatched and replicated in both cases.

    Arguments:
        stream: the name of the stream (a state name).

    Returns:
        A typed key (``jax.random.key``-style) of the stream's impl.

    Raises:
        StateError: under a vmap without an axis name (names the stream).
    """
    # A stream is one sequence of keys wherever it is drawn: never scoped.
    key = read_state(stream, _init_key(stream))  # a key array: no asarray cost
    key, sub = jax.random.split(key)
    write_state(stream, key, by="next_key")
    return key_p.bind(sub, stream=stream, folded=())


@contextlib.contextmanager
def _stream_impl(stream: str, impl: Any):
    token = _STREAM_IMPLS.set({**_STREAM_IMPLS.get(), stream: impl})
    try:
        yield
    finally:
        _STREAM_IMPLS.reset(token)


def _as_typed_key(key: Any, stream: str) -> jax.Array:
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        if key.shape != ():
            raise StateError(f"taxpr: seed for stream {stream!r} must be one key, got a key "
                             f"array of shape {key.shape}")
        return key
    if key.dtype == jnp.uint32 and key.shape == (2,):  # a raw jax.random.PRNGKey
        return jax.random.wrap_key_data(key)
    raise StateError(f"taxpr: seed for stream {stream!r} must be a typed key "
                     f"(jax.random.key) or a raw jax.random.PRNGKey, got "
                     f"{key.dtype}{list(key.shape)}")


def seed(fn: Callable, key: Any, stream: str = DEFAULT_STREAM) -> Callable:
    """``fn`` with stream ``stream`` seeded by ``key``: its ``next_key`` calls
    draw from ``key`` (as numpyro's ``seed`` handler, but through raw JAX
    control flow). Other states ``fn`` uses stay effects (an enclosing
    ``uncurry`` threads them).

    Arguments:
        fn: a function that calls ``next_key(stream)``. Array leaves of its
            arguments are traced, other leaves are static.
        key: a typed key (any impl) or a raw ``jax.random.PRNGKey``.
        stream: the stream to seed.

    Returns:
        A function with ``fn``'s signature returning ``fn``'s outputs only
        (the stream's final key is dropped); each call starts from ``key``.
    """
    key = _as_typed_key(key, stream)
    impl = jax.random.key_impl(key)

    def trace(split: SplitArguments, avals: tuple) -> tuple[Any, Any]:
        with _stream_impl(stream, impl):
            closed, out_tree = trace_program(
                fn, split.tree, avals, getattr(fn, "__name__", "fn"),
                rebuild=split.rebuild, consumes=is_state_tag)
        states = collect_states(closed)  # also checks the stream is used consistently
        if stream in states and states[stream].dtype != key.dtype:
            raise StateError(
                f"taxpr: seed: stream {stream!r} holds {states[stream].dtype} keys in "
                f"{getattr(fn, '__name__', 'fn')}, but the seed is a {key.dtype} (a "
                f"get_state({stream!r}, ...) of another impl?)")
        pure = stream_pure_jaxpr(closed, stream, jax.ShapeDtypeStruct((), key.dtype))
        return pure, out_tree

    traced = per_signature(trace)

    def seeded(*args, **kwargs):
        (pure, out_tree), leaves = traced(args, kwargs)
        outs = evaluated_fun(pure)(key, *leaves)
        return jax.tree_util.tree_unflatten(out_tree, outs[:out_tree.num_leaves])

    return seeded


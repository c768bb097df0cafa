"""Saving and restoring a state dict (``uncurry``'s ``state0`` or a
``pure`` function's new states) as one NumPy ``.npz`` file."""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np

# The entry of the file that records which arrays were typed PRNG keys (as
# their key data) and their implementation.
_KEYS_ENTRY = "__taxpr_typed_keys__"
# The entry recording the dtypes NumPy's file format does not know
# (bfloat16, the float8s, int4: ml_dtypes' extension types, which ``.npz``
# would write as raw ``V`` records): such an array is stored as unsigned
# integers of its width, bit for bit, and viewed back on load.
_DTYPES_ENTRY = "__taxpr_dtypes__"
_ENTRIES = (_KEYS_ENTRY, _DTYPES_ENTRY)


def _is_extension_dtype(dtype: np.dtype) -> bool:
    return not dtype.type.__module__.startswith("numpy")


def _is_typed_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def save_state(file: Any, state: Any) -> None:
    """Save ``state`` (a pytree of arrays: ``{name: value}``, values arrays
    or pytrees of them, typed PRNG keys included) to ``file`` (a path or a
    binary file object), as NumPy's ``np.savez`` writes it.

    Arguments:
        file: where to write (``.npz`` is appended to a path without it,
            as ``np.savez`` does).
        state: the states to save.

    Each array is stored under its key path (``"['stats'].mean"``), a typed
    key as its key data with its implementation recorded, so
    ``load_state`` gives back the same values bit for bit.
    """
    arrays: dict = {}
    keys: dict = {}
    dtypes: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        if _is_typed_key(leaf):
            keys[name] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        array = np.asarray(leaf)
        if _is_extension_dtype(array.dtype):
            dtypes[name] = array.dtype.name
            array = array.view(f"u{array.dtype.itemsize}")
        arrays[name] = array
    np.savez(file, **arrays, **{_KEYS_ENTRY: np.asarray(json.dumps(keys)),
                                _DTYPES_ENTRY: np.asarray(json.dumps(dtypes))})


def load_state(file: Any, like: Any) -> Any:
    """The state saved by ``save_state``, with the structure of ``like``.

    Arguments:
        file: a path or a binary file object.
        like: a state of the same structure (``uncurry``'s ``state0``): it
            gives the pytree structure, and each saved array must have its
            leaf's shape and dtype.

    Returns:
        The saved state, with ``like``'s structure.

    Raises:
        ValueError: the file lacks an array of ``like``, or one's shape or
            dtype differs (the message names its key path).
    """
    with np.load(file) as saved:
        keys = json.loads(str(saved[_KEYS_ENTRY])) if _KEYS_ENTRY in saved else {}
        dtypes = json.loads(str(saved[_DTYPES_ENTRY])) if _DTYPES_ENTRY in saved else {}
        with_paths, tree = jax.tree_util.tree_flatten_with_path(like)
        leaves = []
        for path, want in with_paths:
            name = jax.tree_util.keystr(path)
            if name not in saved:
                raise ValueError(f"taxpr.load_state: the file has no array {name} "
                                 f"(it has {sorted(k for k in saved.files if k not in _ENTRIES)})")
            value = saved[name]
            if name in dtypes:
                value = value.view(jax.numpy.dtype(dtypes[name]))
            if _is_typed_key(want):
                if name not in keys:
                    raise ValueError(f"taxpr.load_state: {name} is a typed key in the state "
                                     f"given, but the file holds plain data for it")
                value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(want))
            got = (tuple(value.shape), value.dtype)
            expected = (tuple(np.shape(want)), jax.numpy.result_type(want))
            if got != expected:
                raise ValueError(f"taxpr.load_state: {name} is {got[1]}{list(got[0])} in the "
                                 f"file and {expected[1]}{list(expected[0])} in the state given")
            leaves.append(jax.numpy.asarray(value) if not _is_typed_key(want) else value)
    return jax.tree_util.tree_unflatten(tree, leaves)

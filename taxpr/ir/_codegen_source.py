"""Python source text of plain values for the generated code: tuples of
sources, exact numbers and arrays of a dtype (``np.int32(3)``,
``np.float32(-0.0)``, arrays by their bytes), dtypes, pytrees of sources,
and the checks that a source gives back its value."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

__all__ = ["NoSource", "Src", "array_src", "default_dtype", "dtype_src", "eval_roundtrips",
           "float_src", "python_scalar_src", "same_value", "scalar_src", "tree_src", "tuple_src"]


def tuple_src(items: list[str]) -> str:
    """A tuple of the sources ``items``."""
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def eval_roundtrips(src: str, value: Any, namespace: dict) -> bool:
    """Whether evaluating ``src`` in ``namespace`` gives a value of
    ``value``'s type equal to it."""
    try:
        back = eval(src, namespace)  # noqa: S307 - our own generated expression
        same = back == value
        if isinstance(same, np.ndarray):
            same = bool(same.all())
        return bool(same) and type(back) is type(value)
    except Exception:
        return False


def same_value(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` have one type and are equal."""
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare to a bool
        return False


# ---- pytrees of sources ---------------------------------------------------------------------

class Src:
    """A leaf of a pytree that is this source text."""

    def __init__(self, src: str):
        self.src = src


class NoSource(Exception):
    """A pytree node that has no source form."""


def tree_src(x: Any) -> str:
    """The source of a pytree of tuples, lists, dicts and None whose
    leaves are ``Src`` (``NoSource`` for any other node)."""
    if isinstance(x, Src):
        return x.src
    if x is None:
        return "None"
    if type(x) is tuple:
        return tuple_src([tree_src(v) for v in x])
    if type(x) is list:
        return f"[{', '.join(tree_src(v) for v in x)}]"
    if type(x) is dict:
        return "{" + ", ".join(f"{k!r}: {tree_src(v)}" for k, v in x.items()) + "}"
    raise NoSource(type(x))


# ---- numbers, dtypes and arrays -------------------------------------------------------------

def default_dtype(dtype: np.dtype) -> np.dtype | None:
    """The dtype a Python scalar of this kind becomes (weakly typed)."""
    kind = {"b": bool, "i": int, "u": None, "f": float, "c": complex}.get(dtype.kind)
    if kind is None:
        return None
    return np.dtype(jax.numpy.result_type(kind))


def float_src(x: float) -> str:
    if math.isnan(x):
        return "float('nan')"
    if math.isinf(x):
        return "float('inf')" if x > 0 else "float('-inf')"
    return repr(x)


def python_scalar_src(a: np.ndarray) -> str:
    """``a``'s value as a Python scalar (a weakly typed value)."""
    v = a.item()
    if isinstance(v, float):
        return float_src(v)
    if isinstance(v, complex):
        return f"complex({float_src(v.real)}, {float_src(v.imag)})"
    return repr(v)


def dtype_src(dtype: np.dtype) -> str:
    name = np.dtype(dtype).name
    return f"np.{name}" if hasattr(np, name) and name != "bool" else (
        "np.bool_" if name == "bool" else f"jnp.{name}")


def scalar_src(a: np.ndarray) -> str:
    """An exact scalar of ``a``'s dtype: ``np.int32(3)``, ``np.float32(-0.0)``."""
    v = a.item() if a.dtype.kind in "biufc" else float(a)
    if a.dtype.kind == "f" or a.dtype.kind == "V" or a.dtype.name in ("bfloat16",) \
            or a.dtype.kind not in "biuc":
        inner = float_src(float(v))
        if math.isnan(v) and not _is_default_nan(a):
            return f"np.frombuffer(bytes.fromhex({a.tobytes().hex()!r}), " \
                   f"dtype={dtype_src(a.dtype)})[0]"
        return f"{dtype_src(a.dtype)}({inner})"
    if a.dtype.kind == "c":
        return f"{dtype_src(a.dtype)}(complex({float_src(v.real)}, {float_src(v.imag)}))"
    return f"{dtype_src(a.dtype)}({v!r})"


def _is_default_nan(a: np.ndarray) -> bool:
    return a.tobytes() == np.asarray(float("nan"), a.dtype).tobytes()


def array_src(a: np.ndarray) -> str:
    """An exact array: integers by their values, others by their bytes."""
    a = np.asarray(a)
    dt = dtype_src(a.dtype)
    if a.dtype.kind in "biu":
        return f"np.array({a.tolist()!r}, dtype={dt})"
    return (f"np.frombuffer(bytes.fromhex({a.tobytes().hex()!r}), dtype={dt})"
            f".reshape({tuple(a.shape)!r})")

"""Where the objects a jaxpr holds live, so that generated code names them
instead of reading them from ``OBJECTS``: the module attribute of a
primitive or a class (``location``), of a module-level object such as a
library's sentinel (``named_object``, ``named_instance``), the import path
of a function (``import_path``) and the ``jax.random`` name of a PRNG
implementation (``prng_impl_name``)."""

from __future__ import annotations

import sys
from typing import Any

import jax
from jax import lax

from .. import _traverse
from .._jax.internals import core

__all__ = ["import_path", "location", "named_instance", "named_object", "prng_impl_name"]

_PUBLIC_MODULES = (("lax", lax), ("jax", jax))
_locations = _traverse.IdMemo()  # primitive or class -> its dotted location
_scanned_modules: set[str] = set()


def _index_module(prefix: str, module: Any) -> None:
    for attr, value in list(vars(module).items()):
        if isinstance(value, (core.Primitive, type)) and _locations.get(value) is None:
            _locations.set(value, f"{prefix}.{attr}")


def location(obj: Any) -> str | None:
    """A dotted expression naming ``obj`` (a primitive or a class) from a
    module: ``jax.lax`` first, then any imported module defining it."""
    if not _locations:
        for prefix, module in _PUBLIC_MODULES:
            _index_module(prefix, module)
    hit = _locations.get(obj)
    if hit is not None:
        return hit
    for name, module in list(sys.modules.items()):
        if name in _scanned_modules or module is None or name == "__main__":
            continue
        _scanned_modules.add(name)
        try:
            _index_module(name, module)
        except Exception:  # a module whose attributes cannot be read
            continue
    return _locations.get(obj)


_named = _traverse.IdMemo()  # module-level object -> (module, attribute)
_named_scanned: set[str] = set()


def named_object(obj: Any) -> tuple[str, str] | None:
    """``(module, name)`` of a module-level object (a library's sentinel or
    marker object) that a fresh process finds again by importing the module:
    the same object, not an equal one. Values of builtin types (numbers,
    strings, containers) and modules are never looked up."""
    if type(obj).__module__ == "builtins" and type(obj) is not object \
            or isinstance(obj, type(sys)):
        return None
    for name, module in list(sys.modules.items()):
        if name in _named_scanned or module is None or name == "__main__":
            continue
        _named_scanned.add(name)
        try:
            items = list(vars(module).items())
        except Exception:  # noqa: BLE001 - a module whose attributes cannot be read
            continue
        for attr, value in items:
            if type(value).__module__ == "builtins" and type(value) is not object \
                    or isinstance(value, (type(sys), type, core.Primitive)) or callable(value):
                continue
            old = _named.get(value)
            # The most public name: fewest private parts.
            if old is None or _private_parts(name, attr) < _private_parts(*old):
                _named.set(value, (name, attr))
    return _named.get(obj)


def named_instance(cls: type) -> tuple[str, str] | None:
    """``(module, name)`` of the one module-level object of class ``cls``
    (a class made for a single marker object), or None."""
    named_object(object())  # (index the modules imported since)
    hits = [where for v, where in _named.items() if type(v) is cls]
    return hits[0] if len(hits) == 1 else None


def _private_parts(module: str, attr: str) -> int:
    return sum(part.startswith("_") for part in [*module.split("."), attr])


def import_path(fn: Any) -> tuple[str, str] | None:
    """``(module, qualname)`` by which a fresh process imports ``fn``
    itself, or None (a lambda, a closure, a function of ``__main__``)."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname \
            or module == "__main__" or module not in sys.modules:
        return None
    obj = sys.modules[module]
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return (module, qualname) if obj is fn else None


def prng_impl_name(impl: Any) -> str | None:
    """The name ``jax.random`` resolves to ``impl`` (``'threefry2x32'``)."""
    name = getattr(impl, "name", None)
    registry = getattr(sys.modules.get(type(impl).__module__), "prngs", {})
    return name if isinstance(name, str) and registry.get(name) is impl else None

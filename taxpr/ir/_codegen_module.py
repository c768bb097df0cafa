"""The parts of the module ``jaxpr_to_python_code`` generates (its imports,
constants, functions, late lines and ``OBJECTS`` entries) and the
expressions naming things in it: modules and their attributes, public
functions, importable callables, primitives and the unique names of
generated functions and constants (``ModuleWriter``)."""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np
from jax import lax

from .. import _traverse
from .._jax.internals import core
from ._codegen_locate import import_path, location
from ._codegen_names import IMPORT_LINES, identifier

__all__ = ["ModuleWriter"]

# Modules ``import jax`` (and ``from jax import lax``) makes attributes.
_IMPORTED_WITH_JAX = frozenset({"jax", "lax", "jnp", "jax.lax", "jax.random", "jax.debug",
                                "jax.tree_util", "jax.sharding"})
_MODULE_ALIASES = {"numpy": "np", "jax.numpy": "jnp", "jax.lax": "lax"}


class ModuleWriter:
    """The generated module's parts, filled while its functions are
    written, and ``namespace``: what the generated code sees (to check
    sources by evaluating them)."""

    def __init__(self):
        self.imports: list[str] = list(IMPORT_LINES)
        self.consts: list[str] = []
        self.functions: list[str] = []
        self.objects: dict = {}
        self.object_keys = _traverse.IdMemo()  # object -> its OBJECTS key
        self.object_notes: dict[str, str] = {}  # key -> what the object is
        self.late: list[str] = []  # module-level lines after the functions they call
        self.n_fn = 0
        self.fn_memo: dict = {}  # helper name -> its function's name
        self.namespace: dict = {"jax": jax, "np": np, "lax": lax, "jnp": jax.numpy}

    def import_module(self, dotted: str, add: bool = True) -> tuple[str, str | None]:
        """The expression naming ``dotted`` (``module.attr``) in the
        generated code and the import line it needs (added unless ``add`` is
        false). Modules outside jax and taxpr get an alias with an
        underscore (never a variable name)."""
        module, attr = dotted.rsplit(".", 1)
        top = module.split(".")[0]
        if module in _MODULE_ALIASES:  # numpy -> np, jax.numpy -> jnp
            return f"{_MODULE_ALIASES[module]}.{attr}", None
        if top in ("np", "lax", "jnp") or module in ("jax", "jax.lax"):
            return dotted, None
        if top in ("jax", "taxpr"):  # (so that a fresh process imports it too)
            line, ref = f"import {module}", dotted
            self.namespace.setdefault(top, sys.modules[top])
        else:
            alias = "_M_" + identifier(module)
            line, ref = f"import {module} as {alias}", f"{alias}.{attr}"
            self.namespace.setdefault(alias, sys.modules.get(module))
        if add:
            self.add_import(line)
        return ref, line

    def public(self, fn: str) -> str:
        """The expression naming the public function ``fn``
        (``jax.experimental.io_callback``), importing its module unless
        ``import jax`` provides it."""
        module = fn.rsplit(".", 1)[0]
        if module not in _IMPORTED_WITH_JAX:
            head, _, rest = module.partition(".")
            full = {"lax": "jax.lax", "jnp": "jax.numpy"}.get(head, head)
            self.add_import(f"import {full}{'.' + rest if rest else ''}")
        return fn

    def add_import(self, line: str | None) -> None:
        if line is not None and line not in self.imports:
            self.imports.append(line)

    def obj(self, value: Any, hint: str) -> str:
        """An ``OBJECTS`` entry holding ``value`` (one per object)."""
        hit = self.object_keys.get(value)
        if hit is not None:
            return f"OBJECTS[{hit!r}]"
        key = f"{identifier(hint)}_{len(self.objects)}"
        self.objects[key] = value
        self.object_keys.set(value, key)
        self.object_notes[key] = _describe(value)
        return f"OBJECTS[{key!r}]"

    def callable_src(self, fn: Any, hint: str) -> str:
        """``fn`` imported by its module path when it is importable
        (module-level, found again by ``module.qualname``), else an
        ``OBJECTS`` entry (a closure, a lambda: no source form)."""
        where = import_path(fn)
        if where is None:
            return self.obj(fn, hint)
        module, qualname = where
        return self.import_object(module, qualname)

    def import_object(self, module: str, qualname: str) -> str:
        """The expression naming ``module.qualname`` (importing the module)."""
        head, _, rest = qualname.partition(".")
        ref = self.import_module(f"{module}.{head}")[0]
        return f"{ref}.{rest}" if rest else ref

    def primitive(self, prim: core.Primitive) -> str:
        """The expression naming ``prim``: where a module defines it, else
        an ``OBJECTS`` entry."""
        where = location(prim)
        if where is None:
            return self.obj(prim, f"{prim.name}_p")
        return self.import_module(where)[0]

    def fn_name(self, hint: str) -> str:
        """``_<hint>_<n>``: lower case (aliases are ``_M_...``), and ``n`` is
        unique among functions and constants, so no two names clash."""
        self.n_fn += 1
        return f"_{identifier(hint).lower()}_{self.n_fn}"


def _describe(value: Any) -> str:
    """One line saying what an ``OBJECTS`` entry is."""
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if callable(value) and isinstance(name, str):
        return f"{type(value).__name__} {getattr(value, '__module__', '?')}.{name}"
    text = " ".join(repr(value).split())
    return f"{type(value).__module__}.{type(value).__qualname__}: " \
           f"{text[:60] + '...' if len(text) > 60 else text}"

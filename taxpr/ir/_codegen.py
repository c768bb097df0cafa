"""Python source code from a jaxpr.

``jaxpr_to_python_code`` writes a module that runs on its own (saved to a
file, in a fresh process): its imports, constants, one function per nested
jaxpr (a scan body, a while cond/body, a cond branch, a jitted or
checkpointed function) and the function ``fn_name`` itself. Running it
computes the jaxpr's outputs bit for bit, and it reads like JAX written by
hand:

* every equation becomes one statement. A primitive with a public JAX
  function is written as its call, the params as keywords (those equal to
  the function's defaults left out): ``lax.add(a, b)``,
  ``lax.broadcast_in_dim(a, shape=(4, 1), broadcast_dimensions=(0,))``,
  ``lax.scatter_add(...)``, ``lax.gather(...)``, ``lax.dot_general(...)``,
  ``lax.reduce_sum(a, axes=(0,))``, ``jax.debug.print('x {}', a)``,
  ``jax.pure_callback(...)``, ``jax.random.bits(...)``; each rule sits in
  ``_RULES``, keyed by the primitive, and checks that the installed JAX's
  function binds exactly the equation's params (its signature has the
  keywords; no explicit sharding, no value it would change), else the
  primitive is bound as it is, ``<primitive>.bind(*args, **params)``, named
  where JAX defines it;
* ``scan`` / ``while`` / ``cond`` / ``jit`` / ``checkpoint`` / ``shard_map``
  become ``lax.scan`` / ``lax.while_loop`` / ``lax.switch`` / ``jax.jit`` /
  ``jax.checkpoint`` / ``jax.shard_map`` of generated functions; a
  ``custom_jvp`` / ``custom_vjp`` call becomes a call of its primal
  function (its derivative rules have no source form); tags become
  ``taxpr.tag(...)``; a jaxpr in the params of a primitive bound as it is
  is rebuilt, ``jax.make_jaxpr`` of its generated function;
* a function the code calls back that a fresh process can import (found
  again at ``module.qualname``) is imported by its module path;
* literals keep their exact dtype and bits (``np.int32(3)``,
  ``np.float32(-0.0)``, ``float('nan')`` for a weakly typed float), so
  integer ``div`` / ``rem`` stay integer operations;
* variables are named ``a``, ``b``, ..., ``ba``, ... per function; names that
  are keywords, builtins or imported modules are skipped, and every other
  generated name starts with an underscore: functions and constants
  ``_<lower-case hint>_<unique number>``, module aliases ``_M_<module>``,
  so no name clashes at any size.

Only Python objects that have no source form (a lambda or closure passed to
a callback, a mesh, constants over ``max_inline_elements``) are read from a
module-level dict ``OBJECTS``; the code then lists them at its top and
raises a ``NameError`` naming those missing. ``PythonCode.objects`` holds
them and ``PythonCode.load()`` runs the code with them.
"""

from __future__ import annotations

import builtins
import dataclasses
import enum
import functools
import importlib
import inspect
import keyword
import math
import sys
from typing import Any, Callable

import jax
import numpy as np
from jax import lax
from jax._src import core
from jax.sharding import PartitionSpec

from .. import _compat, _jaxpr, _traverse
from ..primitives import _tag
from ._build import jit_inlining_loses_nothing

__all__ = ["PythonCode", "fn_to_python_code", "jaxpr_to_python_code"]

# Module aliases the generated code imports (never used as variable names).
_IMPORT_LINES = ("import jax", "import jax.numpy as jnp", "import numpy as np",
                 "from jax import lax")
_IMPORT_NAMES = frozenset({"jax", "jnp", "np", "lax", "taxpr", "OBJECTS"})
_RESERVED = (frozenset(keyword.kwlist) | frozenset(keyword.softkwlist)
             | frozenset(dir(builtins)) | _IMPORT_NAMES)
# Modules ``import jax`` (and ``from jax import lax``) makes attributes.
_IMPORTED_WITH_JAX = frozenset({"jax", "lax", "jnp", "jax.lax", "jax.random", "jax.debug",
                                "jax.tree_util", "jax.sharding"})
_MODULE_ALIASES = {"numpy": "np", "jax.numpy": "jnp", "jax.lax": "lax"}
DEFAULT_MAX_INLINE_ELEMENTS = 10_000
# Elementwise primitives whose ``lax`` function only binds the primitive
# (written ``lax.add(a, b)`` when all their params are None).
_LAX_FUNCTION = {"and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
                 "not": "bitwise_not"}
_READABLE = frozenset({
    "add", "sub", "mul", "div", "rem", "max", "min", "and", "or", "xor", "not", "neg",
    "eq", "ne", "lt", "le", "gt", "ge", "sign", "floor", "ceil", "abs", "select_n",
    "sin", "cos", "tan", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
    "sqrt", "rsqrt", "cbrt", "atan2", "pow", "nextafter", "is_finite", "asin", "acos",
    "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "square", "integer_pow",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count",
    "clz", "erf", "erfc", "erf_inv", "lgamma", "digamma", "clamp", "one_minus_square",
    "real", "imag", "complex", "igamma", "igammac", "igamma_grad_a", "polygamma", "zeta",
    "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta", "random_gamma_grad",
})


class PythonCode(str):
    """Generated source code (a ``str``) and the objects it reads from
    ``OBJECTS`` (empty when the code is self-contained)."""

    objects: dict
    fn_name: str

    def __new__(cls, source: str, objects: dict, fn_name: str):
        self = super().__new__(cls, source)
        self.objects = objects
        self.fn_name = fn_name
        return self

    def load(self) -> Callable:
        """Execute the code (with ``OBJECTS``) and return its function."""
        namespace: dict = {"OBJECTS": self.objects, "__name__": "taxpr_generated"}
        exec(compile(str(self), f"<taxpr.ir generated {self.fn_name}>", "exec"), namespace)
        return namespace[self.fn_name]


# ---- where primitives and classes live ----------------------------------------------------

_PUBLIC_MODULES = (("lax", lax), ("jax", jax))
_locations = _traverse.IdMemo()  # primitive or class -> its dotted location
_scanned_modules: set[str] = set()


def _index_module(prefix: str, module: Any) -> None:
    for attr, value in list(vars(module).items()):
        if isinstance(value, (core.Primitive, type)) and _locations.get(value) is None:
            _locations.set(value, f"{prefix}.{attr}")


def _location(obj: Any) -> str | None:
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


def _named_object(obj: Any) -> tuple[str, str] | None:
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


def _named_instance(cls: type) -> tuple[str, str] | None:
    """``(module, name)`` of the one module-level object of class ``cls``
    (a class made for a single marker object), or None."""
    _named_object(object())  # (index the modules imported since)
    hits = [where for v, where in _named.items() if type(v) is cls]
    return hits[0] if len(hits) == 1 else None


def _private_parts(module: str, attr: str) -> int:
    return sum(part.startswith("_") for part in [*module.split("."), attr])


def _eval_roundtrips(src: str, value: Any, namespace: dict) -> bool:
    try:
        back = eval(src, namespace)  # noqa: S307 - our own generated expression
        same = back == value
        if isinstance(same, np.ndarray):
            same = bool(same.all())
        return bool(same) and type(back) is type(value)
    except Exception:
        return False


def _import_path(fn: Any) -> tuple[str, str] | None:
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


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare to a bool
        return False


def _describe(value: Any) -> str:
    """One line saying what an ``OBJECTS`` entry is."""
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    if callable(value) and isinstance(name, str):
        return f"{type(value).__name__} {getattr(value, '__module__', '?')}.{name}"
    text = " ".join(repr(value).split())
    return f"{type(value).__module__}.{type(value).__qualname__}: " \
           f"{text[:60] + '...' if len(text) > 60 else text}"


# ---- the generator --------------------------------------------------------------------

class _Names:
    """Variable names of one function: a, b, ..., z, ba, bb, ... (the
    pretty-printer's scheme) minus reserved words."""

    def __init__(self):
        self.n = 0

    def fresh(self) -> str:
        while True:
            i, s = self.n, ""
            self.n += 1
            while True:
                s = chr(ord("a") + i % 26) + s
                i //= 26
                if i == 0:
                    break
            if s not in _RESERVED:
                return s


class _Gen:
    def __init__(self, max_inline_elements: int):
        self.max_inline = max_inline_elements
        self.imports: list[str] = list(_IMPORT_LINES)
        self.consts: list[str] = []
        self.functions: list[str] = []
        self.objects: dict = {}
        self.object_keys = _traverse.IdMemo()  # object -> its OBJECTS key
        self.object_notes: dict[str, str] = {}  # key -> what the object is
        self.late: list[str] = []  # module-level lines after the functions they call
        self.n_fn = 0
        self.fn_memo: dict = {}  # helper name -> its function's name
        self.jaxpr_fns = _traverse.IdMemo()  # jaxpr (and how it returns) -> function name
        self.namespace: dict = {"jax": jax, "np": np, "lax": lax, "jnp": jax.numpy}
        self.repr_memo: dict = {}

    # -- module-level things --
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
            alias = "_M_" + _identifier(module)
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
        key = f"{_identifier(hint)}_{len(self.objects)}"
        self.objects[key] = value
        self.object_keys.set(value, key)
        self.object_notes[key] = _describe(value)
        return f"OBJECTS[{key!r}]"

    def callable_src(self, fn: Any, hint: str) -> str:
        """``fn`` imported by its module path when it is importable
        (module-level, found again by ``module.qualname``), else an
        ``OBJECTS`` entry (a closure, a lambda: no source form)."""
        where = _import_path(fn)
        if where is None:
            return self.obj(fn, hint)
        module, qualname = where
        return self.import_object(module, qualname)

    def import_object(self, module: str, qualname: str) -> str:
        """The expression naming ``module.qualname`` (importing the module)."""
        head, _, rest = qualname.partition(".")
        ref = self.import_module(f"{module}.{head}")[0]
        return f"{ref}.{rest}" if rest else ref

    def fn_name(self, hint: str) -> str:
        """``_<hint>_<n>``: lower case (aliases are ``_M_...``), and ``n`` is
        unique among functions and constants, so no two names clash."""
        self.n_fn += 1
        return f"_{_identifier(hint).lower()}_{self.n_fn}"

    def batched_while_loop(self) -> str:
        """The name of the module's helper running a ``while`` whose
        predicate vmap batched (written once, when first needed)."""
        hit = self.fn_memo.get("batched_while_loop")
        if hit is None:
            hit = self.fn_memo["batched_while_loop"] = self.fn_name("batched_while_loop")
            self.functions.append(_BATCHED_WHILE_LOOP.format(name=hit))
        return hit

    # -- values --
    def array(self, value: Any, dtype: Any, hint: str = "const") -> str:
        """A module-level constant holding ``value`` exactly."""
        name = self.fn_name(hint)
        impl = _prng_impl_name(getattr(getattr(value, "dtype", None), "_impl", None))
        if impl is not None:  # typed PRNG keys: their data, wrapped
            data = np.asarray(jax.random.key_data(value))
            if data.size <= self.max_inline:
                self.consts.append(f"{name} = jax.random.wrap_key_data({_array_src(data)}, "
                                   f"impl={impl!r})")
                return name
        if isinstance(value, core.Tracer) and isinstance(getattr(value, "dtype", None), np.dtype):
            # A tracer of a finished trace, kept in a jaxpr held by a param
            # (equinox's closure-converted functions keep the jaxpr; their
            # consts are passed as operands): it has no value, and reading it
            # raises, so the program never reads it. Zeros of its type.
            self.consts.append(f"{name} = np.zeros({tuple(value.shape)!r}, "
                               f"dtype={_dtype_src(np.dtype(value.dtype))})")
            return name
        try:
            a = np.asarray(value, dtype=dtype)
        except (TypeError, ValueError):  # e.g. PRNG keys (an extended dtype)
            a = None
        if a is None or a.size > self.max_inline:
            self.consts.append(f"{name} = {self.obj(value, hint)}")
            return name
        self.consts.append(f"{name} = {_array_src(a)}")
        return name

    def literal(self, lit: core.Literal) -> str:
        aval = lit.aval
        dtype = np.dtype(aval.dtype)
        a = np.asarray(lit.val, dtype=dtype)
        if a.shape != ():
            return _array_src(a) if a.size <= 64 else self.array(a, dtype)
        weak = bool(getattr(aval, "weak_type", False))
        if weak and dtype == _default_dtype(dtype):
            return _python_scalar(a)
        src = _scalar_src(a)
        if weak:  # a weakly typed value of a non-default dtype
            return f"jax._src.lax.lax._convert_element_type({src}, weak_type=True)"
        return src

    def param(self, value: Any, hint: str) -> str:
        """Source of a param value, or an ``OBJECTS`` entry when it has none."""
        if value is None or isinstance(value, (bool, str)):
            return repr(value)
        if isinstance(value, int) and type(value) is int:
            return repr(value)
        if type(value) is float:
            return _float_src(value)
        if type(value) in (tuple, list):
            items = [self.param(v, hint) for v in value]
            if type(value) is tuple:
                return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
            return f"[{', '.join(items)}]"
        if isinstance(value, np.dtype):
            return f"np.dtype({str(value)!r})"
        if type(value) in (frozenset, set):
            items = sorted((self.param(v, hint) for v in value))
            inner = "{" + ", ".join(items) + "}" if items else ""
            return f"{type(value).__name__}({inner})"
        if type(value) in (jax.sharding.Mesh, jax.sharding.AbstractMesh):
            src = self.mesh_src(value)
            return src if src is not None else self.obj(value, hint)
        if type(value) is PartitionSpec:
            src = f"jax.sharding.PartitionSpec({', '.join(self.param(v, hint) for v in value)})"
            return src if _eval_roundtrips(src, value, self.namespace) else self.obj(value, hint)
        if isinstance(value, np.ndarray) or isinstance(value, np.generic):
            return _array_src(value) if np.ndim(value) else _scalar_src(np.asarray(value))
        if _jaxpr.is_jaxpr(value):
            return self.jaxpr_src(value, hint)
        if isinstance(value, jax.tree_util.PyTreeDef):
            src = self.treedef_src(value)
            if src is not None:
                return src
            return self.obj(value, hint)
        if callable(value) and not isinstance(value, type):
            return self.callable_src(value, hint)
        if isinstance(value, type):
            if getattr(builtins, value.__name__, None) is value:
                return value.__name__
            where = _location(value)
            if where is not None:
                return self.import_module(where)[0]
            where = _named_instance(value)  # a class made for one module-level object
            return f"type({self.import_object(*where)})" if where is not None \
                else self.obj(value, hint)
        if type(value) is jax.ShapeDtypeStruct:
            src = self.spec_src(value)
            return src if src is not None and _eval_roundtrips(src, value, self.namespace) \
                else self.obj(value, hint)
        key = (type(value), repr(value))
        try:
            hit = self.repr_memo.get(key)
        except TypeError:
            hit = None
        if hit is not None:
            return hit
        lines: list = []
        before = dict(self.objects)
        src = self._structured(value, hint, lines)
        if src is not None and self.jaxprs_inside(value):
            # Rebuilt jaxprs are new objects (equal in what they compute):
            # the fields are checked one by one instead of the whole.
            for line in lines:
                self.add_import(line)
            return src
        if src is None or "OBJECTS[" in src or not _eval_roundtrips(src, value, self.namespace):
            # Whole, rather than in parts (drop the parts' entries).
            for k in set(self.objects) - set(before):
                self.object_keys.pop(self.objects.pop(k))
            where = _named_object(value)
            if where is not None:  # a module-level object (a sentinel, a tag)
                return self.import_object(*where)
            return self.obj(value, hint)
        for line in lines:
            self.add_import(line)
        try:
            self.repr_memo[key] = src
        except TypeError:
            pass
        return src

    def mesh_src(self, mesh: Any) -> str | None:
        """``jax.sharding.Mesh(<its devices, by id>, <names>, ...)`` or
        ``jax.sharding.AbstractMesh(<sizes>, <names>, ...)``, or None when
        no such source gives back an equal mesh."""
        cls = type(mesh)
        names = self.param(tuple(mesh.axis_names), "mesh")
        if cls is jax.sharding.Mesh:
            devices = np.asarray(mesh.devices)
            platforms = {d.platform for d in devices.flat}
            if len(platforms) != 1:
                return None
            ids = tuple(int(d.id) for d in devices.flat)
            head = (f"jax.sharding.Mesh({self.mesh_devices()}({ids!r}, {devices.shape!r}, "
                    f"{platforms.pop()!r}), {names}")
        else:
            head = f"jax.sharding.AbstractMesh({tuple(mesh.axis_sizes)!r}, {names}"
        try:
            accepted = inspect.signature(cls).parameters
        except (TypeError, ValueError):
            return None
        # Keywords only where this JAX takes them and the value differs from
        # what the constructor gives without them (its defaults differ by
        # version): the fewest that give back an equal mesh.
        opts: dict[str, str] = {}
        for field in ("axis_types", "abstract_device"):
            value = getattr(mesh, field, None)
            if field in accepted and value is not None:
                value_src = (self.axis_types_src(value) if field == "axis_types"
                             else self.param(value, "mesh"))
                if "OBJECTS[" not in value_src:
                    opts[field] = value_src
        for chosen in ((), ("axis_types",), ("abstract_device",),
                       ("axis_types", "abstract_device")):
            if set(chosen) <= set(opts):
                src = f"{head}{''.join(f', {k}={opts[k]}' for k in chosen)})"
                if _eval_roundtrips(src, mesh, self.namespace):
                    return src
        return None

    def axis_types_src(self, types: Any) -> str:
        """``(jax.sharding.AxisType.<name>, ...)``: by its public name."""
        public = getattr(jax.sharding, "AxisType", None)
        if public is not None and all(type(t) is public for t in types):
            items = [f"jax.sharding.AxisType.{t.name}" for t in types]
            return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
        return self.param(tuple(types), "mesh")

    def mesh_devices(self) -> str:
        """The name of the module's helper finding a mesh's devices by id
        (written once, when first needed)."""
        hit = self.fn_memo.get("mesh_devices")
        if hit is None:
            hit = self.fn_memo["mesh_devices"] = self.fn_name("mesh_devices")
            src = _MESH_DEVICES.format(name=hit)
            self.functions.append(src)
            exec(src, self.namespace)  # noqa: S102 - for checking mesh sources here
        return hit

    def _structured(self, value: Any, hint: str, lines: list) -> str | None:
        cls = type(value)
        where = _location(cls)
        if where is None:
            return None
        where, line = self.import_module(where, add=False)
        lines.append(line)
        if isinstance(value, enum.Enum):
            return f"{where}.{value.name}"
        if hasattr(value, "_fields"):  # a NamedTuple (GatherDimensionNumbers, ...)
            defaults = getattr(cls, "_field_defaults", {})
            args = ", ".join(f"{f}={self.param(getattr(value, f), hint)}" for f in value._fields
                             if not (f in defaults and _same(defaults[f], getattr(value, f))))
            return f"{where}({args})"
        if dataclasses.is_dataclass(value):
            args = ", ".join(f"{f.name}={self.param(getattr(value, f.name), hint)}"
                             for f in dataclasses.fields(value) if f.init)
            return f"{where}({args})"
        return None

    @staticmethod
    def jaxprs_inside(value: Any) -> bool:
        return hasattr(value, "_fields") and any(_jaxpr.is_jaxpr(v) for v in value)

    def treedef_src(self, tree: Any) -> str | None:
        """``jax.tree_util.tree_structure(<an example>)`` for a structure of
        tuples, lists, dicts and None; else, where JAX rebuilds a structure
        from its nodes (``PyTreeDef.from_node_data_and_children``), the
        structure node by node (custom nodes: their class and auxiliary data,
        when those have a source form); or None."""
        try:
            src = _tree_src(jax.tree_util.tree_unflatten(tree, [_Src("0")] * tree.num_leaves))
            src = f"jax.tree_util.tree_structure({src})"
        except (_NoSource, TypeError, ValueError):
            src = self.treedef_nodes_src(tree)
        return src if src is not None and _eval_roundtrips(src, tree, self.namespace) else None

    def treedef_nodes_src(self, tree: Any) -> str | None:
        if not hasattr(jax.tree_util.PyTreeDef, "from_node_data_and_children") \
                or not hasattr(jax.tree_util, "default_registry"):
            return None
        data = tree.node_data()
        if data is None:  # a leaf
            return "jax.tree_util.tree_structure(0)"
        cls, aux = data
        cls_src = self.param(cls, "treedef")
        aux_src = self.param(aux, "treedef")
        children = [self.treedef_nodes_src(c) for c in tree.children()]
        if "OBJECTS[" in cls_src + aux_src or None in children:
            return None
        return (f"jax.tree_util.PyTreeDef.from_node_data_and_children("
                f"jax.tree_util.default_registry, ({cls_src}, {aux_src}), "
                f"[{', '.join(children)}])")

    def jaxpr_src(self, j: Any, hint: str) -> str:
        """A module-level jaxpr rebuilt from the function computing ``j``:
        ``jax.make_jaxpr(fn)(<its input types>)`` (an ``OBJECTS`` entry when
        an input type has no source form)."""
        hit = self.jaxpr_fns.get(j, "jaxpr")
        if hit is not None:
            return hit
        parts = _jaxpr.jaxpr_parts(j)
        open_ = not _jaxpr.is_closed(j) and not _compat.MERGED_JAXPR
        n_consts = len(parts.constvars) if open_ else 0
        specs = [self.spec_src(v.aval)
                 for v in [*(parts.constvars if open_ else ()), *parts.invars]]
        if None in specs:
            return self.obj(j, hint)
        fn = self.function(j, hint, "tuple")  # (an open jaxpr's constvars lead)
        name = self.fn_name(hint)
        made = f"jax.make_jaxpr({fn})({', '.join(specs)})" + (".jaxpr" if open_ else "")
        if n_consts:  # an open jaxpr with constvars (JAX with unmerged jaxprs)
            convert = self.import_object("jax._src.interpreters.partial_eval",
                                         "convert_invars_to_constvars")
            made = f"{convert}({made}, {n_consts})"
        self.late.append(f"{name} = {made}")
        self.jaxpr_fns.set(j, name, "jaxpr")
        return name

    def spec_src(self, aval: Any) -> str | None:
        """``jax.ShapeDtypeStruct(...)`` of an array type, or None."""
        dtype = getattr(aval, "dtype", None)
        if dtype is None or not isinstance(dtype, np.dtype) or not hasattr(aval, "shape"):
            return None
        weak = ", weak_type=True" if getattr(aval, "weak_type", False) else ""
        return f"jax.ShapeDtypeStruct({tuple(aval.shape)!r}, {_dtype_src(dtype)}{weak})"

    def primitive(self, prim: core.Primitive) -> str:
        where = _location(prim)
        if where is None:
            return self.obj(prim, f"{prim.name}_p")
        return self.import_module(where)[0]

    # -- functions --
    def function(self, j: Any, hint: str, returns: str, n_carry: int = 0,
                 py_name: str | None = None) -> str:
        """The name of a module-level function computing jaxpr ``j``
        (inputs: its invars; closed-over consts are module constants).
        ``returns``: "tuple", "value" (one output), "top" (one output as
        itself, else a tuple) or "scan" ((carry, ys))."""
        hit = self.jaxpr_fns.get(j, returns, n_carry)
        if hit is not None:
            return hit
        name = self.fn_name(hint)
        self.jaxpr_fns.set(j, name, returns, n_carry)
        src = self._function_src(j, name, returns, n_carry)
        if py_name is not None and py_name != name:  # the name jax.jit records
            src += f"\n\n\n{name}.__name__ = {py_name!r}"
        self.functions.append(src)
        return name

    def _function_src(self, j: Any, name: str, returns: str, n_carry: int) -> str:
        constvars, consts, invars, eqns, outvars, _, _ = _jaxpr.jaxpr_parts(j)
        names = _Names()
        env: dict = {}
        args = []
        if consts is None or len(consts) != len(constvars):
            # An open jaxpr's constvars (no values) are leading inputs.
            invars = [*constvars, *invars]
        else:
            for v, c in zip(constvars, consts):
                env[v] = self.array(c, v.aval.dtype) if hasattr(v.aval, "dtype") \
                    else self.obj(c, "const")
        for v in invars:
            env[v] = names.fresh()
            args.append(env[v])
        lines = [f"def {name}({', '.join(args)}):"]
        body: list[str] = []
        for eqn in eqns:
            body.extend(self.eqn(eqn, env, names))
        outs = [self.atom(env, v) for v in outvars]
        if returns == "value":
            body.append(f"return {outs[0]}")
        elif returns == "top" and len(outs) == 1:
            body.append(f"return {outs[0]}")
        elif returns == "scan":
            body.append(f"return {_tuple(outs[:n_carry])}, {_tuple(outs[n_carry:])}")
        else:
            body.append(f"return {_tuple(outs)}")
        lines.extend("    " + b for b in body)
        return "\n".join(lines)

    def atom(self, env: dict, a: Any) -> str:
        if isinstance(a, core.Literal):
            return self.literal(a)
        return env[a]

    def eqn(self, eqn: core.JaxprEqn, env: dict, names: _Names) -> list[str]:
        args = [self.atom(env, a) for a in eqn.invars]
        outs = []
        for v in eqn.outvars:
            if isinstance(v, core.DropVar):
                outs.append("_")
            else:
                env[v] = names.fresh()
                outs.append(env[v])
        prim = eqn.primitive
        rule = _RULES.get(prim)
        src = None if rule is None else rule(self, eqn, args)
        if isinstance(src, _Single):  # the expression of the one output
            return [_assign(outs, src.src, False)]
        if isinstance(src, tuple):  # (expression, number of outputs in a first group)
            src, n_first = src
            return [f"{_tuple(outs[:n_first])}, {_tuple(outs[n_first:])} = {src}"]
        if src is None:
            src = self.bind(eqn, args)
        return [_assign(outs, src, prim.multiple_results)]

    def bind(self, eqn: core.JaxprEqn, args: list[str]) -> str:
        kw = []
        for k, v in eqn.params.items():
            if k == "flatten" and _is_filter_flatten(v):
                # equinox's filter primitives record their output's
                # structure in a Flatten object at each bind: a new one.
                src = f"{self.param(type(v), 'flatten')}()"
            else:
                src = self.param(v, f"{eqn.primitive.name}_{k}")
            kw.append(f"{k}={src}" if k.isidentifier() and not keyword.iskeyword(k)
                      else f"**{{{k!r}: {src}}}")
        return f"{self.primitive(eqn.primitive)}.bind({', '.join(args + kw)})"


def _is_filter_flatten(value: Any) -> bool:
    """Whether ``value`` is the ``Flatten`` of an equinox filter primitive
    (``equinox.internal.filter_primitive_bind``): the param in which the
    primitive's rules record the structure of its outputs."""
    cls = type(value)
    return cls.__qualname__ == "Flatten" and cls.__module__.startswith("equinox.") \
        and _location(cls) is not None


# ---- rules for higher-order primitives and tags ---------------------------------------------
# Each returns the expression whose value is the tuple of the equation's
# outputs, or None to bind the primitive generically.

def _scan_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    n_consts, n_carry = _jaxpr.scan_counts(p)
    body = g.function(p["jaxpr"], "scan_body", "scan", n_carry)
    consts, carry, xs = args[:n_consts], args[n_consts:n_consts + n_carry], \
        args[n_consts + n_carry:]
    call = f"lambda carry, xs: {body}({', '.join([*consts, '*carry', '*xs'])})"
    opts = f"length={p['length']!r}, reverse={p['reverse']!r}, unroll={p['unroll']!r}"
    if p.get("_split_transpose"):
        opts += ", _split_transpose=True"
    return f"lax.scan({call}, {_tuple(carry)}, {_tuple(xs)}, {opts})", n_carry


def _while_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond = g.function(p["cond_jaxpr"], "while_cond", "value")
    body = g.function(p["body_jaxpr"], "while_body", "tuple")
    cc, bc, init = args[:nc], args[nc:nc + nb], args[nc + nb:]
    if _jaxpr.jaxpr_parts(p["cond_jaxpr"]).outvars[0].aval.shape:
        # vmap batched the predicate: ``while_p`` loops while any example's
        # holds and selects the carry per example (``lax.while_loop`` takes
        # only a scalar predicate), as JAX lowers it.
        return (f"{g.batched_while_loop()}({cond}, {body}, {_tuple(cc)}, {_tuple(bc)}, "
                f"{_tuple(init)})")
    return (f"lax.while_loop(lambda carry: {cond}({', '.join([*cc, '*carry'])}), "
            f"lambda carry: {body}({', '.join([*bc, '*carry'])}), {_tuple(init)})")


_BATCHED_WHILE_LOOP = '''def {name}(cond, body, cond_consts, body_consts, init):
    """lax.while_loop for a predicate vmap batched: loop while any example's
    predicate holds; an example whose predicate is false keeps its carry."""
    def step(carry):
        pred = cond(*cond_consts, *carry)
        new = body(*body_consts, *carry)
        return tuple(lax.select(lax.broadcast_in_dim(pred, n.shape, tuple(range(pred.ndim))),
                                n, c) for n, c in zip(new, carry))
    return lax.while_loop(lambda carry: jnp.any(cond(*cond_consts, *carry)), step, init)'''


_MESH_DEVICES = '''def {name}(ids, shape, platform):
    """A mesh's devices: those of ``ids`` among this process's ``platform``
    devices, in ``shape``."""
    by_id = {{d.id: d for d in jax.devices(platform)}}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise RuntimeError(
            f"this code's mesh needs {{platform}} devices with ids {{missing}}, which this "
            f"process lacks (it has ids {{sorted(by_id)}}; for CPU devices, set XLA_FLAGS="
            f"--xla_force_host_platform_device_count=<n> before JAX starts)")
    return np.array([by_id[i] for i in ids], dtype=object).reshape(shape)'''


def _cond_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    branches = [g.function(b, "branch", "tuple") for b in eqn.params["branches"]]
    return f"lax.switch({', '.join([args[0], _tuple(branches), *args[1:]])})"


def _jit_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    if not jit_inlining_loses_nothing(p):
        return None  # shardings, donation, ...: bind with the params as they are
    fn = g.function(p["jaxpr"], str(p.get("name", "jit")), "tuple",
                    py_name=str(p.get("name", "jit")))
    opts = [f"keep_unused={bool(p.get('keep_unused', False))!r}"]
    if p.get("inline") is True:  # (0.12's Inline enum defaults: left to jax.jit)
        opts.append("inline=True")
    return f"jax.jit({fn}, {', '.join(opts)})({', '.join(args)})"


def _remat_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    fn = g.function(p["jaxpr"], "checkpointed", "tuple")
    policy = g.param(p.get("policy"), "policy")
    return (f"jax.checkpoint({fn}, prevent_cse={bool(p.get('prevent_cse', True))!r}, "
            f"policy={policy})({', '.join(args)})")


def _shard_map_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    known = {"mesh", "in_specs", "out_specs", "jaxpr", "check_vma", "check_rep",
             "newly_manual_axes", "manual_axes"}
    if not set(p) <= known:
        return None
    fn = g.function(p["jaxpr"], "shard_map_body", "tuple")
    axes = p.get("newly_manual_axes", p.get("manual_axes"))
    opts = [f"mesh={g.param(p['mesh'], 'mesh')}",
            f"in_specs={g.param(tuple(p['in_specs']), 'in_specs')}",
            f"out_specs={g.param(tuple(p['out_specs']), 'out_specs')}",
            f"check_vma={_jaxpr.shard_map_checks_vma(p)!r}"]
    if axes is not None:
        opts.append(f"axis_names={g.param(frozenset(axes), 'axis_names')}")
    return f"jax.shard_map({fn}, {', '.join(opts)})({', '.join(args)})"


def _call_rule(hint: str) -> Callable:
    def rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        subs = _traverse.subjaxprs(eqn)
        if len(subs) != 1:
            return None
        fn = g.function(subs[0][1], hint, "tuple")
        return f"{fn}({', '.join(args)})"
    return rule


def _tag_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = _tag.user_params(eqn.params)
    tree = _tag.meta(eqn.params).tree
    if tree is None or _tag.meta(eqn.params) != _tag.TagMeta(tree=tree):
        return None  # kept / batched / guarded / scoped tags: bind as they are
    try:
        value = _tree_src(jax.tree_util.tree_unflatten(tree, [_Src(a) for a in args]))
    except _NoSource:
        return None
    if not all(k.isidentifier() and not keyword.iskeyword(k) for k in p):
        return None
    kw = ", ".join(f"{k}={g.param(v, 'tag_' + k)}" for k, v in p.items())
    g.import_module("taxpr.tag")  # import taxpr
    call = f"taxpr.tag({value}{', ' + kw if kw else ''})"
    if tree.num_leaves == 1 and tree.num_nodes == 1:  # a single array
        return _Single(call)
    return f"jax.tree_util.tree_leaves({call})"


# ---- public JAX functions -------------------------------------------------------------------
# A rule writes the call of the public function that binds the primitive with
# exactly the equation's params (the same computation, bit for bit), each
# param as the function's keyword. It returns None, and the primitive is
# bound as it is, when the installed JAX's function has no keyword for a
# param, or a param holds a value the function would not bind (an explicit
# sharding, a negative literal index it would wrap, ...).

# Params the public functions bind as None by default (explicit sharding).
_DEFAULT_NONE = frozenset({"sharding", "out_sharding"})


def _resolve(dotted: str) -> Any:
    """The object named ``dotted`` (``jax.experimental.io_callback``),
    importing modules on the way; None when it does not exist."""
    parts = dotted.split(".")
    if parts[0] in ("lax", "jnp", "np"):  # the generated code's aliases
        parts[:1] = {"lax": ["jax", "lax"], "jnp": ["jax", "numpy"], "np": ["numpy"]}[parts[0]]
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if not hasattr(obj, part):
            try:
                importlib.import_module(".".join(parts[:i + 1]))
            except ImportError:
                return None
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@functools.cache
def _signature(fn: str) -> dict:
    """``{keyword: default}`` of what ``fn``'s signature accepts as keywords
    (``inspect.Parameter.empty`` for no default; empty when ``fn`` does not
    exist in the installed JAX)."""
    try:
        sig = inspect.signature(_resolve(fn))
    except (TypeError, ValueError):
        return {}
    return {n: prm.default for n, prm in sig.parameters.items()
            if prm.kind in (prm.POSITIONAL_OR_KEYWORD, prm.KEYWORD_ONLY)}


def _keywords(fn: str) -> frozenset:
    return frozenset(_signature(fn))


def _is_default(fn: str, name: str, value: Any) -> bool:
    """Whether passing ``value`` is passing ``fn``'s default (left out)."""
    default = _signature(fn).get(name, inspect.Parameter.empty)
    if default is inspect.Parameter.empty or type(default) is not type(value):
        return False
    try:
        return bool(default == value)
    except Exception:  # noqa: BLE001 - an array-like default
        return False


def _keyword_args(g: _Gen, eqn: core.JaxprEqn, fn: str, params: tuple[str, ...],
                  rename: dict | None = None, fixed: dict | None = None) -> list[str] | None:
    """``keyword=value`` sources of ``params`` (those the equation has) for
    ``fn``, or None when ``fn`` cannot bind the equation's params: a param
    outside ``params`` that is not None (``_DEFAULT_NONE``) or not its
    ``fixed`` value, or a keyword ``fn`` lacks."""
    p, rename, fixed = eqn.params, rename or {}, fixed or {}
    for k, v in p.items():
        if k in params:
            continue
        if k in fixed:
            if not (v is fixed[k] or type(v) is type(fixed[k]) and v == fixed[k]):
                return None
        elif not (k in _DEFAULT_NONE and v is None):
            return None
    accepted = _keywords(fn)
    out = []
    for k in params:
        if k not in p:
            continue
        name = rename.get(k, k)
        if name not in accepted:
            return None
        if _is_default(fn, name, p[k]):
            continue
        value = _dtype_src(p[k]) if isinstance(p[k], np.dtype) else \
            g.param(p[k], f"{eqn.primitive.name}_{k}")
        out.append(f"{name}={value}")
    return out


def _public(fn: str, *params: str, seq: bool = False, rename: dict | None = None,
            fixed: dict | None = None) -> Callable:
    """Rule: ``fn(*operands, param=value, ...)``; with ``seq`` the operands
    are passed as one tuple (``lax.concatenate``, ``lax.optimization_barrier``)."""
    def rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        kw = _keyword_args(g, eqn, fn, params, rename, fixed)
        if kw is None:
            return None
        return f"{g.public(fn)}({', '.join(([_tuple(args)] if seq else args) + kw)})"
    return rule


def _elementwise_rule(fn: str) -> Callable:
    """``lax.add(a, b)``, ``lax.integer_pow(a, y=3)``: params other than
    ``y`` (``accuracy``) must be None."""
    def rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        p = eqn.params
        if any(v is not None for k, v in p.items() if k != "y"):
            return None
        extra = [f"y={p['y']!r}"] if "y" in p else []
        return f"{fn}({', '.join(args + extra)})"
    return rule


def _sort_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> Any:
    kw = _keyword_args(g, eqn, "lax.sort", ("dimension", "is_stable", "num_keys"))
    if kw is None:
        return None
    if len(args) == 1:  # lax.sort of one array returns it (not a tuple)
        return _Single(f"lax.sort({', '.join(args + kw)})")
    return f"lax.sort({', '.join([_tuple(args)] + kw)})"


def _arg_reduction_rule(fn: str) -> Callable:
    def rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        p = eqn.params
        if set(p) != {"axes", "index_dtype"} or len(p["axes"]) != 1:
            return None
        return f"{fn}({args[0]}, axis={p['axes'][0]!r}, index_dtype={_dtype_src(p['index_dtype'])})"
    return rule


def _iota_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    if len(p.get("shape", ())) == 1 and p.get("dimension") == 0 and \
            p.get("sharding") is None and set(p) <= {"dtype", "shape", "dimension", "sharding"}:
        return f"lax.iota({_dtype_src(p['dtype'])}, {p['shape'][0]!r})"
    kw = _keyword_args(g, eqn, "lax.broadcasted_iota", ("dtype", "shape", "dimension"))
    return None if kw is None else f"lax.broadcasted_iota({', '.join(kw)})"


def _dynamic_indices(eqn: core.JaxprEqn, fn: str, indices: list) -> bool:
    """Whether ``fn`` takes these start indices as they are: with
    ``allow_negative_indices=False`` (otherwise it wraps negative indices,
    where the primitive clamps them) and no negative literal (which it
    refuses)."""
    if "allow_negative_indices" not in _keywords(fn):
        return False
    return all(not isinstance(a, core.Literal) or int(np.asarray(a.val)) >= 0 for a in indices)


def _dynamic_slice_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    ndim = len(eqn.invars[0].aval.shape)
    if set(eqn.params) != {"slice_sizes"} or len(args) != 1 + ndim \
            or not _dynamic_indices(eqn, "lax.dynamic_slice", eqn.invars[1:]):
        return None
    return (f"lax.dynamic_slice({args[0]}, {_tuple(args[1:]) if ndim else '()'}, "
            f"slice_sizes={g.param(eqn.params['slice_sizes'], 'slice_sizes')}, "
            f"allow_negative_indices=False)")


def _dynamic_update_slice_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    ndim = len(eqn.invars[0].aval.shape)
    if eqn.params or len(args) != 2 + ndim \
            or not _dynamic_indices(eqn, "lax.dynamic_update_slice", eqn.invars[2:]):
        return None
    return (f"lax.dynamic_update_slice({args[0]}, {args[1]}, "
            f"{_tuple(args[2:]) if ndim else '()'}, allow_negative_indices=False)")


_SCATTER_PARAMS = ("dimension_numbers", "indices_are_sorted", "unique_indices", "mode")


def _scatter_rule(fn: str, combine: core.Primitive | None) -> Callable:
    """``lax.scatter_add(x, idx, upd, dimension_numbers=..., ...)``: the
    function builds the update jaxpr (``combine`` of the two values; none
    for ``lax.scatter``) itself."""
    def rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        p = eqn.params
        if tuple(p.get("update_consts", ())) or not _updates_with(p.get("update_jaxpr"), combine):
            return None
        kw = _keyword_args(g, eqn, fn, _SCATTER_PARAMS,
                           fixed={"update_jaxpr": p.get("update_jaxpr"),
                                  "update_consts": p.get("update_consts")})
        return None if kw is None else f"{fn}({', '.join(args + kw)})"
    return rule


def _updates_with(update_jaxpr: Any, combine: core.Primitive | None) -> bool:
    if combine is None:
        return update_jaxpr is None
    if update_jaxpr is None:
        return False
    return [e.primitive for e in _jaxpr.jaxpr_parts(update_jaxpr).eqns] == [combine]


def _callback_call_args(g: _Gen, in_tree: Any, args: list[str], static: dict,
                        reserved: frozenset) -> list[str] | None:
    """The arguments of a callback call: the ``(args, kwargs)`` pytree
    ``in_tree`` with the equation's operands and static values as leaves."""
    leaves, dynamic = [], iter(args)
    for i in range(len(args) + len(static)):
        leaves.append(_Src(g.param(static[i], "static_arg")) if i in static
                      else _Src(next(dynamic)))
    try:
        call_args, call_kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
        out = [_tree_src(a) for a in call_args]
        for k, v in call_kwargs.items():
            if not (isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k)) \
                    or k in reserved:
                return None
            out.append(f"{k}={_tree_src(v)}")
    except (_NoSource, TypeError, ValueError, AttributeError):
        return None
    return out


def _debug_print_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    if p.get("logging_record") is not None or p.get("in_tree") is None \
            or tuple(p.get("np_printoptions", ())) != tuple(np.get_printoptions().items()):
        return None  # (printed under other numpy print options: bound as it is)
    call = _callback_call_args(g, p["in_tree"], args, dict(p.get("static_args", ())),
                               _keywords("jax.debug.print"))
    if call is None or not isinstance(p.get("fmt"), str):
        return None
    opts = [f"{k}=True" for k in ("ordered", "partitioned") if p.get(k)]
    return f"jax.debug.print({', '.join([repr(p['fmt']), *call, *opts])})"


def _closure_vars(fn: Any) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    except ValueError:  # an empty cell
        return {}


def _debug_callback_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    # jax.debug.callback binds a closure over the user's callback, the
    # arguments' tree and their static values (JAX's _flat_callback).
    p = eqn.params
    closure = _closure_vars(p.get("callback"))
    if not {"callback", "in_tree", "static_args"} <= set(closure) \
            or set(p) - {"callback", "effect", "partitioned"}:
        return None
    call = _callback_call_args(g, closure["in_tree"], args, dict(closure["static_args"]),
                               _keywords("jax.debug.callback"))
    if call is None:
        return None
    opts = []
    if p.get("effect") is not _debug_effect("debug_effect"):
        if p.get("effect") is not _debug_effect("ordered_debug_effect"):
            return None
        opts.append("ordered=True")
    if p.get("partitioned"):
        opts.append("partitioned=True")
    fn = g.callable_src(closure["callback"], "debug_callback")
    return f"jax.debug.callback({', '.join([fn, *call, *opts])})"


def _debug_effect(name: str) -> Any:
    module = sys.modules.get("jax._src.debugging")
    return getattr(module, name, object())


def _host_callback_rule(fn: str, options: tuple[str, ...]) -> Callable:
    """``io_callback`` / ``pure_callback`` of the user's function (JAX binds
    it wrapped with the arguments' tree), with flat result types."""
    def rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        p = eqn.params
        flat = p.get("callback")
        user, in_tree = getattr(flat, "callback_func", None), getattr(flat, "in_tree", None)
        if user is None or in_tree is None or p.get("sharding") is not None \
                or set(p) - {"callback", "result_avals", "sharding", *options}:
            return None
        specs = [g.spec_src(a) for a in p["result_avals"]]
        if None in specs or any(getattr(a, "weak_type", False) for a in p["result_avals"]):
            return None
        call = _callback_call_args(g, in_tree, args, {}, _keywords(fn))
        if call is None or not set(options) <= _keywords(fn):
            return None
        opts = [f"{k}={g.param(p[k], k)}" for k in options
                if k in p and not _is_default(fn, k, p[k])]
        # One result type for one result, as a user writes it.
        results = specs[0] if len(specs) == 1 else _tuple(specs)
        src = f"{g.public(fn)}({', '.join([g.callable_src(user, 'callback'), results, *call, *opts])})"
        return _Single(src) if len(specs) == 1 else src
    return rule


# PRNG keys: ``jax.random`` functions of typed keys.

def _prng_impl_name(impl: Any) -> str | None:
    """The name ``jax.random`` resolves to ``impl`` (``'threefry2x32'``)."""
    name = getattr(impl, "name", None)
    registry = getattr(sys.modules.get(type(impl).__module__), "prngs", {})
    return name if isinstance(name, str) and registry.get(name) is impl else None


def _random_key_rule(fn: str) -> Callable:
    def rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        name = _prng_impl_name(eqn.params.get("impl"))
        if name is None or set(eqn.params) != {"impl"} \
                or fn == "jax.random.key" and eqn.invars[0].aval.shape:
            return None
        return f"{fn}({args[0]}, impl={name!r})"
    return rule


def _random_bits_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    if set(p) - {"bit_width", "shape", "out_sharding"} or p.get("out_sharding") is not None \
            or p.get("bit_width") not in (8, 16, 32, 64):
        return None
    return (f"jax.random.bits({args[0]}, shape={p['shape']!r}, "
            f"dtype=np.uint{p['bit_width']})")


def _random_split_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    if set(p) != {"shape"} or eqn.invars[0].aval.shape:  # (jax.random.split: one key)
        return None
    return f"jax.random.split({args[0]}, {p['shape']!r})"


def _random_fold_in_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    if eqn.params or eqn.invars[0].aval.shape \
            or np.dtype(eqn.invars[1].aval.dtype) != np.uint32:
        return None
    return f"jax.random.fold_in({args[0]}, {args[1]})"


def _reduce_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    """``lax.reduce(operands, init_values, computation, dimensions=...)`` of
    the function computing the reduction's jaxpr."""
    p = eqn.params
    if set(p) - {"computation", "jaxpr", "dimensions", "out_sharding"} \
            or p.get("out_sharding") is not None:
        return None
    n = len(args) // 2
    fn = g.function(p["jaxpr"], "reducer", "tuple")
    if n == 1:  # (one operand: the computation takes and returns arrays)
        return _Single(f"lax.reduce({args[0]}, {args[1]}, lambda acc, x: {fn}(acc, x)[0], "
                       f"dimensions={p['dimensions']!r})")
    return (f"lax.reduce({_tuple(args[:n])}, {_tuple(args[n:])}, "
            f"lambda acc, x: {fn}(*acc, *x), dimensions={p['dimensions']!r})")


def _linear_solve_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    """``lax.custom_linear_solve`` of the functions computing its jaxprs
    (the matvec, the solve and, when given, the transpose solve)."""
    p = eqn.params
    lengths, jaxprs = p.get("const_lengths"), p.get("jaxprs")
    if set(p) != {"const_lengths", "jaxprs"} or jaxprs.solve is None:
        return None
    offsets = np.cumsum([0, *lengths]).tolist()
    consts = {f: args[offsets[i]:offsets[i + 1]] for i, f in enumerate(lengths._fields)}
    b = args[offsets[-1]:]
    if len(_jaxpr.jaxpr_parts(jaxprs.solve).outvars) != len(b):
        return None  # (solve with auxiliary outputs)

    def call(field: str, hint: str) -> str:
        fn = g.function(getattr(jaxprs, field), hint, "tuple")
        return f"{fn}({', '.join([*consts[field], '*x'])})"

    opts = [f"solve=lambda _, x: {call('solve', 'solve')}"]
    if jaxprs.transpose_solve is not None:
        symmetric = jaxprs.vecmat is jaxprs.matvec
        opts.append(f"transpose_solve=lambda _, x: {call('transpose_solve', 'transpose_solve')}")
        if symmetric:
            opts.append("symmetric=True")
    return (f"lax.custom_linear_solve(lambda x: {call('matvec', 'matvec')}, {_tuple(b)}, "
            f"{', '.join(opts)})")


def _array_dtype(aval: Any) -> bool:
    return isinstance(getattr(aval, "dtype", None), np.dtype)


def _copy_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    # jnp.copy binds copy_p alone and keeps the weak type.
    return None if eqn.params or not _array_dtype(eqn.invars[0].aval) else f"jnp.copy({args[0]})"


def _stop_gradient_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    return None if eqn.params or not _array_dtype(eqn.invars[0].aval) \
        else f"lax.stop_gradient({args[0]})"


def _add_jaxvals_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    # The sum of two cotangents: lax.add's when its result has the first's
    # type (add_jaxvals keeps it), that is unless only the first is weak.
    a, b = (v.aval for v in eqn.invars)
    if eqn.params or not _array_dtype(a) or np.dtype(a.dtype).kind not in "iufc" \
            or (a.shape, a.dtype) != (b.shape, b.dtype) \
            or getattr(a, "weak_type", False) and not getattr(b, "weak_type", False):
        return None
    return f"lax.add({', '.join(args)})"


def _triangular_solve_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    # The function adds a dimension to a ``b`` of one dimension less than
    # ``a`` and drops ``conjugate_a`` for real ``a``: the params must be
    # what it binds.
    a, b = (v.aval for v in eqn.invars)
    if len(a.shape) != len(b.shape) or eqn.params.get("conjugate_a") \
            and not np.issubdtype(a.dtype, np.complexfloating):
        return None
    return _public("lax.linalg.triangular_solve", "left_side", "lower", "transpose_a",
                   "conjugate_a", "unit_diagonal")(g, eqn, args)


@functools.cache
def _device_put_params() -> dict | None:
    """The params ``jax.device_put(x)`` binds (traced once)."""
    try:
        j = jax.make_jaxpr(jax.device_put)(jax.ShapeDtypeStruct((), np.float32))
        (e,) = _jaxpr.jaxpr_parts(j).eqns
    except Exception:  # noqa: BLE001 - no single equation: not written with it
        return None
    return dict(e.params)


def _device_put_rule(g: _Gen, eqn: core.JaxprEqn, args: list[str]) -> Any:
    # jax.device_put of a tuple binds once, each param a tuple per operand.
    want, n = _device_put_params(), len(args)
    if want is None or set(want) != set(eqn.params) \
            or any(not _same(tuple(want[k]) * n, eqn.params[k]) for k in want):
        return None
    return _Single(f"jax.device_put({args[0]})") if n == 1 else \
        f"jax.device_put({_tuple(args)})"


def _public_rules() -> dict:
    """The rules of the primitives the installed JAX defines, keyed by the
    primitive."""
    rules: dict = {}

    def add(prim: Any, rule: Callable) -> None:
        if isinstance(prim, core.Primitive):
            rules[prim] = rule

    for name in _READABLE:
        fn = _LAX_FUNCTION.get(name, name)
        if hasattr(lax, fn):
            add(getattr(lax, f"{name}_p", None), _elementwise_rule(f"lax.{fn}"))
    structural = {
        "broadcast_in_dim": ("shape", "broadcast_dimensions"),
        "reshape": ("new_sizes", "dimensions"),
        "squeeze": ("dimensions",),
        "slice": ("start_indices", "limit_indices", "strides"),
        "transpose": ("permutation",),
        "rev": ("dimensions",),
        "pad": ("padding_config",),
        "split": ("sizes", "axis"),
        "reduce_precision": ("exponent_bits", "mantissa_bits"),
        "bitcast_convert_type": ("new_dtype",),
        "round": ("rounding_method",),
        "dot_general": ("dimension_numbers", "precision", "preferred_element_type"),
        "conv_general_dilated": ("window_strides", "padding", "lhs_dilation", "rhs_dilation",
                                 "dimension_numbers", "feature_group_count",
                                 "batch_group_count", "precision", "preferred_element_type"),
        "gather": ("dimension_numbers", "slice_sizes", "unique_indices", "indices_are_sorted",
                   "mode", "fill_value"),
        "rng_bit_generator": ("shape", "dtype", "algorithm"),
        "top_k": ("k", "axis", "is_stable"),
        "tile": ("reps",),
        "unstack": ("axis",),
        **{f"reduce_{op}": ("axes",) for op in ("sum", "max", "min", "prod", "and", "or", "xor")},
        **{f"cum{op}": ("axis", "reverse") for op in ("sum", "prod", "max", "min", "logsumexp")},
    }
    for name, params in structural.items():
        add(getattr(lax, f"{name}_p", None), _public(f"lax.{name}", *params))
    add(lax.convert_element_type_p,
        _public("lax.convert_element_type", "new_dtype", fixed={"weak_type": False}))
    add(lax.concatenate_p, _public("lax.concatenate", "dimension", seq=True))
    add(getattr(lax, "optimization_barrier_p", None),
        _public("lax.optimization_barrier", seq=True))
    add(getattr(lax, "stack_p", None), _public("lax.stack", "axis", seq=True))
    add(lax.copy_p, _copy_rule)
    add(getattr(lax, "stop_gradient_p", None), _stop_gradient_rule)
    add(getattr(lax, "device_put_p", None), _device_put_rule)
    ad_util = sys.modules.get("jax._src.ad_util")
    add(getattr(ad_util, "add_jaxvals_p", None), _add_jaxvals_rule)
    linalg = getattr(lax, "linalg", None)
    add(getattr(linalg, "lu_p", None), _public("lax.linalg.lu"))
    add(getattr(linalg, "triangular_solve_p", None), _triangular_solve_rule)
    add(lax.sort_p, _sort_rule)
    add(lax.argmax_p, _arg_reduction_rule("lax.argmax"))
    add(lax.argmin_p, _arg_reduction_rule("lax.argmin"))
    add(lax.iota_p, _iota_rule)
    add(lax.dynamic_slice_p, _dynamic_slice_rule)
    add(lax.dynamic_update_slice_p, _dynamic_update_slice_rule)
    add(lax.scatter_p, _scatter_rule("lax.scatter", None))
    for op in ("add", "sub", "mul", "min", "max"):
        add(getattr(lax, f"scatter_{op}_p", None),
            _scatter_rule(f"lax.scatter_{op}", getattr(lax, f"{op}_p")))
    add(getattr(lax, "reduce_p", None), _reduce_rule)
    add(getattr(lax, "linear_solve_p", None), _linear_solve_rule)
    debugging = sys.modules.get("jax._src.debugging")
    add(getattr(debugging, "debug_print_p", None), _debug_print_rule)
    add(getattr(debugging, "debug_callback_p", None), _debug_callback_rule)
    callback = importlib.import_module("jax._src.callback")
    add(getattr(callback, "io_callback_p", None),
        _host_callback_rule("jax.experimental.io_callback", ("ordered",)))
    add(getattr(callback, "pure_callback_p", None),
        _host_callback_rule("jax.pure_callback", ("vmap_method",)))
    prng = sys.modules.get("jax._src.random.prng") or sys.modules.get("jax._src.prng")
    add(getattr(prng, "random_seed_p", None), _random_key_rule("jax.random.key"))
    add(getattr(prng, "random_wrap_p", None), _random_key_rule("jax.random.wrap_key_data"))
    add(getattr(prng, "random_unwrap_p", None), _public("jax.random.key_data"))
    add(getattr(prng, "random_bits_p", None), _random_bits_rule)
    add(getattr(prng, "random_split_p", None), _random_split_rule)
    add(getattr(prng, "random_fold_in_p", None), _random_fold_in_rule)
    return rules


_RULES: dict = {
    _compat.scan_p: _scan_rule,
    _compat.while_p: _while_rule,
    _compat.cond_p: _cond_rule,
    _compat.jit_p: _jit_rule,
    _compat.remat_p: _remat_rule,
    _compat.custom_jvp_call_p: _call_rule("custom_jvp_primal"),
    _compat.custom_vjp_call_p: _call_rule("custom_vjp_primal"),
    _compat.shard_map_p: _shard_map_rule,
    _tag.tag_p: _tag_rule,
    **{p: _call_rule("closed_call") for p in _compat.CLOSED_CALL_PRIMITIVES},
    **_public_rules(),
}


class _Single:
    """A rule's expression whose value is the equation's one output."""

    def __init__(self, src: str):
        self.src = src


class _Src:
    def __init__(self, src: str):
        self.src = src


class _NoSource(Exception):
    pass


def _tree_src(x: Any) -> str:
    if isinstance(x, _Src):
        return x.src
    if x is None:
        return "None"
    if type(x) is tuple:
        items = [_tree_src(v) for v in x]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    if type(x) is list:
        return f"[{', '.join(_tree_src(v) for v in x)}]"
    if type(x) is dict:
        return "{" + ", ".join(f"{k!r}: {_tree_src(v)}" for k, v in x.items()) + "}"
    raise _NoSource(type(x))


# ---- source of values -----------------------------------------------------------------------

def _identifier(hint: str) -> str:
    s = "".join(c if c.isalnum() or c == "_" else "_" for c in hint).strip("_") or "fn"
    return s if not s[0].isdigit() else "_" + s


def _tuple(items: list[str]) -> str:
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _assign(outs: list[str], src: str, multiple: bool) -> str:
    if not outs:
        return src
    if not multiple:
        return f"{outs[0]} = {src}"
    if all(o == "_" for o in outs):
        return f"_ = {src}"
    return f"{', '.join(outs)}, = {src}" if len(outs) == 1 else f"{', '.join(outs)} = {src}"


def _default_dtype(dtype: np.dtype) -> np.dtype | None:
    """The dtype a Python scalar of this kind becomes (weakly typed)."""
    kind = {"b": bool, "i": int, "u": None, "f": float, "c": complex}.get(dtype.kind)
    if kind is None:
        return None
    return np.dtype(jax.numpy.result_type(kind))


def _float_src(x: float) -> str:
    if math.isnan(x):
        return "float('nan')"
    if math.isinf(x):
        return "float('inf')" if x > 0 else "float('-inf')"
    return repr(x)


def _python_scalar(a: np.ndarray) -> str:
    v = a.item()
    if isinstance(v, float):
        return _float_src(v)
    if isinstance(v, complex):
        return f"complex({_float_src(v.real)}, {_float_src(v.imag)})"
    return repr(v)


def _dtype_src(dtype: np.dtype) -> str:
    name = np.dtype(dtype).name
    return f"np.{name}" if hasattr(np, name) and name != "bool" else (
        "np.bool_" if name == "bool" else f"jnp.{name}")


def _scalar_src(a: np.ndarray) -> str:
    """An exact scalar of ``a``'s dtype: ``np.int32(3)``, ``np.float32(-0.0)``."""
    v = a.item() if a.dtype.kind in "biufc" else float(a)
    if a.dtype.kind == "f" or a.dtype.kind == "V" or a.dtype.name in ("bfloat16",) \
            or a.dtype.kind not in "biuc":
        inner = _float_src(float(v))
        if math.isnan(v) and not _is_default_nan(a):
            return f"np.frombuffer(bytes.fromhex({a.tobytes().hex()!r}), " \
                   f"dtype={_dtype_src(a.dtype)})[0]"
        return f"{_dtype_src(a.dtype)}({inner})"
    if a.dtype.kind == "c":
        return f"{_dtype_src(a.dtype)}(complex({_float_src(v.real)}, {_float_src(v.imag)}))"
    return f"{_dtype_src(a.dtype)}({v!r})"


def _is_default_nan(a: np.ndarray) -> bool:
    return a.tobytes() == np.asarray(float("nan"), a.dtype).tobytes()


def _array_src(a: np.ndarray) -> str:
    a = np.asarray(a)
    dt = _dtype_src(a.dtype)
    if a.dtype.kind in "biu":
        return f"np.array({a.tolist()!r}, dtype={dt})"
    return (f"np.frombuffer(bytes.fromhex({a.tobytes().hex()!r}), dtype={dt})"
            f".reshape({tuple(a.shape)!r})")


# ---- entry points ---------------------------------------------------------------------------

def jaxpr_to_python_code(jaxpr: Any, fn_name: str = "f",
                         max_inline_elements: int = DEFAULT_MAX_INLINE_ELEMENTS) -> PythonCode:
    """Python source of a module defining ``fn_name``, a function computing
    ``jaxpr`` bit for bit.

    The function takes the jaxpr's inputs (an open jaxpr's constvars first)
    and returns its output, or a tuple when there is not exactly one. A
    primitive with a public JAX function that binds exactly its params is
    written as that function's call with keywords (``lax.scatter_add``,
    ``jax.debug.print``, ...); nested jaxprs become module-level functions
    called through ``lax.scan``, ``lax.while_loop``, ``lax.switch``,
    ``jax.jit`` and ``jax.checkpoint``; custom_jvp/custom_vjp calls become
    calls of their primal function; tags become ``taxpr.tag``; any other
    primitive is bound with its params. The module runs on its own in a
    fresh process unless it reads ``OBJECTS`` (objects with no source form,
    listed at its top).

    Arguments:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
      fn_name: the function's name (an identifier that is no keyword,
        builtin or imported module name, and does not start with ``_``,
        which generated names do).
      max_inline_elements: constants up to this many elements are written
        into the code; larger ones are read from ``OBJECTS``.

    Returns:
      A ``PythonCode`` (a ``str``): ``code.load()`` runs it and returns the
      function; ``code.objects`` holds what the code reads from ``OBJECTS``
      (``exec(code, {"OBJECTS": code.objects})``), empty when it reads
      nothing.

    Raises:
      ValueError: ``fn_name`` is not a usable name.
    """
    if not fn_name.isidentifier() or fn_name in _RESERVED or fn_name.startswith("_"):
        raise ValueError(f"jaxpr_to_python_code: fn_name={fn_name!r} is not an identifier "
                         f"or clashes with a keyword, builtin, import or generated name")
    g = _Gen(max_inline_elements)
    main = g._function_src(jaxpr, fn_name, "top", 0)
    parts = ["\n".join(g.imports)]
    if g.objects:
        parts.append(_objects_check(g))
    if g.consts:
        parts.append("\n".join(g.consts))
    parts.extend(g.functions)
    if g.late:
        parts.append("\n".join(g.late))
    parts.append(main)
    return PythonCode("\n\n\n".join(parts) + "\n", g.objects, fn_name)


def _objects_check(g: _Gen) -> str:
    """The module's opening lines when it reads ``OBJECTS``: which objects,
    and a clear error when they are not given."""
    notes = "\n".join(f"#   {k!r}: {g.object_notes[k]}" for k in g.objects)
    return (
        "# This code reads Python objects that have no source form from a dict OBJECTS\n"
        "# in its globals (taxpr's PythonCode.load() passes them):\n"
        f"{notes}\n"
        f"_OBJECTS_NEEDED = {tuple(g.objects)!r}\n"
        "_OBJECTS_MISSING = [k for k in _OBJECTS_NEEDED if k not in globals().get('OBJECTS', {})]\n"
        "if _OBJECTS_MISSING:\n"
        "    raise NameError('this code needs Python objects that have no source form, missing '\n"
        "                    'from OBJECTS: ' + ', '.join(_OBJECTS_MISSING) + '; run it with '\n"
        "                    \"exec(code, {'OBJECTS': code.objects}) or code.load()\")")


def fn_to_python_code(fn: Callable, *args: Any, **kwargs: Any) -> PythonCode:
    """``jaxpr_to_python_code`` of ``jax.make_jaxpr(fn)(*args, **kwargs)``
    (the generated function takes the flattened arguments and returns the
    flattened outputs), named after ``fn`` when its name is usable.

    Arguments:
      fn: a function JAX can trace.
      *args, **kwargs: example arguments (arrays or ``ShapeDtypeStruct``).

    Returns:
      A ``PythonCode``.
    """
    name = getattr(fn, "__name__", "f")
    if not name.isidentifier() or name in _RESERVED or name.startswith("_"):
        name = "f"
    return jaxpr_to_python_code(jax.make_jaxpr(fn)(*args, **kwargs), fn_name=name)

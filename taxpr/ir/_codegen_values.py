"""The source of the values an equation holds (``ValueWriter``): constants
(module-level, exact), literals, and params of every kind: numbers,
containers, dtypes, meshes and partition specs, pytree structures, array
types, classes, named tuples, dataclasses and enums rebuilt from their
fields, module-level objects by import, and jaxprs (``jaxpr_src``, which
``FunctionWriter`` writes); a value without a source form becomes an
``OBJECTS`` entry. Every rebuilt value is checked to give back an equal one."""

from __future__ import annotations

import builtins
import dataclasses
import enum
import inspect
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from .. import _jaxpr
from .._jax.internals import core
from ._codegen_locate import location, named_instance, named_object, prng_impl_name
from ._codegen_module import ModuleWriter
from ._codegen_source import (NoSource, Src, array_src, default_dtype, dtype_src,
                              eval_roundtrips, float_src, python_scalar_src, same_value,
                              scalar_src, tree_src, tuple_src)

__all__ = ["ValueWriter"]


class ValueWriter(ModuleWriter):
    """Sources of values; constants over ``max_inline_elements`` elements
    are read from ``OBJECTS``."""

    def __init__(self, max_inline_elements: int):
        super().__init__()
        self.max_inline = max_inline_elements
        self.repr_memo: dict = {}

    def jaxpr_src(self, j: Any, hint: str) -> str:
        """The name of a module-level jaxpr equal to ``j`` (written by
        ``FunctionWriter``, which writes functions)."""
        raise NotImplementedError

    def array(self, value: Any, dtype: Any, hint: str = "const") -> str:
        """A module-level constant holding ``value`` exactly."""
        name = self.fn_name(hint)
        impl = prng_impl_name(getattr(getattr(value, "dtype", None), "_impl", None))
        if impl is not None:  # typed PRNG keys: their data, wrapped
            data = np.asarray(jax.random.key_data(value))
            if data.size <= self.max_inline:
                self.consts.append(f"{name} = jax.random.wrap_key_data({array_src(data)}, "
                                   f"impl={impl!r})")
                return name
        if isinstance(value, core.Tracer) and isinstance(getattr(value, "dtype", None), np.dtype):
            # A tracer of a finished trace, kept in a jaxpr held by a param
            # (equinox's closure-converted functions keep the jaxpr; their
            # consts are passed as operands): it has no value, and reading it
            # raises, so the program never reads it. Zeros of its type.
            self.consts.append(f"{name} = np.zeros({tuple(value.shape)!r}, "
                               f"dtype={dtype_src(np.dtype(value.dtype))})")
            return name
        try:
            a = np.asarray(value, dtype=dtype)
        except (TypeError, ValueError):  # e.g. PRNG keys (an extended dtype)
            a = None
        if a is None or a.size > self.max_inline:
            self.consts.append(f"{name} = {self.obj(value, hint)}")
            return name
        self.consts.append(f"{name} = {array_src(a)}")
        return name

    def literal(self, lit: core.Literal) -> str:
        aval = lit.aval
        dtype = np.dtype(aval.dtype)
        a = np.asarray(lit.val, dtype=dtype)
        if a.shape != ():
            return array_src(a) if a.size <= 64 else self.array(a, dtype)
        weak = bool(getattr(aval, "weak_type", False))
        if weak and dtype == default_dtype(dtype):
            return python_scalar_src(a)
        src = scalar_src(a)
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
            return float_src(value)
        if type(value) in (tuple, list):
            items = [self.param(v, hint) for v in value]
            if type(value) is tuple:
                return tuple_src(items)
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
            return src if eval_roundtrips(src, value, self.namespace) else self.obj(value, hint)
        if isinstance(value, np.ndarray) or isinstance(value, np.generic):
            return array_src(value) if np.ndim(value) else scalar_src(np.asarray(value))
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
            where = location(value)
            if where is not None:
                return self.import_module(where)[0]
            where = named_instance(value)  # a class made for one module-level object
            return f"type({self.import_object(*where)})" if where is not None \
                else self.obj(value, hint)
        if type(value) is jax.ShapeDtypeStruct:
            src = self.spec_src(value)
            return src if src is not None and eval_roundtrips(src, value, self.namespace) \
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
        if src is None or "OBJECTS[" in src or not eval_roundtrips(src, value, self.namespace):
            # Whole, rather than in parts (drop the parts' entries).
            for k in set(self.objects) - set(before):
                self.object_keys.pop(self.objects.pop(k))
            where = named_object(value)
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
                if eval_roundtrips(src, mesh, self.namespace):
                    return src
        return None

    def axis_types_src(self, types: Any) -> str:
        """``(jax.sharding.AxisType.<name>, ...)``: by its public name."""
        public = getattr(jax.sharding, "AxisType", None)
        if public is not None and all(type(t) is public for t in types):
            items = [f"jax.sharding.AxisType.{t.name}" for t in types]
            return tuple_src(items)
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
        where = location(cls)
        if where is None:
            return None
        where, line = self.import_module(where, add=False)
        lines.append(line)
        if isinstance(value, enum.Enum):
            return f"{where}.{value.name}"
        if hasattr(value, "_fields"):  # a NamedTuple (GatherDimensionNumbers, ...)
            defaults = getattr(cls, "_field_defaults", {})
            args = ", ".join(f"{f}={self.param(getattr(value, f), hint)}" for f in value._fields
                             if not (f in defaults and same_value(defaults[f], getattr(value, f))))
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
            src = tree_src(jax.tree_util.tree_unflatten(tree, [Src("0")] * tree.num_leaves))
            src = f"jax.tree_util.tree_structure({src})"
        except (NoSource, TypeError, ValueError):
            src = self.treedef_nodes_src(tree)
        return src if src is not None and eval_roundtrips(src, tree, self.namespace) else None

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

    def spec_src(self, aval: Any) -> str | None:
        """``jax.ShapeDtypeStruct(...)`` of an array type, or None."""
        dtype = getattr(aval, "dtype", None)
        if dtype is None or not isinstance(dtype, np.dtype) or not hasattr(aval, "shape"):
            return None
        weak = ", weak_type=True" if getattr(aval, "weak_type", False) else ""
        return f"jax.ShapeDtypeStruct({tuple(aval.shape)!r}, {dtype_src(dtype)}{weak})"


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

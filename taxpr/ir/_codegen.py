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
  ``_Gen.rules``, keyed by the primitive, and checks that the installed JAX's
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

The work is split by job: ``_codegen_names`` (variable names),
``_codegen_source`` (source of plain values), ``_codegen_locate`` (where
objects live), ``_codegen_module`` (the module's parts), ``_codegen_values``
(params and constants), ``_codegen_functions`` (functions and equations),
and the rules per primitive: ``_codegen_control`` (higher-order primitives
and tags), ``_codegen_public`` (calls of public functions),
``_codegen_lax`` and ``_codegen_jax``. This module holds the entry points.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from ._codegen_control import control_rules
from ._codegen_functions import FunctionWriter
from ._codegen_jax import jax_rules
from ._codegen_lax import lax_rules
from ._codegen_names import RESERVED

__all__ = ["PythonCode", "fn_to_python_code", "jaxpr_to_python_code"]

DEFAULT_MAX_INLINE_ELEMENTS = 10_000



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


class _Gen(FunctionWriter):
    """The generator: a ``FunctionWriter`` with every rule."""

    rules = {**control_rules(), **lax_rules(), **jax_rules()}


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
    if not fn_name.isidentifier() or fn_name in RESERVED or fn_name.startswith("_"):
        raise ValueError(f"jaxpr_to_python_code: fn_name={fn_name!r} is not an identifier "
                         f"or clashes with a keyword, builtin, import or generated name")
    g = _Gen(max_inline_elements)
    main = g.function_src(jaxpr, fn_name, "top", 0)
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
    if not name.isidentifier() or name in RESERVED or name.startswith("_"):
        name = "f"
    return jaxpr_to_python_code(jax.make_jaxpr(fn)(*args, **kwargs), fn_name=name)

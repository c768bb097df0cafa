"""Functions and equations of the generated code (``FunctionWriter``): one
module-level function per jaxpr (its consts as module constants, its
invars as arguments, one statement per equation), and the statement of an
equation: its primitive's rule (``rules``, keyed by the primitive) when it
gives one, else ``<primitive>.bind(*args, **params)``."""

from __future__ import annotations

import keyword
from typing import Any

from .. import _compat, _jaxpr, _traverse
from .._jax.internals import core
from ._codegen_locate import location
from ._codegen_names import Names
from ._codegen_source import tuple_src
from ._codegen_values import ValueWriter

__all__ = ["FunctionWriter", "Single"]


class Single:
    """A rule's expression whose value is the equation's one output."""

    def __init__(self, src: str):
        self.src = src


class FunctionWriter(ValueWriter):
    """Writes jaxprs as functions. ``rules`` maps a primitive to its rule
    ``rule(writer, eqn, args) -> source | None``: the expression whose value
    is the tuple of the equation's outputs (``args``: its operands'
    sources); a ``Single``, the expression of its one output; a pair
    ``(expression, n)``, an expression whose value is two tuples, the first
    of the first ``n`` outputs; or None, to bind the primitive as it is.
    Without rules (here) every primitive is bound as it is."""

    rules: dict = {}

    def __init__(self, max_inline_elements: int):
        super().__init__(max_inline_elements)
        self.jaxpr_fns = _traverse.IdMemo()  # jaxpr (and how it returns) -> function name

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
        src = self.function_src(j, name, returns, n_carry)
        if py_name is not None and py_name != name:  # the name jax.jit records
            src += f"\n\n\n{name}.__name__ = {py_name!r}"
        self.functions.append(src)
        return name

    def function_src(self, j: Any, name: str, returns: str, n_carry: int) -> str:
        constvars, consts, invars, eqns, outvars, _, _ = _jaxpr.jaxpr_parts(j)
        names = Names()
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
            body.append(f"return {tuple_src(outs[:n_carry])}, {tuple_src(outs[n_carry:])}")
        else:
            body.append(f"return {tuple_src(outs)}")
        lines.extend("    " + b for b in body)
        return "\n".join(lines)

    def atom(self, env: dict, a: Any) -> str:
        if isinstance(a, core.Literal):
            return self.literal(a)
        return env[a]

    def eqn(self, eqn: core.JaxprEqn, env: dict, names: Names) -> list[str]:
        args = [self.atom(env, a) for a in eqn.invars]
        outs = []
        for v in eqn.outvars:
            if isinstance(v, core.DropVar):
                outs.append("_")
            else:
                env[v] = names.fresh()
                outs.append(env[v])
        prim = eqn.primitive
        rule = self.rules.get(prim)
        src = None if rule is None else rule(self, eqn, args)
        if isinstance(src, Single):  # the expression of the one output
            return [_assign(outs, src.src, False)]
        if isinstance(src, tuple):  # (expression, number of outputs in a first group)
            src, n_first = src
            return [f"{tuple_src(outs[:n_first])}, {tuple_src(outs[n_first:])} = {src}"]
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
        and location(cls) is not None


def _assign(outs: list[str], src: str, multiple: bool) -> str:
    """The statement assigning ``src`` to the names ``outs``."""
    if not outs:
        return src
    if not multiple:
        return f"{outs[0]} = {src}"
    if all(o == "_" for o in outs):
        return f"_ = {src}"
    return f"{', '.join(outs)}, = {src}" if len(outs) == 1 else f"{', '.join(outs)} = {src}"

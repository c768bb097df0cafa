"""``TypedClosedJaxpr``: a closed jaxpr with its input and output pytrees
(taxpr 0.0.3's API)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import jax

from . import _jaxpr
from ._dataflow import partition_out, transpose
from ._inject import inject as _inject


def _to_shape(tree: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)), tree)


@dataclasses.dataclass(frozen=True)
class TypedClosedJaxpr:
    """A closed jaxpr with the pytree structure of its inputs and outputs.

    Attributes:
        in_shape: the arguments' pytree of ShapeDtypeStruct.
        closed_jaxpr: the program over the flattened arguments.
        out_shape: the output's pytree of ShapeDtypeStruct.
        static_argnums: static arguments of the traced function.
    """

    in_shape: Any
    closed_jaxpr: Any
    out_shape: Any
    static_argnums: int | Iterable[int] = ()

    @staticmethod
    def make(fn: Callable, static_argnums: int | Iterable[int] = ()) -> Callable:
        """``TypedClosedJaxpr.make(fn)(*args)`` traces ``fn`` at ``args``."""
        traced = jax.make_jaxpr(fn, static_argnums=static_argnums, return_shape=True)

        def wrapper(*args, **kwargs):
            closed, out_shape = traced(*args, **kwargs)
            return TypedClosedJaxpr(_to_shape(args), closed, out_shape, static_argnums)

        return wrapper

    def eval(self, *args: Any) -> Any:
        """Evaluate on arguments of ``in_shape``'s structure."""
        out = _jaxpr.jaxpr_as_fun(self.closed_jaxpr)(*jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(self.out_shape), out)

    def map_inputs(self, fn: Callable, static_argnums: int | Iterable[int] = ()) -> Callable:
        """A maker of the program ``args -> self.eval(*fn(*args))``."""
        return TypedClosedJaxpr.make(lambda *a: self.eval(*fn(*a)), static_argnums)

    def map_outputs(self, fn: Callable) -> TypedClosedJaxpr:
        """The program ``args -> fn(self.eval(*args))``."""
        return TypedClosedJaxpr.make(lambda *a: fn(self.eval(*a)),
                                     self.static_argnums)(*self.in_shape)

    def inject(self, injector: Callable, ctx: Any) -> TypedClosedJaxpr:
        """``tx.inject`` of this program: ``(ctx, *args) -> (out, ctx)``."""
        closed = _inject(self.closed_jaxpr, injector, ctx)
        return TypedClosedJaxpr(_to_shape((ctx, *self.in_shape)), closed,
                                (self.out_shape, _to_shape(ctx)), self.static_argnums)

    def transpose(self, predicate: Callable | None = None):
        """``tx.transpose`` of this program: ``(typed, params_list)``; the
        typed program has the same inputs and returns the list of tagged
        values. ``tx.tcj_transpose(tcj)`` is the same (taxpr 0.0.3's name)."""
        closed, params, structures = transpose(self.closed_jaxpr, predicate)
        shapes = [jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), s)
                  for s in structures]
        return TypedClosedJaxpr(self.in_shape, closed, shapes, self.static_argnums), params

    def partition_out(self, outvar_indices: list[list[int]]) -> list:
        """``tx.partition_out`` of this program: one program per group of
        output indices, each returning the list of its group's outputs.
        ``tx.tcj_partition_out(tcj, ...)`` is the same (taxpr 0.0.3's name)."""
        leaves, _ = jax.tree_util.tree_flatten(self.out_shape)
        parts = partition_out(self.closed_jaxpr, outvar_indices)
        return [TypedClosedJaxpr(self.in_shape, closed, [leaves[i] for i in group],
                                 self.static_argnums)
                for group, closed in zip(outvar_indices, parts)]


# taxpr 0.0.3's names of the two methods above.
tcj_transpose = TypedClosedJaxpr.transpose
tcj_partition_out = TypedClosedJaxpr.partition_out

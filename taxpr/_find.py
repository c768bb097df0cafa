"""Finding and removing tags: ``iter_tags``, ``find_tags``, ``dissolve_tags``."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import jax
from ._jax.internals import core

from . import _traverse
from .primitives._tag import TAG_PRIMITIVES, meta, n_values, tag_p, user_params

Predicate = Callable[[dict, Any], bool]


@dataclasses.dataclass(frozen=True)
class TagSite:
    """A tag found in a jaxpr.

    Attributes:
        params: the keyword arguments given to ``tag``.
        shape: the tagged pytree with each leaf replaced by its ShapedArray.
        path: the enclosing primitives, outermost first, e.g.
            ``("jit[f]", "scan[length=5]", "cond[branch=1]")``.
    """

    params: dict
    shape: Any
    path: tuple[str, ...]


def tag_shape(eqn: core.JaxprEqn) -> Any:
    """The tagged pytree of ``eqn`` (a tag, tangent or cotangent) as avals."""
    avals = [v.aval for v in eqn.invars]
    if eqn.primitive is not tag_p:  # tangent/cotangent: (*primals, *tangents)
        avals = avals[: len(avals) // 2]
    else:  # a guarded tag's last operand is its guard, not part of the value
        avals = avals[:n_values(eqn.params, len(avals))]
    return jax.tree_util.tree_unflatten(meta(eqn.params).tree, avals)


def find_tags(jaxpr: Any) -> list[TagSite]:
    """Every tag in ``jaxpr`` (a Jaxpr or ClosedJaxpr), in program order,
    through every nested jaxpr.

    Arguments:
        jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.

    Returns:
        A list of ``TagSite(params, shape, path)``.
    """
    return [TagSite(user_params(eqn.params), tag_shape(eqn), path)
            for eqn, path in _traverse.iter_eqns(jaxpr) if eqn.primitive is tag_p]


def iter_tags(jaxpr: Any) -> Iterator[tuple[dict, Any]]:
    """Yield ``(params, shape)`` for every tag in ``jaxpr``, in program order,
    through every nested jaxpr.

    Arguments:
        jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.

    Returns:
        An iterator of ``(params, shape)``; ``shape`` is the tagged pytree with
        each leaf replaced by its ShapedArray.
    """
    for eqn, _ in _traverse.iter_eqns(jaxpr):
        if eqn.primitive is tag_p:
            yield user_params(eqn.params), tag_shape(eqn)




def is_selected(eqn: core.JaxprEqn, predicate: Predicate | None) -> bool:
    """Whether ``eqn`` is a tag (or its tangent) selected by ``predicate``."""
    if eqn.primitive not in TAG_PRIMITIVES:
        return False
    return predicate is None or bool(predicate(user_params(eqn.params), tag_shape(eqn)))


def dissolve_tags(jaxpr: Any, predicate: Predicate | None = None) -> Any:
    """Remove tags from ``jaxpr``, everywhere.

    Arguments:
        jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
        predicate: ``predicate(params, shape) -> bool`` selects the tags to
            remove; None removes all.

    Returns:
        The same kind of object, evaluating identically, without those tags.
    """

    def rewrite(eqn, path, env):
        if not is_selected(eqn, predicate):
            return None
        return forward_dissolved(eqn, env)

    return _traverse.map_jaxpr(jaxpr, rewrite)


def forward_dissolved(eqn: core.JaxprEqn, env: dict) -> list:
    """Dissolve the tag ``eqn`` in a ``_traverse.map_jaxpr`` rewrite: bind
    its outputs to the values it tags in ``env``; returns no equations."""
    ins = (eqn.invars[:n_values(eqn.params, len(eqn.invars))] if eqn.primitive is tag_p
           else eqn.invars[len(eqn.invars) // 2:])
    for o, i in zip(eqn.outvars, ins):
        if not isinstance(o, core.DropVar):
            env[o] = env.get(i, i) if type(i) is core.Var else i
    return []

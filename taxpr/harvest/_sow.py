"""``sow`` / ``sow_cond`` / ``nest``: marking values with a harvest tag."""

from __future__ import annotations

import functools
import contextvars
from typing import Any, Callable

import jax
import jax.numpy as jnp

from .. import _jaxpr
from ..primitives._tag import tag, tag_p


sow_p = tag_p  # the primitive behind ``sow``


class _SowOp:
    """The ``op`` param of a sow (compared by identity: never a user's tag)."""

    __slots__ = ()

    def __repr__(self):
        return "sow"

    def batches_values_alike(self, params: dict) -> bool:
        """A ``sow_cond`` whose predicate vmap batches sows per example."""
        return params.get("mode") == "cond_clobber"


SOW = _SowOp()


# The ``nest`` scopes around the code being traced, outermost first.
_SCOPES: contextvars.ContextVar[tuple] = contextvars.ContextVar("taxpr_nest_scopes", default=())


# (tag, name) -> per-leaf avals a sow takes while a plant re-traces the
# program (see ``_plant_types``); set only around that trace.
RETYPE: contextvars.ContextVar[dict] = contextvars.ContextVar("taxpr_plant_retype", default={})


def _scope() -> tuple:
    return _SCOPES.get()


def sow(value: Any, *, tag: Any, name: Any, mode: str = "strict", key: Any = None) -> Any:
    """Mark ``value`` as an intermediate named ``name`` for harvests of ``tag``.

    Outside a harvest, ``sow`` is the identity (in eager code and under any
    JAX transformation). ``reap`` / ``call_and_reap`` collect sown values,
    ``plant`` replaces them.

    Arguments:
        value: a pytree of arrays (or Python scalars).
        tag: the harvest tag (any hashable value); only harvests of this tag
            see the sow.
        name: the value's name (hashable) in the reaped / planted dict.
        mode: ``"strict"`` (sown at most once per harvest, not in loops),
            ``"clobber"`` (the last value wins; required in ``while_loop``)
            or ``"append"`` (values stacked along a new leading axis, one row
            per time the sow runs; inside ``scan`` one per iteration).
        key: accepted for oryx compatibility and ignored.

    Returns:
        ``value``, or the planted value inside a ``plant``.

    Raises:
        ValueError: ``mode`` is ``"cond_clobber"`` (use ``sow_cond``) or unknown.

    Example:
        >>> def f(x):
        ...     y = sow(x * 2, tag="t", name="y")
        ...     return y + 1
        >>> reap(f, tag="t")(1.0)  # {"y": 2.0}
    """
    del key
    if mode == "cond_clobber":
        raise ValueError("For 'cond_clobber' mode, use `sow_cond`.")
    if mode not in ("strict", "clobber", "append"):
        raise ValueError(f"Invalid mode: {mode}")
    return _tag_sow(value, None, tag, name, mode)


def sow_cond(value: Any, pred: Any, *, tag: Any, name: Any, mode: str = "cond_clobber",
             key: Any = None) -> Any:
    """Sow ``value`` in ``cond_clobber`` mode: a reap keeps the last value whose
    ``pred`` was true (zeros if it never was), e.g. inside ``while_loop``.

    Arguments:
        value: a pytree of arrays.
        pred: a boolean scalar (may be traced).
        tag, name: as for ``sow``.
        mode: must be ``"cond_clobber"`` (oryx's signature).
        key: accepted for oryx compatibility and ignored.

    Returns:
        ``value``, or the planted value inside a ``plant``.

    Raises:
        ValueError: ``mode`` is not ``"cond_clobber"``.

    Example:
        >>> def f(xs):
        ...     def body(c, x):
        ...         sow_cond(x, x > 0, tag="t", name="last_positive")
        ...         return c, None
        ...     return jax.lax.scan(body, 0.0, xs)[0]
        >>> reap(f, tag="t")(jnp.array([1.0, -2.0]))  # {"last_positive": 1.0}
    """
    del key
    if mode != "cond_clobber":
        raise ValueError(f"sow_cond only supports mode='cond_clobber', got {mode!r}")
    return _tag_sow(value, jnp.asarray(pred, bool), tag, name, "cond_clobber")


def _tag_sow(value, pred, tag_, name, mode):
    full = (*_scope(), name) if _scope() else name
    retype = RETYPE.get().get((tag_, full))
    if retype is not None:  # a plant re-traces this sow with the planted value's type
        leaves, tree = jax.tree_util.tree_flatten(value)
        value = jax.tree_util.tree_unflatten(tree, [
            x if t is None else _jaxpr.cast_weak_type(jax.lax.convert_element_type(x, t.dtype), t)
            for x, t in zip(leaves, retype)])
    if pred is None:
        return tag(value, op=SOW, tag=tag_, name=full, mode=mode)
    return tag((value, pred), op=SOW, tag=tag_, name=full, mode=mode)[0]


def nest(f: Callable, *, scope: str) -> Callable:
    """``f`` with the names of the sows it makes nested under ``scope``.

    Reaps of ``nest(f, scope=s)`` come back as ``{s: {name: value}}``,
    plants are read from ``plants[s][name]``, and an ``allowlist`` /
    ``blocklist`` entry ``s`` selects the whole scope. Scopes nest.

    Arguments:
        f: the function whose sows are scoped (called with the same arguments).
        scope: the scope's name; it may not also be a sow's name in the same
            harvest.

    Returns:
        ``wrapped(*args, **kwargs) -> f(*args, **kwargs)``.

    Raises:
        ValueError (at harvest time): a sow and a scope share a name
            ("Variable has already been reaped: ...", as oryx).

    Example:
        >>> g = nest(lambda x: sow(x, tag="t", name="a"), scope="layer1")
        >>> reap(g, tag="t")(1.0)  # {"layer1": {"a": 1.0}}
    """

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        token = _SCOPES.set((*_SCOPES.get(), scope))
        try:
            return f(*args, **kwargs)
        finally:
            _SCOPES.reset(token)

    return wrapped

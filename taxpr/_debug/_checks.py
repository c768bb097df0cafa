"""``tx.error_if`` and ``tx.checked``: errors raised from inside ``jit``.

``error_if(pred, msg, *args)`` binds two things: ``error_if_p``, a marker
that compiles to nothing and that the eager interpreter (``_eager``)
checks, and a host callback run only when ``pred`` holds (``_notify``).
Without a wrapper the callback raises the ``CheckError`` (JAX reports it as
its runtime error under ``jit``). ``checked(fn)`` makes it a clean
exception from the call: its callbacks record the error, and after the
call taxpr runs ``fn`` again eagerly on the same inputs to find which loop
iteration raised it.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .._jax.internals import core
from .. import _compat
from ._eager import EAGER_RULES, Frame, Run, run_closed, trace_on_cpu
from .._host import collecting, deliver, notify


class CheckError(RuntimeError):
    """A ``tx.error_if`` condition held.

    Attributes:
        message: the message, formatted with the run-time values.
        source: the user's line of the ``error_if``, or None.
        path: the enclosing primitives, outermost first (known when the
            error comes from ``tx.checked``).
        iterations: ``((loop kind, index), ...)`` of the enclosing loops,
            outermost first (from ``tx.checked``).
        example: the index of the example along the innermost ``jax.vmap``
            around the ``error_if`` (or, inside ``tx.checked``, of the first
            element of ``pred`` that held), or None.
    """

    def __init__(self, message: str, source: str | None = None, path: tuple = (),
                 iterations: tuple = (), example: int | None = None):
        self.message, self.source, self.path = message, source, path
        self.iterations, self.example = iterations, example
        where = [f"at {source}"] if source else []
        if path:
            where.append("path " + " / ".join(path))
        where += [f"{loop} iteration {i}" for loop, i in iterations]
        if example is not None:
            where.append(f"vmap example {example}")
        super().__init__(message + (f" ({', '.join(where)})" if where else ""))


# ---- the marker -------------------------------------------------------------------

error_if_p = Primitive("taxpr_error_if")
error_if_p.multiple_results = True


def _no_outputs(*args, **params):
    return []


error_if_p.def_impl(_no_outputs)
error_if_p.def_abstract_eval(_no_outputs)
mlir.register_lowering(error_if_p, lambda ctx, *args, **params: [])
ad.primitive_jvps[error_if_p] = lambda primals, tangents, **params: (
    error_if_p.bind(*primals, **params), [])
batching.primitive_batchers[error_if_p] = lambda args, dims, **params: (
    error_if_p.bind(*args, **params), [])


def _format(msg: str, values) -> str:
    try:
        return msg.format(*[np.asarray(v) if np.ndim(v) else np.asarray(v).item() for v in values])
    except (IndexError, KeyError, ValueError):
        return f"{msg} {list(values)}"


def _error_if_rule(frame: Frame, eqn, ins) -> list:
    pred = np.asarray(ins[0].array)
    if pred.any():
        example = int(np.flatnonzero(pred)[0]) if pred.ndim else None
        values = [v.array for v in ins[1:]]
        if example is not None:
            values = [np.asarray(v)[example] if np.shape(v)[:1] == pred.shape[:1] else v
                      for v in values]
        raise CheckError(_format(eqn.params["msg"], values),
                         _compat.user_line(eqn.source_info.traceback), frame.path,
                         frame.iterations, example)
    return []


EAGER_RULES[error_if_p] = _error_if_rule


# ---- error_if and checked -----------------------------------------------------------

# Whether ``checked`` is running a function again eagerly: its callbacks
# then do nothing (the marker raises).
_REPLAYING = contextvars.ContextVar("taxpr_check_replaying", default=False)


def error_if(pred: Any, msg: str, *args: Any) -> None:
    """Raise a ``CheckError`` when ``pred`` holds, from anywhere: under
    ``jit``, ``vmap``, ``scan``, ``grad`` and inside ``tx.uncurry``'s pure
    function.

    Arguments:
        pred: a boolean array; the error is raised when any element is true.
        msg: the message, a ``str.format`` template filled with ``args``'
            run-time values (``"step {} diverged: loss {}"``).
        *args: arrays to format into ``msg``.

    Outside ``tx.checked``, a traced ``error_if`` raises from a host
    callback (JAX reports it as its runtime error, the ``CheckError``'s
    message in it); called on concrete values it raises at once. Inside
    ``tx.checked`` the call raises the ``CheckError`` itself, naming the
    loop iteration.
    """
    pred = jnp.asarray(pred)
    args = [jnp.asarray(a) for a in args]
    if not isinstance(pred, core.Tracer) and not any(isinstance(a, core.Tracer) for a in args):
        if np.asarray(pred).any():
            raise CheckError(_format(msg, args))
        return
    error_if_p.bind(pred, *args, msg=msg)
    notify(jnp.any(pred), args, functools.partial(_on_host, msg))


def _on_host(msg: str, values: list, example: int | None) -> None:
    if _REPLAYING.get():
        return
    deliver(CheckError(_format(msg, values), example=example))


def checked(fn: Callable) -> Callable:
    """``fn`` compiled, with its ``tx.error_if`` errors raised as a clean
    ``CheckError`` from the call (naming the loop iteration), its outputs
    otherwise those of ``fn``.

    Arguments:
        fn: the function.

    Returns:
        The wrapped function. Called with concrete values, it waits for its
        outputs and raises the error found, run again eagerly to name the
        loop iteration. Called inside ``jax.vmap`` / ``jax.grad`` run
        eagerly, it raises the error (naming the vmap example); inside
        ``jax.jit``, an ``error_if`` raises from its callback (JAX reports
        its runtime error, with the message).
    """
    jitted = jax.jit(fn)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        flat = jax.tree_util.tree_leaves((args, kwargs))
        traced = any(isinstance(x, core.Tracer) for x in flat)
        # Run eagerly (under no outer jit), the call's callbacks run before
        # it returns: their error is raised here, cleanly.
        with collecting() as errors:
            out = (fn if traced else jitted)(*args, **kwargs)
            jax.effects_barrier()
        if errors:
            raise (None if traced else _located(fn, args, kwargs)) or errors[0]
        return out

    return wrapped


def _located(fn: Callable, args, kwargs) -> CheckError | None:
    """The ``CheckError`` of ``fn`` run again eagerly (with the loop
    iteration), or None if that run raises none."""
    flat, tree = jax.tree_util.tree_flatten((args, kwargs))

    def flat_fn(*flat):
        a, k = jax.tree_util.tree_unflatten(tree, list(flat))
        return jax.tree_util.tree_leaves(fn(*a, **k))

    token = _REPLAYING.set(True)
    try:
        closed = trace_on_cpu(flat_fn, flat)
        run_closed(closed, flat, Run(inf=True))
    except CheckError as error:
        return error
    finally:
        _REPLAYING.reset(token)
    return None

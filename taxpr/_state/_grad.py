"""``tx.value_and_grad`` / ``tx.grad``: derivatives taken inside a stateful
function that flow through its states.

``jax.grad`` inside an uncurried function differentiates the program before
``uncurry`` threads the states, so a value read back after a ``set_state``
of a differentiated value has derivative zero with respect to it. These
differentiate the function's own pure version instead (its states threaded
first), with the states' current values held constant, and then write back
the states the function set: values, states and derivatives are those of
eager Python with a dict.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax

from ._dicts import lookup, nest
from ._initial import initial_states
from ._ops import read, write
from ._scope import current_scope
from ._uncurry import nest_states, pure_of, state_of, traced_per_signature


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                   holomorphic: bool = False, allow_int: bool = False) -> Callable:
    """``jax.value_and_grad`` of a function that uses states, with the
    derivative flowing through them.

    Called where states are threaded (inside ``uncurry``'s function, or any
    taxpr transformation that threads them), ``fun`` reads the states as
    they stand at the call and leaves them as it set them, as under
    ``jax.value_and_grad``; unlike there, a value ``fun`` reads back after
    setting it from the differentiated arguments carries its derivative (an
    RNN keeping its hidden state in a state is differentiated through
    time). The states' values before the call are constants: the derivative
    is with respect to ``argnums`` only. Outside every transformation the
    states start at their inits and what ``fun`` sets is lost, as for
    ``get_state`` / ``set_state`` there.

    ``fun`` is differentiated as ``pure`` is from outside (custom derivative
    rules run in the function's place with the states threaded; see the
    state docs). A state only a ``custom_vjp`` bwd sets (a logged gradient
    norm) is set where the backward pass runs, inside a transformation that
    threads states; outside every transformation it is an error naming it.

    Arguments:
        fun: a function that may use ``get_state`` / ``set_state``,
            ``next_key`` and ``sow``; array leaves of its arguments are
            traced, other leaves are static.
        argnums, has_aux, holomorphic, allow_int: as for
            ``jax.value_and_grad``.

    Returns:
        A function with ``fun``'s arguments returning ``(value, grads)``, or
        ``((value, aux), grads)`` with ``has_aux``.
    """
    traced_by_scope: dict[tuple[str, ...], Callable] = {}

    def traced_here() -> Callable:
        # State names depend on the tx.scope the call is in: one trace per scope.
        scope = current_scope()
        traced = traced_by_scope.get(scope)
        if traced is None:
            traced = traced_by_scope[scope] = traced_per_signature(fun)
        return traced

    @functools.wraps(fun)
    def value_and_grad_fun(*args, **kwargs):
        traced = traced_here()
        t, leaves = traced(args, kwargs)
        if not t.states:
            return jax.value_and_grad(fun, argnums, has_aux, holomorphic, allow_int)(
                *args, **kwargs)
        initial = nest_states(initial_states(t.closed, t.states, leaves), t.states)
        by_state: dict[str, list] = {}
        for name, info in t.states.items():
            by_state.setdefault(state_of(name), []).append(info)
        # The states' values now; also of a state fun only sets: where it
        # does not set it (a branch not taken), the value passes through.
        current = nest({name: read(name, lookup(initial, name)) for name in by_state})
        pure = pure_of(traced)

        def with_states_as_aux(*a, **kw):
            out, new_state = pure(current, *a, **kw)
            if has_aux:
                value, aux = out
                return value, (aux, new_state)
            return out, new_state

        (value, aux_and_state), grads = jax.value_and_grad(
            with_states_as_aux, argnums, has_aux=True, holomorphic=holomorphic,
            allow_int=allow_int)(*args, **kwargs)
        aux, new_state = aux_and_state if has_aux else (None, aux_and_state)
        for name, infos in by_state.items():
            # Written by fun, or by a custom rule that ran in its place (the
            # trace above, undifferentiated, runs no rule): a state passed
            # through unchanged comes back as the value read.
            new = lookup(new_state, name)
            if any(info.written for info in infos) or any(
                    a is not b for a, b in zip(jax.tree_util.tree_leaves(new),
                                               jax.tree_util.tree_leaves(lookup(current, name)))):
                write(name, new)
        return ((value, aux) if has_aux else value), grads

    return value_and_grad_fun


def grad(fun: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False,
         holomorphic: bool = False, allow_int: bool = False) -> Callable:
    """``jax.grad`` of a function that uses states, with the derivative
    flowing through them: ``value_and_grad`` without the value.

    Arguments:
        fun, argnums, has_aux, holomorphic, allow_int: as for
            ``value_and_grad``.

    Returns:
        A function with ``fun``'s arguments returning ``grads``, or
        ``(grads, aux)`` with ``has_aux``.
    """
    vg = value_and_grad(fun, argnums, has_aux, holomorphic, allow_int)

    @functools.wraps(fun)
    def grad_fun(*args, **kwargs):
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return grad_fun

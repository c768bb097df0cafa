"""``bounded_while_loop``: a while loop with a bound on its steps that
reverse-mode differentiates, also through the states its body sets.

``jax.lax.while_loop`` has no reverse-mode derivative. equinox's
``while_loop(..., kind="checkpointed")`` (brainstate's ``bounded_while_loop``
is adapted from it) differentiates its outputs through a ``custom_vjp``,
whose backward pass gives no derivative of a state the body sets. This loop
is a ``lax.scan`` of ``max_steps`` steps, each a ``lax.cond`` on the
predicate around the body under ``jax.checkpoint``: JAX differentiates it
as it is, so the states threaded through it are differentiated like its
carry, and the backward pass keeps one carry per step.
"""

from __future__ import annotations

from typing import Any, Callable

import jax


def bounded_while_loop(cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any],
                       init_val: Any, *, max_steps: int, checkpoint: bool = True) -> Any:
    """``jax.lax.while_loop`` run for at most ``max_steps`` steps, reverse-mode
    differentiable.

    Arguments:
        cond_fun: ``carry -> bool`` scalar; the loop stops at the first
            ``False``.
        body_fun: ``carry -> carry``; it may use ``get_state`` /
            ``set_state`` / ``next_key``: only the steps the predicate lets
            run apply them.
        init_val: the initial carry (a pytree of arrays).
        max_steps: the bound; the loop runs ``max_steps`` scan steps, those
            after the predicate turned false leaving the carry unchanged.
        checkpoint: recompute each step's body in the backward pass instead
            of storing its intermediates (``jax.checkpoint``), keeping one
            carry per step.

    Returns:
        The final carry: that of ``jax.lax.while_loop(cond_fun, body_fun,
        init_val)`` if it stops within ``max_steps`` steps, else the carry
        after ``max_steps`` steps.
    """
    body = jax.checkpoint(body_fun) if checkpoint else body_fun

    def step(carry, _):
        return jax.lax.cond(cond_fun(carry), body, lambda c: c, carry), None

    return jax.lax.scan(step, init_val, None, length=int(max_steps))[0]

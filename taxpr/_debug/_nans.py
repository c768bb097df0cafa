"""``tx.debug_nans``: where a NaN (or an infinity) was born.

The wrapped function runs as it would (compiled, under the caller's
transformations) with one check added: whether an output (and, when it is
differentiated, a gradient) holds a non-finite value. Only then does the
host run the program again, eagerly and equation by equation (``_eager``),
on the inputs of the failing call (of the failing ``vmap`` example), to
find the equation where the value was born.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ._eager import Origin, Run, run_closed, trace_on_cpu
from .._calls import Signature
from .._host import collecting, deliver, notify


class NonFiniteError(FloatingPointError):
    """A NaN (or, with ``inf=True``, an infinity) reached an output of a
    function wrapped by ``tx.debug_nans``, or its gradient.

    Attributes:
        kind: ``"NaN"`` or ``"inf"``.
        primitive: the primitive of the equation where it was born (``"log"``),
            or ``"input i"`` when the function was given it.
        source: the user's line that bound that equation
            (``"model.py:42, in Block.__call__"``), or None.
        path: the enclosing primitives, outermost first
            (``("jit[loss]", "scan[length=12]", "cond[branch=1]")``).
        iterations: ``((loop kind, index), ...)``: the iteration of each
            enclosing loop, outermost first; in a ``shard_map``,
            ``("shard", k)``: the ``k``-th device of its mesh
            (``mesh.devices.flat``).
        example: the index of the example along the innermost ``jax.vmap``
            around the wrapped function, or None.
        phase: ``"forward"`` or ``"backward"`` (reverse mode's transposed
            program).
        inputs: the equation's inputs, described.
        origin: all of the above as a ``taxpr.Origin``, or None when the
            eager run computed no non-finite value (compiled numerics
            differ from eager ones).
    """

    def __init__(self, message: str, origin: Origin | None, example: int | None):
        super().__init__(message)
        self.origin = origin
        self.example = example
        self.kind = origin.kind if origin else None
        self.primitive = origin.primitive if origin else None
        self.source = origin.source if origin else None
        self.path = origin.path if origin else ()
        self.iterations = origin.iterations if origin else ()
        self.phase = origin.phase if origin else None
        self.inputs = origin.inputs if origin else ()


def _message(name: str, origin: Origin | None, example: int | None, phase: str) -> str:
    where = f" (vmap example {example})" if example is not None else ""
    if origin is None:
        return (f"taxpr.debug_nans: {name} computed a non-finite value in its {phase} pass"
                f"{where}, but running it again eagerly computed only finite values (compiled "
                f"numerics differ from eager ones); try jax.config.update('jax_debug_nans', True)")
    parts = [f"{origin.kind} produced by `{origin.primitive}`"
             + (f" at {origin.source}" if origin.source else ""),
             f"{origin.phase} pass"]
    if origin.path:
        parts.append("path " + " / ".join(origin.path))
    for loop, i in origin.iterations:
        parts.append(f"shard {i}" if loop == "shard" else f"{loop} iteration {i}")
    if example is not None:
        parts.append(f"vmap example {example}")
    text = f"taxpr.debug_nans: in {name}: " + ", ".join(parts)
    if origin.inputs:
        text += "; inputs: " + ", ".join(origin.inputs)
    return text


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _finite_flag(leaves, inf: bool) -> Any:
    """Whether any floating leaf holds a NaN (``inf``: or an infinity).
    ``sum(x * 0)`` is NaN exactly when ``x`` holds a NaN or an infinity,
    and never overflows: one fused reduction per leaf, cheaper than
    ``any(~isfinite(x))``."""
    leaves = [x for x in leaves if _is_float(x)]
    if not leaves:
        return jnp.bool_(False)
    if inf:
        return functools.reduce(jnp.logical_or, [jnp.isnan(jnp.sum(x * 0)) for x in leaves])
    return functools.reduce(jnp.logical_or, [jnp.any(jnp.isnan(x)) for x in leaves])


def debug_nans(fn: Callable, *, inf: bool = True, backward: bool = True) -> Callable:
    """``fn`` checked for non-finite values, reporting where one was born.

    The wrapped function returns what ``fn`` returns, bit for bit, when
    every floating output is finite. Otherwise it raises a
    ``NonFiniteError`` naming the equation where the value was born: the
    first equation (in program order; in a loop, the first iteration)
    whose inputs are finite and whose output is not, among those whose
    non-finite values reach a non-finite output. A NaN that a
    ``jnp.where`` masks away, or that an untaken branch computes, is not
    reported.

    Arguments:
        fn: the function (any pytrees in and out).
        inf: report infinities too (an ``exp`` overflow), not only NaNs.
        backward: when the wrapped function is differentiated in reverse
            mode (``jax.grad``), check the gradient too and report where
            a non-finite value in it was born in the backward pass. The
            wrapped function is then a ``custom_vjp``: forward mode
            (``jax.jvp``) needs ``backward=False``.

    Returns:
        The wrapped function. Called with concrete values (also inside a
        ``jax.vmap`` or ``jax.grad`` run eagerly, backward pass included),
        it waits for its outputs and raises the ``NonFiniteError`` itself;
        inside ``jax.jit``, the error is raised by a host callback, which
        JAX reports as its runtime error with the ``NonFiniteError``'s
        message. Under ``vmap`` the first failing example is named.
    """
    name = getattr(fn, "__name__", repr(fn))
    programs: dict = {}

    def traced(key_parts, flat_fn, values):
        """``flat_fn`` traced at the types of ``values`` (on the CPU: the
        host may be inside a callback of a program holding the
        accelerator)."""
        key = (*key_parts, tuple((np.shape(v), np.asarray(v).dtype) for v in values))
        if key not in programs:
            programs[key] = trace_on_cpu(flat_fn, values)
        return programs[key]

    def report(closed, values, phase, example):
        outs = run_closed(closed, values, Run(inf))
        origins = [v.origin for v in outs if v.origin is not None]
        origin = min(origins, key=lambda o: o.order) if origins else None
        deliver(NonFiniteError(_message(name, origin, example, phase), origin, example))

    def diagnose(sig, values, example):
        closed = traced((sig, "forward"),
                        lambda *flat: jax.tree_util.tree_leaves(sig.call(fn, flat)),
                        values)
        report(closed, values, "forward", example)

    def diagnose_backward(sig, wrt, values, example):
        n = sig.num_dynamic

        def vjp_flat(*flat):
            return _pullback(fn, sig, wrt, flat[:n], flat[n:])

        closed = traced((sig, "backward", wrt), vjp_flat, values)
        report(closed, values, "backward", example)

    def forward_body(sig, *flat):
        out = sig.call(fn, flat)
        flag = _finite_flag(jax.tree_util.tree_leaves(out), inf)
        notify(flag, flat, functools.partial(diagnose, sig))
        return out

    def backward_body(sig, wrt, flat, ct_leaves):
        grads = _pullback(fn, sig, wrt, flat, ct_leaves)
        flag = jnp.logical_and(_finite_flag(grads, inf),
                               jnp.logical_not(_finite_flag(ct_leaves, inf)))
        notify(flag, [*flat, *ct_leaves], functools.partial(diagnose_backward, sig, wrt))
        return grads

    forwards: dict = {}
    backwards: dict = {}

    def forward(sig, flat):
        if sig not in forwards:
            forwards[sig] = jax.jit(functools.partial(forward_body, sig))
        return forwards[sig](*flat)

    def checked_call(sig, flat):
        if not backward:
            return forward(sig, flat)

        @jax.custom_vjp
        def call(*flat):
            return forward(sig, flat)

        # Symbolic zeros: the inputs JAX differentiates are known, so only
        # their gradients are computed and checked (an input not asked for
        # may have an infinite derivative nobody uses).
        def fwd(*primals):
            flat = [p.value for p in primals]
            wrt = _Static(tuple(i for i, p in enumerate(primals) if p.perturbed))
            return forward(sig, flat), (flat, wrt)

        def bwd(residuals, ct):
            flat, wrt = residuals
            ct_leaves = [_instantiate(c, o) for c, o in
                         zip(jax.tree_util.tree_leaves(ct), _out_avals(fn, sig, flat))]
            key = (sig, wrt.value)
            if key not in backwards:
                backwards[key] = jax.jit(functools.partial(backward_body, sig, wrt.value))
            # The backward pass of a jax.grad run eagerly reaches here with
            # values: its error is raised here, cleanly, as the call's.
            grads = _raising_collected(backwards[key], flat, ct_leaves)
            by_input = dict(zip(wrt.value, grads))
            return tuple(by_input.get(i) for i in range(len(flat)))

        call.defvjp(fwd, bwd, symbolic_zeros=True)
        return call(*flat)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        sig, dynamic = Signature.of(args, kwargs)
        # Run eagerly (not under an outer jit), the call's callbacks run
        # before it returns: their error is raised here, cleanly.
        return _raising_collected(lambda *d: checked_call(sig, d), *dynamic)

    return wrapped


@jax.tree_util.register_static
class _Static:
    """A static value among a custom_vjp's residuals."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Static) and other.value == self.value

    def __hash__(self):
        return hash(self.value)


def _raising_collected(fn: Callable, *args) -> Any:
    """``fn(*args)``, raising the first error its host callbacks found while
    it ran (those that run later, in a compiled program, raise from their
    callback)."""
    with collecting() as found:
        out = fn(*args)
        jax.effects_barrier()
    if found:
        raise found[0]
    return out


def _out_avals(fn: Callable, sig: Signature, flat) -> list:
    return jax.tree_util.tree_leaves(jax.eval_shape(lambda *p: sig.call(fn, p), *flat))


def _instantiate(ct: Any, aval: Any) -> Any:
    """A symbolic zero cotangent as zeros."""
    if ct is None or type(ct).__name__ == "SymbolicZero":
        return jnp.zeros(aval.shape, aval.dtype)
    return ct


def _pullback(fn: Callable, sig: Signature, wrt: tuple[int, ...], flat, ct_leaves) -> list:
    """The gradients of ``fn`` w.r.t. the flat inputs ``wrt``, for the
    output cotangents ``ct_leaves``."""
    flat = list(flat)

    def of_wrt(*xs):
        args = list(flat)
        for i, x in zip(wrt, xs):
            args[i] = x
        return sig.call(fn, args)

    out, pullback = jax.vjp(of_wrt, *[flat[i] for i in wrt])
    tree = jax.tree_util.tree_structure(out)
    return list(pullback(jax.tree_util.tree_unflatten(tree, list(ct_leaves))))

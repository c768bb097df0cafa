"""The transformations: ``reap``, ``call_and_reap``, ``plant``, ``harvest``
and ``perturb``, each a ``run_harvest`` with its spec."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable

from ._run import HarvestSpec, run_harvest


_TRANSFORM_ARGS = """
    Arguments:
        f: the function to transform (any JAX-traceable function; raw
            ``scan`` / ``while_loop`` / ``cond`` / ``jit`` / ``shard_map`` /
            custom derivatives inside are handled).
        tag: only sows with this ``tag`` are transformed.
        allowlist: if given, only sows with these names (or nest scopes) are
            transformed.
        blocklist: sows with these names (or nest scopes) are left alone.
        exclusive: also remove the sows this call does not transform (of any
            tag), so enclosing harvests see none of them.
        strict: raise if a name in ``allowlist`` / ``blocklist``{plants} matches
            no sow of ``tag`` (a typo); oryx, and the default, return normally."""


def _wraps_taking_plants(f: Callable, first: str = "plants") -> Callable:
    """``functools.wraps(f)`` for a wrapper that takes ``plants`` (or
    ``first``) before ``f``'s arguments: its signature (what
    ``inspect.signature`` and so ``eqx.filter_jit`` read) is ``f``'s with
    it in front."""
    def decorate(wrapper: Callable) -> Callable:
        wrapper = functools.wraps(f)(wrapper)
        del wrapper.__wrapped__  # else inspect.signature follows it to f
        try:
            sig = inspect.signature(f)
        except (TypeError, ValueError):  # no signature (a builtin): the wrapper's own
            return wrapper
        params = list(sig.parameters.values())
        name = first
        while name in sig.parameters:  # f has an argument of that name
            name = "_" + name
        params.insert(0, inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY))
        wrapper.__signature__ = sig.replace(parameters=params)
        return wrapper
    return decorate


def call_and_reap(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
                  blocklist: Iterable = frozenset(), exclusive: bool = False,
                  strict: bool = False) -> Callable:
    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        return run_harvest(f, HarvestSpec(tag, allowlist, blocklist, exclusive, strict, reaps=True),
                    {}, args, kwargs)

    return wrapped

call_and_reap.__doc__ = """Run ``f`` and collect the values it sows with ``tag``.

    ``call_and_reap(f, tag=t)(*args, **kwargs) -> (out, reaps)``: ``out`` is
    ``f(*args, **kwargs)``; ``reaps`` maps each sow's name to its value:
    ``strict`` / ``clobber``: the (last) sown value; ``cond_clobber``: the last
    value whose predicate was true (zeros if none); ``append``: the values
    stacked along a new leading axis (inside ``scan``: one row per
    iteration). Names under ``nest`` scopes come back nested:
    ``{scope: {name: value}}``. Reaped sows are removed from the result.
""" + _TRANSFORM_ARGS.format(plants="") + """

    Returns:
        ``wrapped(*args, **kwargs) -> (out, reaps)``.

    Raises:
        ValueError: oryx's errors (a strict sow twice, strict mode in ``scan``,
            non-clobber mode in ``while_loop``, ``cond`` branches that sow
            differently), a value that differs across ``shard_map`` shards,
            ``strict=True`` and an unmatched name.

    Example:
        >>> def f(x):
        ...     y = sow(x * 2, tag="t", name="y")
        ...     return y + 1
        >>> call_and_reap(f, tag="t")(1.0)  # (3.0, {"y": 2.0})
"""


def reap(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
         blocklist: Iterable = frozenset(), exclusive: bool = False,
         strict: bool = False) -> Callable:
    car = call_and_reap(f, tag=tag, allowlist=allowlist, blocklist=blocklist,
                        exclusive=exclusive, strict=strict)

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        return car(*args, **kwargs)[1]

    return wrapped

reap.__doc__ = """The values ``f`` sows with ``tag`` (``call_and_reap`` without ``out``).
""" + _TRANSFORM_ARGS.format(plants="") + """

    Returns:
        ``wrapped(*args, **kwargs) -> reaps``, a dict name -> value (see
        ``call_and_reap``).

    Raises:
        ValueError: as ``call_and_reap``.

    Example:
        >>> reap(lambda x: sow(x * 2, tag="t", name="y") + 1, tag="t")(1.0)  # {"y": 2.0}
"""


def plant(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
          blocklist: Iterable = frozenset(), exclusive: bool = False,
          strict: bool = False) -> Callable:
    @_wraps_taking_plants(f)
    def wrapped(plants, *args, **kwargs):
        return run_harvest(f, HarvestSpec(tag, allowlist, blocklist, exclusive, strict, reaps=False),
                    plants, args, kwargs)[0]

    return wrapped


_PLANTS_DOC = """
    Planted values: a non-``append`` sow takes ``plants[name]`` everywhere it
    runs; an ``append`` sow's plant is a stack with one row per time it runs
    (inside ``scan``: one per iteration); ``rows({i: value})`` replaces only
    some rows. Names under ``nest`` scopes are read from ``plants[scope]``.
    A planted value must have the sow's shape and dtype, with JAX's weak-type
    promotion: a weakly typed value (a Python scalar) is converted to the
    sow's dtype when promotion with it gives that dtype (``2.0`` into a
    ``float16`` sow); a sow of a Python scalar takes the planted value's type
    when promotion gives the planted dtype (``15.0`` into ``sow(717)``, the
    program is traced again so later arithmetic promotes as it would with
    ``15.0`` written there). Names with no plant keep their sown value, and
    stay sows for an enclosing harvest. Planted values have derivative zero
    with respect to the sown value and their own derivative flows through.
"""

plant.__doc__ = """``f`` with the values sown with ``tag`` replaced by planted ones.
""" + _PLANTS_DOC + _TRANSFORM_ARGS.format(plants=", or a key of ``plants``") + """

    Returns:
        ``wrapped(plants, *args, **kwargs) -> out``.

    Raises:
        ValueError: a planted value of the wrong structure, shape or dtype
            (naming the sow and where it is), the static errors of
            ``call_and_reap`` for the planted names, ``cond`` branches that
            sow differently, ``strict=True`` and an unmatched name.

    Example:
        >>> f = lambda x: sow(x * 2, tag="t", name="y") + 1
        >>> plant(f, tag="t")({"y": 10.0}, 1.0)  # 11.0
"""


def harvest(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
            blocklist: Iterable = frozenset(), exclusive: bool = False,
            strict: bool = False) -> Callable:
    @_wraps_taking_plants(f)
    def wrapped(plants, *args, **kwargs):
        return run_harvest(f, HarvestSpec(tag, allowlist, blocklist, exclusive, strict, reaps=True),
                    plants, args, kwargs)

    return wrapped

harvest.__doc__ = """``plant`` and ``call_and_reap`` in one: plant some names, reap the others.
""" + _PLANTS_DOC + _TRANSFORM_ARGS.format(plants=", or a key of ``plants``") + """

    Returns:
        ``wrapped(plants, *args, **kwargs) -> (out, reaps)``; planted names
        are not reaped.

    Raises:
        ValueError: as ``plant`` and ``call_and_reap``.

    Example:
        >>> def f(x):
        ...     return sow(x, tag="t", name="a") + sow(x * 2, tag="t", name="b")
        >>> harvest(f, tag="t")({"a": 5.0}, 1.0)  # (7.0, {"b": 2.0})
"""


def perturb(f: Callable, *, tag: Any, allowlist: Iterable | None = None,
            blocklist: Iterable = frozenset(), exclusive: bool = False,
            strict: bool = False) -> Callable:
    @_wraps_taking_plants(f, "perturbations")
    def wrapped(perturbations, *args, **kwargs):
        spec = HarvestSpec(tag, allowlist, blocklist, exclusive, strict, reaps=False,
                            perturb=True)
        return run_harvest(f, spec, perturbations, args, kwargs)[0]

    return wrapped

perturb.__doc__ = """``f`` with ``perturbations[name]`` added to the values sown with ``tag``.

    The gradient of the output with respect to a sown value (an activation,
    a residual stream) is the gradient with respect to its perturbation at
    zero, in the same backward pass as the gradients of ``f``'s arguments
    (as flax's ``perturb``, with no change to the model's code)::

        zeros = jax.tree.map(jnp.zeros_like, reap(loss, tag="act")(x))
        d_acts, d_x = jax.grad(perturb(loss, tag="act"), argnums=(0, 1))(zeros, x)

    A perturbation has the structure, shape and dtype of the sown value
    (JAX's weak-type promotion as for ``plant``); an ``append`` sow's is a
    stack with one row per time it runs (inside ``scan``: one per
    iteration), each row added to that run's value. Names with no
    perturbation are left alone, and stay sows for an enclosing harvest.
    Unlike a planted value, the sown value keeps its derivative.
""" + _TRANSFORM_ARGS.format(plants=", or a key of ``perturbations``") + """

    Returns:
        ``wrapped(perturbations, *args, **kwargs) -> out``.

    Raises:
        ValueError: as ``plant`` (a perturbation of the wrong structure,
            shape or dtype names the sow), or ``rows(...)`` as a perturbation.

    Example:
        >>> f = lambda x: sow(x * 2, tag="t", name="y") ** 2
        >>> jax.grad(perturb(f, tag="t"))({"y": 0.0}, 1.0)  # {"y": 4.0}
"""

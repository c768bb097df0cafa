"""What taxpr knows of the libraries its users build on, in one place.

The core is written against JAX alone; where a library does something JAX
does not (equinox's primitives and its ``filter_jit`` split of arguments,
flax's analysis traces of a scanned body), the knowledge is here, named for
the library, and the core asks for it:

* equinox: the primitives that reduce a predicate over a ``vmap`` batch
  (``_per_example`` registers them), the implementation its primitives are
  lowered with (``_expand``), the split of a call's arguments into traced
  arrays and static leaves (``_inject``);
* flax: the trace ``nn.scan`` makes of its body to find loop-invariant
  variables (tags there stay plain: ``primitives._tag``), and what its
  dead-code analysis raises when a kept tag makes a broadcast variable look
  carry-dependent (``_inject`` explains it).

A library that is not installed costs nothing: each check first looks
whether the library's module is already imported.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator

import equinox as eqx

from ._jax.internals import core

# ---- equinox --------------------------------------------------------------------


def equinox_over_batch_primitives() -> list[core.Primitive]:
    """equinox's primitives whose boolean output is true where their operand
    is for some example of a vmap batch (its loops run while any example
    runs): ``unvmap_any`` and the ``nonbatchable`` check around it."""
    try:
        from equinox._unvmap import unvmap_any_p
        from equinox.internal._nontraceable import nonbatchable_p
    except ImportError:  # another equinox layout: its loops are then not masked
        return []
    return [unvmap_any_p, nonbatchable_p]


def lowering_implementation(prim: core.Primitive) -> Callable:
    """The function JAX lowers ``prim`` with: equinox lowers its vprims with
    an implementation it keeps apart from the eager one (which only adds a
    check for leaked tracers); any other primitive's is ``prim.impl``."""
    vprims = sys.modules.get("equinox.internal._primitive")
    impl = getattr(vprims, "_vprim_impl_registry", {}).get(prim) if vprims else None
    return impl if impl is not None else prim.impl


def is_traced_leaf(x: Any) -> bool:
    """Whether ``equinox.filter_jit`` traces leaf ``x`` (an array)."""
    return eqx.is_array(x)


def filter_partition(tree: Any, traced: Callable[[Any], bool]) -> tuple[Any, Any]:
    """``tree`` split as ``equinox.filter_jit`` splits a call's arguments:
    ``(traced leaves, static rest)``, each a copy of ``tree`` with None for
    the other part's leaves."""
    return eqx.partition(tree, traced)


def filter_combine(dyn: Any, static: Any) -> Any:
    """The tree ``filter_partition`` split, again."""
    return eqx.combine(dyn, static)


# ---- flax -----------------------------------------------------------------------

# Traces a library makes to analyse a body: flax's ``nn.scan`` traces its
# body once more (as "flax scan") to find which variables are
# loop-invariant, by dead-code elimination of that trace, and evaluates what
# is left for the broadcast outputs (effects included: a state access runs
# there, as a ``jax.debug.callback`` does); the loop's body is traced again
# for ``lax.scan``. A kept tag there would count as a use of the carry: tags
# there are plain (a sow is dropped with the value it sows).
_ANALYSIS_TRACES = frozenset({"flax scan"})


def in_analysis_trace() -> bool:
    """Whether JAX now traces for a library's analysis of a body (above)."""
    if "flax.core.axes_scan" not in sys.modules:  # the only one: no cost without it
        return False
    trace = core.trace_ctx.trace
    while trace is not None:
        frame = getattr(trace, "frame", None)
        info = getattr(frame, "debug_info", None)
        if getattr(info, "traced_for", None) in _ANALYSIS_TRACES:
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


# What flax's ``nn.scan`` raises when dead-code elimination of its body finds
# that a broadcast variable (e.g. the params of ``variable_broadcast=
# "params"``) depends on the carry.
_FLAX_BROADCAST_DEPENDENCY = "broadcasted variable has a data dependency on the scan body"


@contextlib.contextmanager
def explaining_kept_tag_dependencies() -> Iterator[None]:
    """Inside a taxpr transformation tags are kept alive (they are
    consumed), so an analysis that asks dead-code elimination which inputs a
    body needs sees a tag of a carry-derived value as a use of the carry:
    flax's error there, explained."""
    try:
        yield
    except ValueError as e:
        if _FLAX_BROADCAST_DEPENDENCY not in str(e):
            raise
        raise ValueError(
            f"{e} (taxpr: inside a taxpr transformation every tag is kept alive, since "
            f"it is consumed, and flax's nn.scan with variable_broadcast decides which "
            f"variables are loop-invariant by dead-code elimination of its body: a tag "
            f"of a value computed from the carry there counts as a use of the carry. "
            f"Outside taxpr's transformations the same model initialises and runs. Sow "
            f"or read state there with flax's own collections, or give the scanned "
            f"variables an axis (variable_axes) instead of broadcasting them)") from e

"""Selectors for ``taxpr.capture`` and ``taxpr.patch``.

A selector is a glob over site names (``"MLP/*/add"``), a predicate over
``taxpr.Site``, or one of these helpers, combined with ``&``, ``|`` and
``~``::

    tx.capture(fn, tx.select.scope("Block_*/attn") & tx.select.primitive("exp"))
    tx.capture(fn, tx.select.leaving("Block_*"))   # each block's outputs
"""

from ._capture._select import (
    Selector as Selector,
    dtype as dtype,
    leaving as leaving,
    name as name,
    primitive as primitive,
    scope as scope,
    shape as shape,
    source as source,
)

__all__ = ["Selector", "dtype", "leaving", "name", "primitive", "scope", "shape", "source"]

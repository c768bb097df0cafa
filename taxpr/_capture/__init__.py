"""Capture and patch the intermediates of code you did not write.

``sites(fn, *args)`` lists every value a traced program computes, named by
its scope (flax module paths, equinox modules, ``jax.named_scope``) and
primitive; ``capture`` returns the selected values, ``patch`` replaces them.
Both insert harvest sows (``taxpr.harvest``) at the selected equations of
the traced program, so values are threaded out of (and into) scan, cond,
while, jit, checkpoint, custom rules, vmap and shard_map by the engine.

Modules, each importing only those above it:

* ``_sites``: ``Site`` records, listed by one walk of the program;
* ``_select``: selectors (globs, predicates, ``taxpr.select`` helpers);
* ``_rewrite``: sows inserted after the selected equations;
* ``_api``: ``sites``, ``capture``, ``patch``, ``perturb``.
"""

from ._api import (
    LoopRows as LoopRows,
    capture as capture,
    patch as patch,
    perturb as perturb,
    sites as sites,
)
from ._rules import CustomRuleError as CustomRuleError
from ._sites import Loop as Loop, Site as Site

__all__ = ["CustomRuleError", "LoopRows", "Loop", "Site", "capture", "patch", "perturb", "sites"]

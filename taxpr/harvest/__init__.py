"""Harvest: oryx-compatible ``sow`` / ``reap`` / ``plant`` on the threading engine.

A drop-in replacement for ``oryx.core.interpreters.harvest``: same names,
signatures, semantics and error messages. Built on taxpr's engine:

* ``strict`` / ``clobber`` / ``cond_clobber`` reaps are carried values (ctx);
* ``append`` reaps are collected per site, stacked by ``scan`` along its axis;
* planted values of non-append sows are carried values, planted ``append``
  values are fed per site (``scan`` slices them along its axis).

Better than oryx: planted values are shape/dtype-checked (with JAX's
weak-type promotion); plant of an ``append`` sow inside a scan works, also
for selected rows only (``rows``); sows in ``shard_map`` work or raise a
clear error; ``strict=True`` catches misspelled names; errors never corrupt
JAX's trace state; cost grows linearly with nesting depth. Sows inside a
``custom_jvp`` rule or a ``custom_vjp`` fwd are threaded through it when
JAX differentiates the call (``_sites._HarvestRules``, the engine's
``RulePolicy`` with oryx's semantics).

Modules, each importing only those above it:

* ``_sow``: ``sow`` / ``sow_cond`` / ``nest`` and their dynamic scope;
* ``_checks``: which sows are selected, oryx's static checks;
* ``_sites``: the engine's site rule and hooks for sows;
* ``_plants``: planted values, checked against their sows; ``rows``;
* ``_run``: one harvest run (trace, find, thread);
* ``_transforms``: ``reap``, ``call_and_reap``, ``plant``, ``harvest``, ``perturb``.
"""

from ._plants import PlantRows as PlantRows, rows as rows
from ._sow import nest as nest, sow as sow, sow_cond as sow_cond, sow_p as sow_p
from ._transforms import (
    call_and_reap as call_and_reap,
    harvest as harvest,
    perturb as perturb,
    plant as plant,
    reap as reap,
)

__all__ = ["sow", "sow_cond", "reap", "call_and_reap", "plant", "harvest", "perturb", "nest",
           "rows", "PlantRows", "sow_p"]

"""JAX's private modules that taxpr uses, imported here and nowhere else
(besides ``taxpr._patches``, ``taxpr._compat`` and ``taxpr._jaxpr``, the
rest of the adapter layer).

Every name is JAX's own object, re-exported: ``internals.core.Var is
jax._src.core.Var``. Where the public API has the same object
(``jax.extend.core``), prefer it; these are what it lacks (tracers, avals,
the rule tables of partial evaluation and batching, effects, source
locations, shard_map's tracing context).
"""

from __future__ import annotations

import importlib
from typing import Any

from jax._src import callback
from jax._src import config
from jax._src import core
from jax._src import effects
from jax._src import source_info_util
from jax._src.debugging import debug_callback_p
from jax._src.interpreters import batching
from jax._src.interpreters import partial_eval as pe
from jax._src.lax import lax as lax_internal
from jax._src.lax import parallel
from jax._src.sharding_impls import UnspecifiedValue

__all__ = ["UnspecifiedValue", "batching", "callback", "config", "core", "debug_callback_p",
           "effects", "lax_internal", "parallel", "pe", "shard_map_internals",
           "source_info_util"]


def shard_map_internals() -> tuple[Any, Any]:
    """``(jax._src.shard_map, jax._src.mesh.use_abstract_mesh)``: what enters
    a shard_map body's tracing context (imported when first needed: only
    programs with a shard_map use them)."""
    sm = importlib.import_module("jax._src.shard_map")
    return sm, importlib.import_module("jax._src.mesh").use_abstract_mesh

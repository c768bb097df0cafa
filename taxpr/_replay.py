"""Tags of a custom_vjp bwd that recomputes its forward pass, differentiated
inside a traced function.

A bwd that runs the function again (``jax.vjp(f)`` in it, equinox's
checkpointed loops, diffrax's adjoints) binds the function's tags a second
time, after the forward pass: eagerly exact is that the recomputation sees
what the forward saw and its effects happen once. Tags are marked with the
custom_vjp call whose fwd or bwd binds them (``primitives._tag``:
``TagMeta.fwd_scopes``, ``TagMeta.replay_scope``); the engine threads a tag of a bwd (a
replay) so that

* what it writes to a ctx leaf that the call's forward pass wrote is not
  applied (the forward already did);
* what it reads of such a leaf, now changed, is marked with ``replay_read_p``
  (an identity): where the derivatives depend on such a read
  (``_dependence``), what the recomputation read depends on the order in
  which the bwd recomputes (a checkpointed loop restarts from saved steps),
  which taxpr cannot see, and threading raises an error naming the leaf;
* its other effects (a state only the bwd sets, a value only it sows) happen
  where the backward pass runs, in program order.
"""

from __future__ import annotations

import functools
from typing import Any

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _dependence, _jaxpr, _traverse
from .primitives._tag import meta

# ``replay_read(x, index=i, scope=k) -> x``: ctx leaf ``i`` as a replay in
# scope ``k`` read it (see the module docstring).
replay_read_p = Primitive("taxpr_replay_read")
replay_read_p.def_impl(lambda x, **_: x)
replay_read_p.def_abstract_eval(lambda aval, **_: aval)
ad.deflinear2(replay_read_p, lambda ct, _, **__: [ct])
batching.primitive_batchers[replay_read_p] = lambda args, dims, **_: (args[0], dims[0])
mlir.register_lowering(replay_read_p, lambda ctx, x, **_: [x])


@functools.lru_cache(maxsize=1024)
def replay_read(aval: Any, index: int, scope: int) -> Any:
    """A closed jaxpr ``x -> replay_read(x)`` at ``aval`` (for inlining)."""
    return _jaxpr.trace_flat(
        lambda x: [replay_read_p.bind(x, index=index, scope=scope)], [aval])


def holds_replay_read(eqns) -> bool:
    return any(e.primitive is replay_read_p for e in eqns)


def _replayed_tag(eqn) -> bool:
    return meta(eqn.params).replay_scope is not None


def live_replay_read(closed: Any) -> tuple[int, tuple[str, ...]] | None:
    """``(leaf index, path)`` of a replay read that the outputs of
    ``closed`` (or an effect in it) depend on, or None. Tags of a replay
    left for another layer do not count as uses: that layer drops them or
    checks the reads that reach them itself."""
    n_in = len(_jaxpr.jaxpr_parts(closed).invars)
    for eqn, path in _traverse.iter_eqns(closed):
        if eqn.primitive is not replay_read_p:
            continue
        dep = _dependence.dependence(closed, [False] * n_in, source=lambda e: e is eqn,
                                     not_a_sink=_replayed_tag)
        if any(dep.outputs) or dep.reaches_effect:
            return eqn.params["index"], path
    return None

"""Every change taxpr makes to JAX's own rules and functions, in one place.

``import taxpr`` calls ``install()`` once. taxpr's own primitives (tags,
``taxpr_key``, replay reads) register their rules where they are defined;
what is listed here replaces or wraps something JAX defines for its own
primitives. Each replacement falls through to JAX's original whenever the
program holds no tag, so a tag-free program traces to the same jaxpr and
lowers to the same StableHLO with and without taxpr
(``tests/test_leaves_jax_as_found.py`` checks it in two processes).

| What is replaced | By | Why | What taxpr relies on |
|---|---|---|---|
| batching rule of ``cond`` | ``_guards._cond_batching_rule`` | a batched index runs every branch for every example: tags there get a per-example guard | JAX's rule for a cond without tags, or with an unbatched index |
| batching rule of ``while`` | ``_guards._while_batching_rule`` | a batched predicate runs the body while any example runs: tags there get a guard (also equinox's loops, which reduce the predicate over the batch) | JAX's rule otherwise |
| partial-eval rule of ``cond`` (``JaxprTrace``) | ``primitives._tag._cond_partial_eval`` | a ``cond`` whose branches hold kept tags is staged whole (JAX dropped a staged cond without used outputs, and a ``set_state`` with it) | JAX's rule otherwise |
| partial-eval rule of ``while`` (``JaxprTrace``, around the staging scope below) | ``primitives._tag._while_partial_eval`` | while a loop is split, a ``while`` of known inputs holding kept tags is staged whole (not hoisted out of a scan) | JAX's rule otherwise |
| partial-eval rule of ``checkpoint`` | ``primitives._tag._remat_partial_eval`` | while a loop is split, a checkpoint holding kept tags is staged whole (not hoisted out of a scan, not run by both parts of a while) | JAX's rule otherwise |
| ``partial_eval_jaxpr_custom`` rule of ``while`` (``checkpoint``'s partial evaluation, a scan's) | ``primitives._tag._while_partial_eval_custom`` | a ``while`` holding kept tags is staged whole: JAX's rule runs a known loop and then the whole loop again (the tags twice), and fails on a kept tag whose known output feeds the carry | JAX's rule otherwise |
| partial-eval rules of ``while`` and ``scan``; ``loops._scan_known_hoisting`` | the same rule in a staging scope (``_in_staging_scope``) | inside them, kept tags with known inputs are staged: eager runs them once per step | the rules themselves, unchanged |
| ``ad.linearize_from_jvp`` | the same function in a scope that evaluates known kept tags | a custom_jvp rule under ``grad`` must keep its primal outputs known | the function itself, unchanged |
| ``JaxprTrace.process_custom_jvp_call`` / ``process_custom_vjp_call`` | ``_unhoisted_custom_call`` | while a loop is split, a custom function holding kept tags stays in the loop | the methods themselves, unchanged |
| ``pe._memoize`` (the thunk that traces a staged custom rule once) | one memoized thunk per taxpr scope (``install_custom_vjp_scopes``) | a staged custom_vjp fwd / custom_jvp rule differentiated again in another scope (equinox's checkpointed loop: speculatively, then in its bwd) is traced again there, as JAX's trace caches do per trace context | ``_memoize`` itself, unchanged |
| ``bind_with_trace`` of ``custom_jvp_call`` / ``custom_vjp_call`` | the same method with the rules (jvp; fwd and bwd) run in the ``tx.scope`` of the call (``_state._scope.rules_in_call_scope``) | JAX traces a rule when it differentiates, outside the scope: its states must have the function's names | the method itself, unchanged; outside scopes and taxpr's transformations the rules are not wrapped |
| ``JVPTrace`` / ``LinearizeTrace.process_custom_vjp_call`` | the same method with the fwd and bwd run in a new scope (``primitives._tag._scoped_fwd_bwd``) | inside a taxpr transformation, tags in a fwd are the forward pass's and those in a bwd's recomputation replay it (not applied twice) | the method itself, unchanged; outside taxpr's transformations the fwd and bwd are not wrapped |

Every wrapper is marked ``_taxpr_wrapped``, so installing twice (a reload)
wraps once.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable

from jax._src.interpreters import ad as _ad
from jax._src.interpreters import partial_eval as pe

from . import _compat, _jaxpr

def wrap_batching_rule(prim: Any, wrapper: Callable) -> None:
    """Replace ``prim``'s batching rule by ``wrapper(original, axis_data,
    args, dims, **params)``; ``original`` takes ``(axis_data, args, dims,
    **params)`` too."""
    from jax._src.interpreters import batching
    if hasattr(batching, "fancy_primitive_batchers") and prim in batching.fancy_primitive_batchers:
        _wrap_rule(batching.fancy_primitive_batchers, prim, wrapper)
        return
    raise NotImplementedError(  # a JAX without axis-data batching rules
        f"taxpr: cannot find the batching rule of {prim}")


def _wrap_rule(table: dict, prim: Any, wrapper: Callable) -> None:
    """Replace ``table[prim]`` by ``wrapper(original, *args, **kwargs)``
    (around a rule taxpr already wrapped with another wrapper, too; once
    per wrapper)."""
    original = table[prim]
    wrappers = getattr(original, "_taxpr_wrappers", frozenset())
    if wrapper.__qualname__ in wrappers:
        return
    rule = lambda *args, **kwargs: wrapper(original, *args, **kwargs)  # noqa: E731
    rule._taxpr_wrapped = True
    rule._taxpr_wrappers = wrappers | {wrapper.__qualname__}
    table[prim] = rule


def wrap_partial_eval_rule(prim: Any, wrapper: Callable) -> None:
    """Replace ``prim``'s partial-evaluation rule (``JaxprTrace``) by
    ``wrapper(original, trace, *tracers, **params)``."""
    _wrap_rule(pe.custom_partial_eval_rules, prim, wrapper)


def wrap_partial_eval_custom_rule(prim: Any, wrapper: Callable) -> None:
    """Replace ``prim``'s ``partial_eval_jaxpr_custom`` rule by
    ``wrapper(original, saveable, unks_in, inst_in, eqn)``."""
    _wrap_rule(pe.partial_eval_jaxpr_custom_rules, prim, wrapper)


# ---- where partial evaluation must stage kept tags whose inputs are known -----
#
# A kept tag whose inputs are all known is staged by taxpr's partial-evaluation
# rule where JAX would otherwise run it a different number of times than eager
# execution: a differentiated ``scan`` hoists loop-invariant work out of the
# loop (once instead of every step), a ``while`` runs its known part and then
# the whole loop again (twice). Where JAX linearizes a function from its JVP
# (``ad.linearize_from_jvp``: a custom_jvp rule under ``grad``, and primitives
# without a linearization rule), the primal outputs must stay known, so known
# kept tags are evaluated there (once, as eagerly). The innermost scope wins.

_STAGE_KNOWN_KEPT_TAGS = contextvars.ContextVar("taxpr_stage_known_kept_tags", default=True)


def staging_known_kept_tags() -> bool:
    """Whether partial evaluation now stages kept tags whose inputs are known."""
    return _STAGE_KNOWN_KEPT_TAGS.get()


# While JAX splits a loop into a known and a staged part (a differentiated
# scan's loop-invariant work hoisted out of it; a ``while`` whose known part
# runs before the whole loop runs again), a custom_jvp / custom_vjp call or a
# ``checkpoint`` whose inputs are all known, or a kept tag in a checkpoint
# (split by ``partial_eval_jaxpr_custom``, which consults no JaxprTrace rule),
# would land in the known part: once outside a scan, or twice for a while. One
# that holds kept tags is partially evaluated as unknown instead, so it stays
# in the loop.
_HOISTING = contextvars.ContextVar("taxpr_hoisting_loop_invariants", default=False)


def splitting_a_loop() -> bool:
    """Whether partial evaluation now splits a loop as above."""
    return _HOISTING.get()


def _in_staging_scope(stage: bool, fn: Callable, hoisting: bool | None = None) -> Callable:
    """``fn`` run with staging ``stage`` and hoisting ``hoisting`` (None:
    unchanged)."""
    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        token = _STAGE_KNOWN_KEPT_TAGS.set(stage)
        hoisting_token = None if hoisting is None else _HOISTING.set(hoisting)
        try:
            return fn(*args, **kwargs)
        finally:
            if hoisting_token is not None:
                _HOISTING.reset(hoisting_token)
            _STAGE_KNOWN_KEPT_TAGS.reset(token)
    scoped._taxpr_wrapped = True
    return scoped


def _unhoisted_custom_call(process: Callable, holds_kept_tags: Callable) -> Callable:
    def process_unhoisted(self, prim, fun, *subfuns_and_tracers, **params):
        *subfuns, tracers = subfuns_and_tracers
        tracers = [self.to_jaxpr_tracer(t) for t in tracers]
        if _HOISTING.get() and tracers and all(t.is_known() for t in tracers):
            called = _jaxpr.called_jaxpr(fun)
            # unseen: assume it holds tags (the call then stays in the loop)
            if called is None or holds_kept_tags(called.effects):
                tracers = [self.instantiate_const(t) for t in tracers]
        return process(self, prim, fun, *subfuns, tracers, **params)
    process_unhoisted._taxpr_wrapped = True
    return process_unhoisted


def install_known_kept_tag_scopes(holds_kept_tags: Callable[[Any], bool]) -> None:
    """Set the scopes above on JAX's functions and rules (once).
    ``holds_kept_tags(effects)`` says whether a jaxpr with these effects holds
    kept tags. Where ``linearize_from_jvp`` is missing, kept tags are always
    staged: loops stay right, and grad of a custom_jvp whose rule holds a tag
    fails loudly."""
    from jax._src.lax.control_flow import loops
    # scan's JaxprTrace rule hoists in ``_scan_known_hoisting`` (the body split
    # before it runs the known body every step: no staging needed there); its
    # partial_eval_jaxpr_custom rule traces with JaxprTrace only to hoist.
    hoisting = getattr(loops, "_scan_known_hoisting", None)
    scopes = [(pe.custom_partial_eval_rules, _compat.while_p, True),
              (pe.partial_eval_jaxpr_custom_rules, _compat.scan_p, True)]
    if hoisting is None:
        scopes.append((pe.custom_partial_eval_rules, _compat.scan_p, True))
    elif not getattr(hoisting, "_taxpr_wrapped", False):
        loops._scan_known_hoisting = _in_staging_scope(True, hoisting, hoisting=True)
    for registry, prim, hoists in scopes:
        if not getattr(registry[prim], "_taxpr_wrapped", False):
            registry[prim] = _in_staging_scope(True, registry[prim], hoisting=hoists)
    linearize_from_jvp = getattr(_ad, "linearize_from_jvp", None)
    if linearize_from_jvp is not None and not getattr(linearize_from_jvp, "_taxpr_wrapped", False):
        _ad.linearize_from_jvp = _in_staging_scope(False, linearize_from_jvp, hoisting=False)
    for name in ("process_custom_jvp_call", "process_custom_vjp_call"):
        process = getattr(pe.JaxprTrace, name)
        if not getattr(process, "_taxpr_wrapped", False):
            setattr(pe.JaxprTrace, name, _unhoisted_custom_call(process, holds_kept_tags))


def install_custom_vjp_scopes(scoped: Callable[[Any, Any, Any], tuple[Any, Any]],
                              current_scopes: Callable[[], Any]) -> None:
    """Let ``scoped(fun, fwd, bwd) -> (fwd, bwd)`` wrap the fwd and bwd
    (each a ``lu.WrappedFun``) of every custom_vjp that JAX differentiates
    while a function is traced (JVP and direct linearization; once).

    A custom_vjp call staged into a jaxpr keeps its fwd (and a custom_jvp call
    its rule) as a thunk that traces it once, on first use, whatever the trace
    context then (``pe._memoize``). A jaxpr holding the call can be
    differentiated again in another scope (equinox's checkpointed loop
    linearizes its body speculatively in the forward pass, then again in its
    bwd): the thunks remember one trace per ``current_scopes()`` value, as
    JAX's trace caches do per trace context."""
    memoize = pe._memoize
    if not getattr(memoize, "_taxpr_wrapped", False):
        def memoize_per_scope(fn):
            per_scope: dict[Any, Callable] = {}

            def memoized(*args):
                scope = current_scopes()
                thunk = per_scope.get(scope)
                if thunk is None:
                    thunk = per_scope[scope] = memoize(fn)
                return thunk(*args)
            return memoized

        memoize_per_scope._taxpr_wrapped = True
        pe._memoize = memoize_per_scope
    for cls in (_ad.JVPTrace, getattr(_ad, "LinearizeTrace", None)):
        process = getattr(cls, "process_custom_vjp_call", None)
        if process is None or getattr(process, "_taxpr_wrapped", False):
            continue

        def process_scoped(self, primitive, fun, fwd, bwd, tracers, /, *, _process=process,
                           **params):
            fwd, bwd = scoped(fun, fwd, bwd)
            return _process(self, primitive, fun, fwd, bwd, tracers, **params)

        process_scoped._taxpr_wrapped = True
        cls.process_custom_vjp_call = process_scoped


def install_rules_in_call_scope(wrap_rules: Callable[[tuple], tuple | None]) -> None:
    """Let ``wrap_rules(rules) -> rules or None`` wrap the derivative rules
    (the ``subfuns`` after the function: a custom_jvp's jvp, a custom_vjp's
    fwd and bwd) of every custom_jvp / custom_vjp call when it is bound."""
    for prim in (_compat.custom_jvp_call_p, _compat.custom_vjp_call_p):
        cls = type(prim)
        original = cls.bind_with_trace
        if getattr(original, "_taxpr_wrapped", False):
            continue

        def bind_with_trace(self, trace, args, *rest, _original=original):
            *avals, params = rest  # (JAX passes the avals before the params)
            fun, *rules = params["subfuns"]
            wrapped = wrap_rules(tuple(rules))
            if wrapped is not None:
                params = {**params, "subfuns": (fun, *wrapped)}
            return _original(self, trace, args, *avals, params)

        bind_with_trace._taxpr_wrapped = True
        cls.bind_with_trace = bind_with_trace


def install() -> None:
    """Make every replacement of the table above (once)."""
    from . import _guards
    from .primitives import _tag
    wrap_batching_rule(_compat.cond_p, _guards._cond_batching_rule)
    wrap_batching_rule(_compat.while_p, _guards._while_batching_rule)
    wrap_partial_eval_rule(_compat.cond_p, _tag._cond_partial_eval)
    wrap_partial_eval_rule(_compat.remat_p, _tag._remat_partial_eval)
    wrap_partial_eval_custom_rule(_compat.while_p, _tag._while_partial_eval_custom)
    install_known_kept_tag_scopes(_tag.holds_kept_tags)
    # Around the while rule's staging scope: it reads the enclosing one.
    wrap_partial_eval_rule(_compat.while_p, _tag._while_partial_eval)
    install_custom_vjp_scopes(_tag._scoped_fwd_bwd, _tag.current_scope_key)
    from ._state._scope import rules_in_call_scope
    install_rules_in_call_scope(rules_in_call_scope)

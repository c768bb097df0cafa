"""How taxpr puts its rules in place of JAX's: wrappers around JAX's rule
tables and methods, each marked ``_taxpr_wrapped`` so that installing twice
(a reload) wraps once."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching
from jax._src.interpreters import partial_eval as pe
from jax._src.lax.control_flow import loops

from .. import _compat, _jaxpr
from .._jax import flags


def expect_signature(fn: Any, what: str, positional: int, keywords: tuple[str, ...] = ()) -> None:
    """Check, before wrapping ``fn`` (JAX's ``what``), that it takes the
    arguments taxpr's wrapper passes it: at least ``positional`` arguments
    by position and the ``keywords`` by name. A JAX whose function changed
    is an ImportError naming it, never a wrapper that fails later inside
    JAX."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    params = list(sig.parameters.values())
    by_position = [q for q in params if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
    any_position = any(q.kind is q.VAR_POSITIONAL for q in params)
    any_keyword = any(q.kind is q.VAR_KEYWORD for q in params)
    missing = [k for k in keywords if k not in sig.parameters and not any_keyword]
    if (len(by_position) < positional and not any_position) or missing:
        raise ImportError(
            f"taxpr: JAX's {what} takes {sig}; taxpr wraps it passing {positional} arguments "
            f"by position" + (f" and {', '.join(keywords)} by name" if keywords else "")
            + ": this JAX version is not supported")


# What taxpr's wrappers pass the rules of JAX's tables they wrap.
_RULE_ARGUMENTS = {"batching": (3, ()), "partial_eval": (1, ()), "partial_eval_custom": (4, ())}


def wrap_batching_rule(prim: Any, wrapper: Callable) -> None:
    """Replace ``prim``'s batching rule by ``wrapper(original, axis_data,
    args, dims, **params)``; ``original`` takes ``(axis_data, args, dims,
    **params)`` too."""
    if hasattr(batching, "fancy_primitive_batchers") and prim in batching.fancy_primitive_batchers:
        _wrap_rule(batching.fancy_primitive_batchers, prim, wrapper, "batching")
        return
    raise NotImplementedError(  # a JAX without axis-data batching rules
        f"taxpr: cannot find the batching rule of {prim}")


def _wrap_rule(table: dict, prim: Any, wrapper: Callable, kind: str) -> None:
    """Replace ``table[prim]`` by ``wrapper(original, *args, **kwargs)``
    (around a rule taxpr already wrapped with another wrapper, too; once
    per wrapper). ``kind`` names the table (``_RULE_ARGUMENTS``)."""
    original = table[prim]
    wrappers = getattr(original, "_taxpr_wrappers", frozenset())
    if wrapper.__qualname__ in wrappers:
        return
    if not wrappers:
        expect_signature(original, f"{kind} rule of {prim}", *_RULE_ARGUMENTS[kind])
    rule = lambda *args, **kwargs: wrapper(original, *args, **kwargs)  # noqa: E731
    rule._taxpr_wrapped = True
    rule._taxpr_wrappers = wrappers | {wrapper.__qualname__}
    table[prim] = rule


def wrap_partial_eval_rule(prim: Any, wrapper: Callable) -> None:
    """Replace ``prim``'s partial-evaluation rule (``JaxprTrace``) by
    ``wrapper(original, trace, *tracers, **params)``."""
    _wrap_rule(pe.custom_partial_eval_rules, prim, wrapper, "partial_eval")


def wrap_partial_eval_custom_rule(prim: Any, wrapper: Callable) -> None:
    """Replace ``prim``'s ``partial_eval_jaxpr_custom`` rule by
    ``wrapper(original, saveable, unks_in, inst_in, eqn)``."""
    _wrap_rule(pe.partial_eval_jaxpr_custom_rules, prim, wrapper, "partial_eval_custom")


def unhoisted_custom_call(process: Callable, holds_kept_tags: Callable) -> Callable:
    def process_unhoisted(self, prim, fun, *subfuns_and_tracers, **params):
        *subfuns, tracers = subfuns_and_tracers
        tracers = [self.to_jaxpr_tracer(t) for t in tracers]
        if flags.splitting_a_loop() and tracers and all(t.is_known() for t in tracers):
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
    # scan's JaxprTrace rule hoists in ``_scan_known_hoisting`` (the body split
    # before it runs the known body every step: no staging needed there); its
    # partial_eval_jaxpr_custom rule traces with JaxprTrace only to hoist.
    hoisting = getattr(loops, "_scan_known_hoisting", None)
    scopes = [(pe.custom_partial_eval_rules, _compat.while_p, True),
              (pe.partial_eval_jaxpr_custom_rules, _compat.scan_p, True)]
    if hoisting is None:
        scopes.append((pe.custom_partial_eval_rules, _compat.scan_p, True))
    elif not getattr(hoisting, "_taxpr_wrapped", False):
        loops._scan_known_hoisting = flags.in_staging_scope(True, hoisting, hoisting=True)
    for registry, prim, hoists in scopes:
        if not getattr(registry[prim], "_taxpr_wrapped", False):
            registry[prim] = flags.in_staging_scope(True, registry[prim], hoisting=hoists)
    linearize_from_jvp = getattr(_ad, "linearize_from_jvp", None)
    if linearize_from_jvp is not None and not getattr(linearize_from_jvp, "_taxpr_wrapped", False):
        _ad.linearize_from_jvp = flags.in_staging_scope(False, linearize_from_jvp, hoisting=False)
    for name in ("process_custom_jvp_call", "process_custom_vjp_call"):
        process = getattr(pe.JaxprTrace, name)
        if not getattr(process, "_taxpr_wrapped", False):
            # (self, prim, fun, *rules, tracers): a jvp rule, or a fwd and a bwd
            expect_signature(process, f"JaxprTrace.{name}",
                             5 if name == "process_custom_jvp_call" else 6)
            setattr(pe.JaxprTrace, name, unhoisted_custom_call(process, holds_kept_tags))


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
        expect_signature(memoize, "partial_eval._memoize", 1)
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
        expect_signature(process, f"{cls.__name__}.process_custom_vjp_call", 6,
                         ("out_trees", "symbolic_zeros"))

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
        # (self, trace, args, *avals, params): the params last
        expect_signature(original, f"{cls.__name__}.bind_with_trace", 4)

        def bind_with_trace(self, trace, args, *rest, _original=original):
            *avals, params = rest  # (JAX passes the avals before the params)
            fun, *rules = params["subfuns"]
            wrapped = wrap_rules(tuple(rules))
            if wrapped is not None:
                params = {**params, "subfuns": (fun, *wrapped)}
            return _original(self, trace, args, *avals, params)

        bind_with_trace._taxpr_wrapped = True
        cls.bind_with_trace = bind_with_trace



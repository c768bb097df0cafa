"""What the thread rules of ``custom_jvp`` and ``custom_vjp`` share: the
rule traced and threaded, ctx passed through a call, cotangent helpers,
the function run again next to a rule, speculative rule traces."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Sequence

import jax

from .._jax.internals import core

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .. import _dependence, _jaxpr, _traverse
from .._find import is_selected
from ..primitives._tag import tag_p, user_params
from ._api import Level, format_path, site_name, zeros_of_aval


def threaded_rule(engine, eqn, jvp_jaxpr, jvp_consts, n_primals, path, context):
    """The jaxpr of a rule of the custom call ``eqn`` (a JVP rule, or a
    custom_vjp fwd), threaded (ctx in first, out last)."""
    closed = _jaxpr.close_traced(jvp_jaxpr, jvp_consts)
    closed = engine.hooks.rules.prepare(engine, closed, n_primals, eqn)
    rule = engine.thread_jaxpr(closed, path, 0, len(_jaxpr.jaxpr_parts(closed).outvars),
                               context)
    ch = engine.channels(rule)
    if ch.collects or ch.feeds:
        raise NotImplementedError(
            f"taxpr: tags in the custom rule at {format_path(path)} collect or are fed "
            f"values per site ({site_name((ch.collects or ch.feeds)[0][0])}); only values "
            f"carried in ctx (e.g. non-append sows) are supported in a derivative rule")
    engine.hooks.rules.check(rule, path)
    return rule


# Set while a rule is differentiated w.r.t. ctx alone (its inputs held): the
# custom functions it calls see zero tangents for their inputs and run their
# bodies, not their rules (JAX calls no rule then, and a rule that calls its
# own function would otherwise recurse without end). JAX instantiates zero
# tangents before calling a rule, so this cannot be read off the tangents.
DIFFERENTIATING_CTX_ONLY = contextvars.ContextVar("taxpr_differentiating_ctx_only",
                                                   default=False)


@contextlib.contextmanager
def differentiating_ctx_only() -> Iterator[None]:
    token = DIFFERENTIATING_CTX_ONLY.set(True)
    try:
        yield
    finally:
        DIFFERENTIATING_CTX_ONLY.reset(token)


# ``ctx_through(after, before) -> after`` with ``before``'s tangent: a ctx
# leaf that a custom_vjp function passes through unchanged. JAX gives every
# output of a custom_vjp call a tangent (a linearization of its bwd), which
# would make a state the call does not touch look differentiated after it;
# its value is still what the call returns (a fwd rule may write it, and
# what a rule writes is a constant w.r.t. the inputs), its tangent the one
# it had before the call (the function's identity on it).
ctx_through_p = Primitive("taxpr_ctx_through")
ctx_through_p.def_impl(lambda after, before: after)
ctx_through_p.def_abstract_eval(lambda after, before: after)
ad.primitive_jvps[ctx_through_p] = lambda primals, tangents: (primals[0], tangents[1])
batching.primitive_batchers[ctx_through_p] = lambda args, dims: (args[0], dims[0])
mlir.register_lowering(ctx_through_p, lambda ctx, after, before: [after])


def emit_ctx_through(level: Level, after: Any, before: Any) -> Any:
    out = _jaxpr.new_var(after.aval)
    level.emit(core.new_jaxpr_eqn([after, before], [out], ctx_through_p, {}, core.no_effects))
    return out


def passes_through(engine, threaded, leaf: int, in_index: int, out_index: int) -> bool:
    """Whether ``threaded`` (a result of ``thread_jaxpr``) hands ctx leaf
    ``leaf`` (its input ``in_index``, output ``out_index``) on unchanged,
    also through the nested calls that thread it: no site writes it and no
    other output depends on it. Its derivative there is the identity."""
    if leaf in engine.writes(threaded):
        return False
    n_in = len(_jaxpr.jaxpr_parts(threaded).invars)
    dep = _dependence.dependence(threaded, [j == in_index for j in range(n_in)])
    return not any(d for k, d in enumerate(dep.outputs) if k != out_index)


def of_some_inputs(fn: Callable, inputs, positions) -> Callable:
    """``fn`` as a function of its inputs at ``positions`` alone, the others
    held at ``inputs``: differentiated w.r.t. those only, nested custom
    functions whose inputs do not depend on them are not differentiated at
    all (as JAX does with symbolic zeros)."""
    def of_some(*leaves):
        full = list(inputs)
        for i, leaf in zip(positions, leaves):
            full[i] = leaf
        return fn(*full)
    return of_some


# The name of the jit through which a rule taxpr generates runs a custom
# function's threaded body again, next to the user's rule (to differentiate
# it w.r.t. ctx or the inputs): a layer above that looks into the rule
# (harvest, for a rule's own sows) tells the function's tags from the rule's.
FUNCTION_AGAIN = "taxpr_function_again"


def jvp_again(fn: Callable, primals: Sequence[Any], positions: Sequence[int],
               tangents: Sequence[Any]) -> tuple[list, list]:
    """``jax.jvp`` of ``fn`` (a custom function's threaded body) w.r.t. its
    inputs at ``positions`` (tangents ``tangents``), the others held at
    ``primals`` (``of_some_inputs``), through a jit named
    ``FUNCTION_AGAIN``."""
    def again(held, xs, ts):
        return jax.jvp(of_some_inputs(fn, held, positions), xs, ts)
    again.__name__ = again.__qualname__ = FUNCTION_AGAIN  # the jit's name
    outs, outs_t = jax.jit(again)(list(primals), [primals[i] for i in positions], list(tangents))
    return list(outs), list(outs_t)


def is_zero_ct(ct) -> bool:
    return is_symbolic_zero(ct) or getattr(ct, "dtype", None) == jax.dtypes.float0


class RuleNotTraceable(Exception):
    """Raised instead of a rule-site error while a rule is traced only to
    look into it (``speculative_rule_traces``): nothing runs the rule yet."""


SPECULATIVE_TRACES = contextvars.ContextVar("taxpr_speculative_rule_traces", default=False)


@contextlib.contextmanager
def speculative_rule_traces() -> Iterator[None]:
    """Rules traced in this block are looked into, not run (harvest's search
    for sows in custom JVP rules): one whose tags cannot be threaded raises
    ``RuleNotTraceable``, and its real error comes if JAX ever runs it (its
    trace is not cached)."""
    token = SPECULATIVE_TRACES.set(True)
    try:
        yield
    finally:
        SPECULATIVE_TRACES.reset(token)


def reject_rule_sites(engine, rule_jaxpr, path: tuple[str, ...]) -> None:
    """A selected tag inside a user's derivative rule (custom_jvp rule,
    custom_vjp fwd/bwd) traced when the rewritten program is differentiated
    from outside cannot be threaded: the rule is traced after the rewrite.
    Eagerly the rule's effects would happen (instead of the function's), so
    rather than drop or misplace them this is an error naming the tag."""
    if not engine.hooks.rules.checks_untraced:
        return
    for eqn, sub_path in _traverse.iter_eqns(rule_jaxpr, path):
        if eqn.primitive is tag_p and is_selected(eqn, engine.predicate):
            error = engine.hooks.rules.untraced_site(user_params(eqn.params), sub_path)
            if error is not None:
                if SPECULATIVE_TRACES.get():
                    raise RuleNotTraceable(str(error)) from error
                raise error


def zeros_like_ct(aval) -> Any:
    return zeros_of_aval(aval.to_tangent_aval())


def is_symbolic_zero(ct) -> bool:
    return ct is None or type(ct) is ad.Zero or type(ct).__name__ == "SymbolicZero"


def instantiate_ct(ct, aval) -> Any:
    return zeros_like_ct(aval) if is_symbolic_zero(ct) else ct


def add_cts(a, b) -> Any:
    if a is None or type(a) is ad.Zero:
        return b
    if b is None or type(b) is ad.Zero or getattr(b, "dtype", None) == jax.dtypes.float0:
        return a
    return a + b

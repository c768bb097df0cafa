"""State effects: ``get_state`` / ``set_state`` made pure by ``uncurry``.

A state access is a tag whose ``op`` param is a private ``StateOp`` value,
so user tags (even ``op="get"``) are never mistaken for state accesses.
``uncurry`` traces the function once, finds every state access (also inside
loops and branches), computes the initial values (a state's initial value
is its ``init`` at first use: taken from the program where every first use
is certain from its structure, else found by running the program once with
the example arguments, as Haiku's ``init`` does), and rewrites the accesses
into a pure function of ``(state, *args)``: each access becomes a
substitution of the state's current value (``inject`` with a ``direct``
rule), with no equations of its own.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import os
import sys
import types
import warnings
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core

from . import _compat, _jaxpr
from ._engine import THREAD_RULES, Hooks, format_path, in_custom_vjp
from ._find import TagSite, tag_shape
from ._expand import expand_for
from ._inject import InjectPolicy, check_no_hidden_tags, inject_with, trace_program
from . import _traverse
from ._inject import guarded_place
from .primitives._tag import (BATCHED, GUARD, guarding_tags, keep_tags, keeping_tags,
                              recording_tags, tag, tag_p, user_params)


class StateOp:
    """The ``op`` param of a state access. Compared by identity, so a user's
    ``op="get"`` string never equals (nor shares a cache entry with) it."""

    __slots__ = ("kind",)

    def __init__(self, kind: str):
        self.kind = kind

    def __repr__(self):
        return f"state.{self.kind}"

    def recomputed(self, saved: list, values: list) -> list:
        """The outputs of this access recomputed in a backward pass
        (``jax_remat3``): a read gives what the forward read, a write passes
        its value on (the derivative flows through) and writes nothing again."""
        return saved if self is GET else values

    def on_untransformed(self, params: dict, how: str) -> None:
        """Called when a state access is compiled or runs eagerly without
        ``uncurry``: ``how`` says which ("is being compiled", "ran eagerly")."""
        if self is SET:
            warnings.warn(
                f"taxpr: set_state({params['name']!r}) {how} without "
                f"tx.uncurry, so the update is lost (get_state returns the init, and "
                f"tx.next_key the same key on every call). Use `pure, state0 = "
                f"tx.uncurry(fn, *args)` and jit `pure` instead (or `tx.seed(fn, key)` "
                f"for a function that only draws keys).",
                StateNotUncurriedWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """The ``stacklevel`` of ``warnings.warn`` called here that names the
    first caller outside taxpr and JAX (the user's line)."""
    inside = (os.path.dirname(__file__) + os.sep, os.path.dirname(jax.__file__) + os.sep)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


GET, SET = StateOp("get"), StateOp("set")


class StateError(ValueError):
    """A state is used inconsistently (the message names it)."""


class StateNotUncurriedWarning(UserWarning):
    """A ``set_state`` reached compilation (e.g. ``jax.jit(fn)``) or ran
    eagerly (``fn(x)``, or under ``jax.disable_jit()``) without
    ``tx.uncurry``: its update is lost. Turn it into an error with
    ``warnings.simplefilter("error", tx.StateNotUncurriedWarning)``."""


def is_state_tag(params: dict, shape: Any = None) -> bool:
    """Whether a tag's params are a state access's (a tag predicate)."""
    return isinstance(params.get("op"), StateOp)


def get_state(name: str, init: Any) -> jax.Array:
    """The current value of state ``name``.

    Arguments:
        name: the state's name.
        init: an array-like, or a zero-argument callable returning one; it
            fixes the state's shape and dtype and is its value at first use.

    Returns:
        The state's current value (``init`` when called outside ``uncurry``).
    """
    if callable(init):
        init = _call_init(name, init)
    # The init stays in the jaxpr as the tag's operand: a state the example
    # run never reaches gets it from there (``initial_states``). (asarray
    # returns arrays and tracers as they are: skip its checks for them.)
    return tag(_one_array(name, init, "get_state's init"), op=GET, name=name)


def _one_array(name: str, value: Any, what: str) -> Any:
    """``value`` as the one array a state holds. A pytree of several arrays
    (a tuple of arrays, a dict, a NamedTuple) is an error naming the state:
    ``jnp.asarray`` would silently stack it into one array. Nested lists or
    tuples of Python scalars are an array literal, as for ``jnp.asarray``."""
    if isinstance(value, jax.Array):
        return value
    leaves, tree = jax.tree_util.tree_flatten(value)
    if tree.num_nodes > 1 and not (
            isinstance(value, (list, tuple)) and _scalars_only(value)):
        raise TypeError(
            f"taxpr: state {name!r}: {what} is a {type(value).__name__} holding "
            f"{len(leaves)} leaves, but a state holds one array (it would be stacked into "
            f"one). Keep each array in its own state (e.g. {name + '_0'!r}, "
            f"{name + '_1'!r}), or stack them explicitly with jnp.stack")
    return jnp.asarray(value)


def _scalars_only(value: Any) -> bool:
    return all(_scalars_only(v) if isinstance(v, (list, tuple))
               else isinstance(v, (bool, int, float, complex, np.bool_, np.number))
               for v in value)


# Per outermost trace (weakly held, so a finished trace drops its entries):
# the value of each (state name, callable init) already called in it. No
# tracer is held strongly, in keys or values: a tracer held here would keep
# its trace alive after it ends, which ``jax.checking_leaks()`` reports as a
# leaked tracer (and a tracer's trace refers back to it, so the entry would
# live as long as the outermost trace).
_INIT_VALUES: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _init_key(init: Callable) -> tuple | None:
    """What makes two callable inits give the same value: the same object,
    or functions with the same code, globals, defaults and closure contents
    (a lambda written in a loop is a new object every iteration). None if
    that cannot be told (an empty closure cell)."""
    if not isinstance(init, types.FunctionType):
        return ("object", _Ident(init))
    try:
        cells = tuple(c.cell_contents for c in init.__closure__ or ())
    except ValueError:
        return None
    held = [_Ident(x) if not isinstance(x, core.Tracer) else _WeakIdent(x) for x in cells]
    # A closure holding tracers inside another object (a dict of traced
    # params): not cached, rather than held.
    if any(type(h) is _Ident and _holds_tracers(h.obj) for h in held):
        return None
    # The objects themselves (not their ids) are held in the key, so an id
    # cannot be reused while the trace lives (a tracer weakly: dead, it
    # equals nothing); compared by identity.
    return ("function", init.__code__, _Ident(init.__globals__), _Ident(init.__defaults__),
            _Ident(init.__kwdefaults__), tuple(held))


def _holds_tracers(x: Any) -> bool:
    return any(isinstance(leaf, core.Tracer) for leaf in jax.tree_util.tree_leaves(x))


class _Ident:
    """Wraps an object so that it hashes and compares by identity."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: Any) -> bool:
        return type(other) is _Ident and other.obj is self.obj


class _WeakIdent:
    """``_Ident`` of a tracer, held weakly."""

    __slots__ = ("ref", "hash")

    def __init__(self, obj: Any):
        self.ref, self.hash = weakref.ref(obj), id(obj)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: Any) -> bool:
        obj = self.ref()
        return type(other) is _WeakIdent and obj is not None and other.ref() is obj


def _remember(per_trace: dict, key: Any, value: Any) -> Any:
    """Store ``value`` (a tracer weakly; not at all if it holds tracers
    otherwise) under ``key``; return it."""
    if isinstance(value, core.Tracer):
        per_trace[key] = weakref.ref(value)
    elif not _holds_tracers(value):
        per_trace[key] = lambda: value
    return value


def _recall(per_trace: dict, key: Any) -> Any | None:
    """The value stored under ``key``; None if absent or a dead tracer."""
    ref = per_trace.get(key)
    return None if ref is None else ref()


def _call_init(name: str, init: Callable) -> Any:
    """``init()`` (evaluated at trace time), called once per state and
    trace (the outermost one: a program's scan bodies, branches and jitted
    functions share it).

    Inits with equal code, globals, defaults and closure contents give equal
    values, so one call serves every ``get_state`` of the state; an init
    that draws from a random generator of its own (NumPy's) draws once per
    state, and that draw is the state's value at first use wherever it is.
    Different states never share a call. This keeps a stateful program
    unrolled in Python as cheap to trace as one with explicit carries.

    Only inside taxpr's own transformations (``keep_tags()``), where a
    ``get_state``'s init is used only as the state's initial value (the
    first use's) and for its type: traced without them, every
    ``get_state`` returns its own init, so each is called (an init whose
    closure holds a mutable object changed in between gives a new value).

    Where only the states' types are needed (``make_jaxpr``), ``init`` is
    traced into the current trace instead (cheaper than evaluating it there)
    and the state pass drops what it computed."""
    if keeping_tags() and _INITS_FOR_TYPES_ONLY.get():
        return _staged_init(name, init)
    trace = _compat.outermost_trace() if keeping_tags() else None
    key = None if trace is None else _init_key(init)
    if key is None:
        with jax.ensure_compile_time_eval():
            return init()
    per_trace = _INIT_VALUES.setdefault(trace, {})
    key = (name, key)
    hit = _recall(per_trace, key)
    if hit is None:
        with jax.ensure_compile_time_eval():
            hit = _remember(per_trace, key, init())
    return hit


def _staged_init(name: str, init: Callable) -> Any:
    """``init()`` traced into the current trace, once per state and trace;
    a value staged in an enclosing trace serves the traces nested in it."""
    traces = _compat.enclosing_traces()
    key = _init_key(init)
    if not traces or key is None:
        return init()
    key = ("staged", name, key)
    for trace in traces:
        hit = _recall(_INIT_VALUES.get(trace, {}), key)
        if hit is not None:
            return hit
    return _remember(_INIT_VALUES.setdefault(traces[0], {}), key, init())


# Set by ``make_jaxpr``: inits are needed only for their types (the pure
# program takes every state as an input).
_INITS_FOR_TYPES_ONLY = contextvars.ContextVar("taxpr_inits_for_types_only", default=False)


def set_state(name: str, value: Any) -> Any:
    """Set state ``name`` to ``value`` and return ``value``.

    Arguments:
        name: the state's name. Setting a state never read creates it (with
            initial value zeros).
        value: the new value; it must have the state's shape and dtype.

    Returns:
        ``value``.
    """
    return tag(_one_array(name, value, "set_state's value"), op=SET, name=name)


@dataclasses.dataclass(frozen=True)
class StateInfo:
    """A state found by ``make_jaxpr``.

    Attributes:
        name: the state's name.
        shape: its shape.
        dtype: its dtype.
        read: whether the program reads it (``get_state``).
        written: whether the program writes it (``set_state``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: Any
    read: bool
    written: bool


def _describe_site(site) -> str:
    return f"{site.params['op'].kind}_state({site.params['name']!r}) at {format_path(site.path)}"


def collect_states(closed: Any) -> dict[str, StateInfo]:
    """The states a program uses, checked for consistent shapes and dtypes.

    Raises:
        StateError: two accesses of a state disagree (names the state, both
            places, and says when a value looks batched by ``vmap``).
    """
    sites, unchecked_sets = _walk_program(closed)
    for eqn, path in sites:  # a batched set is the clearer error: report it first
        p = eqn.params
        if p["op"] is SET and GUARD in p:
            raise StateError(
                f"taxpr: state {p['name']!r}: set_state at {format_path(path)} is inside "
                f"{guarded_place(p)} whose predicate is batched by vmap: only some examples "
                f"take it, so the state's new value would differ per example, and a state is "
                f"not batched (compute the new value with jnp.where and set it outside the "
                f"cond/while, or vmap the pure function over a batch of states)")
        if p["op"] is SET and p.get(BATCHED):
            raise StateError(
                f"taxpr: state {p['name']!r}: set_state at {format_path(path)} sets a value "
                f"batched by vmap; reads under vmap broadcast, but a state cannot be set to "
                f"a batched value (set it outside the vmap, or vmap the pure function over "
                f"a batch of states)")
    if unchecked_sets:
        _, path = unchecked_sets[0]
        raise StateError(
            f"taxpr: state {unchecked_sets[0][0].params['name']!r}: set_state at "
            f"{format_path(path)} is "
            f"inside a shard_map without vma checking (check_vma=False, as jax.pmap "
            f"uses): taxpr cannot tell whether the value is the same on every shard, and "
            f"a state holds one value (only one shard's would be kept); use shard_map "
            f"with check_vma=True (a value that differs per shard is then a clear error), "
            f"or set the state outside the shard_map / pmap")
    states: dict[str, StateInfo] = {}
    first: dict[str, tuple] = {}
    for eqn, path in sites:
        p = eqn.params
        name, op, aval = p["name"], p["op"], tag_shape(eqn)
        if name not in states:
            states[name] = StateInfo(name, tuple(aval.shape), aval.dtype,
                                     op is GET, op is SET)
            first[name] = (eqn, path)
            continue
        info = states[name]
        if tuple(aval.shape) != info.shape or aval.dtype != info.dtype:
            got = f"{aval.dtype.name}{list(aval.shape)}"
            want = f"{info.dtype.name}{list(info.shape)}"
            hint = ""
            # Only where it is true: same dtype, one extra leading axis.
            if (op is SET and aval.dtype == info.dtype
                    and len(aval.shape) == len(info.shape) + 1
                    and tuple(aval.shape[1:]) == info.shape):
                hint = (f" (it has an extra leading axis of size {aval.shape[0]}; if that "
                        f"axis comes from vmap: setting a state to a batched value is not "
                        f"allowed; reads under vmap broadcast, writes must be unbatched)")
            raise StateError(
                f"taxpr: state {name!r}: {_describe_site(_site(eqn, path))} has type {got}, "
                f"but {_describe_site(_site(*first[name]))} gave it type {want}{hint}")
        first_aval = tag_shape(first[name][0])
        if _compat.explicit_sharding(aval) != _compat.explicit_sharding(first_aval):
            raise StateError(
                f"taxpr: state {name!r}: {_describe_site(_site(eqn, path))} has type "
                f"{aval.str_short()}, but {_describe_site(_site(*first[name]))} gave it type "
                f"{first_aval.str_short()}: their shardings over the explicit mesh axes "
                f"differ, and a state keeps one type (give the init the sharding of the "
                f"values set, e.g. with jax.sharding.reshard, or reshard the value set)")
        if (op is GET and not info.read) or (op is SET and not info.written):
            states[name] = dataclasses.replace(info, read=info.read or op is GET,
                                               written=info.written or op is SET)
    return dict(sorted(states.items()))


def _site(eqn, path: tuple[str, ...]) -> TagSite:
    return TagSite(user_params(eqn.params), tag_shape(eqn), path)


def _walk_program(closed: Any) -> tuple[list, list]:
    """One walk over the program (what ``collect_states`` checks), in
    program order: ``(sites, unchecked_sets)``: every state access
    ``(eqn, path)``; the sets inside a shard_map without vma checking
    (``check_vma=False``, as ``jax.pmap`` uses; an error: the value may
    differ per shard and a state is one value)."""
    sites: list = []
    unchecked_sets: list = []

    def visit(jaxpr, path: tuple[str, ...], unchecked: bool) -> None:
        for eqn in _jaxpr.jaxpr_parts(jaxpr).eqns:
            if eqn.primitive is tag_p:
                if is_state_tag(eqn.params):
                    sites.append((eqn, path))
                    if unchecked and eqn.params["op"] is SET:
                        unchecked_sets.append((eqn, path))
                continue
            inner = unchecked or (eqn.primitive is _compat.shard_map_p
                                  and not _compat.shard_map_checks_vma(eqn.params))
            for sub, sj in _traverse.subjaxprs(eqn):
                visit(sj, path + (sub.label,), inner)

    visit(closed, (), False)
    return sites, unchecked_sets


def guard_custom_rules(closed: Any, threads_custom_jvps: bool = True) -> Any:
    """``closed`` with the fwd and bwd of its ``custom_vjp`` functions whose
    body uses no state, and the rules of the ``custom_jvp`` functions inside
    those, checked when JAX runs them: state accesses there are an error
    (other ``custom_jvp`` functions are threaded whole, rules included, see
    ``_StateHooks.rules_may_hold_sites``), and of those inside a primitive
    the engine has no thread rule for.

    Such a rule runs instead of the function when uncurry's pure function is
    differentiated from outside (``jax.grad(lambda x: pure(state, x)[0])``),
    after the rewrite, so its accesses cannot be threaded: a read would see
    the init and a write would be lost. (A rule that runs inside the traced
    function, under a ``jax.grad`` there, is part of the program and fine.)
    The check runs only when JAX calls the rule, with JAX's own arguments:
    taxpr never runs a rule JAX would not (equinox's rules refuse tangents
    JAX never passes them). Functions whose body uses state are rewritten by
    the engine, which checks their rules the same way.

    Raises (when JAX runs such a rule):
        StateError: naming the state and the rule's place.

    ``threads_custom_jvps``: whether the engine threads every ``custom_jvp``
    outside a ``custom_vjp`` (it does when there are states to thread);
    False: their rules are checked too.
    """
    custom = (_compat.custom_jvp_call_p, _compat.custom_vjp_call_p)
    if not any(e.primitive in custom for e, _ in _traverse.iter_eqns(closed)):
        return closed

    def rewrite(eqn, path, env, every_custom_jvp=False):
        prim = eqn.primitive
        if prim is not _compat.custom_vjp_call_p and prim is not _compat.custom_jvp_call_p:
            subs = _traverse.subjaxprs(eqn)
            if every_custom_jvp or not subs or prim in THREAD_RULES:
                return None
            # The engine leaves a primitive it has no thread rule for as it
            # is (lineax's linear_solve, custom_vmap): custom_jvp functions
            # in it are not threaded, so their rules are checked.
            new = {}
            for sub, sj in subs:
                nj = _traverse.map_jaxpr(sj, functools.partial(rewrite, every_custom_jvp=True),
                                         path + (sub.label,))
                if nj is not sj:
                    new[(sub.key, sub.index)] = nj
            return [_traverse.with_subjaxprs(eqn, new)] if new else None
        if (prim is _compat.custom_jvp_call_p and not every_custom_jvp and threads_custom_jvps
                and not in_custom_vjp(path)):
            # (custom_jvp functions outside custom_vjp functions are
            # threaded whole, rules included: ``rules_may_hold_sites``.)
            return None
        if any(e.primitive is tag_p and is_state_tag(e.params)
               for _, sj in _traverse.subjaxprs(eqn) for e, _ in _traverse.iter_eqns(sj)):
            return None  # threaded by the engine, which checks its rules itself
        p = eqn.params
        if prim is _compat.custom_jvp_call_p:
            user_jvp = p["jvp_jaxpr_fun"]
            at = path + ("custom_jvp[jvp rule]",)

            def jvp_jaxpr_fun(*zeros):
                out = user_jvp.call_wrapped(*zeros)
                _reject_state_in_rule(out[0], at)
                return out
            return [eqn.replace(params=dict(p, jvp_jaxpr_fun=_compat.wrap_fun(
                jvp_jaxpr_fun, user_jvp)))]
        user_fwd, user_bwd = p["fwd_jaxpr_thunk"], p["bwd"]
        fwd_at, bwd_at = path + ("custom_vjp[fwd]",), path + ("custom_vjp[bwd]",)

        def fwd_jaxpr_thunk(*zeros):
            out = user_fwd.call_wrapped(*zeros)
            _reject_state_in_rule(out[0], fwd_at)
            return out

        def bwd(*args):
            with guarding_tags(lambda params, value: _rule_error(
                    params["name"], params["op"], bwd_at) if is_state_tag(params) else None):
                return bwd_call(*args)
        bwd_call = user_bwd.call_wrapped
        return [eqn.replace(params=dict(
            p, fwd_jaxpr_thunk=_compat.wrap_fun(fwd_jaxpr_thunk, user_fwd),
            bwd=_compat.wrap_fun(bwd, user_bwd)))]

    return _traverse.map_jaxpr(closed, rewrite)


def _reject_state_in_rule(rule_jaxpr: Any, path: tuple[str, ...]) -> None:
    for eqn, sub in _traverse.iter_eqns(rule_jaxpr, path):
        if eqn.primitive is tag_p and is_state_tag(eqn.params):
            raise _rule_error(eqn.params["name"], eqn.params["op"], sub)


def _rule_error(name: str, op: StateOp, path: tuple[str, ...]) -> StateError:
    where = f"{op.kind}_state({name!r}) at {format_path(path)}"
    if any(p.startswith("custom_vjp[bwd]") for p in path):
        return StateError(
            f"taxpr: state {name!r}: {where} is in a custom_vjp backward pass, which runs "
            f"after uncurry's pure function has returned its states (under jax.grad from "
            f"outside): a read there cannot see the state the forward pass saw, and a write "
            f"would be lost. Access the state in the function or its fwd rule")
    return StateError(
        f"taxpr: state {name!r}: {where} is in the derivative rule of a function whose "
        f"body uses no state, inside a custom_vjp function or a primitive taxpr has no "
        f"thread rule for (or in a custom_vjp fwd). Such a rule runs instead of the function "
        f"when uncurry's pure function is differentiated from outside, and taxpr threads "
        f"state through it only where the function's body uses state too (a read would see "
        f"the init, a write would be lost). Access the state in the function itself, or "
        f"differentiate inside the function")


def _state_direct(names: Sequence[str]) -> Callable:
    """``_state_injector`` as atom substitution (see ``_inject``'s ``direct``):
    a get's value is the state's current atom, a set makes its value the
    state's atom. ``names``: the states in ctx leaf order."""
    index = {n: i for i, n in enumerate(names)}

    def direct(params: dict, ctx: list, token: list):
        i = index[params["name"]]
        if params["op"] is GET:
            return [ctx[i]], ctx
        new = list(ctx)
        new[i] = token[0]
        return token, new

    return direct


def _state_injector(ctx: dict, token: Any, params: dict):
    name = params["name"]
    if params["op"] is GET:
        return ctx[name], ctx
    return token, {**ctx, name: token}


class _FirstUse(NamedTuple):
    """One state's ctx entry while ``initial_states`` runs the program."""

    value: Any  # the state's current value
    initial: Any  # its value at first use (zeros until then)
    seen: Any  # whether it has been used (a bool scalar)


def _init_injector(ctx: dict, token: Any, params: dict):
    """Run with eager semantics and record each state's value at first use
    (``ctx[name]``: a ``_FirstUse``)."""
    name = params["name"]
    use = ctx[name]
    yes = jnp.ones((), bool)
    if params["op"] is GET:
        # lax.select, not jnp.where: it takes every dtype (typed keys too).
        new = jax.lax.select(use.seen, use.value, token)
        return new, {**ctx, name: _FirstUse(new, jax.lax.select(use.seen, use.initial, token),
                                            yes)}
    # A state first set (never read before) starts at zeros.
    return token, {**ctx, name: _FirstUse(token, use.initial, yes)}


def _reached_by_any_example(guard, old: list, new: list) -> list:
    """A first use inside a cond/while whose predicate vmap batches (reads
    only: sets there are errors) counts when any example reaches it; the
    recorded values are unbatched, the same for every example."""
    reached = jnp.any(guard)
    return [jax.lax.select_n(reached, o, n) for o, n in zip(old, new)]


def _state_ctx(states: dict[str, StateInfo], values: dict | None = None) -> dict:
    if values is None:
        return {n: jax.ShapeDtypeStruct(s.shape, s.dtype) for n, s in states.items()}
    return values


class _StateHooks(Hooks):
    """When the pure function is differentiated from outside, the custom_jvp
    rule or custom_vjp fwd of a function whose body uses state runs in its
    place with the state threaded through it (as eagerly). Accesses in a
    custom_vjp bwd (it runs after the forward returned its states), and sets
    of states the function never touches, are errors.

    Arguments:
        names: the states threaded (``None``: another layer may own the
            states it leaves, e.g. ``seed`` inside ``uncurry``).
        leaf_names: the state of each ctx leaf, for messages (default
            ``names``).
    """

    checks_rules = True
    threads_rules = True

    def __init__(self, names: Sequence[str] | None = None,
                 leaf_names: Sequence[str] | None = None):
        self.names = None if names is None else frozenset(names)
        leaf_names = names if leaf_names is None else leaf_names
        self.leaf_names = None if leaf_names is None else list(leaf_names)

    @property
    def rules_may_hold_sites(self) -> bool:
        # Any custom_jvp rule may read a state (a gradient scale kept in
        # state) though its function's body uses none: with states to
        # thread, every custom_jvp function outside a custom_vjp takes them,
        # and its rule, when JAX runs it, is threaded (traced then, never
        # ahead of JAX).
        return bool(self.names)

    def rule_site(self, params: dict, path: tuple[str, ...]) -> Exception:
        return _rule_error(params["name"], params["op"], path)

    def describe_ctx(self, index: int) -> str:
        if self.leaf_names is None:
            return super().describe_ctx(index)
        return f"state {self.leaf_names[index]!r}"

    def replay_read(self, index: int, path: tuple[str, ...]) -> Exception:
        name = self.describe_ctx(index)
        return StateError(
            f"taxpr: {name}: the custom_vjp backward pass at {format_path(path)} recomputes "
            f"the forward pass and its derivatives depend on {name}, which the forward pass "
            f"changes. What the recomputation reads depends on the order in which the bwd "
            f"recomputes (a checkpointed loop, e.g. equinox's or diffrax's "
            f"RecursiveCheckpointAdjoint, restarts from saved steps), which taxpr cannot see. "
            f"Keep the state constant in the function (read it, set it before), or pass the "
            f"value in as an argument")

    def replay_write(self, index: int, path: tuple[str, ...]) -> Exception:
        name = self.describe_ctx(index)
        return StateError(
            f"taxpr: {name}: the custom_vjp backward pass at {format_path(path)} sets it, and "
            f"the function's forward pass does not. taxpr runs a backward pass as a replay of "
            f"the forward pass (it reads the states the forward pass saw; the writes it "
            f"repeats are not applied twice), so a write of its own would be lost. Set the "
            f"state in the function or its fwd rule")

    def check_rule(self, rule: Any, path: tuple[str, ...]) -> None:
        if self.names is None:
            return
        for eqn, sub in _traverse.iter_eqns(rule, path):
            if (eqn.primitive is tag_p and is_state_tag(eqn.params) and eqn.params["op"] is SET
                    and eqn.params["name"] not in self.names):
                name = eqn.params["name"]
                raise StateError(
                    f"taxpr: state {name!r}: set_state({name!r}) at {format_path(sub)} is in a "
                    f"derivative rule, and the function itself never touches {name!r}, so "
                    f"uncurry's pure function has no such state to write it to (its states "
                    f"are {sorted(self.names)}). Give the state a place in the function: a "
                    f"get_state({name!r}, init) there makes uncurry thread it")


def pure_jaxpr(closed: Any, states: dict[str, StateInfo]) -> Any:
    """``closed`` (traced by ``trace_program`` or ``make_jaxpr_with_states``,
    so expanded for state tags) with state accesses threaded: ``(*states,
    *in) -> (*out, *states)``."""
    ctx = _state_ctx(states)
    # ctx leaves are in the flattened dict's (sorted) key order.
    names = jax.tree_util.tree_leaves({n: n for n in ctx})
    # A state read only in a derivative rule is not among them: it reads its
    # init there (nothing in the program writes it).
    return inject_with(guard_custom_rules(closed, threads_custom_jvps=bool(names)),
                       _state_injector, ctx,
                       lambda p, _shape=None: is_state_tag(p) and p["name"] in ctx,
                       InjectPolicy(hooks=_StateHooks(names), direct=_state_direct(names),
                                    expanded=True))


def stream_pure_jaxpr(closed: Any, stream: str, spec: Any) -> Any:
    """``closed`` (traced by ``trace_program`` for state tags) with the
    accesses of state ``stream`` (of type ``spec``) threaded: ``(stream, *in) -> (*out, stream)``. Other states stay effects
    for an enclosing layer (``seed`` inside ``uncurry``)."""
    return inject_with(closed, _state_injector, {stream: spec},
                       lambda p, _shape=None: is_state_tag(p) and p["name"] == stream,
                       InjectPolicy(hooks=_StateHooks(leaf_names=[stream]), expanded=True))


def initial_states(closed: Any, states: dict[str, StateInfo], args: Sequence[Any]) -> dict:
    """Each state's value at first use when ``closed`` runs on ``args``:
    without running it where every first use is certain from the program's
    structure (``_initial_states_without_run``), else by running it once
    (only what the initial values need is compiled). A state the run never
    reaches starts at the ``init`` of its first ``get_state`` in trace order,
    computed exactly from the program (``unreached_init``), or at zeros if
    it is only ever set."""
    known = _initial_states_without_run(closed, states, args)
    if known is not None:
        return known
    zeros = {n: _FirstUse(jnp.zeros(s.shape, s.dtype), jnp.zeros(s.shape, s.dtype),
                          np.zeros((), bool)) for n, s in states.items()}
    init = inject_with(closed, _init_injector, zeros, is_state_tag, InjectPolicy(
        guard_merge=_reached_by_any_example,
        # sets in a shard_map without vma checking are refused by
        # collect_states; reads record their (replicated) init
        check_per_shard=False,
        # a bwd's replay of the forward pass is never a first use
        replays=False))
    leaves = jax.tree_util.tree_leaves(zeros)
    n_out = len(_jaxpr.jaxpr_parts(closed).outvars)
    # Only (initial, seen) of each state are needed: the program's outputs
    # and what only they need are pruned before compiling (effects stay).
    wanted = {n: _FirstUse(False, True, True) for n in zeros}
    needed = [False] * n_out + jax.tree_util.tree_leaves(wanted)
    outs = iter(jax.jit(_jaxpr.jaxpr_as_fun(_jaxpr.dce_closed(init, needed)))(*leaves, *args))
    # ctx leaves are in the flattened dict's (sorted) key order.
    final = {n: _FirstUse(None, next(outs), next(outs)) for n in sorted(zeros)}
    first_gets = _first_gets(closed)
    result = {}
    for n, (_, initial, seen) in final.items():
        if not isinstance(seen, jax.core.Tracer) and bool(seen):
            result[n] = initial
            continue
        if n not in first_gets:  # only ever set: zeros (already in ``initial``)
            result[n] = initial
            continue
        chain, path = first_gets[n]
        if isinstance(seen, jax.core.Tracer):
            # uncurry inside a traced function: whether the example run
            # reaches the state is itself traced.
            try:
                fallback = unreached_init(chain, path, n, args)
            except StateError as e:
                raise StateError(
                    f"{e} (uncurry is called inside a traced function, so whether the "
                    f"example run reaches it is unknown at trace time)") from None
            result[n] = jax.lax.select(seen, initial, fallback)
        else:
            result[n] = unreached_init(chain, path, n, args)
    return result


# ---- initial values without running the program ----------------------------------

def _initial_states_without_run(closed: Any, states: dict[str, StateInfo],
                                args: Sequence[Any]) -> dict | None:
    """Each state's value at first use, found without running the program
    when every state's first use is certain from the program's structure;
    None where it is not (the example run decides then).

    A state's first access is certain when, walking the program in execution
    order, it is met before any place that may or may not run (a cond
    branch, a while loop, a scan of length 0, a shard_map body, a site
    guarded by vmap) that also accesses the state: the equations of a jaxpr
    run in order, and calls and scans of length >= 1 run their bodies'
    equations in order. A first ``set_state`` means zeros; a first
    ``get_state`` its init, computed from only the part of the program that
    computes it (``unreached_init``; an init that needs a loop's carry or
    another state leaves it to the example run). Constant inits need no
    computation at all."""
    first: dict[str, tuple | None] = {}
    uses_state = _traverse.IdMemo()  # jaxpr -> the states it uses

    def names_in(jaxpr) -> frozenset:
        return uses_state.get_or_compute(jaxpr, lambda: frozenset(
            e.params["name"] for e, _ in _traverse.iter_eqns(jaxpr)
            if e.primitive is tag_p and is_state_tag(e.params)))

    def walk(jaxpr, chain: list, path: tuple[str, ...]) -> bool:
        for eqn in _jaxpr.jaxpr_parts(jaxpr).eqns:
            p = eqn.params
            if eqn.primitive is tag_p:
                if not is_state_tag(p) or p["name"] in first:
                    continue
                if GUARD in p or p.get(BATCHED):
                    return False
                first[p["name"]] = ([*chain, (jaxpr, eqn, None)], path) if p["op"] is GET \
                    else None
                continue
            subs = _traverse.subjaxprs(eqn)
            if not subs:
                continue
            prim = eqn.primitive
            runs_in_order = (prim in _compat.CALL_PRIMITIVES
                             or (prim is _compat.scan_p and p["length"] >= 1))
            for sub, sj in subs:
                if not names_in(sj) - first.keys():
                    continue
                if not runs_in_order:
                    return False
                if not walk(sj, [*chain, (jaxpr, eqn, sub)], path + (sub.label,)):
                    return False
        return True

    if not walk(closed, [], ()) or first.keys() != states.keys():
        return None
    result = {}
    for n, info in states.items():
        aval = core.ShapedArray(info.shape, info.dtype)
        if first[n] is None:  # first set: zeros, as in the example run
            result[n] = jnp.zeros(info.shape, info.dtype)
            continue
        chain, path = first[n]
        try:
            value = unreached_init(chain, path, n, args)
        except StateError:
            return None
        value = _compat.cast_weak_type(value, aval)
        # A fresh array, as the example run gives: the init may be the
        # user's own array (or a const of the program), and state0 may be
        # donated.
        result[n] = value if isinstance(value, core.Tracer) else value.copy()
    return result


# ---- the init of a state the example run never reaches ---------------------------

def _first_gets(closed: Any) -> dict[str, tuple[list, tuple[str, ...]]]:
    """Each state's first ``get_state`` in trace order: ``name -> (chain,
    path)``, ``chain`` the enclosing ``(jaxpr, eqn, sub)`` from the top level
    down, ending with ``(jaxpr, tag_eqn, None)``."""
    out: dict = {}

    def visit(jaxpr, chain, path):
        eqns = _jaxpr.jaxpr_parts(jaxpr).eqns
        clamped = None  # outputs of this jaxpr's clamps (lax.switch's index)
        for eqn in eqns:
            if eqn.primitive is tag_p:
                p = eqn.params
                if p.get("op") is GET and p["name"] not in out:
                    out[p["name"]] = ([*chain, (jaxpr, eqn, None)], path)
                continue
            subs = _traverse.subjaxprs(eqn)
            if eqn.primitive is _compat.cond_p and len(eqn.params["branches"]) == 2:
                if clamped is None:
                    clamped = {v for e in eqns if e.primitive is jax.lax.clamp_p for v in e.outvars}
                if not _is_switch_index(eqn.invars[0], clamped):
                    subs = subs[::-1]  # lax.cond traces the true branch (index 1) first
            for sub, sj in subs:
                visit(sj, [*chain, (jaxpr, eqn, sub)], path + (sub.label,))

    visit(closed, [], ())
    return out


def _is_switch_index(index: Any, clamped: set) -> bool:
    """Whether a two-branch ``cond``'s index comes from ``lax.switch``
    (which traces its branches in index order, and clamps its index) rather
    than ``lax.cond`` (which traces its true branch, index 1, first)."""
    return not isinstance(index, core.Literal) and index in clamped


def _outer_operand(eqn, sub, i: int) -> Any | None:
    """The operand of ``eqn`` that input ``i`` of its sub-jaxpr ``sub`` is
    bound to, the same in every iteration; None if there is none (a loop's
    carry or xs, a shard_map's shard)."""
    prim = eqn.primitive
    if prim in _compat.CALL_PRIMITIVES:
        return eqn.invars[i] if i < len(eqn.invars) else None
    if prim is _compat.cond_p:
        return eqn.invars[1 + i]
    if prim is _compat.scan_p:
        nc, _ = _jaxpr.scan_counts(eqn.params)
        return eqn.invars[i] if i < nc else None
    if prim is _compat.while_p:
        cc, bc = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        if sub.key == "cond_jaxpr":
            return eqn.invars[i] if i < cc else None
        return eqn.invars[cc + i] if i < bc else None
    return None


def unreached_init(chain: list, path: tuple[str, ...], name: str, args: Sequence[Any]) -> Any:
    """The value of a ``get_state``'s init operand that the example run never
    reaches, computed from the program and ``args`` (the top-level inputs).

    The init's computation is sliced out of each enclosing jaxpr, from the
    site outwards; an input of a nested jaxpr is followed to the enclosing
    equation's operand when that operand is the same on every run of the
    body (jit/checkpoint/custom rule arguments, cond operands, loop consts).

    Raises:
        StateError: the init depends on a value that differs per run of its
            body (a loop's carry or xs), on a state, or on an effect.
    """
    where = f"get_state({name!r}) at {format_path(path)}"

    def fail(why: str) -> StateError:
        return StateError(
            f"taxpr: state {name!r}: {where} is never reached when running the example "
            f"arguments, and its init {why}, so its initial value cannot be computed; give "
            f"an init that does not depend on traced values (e.g. a callable), or example "
            f"arguments that reach it")

    def values(level: int, atoms: list) -> list:
        jaxpr = chain[level][0]
        constvars, consts, invars, eqns, _, _, dbg = _jaxpr.jaxpr_parts(jaxpr)
        needed = {a for a in atoms if type(a) is _compat.Var}
        kept = []
        for eqn in reversed(eqns):
            if not any(type(o) is _compat.Var and o in needed for o in eqn.outvars):
                continue
            if eqn.primitive is tag_p:
                if is_state_tag(eqn.params) and eqn.params["op"] is GET:
                    raise fail(f"depends on state {eqn.params['name']!r}")
            elif eqn.effects:
                raise fail(f"depends on an effect ({eqn.primitive.name})")
            kept.append(eqn)
            needed.update(v for v in eqn.invars if type(v) is _compat.Var)
        kept.reverse()
        ins = [v for v in invars if v in needed]
        if ins:
            if level == 0:
                index = {v: k for k, v in enumerate(invars)}
                in_vals = [args[index[v]] for v in ins]
            else:
                _, eqn, sub = chain[level - 1]
                pos = {v: k for k, v in enumerate(invars)}
                outer = [_outer_operand(eqn, sub, pos[v]) for v in ins]
                if any(o is None for o in outer):
                    raise fail(f"depends on a value that changes on every run of "
                               f"{sub.label} (e.g. a loop's carry or xs)")
                in_vals = values(level - 1, outer)
        else:
            in_vals = []
        if consts is None and any(v in needed for v in constvars):
            raise fail("depends on a free variable of an open jaxpr")
        sliced = _jaxpr.make_closed(constvars, consts or [], ins, kept, list(atoms),
                                     _traverse.effects_of_eqns(kept), dbg)
        return list(_jaxpr.jaxpr_as_fun(sliced)(*in_vals))

    _, tag_eqn, _ = chain[-1]
    # A jaxpr that returns a const returns it as it is (e.g. a NumPy array).
    return jnp.asarray(values(len(chain) - 1, [tag_eqn.invars[0]])[0])


class _Traced:
    """One traced signature of ``uncurry``'s function."""

    def __init__(self, fn: Callable, static: Any, dyn_avals, dyn_tree):
        self.closed, self.out_tree = trace_program(
            fn, dyn_tree, dyn_avals, getattr(fn, "__name__", "fn"),
            rebuild=lambda dyn: eqx.combine(dyn, static), consumes=is_state_tag)
        self.states = collect_states(self.closed)
        self.pure = pure_jaxpr(self.closed, self.states)


def uncurry(fn: Callable, *example_args: Any, **example_kwargs: Any):
    """Turn a function that uses ``get_state``/``set_state`` into a pure one.

    Arguments:
        fn: the stateful function. Array leaves of its arguments are traced;
            other leaves are static (as ``equinox.filter_jit`` does).
        *example_args, **example_kwargs: arguments to discover the states
            and compute their initial values with.

    Returns:
        ``(pure, state0)``: ``state0`` is ``{name: initial value}`` and
        ``pure(state, *args, **kwargs) -> (out, new_state)`` is an ordinary
        JAX function (jit, vmap, grad, scan all apply).
    """
    traced = per_signature(lambda static, avals, tree: _Traced(fn, static, avals, tree))
    t0, leaves0 = traced(example_args, example_kwargs)
    state0 = initial_states(t0.closed, t0.states, leaves0)

    def pure(state: dict, *args, **kwargs):
        t, leaves = traced(args, kwargs)
        names = list(t.states)
        missing = [n for n in names if n not in state]
        if missing:
            raise StateError(f"taxpr: uncurry's pure function takes states {names}; "
                             f"missing {missing} (got {sorted(state)})")
        for n in names:
            info, v = t.states[n], state[n]
            if tuple(np.shape(v)) != info.shape or jnp.result_type(v) != info.dtype:
                raise StateError(
                    f"taxpr: state {n!r} must be {info.dtype.name}{list(info.shape)}, got "
                    f"{jnp.result_type(v).name}{list(np.shape(v))}")
        outs = _jaxpr.jaxpr_as_fun(t.pure)(*(state[n] for n in names), *leaves)
        n_out = t.out_tree.num_leaves
        # Entries this call path does not use pass through unchanged, as
        # they would in a dict (e.g. the state of a whole training run).
        return (jax.tree_util.tree_unflatten(t.out_tree, outs[:n_out]),
                {**state, **dict(zip(names, outs[n_out:]))})

    return pure, state0


def per_signature(make: Callable[[Any, tuple, Any], Any]) -> Callable:
    """A cache of ``make(static, avals, dyn_tree)`` per call signature, as
    ``equinox.filter_jit`` keys it: array leaves of ``(args, kwargs)`` are
    traced (their avals count), other leaves are static (hashed, or by id).

    Returns:
        ``lookup(args, kwargs) -> (made, array_leaves)``.
    """
    cache: dict = {}

    def lookup(args: tuple, kwargs: dict) -> tuple[Any, list]:
        dyn, static = eqx.partition((args, kwargs), eqx.is_array)
        leaves, tree = jax.tree_util.tree_flatten(dyn)
        avals = tuple(_compat.abstractify(x) for x in leaves)
        static_leaves, static_tree = jax.tree_util.tree_flatten(static)
        key = (tree, avals, static_tree, tuple(map(_hashable, static_leaves)))
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = make(static, avals, tree)
        return hit, leaves

    return lookup


def _hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return ("id", id(x))


def make_jaxpr_with_states(fun: Callable, static_argnums: int | Sequence[int] = (),
                           static_argnames: str | Sequence[str] = (), axis_env=None,
                           return_shape: bool = False, return_only_write: bool = False):
    """``jax.make_jaxpr`` for stateful functions: the pure program and its states.

    Unlike ``jax.make_jaxpr``, the function it returns gives a pair
    ``(jaxpr, states)``. ``tx.make_jaxpr`` is the same function (taxpr
    0.0.3's name).

    Arguments:
        fun: a function that may use ``get_state`` / ``set_state``.
        static_argnums, static_argnames, axis_env: as for ``jax.make_jaxpr``.
        return_shape: also return the output's ShapeDtypeStruct pytree.
        return_only_write: only written states are outputs.

    Returns:
        A function of ``fun``'s arguments returning ``(jaxpr, states)`` or
        ``(jaxpr, states, out_shape)``: ``jaxpr`` is the pure program
        ``(*state_inputs, *flat_args) -> (*flat_outs, *state_outputs)`` and
        ``states`` a tuple of ``StateInfo`` in the order of the state inputs.
    """

    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)

    def wrapped(*args, **kwargs):
        static_kw = {k: kwargs.pop(k) for k in names if k in kwargs}
        f = functools.partial(fun, **static_kw) if static_kw else fun
        token = _INITS_FOR_TYPES_ONLY.set(True)
        try:
            with keep_tags(), recording_tags() as recorded:
                closed, out_shape = jax.make_jaxpr(
                    f, static_argnums=static_argnums, axis_env=axis_env,
                    return_shape=True)(*args, **kwargs)
                closed = expand_for(closed, is_state_tag)
            check_no_hidden_tags(closed, recorded, is_state_tag)
        finally:
            _INITS_FOR_TYPES_ONLY.reset(token)
        states = collect_states(closed)
        infos = tuple(states.values())
        if not states:
            result = closed
        else:
            result = pure_jaxpr(closed, states)
            if return_only_write:
                result = _keep_written_outputs(result, infos)
        return (result, infos, out_shape) if return_shape else (result, infos)

    return wrapped


make_jaxpr = make_jaxpr_with_states  # taxpr 0.0.3's name


def _keep_written_outputs(closed: Any, infos: Sequence[StateInfo]) -> Any:
    outvars = _jaxpr.jaxpr_parts(closed).outvars
    n_out = len(outvars) - len(infos)
    kept = [*outvars[:n_out], *(v for v, s in zip(outvars[n_out:], infos) if s.written)]
    return _jaxpr.with_parts(closed, outvars=kept)

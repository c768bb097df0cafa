"""The rewrite into a pure function: state accesses become substitutions of
the state's current value (``inject_with`` and a ``direct`` rule), with the
state layer's hooks for the engine."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from .. import _jaxpr
from .._engine import Hooks, RulePolicy, format_path
from .._inject import InjectPolicy, inject_with
from .. import _traverse
from ..primitives._tag import tag_p
from ._collect import (StateInfo, guard_custom_rules, in_custom_vjp_bwd,
                       left_to_enclosing_transformation, rule_error)
from ._ops import GET, SET, StateError, is_state_tag
from ._replicated import replicated_sets


def _state_direct(names: Sequence[str]) -> Callable:
    """``_state_injector`` as atom substitution (see ``_inject``'s ``direct``):
    a get's value is the state's current atom, a set makes its value the
    state's atom. ``names``: the states in ctx leaf order."""
    index = {n: i for i, n in enumerate(names)}

    def direct(params: dict, ctx: list, token: list):
        i = index[params["name"]]
        if params["op"] is GET:
            return [ctx[i]], ctx, ()
        new = list(ctx)
        new[i] = token[0]
        return token, new, (i,)

    return direct


def _state_injector(ctx: dict, token: Any, params: dict):
    name = params["name"]
    if params["op"] is GET:
        return ctx[name], ctx
    return token, {**ctx, name: token}


class FirstUse(NamedTuple):
    """One state's ctx entry while ``initial_states`` runs the program."""

    value: Any  # the state's current value
    initial: Any  # its value at first use (zeros until then)
    seen: Any  # whether it has been used (a bool scalar)


def init_injector(ctx: dict, token: Any, params: dict):
    """Run with eager semantics and record each state's value at first use
    (``ctx[name]``: a ``FirstUse``)."""
    name = params["name"]
    use = ctx[name]
    yes = jnp.ones((), bool)
    if params["op"] is GET:
        # lax.select, not jnp.where: it takes every dtype (typed keys too).
        new = jax.lax.select(use.seen, use.value, token)
        return new, {**ctx, name: FirstUse(new, jax.lax.select(use.seen, use.initial, token),
                                            yes)}
    # A state first set (never read before) starts at zeros.
    return token, {**ctx, name: FirstUse(token, use.initial, yes)}


def reached_by_any_example(guard, old: list, new: list) -> list:
    """A first use inside a cond/while whose predicate vmap batches (reads
    only: sets there are errors) counts when any example reaches it; the
    recorded values are unbatched, the same for every example."""
    reached = jnp.any(guard)
    return [jax.lax.select_n(reached, o, n) for o, n in zip(old, new)]


def _state_ctx(states: dict[str, StateInfo], values: dict | None = None) -> dict:
    if values is None:
        return {n: jax.ShapeDtypeStruct(s.shape, s.dtype) for n, s in states.items()}
    return values


class _StateRules(RulePolicy):
    """When the pure function is differentiated from outside, the custom_jvp
    rule or custom_vjp fwd of a function whose body uses state runs in its
    place with the state threaded through it (as eagerly). Accesses in a
    custom_vjp bwd (it runs after the forward returned its states), and sets
    of states the function never touches, are errors."""

    in_place = True
    checks_untraced = True

    def __init__(self, names: frozenset | None):
        self.names = names
        # Any custom_jvp rule may read a state (a gradient scale kept in
        # state) though its function's body uses none: with states to
        # thread, every custom_jvp function outside a custom_vjp takes them,
        # and its rule, when JAX runs it, is threaded (traced then, never
        # ahead of JAX).
        self.may_hold_sites = bool(names)

    def untraced_site(self, params: dict, path: tuple[str, ...]) -> Exception:
        return rule_error(params["name"], params["op"], path)

    def check(self, rule: Any, path: tuple[str, ...]) -> None:
        if self.names is None:
            return
        for eqn, sub in _traverse.iter_eqns(rule, path):
            if not (eqn.primitive is tag_p and is_state_tag(eqn.params)
                    and eqn.params["name"] not in self.names):
                continue
            name, op = eqn.params["name"], eqn.params["op"]
            if in_custom_vjp_bwd(sub):
                if not left_to_enclosing_transformation(name, sub, self.names):
                    raise rule_error(name, op, sub)
            elif op is SET:
                raise StateError(
                    f"taxpr: state {name!r}: set_state({name!r}) at {format_path(sub)} is in a "
                    f"derivative rule, and the function itself never touches {name!r}, so "
                    f"uncurry's pure function has no such state to write it to (its states "
                    f"are {sorted(self.names)}). Give the state a place in the function: a "
                    f"get_state({name!r}, init) there makes uncurry thread it")


class _StateHooks(Hooks):
    """The state layer's hooks: derivative rules as ``_StateRules`` says,
    errors that name states.

    Arguments:
        names: the states threaded (``None``: another layer may own the
            states it leaves, e.g. ``seed`` inside ``uncurry``).
        leaf_names: the state of each ctx leaf, for messages (default
            ``names``).
    """

    def __init__(self, names: Sequence[str] | None = None,
                 leaf_names: Sequence[str] | None = None):
        self.names = None if names is None else frozenset(names)
        leaf_names = names if leaf_names is None else leaf_names
        self.leaf_names = None if leaf_names is None else list(leaf_names)
        self.rules = _StateRules(self.names)

    def describe_ctx(self, index: int) -> str:
        if self.leaf_names is None:
            return super().describe_ctx(index)
        return f"state {self.leaf_names[index]!r}"

    def varying_ctx(self, index, params, path, axes) -> Exception:
        name = self.describe_ctx(index) if self.leaf_names is not None else (
            f"state {params.get('name')!r}")
        return StateError(
            f"taxpr: {name}: set_state at {format_path(path)} sets a value that differs "
            f"across the shards of the shard_map (it varies over mesh axes {sorted(axes)}), "
            f"and a state enters a shard_map replicated, the same on every shard: reduce "
            f"the value over the axes first (lax.pmean / lax.psum), or return the per-shard "
            f"value through out_specs instead of setting a state")

    def differentiated_write(self, index: int, path: tuple[str, ...]) -> Exception:
        name = self.describe_ctx(index)
        return StateError(
            f"taxpr: {name}: the custom_vjp call at {format_path(path)} sets it from inputs "
            f"that are differentiated, and the derivative of {name} is asked for. The call's "
            f"fwd ran in the function's place and its bwd gives derivatives of the outputs "
            f"only (a checkpointed loop, e.g. equinox's checkpointed while_loop / scan or "
            f"diffrax's RecursiveCheckpointAdjoint, cannot be differentiated another way). "
            f"Return the value from the function instead of setting it, or use a loop JAX "
            f"differentiates (lax.scan with jax.checkpoint)")

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


def pure_jaxpr(closed: Any, states: dict[str, StateInfo]) -> Any:
    """``closed`` (traced by ``trace_program`` or ``make_jaxpr_with_states``,
    so expanded for state tags) with state accesses threaded: ``(*states,
    *in) -> (*out, *states)``."""
    ctx = _state_ctx(states)
    # ctx leaves are in the flattened dict's (sorted) key order.
    names = jax.tree_util.tree_leaves({n: n for n in ctx})
    # A state read only in a derivative rule is not among them: it reads its
    # init there (nothing in the program writes it).
    return inject_with(guard_custom_rules(closed, threads_custom_jvps=bool(names), names=ctx),
                       _state_injector, ctx,
                       lambda p, _shape=None: is_state_tag(p) and p["name"] in ctx,
                       InjectPolicy(hooks=_StateHooks(names), direct=_state_direct(names),
                                    expanded=True,
                                    check_per_shard=_unproven_sets(closed)))


def _unproven_sets(closed: Any) -> Callable:
    """The engine's per-shard check (``InjectPolicy.check_per_shard``) for
    ``closed``: at every tag but the sets ``collect_states`` let through in
    a shard_map without vma checking, proven the same on every shard
    (``_replicated``). Tags traced later (a derivative rule's) are checked.
    The analysis runs only if such a shard_map holds a tag."""
    proven: list = []

    def check(eqn) -> bool:
        if not proven:
            proven.append(replicated_sets(closed))
        return not proven[0].proves(eqn)
    return check


def stream_pure_jaxpr(closed: Any, stream: str, spec: Any) -> Any:
    """``closed`` (traced by ``trace_program`` for state tags) with the
    accesses of state ``stream`` (of type ``spec``) threaded: ``(stream, *in) -> (*out, stream)``. Other states stay effects
    for an enclosing layer (``seed`` inside ``uncurry``)."""
    return inject_with(closed, _state_injector, {stream: spec},
                       lambda p, _shape=None: is_state_tag(p) and p["name"] == stream,
                       InjectPolicy(hooks=_StateHooks(leaf_names=[stream]), expanded=True))


def keep_written_outputs(closed: Any, infos: Sequence[StateInfo]) -> Any:
    outvars = _jaxpr.jaxpr_parts(closed).outvars
    n_out = len(outvars) - len(infos)
    kept = [*outvars[:n_out], *(v for v, s in zip(outvars[n_out:], infos) if s.written)]
    return _jaxpr.with_parts(closed, outvars=kept)

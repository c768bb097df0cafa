"""Finding a program's states and checking where they are used: each state's
shape and dtype (``collect_states``) and the custom derivative rules that
taxpr cannot thread (``guard_custom_rules``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from .. import _compat, _jaxpr
from .._engine import THREAD_RULES, format_path, in_custom_vjp
from .._find import TagSite, tag_shape
from .. import _traverse
from .._inject import guarded_place
from ..primitives._tag import guarding_tags, is_guarded, keeping_tags, meta, tag_p, user_params
from ._ops import GET, SET, LeafName, StateError, StateOp, is_state_tag
from ._replicated import is_unchecked_shard_map, replicated_sets
from ._scope import scope_path


@dataclasses.dataclass(frozen=True)
class StateInfo:
    """A state found by ``make_jaxpr``.

    A pytree-valued state has one ``StateInfo`` per array: ``name`` is
    then the state's name and the leaf's key path (``"stats['mean']"``;
    ``name.state`` and ``name.path`` are the parts) and ``tree`` the
    state's structure.

    Attributes:
        name: the state's name.
        shape: its shape.
        dtype: its dtype.
        read: whether the program reads it (``get_state``).
        written: whether the program writes it (``set_state``).
        tree: for one array of a pytree-valued state, the state's
            ``PyTreeDef``; None for a state that is one array.
    """

    name: str
    shape: tuple[int, ...]
    dtype: Any
    read: bool
    written: bool
    tree: Any = None


def _at(eqn, path) -> str:
    """Where a state access is, as "at <path> (<user's line>)": its path
    through nested primitives and the line of the user's code that made it.
    At the top level the line alone, "(<line>)" (a vmap leaves no primitive
    on the path: a batched cond's branches are inlined at the top level)."""
    line = _compat.user_line(eqn.source_info.traceback)
    if line is None:
        return f"at {format_path(path)}"
    return f"({line})" if not path else f"at {format_path(path)} ({line})"


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
        if p["op"] is SET and is_guarded(p) and p.get("by") == "next_key":
            raise StateError(
                f"taxpr: stream {p['name']!r}: next_key {_at(eqn, path)} is inside "
                f"{guarded_place(p)} whose predicate is batched by vmap: only some examples "
                f"take it, so the stream's key would advance per example, and a stream's "
                f"key is not batched (draw the key before the cond/while and pass it in, or "
                f"vmap the pure function over a batch of keys)")
        if p["op"] is SET and is_guarded(p):
            raise StateError(
                f"taxpr: state {p['name']!r}: set_state {_at(eqn, path)} is inside "
                f"{guarded_place(p)} whose predicate is batched by vmap: only some examples "
                f"take it, so the state's new value would differ per example, and a state is "
                f"not batched (compute the new value with jnp.where and set it outside the "
                f"cond/while, or vmap the pure function over a batch of states)")
        if p["op"] is SET and meta(p).batched:
            raise StateError(
                f"taxpr: state {p['name']!r}: set_state {_at(eqn, path)} sets a value "
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
    _check_trees(sites)
    states: dict[str, StateInfo] = {}
    first: dict[str, tuple] = {}
    first_avals: dict[str, Any] = {}
    for eqn, path in sites:
        p = eqn.params
        name, op, aval = p["name"], p["op"], tag_shape(eqn)
        if name not in states:
            states[name] = StateInfo(name, tuple(aval.shape), aval.dtype,
                                     op is GET, op is SET, p.get("state_tree"))
            first[name] = (eqn, path)
            first_avals[name] = aval
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
        first_aval = first_avals[name]
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
    _check_scopes_and_states_apart(first)
    return dict(sorted(states.items()))


def _check_scopes_and_states_apart(first: dict[str, tuple]) -> None:
    """A ``tx.scope`` may not have a state's name beside it (the state dict
    would need both under one key): the error names both places."""
    places = {getattr(name, "state", name): at for name, at in first.items()}
    for name, at in places.items():
        parts = scope_path(name)
        for i in range(1, len(parts)):
            scope = "/".join(parts[:i])
            if scope in places:
                raise StateError(
                    f"taxpr: {scope!r} is both a state and a tx.scope: "
                    f"{_describe_site(_site(*places[scope]))}, and "
                    f"{_describe_site(_site(*at))} inside tx.scope({parts[i - 1]!r}); give one "
                    f"of them another name")


def tree_paths(tree: Any) -> list[str]:
    """The key paths of a ``PyTreeDef``'s leaves, in order (``"[0]"``, ``".mean"``)."""
    example = jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves)
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(example)[0]]


def first_differences(want: list[str], got: list[str]) -> tuple[str | None, str | None]:
    """The first key path ``got`` has and ``want`` has not, and the first
    ``want`` has and ``got`` has not (None where there is none)."""
    extra = next((p for p in got if p not in want), None)
    lacks = next((p for p in want if p not in got), None)
    return extra, lacks


def _check_trees(sites: list) -> None:
    """Every access of a pytree-valued state has one structure, and no
    access treats it as one array (the error names the leaf that differs)."""
    first: dict[str, tuple] = {}  # state -> (its tree or None, eqn, path) at first access
    for eqn, path in sites:
        p = eqn.params
        name = p["name"]
        state = name.state if isinstance(name, LeafName) else name
        tree = p.get("state_tree")
        hit = first.setdefault(state, (tree, eqn, path))
        if (hit[0] is None) == (tree is None) and (tree is None or hit[0] == tree):
            continue
        where = _describe_site(_site(eqn, path)).replace(repr(name), repr(state))
        there = _describe_site(_site(hit[1], hit[2])).replace(
            repr(hit[1].params["name"]), repr(state))
        if hit[0] is None or tree is None:
            one, many = (there, where) if hit[0] is None else (where, there)
            raise StateError(
                f"taxpr: state {state!r}: {one} gives it one array, but {many} gives it a "
                f"pytree of arrays; a state keeps one structure")
        extra, lacks = first_differences(tree_paths(hit[0]), tree_paths(tree))
        leaf = (f"leaf {state}{extra} is new" if extra else
                f"leaf {state}{lacks} is missing" if lacks else "the containers differ")
        raise StateError(
            f"taxpr: state {state!r}: {where} has structure {tree}, but {there} gave it "
            f"structure {hit[0]}: {leaf}; a state keeps one structure")


def _site(eqn, path: tuple[str, ...]) -> TagSite:
    return TagSite(user_params(eqn.params), tag_shape(eqn), path)


def _walk_program(closed: Any) -> tuple[list, list]:
    """One walk over the program (what ``collect_states`` checks), in
    program order: ``(sites, unchecked_sets)``: every state access
    ``(eqn, path)``; the sets inside a shard_map without vma checking
    (``check_vma=False``, as ``jax.pmap`` uses) whose value is not proven
    the same on every shard (``_replicated``; an error: the value may
    differ per shard and a state is one value)."""
    sites: list = []
    unchecked_sets: list = []

    def subs(eqn, path, unchecked: bool):
        return _traverse.every_sub(eqn, path, unchecked or is_unchecked_shard_map(eqn))

    for eqn, path, unchecked in _traverse.walk(closed, subs, False):
        if eqn.primitive is tag_p and is_state_tag(eqn.params):
            sites.append((eqn, path))
            if unchecked and eqn.params["op"] is SET:
                unchecked_sets.append((eqn, path))
    if unchecked_sets:  # the analysis runs only where it has sets to prove
        replicated = replicated_sets(closed)
        unchecked_sets = [(e, p) for e, p in unchecked_sets if not replicated.proves(e)]
    return sites, unchecked_sets


def left_to_enclosing_transformation(name: str, path: tuple[str, ...],
                                     names: Any) -> bool:
    """Whether an access to state ``name`` in the custom_vjp bwd at ``path``
    is left a tag for the transformation whose trace JAX runs the bwd in: a
    state the function never touches (not among ``names``, the states
    threaded), where the pure function is differentiated inside another
    taxpr transformation's trace (``tx.value_and_grad``, ``uncurry`` inside
    ``uncurry``). That transformation threads it where the backward pass
    runs, as eagerly (a gradient norm the bwd logs). Elsewhere the bwd runs
    after the pure function returned its states, and the access is an
    error."""
    return (keeping_tags() and names is not None and name not in names
            and in_custom_vjp_bwd(path))


def in_custom_vjp_bwd(path: tuple[str, ...]) -> bool:
    """Whether ``path`` is inside a custom_vjp's bwd."""
    return any(p.startswith("custom_vjp[bwd]") for p in path)


def guard_custom_rules(closed: Any, threads_custom_jvps: bool = True,
                       names: Any = None) -> Any:
    """``closed`` with the fwd and bwd of its ``custom_vjp`` functions whose
    body uses no state, and the rules of the ``custom_jvp`` functions inside
    those, checked when JAX runs them: state accesses there are an error
    (other ``custom_jvp`` functions are threaded whole, rules included, see
    ``_StateRules.may_hold_sites``), and of those inside a primitive
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
    False: their rules are checked too. ``names``: the states threaded (see
    ``left_to_enclosing_transformation``).
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
            # threaded whole, rules included: ``RulePolicy.may_hold_sites``.)
            return None
        if _traverse.holds(eqn, lambda e: e.primitive is tag_p and is_state_tag(e.params)):
            return None  # threaded by the engine, which checks its rules itself
        p = eqn.params
        if prim is _compat.custom_jvp_call_p:
            user_jvp = p["jvp_jaxpr_fun"]
            at = path + ("custom_jvp[jvp rule]",)

            def jvp_jaxpr_fun(*zeros):
                out = user_jvp.call_wrapped(*zeros)
                _reject_state_in_rule(out[0], at)
                return out
            return [eqn.replace(params=dict(p, jvp_jaxpr_fun=_jaxpr.wrap_fun(
                jvp_jaxpr_fun, user_jvp)))]
        user_fwd, user_bwd = p["fwd_jaxpr_thunk"], p["bwd"]
        fwd_at, bwd_at = path + ("custom_vjp[fwd]",), path + ("custom_vjp[bwd]",)

        def fwd_jaxpr_thunk(*zeros):
            out = user_fwd.call_wrapped(*zeros)
            _reject_state_in_rule(out[0], fwd_at)
            return out

        def bwd(*args):
            with guarding_tags(lambda params, value: rule_error(
                    params["name"], params["op"], bwd_at)
                    if is_state_tag(params) and not left_to_enclosing_transformation(
                        params["name"], bwd_at, names) else None):
                return bwd_call(*args)
        bwd_call = user_bwd.call_wrapped
        return [eqn.replace(params=dict(
            p, fwd_jaxpr_thunk=_jaxpr.wrap_fun(fwd_jaxpr_thunk, user_fwd),
            bwd=_jaxpr.wrap_fun(bwd, user_bwd)))]

    return _traverse.map_jaxpr(closed, rewrite)


def _reject_state_in_rule(rule_jaxpr: Any, path: tuple[str, ...]) -> None:
    for eqn, sub in _traverse.iter_eqns(rule_jaxpr, path):
        if eqn.primitive is tag_p and is_state_tag(eqn.params):
            raise rule_error(eqn.params["name"], eqn.params["op"], sub)


def rule_error(name: str, op: StateOp, path: tuple[str, ...]) -> StateError:
    where = f"{op.kind}_state({name!r}) at {format_path(path)}"
    if in_custom_vjp_bwd(path):
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

"""The checks: a program through one of taxpr's transformations against
the eager reference.

``check_uncurry``, ``check_reap``, ``check_harvest``, ``check_vmap``,
``check_vmap_inside``, ``check_derivatives`` (against finite differences of
the reference), ``check_grad_inside``, ``check_tx_grad_inside``, ``check_raw_reap`` and
``check_as_users_run`` (the hoisted rendering after a warm-up). ``run_check``
runs one: it labels the program's features as hypothesis events (and
records them: ``_CHECKED``, ``_GENERATED``; with ``_DRAW_ONLY`` it checks
nothing) and attaches the program's source to a failure. The assert helpers
compare outputs, states and reaps (floats to a tolerance; integers, typed
states and keys exactly). ``VIOLATIONS``: harvest's static rules broken on
purpose, and the errors they raise.
"""

from __future__ import annotations

import collections
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import assume, event
from hypothesis.errors import InvalidArgument

import taxpr as tx
from taxpr import harvest as h

from helpers import check

from .analysis import (append_slots, children, rule_functions, rule_sow_in_branch, rule_sows,
                       sow_names, states_of, stateful_custom_rules, uses_state, walk)
from .model import (ENV, FUNCTIONS, PYTREE_INT, PYTREE_STATES, STATES, T, TYPED_STATES, Bump,
                    Cond, CustomVjp, EqxLoop, Fori, Program, Scan, Scope, Set, Sow, Switch, Tree,
                    While, base_name, has_rule, not_differentiated, rule_split, sow_kind,
                    tree_leaf_kinds, typed_next)
from .reference import Ambiguous, Reference, _is_key, flat_states
from .render import build, build_hoisted, to_source


# ---------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------

TOL = dict(rtol=2e-4, atol=2e-4)


def assert_close(got, want, what: str) -> None:
    if isinstance(want, (tuple, dict)):  # a pytree state's value: the same tree, leaf by leaf
        g_leaves, g_tree = jax.tree_util.tree_flatten(got)
        w_paths, w_tree = jax.tree_util.tree_flatten_with_path(want)
        assert g_tree == w_tree, f"{what}: tree {g_tree} != reference {w_tree}"
        for g, (path, w) in zip(g_leaves, w_paths):
            assert_close(g, w, f"{what}{jax.tree_util.keystr(path)}")
        return
    if _is_key(want):
        assert _is_key(got) and got.dtype == want.dtype, f"{what}: {got!r} is not a {want.dtype}"
        assert np.array_equal(jax.random.key_data(got), jax.random.key_data(want)), \
            f"{what}: key {jax.random.key_data(got)} != reference {jax.random.key_data(want)}"
        return
    g = np.asarray(got)
    w = np.asarray(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != reference {w.shape}"
    if not isinstance(want, int) and w.dtype not in (np.float64, np.int64):
        # A typed value (a typed state, an extra state entry): exact.
        assert g.dtype == w.dtype, f"{what}: dtype {g.dtype}, expected {w.dtype}"
        assert np.array_equal(_bits(g), _bits(w)), f"{what}: {g} != reference {w} (bitwise)"
        return
    if isinstance(want, int) or w.dtype.kind in "iu":
        assert g.dtype == np.int32, f"{what}: dtype {g.dtype}, expected int32"
        assert np.array_equal(g, w), f"{what}: {g} != reference {w}"
        return
    assert g.dtype == np.float32, f"{what}: dtype {g.dtype}, expected float32"
    np.testing.assert_allclose(g, w, err_msg=what, **TOL)


def _bits(a: np.ndarray) -> np.ndarray:
    """The values of a typed array, comparable bit for bit: integers as
    int64, floats (every float type widens exactly to float32, -0.0 and NaNs
    included) and complex parts as float32 bit patterns."""
    if a.dtype == np.bool_ or jnp.issubdtype(a.dtype, jnp.integer):
        return a.astype(np.int64)
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        a = np.stack([a.real, a.imag])
    return np.ascontiguousarray(np.atleast_1d(a.astype(np.float32))).view(np.uint32)


def assert_dict_close(got: dict, want: dict, what: str) -> None:
    """Two dicts of states (or reaps): a state dict nested by scope is
    compared by full names ("sa/s0"), a pytree state leaf by leaf."""
    got, want = flat_states(got), flat_states(want)
    assert set(got) == set(want), f"{what}: keys {sorted(got)} != reference {sorted(want)}"
    for k in want:
        assert_close(got[k], want[k], f"{what}[{k!r}]")


def info_names(state: dict) -> list[str]:
    """The ``StateInfo`` names of a state dict's arrays, sorted: a state's
    full name, a pytree state's followed by each leaf's key path
    (``"sa/pt[0]"``, ``'pd["w"]'`` as JAX writes it)."""
    out = []
    for name, value in flat_states(state).items():
        if isinstance(value, (tuple, dict)):
            out += [name + jax.tree_util.keystr(p)
                    for p, _ in jax.tree_util.tree_flatten_with_path(value)[0]]
        else:
            out.append(name)
    return sorted(out)


def assert_outs_close(got, want, what: str) -> None:
    assert len(got) == len(want)
    for name, g, w in zip(ENV, got, want):
        assert_close(g, w, f"{what} {name}")


def perturb(state: dict) -> dict:
    """Another valid state: floats moved, the counter advanced, typed states
    (and pytree states' int8 leaves) updated exactly; scopes (``StateScope``)
    kept."""
    out = {}
    for k, v in state.items():
        if isinstance(v, tx.StateScope):
            out[k] = perturb(v)
        elif _is_key(v):  # another key for the stream
            out[k] = jax.random.fold_in(v, 7)
        elif k in TYPED_STATES:
            out[k] = typed_next(TYPED_STATES[k], v)
        elif k in PYTREE_STATES:
            out[k] = jax.tree_util.tree_map(
                lambda x: (typed_next(PYTREE_INT, x) if np.asarray(x).dtype.kind == "i"
                           else _moved(x)), v)
        else:
            out[k] = _moved(v)
    return type(state)(out)


def _moved(v):
    a = np.asarray(v)
    return (a + 1 if a.dtype.kind in "iu" else a * -0.5 + 0.25).astype(a.dtype)


def nest_states(flat: dict) -> dict:
    """A flat dict of states keyed by full names as ``uncurry``'s state
    dict: nested by scope in ``tx.StateScope`` dicts."""
    out: dict = {}
    for name, value in flat.items():
        *scopes, base = name.split("/")
        at = out
        for sc in scopes:
            at = at.setdefault(sc, tx.StateScope())
        at[base] = value
    return out


def float_slots(state: dict) -> list[tuple]:
    """The float32 arrays of a state dict that the derivative checks
    differentiate: ``(full name, leaf index)`` of the states of ``STATES``
    (leaf None: the value) and of the float leaves of pytree states, sorted
    by full name."""
    out = []
    for name, _ in sorted(flat_states(state).items()):
        base = base_name(name)
        if base in STATES:
            out.append((name, None))
        elif base in PYTREE_STATES:
            out += [(name, i) for i, k in enumerate(tree_leaf_kinds(base)) if k != "i8"]
    return out


def slot_values(state: dict, slots: list) -> list:
    flat = flat_states(state)
    return [flat[n] if i is None else jax.tree_util.tree_leaves(flat[n])[i] for n, i in slots]


def with_slots(state: dict, slots: list, values) -> dict:
    """``state`` (nested or flat) with the arrays ``slots`` replaced by
    ``values``, as a nested state dict."""
    flat = dict(flat_states(state))
    for (name, i), x in zip(slots, values):
        if i is None:
            flat[name] = x
        else:
            leaves, tree = jax.tree_util.tree_flatten(flat[name])
            leaves[i] = x
            flat[name] = jax.tree_util.tree_unflatten(tree, leaves)
    return nest_states(flat)


def reference(program, args, states=None, plants=None, diff: bool = False):
    """Run the reference (``diff``: differentiated, see ``Reference``); a
    predicate too close to call makes hypothesis discard the example."""
    try:
        return Reference(program, states, plants, diff).run(args)
    except Ambiguous:
        assume(False)


def make_plants(program: Program, rng: np.random.Generator, fraction=0.5, rules: bool = False,
                append: bool = True) -> dict:
    """Random plants for some of the sown names (right shapes and dtypes);
    ``rules``: of the names sown in rules too (``sow_names``); not of the
    append names without ``append``."""
    plants = {}
    slots = append_slots(program)
    for name, mode in sorted(sow_names(program, rules).items()):
        if rng.random() > fraction or (mode == "append" and not append):
            continue
        kind = sow_kind(name)
        if mode == "append":
            sl = slots[name]
            rows = sum(s.rows() for s in sl)
            shape = (rows, *sl[0].shape()[1:]) if sl[0].lens else (rows, *sl[0].shape())
        else:
            shape = (3,) if kind == "V" else ()
        plants[name] = rng.uniform(-2, 2, shape).astype(np.float32)
    return plants


def features(program: Program) -> set[str]:
    """Labels for ``hypothesis.event`` (see --hypothesis-show-statistics)."""
    out = set()
    sown = sow_names(program)

    def visit(stmts, depth, lens, owner, owners=()):
        out.add(f"depth {depth}")
        for s in stmts:
            name = type(s).__name__
            if isinstance(s, Bump):
                name = f"typed_state {TYPED_STATES[s.state]}"
                out.add(f"typed_state {s.op}" + (" mixed" if s.target else ""))
                out.add(f"typed_state in {owner}")
            elif isinstance(s, Sow):
                name = f"sow {s.mode}" + (" (other tag)" if s.tag != T else "")
                if s.mode == "append" and s.tag == T and lens:
                    name += f" in scan depth {len(lens)}"
            elif isinstance(s, Tree):
                name = f"pytree_state {s.state} {s.op}"
                out.add(f"pytree_state in {owner}")
                out.update(f"pytree_state under {o}" for o in owners)
            elif isinstance(s, Scope):
                out.add(f"Scope in {owner}")
                out.update(f"Scope under {o}" for o in owners)
            elif isinstance(s, Scan):
                name = f"scan len {s.length}" + (" reverse" if s.reverse else "")
            elif isinstance(s, While):
                name = (f"while {s.kind}" + (" spred" if s.spred else "")
                        + (" cbump" if s.cbump else ""))
            if isinstance(s, FUNCTIONS) and s.scopes:
                out.add(f"{name} called in scopes")
                if len(set(s.scopes)) > 1:
                    out.add(f"{name} called in two scopes")
            if has_rule(s):
                out.add(f"rule statements in {name}")
                if s.scopes or "Scope" in owners:
                    out.add("rule statements in a tx.scope")
                out.update(f"rule {type(r).__name__} in {name}" for r in s.rule)
                if any(isinstance(r, Sow) and r.tag == T and r.name in sown for r in s.rule):
                    out.add(f"rule Sow of a name sown outside rules in {name}")
                before, after = rule_split(s)
                body_names = set(sow_names(Program(s.body)))
                for where, stmts in (("before", before), ("after", after)):
                    if any(isinstance(r, Sow) and r.tag == T and r.name in body_names
                           for r in stmts):
                        out.add(f"rule Sow {where} its function of a name it sows in {name}")
            out.add(name)
            lens2 = (*lens, s.length) if isinstance(s, Scan) else lens
            for b in children(s):
                visit(b, depth + 1, lens2, type(s).__name__, (*owners, type(s).__name__))

    visit(program.body, 0, (), "program")
    return out


def _event(label: str) -> None:
    """``hypothesis.event``; nothing when a check runs outside hypothesis."""
    try:
        event(label)
    except InvalidArgument:
        pass


_RUNS = [0]
# What this process checked: programs per check, and every feature of them.
_CHECKED: collections.Counter = collections.Counter()
_GENERATED: set = set()
# Set by test_ci_profile_generates_typed_states_everywhere: the CI profile's
# tests draw their programs and record them, but check none.
_DRAW_ONLY = False


def run_check(check, program, *params):
    """``check(program, *params)``; a failure carries the program's source and
    the check's arguments."""
    _RUNS[0] += 1
    if _RUNS[0] % 250 == 0:  # every program compiles new jaxprs: bound the caches
        jax.clear_caches()
    _CHECKED[check.__name__] += 1
    labels = features(program)
    if rules_differentiated(check.__name__, program):  # "check_grad_inside: rule Draw in ..."
        labels |= {f"{check.__name__}: {f}" for f in labels if f.startswith("rule ")}
    for f in sorted(labels):
        _GENERATED.add(f)
        event(f)
    if _DRAW_ONLY:
        return
    try:
        check(program, *params)
    except Exception as e:  # noqa: BLE001 - re-raised with the program attached
        call = ", ".join(["program", *map(repr, params)])
        e.add_note(f"fuzz program (failed {check.__name__}({call})):\n{to_source(program)}")
        raise


# ---------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------

def check_uncurry(program, args, args2, jit: bool):
    """uncurry: state0, pure(state0) (not jitted), pure(other state) (jitted or not)."""
    fn = build(program)
    out_r, fin_r, s0_r, _ = reference(program, args)
    pure, state0 = tx.uncurry(fn, *args)
    assert_dict_close(state0, s0_r, "state0")
    if not jit:
        out, fin = pure(state0, *args)
        assert_outs_close(out, out_r, "pure(state0) out")
        assert_dict_close(fin, fin_r, "pure(state0) state")
        closed, infos = tx.make_jaxpr(fn)(*args)
        check(closed)
        assert [i.name for i in infos] == info_names(s0_r)
        check(jax.make_jaxpr(pure)(state0, *args))  # the rewritten jaxprs, bound again
    other = perturb(state0)
    out_r2, fin_r2, _, _ = reference(program, args2, other)
    run = jax.jit(pure) if jit else pure
    out2, fin2 = run(other, *args2)
    assert_outs_close(out2, out_r2, "pure(other state) out")
    assert_dict_close(fin2, fin_r2, "pure(other state) state")


def check_reap(program, args, jit: bool, compose: str, filt: tuple):
    """reap of the uncurried function (or uncurry of the reaped one), with an
    allowlist or blocklist ``filt = (kind, names)``."""
    fn = build(program)
    pure, state0 = tx.uncurry(fn, *args)
    state = perturb(state0)
    out_r, fin_r, _, reaps_r = reference(program, args, state)
    kind, names = filt
    kw = {} if kind is None else {kind: names}
    if kind is not None:
        keep = (lambda n: n in names) if kind == "allowlist" else (lambda n: n not in names)
        reaps_r = {k: v for k, v in reaps_r.items() if keep(k)}
    if compose == "reap(pure)":
        car = h.call_and_reap(pure, tag=T, **kw)
        (out, fin), reaps = (jax.jit(car) if jit else car)(state, *args)
        if not jit:
            check(jax.make_jaxpr(car)(state, *args))
    else:
        pure2, _ = tx.uncurry(h.call_and_reap(fn, tag=T, **kw), *args)
        (out, reaps), fin = (jax.jit(pure2) if jit else pure2)(state, *args)
    assert_outs_close(out, out_r, f"{compose} out")
    assert_dict_close(fin, fin_r, f"{compose} state")
    assert_dict_close(reaps, reaps_r, f"{compose} reaps")


def check_harvest(program, args, seed: int, jit: bool):
    """harvest (plant some names, reap the others) of the uncurried function."""
    fn = build(program)
    pure, state0 = tx.uncurry(fn, *args)
    plants = make_plants(program, np.random.default_rng(seed))
    out_r, fin_r, _, reaps_r = reference(program, args, dict(state0), plants)
    hv = h.harvest(pure, tag=T)
    (out, fin), reaps = (jax.jit(hv) if jit else hv)(plants, state0, *args)
    assert_outs_close(out, out_r, "harvest out")
    assert_dict_close(fin, fin_r, "harvest state")
    assert_dict_close(reaps, reaps_r, "harvest reaps")
    if plants and not jit:
        out_p = h.plant(pure, tag=T)(plants, state0, *args)[0]
        assert_outs_close(out_p, out_r, "plant out")


def _stack(a, b):
    if _is_key(a):
        return jnp.stack([a, b])
    return np.stack([np.asarray(a), np.asarray(b)])


def check_vmap(program, args, args2, with_reap: bool):
    """vmap of the pure function (or of reap of it) over a batch of two states
    and two argument sets: each row matches its own reference run."""
    fn = build(program)
    pure, state0 = tx.uncurry(fn, *args)
    states = (dict(state0), perturb(state0))
    refs = [reference(program, a, s) for a, s in zip((args, args2), states)]
    bstate = jax.tree_util.tree_map(_stack, *states)
    bargs = [_stack(a, b) for a, b in zip(args, args2)]
    if with_reap:
        (out, fin), reaps = jax.vmap(h.call_and_reap(pure, tag=T))(bstate, *bargs)
    else:
        (out, fin), reaps = jax.vmap(pure)(bstate, *bargs), None
    for row, (out_r, fin_r, _, reaps_r) in enumerate(refs):
        pick = lambda tree: jax.tree_util.tree_map(lambda x: x[row], tree)  # noqa: E731
        assert_outs_close(pick(out), out_r, f"vmap row {row} out")
        assert_dict_close(pick(fin), fin_r, f"vmap row {row} state")
        if with_reap:
            assert_dict_close(pick(reaps), reaps_r, f"vmap row {row} reaps")


def _objective(out, state, reaps=None) -> Any:
    """A scalar of every float output, float32 state (``float_slots``: the
    float leaves of pytree states too) and reaped value."""
    leaves = [*out, *slot_values(state, float_slots(state)),
              *(v for _, v in sorted((reaps or {}).items()))]
    return sum(leaves[i].sum() * (i + 1) * 0.1 for i in range(len(leaves)))


def check_stateful_rules_differentiated(program, pure, state, args, can_jvp, can_grad,
                                        variant: str = "pure", seed: int = 0, plants=None):
    """Differentiated from outside, a custom function with stateful rules
    runs its rule instead (JAX's semantics): its rule statements, then
    ``jax.jvp`` of the function itself (custom_jvp) or the plain function
    (custom_vjp's fwd), so the outputs and the states are the differentiated
    reference's (``Reference(diff=True)``): the rule's effects happen once,
    in program order. (Their derivatives differ from finite differences by
    design: what a rule writes is a constant w.r.t. the inputs, as eagerly.)

    ``variant="reap"``: of ``call_and_reap(pure)``, the reaped values too
    (a rule's sows, reaped in program order with derivative zero), and
    undifferentiated, where no rule runs (the names only rules sow are
    absent); ``"plant"``: of ``harvest(pure)`` planting ``plants`` (by
    default some names, of the rules' sows too, drawn from ``seed``) and
    reaping the others."""
    floats_in = tuple(np.asarray(a) for a in args[:4])
    if variant != "plant":
        plants = {}
    elif plants is None:
        plants = make_plants(program, np.random.default_rng(seed), rules=True)
    out_r, fin_r, _, reaps_r = reference(program, args, state, plants, diff=True)
    if variant == "pure":
        reaps_r = {}
    if variant == "reap":  # undifferentiated: no rule runs
        out_p, fin_p, _, reaps_p = reference(program, args, state)
        (out, fin), reaps = h.call_and_reap(pure, tag=T)(state, *args)
        assert_outs_close(out, out_p, "reap(pure) out")
        assert_dict_close(fin, fin_p, "reap(pure) state")
        assert_dict_close(reaps, reaps_p, "reap(pure) reaps")
    what = {"pure": "pure", "reap": "reap(pure)", "plant": "harvest(pure)"}[variant]
    in_rules = {s.name for s in rule_sows(program)}
    only_in_rules = in_rules - set(sow_names(program))

    def run(*xs):
        a = (*xs, args[4])
        if variant == "reap":
            return h.call_and_reap(pure, tag=T)(state, *a)
        if variant == "plant":
            return h.harvest(pure, tag=T)(plants, state, *a)
        return pure(state, *a), {}

    if can_jvp:
        ((out, fin), reaps), (_, reaps_t) = jax.jvp(
            run, floats_in, tuple(np.ones_like(a) for a in floats_in))
        assert_outs_close(out, out_r, f"jvp({what}) out")
        assert_dict_close(fin, fin_r, f"jvp({what}) state")
        assert_dict_close(reaps, reaps_r, f"jvp({what}) reaps")
        for name in only_in_rules & set(reaps):  # documented: a constant
            assert not np.any(np.asarray(reaps_t[name])), f"jvp({what}) reap {name!r} tangent"
    if can_grad:
        try:
            ((out, fin), reaps), vjp_fn = jax.vjp(run, *floats_in)
        except NotImplementedError as e:
            # A float state that a custom_vjp fwd reads (a custom_jvp in its
            # body takes every state) and that has a derivative there (set
            # from a differentiated value before the call): documented
            # (docs/limitations.md), as JAX refuses a custom_vjp closing
            # over a differentiated value.
            # (A scoped state's name has its scopes, a pytree state's array
            # its key path: "sa/pt[1]", "pd['w']" in double quotes.)
            name = re.search(r"differentiating w\.r\.t\. state (['\"])([\w/]+)(\[.*?\])?\1, "
                             r"which the custom_vjp function at \S+ reads", str(e))
            assert name and name[2] in states_of(program) and any(
                isinstance(s, CustomVjp) and uses_state(s.body) for s in walk(program.body)), e
            _event("derivatives: vjp of pure refused: a differentiated state a custom_vjp reads")
            return
        assert_outs_close(out, out_r, f"vjp({what}) out")
        assert_dict_close(fin, fin_r, f"vjp({what}) state")
        assert_dict_close(reaps, reaps_r, f"vjp({what}) reaps")
        cts = jax.tree_util.tree_map(
            lambda v: (jnp.ones_like(v) if jnp.issubdtype(v.dtype, jnp.inexact)
                       else np.zeros(np.shape(v), jax.dtypes.float0)), ((out, fin), reaps))
        if any(isinstance(s, CustomVjp) and uses_state(s.body) for s in walk(program.body)):
            # Its bwd (jax.vjp of the function) touches state after the
            # forward pass: a StateError where a cotangent reaches it
            # (tests/state/test_in_rules.py); only the forward is checked.
            _event("derivatives: forward of a stateful custom_vjp under vjp")
        else:
            grads = vjp_fn(cts)
            assert all(np.isfinite(np.asarray(g)).all() for g in grads), grads
    _event("derivatives: stateful custom rules run once, as the reference")
    if (can_jvp or can_grad) and rule_functions(program):
        _event("derivatives: rule statements ran under differentiation (jvp / vjp of pure)")
    if (can_jvp or can_grad) and in_rules and variant != "pure":
        _event(f"derivatives: rule sows under {what}")


def derivative_modes(program: Program) -> tuple[bool, bool]:
    """(jvp, grad): forward mode of a custom_vjp function, reverse mode of a
    while loop (incl. fori with traced bounds) are not supported by JAX."""
    stmts = list(walk(program.body))
    return (not any(isinstance(s, CustomVjp) for s in stmts),
            not any(isinstance(s, (While, Fori)) for s in stmts))


def rules_differentiated(check_name: str, program: Program) -> bool:
    """Whether the check ``check_name`` runs ``program``'s rule statements
    differentiated (and compares with ``Reference(diff=True)``)."""
    if not rule_functions(program):
        return False
    if check_name == "check_grad_inside":  # (its programs have no while / fori / root)
        return True
    if check_name == "check_derivatives":
        return (not any(not_differentiated(s) for s in walk(program.body))
                and any(derivative_modes(program)))
    return False


def check_derivatives(program, args, seed: int, variant: str):
    """jvp (and, without while loops, grad) of the pure function w.r.t. the
    float arguments and float states (``variant="reap"``: of reap of it, the
    reaped values included; ``"plant"``: of plant of it, also w.r.t. the
    planted values), against central finite differences of the float64
    reference."""
    fn = build(program)
    pure, state0 = tx.uncurry(fn, *args)
    state = perturb(state0)
    can_jvp, can_grad = derivative_modes(program)
    if any(not_differentiated(s) for s in walk(program.body)):
        _event("derivatives: not checked through custom_root / a checkpointed loop")
        return
    if stateful_custom_rules(program):
        check_stateful_rules_differentiated(program, pure, state, args, can_jvp, can_grad,
                                            variant, seed)
        return
    # Typed states are not differentiated: integer-valued, updated by
    # wrap-around and ``% 4``, they have no derivatives that finite
    # differences see (their tangents, float0 or zero, still flow).
    # (The float32 states, pytree states' float leaves included, by full name.)
    fkeys = float_slots(state)
    rng = np.random.default_rng(seed)
    plants = make_plants(program, rng, 1.0) if variant == "plant" else {}
    pkeys = sorted(plants)
    floats = ([np.asarray(a) for a in args[:4]] + [np.asarray(x) for x in slot_values(state, fkeys)]
              + [plants[k] for k in pkeys])
    tangents = [rng.uniform(-1, 1, np.shape(x)).astype(np.float32) for x in floats]
    n_st = 4 + len(fkeys)

    def split(xs):
        st_ = with_slots(state, fkeys, xs[4:n_st])
        return st_, (*xs[:4], args[4]), dict(zip(pkeys, xs[n_st:]))

    def f(*xs):
        st_, a, pl = split(xs)
        if variant == "reap":
            (out, fin), reaps = h.call_and_reap(pure, tag=T)(st_, *a)
            return _objective(out, fin, reaps)
        if variant == "plant":
            out, fin = h.plant(pure, tag=T)(pl, st_, *a)
        else:
            out, fin = pure(st_, *a)
        return _objective(out, fin)

    def f_ref(xs):
        st_, a, pl = split(xs)
        out, fin, _, reaps = reference(program, a, st_, pl)
        return float(_objective(out, fin, reaps if variant == "reap" else None))

    eps = 1e-5
    plus = [np.asarray(x, np.float64) + eps * t for x, t in zip(floats, tangents)]
    minus = [np.asarray(x, np.float64) - eps * t for x, t in zip(floats, tangents)]
    fd = (f_ref(plus) - f_ref(minus)) / (2 * eps)
    if can_jvp:
        _, jvp = jax.jvp(f, floats, tangents)
        np.testing.assert_allclose(float(jvp), fd, rtol=2e-3, atol=2e-3,
                                   err_msg=f"{variant}: jvp vs finite differences")
    if can_grad:
        grads = jax.grad(f, argnums=tuple(range(len(floats))))(*floats)
        dot = sum(float(np.sum(np.asarray(g) * t)) for g, t in zip(grads, tangents))
        np.testing.assert_allclose(dot, fd, rtol=2e-3, atol=2e-3,
                                   err_msg=f"{variant}: grad vs finite differences")


def _assert_grads_match_finite_differences(program, args, state, grads, what: str) -> None:
    """``grads`` (w.r.t. the four float arguments) against central finite
    differences of the float64 reference from ``state``, along a random
    direction."""
    eps = 1e-5
    rng = np.random.default_rng(0)
    floats = [np.asarray(a, np.float64) for a in args[:4]]
    tangents = [rng.uniform(-1, 1, np.shape(x)) for x in floats]

    def f_ref(xs):
        out, _, _, _ = reference(program, (*xs, args[4]), state)
        return float(_objective(out, {}))

    fd = (f_ref([x + eps * t for x, t in zip(floats, tangents)])
          - f_ref([x - eps * t for x, t in zip(floats, tangents)])) / (2 * eps)
    dot = sum(float(np.sum(np.asarray(g) * t)) for g, t in zip(grads, tangents))
    np.testing.assert_allclose(dot, fd, rtol=2e-3, atol=2e-3,
                               err_msg=f"{what} vs finite differences")


def check_grad_inside(program, args):
    """``jax.value_and_grad`` inside the uncurried function (taxpr rewrites
    the differentiated program, custom_vjp bwds recomputing their function
    included): the value and the final states are the reference's (the
    backward pass repeats no effect), and, where JAX's rules are autodiff's
    and no rule has state, the gradient matches central finite differences
    of the float64 reference. A stateful custom_vjp or equinox checkpointed
    loop whose recomputation reads a state the forward changes may instead be
    a ``StateError`` (which one cannot be read off the program). Where a
    custom_jvp rule sows, also reap and harvest of the uncurried function
    (``_harvest_grad_inside``)."""
    fn = build(program)
    stmts = list(walk(program.body))

    def loss(*xs):
        return _objective(fn(*xs), {})

    def prog(a0, a1, a2, a3, n):
        return jax.value_and_grad(lambda *f: loss(*f, n), argnums=(0, 1, 2, 3))(a0, a1, a2, a3)

    recomputing = any(isinstance(s, (CustomVjp, EqxLoop)) and uses_state(s.body) for s in stmts)
    try:
        pure, state0 = tx.uncurry(prog, *args)
        state = perturb(state0)
        (value, grads), fin = pure(state, *args)
    except tx.StateError as e:
        assert recomputing, f"StateError without a recomputing bwd: {e}"
        assert "recomputes" in str(e) or "replay" in str(e), e
        _event("grad inside: a recomputation reading a changed state, a StateError")
        return "StateError"
    # JAX differentiates the program as it traces it: every custom function
    # with stateful rules runs its rule (p0 is differentiated).
    out_r, fin_r, _, _ = reference(program, args, state, diff=True)
    assert_close(value, _objective(out_r, {}), "value_and_grad inside: value")
    assert_dict_close(fin, fin_r, "value_and_grad inside: state")
    if rule_functions(program):
        _event("grad inside: rule statements ran under differentiation")
    if any(isinstance(r, Sow) for f in rule_functions(program) for r in f.rule):
        _harvest_grad_inside(program, pure, state, args)
    if (stateful_custom_rules(program) or any(not_differentiated(s) for s in stmts)
            or any(isinstance(s, (Set, Bump)) for s in stmts)):
        # Derivatives through a state set and read again inside the
        # differentiated function are not propagated (docs/limitations.md).
        _event("grad inside: value and states checked")
        return "value and states"
    _assert_grads_match_finite_differences(program, args, state, grads, "grad inside")
    _event("grad inside: value, states and gradient checked")
    return "value, states and gradient"


def check_tx_grad_inside(program, args):
    """``tx.value_and_grad`` inside the uncurried function: the function is
    differentiated with its states threaded, as ``pure`` is from outside, so
    custom rules run in their functions' place (``Reference(diff=True)``)
    and the value and final states are the reference's; the gradient, now
    through the states it sets and reads again, matches central finite
    differences of the float64 reference where JAX's rules are autodiff's.
    A custom_vjp (or equinox checkpointed loop) whose bwd touches a state
    the forward changes may instead be a ``StateError`` naming the bwd."""
    fn = build(program)
    stmts = list(walk(program.body))

    def prog(a0, a1, a2, a3, n):
        return tx.value_and_grad(lambda *f: _objective(fn(*f, n), {}),
                                 argnums=(0, 1, 2, 3))(a0, a1, a2, a3)

    stateful_bwd = any(isinstance(s, (CustomVjp, EqxLoop)) and uses_state(s.body)
                       for s in stmts)
    try:
        pure, state0 = tx.uncurry(prog, *args)
        state = perturb(state0)
        (value, grads), fin = pure(state, *args)
    except tx.StateError as e:
        assert stateful_bwd, f"StateError without a stateful custom_vjp or loop: {e}"
        assert "bwd" in str(e) or "recomput" in str(e) or "replay" in str(e), e
        _event("tx grad inside: a bwd touching state, a StateError")
        return "StateError"
    except NotImplementedError as e:
        # A state set from a differentiated value and then read by a
        # custom_vjp fwd: its rules give no derivative for it (documented,
        # as from outside ``pure``).
        name = re.search(r"differentiating w\.r\.t\. state (['\"])([\w/]+)(\[.*?\])?\1, "
                         r"which the custom_vjp function at \S+ reads", str(e))
        assert name and name[2] in states_of(program) and stateful_bwd, e
        _event("tx grad inside: a differentiated state a custom_vjp reads, refused")
        return "NotImplementedError"
    out_r, fin_r, _, _ = reference(program, args, state, diff=True)
    assert_close(value, _objective(out_r, {}), "tx.value_and_grad inside: value")
    assert_dict_close(fin, fin_r, "tx.value_and_grad inside: state")
    if stateful_custom_rules(program) or any(not_differentiated(s) for s in stmts):
        _event("tx grad inside: value and states checked")
        return "value and states"
    _assert_grads_match_finite_differences(program, args, state, grads,
                                           "tx.value_and_grad inside")
    if any(isinstance(s, (Set, Bump)) for s in stmts):
        _event("tx grad inside: gradient through states checked")
    _event("tx grad inside: value, states and gradient checked")
    return "value, states and gradient"


def _harvest_grad_inside(program, pure, state, args) -> None:
    """reap and harvest (plant some non-append names, of the rules' sows too,
    reap the others) of ``pure`` of ``check_grad_inside``'s program: JAX runs
    the rules as it traces it, so their sows are reaped and planted as any,
    in program order (``Reference(diff=True)``). A rule's sow in a function
    in one branch of a cond is then in that branch only: oryx's error
    (docs/limitations.md). (Appends are not planted: where a custom_vjp's
    bwd recomputes them that is a documented NotImplementedError.)"""
    _, fin_r, _, reaps_r = reference(program, args, state, diff=True)
    plants = make_plants(program, np.random.default_rng(1), rules=True, append=False)
    out_p, fin_p, _, reaps_p = reference(program, args, state, plants, diff=True)
    try:
        (_, fin), reaps = h.call_and_reap(pure, tag=T)(state, *args)
        ((value, _), fin_h), reaps_h = h.harvest(pure, tag=T)(plants, state, *args)
    except ValueError as e:
        assert rule_sow_in_branch(program), e
        assert str(e) == "Mismatching number of `sow`s between branches.", e
        _event("grad inside: a rule's sow in one branch of a cond, oryx's error")
        return
    assert_dict_close(fin, fin_r, "reap(value_and_grad inside) state")
    assert_dict_close(reaps, reaps_r, "reap(value_and_grad inside) reaps")
    assert_close(value, _objective(out_p, {}), "harvest(value_and_grad inside) value")
    assert_dict_close(fin_h, fin_p, "harvest(value_and_grad inside) state")
    assert_dict_close(reaps_h, reaps_p, "harvest(value_and_grad inside) reaps")
    _event("grad inside: rule sows reaped and planted")


def check_raw_reap(program, args):
    """reap / plant of the stateful function itself (no state handler: get
    returns init, set is a no-op; taxpr warns about each set, as expected)."""
    fn = build(program)
    out_r, _, _, reaps_r = reference(program, args, "none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tx.StateNotUncurriedWarning)
        out, reaps = jax.jit(h.call_and_reap(fn, tag=T))(*args)
    assert_outs_close(out, out_r, "call_and_reap out")
    assert_dict_close(reaps, reaps_r, "call_and_reap reaps")


# ---- vmap inside the transformed function (batched predicates) ----------------------

# (NotImplementedError: equinox's loops under vmap whose predicate reads a
# state, "a while loop that runs while any example of a vmap batch runs".)
VMAP_ERRORS = (tx.StateError, tx.InjectError, ValueError, NotImplementedError)


def check_vmap_inside(program, args, p0s, jit: bool, with_reap: bool = False):
    """uncurry of ``vmap(program)`` over a batch of ``p0`` (so conds/whiles on
    ``f0`` get batched predicates, with states and sows inside). Per example
    the result must be the reference run on that example, states shared
    (reads broadcast; a state's new value is the same for every example);
    where that has no per-example meaning (a state set to a value that
    differs per example, or in a branch/iteration only some examples take)
    the outcome must be a clear error that says it is about vmap.

    ``with_reap`` also reaps (non-append names compared); reaping outside
    the vmap a name that vmap batches in one cond branch and not in another
    is such a clear error."""
    fn = build(program)

    def batched(p0, p1, p2, pv, n):
        return jax.vmap(fn, in_axes=(0, None, None, None, None))(p0, p1, p2, pv, n)

    bargs = (np.asarray(p0s, np.float32), *args[1:])
    f = h.call_and_reap(batched, tag=T) if with_reap else batched
    try:
        pure, state0 = tx.uncurry(f, *bargs)
        state = perturb(state0)
        run = jax.jit(pure) if jit else pure
        out, fin = run(state, *bargs)
    except VMAP_ERRORS as e:
        assert "vmap" in str(e), f"an error that does not say it is about vmap: {e!r}"
        _event("vmap inside: clear error")
        return
    _event("vmap inside: result")
    out, reaps = out if with_reap else (out, {})
    refs = [reference(program, (np.float32(p), *args[1:]), dict(state)) for p in p0s]
    modes = sow_names(program)
    for row, (out_r, fin_r, _, reaps_r) in enumerate(refs):
        assert_outs_close([np.asarray(o)[row] for o in out], out_r, f"vmap inside row {row} out")
        # A state is not batched: every example must have left it the same.
        assert_dict_close(fin, fin_r, f"vmap inside row {row} state")
        for name, want in (reaps_r.items() if with_reap else ()):
            if modes.get(name) == "append":
                continue
            got = np.asarray(reaps[name])
            got = got[row] if got.shape != np.shape(want) else got
            assert_close(got, want, f"vmap inside row {row} reap[{name!r}]")


# ---- static rules: harvest's rules broken on purpose --------------------------------

_LOOPS = (Scan, Fori, While, EqxLoop)
VIOLATIONS = {
    # kind: (where it may go, the sow, the messages it may raise)
    "strict_in_scan": (lambda owners: any(isinstance(o, Scan) for o in owners), "strict",
                       r"Cannot use strict mode for 'z' inside `scan`\.|"
                       r"Must use clobber or cond_clobber mode for 'z' inside of a `while_loop`\."),
    "append_in_while": (lambda owners: any(isinstance(o, (While, Fori, EqxLoop)) for o in owners),
                        "append", r"Must use clobber or cond_clobber mode for 'z' inside of a "
                                  r"`while_loop`\."),
    "strict_twice": (lambda owners: not any(isinstance(o, (*_LOOPS, Cond, Switch)) for o in owners),
                     "strict", r"Variable has already been reaped: z"),
    "missing_in_branch": (lambda owners: bool(owners) and isinstance(owners[-1], (Cond, Switch))
                          and len(owners[-1].branches) > 1, "clobber",
                          r"Missing sow in branch: 'z'\.|Mismatching number of `sow`s between "
                          r"branches\."),
}


# ---- programs as users run them: a warm-up first, inits in another style -------------

WARM_UPS = ("none", "jit", "eager", "make_jaxpr")


def warm_up(fn, how: str, args, program) -> None:
    """Run ``fn`` before taxpr transforms it, so JAX's trace caches are warm.

    Run without ``uncurry``, sets are lost and reads give the init (taxpr
    warns about each set, as expected here), so a loop whose exit depends on
    state may never end: programs with loops are only traced
    (``jit(...).lower``, which fills the same trace caches, or
    ``make_jaxpr``), never executed, by the warm-up."""
    if how in ("jit", "eager") and any(isinstance(s, (While, Fori))
                                       for s in walk(program.body)):
        how = "jit_lower" if how == "jit" else "make_jaxpr"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tx.StateNotUncurriedWarning)
        _warm_up(fn, how, args)


def _warm_up(fn, how: str, args) -> None:
    if how == "jit":
        jax.block_until_ready(jax.jit(fn)(*args))
    elif how == "jit_lower":
        jax.jit(fn).lower(*args)
    elif how == "eager":
        jax.block_until_ready(fn(*args))
    elif how == "make_jaxpr":
        jax.make_jaxpr(fn)(*args)


EXTRA_ENTRIES = {"zz_extra": np.float32(3.5), "aa_steps": np.int32(7),
                 "zz_flags": np.array([True, False, True]),
                 "zz_half": np.asarray(-1.5, ml_dtypes.bfloat16)}


def _linearized(fn):
    """``fn`` computed under ``jax.vjp`` w.r.t. its first argument (the
    forward pass, as ``jax.grad`` runs it): the same outputs and effects, but
    traced through linearization and partial evaluation, where tags must be
    kept (what a warm trace cache made with tags not kept broke)."""
    def g(p0, *rest):
        return jax.vjp(lambda p: fn(p, *rest), p0)[0]
    return g


def check_as_users_run(program, args, args2, warm: str, init_style: str, extra: bool,
                       with_reap: bool, linearize: bool = False):
    """uncurry (and reap of the pure function) of the hoisted program after a
    warm-up, with inits in ``init_style`` and, with ``extra``, unknown entries
    in the state dict (they pass through unchanged); with ``linearize`` the
    transformed function runs the program under ``jax.vjp``."""
    fn = build_hoisted(program, init_style)
    warm_up(fn, warm, args, program)
    if linearize:
        fn = _linearized(fn)
    out_r, fin_r, s0_r, _ = reference(program, args)
    pure, state0 = tx.uncurry(fn, *args)
    assert_dict_close(state0, s0_r, "state0")
    out, fin = pure(state0, *args)
    assert_outs_close(out, out_r, "pure(state0) out")
    assert_dict_close(fin, fin_r, "pure(state0) state")
    closed, infos = tx.make_jaxpr(fn)(*args)
    check(closed)
    assert [i.name for i in infos] == info_names(s0_r)
    other = perturb(state0)
    out_r2, fin_r2, _, reaps_r = reference(program, args2, other)
    start = {**other, **EXTRA_ENTRIES} if extra else other
    want_fin = {**fin_r2, **EXTRA_ENTRIES} if extra else fin_r2
    if with_reap:
        (out2, fin2), reaps = jax.jit(h.call_and_reap(pure, tag=T))(start, *args2)
        assert_dict_close(reaps, reaps_r, "reap(pure) reaps")
    else:
        out2, fin2 = jax.jit(pure)(start, *args2)
    assert_outs_close(out2, out_r2, "pure(other state) out")
    assert_dict_close(fin2, want_fin, "pure(other state) state")

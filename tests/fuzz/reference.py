"""The eager reference interpreter.

``Reference`` runs a program's AST in float64 NumPy with Python control
flow, a flat dict for the states keyed by full names (inside ``tx.scope``
blocks the "/"-joined scopes and the name, "sa/sb/s0"; the key stream is
never scoped; a typed state stays in its NumPy / ml_dtypes dtype, bit for
bit; a pytree state is stored as its pytree, a tuple or a dict) and
per-site records for the sows; optionally planted,
or differentiated as JAX runs custom functions' rules (see its docstring).
It is the semantics the checks compare taxpr's transformations of the
rendered program with; a float predicate too close to its threshold raises
``Ambiguous``.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import taxpr as tx

from .analysis import append_slots, call_prefixes, first_traced_inits, sow_names, states_of
from .model import (ENV, FUNCTIONS, PYTREE_INT, PYTREE_STATES, RNG, STATES, T, TYPED_STATES, AddC,
                    Assign, Bin, Bump, Cond, Const, CustomJvp, CustomVjp, Draw, EqxLoop, Fori,
                    FPred, Get, IdxF, IPred, Mean, MulC, Program, Root, Scan, Scope, Set, SIdx,
                    Sow, Switch, Tree, Un, Var, VConst, While, base_name, full_name, np_dtype,
                    rule_split, sow_kind, tree_leaf_kinds, tree_leaves, tree_value, tree_zeros,
                    typed_mix, typed_update, typed_value, var_kind)


# ---------------------------------------------------------------------------------
# The eager reference interpreter
# ---------------------------------------------------------------------------------

class Ambiguous(Exception):
    """A float predicate too close to its threshold to compare float32 with float64."""


def _zeros(kind: str):
    return np.zeros(3) if kind == "V" else np.float64(0.0)


class Reference:
    """Runs a program with Python control flow.

    Arguments:
        states: None (the example run: first-use inits), or a dict of initial
            state values, or "none" (no state handler: get returns init, set is
            a no-op).
        plants: {name: value} replacing sows of tag T.
        diff: the program runs differentiated (every custom function's input
            ``p0`` has a nonzero tangent), as JAX runs it: a custom function's
            rule runs instead of the function. A ``CustomJvp`` runs its
            ``rule`` statements, then its body, differentiated too (its rule
            is ``jax.jvp`` of the function: nested rules run); a
            ``CustomVjp`` runs its ``rule`` statements, then its body not
            differentiated (its fwd calls the plain function). Rule
            statements touch states and sow (a plant replaces the value in
            the rule; what the rule does with it is the function's JVP
            either way), on a copy of the env: the function gets its
            arguments unchanged. Without ``diff`` no rule runs: a name only
            rules sow is not reaped (taxpr leaves it out, as oryx does).
    """

    def __init__(self, program: Program, states=None, plants=None, diff: bool = False):
        self.program = program
        self.diff = diff
        self.mode = "none" if states == "none" else ("example" if states is None else "given")
        self.cur = {} if states is None or states == "none" else {
            k: _ref_state(k, v) for k, v in flat_states(states).items()}
        self.prefix: tuple = ()  # the scopes the program runs in now (``Scope``)
        self.state0: dict = {}
        self.plants = {k: _np(v) for k, v in (plants or {}).items()}
        self.clobber: dict = {}
        self.records: dict = {}  # slot key -> {index tuple: value}
        self.slots = append_slots(program)
        self.offsets = {}
        for name, slots in self.slots.items():
            off = 0
            for sl in slots:
                self.offsets[sl.key] = off
                off += sl.rows()

    # -- expressions
    def ev(self, e, env, ienv):
        if isinstance(e, Var):
            return env[e.name]
        if isinstance(e, Const):
            return np.float64(e.value)
        if isinstance(e, VConst):
            return np.array(e.values, np.float64)
        if isinstance(e, Un):
            return getattr(np, e.op)(self.ev(e.a, env, ienv))
        if isinstance(e, Bin):
            a, b = self.ev(e.a, env, ienv), self.ev(e.b, env, ienv)
            return (a + b) * 0.5 if e.op == "avg" else a * b * 0.25
        if isinstance(e, AddC):
            return (self.ev(e.a, env, ienv) + e.c) * 0.5
        if isinstance(e, MulC):
            return self.ev(e.a, env, ienv) * e.c
        if isinstance(e, Mean):
            return np.float64(np.mean(self.ev(e.a, env, ienv)))
        if isinstance(e, IdxF):
            return np.float64((ienv[e.ivar] % 3) * 0.5)
        if isinstance(e, IPred):
            return (ienv[e.ivar] + e.c) % e.m == 0
        if isinstance(e, FPred):
            x = self.ev(e.e, env, ienv)
            return self.gt(x, e.t)
        if isinstance(e, SIdx):
            return (ienv[e.ivar] + e.c) % e.m
        raise TypeError(e)

    @staticmethod
    def gt(x, t) -> bool:
        if abs(float(x) - t) < 1e-3:
            raise Ambiguous(f"{float(x)} vs {t}")
        return bool(x > t)

    # -- state
    # One flat dict keyed by full names: a state accessed inside ``tx.scope``
    # ("sa") is another state, "sa/<name>"; the key stream is never scoped.
    def get(self, name, init):
        init = (0 if name == "cnt" else jax.random.key(0) if name == RNG
                else typed_value(TYPED_STATES[name], init) if name in TYPED_STATES
                else tree_value(name, init) if name in PYTREE_STATES
                else _np(init))
        if self.mode == "none":
            return init
        name = full_name(self.prefix, name)
        if name not in self.cur:
            self.cur[name] = init
            self.state0.setdefault(name, init)
        return self.cur[name]

    def set(self, name, value):
        if self.mode == "none":
            return
        base, name = name, full_name(self.prefix, name)
        if name not in self.cur and self.mode == "example":
            self.state0.setdefault(name, 0 if base == "cnt" else tree_zeros(base)
                                   if base in PYTREE_STATES else _zeros(STATES[base]))
        # (A typed state is read before it is set: never first set.)
        self.cur[name] = value

    # -- sows
    def sow(self, s: Sow, value, env, ienv, site):
        idx, calls = site
        if s.tag != T:
            return value
        if s.mode == "cond_clobber":
            pred = self.ev(s.pred, env, ienv)
            if pred:
                self.clobber[s.name] = value
        elif s.mode == "append":
            self.records.setdefault((s.slot or s.uid, calls), {})[idx] = value
        else:
            self.clobber[s.name] = value
        if s.name in self.plants:
            p = self.plants[s.name]
            if s.mode == "append":
                off = self.offsets[(s.slot or s.uid, calls)]
                return p[off + idx[0]][idx[1:]] if idx else p[off]
            return p
        return value

    # -- statements
    def block(self, stmts, env, ienv, site):
        for s in stmts:
            self.stmt(s, env, ienv, site)

    def stmt(self, s, env, ienv, site):
        """``site = (scan indices, calls)`` of the enclosing scans and functions."""
        idx, calls = site
        if isinstance(s, Assign):
            env[s.target] = self.ev(s.e, env, ienv)
        elif isinstance(s, Get):
            env[s.target] = self.get(s.state, s.init)
        elif isinstance(s, Set):
            self.set(s.state, self.ev(s.e, env, ienv))
        elif isinstance(s, Draw):
            # Eager semantics of next_key: key, sub = split(key); draw from sub.
            key, sub = jax.random.split(self.get(RNG, None))
            self.set(RNG, key)
            env[s.target] = np.float64(jax.random.uniform(sub, minval=-1.0, maxval=1.0))
        elif isinstance(s, Bump):
            d = TYPED_STATES[s.state]
            arg = self.ev(s.arg, env, ienv) if s.op == "xor" else s.arg
            y = typed_update(d, s.op, self.get(s.state, s.init), arg)
            self.set(s.state, y)
            if s.target:
                env[s.target] = env[s.target] * 0.5 + typed_mix(d, y) * 0.25
        elif isinstance(s, Tree):
            self.tree(s, env, ienv)
        elif isinstance(s, Scope):
            with self.scope(s.name):
                self.block(s.body, env, ienv, site)
        elif isinstance(s, Sow):
            value = self.ev(s.e, env, ienv)
            out = self.sow(s, value, env, ienv, site)
            if s.target:
                env[s.target] = out
        elif isinstance(s, Scan):
            xsrc = self.ev(s.xsrc, env, ienv)
            ys = [None] * s.length
            order = range(s.length - 1, -1, -1) if s.reverse else range(s.length)
            for i in order:
                env[f"x{s.uid}"] = np.float64(s.coefs[i] * xsrc)
                self.block(s.body, env, {**ienv, f"i{s.uid}": i}, ((*idx, i), calls))
                ys[i] = env[s.yvar]
                del env[f"x{s.uid}"]
            kind = var_kind(s.yvar)
            total = sum(ys, _zeros(kind)) if ys else _zeros(kind)
            env[s.out] = np.tanh(total)
        elif isinstance(s, Fori):
            lo = min(max(ienv[s.ivar] + s.lo, 0), 2)
            hi = min(max(ienv[s.ivar] + s.hi, 0), 3)
            for i in range(lo, hi):
                self.block(s.body, env, {**ienv, f"i{s.uid}": i}, site)
        elif isinstance(s, While):
            k = 0
            lim = self.get("cnt", 0) + s.bound if s.kind == "state" else None

            def cond():
                if s.csow:
                    self.sow(Sow(-1, None, None, s.csow[1], "clobber"), env[s.csow[0]], env, ienv,
                             site)
                if s.cbump:
                    self.stmt(s.cbump, env, ienv, site)
                base = k < s.bound if s.kind == "carry" else self.get("cnt", 0) < lim
                if s.spred:
                    x = self.get(s.spred[0], s.spred[1])
                    return base and self.gt(x, s.spred[2])
                return base

            while cond():
                body_ienv = {**ienv, f"k{s.uid}": k} if s.kind == "carry" else ienv
                if s.kind == "state":
                    self.set("cnt", self.get("cnt", 0) + 1)
                self.block(s.body, env, body_ienv, site)
                k += 1
        elif isinstance(s, Cond):
            b = 0 if self.ev(s.pred, env, ienv) else 1
            self.branch(s.branches[b], env, ienv, site)
        elif isinstance(s, Switch):
            b = min(max(self.ev(s.idx, env, ienv), 0), len(s.branches) - 1)
            self.branch(s.branches[b], env, ienv, site)
        elif isinstance(s, FUNCTIONS):
            outer = self.prefix
            for c, prefix in enumerate(call_prefixes(s, outer)):
                self.prefix = prefix  # the call's scope (its rule runs there too)
                fsite = (idx, (*calls, (s.uid, c)))
                diff = self.diff
                rule = diff and isinstance(s, (CustomJvp, CustomVjp))
                before, after = rule_split(s) if rule else ((), ())
                at_call = dict(env)  # what the rule's statements read
                # Its rule runs instead: the rule's own statements (on a
                # scratch env: their locals go nowhere), the function, then
                # the rule's statements after it.
                self.block(before, dict(at_call), ienv, fsite)
                # A custom_vjp's fwd calls the plain function; custom_root's
                # solve and equinox's checkpointed loop (a custom_vjp) run
                # their function undifferentiated in the forward pass. (A
                # bwd differentiates it again: rule statements nested there
                # would run in the backward pass, which this reference does
                # not model; Gen.add_rules draws none there.)
                self.diff = diff and not isinstance(s, (CustomVjp, Root, EqxLoop))
                try:
                    self.branch(s.body, env, ienv, fsite)
                finally:
                    self.diff = diff
                self.block(after, dict(at_call), ienv, fsite)
                self.prefix = outer
        else:
            raise TypeError(s)

    @contextlib.contextmanager
    def scope(self, name):
        """``with tx.scope(name)``: the states accessed inside are ``.../name/x``."""
        outer = self.prefix
        self.prefix = (*outer, name)
        try:
            yield
        finally:
            self.prefix = outer

    def tree(self, s: Tree, env, ienv):
        """A pytree state's get / update / set (``Tree``), leaf by leaf."""
        kinds = tree_leaf_kinds(s.state)
        if s.op == "set":
            es = iter(s.es)
            new = [np.int8(ienv[s.arg] % 5) if k == "i8" else self.ev(next(es), env, ienv)
                   for k in kinds]
            self.set(s.state, tree_value(s.state, new))
            return
        old = tree_leaves(s.state, self.get(s.state, s.init))
        for k, x, target in zip(kinds, old, s.targets):
            if target is None:
                continue
            if k == "i8":
                env[target] = env[target] * 0.5 + typed_mix(PYTREE_INT, x) * 0.25
            else:
                env[target] = (env[target] + x) * 0.5
        if s.op == "update":
            es = iter(s.es)
            new = [typed_update(PYTREE_INT, "add", x, s.arg) if k == "i8"
                   else (x + self.ev(next(es), env, ienv)) * 0.5 for k, x in zip(kinds, old)]
            self.set(s.state, tree_value(s.state, new))

    def branch(self, body, env, ienv, site):
        # A function body: its own copy of the env (in-place updates of the
        # loop-element variables do not leak), results written back.
        inner = dict(env)
        self.block(body, inner, ienv, site)
        for n in ENV:
            env[n] = inner[n]

    def run(self, args):
        p0, p1, p2, pv, n = args
        env = {"f0": _np(p0), "f1": _np(p1), "f2": _np(p2), "v": _np(pv)}
        self.block(self.program.body, env, {"n": int(n)}, ((), ()))
        out = tuple(env[k] for k in ENV)
        names = states_of(self.program)
        if self.mode == "example":
            inits = first_traced_inits(self.program)
            for name, kind in names.items():
                if name not in self.state0:
                    self.state0[name] = (
                        jax.random.key(0) if kind == "K" else inits[name] if kind == "Y"
                        else inits.get(name, tree_zeros(base_name(name))) if kind == "P"
                        else _np(inits[name]) if name in inits and kind != "I"
                        else (0 if kind == "I" else _zeros(kind)))
        final = {}
        if self.mode != "none":
            start = self.state0 if self.mode == "example" else {}
            final = {name: self.cur.get(name, start.get(name)) for name in names}
        return out, final, dict(self.state0), self.reaps()

    def reaps(self):
        out = {}
        for name, mode in sow_names(self.program, rules=self.diff).items():
            if name in self.plants:
                continue
            if mode != "append":
                out[name] = self.clobber.get(name, _zeros(sow_kind(name)))
                continue
            parts = []
            for sl in self.slots[name]:
                block = np.zeros(sl.shape())
                for i, val in self.records.get(sl.key, {}).items():
                    block[i] = val
                parts.append(block if sl.lens else block[None])
            out[name] = np.concatenate(parts, axis=0)
        return out


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def flat_states(state: dict) -> dict:
    """A state dict (``uncurry``'s, nested by scope in ``tx.StateScope``
    dicts; or the reference's, flat already) as the reference keeps it: one
    flat dict keyed by full names ("sa/sb/s0"). A pytree state's value (a
    tuple, a plain dict) is one entry."""
    out = {}
    for key, value in state.items():
        if isinstance(value, tx.StateScope):
            out.update((f"{key}/{k}", v) for k, v in flat_states(value).items())
        else:
            out[key] = value
    return out


def _ref_state(name: str, value):
    """A state value given to the reference (``name`` its full name): a
    typed state (or leaf) keeps its dtype."""
    base = base_name(name)
    if base in TYPED_STATES:
        a = np.asarray(value)
        assert a.dtype == np_dtype(TYPED_STATES[base]), f"state {name!r} is {a.dtype}"
        return a
    if base in PYTREE_STATES:
        leaves = []
        for (key, kind), x in zip(PYTREE_STATES[base][1], tree_leaves(base, value)):
            a = np.asarray(x)
            if kind == "i8":
                assert a.dtype == np_dtype(PYTREE_INT), f"state {name!r}[{key!r}] is {a.dtype}"
                leaves.append(a)
            else:
                leaves.append(a.astype(np.float64) if a.shape else np.float64(a))
        return tree_value(base, leaves)
    return _np(value)


def _np(x):
    if _is_key(x):  # the "rng" stream's key stays a key
        return x
    if isinstance(x, tuple):
        return np.array(x, np.float64)
    a = np.asarray(x)
    if a.dtype.kind in "iu":
        return int(a) if a.shape == () else a.astype(np.int64)
    return a.astype(np.float64) if a.shape else np.float64(a)

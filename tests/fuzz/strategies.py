"""The hypothesis strategies of the fuzzer.

``programs`` draws a ``Program`` (``Gen``: statement by statement within a
budget, nested up to ``MAX_DEPTH``; optional features in ``allow``). It
respects harvest's static rules: strict sows only outside loops, branches
and functions called twice, once per name; only clobber modes inside
``while`` / traced ``fori``; every cond branch sows the same names (appends
and strict sows only as identical tails of every branch, missing clobber
names padded in); an append name encodes its inner scan lengths so that its
sows stack. Pytree states (``Tree``) and ``tx.scope`` blocks (``Scope``)
are one entry each of the statement kinds drawn from, and a quarter of the
function statements have their calls in scopes (the same function object in
two scopes, or in one twice). ``arguments`` draws a program's arguments
``(p0, p1, p2, pv, n)``; ``ARGS`` and ``ARGS2`` are fixed ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np
from hypothesis import strategies as st

from .analysis import (call_prefixes, children, rule_sows, sow_names, sows, states_of,
                       uses_state)
from .model import (ARGUMENTS_ONLY, CLOBBER_NAMES, FUNCTION_KINDS, FUNCTIONS, OTHER, PYTREE_INT,
                    PYTREE_STATES, RNG, SCOPE_NAMES, STATES, STRICT_NAMES, SVARS, T, TYPED_DTYPES,
                    TYPED_OPS, TYPED_STATES, AddC, Assign, Bin, Bump, Cond, Const, CustomJvp,
                    CustomVjp, Draw, EqxLoop, Fori, FPred, Get, IdxF, IPred, Mean, MulC, Program,
                    Root, Scan, Scope, Set, SIdx, Sow, Switch, Tree, Un, Var, VConst, While,
                    append_name, base_name, full_name, sow_kind, tree_leaf_kinds, typed_adds,
                    typed_inits, typed_kind, typed_shape, var_kind)

MAX_DEPTH = 4


# ---------------------------------------------------------------------------------
# The generator
# ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ctx:
    depth: int = 0
    scan_lens: tuple = ()
    no_strict: bool = False  # in a loop, or a function called twice
    in_while: bool = False  # only clobber modes
    in_branch: bool = False  # appends only as branch tails
    ivars: tuple = ("n",)
    fvars: tuple = ()  # readable float scalars besides f0 f1 f2 (scan elements)


CONSTS = (0.5, -0.5, 1.0, 0.25, -1.0, 1.5, -1.5, 2.0, 0.0, -2.0)
COEFS = (1.0, -0.5, 0.5, 0.25, -1.0, 0.75)
# Thresholds away from the values simple programs compute (a value within
# 1e-3 of its threshold makes the example ambiguous and discarded).
THRESH = (0.1, 0.61, -0.37, 0.23, -0.13)
SIMPLE_KINDS = ("assign", "sow", "get", "set", "sow", "draw", "bump", "tree", "bump")
# Repeats weight the choice (the first entries are what shrinking tends to).
STMT_KINDS = (*SIMPLE_KINDS, "scan", "cond", "scan", "jit", "fori", "while", "switch", "ckpt",
              "scan", "sow", "get", "while", "cond", "cjvp", "cvjp", "scope", "root", "eqxloop")
# The derivative checks' programs (allow "custom_rules"): custom functions
# three times as often, so that rule statements run differentiated.
STMT_KINDS_CUSTOM = (*STMT_KINDS, "cjvp", "cvjp", "cjvp", "cvjp")


class Gen:
    def __init__(self, draw, budget: int, allow: frozenset = frozenset()):
        self.draw = draw
        self.budget = budget
        self.uid = 0
        self.strict_left = list(STRICT_NAMES)
        # Optional features: "counter_state" (while on a counter state),
        # "custom_rules" (custom functions more often: STMT_KINDS_CUSTOM),
        # "rule_sows" (sows among custom_jvp rules' statements: add_rules).
        self.allow = allow
        self.sown_elsewhere: set = set()  # names the program sows outside rules (add_rules)

    def next_uid(self) -> int:
        self.uid += 1
        return self.uid

    def pick(self, seq):
        return self.draw(st.sampled_from(seq))

    def int_(self, lo, hi):
        return self.draw(st.integers(lo, hi))

    # -- expressions
    def expr(self, kind: str, ctx: Ctx, d: int = 0):
        leaf = d >= 2 or not self.draw(st.booleans())
        if kind == "S":
            if leaf:
                opts = ["var", "const", "idx"]
                which = self.pick(opts)
                if which == "var":
                    return Var(self.pick((*SVARS, *ctx.fvars)))
                if which == "const":
                    return Const(self.pick(CONSTS))
                return IdxF(self.pick(ctx.ivars))
            op = self.pick(("avg", "sin", "mulc", "tanh", "mul", "addc", "mean"))
        else:
            if leaf:
                if self.draw(st.booleans()):
                    return Var("v")
                return VConst(tuple(self.pick(CONSTS) for _ in range(3)))
            op = self.pick(("avg", "sin", "mulc", "tanh", "mul", "addc"))
        if op in ("sin", "tanh"):
            return Un(op, self.expr(kind, ctx, d + 1))
        if op == "mulc":
            return MulC(self.expr(kind, ctx, d + 1), self.pick((0.5, -1.0, 0.9, -0.25)))
        if op == "addc":
            return AddC(self.expr(kind, ctx, d + 1), self.pick(CONSTS))
        if op == "mean":
            return Mean(self.expr("V", ctx, d + 1))
        # avg / mul: for a vector, one side may be a scalar (broadcast)
        ka, kb = kind, kind
        if kind == "V":
            ka, kb = self.pick((("V", "V"), ("V", "S"), ("S", "V")))
        return Bin(op, self.expr(ka, ctx, d + 1), self.expr(kb, ctx, d + 1))

    def pred(self, ctx: Ctx):
        if self.draw(st.booleans()):
            return IPred(self.pick(ctx.ivars), self.int_(0, 2), self.pick((2, 3)))
        return FPred(self.expr("S", ctx, 1), self.pick(THRESH))

    def target(self, kind: str):
        return "v" if kind == "V" else self.pick(SVARS)

    # -- sows
    def sow(self, ctx: Ctx, mode=None, name=None, slot=None, unused_ok=True):
        if mode is None:
            modes = ["clobber", "cond_clobber", "other"]
            if not ctx.in_while and not ctx.in_branch:
                modes.insert(1, "append")
            if not ctx.no_strict and not ctx.in_branch and self.strict_left:
                modes.append("strict")
            mode = self.pick(modes)
        tag = T
        pred = None
        if mode == "other":
            tag, name, mode = OTHER, "o", self.pick(("clobber", "append", "strict"))
            kind = self.pick(("S", "V"))
        elif mode == "clobber":
            name = name or self.pick(tuple(CLOBBER_NAMES))
            kind = CLOBBER_NAMES[name]
        elif mode == "cond_clobber":
            name = name or "q0"
            kind = "S"
            pred = self.pred(ctx)
        elif mode == "strict":
            name = name or self.strict_left.pop(self.int_(0, len(self.strict_left) - 1))
            kind = STRICT_NAMES[name]
        else:  # append
            if name is None:
                kind = self.pick(("S", "V"))
                name = append_name(self.pick(("a", "b")), ctx.scan_lens, kind)
            kind = sow_kind(name)
        target = self.target(kind) if not (unused_ok and self.draw(st.booleans())) else None
        return Sow(self.next_uid(), target, self.expr(kind, ctx), name, mode, tag, pred, slot)

    # -- statements
    def block(self, ctx: Ctx, max_len: int) -> tuple:
        out = []
        n = self.int_(0 if ctx.depth else 1, max_len)
        for _ in range(n):
            if self.budget <= 0:
                break
            self.budget -= 1
            out.append(self.stmt(ctx))
        return tuple(out)

    def stmt(self, ctx: Ctx, k: Optional[str] = None):
        """A statement (of kind ``k``: drawn from the kinds when None)."""
        kinds = (SIMPLE_KINDS if ctx.depth >= MAX_DEPTH or self.budget <= 0
                 else STMT_KINDS_CUSTOM if "custom_rules" in self.allow else STMT_KINDS)
        k = k or self.pick(kinds)
        if k == "assign":
            kind = self.pick(("S", "V"))
            return Assign(self.target(kind), self.expr(kind, ctx))
        if k == "get":
            state = self.pick(tuple(STATES))
            init = (tuple(self.pick(CONSTS) for _ in range(3)) if STATES[state] == "V"
                    else self.pick(CONSTS))
            return Get(self.target(STATES[state]), state, init)
        if k == "set":
            state = self.pick(tuple(STATES))
            return Set(state, self.expr(STATES[state], ctx))
        if k == "sow":
            return self.sow(ctx)
        if k == "draw":
            return Draw(self.pick(SVARS))
        if k == "bump":
            return self.bump(ctx)
        if k == "tree":
            return self.tree(ctx)
        uid = self.next_uid()
        sub = dataclasses.replace(ctx, depth=ctx.depth + 1)
        if k == "scan":
            length = self.pick((2, 0, 1, 3))
            sub = dataclasses.replace(sub, scan_lens=(*ctx.scan_lens, length), no_strict=True,
                                      ivars=(*ctx.ivars, f"i{uid}"),
                                      fvars=(*ctx.fvars, f"x{uid}"))
            body = self.block(sub, 3)
            yvar = self.pick(("f0", "f1", "f2", "v", f"x{uid}"))
            return Scan(uid, body, length, self.draw(st.booleans()),
                        tuple(self.pick(COEFS) for _ in range(length)), self.expr("S", ctx, 1),
                        yvar, self.target(var_kind(yvar)))
        if k == "fori":
            sub = dataclasses.replace(sub, no_strict=True, in_while=True,
                                      ivars=(*ctx.ivars, f"i{uid}"))
            ivar = self.pick(ctx.ivars)
            return Fori(uid, self.block(sub, 3), ivar, self.int_(-1, 1), self.int_(0, 3))
        if k == "while":
            kind = self.pick(("carry", "state")) if "counter_state" in self.allow else "carry"
            sub = dataclasses.replace(sub, no_strict=True, in_while=True,
                                      ivars=(*ctx.ivars, f"k{uid}") if kind == "carry"
                                      else ctx.ivars)
            spred = csow = None
            if self.draw(st.booleans()):
                state = self.pick(("s0", "s1"))
                spred = (state, self.pick(CONSTS), self.pick(THRESH))
            if self.draw(st.booleans()):
                name = self.pick(tuple(CLOBBER_NAMES))
                csow = (self.target(CLOBBER_NAMES[name]), name)
            cbump = None
            if "counter_state" in self.allow and self.draw(st.booleans()):
                # A state written by each run of the predicate: one run more
                # than the body (unmixed: the predicate's locals are dropped).
                cbump = dataclasses.replace(self.bump(ctx, ops_without=("xor",)), target=None)
            body = self.block(sub, 3)
            loop = "lax"
            if csow is None and cbump is None:
                loop = self.pick(("lax", "lax", "eqx_lax", "eqx_checkpointed", "eqx_bounded"))
                if loop == "eqx_bounded" and sows(body):
                    # The bounded loop nests conds whose branches sow
                    # differently: a known gap (tests/ecosystem/conftest.py).
                    loop = "eqx_lax"
            return While(uid, body, kind, self.pick((2, 1, 3, 0)), spred, csow, cbump, loop)
        if k in ("cond", "switch"):
            nb = 2 if k == "cond" else self.pick((3, 2, 1))
            bctx = dataclasses.replace(sub, in_branch=True)
            bodies = [list(self.block(bctx, 2)) for _ in range(nb)]
            self.pad_branches(bodies, ctx)
            # Tails: the same appends (and maybe a strict sow) ending every branch.
            if ctx.in_while or ctx.in_branch or not self.draw(st.booleans()):
                tails = []
            else:
                tails = [self.pick(("S", "V")) for _ in range(self.int_(1, 2))]
            names = [append_name(self.pick(("a", "b")), ctx.scan_lens, kind) for kind in tails]
            strict = None
            if not ctx.no_strict and not ctx.in_branch and self.strict_left and self.draw(
                    st.booleans()):
                strict = self.strict_left.pop(self.int_(0, len(self.strict_left) - 1))
            for body in bodies:
                for j, name in enumerate(names):
                    body.append(self.sow(bctx, "append", name, slot=(uid, j)))
                if strict:
                    body.append(self.sow(bctx, "strict", strict))
            bodies = tuple(map(tuple, bodies))
            if k == "cond":
                return Cond(uid, self.pred(ctx), bodies)
            return Switch(uid, SIdx(self.pick(ctx.ivars), self.int_(0, 2), self.pick((3, 2, 4))),
                          bodies)
        if k == "scope":
            return Scope(uid, self.pick(SCOPE_NAMES), self.block(sub, 3))
        if k in FUNCTION_KINDS.values():
            calls = self.pick((1, 2))
            scopes = ()
            if self.int_(0, 3) == 0:
                # Its calls in scopes (the same function object in two
                # scopes keeps two states), some maybe in none.
                scopes = tuple(self.pick((*SCOPE_NAMES, None)) for _ in range(calls))
                scopes = scopes if any(scopes) else ()
            sub = dataclasses.replace(sub, no_strict=ctx.no_strict or calls > 1)
            if k in ARGUMENTS_ONLY:  # reads only its arguments (see rblock)
                sub = dataclasses.replace(sub, fvars=(), ivars=("n",))
            if k == "eqxloop":  # a while loop: only clobber modes
                sub = dataclasses.replace(sub, no_strict=True, in_while=True)
            body = self.block(sub, 3)
            kinds = {kind: cls for cls, kind in FUNCTION_KINDS.items()}
            return kinds[k](uid, body, calls, scopes=scopes)
        raise AssertionError(k)

    def bump(self, ctx: Ctx, ops_without: tuple = ()) -> Bump:
        """An exact update of a typed state of a random dtype: its kind first
        (bool and complex are one dtype each, but their updates matter as
        much as the integers' or floats'); no update in ``ops_without``."""
        kind = self.pick(("i", "f", "b", "c"))
        d = self.pick(tuple(d for d in TYPED_DTYPES if typed_kind(d) == kind))
        values = typed_inits(d)
        init = tuple(self.pick(values) for _ in range(3)) if typed_shape(d) else self.pick(values)
        op = self.pick(tuple(o for o in TYPED_OPS[typed_kind(d)] if o not in ops_without))
        arg = self.pred(ctx) if op == "xor" else self.pick(typed_adds(d)) if op == "add" else None
        target = None
        if self.draw(st.booleans()):
            target = "v" if typed_shape(d) else self.pick(SVARS)
        return Bump(self.next_uid(), f"y_{d}", init, self.pick(("scalar", "array", "callable")),
                    op, arg, target)

    def tree(self, ctx: Ctx) -> Tree:
        """A pytree state's get, update or set (``Tree``)."""
        state = self.pick(tuple(PYTREE_STATES))
        op = self.pick(("update", "get", "set", "update"))
        kinds = tree_leaf_kinds(state)
        init = targets = es = ()
        arg = None
        if op != "set":
            init = tuple(self.pick(typed_inits(PYTREE_INT)) if k == "i8"
                         else tuple(self.pick(CONSTS) for _ in range(3)) if k == "V"
                         else self.pick(CONSTS) for k in kinds)
            targets = tuple((self.pick(SVARS) if k in ("S", "i8") else "v")
                            if self.draw(st.booleans()) else None for k in kinds)
        if op != "get":
            es = tuple(self.expr(k, ctx) for k in kinds if k != "i8")
            if "i8" in kinds:
                arg = (self.pick(typed_adds(PYTREE_INT)) if op == "update"
                       else self.pick(ctx.ivars))
        return Tree(self.next_uid(), state, op, init, es, arg, targets)

    def add_rules(self, body: tuple) -> tuple:
        """``body`` with rule statements (``CustomJvp.rule``) drawn for some of
        its custom functions, once the whole program is known: they touch
        only states the program uses outside any rule (the undifferentiated
        trace, where no rule runs, fixes the states ``pure`` takes and
        returns: a state only a rule uses is an error, docs/limitations.md),
        in every tx.scope its function is called in (the rule runs in the
        call's scope).
        Not in a function nested in a custom_vjp, custom_root or equinox
        loop, nor in the fwd of a custom_vjp whose body uses no state (clear
        StateErrors: ``test_rule_statements_where_taxpr_cannot_thread_them_raise``).
        With "rule_sows" allowed, a custom_jvp rule's statements may also be
        sows (``rule_sow``), in programs with or without state, and
        sometimes a custom_vjp's fwd sows too."""
        kinds = states_of(Program(body))
        draws = RNG in kinds
        sown = sow_names(Program(body)) if "rule_sows" in self.allow else None
        self.sown_elsewhere = set() if sown is None else set(sown)
        if not draws and sown is None and not {"Y", "P"} & set(kinds.values()):
            return body

        def usable(kind: str, prefixes: list) -> list:
            """The (base) names of the states of ``kind`` ("Y" typed, "P"
            pytree) that the program uses outside rules in every scope of
            ``prefixes``: a rule run in those scopes may touch them (a rule
            runs in the tx.scope of its function's call)."""
            bases = sorted({base_name(k) for k, v in kinds.items() if v == kind})
            return [b for b in bases if all(kinds.get(full_name(p, b)) == kind for p in prefixes)]

        def rule(sows_ok: bool, taken: set, typed: list, pytrees: list) -> tuple:
            """1 or 2 statements: state effects (of the states ``typed``,
            ``pytrees`` and the key stream), or (``sows_ok``) sows of names
            not ``taken``, or both."""
            count = self.int_(1, 2)
            kind = ("state" if not sows_ok else "sows" if not (typed or draws or pytrees)
                    else self.pick(("state", "sows", "mixed", "state")))
            out = []
            for _ in range(count):
                if kind == "sows" or (kind == "mixed" and self.draw(st.booleans())):
                    out.append(self.rule_sow(taken,
                                             used=bool(kinds) or self.draw(st.booleans())))
                else:
                    effect = self.pick(tuple(e for e, ok in (
                        ("draw", draws), ("bump", typed), ("tree", pytrees)) if ok))
                    out.append(Draw("_") if effect == "draw" else self.typed_bump(
                        self.pick(typed)) if effect == "bump" else self.rule_tree(
                        self.pick(pytrees)))
            return tuple(out)

        def visit(stmts, inside: bool, prefixes: list) -> tuple:
            """``prefixes``: the scopes ``stmts`` may run in."""
            out = []
            for s in stmts:
                calls = (list(dict.fromkeys(c for p in prefixes for c in call_prefixes(s, p)))
                         if isinstance(s, FUNCTIONS) else prefixes)
                if isinstance(s, (Cond, Switch)):
                    s = dataclasses.replace(s, branches=tuple(visit(b, inside, prefixes)
                                                              for b in s.branches))
                elif isinstance(s, Scope):
                    s = dataclasses.replace(s, body=visit(s.body, inside,
                                                          [(*p, s.name) for p in prefixes]))
                elif children(s):
                    s = dataclasses.replace(s, body=visit(s.body, inside or isinstance(
                        s, (CustomVjp, Root, EqxLoop)), calls))
                sows_ok = sown is not None and isinstance(s, CustomJvp)
                custom = isinstance(s, (CustomJvp, CustomVjp))
                # The names a rule may not sow: those rules in its function's
                # body sow (see ``rule_sow``).
                nested = ({r.name for r in rule_sows(Program(s.body))}
                          if custom and sown is not None else set())
                typed, pytrees = usable("Y", calls), usable("P", calls)
                if (custom and not inside
                        and (isinstance(s, CustomJvp) or uses_state(s.body))
                        and (typed or draws or pytrees or sows_ok)
                        and self.int_(0, 3) < 3):  # (0, what draws tend to: a rule)
                    s = dataclasses.replace(s, rule=rule(sows_ok, nested, typed, pytrees))
                if (sown is not None and isinstance(s, CustomVjp) and not inside
                        and self.int_(0, 2) < 2):  # a fwd that sows (often)
                    s = dataclasses.replace(s, rule=(*s.rule, *(
                        self.rule_sow(nested, used=self.draw(st.booleans()))
                        for _ in range(self.int_(1, 2)))))
                # Sows after the rule's call of the function, mostly of names
                # the function sows (eagerly they clobber the function's).
                own = [n for n in sow_names(Program(s.body))
                       if n in CLOBBER_NAMES or n == "q0"] if custom else []
                if custom and sown is not None and not inside and self.int_(0, 1) == 0:
                    after = tuple(self.rule_sow(nested, used=self.draw(st.booleans()), prefer=own)
                                  for _ in range(self.int_(1, 2)))
                    s = dataclasses.replace(s, rule=(*s.rule, *after), after=len(after))
                out.append(s)
            return tuple(out)

        return visit(body, False, [()])

    def rule_sow(self, taken, used: bool, prefer=()) -> Sow:
        """A sow in a custom_jvp rule or a custom_vjp fwd (clobber or
        ``sow_cond``, or of another tag) of a value of the function's
        arguments. Its name may be one the program sows outside rules (the
        function's own body too: the rule's sow then clobbers, or is
        clobbered by, the function's), mostly one of ``prefer`` where given,
        but not in ``taken``: those that rules in the function's body sow
        (there taxpr orders a rule's own sows after those of the rules in a
        jit in its function:
        ``test_a_rule_sow_before_one_in_a_jit_in_its_function_is_clobbered``).
        Its result is ``used`` by the rule (``RULE_SCALE``), or not only
        where the program has no state: with state, differentiated from
        outside, an unused one is not reaped
        (``test_an_unused_sow_in_a_custom_jvp_rule_is_reaped_with_state``).
        Not in append mode (per-site values in a rule: a NotImplementedError),
        nor strict (a rule runs once per differentiated call)."""
        ctx = Ctx(ivars=("n",))  # the function's arguments
        free = [n for n in (*CLOBBER_NAMES, "q0") if n not in taken]
        # Half the time (where there are some) a name the program sows
        # elsewhere: the rule's sow then clobbers, or is clobbered by, those.
        elsewhere = [n for n in free if n in self.sown_elsewhere]
        preferred = [n for n in free if n in prefer]
        name = (self.pick(preferred) if preferred and self.int_(0, 3) > 0
                else self.pick(elsewhere) if elsewhere and self.draw(st.booleans())
                else self.pick((*free, OTHER)))
        uid = self.next_uid()
        tag, mode, pred = T, "clobber", None
        if name == OTHER:
            tag, name = OTHER, "o"
            kind = self.pick(("S", "V"))
        elif name == "q0":
            mode, kind, pred = "cond_clobber", "S", self.pred(ctx)
        else:
            kind = CLOBBER_NAMES[name]
        return Sow(uid, f"r{uid}" if used else None, self.expr(kind, ctx), name, mode, tag, pred)

    def typed_bump(self, state: str) -> Bump:
        """An exact update of the typed state ``state`` that reads nothing of
        the env (no ``xor``, no ``target``): a rule statement."""
        d = TYPED_STATES[state]
        values = typed_inits(d)
        init = tuple(self.pick(values) for _ in range(3)) if typed_shape(d) else self.pick(values)
        op = self.pick(tuple(o for o in TYPED_OPS[typed_kind(d)] if o != "xor"))
        arg = self.pick(typed_adds(d)) if op == "add" else None
        return Bump(self.next_uid(), state, init, self.pick(("scalar", "array", "callable")),
                    op, arg)

    def rule_tree(self, state: str) -> Tree:
        """An update of the pytree state ``state`` that reads nothing of the
        env (its float leaves averaged with constants, no targets): a rule
        statement."""
        kinds = tree_leaf_kinds(state)
        init = tuple(self.pick(typed_inits(PYTREE_INT)) if k == "i8"
                     else tuple(self.pick(CONSTS) for _ in range(3)) if k == "V"
                     else self.pick(CONSTS) for k in kinds)
        es = tuple(VConst(tuple(self.pick(CONSTS) for _ in range(3))) if k == "V"
                   else Const(self.pick(CONSTS)) for k in kinds if k != "i8")
        arg = self.pick(typed_adds(PYTREE_INT)) if "i8" in kinds else None
        return Tree(self.next_uid(), state, "update", init, es, arg, (None,) * len(kinds))

    def pad_branches(self, bodies: list, ctx: Ctx) -> None:
        """Every branch must sow the same (non-append) names: prepend the
        missing ones."""
        have = [{s.name: s.mode for s in sows(b) if s.mode != "append"} for b in bodies]
        union = {}
        for hv in have:
            union.update(hv)
        bctx = dataclasses.replace(ctx, in_branch=True)
        for body, hv in zip(bodies, have):
            missing = [n for n in union if n not in hv]
            body[:0] = [self.sow(bctx, union[n], n) for n in missing]


@st.composite
def programs(draw, budget: int = 12, allow=frozenset({"counter_state"})):
    gen = Gen(draw, draw(st.integers(min(4, budget), budget)), allow)
    body = gen.block(Ctx(), budget)
    if "custom_rules" in allow and draw(st.booleans()):
        # One more custom function at a random place of the top level, where
        # Gen.add_rules may give it rule statements: its body uses state (a
        # custom_vjp's fwd may have rule statements only then).
        f = gen.stmt(Ctx(), gen.pick(("cjvp", "cvjp")))
        if not uses_state(f.body):
            first = gen.stmt(Ctx(depth=1), gen.pick(("bump", "draw")))
            f = dataclasses.replace(f, body=(first, *f.body))
        pos = draw(st.integers(0, len(body)))
        body = (*body[:pos], f, *body[pos:])
    return Program(gen.add_rules(body))


F32 = st.sampled_from((0.5, -1.0, 1.5, 0.0, -0.75, 1.0, -2.0, 0.3))


@st.composite
def arguments(draw):
    p0, p1, p2 = draw(F32), draw(F32), draw(F32)
    pv = np.array([draw(F32) for _ in range(3)], np.float32)
    n = draw(st.integers(-1, 3))
    return (np.float32(p0), np.float32(p1), np.float32(p2), pv, np.int32(n))


# Fixed arguments (the deterministic tests, the static rules' test).
ARGS = (np.float32(0.5), np.float32(-1.0), np.float32(1.5), np.array([0.5, -0.5, 1.0], np.float32),
        np.int32(1))
ARGS2 = (np.float32(-1.0), np.float32(0.3), np.float32(-0.75), np.array([1.5, 0.0, -2.0],
                                                                        np.float32), np.int32(2))

"""Static views of a program.

Its statements (``walk``, ``children``; ``blocks``: every block with its
path and owners; ``scoped_walk``: with the ``tx.scope`` each runs in), the
sows of a tag and the names and modes sown, the states it mentions by full
name (``states_of``) and their inits at first use in trace order, its
append sites (``Slot``, ``append_slots``), which custom functions have
stateful rules or take ``p0``, the sows their rules make (``rule_sows``);
and ``insert``: a program with one statement more.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from .model import (FUNCTIONS, RNG, STATES, T, TYPED_STATES, Bump, Cond, CustomJvp, CustomVjp,
                    Draw, EqxLoop, Fori, Get, Program, Root, Scan, Scope, Set, Sow, Switch, Tree,
                    While, full_name, has_rule, sow_kind, tree_value, typed_value)


# ---------------------------------------------------------------------------------
# Static views of a program
# ---------------------------------------------------------------------------------

def children(s) -> list[tuple]:
    if isinstance(s, (Scan, Fori, While, Scope, *FUNCTIONS)):
        return [s.body]
    if isinstance(s, (Cond, Switch)):
        return list(s.branches)
    return []


def uses_state(stmts) -> bool:
    """Whether ``stmts`` read or write a state anywhere (statically; a key
    draw reads and writes the "rng" stream)."""
    return any(isinstance(s, (Get, Set, Draw, Bump, Tree)) or (isinstance(s, While) and (
        s.kind == "state" or s.spred or s.cbump)) for s in walk(stmts))


def stateful_custom_rules(program: Program) -> list:
    """The custom_jvp/custom_vjp functions whose rules have state: their body
    uses state (the rules call the function), or they have rule statements
    of their own. Differentiated, their rules run instead of the function
    (``Reference(diff=True)``); their derivatives are not autodiff's of the
    reference (what a rule writes is a constant w.r.t. the inputs), and no
    derivative flows through a read under a jax.grad inside
    (docs/limitations.md)."""
    return [s for s in walk(program.body)
            if isinstance(s, (CustomJvp, CustomVjp)) and (uses_state(s.body) or s.rule)]


def rule_functions(program: Program) -> list:
    """The custom functions with rule statements of their own."""
    return [s for s in walk(program.body) if has_rule(s)]


def takes_p0(s) -> bool:
    """A custom function with rule statements in it or nested in its body
    takes the program's ``p0`` as its last argument (custom functions read
    only their arguments)."""
    return isinstance(s, (CustomJvp, CustomVjp)) and any(
        has_rule(x) for x in (s, *walk(s.body)))


def walk(stmts):
    for s in stmts:
        yield s
        for b in children(s):
            yield from walk(b)


def sows(stmts, tag=T):
    """The sows of ``tag`` (a while's cond sow as a plain clobber ``Sow``)."""
    out = []
    for s in walk(stmts):
        if isinstance(s, Sow) and s.tag == tag:
            out.append(s)
        elif isinstance(s, While) and s.csow and tag == T:
            out.append(Sow(-1, None, None, s.csow[1], "clobber"))
    return out


def call_prefixes(s, prefix: tuple) -> list[tuple]:
    """The scopes of each call of function statement ``s`` called inside
    the scopes ``prefix``: ``s.scopes`` adds one per call."""
    assert not s.scopes or len(s.scopes) == s.calls, s
    return [(*prefix, sc) if sc else prefix for sc in (s.scopes or (None,) * s.calls)]


def scoped_walk(stmts, prefix: tuple = ()):
    """``(statement, scopes)`` of every statement, in trace order, with the
    scopes it runs in (``Scope`` statements, ``scopes`` of the calls): a
    function's body once per scope it is called in."""
    for s in stmts:
        yield s, prefix
        if isinstance(s, Scope):
            yield from scoped_walk(s.body, (*prefix, s.name))
        elif isinstance(s, FUNCTIONS):
            for p in dict.fromkeys(call_prefixes(s, prefix)):
                yield from scoped_walk(s.body, p)
        else:
            for b in children(s):
                yield from scoped_walk(b, prefix)


def states_of(program: Program) -> dict[str, str]:
    """full name -> kind of every state the program mentions ("S", "V":
    float32 scalar / [3], "I": the int32 counter, "K": the key stream, "Y":
    typed, "P": pytree-valued); inside ``tx.scope`` the full name has the
    scopes ("sa/s0")."""
    out = {}
    for s, prefix in scoped_walk(program.body):
        name = functools.partial(full_name, prefix)
        if isinstance(s, (Get, Set)):
            out[name(s.state)] = STATES[s.state]
        elif isinstance(s, Draw):
            out[RNG] = "K"
        elif isinstance(s, Bump):
            out[name(s.state)] = "Y"
        elif isinstance(s, Tree):
            out[name(s.state)] = "P"
        elif isinstance(s, While):
            if s.kind == "state":
                out[name("cnt")] = "I"
            if s.spred:
                out[name(s.spred[0])] = "S"
            if s.cbump:
                out[name(s.cbump.state)] = "Y"
    return out


def first_traced_inits(program: Program) -> dict:
    """Each state's (full name's) ``init`` at its first ``get_state`` in
    trace order (a pytree state's as the reference's value)."""
    out: dict = {}
    for s, prefix in scoped_walk(program.body):
        name = functools.partial(full_name, prefix)
        if isinstance(s, Get):
            out.setdefault(name(s.state), s.init)
        elif isinstance(s, Draw):
            out.setdefault(RNG, None)
        elif isinstance(s, Bump):
            out.setdefault(name(s.state), typed_value(TYPED_STATES[s.state], s.init))
        elif isinstance(s, Tree):
            if s.op != "set":
                out.setdefault(name(s.state), tree_value(s.state, s.init))
        elif isinstance(s, While):
            if s.kind == "state":
                out.setdefault(name("cnt"), 0)
            if s.cbump:  # traced before the predicate's reads
                out.setdefault(name(s.cbump.state),
                               typed_value(TYPED_STATES[s.cbump.state], s.cbump.init))
            if s.spred:
                out.setdefault(name(s.spred[0]), s.spred[1])
    return out


@dataclass(frozen=True)
class Slot:
    key: Any
    name: str
    lens: tuple  # lengths of the enclosing scans
    kind: str

    def rows(self) -> int:
        return self.lens[0] if self.lens else 1

    def shape(self) -> tuple:
        return (*self.lens, *((3,) if self.kind == "V" else ()))


def append_slots(program: Program) -> dict[str, list[Slot]]:
    """name -> its append sites in program (trace) order; a cond's branches
    share their slots (the taken branch fills them); a function called twice
    has its sites twice. A slot's key is ``(site, calls)``."""
    slots: dict[str, list[Slot]] = {}
    seen = set()

    def visit(stmts, lens, calls):
        for s in stmts:
            if isinstance(s, Sow) and s.tag == T and s.mode == "append":
                key = (s.slot or s.uid, calls)
                if key not in seen:
                    seen.add(key)
                    slots.setdefault(s.name, []).append(Slot(key, s.name, lens, sow_kind(s.name)))
            elif isinstance(s, Scan):
                visit(s.body, (*lens, s.length), calls)
            elif isinstance(s, FUNCTIONS):
                for c in range(s.calls):
                    visit(s.body, lens, (*calls, (s.uid, c)))
            else:
                for b in children(s):
                    visit(b, lens, calls)

    visit(program.body, (), ())
    return slots


def sow_names(program: Program, rules: bool = False) -> dict[str, str]:
    """name -> mode of every sow of tag T (``rules``: those of ``rule_sows``
    too, which run where the program is differentiated)."""
    out = {s.name: s.mode for s in sows(program.body)}
    if rules:
        out.update((s.name, s.mode) for s in rule_sows(program))
    return out


def rule_sows(program: Program, tag=T) -> list:
    """The sows of ``tag`` in the rules of the custom functions whose rules
    run where the program is differentiated (``Reference(diff=True)``): not
    those nested in a custom_vjp, custom_root or equinox loop (their
    function runs undifferentiated in the forward pass)."""
    out = []

    def visit(stmts, inside: bool):
        for s in stmts:
            if has_rule(s) and not inside:
                out.extend(r for r in s.rule if isinstance(r, Sow) and r.tag == tag)
            for b in children(s):
                visit(b, inside or isinstance(s, (CustomVjp, Root, EqxLoop)))

    visit(program.body, False)
    return out


def rule_sow_in_branch(program: Program) -> bool:
    """Whether a custom function whose rule sows (tag T) is in a branch of a
    cond / switch of several branches: differentiated inside the harvest,
    its sow is in that branch only."""
    def visit(stmts, in_branch: bool) -> bool:
        for s in stmts:
            if in_branch and any(isinstance(r, Sow) and r.tag == T
                                 for r in (s.rule if has_rule(s) else ())):
                return True
            branchy = isinstance(s, (Cond, Switch)) and len(s.branches) > 1
            if any(visit(b, in_branch or branchy) for b in children(s)):
                return True
        return False

    return visit(program.body, False)


# ---- blocks of a program, and a statement inserted into one --------------------------

def blocks(stmts, path=(), owners=()):
    """(path, owners) of every block: ``path`` = ((stmt index, child index), ...)
    from the top; ``owners`` the statements owning the nested blocks."""
    yield path, owners
    for i, s in enumerate(stmts):
        for j, b in enumerate(children(s)):
            yield from blocks(b, (*path, (i, j)), (*owners, s))


def insert(stmts: tuple, path: tuple, pos: int, new) -> tuple:
    """``stmts`` with ``new`` inserted at ``pos`` of the block at ``path``."""
    if not path:
        pos = min(pos, len(stmts))
        return (*stmts[:pos], new, *stmts[pos:])
    (i, j), rest = path[0], path[1:]
    s = stmts[i]
    if isinstance(s, (Cond, Switch)):
        branches = list(s.branches)
        branches[j] = insert(branches[j], rest, pos, new)
        s = dataclasses.replace(s, branches=tuple(branches))
    else:
        s = dataclasses.replace(s, body=insert(s.body, rest, pos, new))
    return (*stmts[:i], s, *stmts[i + 1:])

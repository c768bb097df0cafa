"""The statement model and the seeded generator.

A program is a tuple of statements, each a tuple whose first item names its
kind (``("bin", dst, op, a, b)``, ``("scan", length, body)``, ...); a
nested block is a tuple of statements. ``SLOTS`` are the variables a
program reads and writes (float32 scalars ``f*``, float32 vectors ``v*``, a
bfloat16 vector ``b0``, int32 scalars ``i*``). ``Gen`` draws statements from
one seed; ``program(seed)`` is the program of a seed. ``vmappable`` and
``differentiable`` say whether JAX can vmap / jvp a program
(``VMAP_REJECTIONS``: what vmap raises otherwise).
"""

from __future__ import annotations

import random

SLOTS = {"f0": "f", "f1": "f", "f2": "f", "v0": "v", "v1": "v", "b0": "b", "i0": "i", "i1": "i"}
FLOAT_LITS = (0.0, -0.0, 1.0, -1.0, 2.0, 0.5, float("nan"), float("inf"), float("-inf"), 3.0)
INT_LITS = (0, 1, -1, 2, 7, -3)
FBIN = ("add", "sub", "mul", "div", "max", "min")
FUN = ("sin", "neg", "abs", "exp", "sqrt", "tanh", "negneg")
IBIN = ("add", "sub", "mul", "div", "rem", "max")
MAX_DEPTH = 3


class Gen:
    """Random statements (tuples) from one seed."""

    def __init__(self, seed: int):
        self.r = random.Random(seed)

    def slot(self, kind=None):
        names = [n for n, k in SLOTS.items() if kind is None or k == kind]
        return self.r.choice(names)

    def operand(self, kind):
        if self.r.random() < 0.35:
            return ("lit", self.r.choice(INT_LITS if kind == "i" else FLOAT_LITS))
        return self.slot(kind)

    def stmt(self, depth):
        r = self.r.random()
        if depth < MAX_DEPTH and r < 0.18:
            kind = self.r.choice(("scan", "cond", "while", "jit", "ckpt"))
            body = self.block(depth + 1, self.r.randint(1, 4))
            if kind == "cond":
                return ("cond", self.slot("i"), body, self.block(depth + 1, self.r.randint(1, 3)))
            if kind == "scan":
                return ("scan", self.r.randint(0, 3), body)
            if kind == "while":
                return ("while", self.r.randint(0, 3), body)
            if kind == "jit":
                return ("jit", self.r.choice((1, 2, "twin")), body)
            return ("ckpt", body)
        kind = self.r.choice("ffffvvbii")
        if kind in "fv":
            k = "f" if kind == "f" else "v"
            c = self.r.random()
            if c < 0.45:
                return ("bin", self.slot(k), self.r.choice(FBIN), self.operand(k), self.operand(k))
            if c < 0.65:
                return ("un", self.slot(k), self.r.choice(FUN), self.slot(k))
            if c < 0.75:
                return ("constexpr", self.slot(k), self.r.choice(FBIN),
                        self.r.choice(FLOAT_LITS), self.r.choice(FLOAT_LITS))
            if c < 0.82:
                return ("copy", self.slot(k))
            if c < 0.9:
                return ("tag", self.slot(k))
            return ("callback", self.slot(k), self.r.choice(("io", "debug")))
        if kind == "b":
            return self.r.choice((
                ("bf_from", self.slot("v")),
                ("bf_bin", self.r.choice(FBIN), self.operand("f")),
                ("bf_to", self.slot("v"))))
        return ("ibin", self.slot("i"), self.r.choice(IBIN), self.operand("i"), self.operand("i"))

    def block(self, depth, n):
        out = []
        while len(out) < n:
            s = self.stmt(depth)
            out.append(s)
            # Repeated work: the same computation into another slot.
            if s[0] in ("bin", "un", "ibin", "constexpr") and self.r.random() < 0.4:
                others = [x for x in SLOTS if SLOTS[x] == SLOTS[s[1]] and x != s[1]
                          and x not in s[2:]]
                if others:
                    out.append((s[0], self.r.choice(others), *s[2:]))
        return tuple(out)


def program(seed: int):
    g = Gen(seed)
    return g.block(0, g.r.randint(3, 14))


def _walk(stmts):
    """Every statement, nested blocks included."""
    for s in stmts:
        yield s
        for part in s[1:]:
            if _is_block(part):
                yield from _walk(part)


def _is_block(part) -> bool:
    return isinstance(part, tuple) and bool(part) and isinstance(part[0], tuple)


# What JAX's vmap raises for an io_callback in a cond or a while whose
# predicate it batches: message -> exception type (JAX raises a bare
# Exception for the while).
VMAP_REJECTIONS = {
    "IO effect not supported in vmap-of-cond": NotImplementedError,
    "Unordered IO effects not supported in while_loop with batched predicate": Exception,
}
VMAP_REJECTS = "|".join(VMAP_REJECTIONS)


def vmappable(stmts) -> bool:
    """JAX cannot vmap an ``io_callback`` inside a ``cond`` or ``while``
    whose predicate it batches (``VMAP_REJECTS``)."""
    def has_io(block):
        return any(s[0] == "callback" and s[2] == "io" for s in _walk(block))
    return not any(s[0] == "cond" and (has_io(s[2]) or has_io(s[3]))
                   or s[0] == "while" and has_io(s[2]) for s in _walk(stmts))


def differentiable(stmts) -> bool:
    """``io_callback`` has no JVP rule."""
    return not any(s[0] == "callback" and s[2] == "io" for s in _walk(stmts))

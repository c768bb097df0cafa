"""The program model of the state / harvest fuzzer: a program is an AST.

Expressions (``Var`` ... ``SIdx``) over the float32 scalars ``f0 f1 f2``
and the float32[3] ``v`` (``ENV``), integer loop indices and ``n``;
statements (``Assign`` ... ``Scope``), each compound one numbered by
``uid``; a ``Program`` is a tuple of statements (it prints as the source it
renders to). Also the tables of the function statements' kinds
(``FUNCTION_KINDS``, how custom functions get their rules, which read only
their arguments, which are not differentiated), the states and sow names
programs use, the typed states ``y_<dtype>``: their dtypes, inits and
exact updates (``TYPED_OPS``; as source, ``OP_SOURCE`` and ``MIX``; computed
in NumPy, ``typed_update`` and ``typed_mix``), the pytree-valued states
(``PYTREE_STATES``: a tuple and a dict of leaves of several shapes and
dtypes, accessed by ``Tree``) and the names of ``tx.scope`` (``Scope``, and
the ``scopes`` of a function statement's calls), which give a state
accessed inside the full name ``scope/name`` (``full_name``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax.numpy as jnp
import ml_dtypes
import numpy as np


T = "fuzz"
OTHER = "other"
ENV = ("f0", "f1", "f2", "v")
SVARS = ("f0", "f1", "f2")


# ---------------------------------------------------------------------------------
# The AST
# ---------------------------------------------------------------------------------
# Expressions (kind "S": float32 scalar, "V": float32[3]); every op keeps values
# in [-2, 2] and is 1-Lipschitz, so float32 and the float64 reference agree.

@dataclass(frozen=True)
class Var:
    name: str


@dataclass(frozen=True)
class Const:
    value: float


@dataclass(frozen=True)
class VConst:
    values: tuple


@dataclass(frozen=True)
class Un:
    op: str  # sin | tanh
    a: Any


@dataclass(frozen=True)
class Bin:
    op: str  # avg: (a + b) * 0.5 | mul: a * b * 0.25
    a: Any
    b: Any


@dataclass(frozen=True)
class AddC:  # (a + c) * 0.5
    a: Any
    c: float


@dataclass(frozen=True)
class MulC:  # a * c, |c| <= 1
    a: Any
    c: float


@dataclass(frozen=True)
class Mean:  # V -> S
    a: Any


@dataclass(frozen=True)
class IdxF:  # int var -> float: float32(i % 3) * 0.5
    ivar: str


# Predicates / switch indices.
@dataclass(frozen=True)
class IPred:  # (ivar + c) % m == 0
    ivar: str
    c: int
    m: int


@dataclass(frozen=True)
class FPred:  # e > t
    e: Any
    t: float


@dataclass(frozen=True)
class SIdx:  # (ivar + c) % m, clamped by lax.switch
    ivar: str
    c: int
    m: int


# Statements. ``uid`` numbers nodes (unique per program).
@dataclass(frozen=True)
class Assign:
    target: str
    e: Any


@dataclass(frozen=True)
class Get:
    target: str
    state: str
    init: Any  # float or tuple of 3 floats


@dataclass(frozen=True)
class Set:
    state: str
    e: Any


@dataclass(frozen=True)
class Draw:  # target = uniform(tx.next_key(), minval=-1, maxval=1): stream "rng"
    target: str


@dataclass(frozen=True)
class Sow:
    uid: int
    target: Optional[str]  # None: the sow's result is unused
    e: Any
    name: str
    mode: str  # strict | clobber | append | cond_clobber
    tag: str = T
    pred: Any = None  # cond_clobber
    slot: Optional[tuple] = None  # append in a cond branch: (cond uid, k)


@dataclass(frozen=True)
class Scan:
    uid: int
    body: tuple
    length: int
    reverse: bool
    coefs: tuple  # xs = coefs * xsrc (float) and arange(length) (int)
    xsrc: Any
    yvar: str
    out: str


@dataclass(frozen=True)
class Fori:
    uid: int
    body: tuple
    ivar: str  # bounds: clip(ivar + lo, 0, 2), clip(ivar + hi, 0, 3)
    lo: int
    hi: int


@dataclass(frozen=True)
class While:
    uid: int
    body: tuple
    kind: str  # "carry": counter in the carry | "state": counter state "cnt"
    bound: int
    spred: Optional[tuple] = None  # (state, init, threshold): & get_state(state) > t
    csow: Optional[tuple] = None  # (var, name): clobber sow in the cond
    cbump: Optional["Bump"] = None  # a typed state updated by every run of the cond
    # "lax": lax.while_loop; else equinox's while_loop of that kind ("eqx_lax",
    # "eqx_checkpointed", "eqx_bounded"), which under vmap runs until every
    # example is done and masks its own carry. equinox runs the predicate
    # twice a step: no effects in it (csow, cbump) there.
    loop: str = "lax"


@dataclass(frozen=True)
class Cond:
    uid: int
    pred: Any
    branches: tuple  # (true_body, false_body)


@dataclass(frozen=True)
class Switch:
    uid: int
    idx: Any
    branches: tuple


@dataclass(frozen=True)
class Jit:
    uid: int
    body: tuple
    calls: int = 1  # 2: the same jitted function is called twice (one cached jaxpr)
    # Per call, the ``tx.scope`` around it (None: none; empty: none around
    # any call). Every function statement has it: one function object called
    # in two scopes keeps a state of its own in each (a jitted one is traced
    # again in the second).
    scopes: tuple = ()


@dataclass(frozen=True)
class Ckpt:
    uid: int
    body: tuple
    calls: int = 1
    scopes: tuple = ()


@dataclass(frozen=True)
class CustomJvp:
    """A ``jax.custom_jvp`` function whose rule is ``jax.jvp`` of the function
    itself (derivatives as autodiff's). Its body reads only its arguments (the
    env and ``n``): JAX's custom derivatives do not support closing over
    traced values.

    ``rule``: statements the rule runs before ``jax.jvp`` of the function:
    effects on states (``Bump`` without ``target`` of a typed state the
    program uses outside any rule, ``Tree`` updating a pytree state the
    program uses outside any rule with constants, ``Draw`` into a local where
    the program draws keys elsewhere) and sows (``Sow`` of a value of the arguments, of
    a name the program sows nowhere outside rules, not in append or strict
    mode; see ``Gen.add_rules``). A rule sow's ``target`` is None (its
    result unused) or ``r{uid}``, a local of the rule that scales the
    tangents it returns by ``1 + 0 * sum(r{uid})`` (``RULE_SCALE``): the
    rule stays the function's JVP, planted or not. A function with a rule
    statement, or with one nested in its body, takes the program's ``p0`` as
    an argument and its body ends with ``f0 = f0 + 0.0 * p0``: every
    derivative check differentiates ``p0``, so JAX always runs the rule
    (with all tangents symbolic zeros it runs the function instead).

    ``after``: the last ``after`` statements of ``rule`` (sows) run after
    ``jax.jvp`` of the function; their names may be ones the function sows
    (eagerly the rule's later sow clobbers the function's)."""
    uid: int
    body: tuple
    calls: int = 1
    rule: tuple = ()
    scopes: tuple = ()
    after: int = 0


@dataclass(frozen=True)
class CustomVjp:
    """A ``jax.custom_vjp`` function: fwd runs the function (saving its
    inputs), bwd is ``jax.vjp`` of it (derivatives as autodiff's; with state
    in the body the rules have state too). Reads only its arguments.
    ``rule``: statements the fwd runs before the function (as
    ``CustomJvp.rule``): effects on states only where the body uses state (a
    state access in the fwd of a custom_vjp whose body uses none is a
    StateError), and sows (as a custom_jvp rule's; reaped and planted where
    JAX differentiates the call, docs/harvest.md). A fwd sow's ``target`` is
    None or ``r{uid}``, which the fwd saves as a residual by which the bwd
    scales the cotangents, ``1 + 0 * sum(r{uid})`` (``FWD_SCALE``): the bwd
    stays the function's VJP, planted or not. ``after``: as
    ``CustomJvp.after``, the fwd's last sows run after the function."""
    uid: int
    body: tuple
    calls: int = 1
    rule: tuple = ()
    scopes: tuple = ()
    after: int = 0


@dataclass(frozen=True)
class Root:
    """``lax.custom_root`` whose ``solve`` runs the function once (newer JAX
    binds it as a high-level primitive holding the traced functions). Reads
    only its arguments, as a custom function."""
    uid: int
    body: tuple
    calls: int = 1
    scopes: tuple = ()


@dataclass(frozen=True)
class EqxLoop:
    """equinox's checkpointed ``while_loop`` (a custom_vjp around a while
    loop) running the function once: only clobber modes inside. Reads only
    its arguments."""
    uid: int
    body: tuple
    calls: int = 1
    scopes: tuple = ()


@dataclass(frozen=True)
class Bump:
    """A typed state: ``y = get_state(state, init)``, then ``set_state(state,
    op(y))`` with an update the reference computes bit for bit in the same
    dtype (``TYPED_OPS``); with ``target`` the float variable ``target``
    mixes in the new value through an exact cast (``MIX``)."""
    uid: int
    state: str  # "y_<dtype>" (TYPED_STATES)
    init: Any  # a value (tuple of 3 for a vector state; (re, im) pairs for complex)
    form: str  # the init as "scalar" | "array" (NumPy constants) | "callable"
    op: str  # TYPED_OPS
    arg: Any = None  # add: the constant; xor: a predicate
    target: Optional[str] = None


@dataclass(frozen=True)
class Tree:
    """A pytree-valued state (``PYTREE_STATES``: "pt" a tuple of a float32
    and a float32[3], "pd" a dict of an int8 and a float32[3]). ``op``:
    "get" reads it (``t = get_state(state, init)``) and mixes its leaves into
    ``targets``; "update" does too, then sets each float leaf to the average
    of its old value and its expression in ``es`` and pd's int8 leaf to its
    old value plus ``arg`` (wrapping around); "set" sets it without reading
    it: the float leaves to ``es``, pd's int8 leaf to ``int8(arg % 5)`` of
    the integer variable ``arg``."""
    uid: int
    state: str  # PYTREE_STATES
    op: str  # get | update | set
    init: Any = None  # get / update: the leaves' inits, in leaf order
    es: tuple = ()  # update / set: the float leaves' expressions, in leaf order
    arg: Any = None  # pd's int8 leaf: the constant added (update), the int variable (set)
    targets: tuple = ()  # get / update: per leaf, the variable it mixes into (or None)


@dataclass(frozen=True)
class Scope:
    """``with tx.scope(name):`` around ``body``: a state ``x`` accessed
    inside (get, set, typed, pytree, the while loops' counter and predicate
    states) is the state ``name/x``, nested scopes joined by "/"
    (``outer/inner/x``); the key stream ("rng") is never scoped."""
    uid: int
    name: str
    body: tuple


# The function statements: their kind in generated names.
FUNCTION_KINDS = {Jit: "jit", Ckpt: "ckpt", CustomJvp: "cjvp", CustomVjp: "cvjp", Root: "root",
                  EqxLoop: "eqxloop"}
FUNCTIONS = tuple(FUNCTION_KINDS)
# How a custom function gets its rules, given its name ``{f}`` (the custom
# function) and ``{f}_fn`` (the plain one).
CUSTOM_RULES = {
    "cjvp": ("jax.custom_jvp", "{f}.defjvp(lambda p, t: jax.jvp({f}_fn, p, t))"),
    "cvjp": ("jax.custom_vjp", "{f}.defvjp(lambda *p: ({f}_fn(*p), p), "
                               "lambda p, ct: jax.vjp({f}_fn, *p)[1](ct))"),
}
# Functions called through a library's higher-order operation, given the
# plain one ``{f}_fn(*env, *rest)``: ``{f}(*env, *rest)`` runs it once.
CALL_WRAPPERS = {
    "root": ("lambda *a: lax.custom_root(lambda y: jax.tree_util.tree_map(jnp.zeros_like, y), "
             "a[:4], lambda _, y: {f}_fn(*y, *a[4:]), lambda g, y: y)"),
    "eqxloop": ("lambda *a: eqxi.while_loop(lambda c: c[0] < 1, "
                "lambda c: (c[0] + 1, {f}_fn(*c[1], *a[4:])), (jnp.int32(0), a[:4]), "
                "max_steps=1, kind=\"checkpointed\")[1]"),
}
# Reads only its arguments: JAX's custom derivatives (and custom_root) do
# not support closing over traced values.
ARGUMENTS_ONLY = (*CUSTOM_RULES, *CALL_WRAPPERS)
# Derivatives through these are not the eager ones: custom_root's implicit
# derivative ignores the initial guess; the checkpointed loop recomputes the
# forward (a known gap, docs/limitations.md).
NOT_DIFFERENTIATED = (Root, EqxLoop)


# A custom function's rule with statements of its own (``rule``): its
# header, its call of the function (the statements before it run first, the
# last ``after`` ones then), what it returns and how it is installed, given
# ``{f}`` and ``{f}_fn`` as in ``CUSTOM_RULES``.
RULE_DEFS = {
    "cjvp": ("def {f}_rule(p, t):", "out, out_t = jax.jvp({f}_fn, p, t)", "return out, out_t",
             "{f}.defjvp({f}_rule)"),
    "cvjp": ("def {f}_fwd(*p):", "out = {f}_fn(*p)", "return out, p",
             "{f}.defvjp({f}_fwd, lambda p, ct: jax.vjp({f}_fn, *p)[1](ct))"),
}
# What a custom_jvp rule with sows whose result it uses (``CustomJvp.rule``)
# returns, given the sum ``{r}`` of those results: the JVP of the function,
# its tangents scaled by one (planted or not).
RULE_SCALE = "return out, tuple(x * (1.0 + 0.0 * ({r})) for x in out_t)"
# What a custom_vjp fwd with sows whose result it uses (``CustomVjp.rule``)
# returns, given the sum ``{r}`` of those results (a residual), and how it
# is installed: a bwd that scales the cotangents by one.
FWD_SCALE = ("return out, (p, {r})",
             "{f}.defvjp({f}_fwd, lambda res, ct: jax.vjp({f}_fn, *res[0])[1]("
             "tuple(x * (1.0 + 0.0 * res[1]) for x in ct)))")
# The line a function with rule statements ends with: its body uses ``p0``
# (an argument with a nonzero tangent in every derivative check), so JAX runs
# its rule whenever it differentiates the call, whatever the other tangents.
P0_USE = "f0 = f0 + 0.0 * p0"


def has_rule(s) -> bool:
    """Whether ``s`` is a custom function with rule statements."""
    return isinstance(s, (CustomJvp, CustomVjp)) and bool(s.rule)


def rule_reads_env(s) -> bool:
    """Whether ``s``'s rule statements read its arguments (a sow's value):
    the rule unpacks them first."""
    return has_rule(s) and any(isinstance(r, Sow) for r in s.rule)


def rule_split(s) -> tuple[tuple, tuple]:
    """``s``'s rule statements run before its function, and those after."""
    k = len(s.rule) - s.after
    return s.rule[:k], s.rule[k:]


def rule_results(s) -> list:
    """The locals ``r{uid}`` of ``s``'s rule (or fwd) sows whose result the
    rule uses."""
    return [r.target for r in s.rule if isinstance(r, Sow) and r.target]


def not_differentiated(s) -> bool:
    """Derivatives through ``s`` are not checked (``NOT_DIFFERENTIATED``, or
    equinox's checkpointed loop, which has no forward mode)."""
    return isinstance(s, NOT_DIFFERENTIATED) or (isinstance(s, While)
                                                 and s.loop == "eqx_checkpointed")


@dataclass(frozen=True, repr=False)
class Program:
    body: tuple

    def __repr__(self):
        from .render import to_source  # (render imports this module)
        return "\n" + to_source(self, header=False)

    def _repr_pretty_(self, p, cycle):  # hypothesis prints the failing draw as source
        p.text(repr(self))


STATES = {"s0": "S", "s1": "S", "sv": "V"}
CLOBBER_NAMES = {"c0": "S", "c1": "S", "cv": "V"}
STRICT_NAMES = {"t0": "S", "t1": "S"}
RNG = "rng"  # the stream next_key draws from: a state holding a typed key
SCOPE_NAMES = ("sa", "sb")  # tx.scope's names (no state is named so)


def full_name(prefix: tuple, name: str) -> str:
    """State ``name`` accessed inside the scopes ``prefix`` (outermost
    first): its full name, the "/"-joined scopes and name; the key stream's
    is never scoped."""
    return name if name == RNG or not prefix else "/".join((*prefix, name))


def base_name(name: str) -> str:
    """A state's own name, without its scopes."""
    return name.rsplit("/", 1)[-1]


# Pytree-valued states: name -> (container, its leaves in JAX's leaf order (a
# dict's keys sorted), each (key, kind)): "S" / "V" a float32 scalar / [3]
# (differentiated, as the states of ``STATES``), "i8" an int8 scalar (a typed
# leaf: exact, updated by wrapping additions, not differentiated).
PYTREE_STATES = {"pt": ("tuple", ((0, "S"), (1, "V"))),
                 "pd": ("dict", (("c", "i8"), ("w", "V")))}
PYTREE_INT = "int8"  # the dtype of the "i8" leaves (typed_* helpers)


def tree_leaf_kinds(state: str) -> tuple:
    return tuple(kind for _, kind in PYTREE_STATES[state][1])


def tree_value(state: str, leaves) -> Any:
    """The reference's value of pytree state ``state`` from its leaves (in
    leaf order): float leaves in float64, the int8 leaf a NumPy int8."""
    container, spec = PYTREE_STATES[state]
    vals = [typed_value(PYTREE_INT, x) if kind == "i8"
            else np.array(x, np.float64) if kind == "V" else np.float64(x)
            for (_, kind), x in zip(spec, leaves)]
    if container == "tuple":
        return tuple(vals)
    return {key: x for (key, _), x in zip(spec, vals)}


def tree_zeros(state: str) -> Any:
    """The value of a pytree state first set before it is read: zeros."""
    return tree_value(state, [(0.0, 0.0, 0.0) if k == "V" else 0 for k in tree_leaf_kinds(state)])


def tree_leaves(state: str, value) -> list:
    """The leaves of a pytree state's value, in leaf order."""
    return [value[key] for key, _ in PYTREE_STATES[state][1]]


# Typed states: one state "y_<dtype>" per dtype JAX has with x64 off, some
# of them float32[3]-like vectors ([3] of that dtype, so they mix into ``v``).
# Left out: int2 / uint2 (ml_dtypes' NumPy arithmetic leaves the type's range
# and XLA on CPU computes wrong values in a scan with cond and while),
# float6_e2m3fn / float6_e3m2fn (XLA's CPU compiler aborts the process on
# JAX 0.11 / 0.12), float8_e8m0fnu (no zero and no negatives: none of the
# exact updates below stays in it).
TYPED_DTYPES = ("bool", "int8", "int16", "int32", "uint8", "uint16", "uint32", "int4", "uint4",
                "float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e3m4",
                "float8_e4m3", "float4_e2m1fn", "complex64")
TYPED_VECTORS = frozenset({"bool", "int16", "uint16", "uint4", "bfloat16", "float8_e5m2",
                           "float4_e2m1fn", "complex64"})
TYPED_STATES = {f"y_{d}": d for d in TYPED_DTYPES}  # state name -> dtype name
# NumPy's own dtypes; the others are ml_dtypes' (JAX's float8 / bfloat16 / int4 ...).
NUMPY_DTYPES = frozenset({"bool", "int8", "int16", "int32", "uint8", "uint16", "uint32",
                          "float16", "float32", "complex64"})


def np_dtype(d: str) -> np.dtype:
    return np.dtype(getattr(jnp, "bool_" if d == "bool" else d))


def typed_kind(d: str) -> str:
    """"b" (bool) | "i" (signed and unsigned ints) | "f" | "c" (ml_dtypes'
    dtypes have NumPy kind "V": asked of JAX)."""
    dt = np_dtype(d)
    if dt == np.bool_:
        return "b"
    if jnp.issubdtype(dt, jnp.integer):
        return "i"
    return "c" if jnp.issubdtype(dt, jnp.complexfloating) else "f"


def typed_shape(d: str) -> tuple:
    return (3,) if d in TYPED_VECTORS else ()


# The exact updates per kind: integers wrap around (NumPy and XLA both do);
# floats stay integers in [-3, 3] (exact in every float type down to float4,
# intermediate results too); ``s * 1j`` only swaps a complex's parts (and
# negates one: parts are never zero, so no signed zeros).
TYPED_OPS = {"b": ("not", "xor"), "i": ("add",), "f": ("inc", "neg"), "c": ("rot",)}
OP_SOURCE = {"not": "~{y}", "xor": "{y} ^ ({arg})", "add": "{y} + {arg}", "inc": "({y} + 1) % 4",
             "neg": "{y} * -1", "rot": "{y} * 1j"}
# A typed value as a float32 in [0, 1] (0 or 1 but for complex parts), exactly.
MIX = {"b": "{y}.astype(jnp.float32)", "i": "({y} % 2).astype(jnp.float32)",
       "f": "({y} % 2).astype(jnp.float32)", "c": "(jnp.real({y}) % 2).astype(jnp.float32)"}


def typed_inits(d: str) -> tuple:
    """The initial values a state of dtype ``d`` may start from."""
    k = typed_kind(d)
    if k == "b":
        return (True, False)
    if k == "i":
        info = ml_dtypes.iinfo(np_dtype(d))
        return (0, 5, int(info.min), int(info.max))
    if k == "f":
        return (0.0, 1.0, -2.0, 3.0, -1.0)
    # No zero parts: the sign of a zero part of ``s * 1j`` depends on how
    # XLA computes the product (a fused or folded one differs from NumPy's).
    return ((1.0, 2.0), (2.0, -1.0), (-3.0, 1.0), (-1.0, -1.0))


def typed_adds(d: str) -> tuple:
    """Constants an integer state is incremented by: two of them wrap around fast."""
    info = ml_dtypes.iinfo(np_dtype(d))
    return (1, int(info.max) // 2 + 1, int(info.max))


def typed_value(d: str, init):
    """``init`` as a NumPy value of dtype ``d`` (what the source's constant is)."""
    dt = np_dtype(d)
    if typed_kind(d) == "c":
        init = [complex(*c) for c in init] if typed_shape(d) else complex(*init)
    return np.asarray(init, dt)


def typed_update(d: str, op: str, y, arg=None):
    """The reference of ``OP_SOURCE[op]``: in dtype ``d``, as XLA computes it."""
    t = np_dtype(d).type
    with np.errstate(over="ignore"):
        if op == "not":
            out = ~y
        elif op == "xor":
            out = y ^ np.bool_(arg)
        elif op == "add":
            out = y + t(arg)
        elif op == "inc":
            out = (y + t(1)) % t(4)
        elif op == "neg":
            out = y * t(-1)
        else:  # rot
            out = y * t(1j)
    return np.asarray(out, np_dtype(d))


def typed_mix(d: str, y) -> np.ndarray:
    """The reference of ``MIX``, in float64."""
    k = typed_kind(d)
    if k == "b":
        return np.asarray(y, np.float64)
    if k == "c":
        return np.asarray(np.real(y) % np.float32(2), np.float64)
    return np.asarray(y % np_dtype(d).type(2), np.float64)


def typed_next(d: str, y) -> np.ndarray:
    """Another valid value of a typed state (for ``perturb``)."""
    op = {"b": "not", "i": "add", "f": "inc", "c": "rot"}[typed_kind(d)]
    return typed_update(d, op, np.asarray(y, np_dtype(d)), 1)


def var_kind(name: str) -> str:
    return "V" if name == "v" else "S"


def sow_kind(name: str) -> str:
    return "V" if name.endswith("v") else "S"


def append_name(base: str, scan_lens: tuple, kind: str) -> str:
    """Append sows of one name must stack to one shape: a direct sow gives a
    row, a scan a block of rows, so the inner scan lengths are in the name."""
    return base + "".join(f"_{n}" for n in scan_lens[1:]) + ("v" if kind == "V" else "")

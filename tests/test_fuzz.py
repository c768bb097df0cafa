"""Differential fuzzing of state and harvest.

Hypothesis generates small random programs as an AST (``Program``): scalar
float32 variables ``f0 f1 f2`` and a float32[3] ``v``, integer loop indices,
``get_state`` / ``set_state`` of three states (plus an int32 counter state),
``tx.next_key`` draws (``uniform(next_key(), -1, 1)``: the "rng" stream, a
typed key as state; the reference splits a Python key variable per draw),
typed states ``y_<dtype>`` of every dtype JAX has with x64 off
(``TYPED_DTYPES``: bool, int8/16/32, uint8/16/32, int4, uint4, float16,
bfloat16, float32, seven float8 types, float4_e2m1fn, complex64; scalars or
[3]) read with an init of that dtype (a NumPy scalar or array, or a callable)
and set to an update that is exact in it (integers ``+ c`` wrapping around,
bool ``~s`` or ``s ^ predicate``, integer-valued floats ``(s + 1) % 4`` or
``s * -1``, complex ``s * 1j``), sometimes mixed into a float variable by
an exact cast (so typed values flow through carries and outputs),
``sow`` / ``sow_cond`` in every mode (and sows of another tag), and
``lax.scan`` (incl. ``reverse=True`` and length 0), ``fori_loop`` with traced
bounds, ``while_loop`` whose cond reads state (and may sow, and may write a
typed state: one run more than the body), ``cond``,
``switch``, ``jax.jit``, ``jax.checkpoint``, custom_jvp / custom_vjp functions
(whose rule / fwd may bump typed states and draw keys itself before calling
the function: ``CustomJvp.rule``), ``lax.custom_root`` and equinox's
checkpointed ``while_loop`` (each called once or twice) nested up to depth 4. Every op keeps values in [-2, 2] and is 1-Lipschitz.

Each program has two interpreters:

* ``to_source(program)`` renders it as Python source using raw JAX control
  flow, ``tx.get_state`` / ``tx.set_state`` and ``h.sow``; the JAX side
  ``exec``s exactly that source, so a failing (shrunk) program prints as the
  code that failed (in the exception's note and as hypothesis' "Draw 1");
* ``Reference`` runs the AST eagerly in float64 NumPy with Python control
  flow, a dict for states (a state's initial value is its ``init`` at first
  use; one first set starts at zeros; one never reached starts at its first
  traced ``init``; a typed state stays in its NumPy dtype, ml_dtypes' for
  bfloat16 / float8 / int4 ..., and is compared exactly: same dtype, same
  bits) and per-site records for sows (``append``: one row per
  direct sow and one block per scan site, in trace order, stacked along the
  scan axes, reverse scans aligned with xs; ``clobber``: last value wins,
  zeros if never run; ``cond_clobber``: last value whose predicate held;
  plants replace values, append plants split row by row the same way).
  A float predicate within 1e-3 of its threshold discards the example.
  Differentiated (``diff=True``), a custom function's rule runs instead of
  the function, as JAX runs it: its rule statements, then its body.

The checks (one test each; ``_long`` variants for the long profile):
``uncurry`` (state0; ``pure(state0)`` not jitted, with ``check_jaxpr`` of the
rewritten jaxprs; ``pure(other state)`` jitted or not), ``reap`` (of the pure
function, or ``uncurry`` of a reaping function; with allow/blocklists),
``harvest``/``plant`` (random plants of every mode), ``vmap`` of ``pure`` and
of its reap over two states/argument sets, derivatives (``jvp``, and ``grad``
without while loops, of pure / reap / plant against finite differences of the
reference, w.r.t. the arguments and the float32 states ``s0 s1 sv``: typed
states are carried, not differentiated; with stateful custom rules, jvp / vjp
of pure and ``value_and_grad`` inside, outputs and states against the
differentiated reference), ``reap`` of the raw stateful
function, ``uncurry`` / ``reap`` under ``jax.disable_jit()`` (where a
``while_loop`` first tries its loop in Python), and static-rule violations.
A last test checks that the CI profile
generated typed states with every update in every kind of body;
``test_typed_states_of_every_dtype_through_every_primitive_match_reference``
runs every dtype through every primitive's carries deterministically.

The generator respects harvest's static rules (strict only outside loops,
branches and functions called twice, once per name; only clobber modes inside
``while`` / traced ``fori``; every cond branch sows the same names: appends
and strict sows only as identical "tails" of every branch, missing clobber
names padded in; an append name encodes its inner scan lengths so that its
sows stack). ``test_static_rule_violations_raise`` breaks one rule on purpose.

Profiles: CI runs 570 programs (+60 rule violations), about a minute;
``TAXPR_FUZZ_LONG=1`` or ``pytest -m long`` runs 20,000 (derandomized);
``TAXPR_FUZZ_EXAMPLES=N`` sets that count and ``TAXPR_FUZZ_SEED=S`` seeds it.
"""

from __future__ import annotations

import collections
import dataclasses
import linecache
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings, strategies as st
from hypothesis.errors import InvalidArgument
from jax import lax

import taxpr as tx
from taxpr import harvest as h

from helpers import check

T = "fuzz"
OTHER = "other"
ENV = ("f0", "f1", "f2", "v")
SVARS = ("f0", "f1", "f2")
MAX_DEPTH = 4


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


@dataclass(frozen=True)
class Ckpt:
    uid: int
    body: tuple
    calls: int = 1


@dataclass(frozen=True)
class CustomJvp:
    """A ``jax.custom_jvp`` function whose rule is ``jax.jvp`` of the function
    itself (derivatives as autodiff's). Its body reads only its arguments (the
    env and ``n``): JAX's custom derivatives do not support closing over
    traced values.

    ``rule``: statements the rule runs before ``jax.jvp`` of the function
    (effects on states only: ``Bump`` without ``target`` of a typed state the
    program uses outside any rule, ``Draw`` into a local where the program
    draws keys elsewhere; see ``Gen.add_rules``). A function with a rule
    statement, or with one nested in its body, takes the program's ``p0`` as
    an argument and its body ends with ``f0 = f0 + 0.0 * p0``: every
    derivative check differentiates ``p0``, so JAX always runs the rule
    (with all tangents symbolic zeros it runs the function instead)."""
    uid: int
    body: tuple
    calls: int = 1
    rule: tuple = ()


@dataclass(frozen=True)
class CustomVjp:
    """A ``jax.custom_vjp`` function: fwd runs the function (saving its
    inputs), bwd is ``jax.vjp`` of it (derivatives as autodiff's; with state
    in the body the rules have state too). Reads only its arguments.
    ``rule``: statements the fwd runs before the function (as
    ``CustomJvp.rule``; only where the body uses state: a state access in the
    fwd of a custom_vjp whose body uses none is a StateError)."""
    uid: int
    body: tuple
    calls: int = 1
    rule: tuple = ()


@dataclass(frozen=True)
class Root:
    """``lax.custom_root`` whose ``solve`` runs the function once (newer JAX
    binds it as a high-level primitive holding the traced functions). Reads
    only its arguments, as a custom function."""
    uid: int
    body: tuple
    calls: int = 1


@dataclass(frozen=True)
class EqxLoop:
    """equinox's checkpointed ``while_loop`` (a custom_vjp around a while
    loop) running the function once: only clobber modes inside. Reads only
    its arguments."""
    uid: int
    body: tuple
    calls: int = 1


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
# header, and what it returns and how it is installed, given ``{f}`` and
# ``{f}_fn`` as in ``CUSTOM_RULES``.
RULE_DEFS = {
    "cjvp": ("def {f}_rule(p, t):", "return jax.jvp({f}_fn, p, t)", "{f}.defjvp({f}_rule)"),
    "cvjp": ("def {f}_fwd(*p):", "return {f}_fn(*p), p",
             "{f}.defvjp({f}_fwd, lambda p, ct: jax.vjp({f}_fn, *p)[1](ct))"),
}
# The line a function with rule statements ends with: its body uses ``p0``
# (an argument with a nonzero tangent in every derivative check), so JAX runs
# its rule whenever it differentiates the call, whatever the other tangents.
P0_USE = "f0 = f0 + 0.0 * p0"


def has_rule(s) -> bool:
    """Whether ``s`` is a custom function with rule statements."""
    return isinstance(s, (CustomJvp, CustomVjp)) and bool(s.rule)


def takes_p0(s) -> bool:
    """A custom function with rule statements in it or nested in its body
    takes the program's ``p0`` as its last argument (custom functions read
    only their arguments)."""
    return isinstance(s, (CustomJvp, CustomVjp)) and any(
        has_rule(x) for x in (s, *walk(s.body)))


def not_differentiated(s) -> bool:
    """Derivatives through ``s`` are not checked (``NOT_DIFFERENTIATED``, or
    equinox's checkpointed loop, which has no forward mode)."""
    return isinstance(s, NOT_DIFFERENTIATED) or (isinstance(s, While)
                                                 and s.loop == "eqx_checkpointed")


@dataclass(frozen=True, repr=False)
class Program:
    body: tuple

    def __repr__(self):
        return "\n" + to_source(self, header=False)

    def _repr_pretty_(self, p, cycle):  # hypothesis prints the failing draw as source
        p.text(repr(self))


STATES = {"s0": "S", "s1": "S", "sv": "V"}
CLOBBER_NAMES = {"c0": "S", "c1": "S", "cv": "V"}
STRICT_NAMES = {"t0": "S", "t1": "S"}


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


# ---------------------------------------------------------------------------------
# Rendering as Python source (the JAX interpreter execs exactly this)
# ---------------------------------------------------------------------------------

HEADER = """\
import jax, jax.numpy as jnp, ml_dtypes, numpy as np
from jax import lax
import equinox.internal as eqxi
import taxpr as tx
from taxpr import harvest as h
T, OTHER = "fuzz", "other"
"""


def _f(x: float) -> str:
    return repr(float(x))


def _vec(vals) -> str:
    return f"jnp.array([{', '.join(_f(x) for x in vals)}], jnp.float32)"


def _npinit(init) -> str:
    if isinstance(init, tuple):
        return f"np.array([{', '.join(_f(x) for x in init)}], np.float32)"
    return f"np.float32({_f(init)})"


def rexpr(e, top: bool = True) -> str:
    def wrap(s):
        return s if top else f"({s})"

    if isinstance(e, Var):
        return e.name
    if isinstance(e, Const):
        return f"jnp.float32({_f(e.value)})"
    if isinstance(e, VConst):
        return _vec(e.values)
    if isinstance(e, Un):
        return f"jnp.{e.op}({rexpr(e.a)})"
    if isinstance(e, Bin):
        if e.op == "avg":
            return wrap(f"({rexpr(e.a, False)} + {rexpr(e.b, False)}) * 0.5")
        return wrap(f"{rexpr(e.a, False)} * {rexpr(e.b, False)} * 0.25")
    if isinstance(e, AddC):
        return wrap(f"({rexpr(e.a, False)} + {_f(e.c)}) * 0.5")
    if isinstance(e, MulC):
        return wrap(f"{rexpr(e.a, False)} * {_f(e.c)}")
    if isinstance(e, Mean):
        return f"jnp.mean({rexpr(e.a)})"
    if isinstance(e, IdxF):
        return wrap(f"jnp.float32({e.ivar} % 3) * 0.5")
    if isinstance(e, IPred):
        return f"({e.ivar} + {e.c}) % {e.m} == 0"
    if isinstance(e, FPred):
        return f"{rexpr(e.e, False)} > {_f(e.t)}"
    if isinstance(e, SIdx):
        return f"({e.ivar} + {e.c}) % {e.m}"
    raise TypeError(e)


def _state_get(state: str, init) -> str:
    return f'tx.get_state("{state}", {_npinit(init)})'


def _typed_lit(d: str, value) -> str:
    """One value of dtype ``d`` as a Python literal."""
    k = typed_kind(d)
    if k == "b":
        return repr(bool(value))
    if k == "i":
        return repr(int(value))
    if k == "f":
        return _f(value)
    return f"complex({_f(value[0])}, {_f(value[1])})"  # no -0.0 from a "-2j" literal


def _typed_type(d: str) -> str:
    """The NumPy scalar type of dtype ``d`` in source."""
    if d not in NUMPY_DTYPES:
        return f"ml_dtypes.{d}"
    return "np.bool_" if d == "bool" else f"np.{d}"


def _typed_init(d: str, init, form: str) -> str:
    """A typed state's init as a NumPy constant (or a callable returning one)."""
    if typed_shape(d):
        src = f"np.array([{', '.join(_typed_lit(d, x) for x in init)}], {_typed_type(d)})"
    elif form == "scalar":
        src = f"{_typed_type(d)}({_typed_lit(d, init)})"
    else:
        src = f"np.array({_typed_lit(d, init)}, {_typed_type(d)})"
    return f"lambda: {src}" if form == "callable" else src


def bump_lines(s: Bump, init_src: str) -> list[str]:
    """The source lines of a ``Bump`` whose init renders as ``init_src``."""
    d = TYPED_STATES[s.state]
    y = f"y{s.uid}"
    arg = (rexpr(s.arg) if s.op == "xor" else f"{_typed_type(d)}({s.arg})" if s.op == "add"
           else None)
    lines = [f'{y} = tx.get_state("{s.state}", {init_src})',
             f"{y} = {OP_SOURCE[s.op].format(y=y, arg=arg)}",
             f'tx.set_state("{s.state}", {y})']
    if s.target:
        mix = MIX[typed_kind(d)].format(y=y)
        lines.append(f"{s.target} = {s.target} * 0.5 + {mix} * 0.25")
    return lines


CNT_GET = 'tx.get_state("cnt", np.int32(0))'
DRAW = "jax.random.uniform(tx.next_key(), minval=-1.0, maxval=1.0)"
RNG = "rng"  # the stream next_key draws from: a state holding a typed key
ENV_S = ", ".join(ENV)


def rblock(stmts, ind: str, out: list) -> None:
    for s in stmts:
        rstmt(s, ind, out)


def rstmt(s, ind: str, out: list) -> None:
    w = lambda line: out.append(ind + line)  # noqa: E731
    i2 = ind + "    "
    if isinstance(s, Assign):
        w(f"{s.target} = {rexpr(s.e)}")
    elif isinstance(s, Get):
        w(f"{s.target} = {_state_get(s.state, s.init)}")
    elif isinstance(s, Set):
        w(f'tx.set_state("{s.state}", {rexpr(s.e)})')
    elif isinstance(s, Draw):
        w(f"{s.target} = {DRAW}")
    elif isinstance(s, Bump):
        for line in bump_lines(s, _typed_init(TYPED_STATES[s.state], s.init, s.form)):
            w(line)
    elif isinstance(s, Sow):
        tag = "T" if s.tag == T else "OTHER"
        if s.mode == "cond_clobber":
            call = f'h.sow_cond({rexpr(s.e)}, {rexpr(s.pred)}, tag={tag}, name="{s.name}")'
        else:
            call = f'h.sow({rexpr(s.e)}, tag={tag}, name="{s.name}", mode="{s.mode}")'
        w(f"{s.target} = {call}" if s.target else call)
    elif isinstance(s, Scan):
        u = s.uid
        w(f"def scan{u}(carry, xi):")
        out.append(f"{i2}{ENV_S} = carry")
        out.append(f"{i2}x{u}, i{u} = xi")
        rblock(s.body, i2, out)
        out.append(f"{i2}return ({ENV_S}), {s.yvar}")
        coefs = _vec(s.coefs) if s.length else "jnp.zeros((0,), jnp.float32)"
        rev = ", reverse=True" if s.reverse else ""
        w(f"({ENV_S}), ys{u} = lax.scan(scan{u}, ({ENV_S}), ({coefs} * {rexpr(s.xsrc, False)}, "
          f"jnp.arange({s.length}, dtype=jnp.int32)){rev})")
        w(f"{s.out} = jnp.tanh(jnp.sum(ys{u}, axis=0))")
    elif isinstance(s, Fori):
        u = s.uid
        w(f"def fori{u}(i{u}, carry):")
        out.append(f"{i2}{ENV_S} = carry")
        rblock(s.body, i2, out)
        out.append(f"{i2}return {ENV_S}")
        w(f"{ENV_S} = lax.fori_loop(jnp.clip({s.ivar} + {s.lo}, 0, 2), "
          f"jnp.clip({s.ivar} + {s.hi}, 0, 3), fori{u}, ({ENV_S}))")
    elif isinstance(s, While):
        u = s.uid
        carry = f"k{u}, ({ENV_S})" if s.kind == "carry" else ENV_S
        if s.kind == "state":
            w(f"lim{u} = {CNT_GET} + {s.bound}")
        w(f"def wcond{u}(carry):")
        out.append(f"{i2}{carry} = carry")
        if s.csow:
            out.append(f'{i2}h.sow({s.csow[0]}, tag=T, name="{s.csow[1]}", mode="clobber")')
        if s.cbump:
            out += [i2 + line for line in bump_lines(
                s.cbump, _typed_init(TYPED_STATES[s.cbump.state], s.cbump.init, s.cbump.form))]
        pred = f"k{u} < {s.bound}" if s.kind == "carry" else f"{CNT_GET} < lim{u}"
        if s.spred:
            st_, init, t = s.spred
            pred = f"({pred}) & ({_state_get(st_, init)} > {_f(t)})"
        out.append(f"{i2}return {pred}")
        w(f"def wbody{u}(carry):")
        out.append(f"{i2}{carry} = carry")
        if s.kind == "state":
            out.append(f'{i2}tx.set_state("cnt", {CNT_GET} + 1)')
        rblock(s.body, i2, out)
        out.append(f"{i2}return " + (f"k{u} + 1, ({ENV_S})" if s.kind == "carry" else ENV_S))
        if s.loop == "lax":
            loop = "lax.while_loop({})"
        else:  # at most `bound` steps: equinox's max_steps
            # equinox's bounded loop of one step runs its body unconditionally
            # (a "false step" whose carry it masks: its effects happen, as a
            # jax.debug.callback's would), which the reference's while does
            # not model: at least two steps, each under a cond.
            least = 2 if s.loop == "eqx_bounded" else 1
            loop = (f"eqxi.while_loop({{}}, max_steps={max(s.bound, least)}, "
                    f"kind=\"{s.loop.removeprefix('eqx_')}\")")
        if s.kind == "carry":
            w(f"_, ({ENV_S}) = " + loop.format(f"wcond{u}, wbody{u}, (jnp.int32(0), ({ENV_S}))"))
        else:
            w(f"{ENV_S} = " + loop.format(f"wcond{u}, wbody{u}, ({ENV_S})"))
    elif isinstance(s, (Cond, Switch)):
        u = s.uid
        for b, body in enumerate(s.branches):
            w(f"def br{u}_{b}({ENV_S}):")
            rblock(body, i2, out)
            out.append(f"{i2}return {ENV_S}")
        w(branch_call(s, ENV_S))
    elif isinstance(s, FUNCTIONS):
        kind = FUNCTION_KINDS[type(s)]
        custom = kind in ARGUMENTS_ONLY
        if kind in ("jit", "ckpt"):
            w("@jax.jit" if kind == "jit" else "@jax.checkpoint")
        # A custom function takes ``n`` (and ``p0``, see ``takes_p0``) as an
        # argument: closing over a traced value is not supported by JAX's
        # custom derivatives.
        params = f"{ENV_S}, n" if custom else ENV_S
        params += ", p0" if takes_p0(s) else ""
        w(f"def {kind}{s.uid}({params}):")
        rblock(s.body, i2, out)
        if has_rule(s):
            out.append(f"{i2}{P0_USE}")
        out.append(f"{i2}return {ENV_S}")
        if custom:
            f = f"{kind}{s.uid}"
            w(f"{f}_fn = {f}")
            if kind in CALL_WRAPPERS:
                w(f"{f} = " + CALL_WRAPPERS[kind].format(f=f))
            else:
                wrap, rules = CUSTOM_RULES[kind]
                w(f"{f} = {wrap}({f}_fn)")
                if has_rule(s):
                    header, ret, install = (x.format(f=f) for x in RULE_DEFS[kind])
                    w(header)
                    rblock(s.rule, i2, out)
                    out.append(f"{i2}{ret}")
                    w(install)
                else:
                    w(rules.format(f=f))
        for _ in range(s.calls):
            w(f"{ENV_S} = {kind}{s.uid}({params})")
    else:
        raise TypeError(s)


def branch_call(s, operands: str) -> str:
    """The line calling a Cond / Switch statement's branch functions
    ``br{uid}_{b}`` on ``operands``."""
    names = ", ".join(f"br{s.uid}_{b}" for b in range(len(s.branches)))
    names += "," if len(s.branches) == 1 else ""
    if isinstance(s, Cond):
        return f"{ENV_S} = lax.cond({rexpr(s.pred)}, {names}, {operands})"
    return f"{ENV_S} = lax.switch({rexpr(s.idx)}, ({names}), {operands})"


def to_source(program: Program, header: bool = True) -> str:
    """The program as a Python function ``program(p0, p1, p2, pv, n)``."""
    out = [HEADER] if header else []
    out.append("def program(p0, p1, p2, pv, n):")
    out.append(f"    {ENV_S} = p0, p1, p2, pv")
    rblock(program.body, "    ", out)
    out.append(f"    return {ENV_S}")
    return "\n".join(out) + "\n"


_BUILD_COUNT = [0]


def build(program: Program):
    """exec ``to_source(program)``; tracebacks show its lines."""
    src = to_source(program)
    _BUILD_COUNT[0] += 1
    fname = f"<fuzz-program-{_BUILD_COUNT[0]}>"
    linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
    namespace: dict = {}
    exec(compile(src, fname, "exec"), namespace)
    return namespace["program"]


# ---------------------------------------------------------------------------------
# Static views of a program
# ---------------------------------------------------------------------------------

def children(s) -> list[tuple]:
    if isinstance(s, (Scan, Fori, While, *FUNCTIONS)):
        return [s.body]
    if isinstance(s, (Cond, Switch)):
        return list(s.branches)
    return []


def uses_state(stmts) -> bool:
    """Whether ``stmts`` read or write a state anywhere (statically; a key
    draw reads and writes the "rng" stream)."""
    return any(isinstance(s, (Get, Set, Draw, Bump)) or (isinstance(s, While) and (
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


def states_of(program: Program) -> dict[str, str]:
    """name -> kind of every state the program mentions ("S", "V": float32
    scalar / [3], "I": the int32 counter, "K": the key stream, "Y": typed)."""
    out = {}
    for s in walk(program.body):
        if isinstance(s, (Get, Set)):
            out[s.state] = STATES[s.state]
        elif isinstance(s, Draw):
            out[RNG] = "K"
        elif isinstance(s, Bump):
            out[s.state] = "Y"
        elif isinstance(s, While):
            if s.kind == "state":
                out["cnt"] = "I"
            if s.spred:
                out[s.spred[0]] = "S"
            if s.cbump:
                out[s.cbump.state] = "Y"
    return out


def first_traced_inits(program: Program) -> dict:
    """Each state's ``init`` at its first ``get_state`` in trace order."""
    out: dict = {}

    def visit(stmts):
        for s in stmts:
            if isinstance(s, Get):
                out.setdefault(s.state, s.init)
            elif isinstance(s, Draw):
                out.setdefault(RNG, None)
            elif isinstance(s, Bump):
                out.setdefault(s.state, typed_value(TYPED_STATES[s.state], s.init))
            elif isinstance(s, While):
                if s.kind == "state":
                    out.setdefault("cnt", 0)
                if s.cbump:  # traced before the predicate's reads
                    out.setdefault(s.cbump.state,
                                   typed_value(TYPED_STATES[s.cbump.state], s.cbump.init))
                if s.spred:
                    out.setdefault(s.spred[0], s.spred[1])
                visit(s.body)
            else:
                for b in children(s):
                    visit(b)

    visit(program.body)
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


def sow_names(program: Program) -> dict[str, str]:
    """name -> mode of every sow of tag T."""
    return {s.name: s.mode for s in sows(program.body)}


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
            statements touch states only. Without ``diff`` no rule runs.
    """

    def __init__(self, program: Program, states=None, plants=None, diff: bool = False):
        self.program = program
        self.diff = diff
        self.mode = "none" if states == "none" else ("example" if states is None else "given")
        self.cur = {} if states is None or states == "none" else {
            k: _ref_state(k, v) for k, v in states.items()}
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
    def get(self, name, init):
        init = (0 if name == "cnt" else jax.random.key(0) if name == RNG
                else typed_value(TYPED_STATES[name], init) if name in TYPED_STATES
                else _np(init))
        if self.mode == "none":
            return init
        if name not in self.cur:
            self.cur[name] = init
            self.state0.setdefault(name, init)
        return self.cur[name]

    def set(self, name, value):
        if self.mode == "none":
            return
        if name not in self.cur and self.mode == "example":
            self.state0.setdefault(name, 0 if name == "cnt" else _zeros(STATES[name]))
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
            for c in range(s.calls):
                fsite = (idx, (*calls, (s.uid, c)))
                diff = self.diff
                if diff and isinstance(s, (CustomJvp, CustomVjp)):
                    # Its rule runs instead: the rule's own statements (on a
                    # scratch env: their locals go nowhere), then the function.
                    self.block(s.rule, dict(env), ienv, fsite)
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
        else:
            raise TypeError(s)

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
                        else _np(inits[name]) if name in inits and name != "cnt"
                        else (0 if kind == "I" else _zeros(kind)))
        final = {}
        if self.mode != "none":
            start = self.state0 if self.mode == "example" else {}
            final = {name: self.cur.get(name, start.get(name)) for name in names}
        return out, final, dict(self.state0), self.reaps()

    def reaps(self):
        out = {}
        for name, mode in sow_names(self.program).items():
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


def _ref_state(name: str, value):
    """A state value given to the reference: a typed state keeps its dtype."""
    if name in TYPED_STATES:
        a = np.asarray(value)
        assert a.dtype == np_dtype(TYPED_STATES[name]), f"state {name!r} is {a.dtype}"
        return a
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
SIMPLE_KINDS = ("assign", "sow", "get", "set", "sow", "draw", "bump", "bump")
# Repeats weight the choice (the first entries are what shrinking tends to).
STMT_KINDS = (*SIMPLE_KINDS, "scan", "cond", "scan", "jit", "fori", "while", "switch", "ckpt",
              "scan", "sow", "get", "while", "cond", "cjvp", "cvjp", "root", "eqxloop")
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
        # "custom_rules" (custom functions more often: STMT_KINDS_CUSTOM).
        self.allow = allow

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
        if k in FUNCTION_KINDS.values():
            calls = self.pick((1, 2))
            sub = dataclasses.replace(sub, no_strict=ctx.no_strict or calls > 1)
            if k in ARGUMENTS_ONLY:  # reads only its arguments (see rblock)
                sub = dataclasses.replace(sub, fvars=(), ivars=("n",))
            if k == "eqxloop":  # a while loop: only clobber modes
                sub = dataclasses.replace(sub, no_strict=True, in_while=True)
            body = self.block(sub, 3)
            kinds = {kind: cls for cls, kind in FUNCTION_KINDS.items()}
            return kinds[k](uid, body, calls)
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

    def add_rules(self, body: tuple) -> tuple:
        """``body`` with rule statements (``CustomJvp.rule``) drawn for some of
        its custom functions, once the whole program is known: they touch
        only states the program uses outside any rule (the undifferentiated
        trace, where no rule runs, fixes the states ``pure`` takes and
        returns: a state only a rule uses is an error, docs/limitations.md).
        Not in a function nested in a custom_vjp, custom_root or equinox
        loop, nor in the fwd of a custom_vjp whose body uses no state (clear
        StateErrors: ``test_rule_statements_where_taxpr_cannot_thread_them_raise``)."""
        kinds = states_of(Program(body))
        typed = sorted(k for k, v in kinds.items() if v == "Y")
        draws = RNG in kinds
        if not typed and not draws:
            return body

        def visit(stmts, inside: bool) -> tuple:
            out = []
            for s in stmts:
                if isinstance(s, (Cond, Switch)):
                    s = dataclasses.replace(s, branches=tuple(visit(b, inside)
                                                              for b in s.branches))
                elif children(s):
                    s = dataclasses.replace(s, body=visit(s.body, inside or isinstance(
                        s, (CustomVjp, Root, EqxLoop))))
                if (isinstance(s, (CustomJvp, CustomVjp)) and not inside
                        and (isinstance(s, CustomJvp) or uses_state(s.body))
                        and self.int_(0, 3) < 3):  # (0, what draws tend to: a rule)
                    s = dataclasses.replace(s, rule=tuple(
                        Draw("_") if draws and not (typed and self.draw(st.booleans()))
                        else self.typed_bump(self.pick(typed))
                        for _ in range(self.int_(1, 2))))
                out.append(s)
            return tuple(out)

        return visit(body, False)

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


# ---------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------

TOL = dict(rtol=2e-4, atol=2e-4)


def assert_close(got, want, what: str) -> None:
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
    assert set(got) == set(want), f"{what}: keys {sorted(got)} != reference {sorted(want)}"
    for k in want:
        assert_close(got[k], want[k], f"{what}[{k!r}]")


def assert_outs_close(got, want, what: str) -> None:
    assert len(got) == len(want)
    for name, g, w in zip(ENV, got, want):
        assert_close(g, w, f"{what} {name}")


def perturb(state: dict) -> dict:
    """Another valid state: floats moved, the counter advanced, typed states
    updated exactly."""
    out = {}
    for k, v in state.items():
        if _is_key(v):  # another key for the stream
            out[k] = jax.random.fold_in(v, 7)
            continue
        if k in TYPED_STATES:
            out[k] = typed_next(TYPED_STATES[k], v)
            continue
        a = np.asarray(v)
        out[k] = (a + 1 if a.dtype.kind in "iu" else a * -0.5 + 0.25).astype(a.dtype)
    return out


def reference(program, args, states=None, plants=None, diff: bool = False):
    """Run the reference (``diff``: differentiated, see ``Reference``); a
    predicate too close to call makes hypothesis discard the example."""
    try:
        return Reference(program, states, plants, diff).run(args)
    except Ambiguous:
        assume(False)


def make_plants(program: Program, rng: np.random.Generator, fraction=0.5) -> dict:
    """Random plants for some of the sown names (right shapes and dtypes)."""
    plants = {}
    slots = append_slots(program)
    for name, mode in sorted(sow_names(program).items()):
        if rng.random() > fraction:
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

    def visit(stmts, depth, lens, owner):
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
            elif isinstance(s, Scan):
                name = f"scan len {s.length}" + (" reverse" if s.reverse else "")
            elif isinstance(s, While):
                name = (f"while {s.kind}" + (" spred" if s.spred else "")
                        + (" cbump" if s.cbump else ""))
            elif has_rule(s):
                out.add(f"rule statements in {name}")
                out.update(f"rule {type(r).__name__} in {name}" for r in s.rule)
            out.add(name)
            lens2 = (*lens, s.length) if isinstance(s, Scan) else lens
            for b in children(s):
                visit(b, depth + 1, lens2, type(s).__name__)

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
        assert [i.name for i in infos] == sorted(s0_r)
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
    bstate = {k: _stack(states[0][k], states[1][k]) for k in state0}
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
    """A scalar of every float output, float32 state and reaped value."""
    leaves = [*out, *(v for k, v in sorted(state.items()) if k in STATES),
              *(v for _, v in sorted((reaps or {}).items()))]
    return sum(leaves[i].sum() * (i + 1) * 0.1 for i in range(len(leaves)))


def check_stateful_rules_differentiated(program, pure, state, args, can_jvp, can_grad):
    """Differentiated from outside, a custom function with stateful rules
    runs its rule instead (JAX's semantics): its rule statements, then
    ``jax.jvp`` of the function itself (custom_jvp) or the plain function
    (custom_vjp's fwd), so the outputs and the states are the differentiated
    reference's (``Reference(diff=True)``): the rule's effects happen once,
    in program order. (Their derivatives differ from finite differences by
    design: what a rule writes is a constant w.r.t. the inputs, as eagerly.)"""
    floats_in = tuple(np.asarray(a) for a in args[:4])
    out_r, fin_r, _, _ = reference(program, args, state, diff=True)

    def run(*xs):
        return pure(state, *xs, args[4])

    if can_jvp:
        (out, fin), _ = jax.jvp(run, floats_in, tuple(np.ones_like(a) for a in floats_in))
        assert_outs_close(out, out_r, "jvp(pure) out")
        assert_dict_close(fin, fin_r, "jvp(pure) state")
    if can_grad:
        try:
            (out, fin), vjp_fn = jax.vjp(run, *floats_in)
        except NotImplementedError as e:
            # A float state that a custom_vjp fwd reads (a custom_jvp in its
            # body takes every state) and that has a derivative there (set
            # from a differentiated value before the call): documented
            # (docs/limitations.md), as JAX refuses a custom_vjp closing
            # over a differentiated value.
            name = re.search(r"differentiating w\.r\.t\. state '(\w+)', which the custom_vjp "
                             r"function at \S+ reads", str(e))
            assert name and name[1] in states_of(program) and any(
                isinstance(s, CustomVjp) and uses_state(s.body) for s in walk(program.body)), e
            _event("derivatives: vjp of pure refused: a differentiated state a custom_vjp reads")
            return
        assert_outs_close(out, out_r, "vjp(pure) out")
        assert_dict_close(fin, fin_r, "vjp(pure) state")
        cts = jax.tree_util.tree_map(
            lambda v: (jnp.ones_like(v) if jnp.issubdtype(v.dtype, jnp.inexact)
                       else np.zeros(np.shape(v), jax.dtypes.float0)), (out, fin))
        if any(isinstance(s, CustomVjp) and uses_state(s.body) for s in walk(program.body)):
            # Its bwd (jax.vjp of the function) touches state after the
            # forward pass: a StateError where a cotangent reaches it
            # (tests/test_state_semantics.py); only the forward is checked.
            _event("derivatives: forward of a stateful custom_vjp under vjp")
        else:
            grads = vjp_fn(cts)
            assert all(np.isfinite(np.asarray(g)).all() for g in grads), grads
    _event("derivatives: stateful custom rules run once, as the reference")
    if (can_jvp or can_grad) and rule_functions(program):
        _event("derivatives: rule statements ran under differentiation (jvp / vjp of pure)")


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
        check_stateful_rules_differentiated(program, pure, state, args, can_jvp, can_grad)
        return
    # Typed states are not differentiated: integer-valued, updated by
    # wrap-around and ``% 4``, they have no derivatives that finite
    # differences see (their tangents, float0 or zero, still flow).
    fkeys = sorted(k for k in state if k in STATES)
    rng = np.random.default_rng(seed)
    plants = make_plants(program, rng, 1.0) if variant == "plant" else {}
    pkeys = sorted(plants)
    floats = ([np.asarray(a) for a in args[:4]] + [np.asarray(state[k]) for k in fkeys]
              + [plants[k] for k in pkeys])
    tangents = [rng.uniform(-1, 1, np.shape(x)).astype(np.float32) for x in floats]
    n_st = 4 + len(fkeys)

    def split(xs):
        st_ = dict(state)
        st_.update(zip(fkeys, xs[4:n_st]))
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


def check_grad_inside(program, args):
    """``jax.value_and_grad`` inside the uncurried function (taxpr rewrites
    the differentiated program, custom_vjp bwds recomputing their function
    included): the value and the final states are the reference's (the
    backward pass repeats no effect), and, where JAX's rules are autodiff's
    and no rule has state, the gradient matches central finite differences
    of the float64 reference. A stateful custom_vjp or equinox checkpointed
    loop whose recomputation reads a state the forward changes may instead be
    a ``StateError`` (which one cannot be read off the program)."""
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
    if (stateful_custom_rules(program) or any(not_differentiated(s) for s in stmts)
            or any(isinstance(s, (Set, Bump)) for s in stmts)):
        # Derivatives through a state set and read again inside the
        # differentiated function are not propagated (docs/limitations.md).
        _event("grad inside: value and states checked")
        return "value and states"
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
                               err_msg="grad inside vs finite differences")
    _event("grad inside: value, states and gradient checked")
    return "value, states and gradient"


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


# ---------------------------------------------------------------------------------
# Profiles and tests
# ---------------------------------------------------------------------------------

LONG = os.environ.get("TAXPR_FUZZ_LONG") == "1"
LONG_EXAMPLES = int(os.environ.get("TAXPR_FUZZ_EXAMPLES", "20000"))
_SEED = os.environ.get("TAXPR_FUZZ_SEED")


def ci_settings(n: int):
    """``n`` examples in CI (fixed, derandomized); the long profile's share of
    LONG_EXAMPLES when TAXPR_FUZZ_LONG=1."""
    if LONG:
        return long_settings(n)
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


# Programs per check in CI; the long profile splits LONG_EXAMPLES in these proportions.
# "as_users_run": each program is warmed up, uncurried, run eagerly and
# jitted (about 0.5 s each on a 2-core machine).
SHARES = {"uncurry": 120, "uncurry_jit": 50, "reap": 100, "harvest": 90, "raw": 40, "vmap": 50,
          "derivatives": 50, "grad_inside": 40, "vmap_inside": 30, "as_users_run": 40,
          "disable_jit": 30}


def long_settings(n: int):
    # The long tests' counts add up to LONG_EXAMPLES (rounded up).
    count = max(1, -(-LONG_EXAMPLES * n // sum(SHARES.values())))
    return settings(max_examples=count, deadline=None, database=None, derandomize=_SEED is None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def _seeded(test, long: bool = False):
    """TAXPR_FUZZ_SEED=S seeds the long profile (else it is derandomized)."""
    if _SEED is not None and (LONG or long):
        from hypothesis import seed
        return seed(int(_SEED))(test)
    return test


def _seeded_long(test):
    return _seeded(test, long=True)


def _uncurry_case(data, jit):
    program = data.draw(programs())
    args, args2 = data.draw(arguments()), data.draw(arguments())
    run_check(check_uncurry, program, args, args2, jit)


def _reap_case(data):
    program = data.draw(programs())
    args = data.draw(arguments())
    compose = data.draw(st.sampled_from(("reap(pure)", "uncurry(reap)")))
    jit = data.draw(st.booleans())
    kind = data.draw(st.sampled_from((None, "allowlist", "blocklist")))
    names = sorted(sow_names(program))
    filt = (kind, data.draw(st.sets(st.sampled_from(names))) if names and kind else set())
    run_check(check_reap, program, args, jit, compose, filt)


def _harvest_case(data):
    program = data.draw(programs())
    args = data.draw(arguments())
    seed = data.draw(st.integers(0, 2**16))
    jit = data.draw(st.booleans())
    run_check(check_harvest, program, args, seed, jit)


def _vmap_case(data):
    program = data.draw(programs())
    args, args2 = data.draw(arguments()), data.draw(arguments())
    with_reap = data.draw(st.booleans())
    run_check(check_vmap, program, args, args2, with_reap)


def _vmap_inside_case(data):
    program = data.draw(programs())
    args = data.draw(arguments())
    p0s = data.draw(st.lists(F32, min_size=2, max_size=3))
    jit = data.draw(st.booleans())
    with_reap = data.draw(st.booleans())
    run_check(check_vmap_inside, program, args, p0s, jit, with_reap)


DERIVATIVE_FEATURES = frozenset({"counter_state", "custom_rules"})


def _derivative_case(data):
    program = data.draw(programs(allow=DERIVATIVE_FEATURES))
    args = data.draw(arguments())
    seed = data.draw(st.integers(0, 2**16))
    variant = data.draw(st.sampled_from(("pure", "reap", "plant")))
    run_check(check_derivatives, program, args, seed, variant)


def _grad_inside_case(data):
    # Reverse mode does not go through while loops (fori with traced bounds).
    program = data.draw(programs(allow=DERIVATIVE_FEATURES))
    assume(not any(isinstance(s, (While, Fori, Root)) for s in walk(program.body)))
    args = data.draw(arguments())
    run_check(check_grad_inside, program, args)


def _raw_case(data):
    # Without a state handler set_state is a no-op: a while on the counter
    # state would never stop.
    program = data.draw(programs(allow=frozenset()))
    args = data.draw(arguments())
    run_check(check_raw_reap, program, args)


def _disable_jit_case(data):
    # As users debug: under jax.disable_jit(), a while_loop first tries its
    # loop in Python; taxpr must trace what jax.jit would (no tags of that
    # attempt left behind).
    with jax.disable_jit():
        check = data.draw(st.sampled_from(("uncurry", "reap", "harvest")))
        if check == "uncurry":
            _uncurry_case(data, jit=data.draw(st.booleans()))
        elif check == "reap":
            _reap_case(data)
        else:
            _harvest_case(data)


@_seeded
@ci_settings(SHARES["uncurry"])
@given(st.data())
def test_uncurry_matches_reference(data):
    _uncurry_case(data, jit=False)


@_seeded
@ci_settings(SHARES["uncurry_jit"])
@given(st.data())
def test_uncurry_jit_matches_reference(data):
    _uncurry_case(data, jit=True)


@_seeded
@ci_settings(SHARES["reap"])
@given(st.data())
def test_reap_matches_reference(data):
    _reap_case(data)


@_seeded
@ci_settings(SHARES["harvest"])
@given(st.data())
def test_harvest_matches_reference(data):
    _harvest_case(data)


@_seeded
@ci_settings(SHARES["vmap"])
@given(st.data())
def test_vmap_matches_reference(data):
    _vmap_case(data)


@_seeded
@ci_settings(SHARES["vmap_inside"])
@given(st.data())
def test_vmap_inside_with_batched_predicates_matches_reference(data):
    _vmap_inside_case(data)


@_seeded
@ci_settings(SHARES["derivatives"])
@given(st.data())
def test_derivatives_match_finite_differences(data):
    _derivative_case(data)


@_seeded
@ci_settings(SHARES["grad_inside"])
@given(st.data())
def test_grad_inside_matches_reference(data):
    _grad_inside_case(data)


@_seeded
@ci_settings(SHARES["raw"])
@given(st.data())
def test_raw_reap_matches_reference(data):
    _raw_case(data)


# ---- static rules: one violation inserted into a valid program -----------------------

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


@ci_settings(60)
@given(st.data())
def test_static_rule_violations_raise(data):
    """A valid program with one of harvest's static rules broken: reap raises
    oryx's ValueError naming the sow, and JAX still works afterwards."""
    kind = data.draw(st.sampled_from(sorted(VIOLATIONS)))
    where, mode, message = VIOLATIONS[kind]
    program = data.draw(programs(allow=frozenset()))
    spots = [(p, o) for p, o in blocks(program.body) if where(o)]
    assume(spots)
    path, _ = data.draw(st.sampled_from(spots))
    sow = Sow(10_000, None, Var("f0"), "z", mode)
    body = insert(program.body, path, data.draw(st.integers(0, 3)), sow)
    if kind == "strict_twice":
        body = insert(body, (), data.draw(st.integers(0, 3)), dataclasses.replace(sow, uid=10_001))
    bad = Program(body)

    def run(bad):
        fn = build(bad)
        with pytest.raises(ValueError, match=message):
            h.reap(fn, tag=T)(*ARGS)
        assert float(jax.jit(lambda x: x * 2)(1.0)) == 2.0
        assert float(jax.grad(lambda x: jnp.sin(x) * x)(0.0)) == 0.0

    run_check(run, bad)


ARGS = (np.float32(0.5), np.float32(-1.0), np.float32(1.5), np.array([0.5, -0.5, 1.0], np.float32),
        np.int32(1))


@_seeded
@ci_settings(SHARES["disable_jit"])
@given(st.data())
def test_programs_under_disable_jit_match_reference(data):
    _disable_jit_case(data)


# ---- the long profile (pytest -m long) ----------------------------------------------

def _long_test(case, *shares: str):
    """A test of the long profile: ``case(data)`` for its share of programs."""
    @pytest.mark.long
    @_seeded_long
    @long_settings(sum(SHARES[s] for s in shares))
    @given(st.data())
    def test(data):
        case(data)
    return test


test_long_uncurry = _long_test(lambda data: _uncurry_case(data, jit=data.draw(st.booleans())),
                               "uncurry", "uncurry_jit")
test_long_reap = _long_test(_reap_case, "reap")
test_long_harvest = _long_test(_harvest_case, "harvest")
test_long_vmap = _long_test(_vmap_case, "vmap")
test_long_vmap_inside = _long_test(_vmap_inside_case, "vmap_inside")
test_long_derivatives = _long_test(_derivative_case, "derivatives")
test_long_grad_inside = _long_test(_grad_inside_case, "grad_inside")
test_long_raw_reap = _long_test(_raw_case, "raw")
test_long_disable_jit = _long_test(_disable_jit_case, "disable_jit")


# ---- append sows of one name in cond branches and outside -----------------------------

# Each append sow in a cond's branches is its own row: plants of append sows
# in branches must not collide with other append sows of the same name (one
# row per site, each planted into its own site).

def _cond_append(x):
    return lax.cond(x > 0, lambda x: h.sow(x * 2, tag=T, name="a", mode="append"),
                    lambda x: h.sow(x * 3, tag=T, name="a", mode="append"), x)


def test_plant_append_in_cond_after_direct_sow():
    def f(x):
        h.sow(x, tag=T, name="a", mode="append")
        return _cond_append(x)

    np.testing.assert_allclose(h.reap(f, tag=T)(1.0)["a"], [1.0, 2.0])
    assert float(h.plant(f, tag=T)({"a": jnp.array([10.0, 20.0])}, 1.0)) == 20.0


def test_plant_append_in_two_conds():
    def f(x):
        return _cond_append(x) + _cond_append(x) * 10

    np.testing.assert_allclose(h.reap(f, tag=T)(1.0)["a"], [2.0, 2.0])
    assert float(h.plant(f, tag=T)({"a": jnp.array([1.0, 2.0])}, 1.0)) == 21.0


# ---------------------------------------------------------------------------------
# Programs as users really run them: warm trace caches, inits built
# inside the trace, extra state entries
# ---------------------------------------------------------------------------------
# ``to_source_hoisted`` renders a program with every inner function (scan /
# fori / while bodies, branches, jitted and checkpointed functions) defined
# once at module level, its free variables passed explicitly (``ex``): the
# functions keep their identity across calls, so JAX's trace caches (keyed by
# function identity) are warm when the program ran before (under ``jax.jit``,
# eagerly or ``jax.make_jaxpr``) and taxpr transforms it. ``init_style``
# renders a state's init as a NumPy constant, a JAX constant (a tracer inside
# a traced body), ``c * jnp.ones(())`` or a callable: unreached states must
# start at that init in every style.

INIT_STYLES = ("numpy", "jnp", "ones", "callable")
WARM_UPS = ("none", "jit", "eager", "make_jaxpr")


def _styled_init(init, style: str) -> str:
    if style == "numpy":
        return _npinit(init)
    if isinstance(init, tuple):
        value = f"jnp.array([{', '.join(_f(x) for x in init)}], jnp.float32)"
        ones = f"{value} * jnp.ones((3,), jnp.float32)"
    else:
        value = f"jnp.float32({_f(init)})"
        ones = f"{_f(init)} * jnp.ones((), jnp.float32)"
    if style == "jnp":
        return value
    if style == "ones":
        return ones
    return f"lambda: {value}"


class _Hoisted:
    """The renderer of ``to_source_hoisted``."""

    def __init__(self, init_style: str):
        self.init_style = init_style
        self.defs: list[str] = []

    def get(self, state: str, init) -> str:
        return f'tx.get_state("{state}", {_styled_init(init, self.init_style)})'

    def typed_init(self, s: Bump) -> str:
        """A typed state's init in ``init_style`` ("numpy": the Bump's own form)."""
        d = TYPED_STATES[s.state]
        if self.init_style == "numpy":
            return _typed_init(d, s.init, s.form)
        jd = "jnp.bool_" if d == "bool" else f"jnp.{d}"
        lit = (f"[{', '.join(_typed_lit(d, x) for x in s.init)}]" if typed_shape(d)
               else _typed_lit(d, s.init))
        value = f"jnp.array({lit}, {jd})"
        if self.init_style == "jnp":
            return value
        if self.init_style == "ones":
            return f"{value} * jnp.ones({typed_shape(d)}, {jd})"
        return f"lambda: {value}"

    def function(self, header: str, scope: tuple, lines: list) -> None:
        """A module-level def: ``header`` then unpacking ``ex`` into ``scope``."""
        self.defs.append(header)
        self.defs.append(f"    {', '.join(scope)}, = ex")
        self.defs.extend(lines)
        self.defs.append("")

    def block(self, stmts, ind: str, out: list, scope: tuple) -> None:
        for s in stmts:
            self.stmt(s, ind, out, scope)

    def body(self, stmts, scope: tuple) -> list:
        lines: list = []
        self.block(stmts, "    ", lines, scope)
        return lines

    def stmt(self, s, ind: str, out: list, scope: tuple) -> None:
        w = lambda line: out.append(ind + line)  # noqa: E731
        ex = f"({', '.join(scope)},)"
        if isinstance(s, Get):
            w(f"{s.target} = {self.get(s.state, s.init)}")
        elif isinstance(s, Bump):
            for line in bump_lines(s, self.typed_init(s)):
                w(line)
        elif isinstance(s, (Assign, Set, Sow, Draw)):
            rstmt(s, ind, out)
        elif isinstance(s, Scan):
            u, inner = s.uid, (*scope, f"x{s.uid}", f"i{s.uid}")
            lines = [f"    x{u}, i{u} = xi", *self.body(s.body, inner),
                     f"    return (({ENV_S}), ex), {s.yvar}"]
            self.defs.append(f"def scan{u}(carry, xi):")
            self.defs.append(f"    ({ENV_S}), ex = carry")
            self.function_tail(scope, lines)
            coefs = _vec(s.coefs) if s.length else "jnp.zeros((0,), jnp.float32)"
            rev = ", reverse=True" if s.reverse else ""
            w(f"(({ENV_S}), _), ys{u} = lax.scan(scan{u}, (({ENV_S}), {ex}), "
              f"({coefs} * {rexpr(s.xsrc, False)}, jnp.arange({s.length}, dtype=jnp.int32)){rev})")
            w(f"{s.out} = jnp.tanh(jnp.sum(ys{u}, axis=0))")
        elif isinstance(s, Fori):
            u, inner = s.uid, (*scope, f"i{s.uid}")
            lines = [*self.body(s.body, inner), f"    return ({ENV_S}), ex"]  # nested defs first
            self.defs.append(f"def fori{u}(i{u}, carry):")
            self.defs.append(f"    ({ENV_S}), ex = carry")
            self.function_tail(scope, lines)
            w(f"({ENV_S}), _ = lax.fori_loop(jnp.clip({s.ivar} + {s.lo}, 0, 2), "
              f"jnp.clip({s.ivar} + {s.hi}, 0, 3), fori{u}, (({ENV_S}), {ex}))")
        elif isinstance(s, While):
            u = s.uid
            outer = scope
            if s.kind == "state":
                w(f"lim{u} = {CNT_GET} + {s.bound}")
                scope = (*scope, f"lim{u}")
                ex = f"({', '.join(scope)},)"
            carry = f"k{u}, ({ENV_S}), ex" if s.kind == "carry" else f"({ENV_S}), ex"
            inner = (*outer, f"k{u}") if s.kind == "carry" else scope
            cond_lines = []
            if s.csow:
                cond_lines.append(f'    h.sow({s.csow[0]}, tag=T, name="{s.csow[1]}", '
                                  f'mode="clobber")')
            if s.cbump:
                cond_lines += ["    " + line for line in bump_lines(s.cbump, self.typed_init(s.cbump))]
            pred = f"k{u} < {s.bound}" if s.kind == "carry" else f"{CNT_GET} < lim{u}"
            if s.spred:
                st_, init, t = s.spred
                pred = f"({pred}) & ({self.get(st_, init)} > {_f(t)})"
            cond_lines.append(f"    return {pred}")
            self.defs.append(f"def wcond{u}(carry):")
            self.defs.append(f"    {carry} = carry")
            self.function_tail(scope, cond_lines)
            body_lines = []
            if s.kind == "state":
                body_lines.append(f'    tx.set_state("cnt", {CNT_GET} + 1)')
            # The body sees k{u} (carry kind) as a free variable of nested functions.
            body_lines += self.body(s.body, inner)
            body_lines.append("    return " + (f"k{u} + 1, ({ENV_S}), ex" if s.kind == "carry"
                                               else f"({ENV_S}), ex"))
            self.defs.append(f"def wbody{u}(carry):")
            self.defs.append(f"    {carry} = carry")
            self.function_tail(scope, body_lines)
            if s.kind == "carry":
                w(f"_, ({ENV_S}), _ = lax.while_loop(wcond{u}, wbody{u}, "
                  f"(jnp.int32(0), ({ENV_S}), {ex}))")
            else:
                w(f"({ENV_S}), _ = lax.while_loop(wcond{u}, wbody{u}, (({ENV_S}), {ex}))")
        elif isinstance(s, (Cond, Switch)):
            u = s.uid
            for b, body in enumerate(s.branches):
                self.function(f"def br{u}_{b}({ENV_S}, ex):", scope,
                              [*self.body(body, scope), f"    return {ENV_S}"])
            w(branch_call(s, f"{ENV_S}, {ex}"))
        elif isinstance(s, FUNCTIONS):
            kind = FUNCTION_KINDS[type(s)]
            f = f"{kind}{s.uid}"
            p0_use = [f"    {P0_USE}"] if has_rule(s) else []  # p0: in ``ex`` (scope)
            self.function(f"def {f}_fn({ENV_S}, ex):", scope,
                          [*self.body(s.body, scope), *p0_use, f"    return {ENV_S}"])
            if kind in CALL_WRAPPERS:
                self.defs.append(f"{f} = " + CALL_WRAPPERS[kind].format(f=f))
            else:
                wrap, rules = CUSTOM_RULES.get(kind, ({"jit": "jax.jit", "ckpt": "jax.checkpoint"}
                                                      .get(kind), None))
                self.defs.append(f"{f} = {wrap}({f}_fn)")
                if has_rule(s):
                    header, ret, install = (x.format(f=f) for x in RULE_DEFS[kind])
                    lines: list = []
                    self.block(s.rule, "    ", lines, ())  # effects on states only
                    self.defs += [header, *lines, f"    {ret}", install]
                elif rules:
                    self.defs.append(rules.format(f=f))
            self.defs.append("")
            for _ in range(s.calls):
                w(f"{ENV_S} = {kind}{s.uid}({ENV_S}, {ex})")
        else:
            raise TypeError(s)

    def function_tail(self, scope: tuple, lines: list) -> None:
        """The rest of a def whose header unpacked ``ex`` from its carry."""
        self.defs.append(f"    {', '.join(scope)}, = ex")
        self.defs.extend(lines)
        self.defs.append("")


def to_source_hoisted(program: Program, init_style: str = "numpy") -> str:
    """The program as ``program(p0, p1, p2, pv, n)`` with its inner functions
    at module level (see above)."""
    r = _Hoisted(init_style)
    main = ["def program(p0, p1, p2, pv, n):", f"    {ENV_S} = p0, p1, p2, pv"]
    # With rule statements every function gets ``p0`` too (in ``ex``).
    r.block(program.body, "    ", main, ("n", "p0") if rule_functions(program) else ("n",))
    main.append(f"    return {ENV_S}")
    return "\n".join([HEADER, *r.defs, *main]) + "\n"


def build_hoisted(program: Program, init_style: str):
    src = to_source_hoisted(program, init_style)
    _BUILD_COUNT[0] += 1
    fname = f"<fuzz-hoisted-{_BUILD_COUNT[0]}>"
    linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
    namespace: dict = {}
    exec(compile(src, fname, "exec"), namespace)
    return namespace["program"]


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
    assert [i.name for i in infos] == sorted(s0_r)
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


def _as_users_run_case(data):
    program = data.draw(programs())
    args, args2 = data.draw(arguments()), data.draw(arguments())
    warm = data.draw(st.sampled_from(WARM_UPS))
    init_style = data.draw(st.sampled_from(INIT_STYLES))
    extra = data.draw(st.booleans())
    with_reap = data.draw(st.booleans())
    # Reverse mode of a while loop (incl. fori with traced bounds) is not
    # supported (as in check_derivatives); nor a custom_jvp rule with state.
    linearize = data.draw(st.booleans()) and not any(
        isinstance(s, (While, Fori)) or not_differentiated(s) for s in walk(program.body)
    ) and not stateful_custom_rules(program)
    event(f"warm-up {warm}")
    event(f"init {init_style}")
    run_check(check_as_users_run, program, args, args2, warm, init_style, extra, with_reap,
              linearize)


@_seeded
@ci_settings(SHARES["as_users_run"])
@given(st.data())
def test_programs_as_users_run_them_match_reference(data):
    _as_users_run_case(data)


test_long_programs_as_users_run_them = _long_test(_as_users_run_case, "as_users_run")


def test_state_set_in_cond_in_scan_under_vjp_is_kept():
    # JAX's cond partial evaluation must not drop the staged half of the
    # cond (it holds only the set).
    def program(p0, n):
        def branch(f0):
            def step(f, _):
                def sets(f):
                    tx.set_state("s0", f)
                    return f
                f = lax.cond(f > 0.1, sets, lambda f: f, f)
                return f, f
            f0, ys = lax.scan(step, f0, jnp.arange(2.0))
            return jnp.tanh(jnp.sum(ys))
        return lax.switch(n % 3, (branch,), p0)

    def under_vjp(p0, n):
        return jax.vjp(lambda p: program(p, n), p0)[0]

    pure, state0 = tx.uncurry(under_vjp, np.float32(0.5), np.int32(0))
    assert set(state0) == {"s0"}  # eagerly: s0 is set (to 0.5) on both steps
    _, state1 = pure(state0, np.float32(0.5), np.int32(0))
    np.testing.assert_array_equal(state1["s0"], np.float32(0.5))
    _, state1 = pure({"s0": np.float32(3.0)}, np.float32(-1.0), np.int32(0))
    np.testing.assert_array_equal(state1["s0"], np.float32(3.0))  # not taken: unchanged


# ---- typed states of every dtype through every primitive, deterministically ---------

def _all_typed_bumps(uid: int) -> tuple:
    """One Bump per dtype (uids from ``uid``), every update and init form."""
    out = []
    for i, d in enumerate(TYPED_DTYPES):
        values = typed_inits(d)
        init = (tuple(values[(i + j) % len(values)] for j in range(3)) if typed_shape(d)
                else values[i % len(values)])
        ops = TYPED_OPS[typed_kind(d)]
        op = ops[i % len(ops)]
        arg = (IPred("n", 1, 2) if op == "xor" else typed_adds(d)[i % 3] if op == "add"
               else None)
        target = ("v" if typed_shape(d) else SVARS[i % 3]) if i % 2 else None
        out.append(Bump(uid + i, f"y_{d}", init, ("scalar", "array", "callable")[i % 3], op,
                        arg, target))
    # bool's other update: xor with a predicate of the program
    out.append(Bump(uid + len(out), "y_bool", (False, True, False), "array", "xor",
                    IPred("n", 1, 2), "v"))
    return tuple(out)


# Every dtype's state in the carries of scan, cond, switch, jit (called twice)
# and checkpoint; of while, fori and custom_jvp, then of custom_vjp.
TYPED_NESTS = {
    "scan_cond_switch_jit_ckpt": Program((Scan(
        1, (Cond(2, IPred("i1", 0, 2), ((Switch(3, SIdx("n", 0, 2), (
            (Jit(4, (Ckpt(5, _all_typed_bumps(100)),), calls=2),), ())),), ())),
            Assign("f0", Un("sin", Var("x1")))),
        2, False, (0.5, -1.0), Var("f1"), "f0", "f2"),)),
    "while_fori_cjvp_cvjp": Program((While(
        1, (Fori(2, (CustomJvp(3, _all_typed_bumps(100)),), "n", 0, 2),), "carry", 2),
        CustomVjp(4, _all_typed_bumps(200), calls=2))),
    "root_eqxloop": Program((Root(1, _all_typed_bumps(100)),
                             EqxLoop(2, _all_typed_bumps(200), calls=2))),
}


# Programs inside library operations: custom_root (a high-level primitive on
# newer JAX) and equinox's checkpointed while loop, each with state reads and
# writes, sows and key draws, called once and twice.
LIBRARY_NESTS = {
    "root": Program((
        Get("f0", "s0", 0.5),
        Root(1, (Get("f1", "s1", -1.0), Set("s0", Bin("avg", Var("f0"), Var("f1"))),
                 Sow(2, "f2", Var("f0"), "t0", "strict"),
                 Sow(3, None, Var("f1"), "c0", "clobber"), Draw("f1"))),
        Root(4, (Set("s1", Un("sin", Var("f2"))), Sow(5, None, Var("f2"), "c1", "clobber")),
             calls=2),
        Set("s1", Var("f2")))),
    "eqxloop": Program((
        EqxLoop(1, (Get("f0", "s0", 0.25), Set("s0", AddC(Var("f0"), 1.0)),
                    Sow(2, "f1", Var("f0"), "c0", "clobber"), Draw("f2")), calls=2),
        Set("s1", Var("f1")))),
    "nested": Program((
        EqxLoop(1, (Root(2, (Get("f0", "s0", 1.5), Set("s0", Un("sin", Var("f0"))),
                             Sow(3, None, Var("f0"), "c0", "clobber"))),)),)),
}


# Custom functions whose body uses state, keys and sows (their rules call the
# function: a custom_vjp's bwd recomputes it, as equinox's checkpointed loop
# does), differentiated inside the uncurried function.
GRAD_INSIDE_NESTS = {
    "cvjp_counts_and_reads_a_constant_state": Program((
        Set("s1", Var("f1")),
        CustomVjp(1, (Get("f0", "s0", 0.5), Set("s0", AddC(Var("f0"), 1.0)),
                      Get("f2", "s1", 0.0), Assign("f1", Bin("mul", Var("f1"), Var("f2"))),
                      Sow(2, None, Var("f1"), "c0", "clobber"), Draw("f3")), calls=2),
        Assign("f0", Bin("avg", Var("f0"), Var("f1"))))),
    "cvjp_reads_a_state_it_updates": Program((
        CustomVjp(1, (Get("f0", "s0", 0.5), Set("s0", Un("sin", Var("f0"))),
                      Assign("f1", Bin("mul", Var("f1"), Var("f0")))),),)),
    "cjvp_in_a_scan": Program((Scan(
        1, (CustomJvp(2, (Get("f0", "s0", 0.25), Set("s0", AddC(Var("f0"), 1.0)),
                          Assign("f1", Un("sin", Var("f1"))))),),
        3, False, (0.5, -1.0, 2.0), Var("f2"), "f0", "f2"),)),
    "eqxloop_in_a_jit": Program((Jit(1, (
        EqxLoop(2, (Get("f0", "s0", 0.75), Set("s0", AddC(Var("f0"), 1.0)),
                    Assign("f1", MulC(Var("f1"), 0.5)),
                    Sow(3, None, Var("f1"), "c1", "clobber"))),), calls=2),)),
}


@pytest.mark.parametrize("nest", sorted(GRAD_INSIDE_NESTS))
def test_stateful_custom_functions_differentiated_inside_match_reference(nest):
    """jax.value_and_grad inside uncurry of custom functions with state, keys
    and sows in their body: the value and states are the eager reference's
    (the bwd's recomputation repeats no effect); a StateError where the
    gradient depends on what the recomputation reads of a state the forward
    changes."""
    # (eqxloop_in_a_jit works with JAX's two-argument dead-code-elimination
    # rules too: taxpr/_dependence.py decides what a replay reads.)
    want = "StateError" if nest == "cvjp_reads_a_state_it_updates" else "value and states"
    for args in (ARGS, ARGS2):
        assert check_grad_inside(GRAD_INSIDE_NESTS[nest], args) == want


# Custom functions whose rules touch states and keys themselves (``rule``
# statements run before the rule calls the function): a counter bumped and a
# key drawn by a custom_jvp rule (called twice), rules of custom_jvp functions
# nested in a custom_jvp in a scan, a custom_vjp fwd counting and drawing.
RULE_NESTS = {
    "cjvp_rule_counts_and_draws": Program((
        Bump(1, "y_int8", 5, "scalar", "add", 1), Draw("f1"),
        CustomJvp(2, (Assign("f1", Un("sin", Var("f1"))),),
                  calls=2, rule=(Bump(3, "y_int8", 0, "array", "add", 127), Draw("_"))),
        Draw("f2"))),
    "nested_cjvp_rules_in_a_scan": Program((
        Bump(1, "y_uint8", 5, "scalar", "add", 1), Draw("f1"),
        Scan(2, (CustomJvp(3, (
            Assign("f1", Un("sin", Var("f1"))),
            CustomJvp(4, (Assign("f2", Un("tanh", Var("f1"))), Draw("f0")),
                      rule=(Draw("_"),)),
            Bump(5, "y_uint8", 0, "callable", "add", 128, "f2")),
            calls=2, rule=(Bump(6, "y_uint8", 0, "array", "add", 255), Draw("_"))),),
            2, False, (0.5, -1.0), Var("f2"), "f0", "f2"),
        Draw("f0"))),
    "cvjp_fwd_counts_and_draws": Program((
        Bump(1, "y_int32", 5, "scalar", "add", 1), Draw("f1"),
        CustomVjp(2, (Get("f2", "s0", 0.5), Assign("f1", Bin("mul", Var("f1"), Var("f2"))),
                      Set("s0", Var("f1"))),
                  rule=(Bump(3, "y_int32", 0, "array", "add", 7), Draw("_"))),
        Draw("f2"))),
}


@pytest.mark.parametrize("nest", sorted(RULE_NESTS))
def test_custom_rules_touching_states_and_keys_match_reference(nest):
    """Rule statements run where JAX runs the rule: differentiated from
    outside (jvp and vjp of pure) and inside (value_and_grad in the uncurried
    function) the outputs and states are ``Reference(diff=True)``'s, which
    differ from the plain reference's (the rules ran); undifferentiated
    (uncurry, vmap) no rule runs."""
    program = RULE_NESTS[nest]
    for args in (ARGS, ARGS2):
        check_uncurry(program, args, ARGS2, jit=False)
        pure, state0 = tx.uncurry(build(program), *args)
        state = perturb(state0)
        check_stateful_rules_differentiated(program, pure, state, args,
                                            *derivative_modes(program))
        assert check_grad_inside(program, args) == "value and states"
        plain, ran = (reference(program, args, state, diff=d)[1] for d in (False, True))
        counter = next(k for k in plain if k in TYPED_STATES)
        assert plain[counter] != ran[counter]
        assert not np.array_equal(jax.random.key_data(plain[RNG]),
                                  jax.random.key_data(ran[RNG]))
    check_vmap(program, ARGS, ARGS2, with_reap=False)


def test_custom_jvp_rule_counting_and_drawing_under_jvp_and_grad_of_pure():
    """A custom_jvp function called twice whose rule adds 127 to an int8
    counter and draws a key: under jax.jvp and jax.grad of pure from outside
    its rule runs once per call, in program order (the key draws after it
    see the stream advanced); run plainly, never."""
    program = RULE_NESTS["cjvp_rule_counts_and_draws"]
    pure, state0 = tx.uncurry(build(program), *ARGS)
    state = perturb(state0)
    out_r, fin_r, _, _ = reference(program, ARGS, state, diff=True)
    np.testing.assert_array_equal(
        fin_r["y_int8"], (state["y_int8"].astype(np.int64) + 1 + 2 * 127 + 128) % 256 - 128)

    def run(p0):
        out, fin = pure(state, p0, *ARGS[1:])
        return out[0] + out[1] + out[2], (out, fin)

    (_, (out, fin)), _ = jax.jvp(run, (ARGS[0],), (np.float32(1.0),))
    assert_outs_close(out, out_r, "jvp(pure) out")
    assert_dict_close(fin, fin_r, "jvp(pure) state")
    _, (out, fin) = jax.grad(run, has_aux=True)(ARGS[0])
    assert_outs_close(out, out_r, "grad(pure) out")
    assert_dict_close(fin, fin_r, "grad(pure) state")
    out, fin = pure(state, *ARGS)
    out_p, fin_p, _, _ = reference(program, ARGS, state)
    assert_outs_close(out, out_p, "pure out")
    assert_dict_close(fin, fin_p, "pure state")


def test_rule_statements_where_taxpr_cannot_thread_them_raise():
    """Differentiated from outside, a state access in the fwd of a custom_vjp
    whose body uses no state, or in the rule of a custom_jvp nested in such a
    custom_vjp or in equinox's checkpointed loop (run by their bwd, after
    pure has returned), is a StateError naming the state
    (docs/limitations.md); ``Gen.add_rules`` draws none of them."""
    rule = (Bump(3, "y_int32", 0, "array", "add", 7),)
    body = (Assign("f1", Un("sin", Var("f1"))),)
    first = Bump(1, "y_int32", 5, "scalar", "add", 1)
    cases = (("custom_vjp[fwd]", CustomVjp(2, body, rule=rule)),
             ("custom_vjp[bwd]", CustomVjp(2, (CustomJvp(4, body, rule=rule),))),
             ("custom_vjp[bwd]", EqxLoop(2, (CustomJvp(4, body, rule=rule),))))
    for where, f in cases:
        program = Program((first, f))
        pure, state0 = tx.uncurry(build(program), *ARGS)

        def run(*xs, pure=pure, state0=state0):
            return pure(state0, *xs, ARGS[4])

        with pytest.raises(tx.StateError, match=r"state 'y_int32'.*" + re.escape(where)):
            outs, vjp_fn = jax.vjp(run, *ARGS[:4])
            vjp_fn(jax.tree_util.tree_map(
                lambda v: (jnp.ones_like(v) if jnp.issubdtype(v.dtype, jnp.inexact)
                           else np.zeros(np.shape(v), jax.dtypes.float0)), outs))


@pytest.mark.parametrize("nest", sorted(LIBRARY_NESTS))
def test_programs_inside_library_operations_match_reference(nest):
    """uncurry, reap, harvest / plant and vmap over states of programs inside
    custom_root and equinox's checkpointed loop match the eager reference."""
    program = LIBRARY_NESTS[nest]
    check_uncurry(program, ARGS, ARGS2, jit=True)
    check_reap(program, ARGS, jit=False, compose="reap(pure)", filt=(None, ()))
    check_reap(program, ARGS2, jit=True, compose="uncurry(reap)", filt=(None, ()))
    check_harvest(program, ARGS, 0, jit=False)
    check_vmap(program, ARGS2, ARGS, with_reap=True)


@pytest.mark.parametrize("nest", sorted(TYPED_NESTS))
def test_typed_states_of_every_dtype_through_every_primitive_match_reference(nest):
    """uncurry (state0, jitted pure of another state) and vmap over states
    keep every dtype's state exact through the primitives' carries; the
    derivatives match finite differences (JAX differentiates only the first
    nest: grad does not go through while, jvp not through custom_vjp)."""
    program = TYPED_NESTS[nest]
    check_uncurry(program, ARGS, ARGS2, jit=True)
    check_vmap(program, ARGS2, ARGS, with_reap=False)
    if nest == "scan_cond_switch_jit_ckpt":
        check_derivatives(program, ARGS, 0, "pure")  # typed carries' tangents


ARGS2 = (np.float32(-1.0), np.float32(0.3), np.float32(-0.75), np.array([1.5, 0.0, -2.0],
                                                                        np.float32), np.int32(2))


# ---------------------------------------------------------------------------------
# What the CI profile generates
# ---------------------------------------------------------------------------------

TYPED_CONTEXTS = ("program", "Scan", "Fori", "While", "Cond", "Switch",
                  *(cls.__name__ for cls in FUNCTIONS))
# The CI profile's tests, by the check each runs.
CI_TESTS = {
    "check_uncurry": (test_uncurry_matches_reference, test_uncurry_jit_matches_reference),
    "check_reap": (test_reap_matches_reference,),
    "check_harvest": (test_harvest_matches_reference,),
    "check_vmap": (test_vmap_matches_reference,),
    "check_vmap_inside": (test_vmap_inside_with_batched_predicates_matches_reference,),
    "check_derivatives": (test_derivatives_match_finite_differences,),
    "check_grad_inside": (test_grad_inside_matches_reference,),
    "check_raw_reap": (test_raw_reap_matches_reference,),
    "check_as_users_run": (test_programs_as_users_run_them_match_reference,),
}


@pytest.mark.skipif(LONG, reason="TAXPR_FUZZ_LONG=1: the CI profile's tests draw the long "
                                 "profile's programs")
def test_ci_profile_generates_typed_states_everywhere(monkeypatch):
    """The programs the CI profile's fuzz tests check hold typed states with
    every exact update (so of every dtype kind), in every kind of body (so
    every control-flow primitive's carries get them), of most dtypes; and
    custom_jvp / custom_vjp functions whose rules bump typed states and draw
    keys themselves, which the derivative checks run differentiated from
    outside and inside. The tests draw the same programs again
    (derandomized), checking none."""
    module = sys.modules[__name__]
    monkeypatch.setattr(module, "_DRAW_ONLY", True)
    monkeypatch.setattr(module, "_CHECKED", collections.Counter())
    monkeypatch.setattr(module, "_GENERATED", set())
    for tests in CI_TESTS.values():
        for test in tests:
            test()
    assert set(_CHECKED) == set(CI_TESTS), _CHECKED  # every check drew its programs
    want = ({f"typed_state {op}" for ops in TYPED_OPS.values() for op in ops}
            | {f"typed_state in {c}" for c in TYPED_CONTEXTS})
    assert not want - _GENERATED, f"never generated: {sorted(want - _GENERATED)}"
    # Most dtypes (which ones depends on hypothesis' derandomized draws;
    # every one through every primitive: test_typed_states_of_every_dtype_...).
    dtypes = {d for d in TYPED_DTYPES if f"typed_state {d}" in _GENERATED}
    assert len(dtypes) >= 15, f"generated only {sorted(dtypes)}"
    # Custom functions whose rules touch states and keys themselves, run
    # differentiated from outside and inside (labels of run_check).
    # Every check, every kind of function and of rule statement, in some
    # pairing (which ones depends on the derandomized draws).
    checks, classes = ("check_derivatives", "check_grad_inside"), ("CustomJvp", "CustomVjp")
    ran = {(c, cls, stmt) for c in checks for cls in classes for stmt in ("Bump", "Draw")
           if f"{c}: rule {stmt} in {cls}" in _GENERATED}
    for i, want in enumerate((checks, classes, ("Bump", "Draw"))):
        missing = set(want) - {r[i] for r in ran}
        assert not missing, f"no rule statements differentiated for {sorted(missing)}: {ran}"


def test_the_long_profile_runs_the_requested_number_of_programs_in_all():
    # TAXPR_FUZZ_EXAMPLES=N is the number of programs of the whole long
    # profile (its tests share it), not a number per test.
    long_tests = [v for k, v in globals().items() if k.startswith("test_long_")]
    counts = [t._hypothesis_internal_use_settings.max_examples for t in long_tests]
    assert len(long_tests) == 10
    assert LONG_EXAMPLES <= sum(counts) < LONG_EXAMPLES + len(long_tests)

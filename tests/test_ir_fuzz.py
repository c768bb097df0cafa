"""Differential fuzzing of the taxpr.ir passes.

A compact generator builds random programs from a seed: float32 scalars and
vectors, a bfloat16 vector and int32 scalars; literals including -0.0, NaN
and +-inf; integer ``div``/``rem`` (by 0 and -1 too); identity copies,
constant subexpressions and repeated work (so every pass has work);
``lax.scan`` (length 0 to 3), ``lax.cond``, bounded ``lax.while_loop``,
``jax.jit`` (a jitted block called once or twice on the same inputs),
``jax.checkpoint``, nested up to depth 3; tags, ``io_callback`` and
``jax.debug.callback`` anywhere. (tests/test_fuzz.py's generator is
specialised to state/harvest programs over values in [-2, 2], so it is not
reused here.)

For every pass, the pipeline and Python code generation (the generated
function traced again): ``check_jaxpr`` passes, the outputs are
bitwise equal to the original's (any NaN equals any NaN), the number of
callback calls at run time and the tags are unchanged.

Programs also run transformed, as users run them: under ``jax.vmap``
(``check_program(seed, batched=True)``: three examples, every argument
batched), so the passes see what vmap makes of control flow (a ``cond``
with a batched predicate becomes both branches and ``select_n``; a
``while`` with a batched predicate, each example looping ``trips`` more
times, a ``while_p`` whose predicate is per example), and under
``jax.jvp`` (``differentiated=True``), both where JAX can.

Profiles: CI runs ``TAXPR_IR_FUZZ_CI`` programs (default 16, under a
minute), some of them vmapped and differentiated; ``pytest -m long`` runs
``TAXPR_IR_FUZZ_EXAMPLES`` (default 20,000) starting at seed
``TAXPR_IR_FUZZ_SEED`` (default 0), and for three seeds in four a
transformed run too (``long_profile_modes``).
"""

from __future__ import annotations

import os
import random
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import io_callback

import taxpr as tx
from taxpr import _jaxpr, _traverse, ir

from ir_helpers import assert_bitwise, check, run

SLOTS = {"f0": "f", "f1": "f", "f2": "f", "v0": "v", "v1": "v", "b0": "b", "i0": "i", "i1": "i"}
FLOAT_LITS = (0.0, -0.0, 1.0, -1.0, 2.0, 0.5, float("nan"), float("inf"), float("-inf"), 3.0)
INT_LITS = (0, 1, -1, 2, 7, -3)
FBIN = ("add", "sub", "mul", "div", "max", "min")
FUN = ("sin", "neg", "abs", "exp", "sqrt", "tanh", "negneg")
IBIN = ("add", "sub", "mul", "div", "rem", "max")
MAX_DEPTH = 3
CALLS: Counter = Counter()


def _io_identity(x):
    CALLS["io"] += 1
    return x


def _debug_cb(x):
    CALLS["debug"] += 1


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


def _fbin(op, x, y):
    if jax.config.jax_enable_x64 and (type(x) is float or type(y) is float):
        # Under x64 lax takes a Python float as float64; jnp promotes it
        # weakly, to the same weak literal that lax makes without x64.
        return {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply,
                "div": jnp.divide, "max": jnp.maximum, "min": jnp.minimum}[op](x, y)
    return {"add": lax.add, "sub": lax.sub, "mul": lax.mul, "div": lax.div,
            "max": lax.max, "min": lax.min, "rem": lax.rem}[op](x, y)


def _lit(a, dtype, shape):
    # A Python scalar keeps the literal weak and inline in the jaxpr.
    v = a[1]
    return lax.broadcast(jnp.asarray(v, dtype), shape) if shape else v


def exec_block(stmts, env):
    env = dict(env)
    for s in stmts:
        env = exec_stmt(s, env)
    return env


def exec_stmt(s, env):
    k = s[0]
    if k == "bin":
        _, dst, op, a, b = s
        like = env[dst]
        xa = _lit(a, like.dtype, like.shape) if isinstance(a, tuple) else env[a]
        xb = _lit(b, like.dtype, like.shape) if isinstance(b, tuple) else env[b]
        if isinstance(xa, float) and isinstance(xb, float):
            xa = jnp.asarray(xa, like.dtype)
        res = _fbin(op, xa, xb) if not isinstance(xa, float) else _fbin(op, xb * 0 + xa, xb)
        env[dst] = lax.convert_element_type(res, like.dtype)
    elif k == "un":
        _, dst, op, a = s
        x = env[a]
        env[dst] = lax.neg(lax.neg(x)) if op == "negneg" else getattr(lax, op)(x)
    elif k == "constexpr":
        _, dst, op, c1, c2 = s
        like = env[dst]
        c = _fbin(op, jnp.float32(c1), c2)
        env[dst] = lax.add(like, lax.broadcast(c, like.shape)) if like.shape else like + c
    elif k == "copy":
        env[s[1]] = lax.copy_p.bind(env[s[1]])
    elif k == "tag":
        env[s[1]] = tx.tag(env[s[1]], op="fuzz")
    elif k == "callback":
        x = env[s[1]]
        if s[2] == "io":
            env[s[1]] = io_callback(_io_identity, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                                    ordered=False)
        else:
            jax.debug.callback(_debug_cb, x)
    elif k == "bf_from":
        env["b0"] = env[s[1]].astype(jnp.bfloat16)
    elif k == "bf_bin":
        b = env["b0"]
        y = s[2]
        yb = lax.broadcast(jnp.asarray(y[1], jnp.bfloat16), b.shape) if isinstance(y, tuple) \
            else lax.broadcast(env[y].astype(jnp.bfloat16), b.shape)
        env["b0"] = _fbin(s[1], b, yb)
    elif k == "bf_to":
        env[s[1]] = env["b0"].astype(jnp.float32) * 1.0
    elif k == "ibin":
        _, dst, op, a, b = s
        xa = jnp.int32(a[1]) if isinstance(a, tuple) else env[a]
        # JAX 0.10's XLA traps (SIGFPE) when it evaluates at compile time an
        # integer division by a zero it can prove, in the original program
        # already: a literal 0, or e.g. ``i0 = i0 - i0; i1 = rem(1, i0);
        # i0 = i1 + i1`` (PROVABLE_ZERO_DIVISOR; an optimization barrier does not help on
        # CPU, XLA expands it first). So literal divisors are nonzero and a
        # variable divisor is offset by the argument ``zero`` (0 at run time,
        # unknown to XLA and to taxpr); at run time x / 0 is defined.
        xb = jnp.int32(b[1] or 3) if isinstance(b, tuple) else env[b]
        if op in ("div", "rem") and not isinstance(b, tuple):
            xb = xb + env["zero"]
        env[dst] = _fbin(op, xa, xb)
    elif k == "scan":
        _, length, body = s
        env, _ = lax.scan(lambda c, _: (exec_block(body, c), None), env, None, length=length)
    elif k == "cond":
        _, p, t, f = s
        env = lax.cond(env[p] % 2 == 0, lambda e: exec_block(t, e), lambda e: exec_block(f, e),
                       env)
    elif k == "while":
        _, n, body = s
        # Batched programs add each example's own extra trips (``trips``),
        # so vmap batches the predicate and the examples stop apart.
        bound = n + env["trips"] if "trips" in env else n
        _, env = lax.while_loop(lambda c: c[0] < bound,
                                lambda c: (c[0] + 1, exec_block(body, c[1])), (0, env))
    elif k == "jit":
        _, times, body = s
        fn = jax.jit(lambda e: exec_block(body, e))
        if times == "twin":
            a, b = fn(env), fn(env)
            env = dict(a, f0=a["f0"] + b["f0"])
        else:
            for _ in range(times):
                env = fn(env)
    elif k == "ckpt":
        env = jax.checkpoint(lambda e: exec_block(s[1], e))(env)
    else:  # pragma: no cover
        raise AssertionError(s)
    return env


def make_fn(stmts):
    def f(f0, f1, f2, v0, v1, b0, i0, i1, zero, *trips):
        env = dict(f0=f0, f1=f1, f2=f2, v0=v0, v1=v1, b0=b0, i0=i0, i1=i1, zero=zero)
        if trips:  # batched programs: extra while trips per example
            env["trips"] = trips[0]
        env = exec_block(stmts, env)
        return [env[n] for n in SLOTS]
    return f


def arguments(seed: int):
    r = np.random.default_rng(seed)
    pal = np.array([0.0, -0.0, 1.5, -2.25, np.nan, np.inf, -np.inf, 0.3, 7.0], np.float32)
    f = [np.float32(r.choice(pal)) for _ in range(3)]
    v = [r.choice(pal, 4).astype(np.float32) for _ in range(2)]
    b = r.choice(pal, 4).astype(jnp.bfloat16)
    i = [np.int32(r.choice([0, 1, -1, 5, -7, 2**31 - 1, -2**31])) for _ in range(2)]
    return (*f, *v, b, *i, np.int32(0))  # the last: ``zero``


VARIANTS = {
    "constant_fold": ir.constant_fold,
    "algebraic_simplification": ir.algebraic_simplification,
    "copy_propagation": ir.copy_propagation,
    "common_subexpression_elimination": ir.common_subexpression_elimination,
    "dead_code_elimination": ir.dead_code_elimination,
    "optimize_jaxpr": ir.optimize_jaxpr,
    "jaxpr_to_python_code": lambda j: regenerate(j),
}


def regenerate(j):
    """The jaxpr of the Python code generated from ``j`` (its function traced
    at ``j``'s input types): codegen is checked like a pass."""
    code = ir.jaxpr_to_python_code(j)
    avals = [v.aval for v in _jaxpr.jaxpr_parts(j).invars]
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    return jax.make_jaxpr(code.load())(*specs)


def _identity(j) -> tuple:
    """What determines ``j``'s results: its text and its constants' bytes."""
    consts = _jaxpr.jaxpr_parts(j).consts or ()
    return str(j), tuple((np.asarray(c).dtype.str, np.asarray(c).shape, np.asarray(c).tobytes())
                         for c in consts)


class _EagerReference:
    """The original's outputs evaluated equation by equation (computed only
    when needed: it is slow).

    XLA folds constant-only expressions itself when it compiles the original,
    and not always as it computes them at run time: ``-0.0 - -0.0`` becomes
    ``-0.0`` (its ``A - 0 -> A`` also matches -0.0) where IEEE and the
    eager op give ``+0.0``; ``tanh`` of a constant is folded with the C
    library's ``tanh``, 1 ulp from XLA's own kernel. taxpr folds with
    JAX's eager semantics, so an output may equal the eager original where
    the jitted original differs: both are what JAX computes for the program.
    """

    def __init__(self, j, args):
        self._j, self._args, self._out = j, args, None

    def outputs(self):
        if self._out is None:
            self._out = run(self._j, *self._args, jit=False)
        return self._out


def _bitwise_equal(a, b) -> bool:
    try:
        assert_bitwise([a], [b])
    except AssertionError:
        return False
    return True


def assert_bitwise_to_jit_or_eager(got, want, eager: _EagerReference,
                                   variant_eager: _EagerReference, what: str) -> None:
    """Each output bitwise equal to the jitted original's, or else to the
    eager original's (see :class:`_EagerReference`).

    Where XLA's compiled original itself departs from the eager original (it
    did not compute what the program says), the compiled variant is no
    reference either: the variant evaluated eagerly must then equal the
    original evaluated eagerly. Seen on JAX 0.10.2's CPU backend: ``exp`` of
    a fused NaN constant (``exp(0.5 / nan + x)``) returns garbage that
    changes from run to run (``NAN_EXP_PROGRAMS``), in the original as in
    the variant.
    """
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if _bitwise_equal(g, w):
            continue
        reference = eager.outputs()[i]
        if _bitwise_equal(g, reference):
            continue
        if not _bitwise_equal(w, reference):
            assert_bitwise([variant_eager.outputs()[i]], [reference],
                           f"{what} output={i} (XLA's original departs from eager; both eager)")
            continue
        assert_bitwise([g], [reference], f"{what} output={i} (jit and eager)")


def _tags(j):
    return sorted(str(s.path) for s in tx.find_tags(j))


def _calls(j, args):
    CALLS.clear()
    out = run(j, *args)
    jax.effects_barrier()
    return out, dict(CALLS)


BATCH = 3


def batched_arguments(seed: int) -> list:
    """``BATCH`` examples of every argument, stacked (those of seeds
    ``seed``, ``seed + 1``, ...), and ``trips`` (0, 1, 2: each example's
    extra ``while`` iterations), so vmap batches every predicate."""
    examples = [arguments(seed + k) for k in range(BATCH)]
    return [*(np.stack(column) for column in zip(*examples)),
            np.arange(BATCH, dtype=np.int32)]


N_FLOAT_ARGS = 5  # f0, f1, f2, v0, v1: the arguments jvp differentiates


def differentiate(fn):
    """``fn`` with ``N_FLOAT_ARGS`` tangent arguments put first, returning
    its outputs (by ``jax.jvp``) and the tangents of its float32 outputs."""
    def jvp_fn(*args):
        tangents, args = args[:N_FLOAT_ARGS], args[N_FLOAT_ARGS:]
        primals, rest = args[:N_FLOAT_ARGS], args[N_FLOAT_ARGS:]

        def split(*p):
            outs = fn(*p, *rest)
            floats = [o for o in outs if o.dtype == jnp.float32]
            return floats, [o for o in outs if o.dtype != jnp.float32]

        floats, tangents_out, others = jax.jvp(split, primals, tangents, has_aux=True)
        return [*floats, *others, *tangents_out]
    return jvp_fn


def traced_program(seed: int, batched: bool = False, differentiated: bool = False):
    """``(statements, arguments, jaxpr)`` of the program ``seed``:
    forward-differentiated (``differentiate``; the tangents are the float
    arguments of a later seed: NaN, inf, -0.0 included) when
    ``differentiated``, then vmapped over ``batched_arguments`` when
    ``batched``."""
    stmts = program(seed)
    fn = make_fn(stmts)
    args = batched_arguments(seed) if batched else list(arguments(seed))
    if differentiated:
        fn = differentiate(fn)
        later = batched_arguments(seed + BATCH) if batched else arguments(seed + BATCH)
        args = [*later[:N_FLOAT_ARGS], *args]
    if batched:
        fn = jax.vmap(fn)
    return stmts, args, jax.make_jaxpr(fn)(*args)


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


def check_program(seed: int, batched: bool = False, differentiated: bool = False) -> None:
    stmts, args, j = traced_program(seed, batched, differentiated)
    want, want_calls = _calls(j, args)
    eager = _EagerReference(j, args)
    tags = _tags(j)
    # A variant identical to the original or to an earlier variant (same
    # text, same constants) computes what that one did: it is not compiled
    # and run again (compiling dominates the fuzzer's time).
    ran = {_identity(j): (want, want_calls)}
    for name, p in VARIANTS.items():
        what = (f"seed={seed} batched={batched} differentiated={differentiated} pass={name} "
                f"program={stmts}")
        o = p(j)
        check(o)
        key = _identity(o)
        if key not in ran:
            ran[key] = _calls(o, args)
        got, got_calls = ran[key]
        assert_bitwise_to_jit_or_eager(got, want, eager, _EagerReference(o, args), what)
        assert got_calls == want_calls, (what, got_calls, want_calls)
        assert _tags(o) == tags, what


CI_COUNT = int(os.environ.get("TAXPR_IR_FUZZ_CI", "16"))
LONG_COUNT = int(os.environ.get("TAXPR_IR_FUZZ_EXAMPLES", "20000"))
LONG_SEED = int(os.environ.get("TAXPR_IR_FUZZ_SEED", "0"))
# The long profile also runs transformed programs: with seed % 4 == 0
# vmapped, == 1 differentiated (jvp), == 2 both (where JAX can), unless
# TAXPR_IR_FUZZ_TRANSFORMED=0.
TRANSFORMED = os.environ.get("TAXPR_IR_FUZZ_TRANSFORMED", "1") != "0"


def long_profile_modes(seed: int) -> list[tuple[bool, bool]]:
    """``(batched, differentiated)`` runs of program ``seed`` in the long
    profile: always the plain one, and one transformed where JAX can."""
    stmts = program(seed)
    modes = [(False, False)]
    wanted = {0: (True, False), 1: (False, True), 2: (True, True)}.get(seed % 4)
    if TRANSFORMED and wanted is not None:
        batched, differentiated = wanted
        if (not batched or vmappable(stmts)) and (not differentiated or differentiable(stmts)):
            modes.append(wanted)
    return modes


def test_generator_covers_every_feature():
    kinds: Counter = Counter(s[0] for seed in range(CI_COUNT) for s in _walk(program(seed)))
    for k in ("bin", "un", "constexpr", "copy", "tag", "callback", "bf_bin", "ibin",
              "scan", "cond", "while", "jit", "ckpt"):
        assert kinds[k] > 0, (k, kinds)


@pytest.mark.parametrize("seed", range(CI_COUNT))
def test_passes_preserve_outputs_effects_and_tags(seed):
    check_program(seed)


BATCHED_SEEDS = [s for s in range(CI_COUNT) if vmappable(program(s))][:8]


@pytest.mark.parametrize("seed", BATCHED_SEEDS)
def test_passes_preserve_outputs_effects_and_tags_of_vmapped_programs(seed):
    check_program(seed, batched=True)


DIFFERENTIATED_SEEDS = [s for s in range(CI_COUNT) if differentiable(program(s))][:6]


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("seed", DIFFERENTIATED_SEEDS)
def test_passes_preserve_outputs_effects_and_tags_of_differentiated_programs(seed, batched):
    # What jax.jvp makes of a program (tangent equations beside the primal
    # ones, jvp-named jits, symbolic zeros instantiated), vmapped too when
    # vmappable; tangents include NaN, inf and -0.0.
    if batched and not vmappable(program(seed)):
        pytest.skip("vmap rejects an io_callback in a cond/while")
    check_program(seed, batched=batched, differentiated=True)


def test_vmapped_programs_hold_what_vmap_makes_of_control_flow():
    # The condition the batched mode creates: a cond whose predicate vmap
    # batches runs both branches and selects (select_n, no cond left); a
    # while whose predicate it batches keeps a predicate per example (its
    # cond_jaxpr returns bool[3]: while_p loops while any holds and selects
    # each example's carry, which lax.while_loop cannot express).
    written, traced = Counter(), Counter()
    for seed in BATCHED_SEEDS:
        stmts, _, j = traced_program(seed, batched=True)
        written.update(s[0] for s in _walk(stmts))
        traced.update(e.primitive.name for e, _ in _traverse.iter_eqns(j))
    assert written["cond"] > traced["cond"], (written, traced)  # some became selects
    assert traced["select_n"], traced
    batched_whiles = [e for seed in BATCHED_SEEDS
                      for e, _ in _traverse.iter_eqns(traced_program(seed, batched=True)[2])
                      if e.primitive.name == "while"
                      and _jaxpr.jaxpr_parts(e.params["cond_jaxpr"]).outvars[0].aval.shape]
    assert batched_whiles, traced


def test_programs_vmap_rejects_are_exactly_those_with_an_io_callback_in_a_cond_or_while():
    for seed in range(CI_COUNT * 2):
        stmts = program(seed)
        if vmappable(stmts):
            continue
        with pytest.raises(Exception, match=VMAP_REJECTS) as rejected:
            traced_program(seed, batched=True)
        (message,) = [m for m in VMAP_REJECTIONS if m in str(rejected.value)]
        assert type(rejected.value) is VMAP_REJECTIONS[message], (seed, rejected.value)


# Generated programs kept as regression cases, by what they hold (the value
# is the program's seed: ``program(seed)``).
# ``rem(1, i0 - i0)``: an integer division by a zero XLA can prove.
PROVABLE_ZERO_DIVISOR = 5033
# A bfloat16 chain after a cond whose index constant folding decides.
BF16_CHAIN_AFTER_FOLDED_COND = 576
# An unused cond / scan / while whose body holds only (effect-free) tags,
# which JAX's own DCE rules would drop.
UNUSED_CALLS_OF_TAG_ONLY_JAXPRS = {"unused_call_of_tags_a": 324, "unused_call_of_tags_b": 493,
                                   "unused_call_of_tags_c": 617, "unused_call_of_tags_d": 663}
# A while holding only tags inside a jit that was jitted before (JAX 0.10
# caches the DCE of a jit's callee).
WHILE_OF_TAGS_IN_A_JIT_CALLED_TWICE = {"while_of_tags_in_jit_called_twice_a": 12590,
                                       "while_of_tags_in_jit_called_twice_b": 13349}
# A scan whose inputs are all constants constant_fold folds.
SCAN_OF_FOLDED_CONSTANTS = 4777
# Constants XLA's compile-time folding computes differently from eager
# evaluation (program, the output that differs, the backends where it does:
# XLA's GPU backend folds tanh(1.5) as eager computes it).
XLA_FOLDING_DEPARTS_FROM_EAGER = {
    "negative_zero_minus_negative_zero": (835, 3, frozenset({"cpu", "gpu"})),
    "tanh_of_a_constant": (856, 0, frozenset({"cpu"}))}
# ``exp`` of a fused NaN constant, which JAX 0.10.2's XLA CPU backend
# computes as garbage (program, the output).
NAN_EXP_PROGRAMS = {"exp_of_nan_constant_a": (10015, 1), "exp_of_nan_constant_b": (10272, 3)}


def test_integer_division_by_a_zero_xla_can_prove_does_not_crash_the_fuzzer():
    # JAX 0.10's XLA folds rem(1, i0 - i0) at compile time and the process
    # dies of SIGFPE (the original program, before any taxpr pass). Run in a
    # subprocess, so that a crash fails this test only.
    import subprocess
    import sys
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import jax; "
            "jax.config.update('jax_enable_checks', True); import test_ir_fuzz; "
            f"test_ir_fuzz.check_program({PROVABLE_ZERO_DIVISOR})")
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", code, here, os.path.dirname(here)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert ("ibin", "i0", "sub", "i0", "i0") in program(PROVABLE_ZERO_DIVISOR)
    assert ("ibin", "i1", "rem", ("lit", 1), "i0") in program(PROVABLE_ZERO_DIVISOR)


def test_bf16_chains_are_compared_without_xla_excess_precision():
    # Folding a cond index lets XLA fuse a bfloat16 chain differently, and
    # with excess precision allowed it skips a bf16 rounding in one program
    # only (1.1992188 vs 1.203125). tests/conftest.py turns excess precision
    # off, so both programs round every bf16 op.
    assert "--xla_allow_excess_precision=false" in os.environ["XLA_FLAGS"]
    check_program(BF16_CHAIN_AFTER_FOLDED_COND)


@pytest.mark.parametrize("seed", [
    *(pytest.param(seed, id=name) for name, seed in UNUSED_CALLS_OF_TAG_ONLY_JAXPRS.items()),
    *(pytest.param(seed, id=name) for name, seed in WHILE_OF_TAGS_IN_A_JIT_CALLED_TWICE.items()),
])
def test_dce_keeps_unused_calls_of_jaxprs_holding_tags(seed):
    # JAX's DCE rules drop an unused cond / scan / while whose body holds
    # only (effect-free) tags, and JAX's caches of DCE results (filled while
    # jitting the original) would bypass taxpr's rules.
    check_program(seed)


def test_folding_a_computation_that_reads_known_constants_evaluates_it():
    # A scan whose inputs are folded constants is evaluated with those
    # inputs (JAX 0.12's DCE moves the constants into the jaxpr's inputs).
    check_program(SCAN_OF_FOLDED_CONSTANTS)


@pytest.mark.parametrize("seed, output, departs_on",
                         [pytest.param(*case, id=name) for name, case
                          in XLA_FOLDING_DEPARTS_FROM_EAGER.items()])
def test_folded_constants_equal_what_jax_computes_eagerly(seed, output, departs_on):
    # XLA's compile-time folding of the original (-0.0 - -0.0 -> -0.0;
    # tanh(1.5) 1 ulp off) differs from the same program evaluated eagerly;
    # constant_fold follows eager.
    _, args, j = traced_program(seed)
    folded = run(ir.constant_fold(j), *args)
    eager = run(j, *args, jit=False)
    assert_bitwise(folded, eager, f"seed={seed}")
    if jax.default_backend() in departs_on:  # XLA's own folding is the odd one out
        with pytest.raises(AssertionError):
            assert_bitwise([folded[output]], [run(j, *args)[output]])
    check_program(seed)


@pytest.mark.parametrize("seed, output", [pytest.param(*case, id=name) for name, case
                                          in NAN_EXP_PROGRAMS.items()])
def test_outputs_xla_computes_wrongly_are_compared_eagerly(seed, output):
    # JAX 0.10.2's XLA CPU backend computes exp of a fused NaN constant as
    # garbage, in the original program as in the folded one. Eagerly both
    # give NaN, as IEEE says: constant_fold keeps the program's meaning, and
    # the fuzzer judges it by that.
    _, args, j = traced_program(seed)
    folded = ir.constant_fold(j)
    assert np.isnan(run(j, *args, jit=False)[output]).all()
    assert np.isnan(run(folded, *args, jit=False)[output]).all()
    check_program(seed)


def _log(path: str | None, line: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


@pytest.mark.long
def test_passes_preserve_outputs_effects_and_tags_long():
    # Every program runs (a finding does not hide the next ones); progress
    # goes to TAXPR_IR_FUZZ_LOG when set, so a long run can be followed.
    log = os.environ.get("TAXPR_IR_FUZZ_LOG")
    failures = []
    transformed_runs = 0
    for n, seed in enumerate(range(LONG_SEED, LONG_SEED + LONG_COUNT), 1):
        modes = long_profile_modes(seed)
        transformed_runs += len(modes) - 1
        for batched, differentiated in modes:
            try:
                check_program(seed, batched, differentiated)
            except Exception as e:  # noqa: BLE001 - every finding is reported below
                failures.append(f"seed {seed} batched={batched} differentiated="
                                f"{differentiated}: {type(e).__name__}: {str(e)[:2000]}")
                _log(log, failures[-1])
        if n % 100 == 0 or n == LONG_COUNT:
            _log(log, f"{n} programs up to seed {seed} ({transformed_runs} also transformed): "
                      f"{len(failures)} failures")
    assert not failures, "\n".join(failures)

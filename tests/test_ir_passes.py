"""taxpr.ir optimization passes: legal rewrites only, inside every nested jaxpr."""

from __future__ import annotations

import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import core
from jax.experimental import io_callback

import taxpr as tx
from taxpr import _compat, _jaxpr, ir

from helpers import shard_map
from ir_helpers import assert_bitwise, check, counts, run, total

PASSES = [ir.constant_fold, ir.algebraic_simplification, ir.copy_propagation,
          ir.common_subexpression_elimination, ir.dead_code_elimination]


def nested_scans(x):
    """3 nested scans with constant, repeated, identity and dead work at
    every level: 7 top-level and 34 nested equations."""
    def inner(c, _):
        a = c * 1.0
        b = c * 1.0
        k = jnp.float32(2.0) * 3.0
        d = a + b * k
        _ = jnp.sin(c), jnp.cos(c)
        e = jnp.tanh(d) - 0.0
        f = jnp.tanh(d) - 0.0
        return e + f, None

    def mid(c, _):
        c, _ = lax.scan(inner, c, None, length=2)
        e = c * 1.0
        f = jnp.cos(c)
        g = jnp.cos(c)
        _ = jnp.exp(e), jnp.log1p(g * g), jnp.sin(c) * 3.0 + 1.0
        return e + f + g, None

    def outer(c, _):
        c, _ = lax.scan(mid, c, None, length=2)
        h = jnp.exp(c * 0.1)
        _ = jnp.tanh(c), jnp.sin(c) * 2.0
        k = jnp.float32(1.0) * 2.0 + 1.0
        return h * 1.0 + k, None

    y, _ = lax.scan(outer, x, None, length=2)
    z = y * 1.0
    z2 = y * 1.0
    _ = jnp.sin(y)
    c = jnp.float32(3.0) * 2.0
    return z + z2 + c


def test_nested_scan_program_shrinks_to_5_top_and_20_nested():
    j = jax.make_jaxpr(nested_scans)(jnp.float32(0.3))
    assert counts(j) == (7, 34)
    o = ir.optimize_jaxpr(j, validate=True)
    top, nested = counts(o)
    assert top <= 5 and nested <= 20, (top, nested)
    assert (top, nested) == (3, 12)
    for x in (0.3, -0.0, np.nan, np.inf, -2.5):
        assert_bitwise(run(o, np.float32(x)), run(j, np.float32(x)), str(x))


def repeated_work(x, y):
    """Repeated work that only shows as repeated after folding (literals
    equal by value, not by identity), plus an ``x + 0.0`` that must stay."""
    acc = x
    for i in range(10):
        two = jnp.float32(1.0) + 1.0           # folds to a fresh literal 2.0
        a = x * two
        b = x * (jnp.float32(4.0) - 2.0)        # the same after folding
        c = jnp.sin(a) + jnp.sin(b) * 1.0
        d = (y + 0.0) * c                       # y + 0.0 is not y (-0.0)
        acc = acc + d + x * two
    return acc


def test_repeated_work_reaches_one_minimal_count_in_every_pass_order():
    j = jax.make_jaxpr(repeated_work)(jnp.float32(0.5), jnp.float32(-0.0))
    want = run(j, np.float32(0.5), np.float32(-0.0))
    results = set()
    for i, order in enumerate(itertools.permutations(PASSES)):
        o = ir.optimize_jaxpr(j, passes=list(order), validate=True)
        results.add(total(o))
        if i % 17 == 0:
                assert_bitwise(run(o, np.float32(0.5), np.float32(-0.0)), want, str(order))
    # Once: x*2, sin, sin+sin, y+0.0, d; per iteration: acc + d + x*2.
    assert results == {5 + 2 * 10}, results


def test_two_calls_of_jitted_function_with_callbacks_still_call_twice():
    calls = []

    @jax.jit
    def noisy(x):
        jax.debug.print("x={x}", x=x)
        io_callback(lambda v: calls.append(float(v)) or np.float32(0), jax.ShapeDtypeStruct((), jnp.float32), x, ordered=False)
        return x * 2.0

    def f(x):
        return noisy(x) + noisy(x)

    j = jax.make_jaxpr(f)(jnp.float32(1.0))
    for p in [*PASSES, ir.optimize_jaxpr]:
        o = p(j)
        check(o)
        assert sum(e.primitive.name in ("jit", "pjit") for e in _jaxpr.jaxpr_parts(o).eqns) == 2
        calls.clear()
        jax.block_until_ready(run(o, np.float32(1.0), jit=False))
        jax.effects_barrier()
        assert calls == [1.0, 1.0], (p, calls)


def test_large_pad_is_not_folded_and_small_pad_is():
    def big(x):
        return x + jnp.pad(jnp.ones((10,), jnp.float32), (0, 1_000_000 - 10))[:3].sum()

    def small(x):
        return x + jnp.pad(jnp.ones((10,), jnp.float32), (0, 10)).sum()

    jb = jax.make_jaxpr(big)(jnp.float32(1.0))
    ob = ir.constant_fold(jb)
    assert "pad" in {e.primitive.name for e, _ in ir_iter(ob)}
    assert all(np.size(c) <= 1000 for c in _jaxpr.jaxpr_parts(ob).consts)
    assert_bitwise(run(ob, np.float32(1.0)), run(jb, np.float32(1.0)))
    js = jax.make_jaxpr(small)(jnp.float32(1.0))
    os_ = ir.constant_fold(js)
    assert "pad" not in {e.primitive.name for e, _ in ir_iter(os_)}
    assert_bitwise(run(os_, np.float32(1.0)), run(js, np.float32(1.0)))


def test_constant_fold_cap_is_a_parameter():
    f = lambda x: x + jnp.arange(50.0, dtype=jnp.float32) * 2.0
    j = jax.make_jaxpr(f)(jnp.zeros(50, jnp.float32))
    assert total(ir.constant_fold(j, max_elements=10)) == total(j)
    folded = ir.constant_fold(j, max_elements=100)
    assert total(folded) == 1
    assert_bitwise(run(folded, np.ones(50, np.float32)), run(j, np.ones(50, np.float32)))


def test_constant_fold_evaluates_many_constants_at_once():
    def f(x):
        c = jnp.float32(0.5)
        for _ in range(200):
            c = jnp.sin(c) * 1.5 + 0.25
        return x + c

    j = jax.make_jaxpr(f)(jnp.float32(1.0))
    o = ir.constant_fold(j)
    assert total(o) == 1
    assert_bitwise(run(o, np.float32(1.0)), run(j, np.float32(1.0)))


@pytest.mark.parametrize("x", [0.0, -0.0, 1.5, np.nan, np.inf, -np.inf])
def test_algebraic_simplification_keeps_ieee_semantics(x):
    def f(x):
        return (x + 0.0, x * 0.0, x - x, x + (-0.0), x - 0.0, x * 1.0, x / 1.0,
                -(-x), jnp.maximum(x, x))

    j = jax.make_jaxpr(f)(jnp.float32(1.0))
    o = ir.dead_code_elimination(ir.algebraic_simplification(j))
    check(o)
    names = [e.primitive.name for e in _jaxpr.jaxpr_parts(o).eqns]
    assert names == ["add", "mul", "sub"]  # x + 0.0, x * 0.0, x - x stay
    assert_bitwise(run(o, np.float32(x)), run(j, np.float32(x)))


def test_algebraic_simplification_of_a_neg_whose_operand_became_a_literal():
    # -1.0 * 1.0 becomes the literal -1.0, which is then neg's operand (a
    # Literal is unhashable on JAX 0.12).
    def f(x):
        c = lax.mul(np.float32(-1.0), np.float32(1.0))
        return x + lax.neg(lax.neg(c)), x + lax.neg(c)

    j = jax.make_jaxpr(f)(jnp.float32(1.0))
    o = ir.algebraic_simplification(j)
    check(o)
    assert [e.primitive.name for e in _jaxpr.jaxpr_parts(o).eqns].count("mul") == 0
    assert_bitwise(run(o, np.float32(2.0)), run(j, np.float32(2.0)))


def test_algebraic_simplification_keeps_the_exact_output_type():
    # weak-typed x times a strongly typed 1 is strongly typed: not x.
    j = jax.make_jaxpr(lambda x: lax.mul_p.bind(x, np.float32(1)))(1.0)
    (eqn,) = _jaxpr.jaxpr_parts(j).eqns
    assert eqn.invars[0].aval.weak_type and not eqn.outvars[0].aval.weak_type
    assert ir.algebraic_simplification(j) is j
    # bf16 x converted to f32 then times 1: the multiply goes, the convert stays.
    jb = jax.make_jaxpr(lambda x: x.astype(jnp.float32) * 1.0)(jnp.bfloat16(1.5))
    ob = ir.optimize_jaxpr(jb, validate=True)
    assert [e.primitive.name for e in _jaxpr.jaxpr_parts(ob).eqns] == ["convert_element_type"]
    assert_bitwise(run(ob, jnp.bfloat16(1.5)), run(jb, jnp.bfloat16(1.5)))
    # integer division stays integer division; x // 1 is x.
    ji = jax.make_jaxpr(lambda a, b: (lax.div(a, b), lax.div(a, 1)))(7, 2)
    oi = ir.optimize_jaxpr(ji, validate=True)
    assert [e.primitive.name for e in _jaxpr.jaxpr_parts(oi).eqns] == ["div"]
    assert_bitwise(run(oi, np.int32(-7), np.int32(2)), run(ji, np.int32(-7), np.int32(2)))


def test_cse_compares_literals_by_value_dtype_and_sign():
    def f(x):
        return x * 2.0, x * 2.0, x * -0.0, x * 0.0, x.astype(jnp.int32) * 2

    j = jax.make_jaxpr(f)(jnp.float32(1.0))
    o = ir.common_subexpression_elimination(j)
    assert total(o) == total(j) - 1
    assert_bitwise(run(o, np.float32(-3.0)), run(j, np.float32(-3.0)))


def test_tags_and_effects_survive_every_pass_at_every_depth():
    def f(x):
        def body(c, _):
            tx.tag(c * 1.0, op="dead")               # unused tag: kept
            jax.debug.print("c={c}", c=c)           # effect: kept
            d = tx.tag(c, op="live") * 1.0
            return d + 1.0, None

        c, _ = lax.scan(body, x, None, length=3)
        return lax.cond(c > 0, lambda c: tx.tag(c, op="br") * 1.0, lambda c: c, c)

    j = jax.make_jaxpr(f)(jnp.float32(1.0))
    tags = sorted(s.params["op"] for s in tx.find_tags(j))
    for p in [*PASSES, ir.optimize_jaxpr]:
        o = p(j)
        check(o)
        assert sorted(s.params["op"] for s in tx.find_tags(o)) == tags, p
        names = [e.primitive.name for e, _ in ir_iter(o)]
        assert names.count("debug_callback") + names.count("debug_print") == 1, p


def test_unused_tag_tangent_is_kept_by_dce():
    f = lambda x: tx.tag(jnp.sin(x), op="t")
    j = jax.make_jaxpr(lambda x, t: jax.jvp(f, (x,), (t,))[0])(1.0, 1.0)
    before = [e.primitive.name for e, _ in ir_iter(j)].count("tag_tangent")
    o = ir.dead_code_elimination(j)
    check(o)
    assert before == 1
    assert [e.primitive.name for e, _ in ir_iter(o)].count("tag_tangent") == 1


def ir_iter(j):
    from taxpr import _traverse
    return _traverse.iter_eqns(j)


def test_dce_prunes_unused_scan_carries_and_outputs():
    def f(x):
        def body(c, _):
            a, b = c
            return (a + 1.0, jnp.sin(b) * 3.0), jnp.cos(a)
        (a, b), ys = lax.scan(body, (x, x), None, length=4)
        return a

    j = jax.make_jaxpr(f)(jnp.float32(1.0))
    o = ir.dead_code_elimination(j)
    check(o)
    (scan,) = [e for e in _jaxpr.jaxpr_parts(o).eqns if e.primitive.name == "scan"]
    assert len(scan.outvars) == 1
    assert counts(o) == (1, 1)
    assert_bitwise(run(o, np.float32(2.0)), run(j, np.float32(2.0)))


def every_nesting(x):
    """Repeated and identity work inside each kind of nested jaxpr."""
    def rep(v):
        return jnp.sin(v) * 1.0 + jnp.sin(v) * 1.0

    @jax.custom_jvp
    def cj(v):
        return rep(v)

    cj.defjvp(lambda p, t: (cj(p[0]), t[0]))

    @jax.custom_vjp
    def cv(v):
        return rep(v)

    cv.defvjp(lambda v: (cv(v), None), lambda r, g: (g,))

    y = jax.jit(rep)(x)
    y = jax.checkpoint(rep)(y)
    y = lax.cond(y > 0, rep, lambda v: rep(v) - 0.0, y)
    y = lax.while_loop(lambda c: rep(c[0]) * 0.0 + c[1] < 3.0,
                       lambda c: (rep(c[0]) + 1.0, c[1] + 1.0), (y, 0.0))[0]
    y = cj(y) + cv(y)
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("i",))
    P = jax.sharding.PartitionSpec
    y = shard_map()(lambda v: rep(v), mesh=mesh, in_specs=P(), out_specs=P())(y)
    return y


def test_passes_work_inside_every_kind_of_nested_jaxpr():
    j = jax.make_jaxpr(every_nesting)(jnp.float32(0.3))
    o = ir.optimize_jaxpr(j, validate=True)
    from taxpr import _traverse
    levels_before = [len(_jaxpr.jaxpr_parts(sj).eqns) for e, _ in _traverse.iter_eqns(j)
                     for _, sj in _traverse.subjaxprs(e)]
    levels_after = [len(_jaxpr.jaxpr_parts(sj).eqns) for e, _ in _traverse.iter_eqns(o)
                    for _, sj in _traverse.subjaxprs(e)]
    assert total(o) < total(j)
    # jit, checkpoint, 2 cond branches, while cond and body, custom_jvp,
    # custom_vjp, shard_map: each `rep` (sin, mul, sin, mul, add) -> sin, add.
    assert len(levels_before) == len(levels_after) == 9
    assert all(a < b for a, b in zip(levels_after, levels_before)), (levels_before, levels_after)
    assert levels_before.count(5) == 6 and levels_after.count(2) == 7
    for x in (0.3, -0.7, 0.0):
        assert_bitwise(run(o, np.float32(x)), run(j, np.float32(x)))


@pytest.mark.parametrize("closed", [True, False])
def test_each_pass_returns_the_kind_of_jaxpr_it_gets(closed):
    j = jax.make_jaxpr(lambda x: (x * 1.0 + jnp.float32(2.0) * 2.0, jnp.sin(x)))(jnp.float32(1.0))
    if not closed and not _compat.MERGED_JAXPR:
        j = j.jaxpr
    for p in [*PASSES, ir.optimize_jaxpr]:
        o = p(j)
        assert type(o) is type(j)
        check(o)
    once = ir.copy_propagation(j)
    assert ir.copy_propagation(once) is once  # idempotent: nothing left to rewrite


def test_unchanged_jaxpr_is_returned_as_is():
    j = jax.make_jaxpr(lambda x: jnp.sin(x) + x)(jnp.float32(1.0))
    for p in PASSES:
        assert p(j) is j, p


def test_validate_runs_check_jaxpr_on_the_result():
    from jax._src import core

    def breaks_types(j):
        parts = _jaxpr.jaxpr_parts(j)
        eqn = parts[3][0]
        bad = eqn.replace(outvars=[core.Var(core.ShapedArray((2,), jnp.float32))])
        return _jaxpr.make_jaxpr_like(j, parts[0], parts[1], parts[2], [bad], bad.outvars,
                                       parts[5], parts[6])

    j = jax.make_jaxpr(lambda x: jnp.sin(x))(jnp.float32(1.0))
    # Without validate the pass's result comes back unchecked, ill-typed.
    unchecked = ir.optimize_jaxpr(j, passes=[breaks_types])
    assert _jaxpr.jaxpr_parts(unchecked).outvars[0].aval.shape == (2,)
    with pytest.raises(jax.errors.JaxprTypeError, match="inconsistently typed as f32"):
        ir.optimize_jaxpr(j, passes=[breaks_types], validate=True)
    with pytest.raises(ValueError, match="unknown passes"):
        ir.optimize_jaxpr(j, passes=["no_such_pass"])


def test_copy_propagation_is_linear_in_the_number_of_copies():
    def chain(n):
        def f(x):
            for _ in range(n):
                x = lax.copy_p.bind(x)
            return x + 1.0
        return f

    times = {}
    for n in (4000, 16000):
        j = jax.make_jaxpr(chain(n))(jnp.zeros(3, jnp.float32))
        assert total(j) == n + 1
        t0 = time.process_time()
        o = ir.copy_propagation(j)
        times[n] = time.process_time() - t0
        assert total(o) == 1
    assert times[16000] < 8 * max(times[4000], 0.02), times


def test_effect_of_one_cond_branch_stays_on_the_cond_when_another_branch_shrinks():
    def f(x):
        def noisy(v):
            jax.debug.print("v={v}", v=v)
            return v
        return lax.cond(x > 0, lambda v: (jnp.sin(v), v)[1], noisy, x)

    j = jax.make_jaxpr(f)(jnp.float32(1.0))
    for p in [*PASSES, ir.optimize_jaxpr]:
        o = p(j)
        check(o)
        (cond,) = [e for e in _jaxpr.jaxpr_parts(o).eqns if e.primitive.name == "cond"]
        assert cond.effects, p


def test_constant_fold_never_folds_or_materializes_an_integer_divisor():
    # XLA (JAX 0.10) traps with SIGFPE when it compiles an integer division
    # by a literal 0: the folded program keeps every integer division by a
    # computed constant as a division by a variable (a literal divisor is
    # only kept when the program had it).
    def f(x):
        z = lax.sub(np.int32(3), np.int32(3))            # a constant 0
        return lax.div(np.int32(7), z), lax.rem(x, z), lax.div(x, lax.add(z, np.int32(2)))

    j = jax.make_jaxpr(f)(np.int32(5))
    o = ir.constant_fold(j)
    check(o)
    divs = [e for e in _jaxpr.jaxpr_parts(o).eqns if e.primitive.name in ("div", "rem")]
    assert len(divs) == 3
    assert not any(isinstance(e.invars[1], core.Literal) for e in divs)
    # Evaluated op by op (no XLA constant folding across ops): x / 0 is defined.
    assert_bitwise(run(o, np.int32(5), jit=False), run(j, np.int32(5), jit=False))


def test_dce_keeps_an_unused_cond_whose_branches_hold_tags_even_after_jitting():
    def f(x, i):
        lax.cond(i > 0, lambda v: tx.tag(v, op="a"), lambda v: tx.tag(v * 2.0, op="b"), x)
        return x + 1.0

    j = jax.make_jaxpr(f)(1.0, 1)
    run(j, 1.0, 1)  # fills JAX's DCE cache with its own rules' result
    o = ir.dead_code_elimination(j)
    check(o)
    assert sorted(s.params["op"] for s in tx.find_tags(o)) == ["a", "b"]
    assert [e.primitive.name for e in _jaxpr.jaxpr_parts(o).eqns].count("cond") == 1


# ---- the default passes stop where another round would change nothing -----------------

def _identity(j) -> tuple:
    """What ``j`` is: its text (variables numbered in order) and its consts."""
    consts = _jaxpr.jaxpr_parts(j).consts or ()
    return str(j), tuple((np.asarray(c).dtype.str, np.asarray(c).shape,
                          np.asarray(c).tobytes()) for c in consts)


def _default_passes_to_fixpoint(j, rounds: int = 10):
    """The default passes (algebraic simplification, copy propagation and
    CSE in one walk) repeated until a round returns its input, and how many
    rounds changed something."""
    from taxpr.ir import _passes
    for changed in range(rounds):
        before = j
        for p in (ir.constant_fold, _passes._simplify_copies_and_cse,
                  ir.dead_code_elimination):
            j = p(j)
        if j is before:
            return j, changed
    raise AssertionError(f"no fixpoint in {rounds} rounds")


def _bench_ir_program():
    import importlib.util
    import pathlib
    import sys
    bench = pathlib.Path(__file__).resolve().parent.parent / "bench"
    sys.path.insert(0, str(bench))  # bench_ir imports its _common
    try:
        spec = importlib.util.spec_from_file_location("_taxpr_bench_ir", bench / "bench_ir.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(bench))
    return module.program


_SELECTED = np.arange(3, dtype=np.float32)


def _select_of_equal_constants_plus_constant(p, y):
    # select_n(p, c, c) is c, a constant: the add becomes constant.
    return lax.select_n(p, _SELECTED, _SELECTED) + 2.0, y


def _constant_divisor_of_dead_division(x, y):
    # d is not folded while a division uses it; DCE removes that division.
    d = lax.add(np.int32(1), np.int32(2))
    _ = lax.div(x, d)
    return d * y


def _splat_one_divisor(x):
    # x / s is x for s = [1, 1, 1]; then s is no integer divisor and folds.
    s = lax.broadcast_in_dim(np.int32(1), (3,), ())
    return lax.div(x, s), x + s


def _calls_equal_once_pruned(x, y, z):
    # DCE prunes the unused output of both calls: they become the same call.
    f = jax.jit(lambda a, b: (a * 2.0, jnp.sin(b)))
    return f(x, y)[0] + f(x, z)[0]


def _call_constant_once_pruned(x, y):
    # DCE prunes the call's unused output and then its unused input x.
    f = jax.jit(lambda a, b: (a * 2.0, b * 2.0))
    return f(x, jnp.float32(3.0))[1] + y


NEEDS_A_SECOND_ROUND = {
    "select_of_equal_constants": (_select_of_equal_constants_plus_constant,
                                  (np.array([True, False, True]), np.float32(1.0))),
    "constant_divisor_of_dead_division": (_constant_divisor_of_dead_division,
                                          (np.int32(7), np.int32(2))),
    "splat_one_divisor": (_splat_one_divisor, (np.arange(1, 4, dtype=np.int32),)),
    "calls_equal_once_pruned": (_calls_equal_once_pruned,
                                (np.float32(1.0), np.float32(2.0), np.float32(3.0))),
    "call_constant_once_pruned": (_call_constant_once_pruned, (np.float32(1.0), np.float32(2.0))),
}


@pytest.mark.parametrize("name", sorted(NEEDS_A_SECOND_ROUND))
def test_default_passes_run_the_round_an_earlier_round_gave_work(name):
    f, args = NEEDS_A_SECOND_ROUND[name]
    j = jax.make_jaxpr(f)(*args)
    want, rounds = _default_passes_to_fixpoint(j)
    assert rounds >= 2, name  # one round does not reach the fixpoint
    o = ir.optimize_jaxpr(j, validate=True)
    assert _identity(o) == _identity(want), (name, o, want)
    assert_bitwise(run(o, *args), run(j, *args), name)


def test_default_passes_reach_the_fixpoint_of_the_rewrite_rich_bench_program(monkeypatch):
    from taxpr.ir import _passes
    j = jax.make_jaxpr(_bench_ir_program()(400))(jnp.float32(0.5), jnp.float32(0.25))
    want, rounds = _default_passes_to_fixpoint(j)
    assert rounds == 1
    folds = []  # one constant folding per round
    fold_level = _passes._fold_level
    monkeypatch.setattr(_passes, "_fold_level", lambda *a: folds.append(a) or fold_level(*a))
    assert _identity(ir.optimize_jaxpr(j)) == _identity(want)
    assert len(folds) == 1  # the one round that changes the program, no confirming round


@pytest.mark.parametrize("batched,differentiated",
                         [(False, False), (True, False), (False, True)])
def test_default_passes_reach_the_fixpoint_of_fuzzed_programs(batched, differentiated):
    from ir_fuzz.build import traced_program
    from ir_fuzz.generator import differentiable, program, vmappable
    for seed in range(40):
        stmts = program(seed)
        if batched and not vmappable(stmts) or differentiated and not differentiable(stmts):
            continue
        _, _, j = traced_program(seed, batched, differentiated)
        want, _ = _default_passes_to_fixpoint(j)
        assert _identity(ir.optimize_jaxpr(j)) == _identity(want), (seed, stmts)


def test_constant_fold_evaluates_a_folded_equation_that_uses_a_kept_constant():
    # d stays (an integer divisor); d * 5 folds, computed from d's value.
    def f(x):
        d = lax.add(np.int32(1), np.int32(2))
        return lax.div(x, d) + d * 5

    j = jax.make_jaxpr(f)(np.int32(7))
    o = ir.constant_fold(j)
    check(o)
    assert [e.primitive.name for e in _jaxpr.jaxpr_parts(o).eqns] == ["add", "div", "add"]
    assert_bitwise(run(o, np.int32(7)), run(j, np.int32(7)))

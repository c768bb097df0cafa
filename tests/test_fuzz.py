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
pytree-valued states (``pt``: a tuple of a float32 and a float32[3];
``pd``: a dict of an int8 and a float32[3]) read, updated and first set,
``with tx.scope(...)`` blocks (nested, anywhere) and function calls in
scopes (one function object in two scopes keeps two states),
``sow`` / ``sow_cond`` in every mode (and sows of another tag), and
``lax.scan`` (incl. ``reverse=True`` and length 0), ``fori_loop`` with traced
bounds, ``while_loop`` whose cond reads state (and may sow, and may write a
typed state: one run more than the body), ``cond``,
``switch``, ``jax.jit``, ``jax.checkpoint``, custom_jvp / custom_vjp functions
(whose rule / fwd may bump typed states and draw keys itself before calling
the function, and a custom_jvp rule sow: ``CustomJvp.rule``),
``lax.custom_root`` and equinox's
checkpointed ``while_loop`` (each called once or twice) nested up to depth 4. Every op keeps values in [-2, 2] and is 1-Lipschitz.

Each program has two interpreters:

* ``to_source(program)`` renders it as Python source using raw JAX control
  flow, ``tx.get_state`` / ``tx.set_state`` and ``h.sow``; the JAX side
  ``exec``s exactly that source, so a failing (shrunk) program prints as the
  code that failed (in the exception's note and as hypothesis' "Draw 1");
* ``Reference`` runs the AST eagerly in float64 NumPy with Python control
  flow, a dict for states keyed by full names (inside ``tx.scope`` the
  scopes prefix the name, "sa/s0"; compared with ``uncurry``'s dict nested
  by scope, flattened; a pytree state is stored as its pytree) (a state's
  initial value is its ``init`` at first
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
  the function, as JAX runs it: its rule statements, then its body (a
  rule's sows are reaped only then).

The checks (one test each; ``_long`` variants for the long profile):
``uncurry`` (state0; ``pure(state0)`` not jitted, with ``check_jaxpr`` of the
rewritten jaxprs; ``pure(other state)`` jitted or not), ``reap`` (of the pure
function, or ``uncurry`` of a reaping function; with allow/blocklists),
``harvest``/``plant`` (random plants of every mode), ``vmap`` of ``pure`` and
of its reap over two states/argument sets, derivatives (``jvp``, and ``grad``
without while loops, of pure / reap / plant against finite differences of the
reference, w.r.t. the arguments and the float32 states ``s0 s1 sv`` and the
pytree states' float leaves, in every scope: typed
states are carried, not differentiated; with stateful custom rules, jvp / vjp
of pure, of its reap and of its harvest, and ``value_and_grad`` inside
(reaped and harvested where a rule sows), outputs, states and reaps against
the differentiated reference), ``reap`` of the raw stateful
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

The fuzzer is the package ``tests/fuzz``: ``model`` (the AST), ``render``
(``to_source``), ``analysis``, ``reference`` (``Reference``), ``strategies``
(the generator), ``checks``, ``cases``, ``profiles`` and ``nests``; this
module holds the tests.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, strategies as st
from jax import lax

import taxpr as tx
from taxpr import harvest as h

from fuzz import checks as fuzz_checks
from fuzz.analysis import blocks, insert, rule_sows, sow_names, walk
from fuzz.cases import (_as_users_run_case, _derivative_case, _disable_jit_case,
                        _grad_inside_case, _harvest_case, _raw_case, _reap_case,
                        _tx_grad_inside_case, _uncurry_case, _vmap_case, _vmap_inside_case)
from fuzz.checks import (VIOLATIONS, assert_dict_close, assert_outs_close, check_derivatives,
                         check_grad_inside, check_harvest, check_reap,
                         check_stateful_rules_differentiated, check_uncurry, check_vmap,
                         derivative_modes, perturb, reference,
                         run_check)
from fuzz.model import (FUNCTIONS, PYTREE_STATES, RNG, T, TYPED_DTYPES, TYPED_OPS, TYPED_STATES,
                        Assign, Bump, CustomJvp, CustomVjp, EqxLoop, Program, Sow, Un, Var)
from fuzz.nests import (AROUND_NESTS, FWD_SOW_NESTS, GRAD_INSIDE_NESTS, LIBRARY_NESTS,
                        RULE_NESTS, RULE_SOW_NESTS, RULE_SOW_PLANTS, SCOPE_NESTS, TYPED_NESTS)
from fuzz.profiles import (LONG, LONG_EXAMPLES, SHARES, _seeded, _seeded_long, ci_settings,
                           long_settings)
from fuzz.render import build
from fuzz.strategies import ARGS, ARGS2, programs


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
@ci_settings(SHARES["tx_grad_inside"])
@given(st.data())
def test_tx_value_and_grad_inside_matches_reference(data):
    _tx_grad_inside_case(data)


@_seeded
@ci_settings(SHARES["raw"])
@given(st.data())
def test_raw_reap_matches_reference(data):
    _raw_case(data)


# ---- static rules: one violation inserted into a valid program -----------------------

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
test_long_tx_grad_inside = _long_test(_tx_grad_inside_case, "tx_grad_inside")
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
# inside the trace, extra state entries (render.to_source_hoisted)
# ---------------------------------------------------------------------------------

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


# ---- fixed programs through every primitive and library operation (fuzz.nests) ------

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


@pytest.mark.parametrize("nest", sorted(RULE_SOW_NESTS))
def test_custom_jvp_rules_that_sow_match_reference(nest):
    """Sows in custom_jvp rules happen where JAX runs the rule: differentiated
    from outside (jvp and vjp of ``call_and_reap(pure)`` and of
    ``harvest(pure)`` planting every name, the rules' too) and inside
    (reap and harvest of ``value_and_grad`` in the uncurried function) the
    outputs, states and reaps are ``Reference(diff=True)``'s: the rules'
    names reaped (in program order, derivative zero), a planted one not;
    undifferentiated (uncurry, reap, harvest, vmap) no rule runs and the
    names only rules sow are absent."""
    _check_rule_sows(RULE_SOW_NESTS[nest])


@pytest.mark.parametrize("nest", sorted(FWD_SOW_NESTS))
def test_custom_vjp_fwds_that_sow_match_reference(nest):
    """Sows in custom_vjp fwds, as custom_jvp rules' (``_check_rule_sows``):
    reaped (after the function's own sows, derivative zero) and planted (a
    residual the bwd reads, planted) where JAX differentiates the call (vjp
    of ``call_and_reap(pure)`` / ``harvest(pure)``, reap and harvest of
    ``value_and_grad`` in the uncurried function), absent undifferentiated,
    where the fwd does not run."""
    _check_rule_sows(FWD_SOW_NESTS[nest])


def _check_rule_sows(program):
    """The checks of the programs whose rules (or fwds) sow: every one, on
    both fixed arguments, planting ``RULE_SOW_PLANTS``."""
    in_rules = {s.name for s in rule_sows(program)}
    plants = {k: np.asarray(v, np.float32) for k, v in RULE_SOW_PLANTS.items()
              if k in sow_names(program, rules=True)}
    assert in_rules and in_rules <= set(plants)
    for args in (ARGS, ARGS2):
        check_uncurry(program, args, ARGS2, jit=False)
        check_reap(program, args, jit=False, compose="reap(pure)", filt=(None, ()))
        check_harvest(program, args, 0, jit=True)
        pure, state0 = tx.uncurry(build(program), *args)
        state = perturb(state0)
        for variant in ("pure", "reap", "plant"):
            check_stateful_rules_differentiated(program, pure, state, args,
                                                *derivative_modes(program), variant=variant,
                                                plants=plants)
        assert check_grad_inside(program, args) == "value and states"
        plain, ran = (reference(program, args, state, diff=d)[3] for d in (False, True))
        assert not in_rules & set(plain) and in_rules <= set(ran)
    check_vmap(program, ARGS, ARGS2, with_reap=True)


@pytest.mark.parametrize("nest", sorted(AROUND_NESTS))
def test_rule_sows_around_the_function_match_reference(nest):
    """A rule's (or fwd's) sows of names its function sows too, before and
    after its call of the function: differentiated from outside (vjp and,
    without a custom_vjp, jvp of ``pure``, ``call_and_reap(pure)`` and
    ``harvest(pure)`` planting every name) and inside (reap of
    ``value_and_grad`` in the uncurried function), the last sow JAX runs is
    reaped, as ``Reference(diff=True)``: the rule's own after sow, else the
    function's; undifferentiated, the function's."""
    program = AROUND_NESTS[nest]
    plants = {k: np.asarray(v, np.float32) for k, v in RULE_SOW_PLANTS.items()
              if k in sow_names(program, rules=True)}
    after = any(getattr(s, "after", 0) for s in walk(program.body))
    for args in (ARGS, ARGS2):
        check_reap(program, args, jit=False, compose="reap(pure)", filt=(None, ()))
        pure, state0 = tx.uncurry(build(program), *args)
        state = perturb(state0)
        plain, ran = (reference(program, args, state, diff=d)[3] for d in (False, True))
        # The rule's own sows after the function change what is reaped.
        assert after == any(not np.array_equal(plain[k], ran[k]) for k in plain), (plain, ran)
        for variant in ("pure", "reap", "plant"):
            check_stateful_rules_differentiated(program, pure, state, args,
                                                *derivative_modes(program), variant=variant,
                                                plants=plants)
        assert check_grad_inside(program, args) == "value and states"
    check_vmap(program, ARGS, ARGS2, with_reap=True)


def test_reap_of_grad_of_a_checkpointed_equinox_loop_that_sows():
    # jax.grad inside a harvest of a jax.checkpoint around equinox's
    # checkpointed while_loop: the checkpoint's partial evaluation splits the
    # loop with the sow; the sow runs once, as eagerly.
    eqxi = pytest.importorskip("equinox.internal")

    def program(x):
        @jax.checkpoint
        def ck(x):
            return eqxi.while_loop(
                lambda c: c[0] < 1,
                lambda c: (c[0] + 1, h.sow(jnp.sin(c[1]), tag=T, name="c", mode="clobber")),
                (jnp.int32(0), x), max_steps=1, kind="checkpointed")[1]
        return ck(x)

    x = np.float32(0.5)
    assert float(jax.grad(program)(x)) == float(jnp.cos(x))
    assert float(h.reap(jax.grad(program), tag=T)(x)["c"]) == float(jnp.sin(x))

    def counted(x):  # the same loop counting its steps in a state
        @jax.checkpoint
        def ck(x):
            def body(c):
                tx.set_state("n", tx.get_state("n", np.int32(0)) + 1)
                return c[0] + 1, jnp.sin(c[1])
            return eqxi.while_loop(lambda c: c[0] < 2, body, (jnp.int32(0), x), max_steps=2,
                                   kind="checkpointed")[1]
        return ck(x)

    pure, state0 = tx.uncurry(jax.grad(counted), x)
    g, state1 = pure(state0, x)
    assert float(g) == pytest.approx(float(jnp.cos(jnp.sin(x)) * jnp.cos(x)), rel=1e-6)
    assert int(state1["n"]) == 2


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


@pytest.mark.parametrize("nest", sorted(SCOPE_NESTS))
def test_pytree_states_and_scopes_through_every_primitive_match_reference(nest):
    """Pytree-valued states (a tuple, a dict with an int8 leaf) read, updated
    and first set in ``tx.scope`` blocks (nested, in loop bodies and
    branches) and in functions called in two scopes: uncurry (state0,
    ``pure`` from it and from another state, the rewritten jaxprs) matches
    the reference, whose flat dict prefixes each scoped state's name with
    its scopes; the derivatives (w.r.t. the pytree states' float leaves too)
    match finite differences where JAX takes them. (The fuzz tests run them
    through the other checks.)"""
    program = SCOPE_NESTS[nest]
    check_uncurry(program, ARGS, ARGS2, jit=False)
    if nest == "scan_cond_switch_jit_ckpt":
        # One jitted function object called in scopes "sa" and "sb": two states.
        _, state0 = tx.uncurry(build(program), *ARGS)
        assert {"pt", "pd"} <= set(state0["sa"]["sa"]) and {"pt", "pd"} <= set(state0["sa"]["sb"])
        check_derivatives(program, ARGS, 0, "pure")


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_stateful_custom_function_called_in_a_scope_differentiated_from_outside(kind):
    """Differentiated from outside (jax.jvp / jax.vjp of pure), a custom_jvp /
    custom_vjp function called inside tx.scope runs its rule (jax.jvp of the
    function, the fwd) in the call's scope: its body's states are the scoped
    ones, as undifferentiated (the derivative checks' programs draw such
    calls too)."""
    if kind == "custom_jvp":
        @jax.custom_jvp
        def f(x):
            tx.set_state("y", tx.get_state("y", np.int32(0)) + 1)
            return jnp.sin(x)

        f.defjvp(lambda p, t: jax.jvp(f.fun, p, t))
    else:
        @jax.custom_vjp
        def f(x):
            tx.set_state("y", tx.get_state("y", np.int32(0)) + 1)
            return jnp.sin(x)

        f.defvjp(lambda x: (f.fun(x), x), lambda x, ct: (jnp.cos(x) * ct,))

    def program(x):
        with tx.scope("a"):
            return f(x)

    x = np.float32(1.0)
    pure, state0 = tx.uncurry(program, x)
    assert int(pure(state0, x)[1]["a"]["y"]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tx.StateNotUncurriedWarning)
        if kind == "custom_jvp":
            (_, state1), _ = jax.jvp(lambda x: pure(state0, x), (x,), (x,))
        else:
            (_, state1), _ = jax.vjp(lambda x: pure(state0, x), x)
    assert int(state1["a"]["y"]) == 1


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
    "check_tx_grad_inside": (test_tx_value_and_grad_inside_matches_reference,),
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
    keys themselves, and custom_jvp rules that sow (also names sown outside
    rules), which the derivative checks run differentiated from outside and
    inside, and custom_vjp fwds that sow, differentiated inside; pytree
    states and tx.scope blocks in every kind of body, functions called in
    two scopes, and rules of functions in scopes, differentiated. The tests
    draw the same programs again (derandomized), checking none."""
    # run_check reads and records these in its own module.
    _CHECKED, _GENERATED = collections.Counter(), set()
    monkeypatch.setattr(fuzz_checks, "_DRAW_ONLY", True)
    monkeypatch.setattr(fuzz_checks, "_CHECKED", _CHECKED)
    monkeypatch.setattr(fuzz_checks, "_GENERATED", _GENERATED)
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
    # custom_jvp rules that sow, run differentiated from outside and inside;
    # custom_vjp fwds that sow, inside (the CI profile's derivative programs
    # whose custom_vjp fwds sow hold while loops, which reverse mode does not
    # take; test_custom_vjp_fwds_that_sow_match_reference differentiates
    # fixed ones from outside).
    wanted = {*((c, "CustomJvp") for c in checks), ("check_grad_inside", "CustomVjp")}
    missing = {(c, cls) for c, cls in wanted if f"{c}: rule Sow in {cls}" not in _GENERATED}
    assert not missing, f"no rule sows differentiated in {sorted(missing)}"
    # ... some of them of names the program also sows outside rules.
    shared = {c for c in checks for cls in classes
              if f"{c}: rule Sow of a name sown outside rules in {cls}" in _GENERATED}
    assert shared == set(checks), f"rule sows of names sown outside rules only in {shared}"
    # (Rule sows around the function's call of names it sows, differentiated:
    # test_rule_sows_around_the_function_match_reference.)
    # Pytree-valued states, both of them read, updated and first set, in
    # every kind of body (at any depth) and in custom rules; tx.scope blocks
    # in scopes, scans, branches, jitted and checkpointed functions, and
    # jitted and checkpointed functions called in two scopes (of the while
    # and fori loops and the custom functions, which ones depends on the
    # draws: some).
    want = ({f"pytree_state {s} {op}" for s in PYTREE_STATES for op in ("get", "update", "set")}
            | {f"pytree_state under {c}" for c in (*TYPED_CONTEXTS[1:], "Scope")}
            | {f"Scope under {c}" for c in ("Scope", "Scan", "Cond", "Switch", "Jit", "Ckpt")}
            | {"Jit called in two scopes", "Ckpt called in two scopes"}
            | {f"rule Tree in {cls}" for cls in classes})
    assert not want - _GENERATED, f"never generated: {sorted(want - _GENERATED)}"
    # Rules of functions called in a tx.scope (which run in it), differentiated.
    missing = {c for c in checks if f"{c}: rule statements in a tx.scope" not in _GENERATED}
    assert not missing, f"no rule statements in a scope differentiated in {sorted(missing)}"
    custom = ("CustomJvp", "CustomVjp", "Root", "EqxLoop")
    for some in ([f"Scope under {c}" for c in ("Fori", "While")],
                 [f"Scope under {c}" for c in custom],
                 [f"{c} called in two scopes" for c in custom]):
        assert set(some) & _GENERATED, f"none of {some} generated"


def test_the_long_profile_runs_the_requested_number_of_programs_in_all():
    # TAXPR_FUZZ_EXAMPLES=N is the number of programs of the whole long
    # profile (its tests share it), not a number per test.
    long_tests = [v for k, v in globals().items() if k.startswith("test_long_")]
    counts = [t._hypothesis_internal_use_settings.max_examples for t in long_tests]
    assert len(long_tests) == 11
    assert LONG_EXAMPLES <= sum(counts) < LONG_EXAMPLES + len(long_tests)

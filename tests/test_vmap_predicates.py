"""vmap with a per-example (batched) predicate for cond / while_loop.

JAX runs every branch (every loop iteration while any example runs) for
every example; taxpr guards the tags there so that effects happen only for
the examples that take the branch / iteration (eager semantics, compared
with per-example eager runs), or raises a clear error where the result has
no per-example meaning (an unbatched state or ctx changed per example).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun

import taxpr as tx
from taxpr import harvest as h

from helpers import check

XS = jnp.array([-1.0, 2.0, -3.0, 4.0])
NEG = jnp.array([-1.0, -2.0, -3.0, -4.0])


def per_example_reap(fn, xs, **kw):
    """The eager reference: reap each example on its own, stacked."""
    rows = [h.reap(fn, tag="t", **kw)(x) for x in xs]
    return jax.tree_util.tree_map(lambda *r: jnp.stack(r), *rows)


def assert_tree_close(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


# ---- state ------------------------------------------------------------------------

def counter_in_branch(x):
    def inc(x):
        tx.set_state("n", tx.get_state("n", jnp.int32(0)) + 1)
        return x + 1
    return jax.lax.cond(x > 0, inc, lambda x: x, x)


def test_set_state_in_batched_cond_branch_is_a_state_error():
    with pytest.raises(tx.StateError) as e:
        tx.uncurry(jax.vmap(counter_in_branch), XS)
    msg = str(e.value)
    assert "'n'" in msg and "cond[branch=1]" in msg and "batched by vmap" in msg


def test_set_state_in_batched_cond_is_an_error_even_when_no_example_takes_it():
    # Eagerly no example would increment n; the pure function cannot know
    # that at trace time, so it refuses instead of counting the untaken branch.
    with pytest.raises(tx.StateError, match="batched by vmap"):
        tx.make_jaxpr(jax.vmap(counter_in_branch))(NEG)


def test_set_state_in_cond_with_unbatched_predicate_under_vmap_counts_once():
    def f(x, flag):
        def inc(x):
            tx.set_state("n", tx.get_state("n", jnp.int32(0)) + 1)
            return x + 1
        return jax.lax.cond(flag > 0, inc, lambda x: x, x)

    g = jax.vmap(f, in_axes=(0, None))
    pure, s0 = tx.uncurry(g, XS, 1.0)
    for flag, want in ((1.0, 1), (-1.0, 0)):
        out, s1 = pure(s0, XS, flag)
        assert int(s1["n"]) == want
        np.testing.assert_allclose(out, XS + want)


def read_in_branch(x):
    def pos(x):
        return x + tx.get_state("w", lambda: jnp.float32(2.0))
    return jax.lax.cond(x > 0, pos, lambda x: x - 1.0, x)


def test_get_state_in_batched_cond_branch_reads_the_state():
    pure, s0 = tx.uncurry(jax.vmap(read_in_branch), XS)
    assert float(s0["w"]) == 2.0
    out, s1 = jax.jit(pure)({"w": jnp.float32(10.0)}, XS)
    want = [x + 10.0 if x > 0 else x - 1.0 for x in XS.tolist()]
    np.testing.assert_allclose(out, want)
    assert float(s1["w"]) == 10.0


def test_state_read_only_in_batched_branch_no_example_takes_gets_its_init():
    # The init run (on the example arguments) never reaches the read: the
    # state starts at its concrete init, as when vmap is not involved.
    pure, s0 = tx.uncurry(jax.vmap(read_in_branch), NEG)
    assert float(s0["w"]) == 2.0
    out, _ = pure(s0, XS)
    np.testing.assert_allclose(out, [x + 2.0 if x > 0 else x - 1.0 for x in XS.tolist()])


def while_reading_state(x):
    def body(c):
        return c + tx.get_state("step", jnp.float32(1.0))
    return jax.lax.while_loop(lambda c: c < x, body, 0.0)


def test_while_with_batched_predicate_reads_state_in_body():
    # Before: an invalid jaxpr (bare AssertionError at lowering).
    pure, s0 = tx.uncurry(jax.vmap(while_reading_state), XS)
    xs = jnp.array([1.0, 3.0, 0.0, 5.5])
    for fn in (pure, jax.jit(pure)):
        out, s1 = fn({"step": jnp.float32(2.0)}, xs)
        want = []
        for x in xs.tolist():
            c = 0.0
            while c < x:
                c += 2.0
            want.append(c)
        np.testing.assert_allclose(out, want)
        assert float(s1["step"]) == 2.0


def test_set_state_in_body_of_while_with_batched_predicate_is_a_state_error():
    def f(x):
        def body(c):
            tx.set_state("k", tx.get_state("k", jnp.int32(0)) + 1)
            return c + 1.0
        return jax.lax.while_loop(lambda c: c < x, body, 0.0)

    with pytest.raises(tx.StateError) as e:
        tx.uncurry(jax.vmap(f), XS)
    assert "'k'" in str(e.value) and "while[body]" in str(e.value)


def test_while_with_unbatched_predicate_under_vmap_sets_state_per_iteration():
    def f(x, n):
        def body(c):
            tx.set_state("k", tx.get_state("k", jnp.int32(0)) + 1)
            return c + x
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[1])),
                                  (0, 0.0))[1]

    pure, s0 = tx.uncurry(jax.vmap(f, in_axes=(0, None)), XS, 3)
    out, s1 = pure(s0, XS, 3)
    assert int(s1["k"]) == 3
    np.testing.assert_allclose(out, 3 * XS)


def test_state_read_in_cond_of_while_with_batched_predicate():
    def f(x):
        return jax.lax.while_loop(lambda c: c < x * tx.get_state("scale", jnp.float32(1.0)),
                                  lambda c: c + 1.0, 0.0)

    pure, s0 = tx.uncurry(jax.vmap(f), XS)
    out, _ = jax.jit(pure)({"scale": jnp.float32(2.0)}, XS)
    want = [float(np.ceil(max(2 * x, 0.0))) for x in XS.tolist()]
    np.testing.assert_allclose(out, want)


# ---- harvest ----------------------------------------------------------------------

def sow_in_both_branches(x):
    return jax.lax.cond(x > 0,
                        lambda x: h.sow(x * 2, tag="t", name="a", mode="clobber"),
                        lambda x: h.sow(x * 3, tag="t", name="a", mode="clobber"), x)


def test_reap_clobber_in_batched_cond_is_the_taken_branchs_value():
    got = h.reap(jax.vmap(sow_in_both_branches), tag="t")(XS)
    assert_tree_close(got, per_example_reap(sow_in_both_branches, XS))
    np.testing.assert_allclose(got["a"], [-3.0, 4.0, -9.0, 8.0])


def test_reap_clobber_in_one_batched_branch_keeps_the_earlier_value():
    # (oryx rejects an unbatched cond whose branches sow differently; a
    # batched one is not checked and keeps the earlier value per example.)
    def f(x):
        h.sow(x, tag="t", name="a", mode="clobber")
        return jax.lax.cond(x > 0, lambda x: h.sow(x * 10, tag="t", name="a", mode="clobber"),
                            lambda x: x, x)

    got = h.reap(jax.vmap(f), tag="t", )(XS)
    np.testing.assert_allclose(got["a"], [-1.0, 20.0, -3.0, 40.0])


def test_reap_cond_clobber_in_batched_cond():
    def f(x):
        def pos(x):
            h.sow_cond(x * 2, x > 3, tag="t", name="a")
            return x
        def neg(x):
            h.sow_cond(x * 5, x < -2, tag="t", name="a")
            return x
        return jax.lax.cond(x > 0, pos, neg, x)

    got = h.reap(jax.vmap(f), tag="t")(XS)
    assert_tree_close(got, per_example_reap(f, XS))
    np.testing.assert_allclose(got["a"], [0.0, 0.0, -15.0, 8.0])


def test_reap_clobber_in_body_of_while_with_batched_predicate_is_last_real_iteration():
    def f(x):
        def body(c):
            h.sow(c * 10, tag="t", name="last", mode="clobber")
            return c + 1.0
        return jax.lax.while_loop(lambda c: c < x, body, 0.0)

    got = h.reap(jax.vmap(f), tag="t")(XS)
    assert_tree_close(got, per_example_reap(f, XS))
    np.testing.assert_allclose(got["last"], [0.0, 10.0, 0.0, 30.0])


def test_reap_clobber_in_cond_of_while_with_batched_predicate_is_last_check():
    def f(x):
        def cond(c):
            h.sow(c, tag="t", name="checked", mode="clobber")
            return c < x
        return jax.lax.while_loop(cond, lambda c: c + 1.0, 0.0)

    got = h.reap(jax.vmap(f), tag="t")(XS)
    assert_tree_close(got, per_example_reap(f, XS))
    np.testing.assert_allclose(got["checked"], [0.0, 2.0, 0.0, 4.0])


def test_plant_in_batched_cond_replaces_the_value_in_the_taken_branch():
    planted = h.plant(jax.vmap(sow_in_both_branches), tag="t")({"a": jnp.full(4, 7.0)}, XS)
    np.testing.assert_allclose(planted, 7.0)


def test_append_sow_in_batched_cond_is_a_clear_error():
    def f(x):
        return jax.lax.cond(x > 0, lambda x: h.sow(x, tag="t", name="a", mode="append"),
                            lambda x: h.sow(-x, tag="t", name="a", mode="append"), x)

    with pytest.raises(ValueError) as e:
        h.reap(jax.vmap(f), tag="t")(XS)
    assert "'a'" in str(e.value) and "batched by vmap" in str(e.value)


def test_reap_of_unbatched_sow_in_batched_branch_is_a_clear_error():
    def f(x):
        return jax.lax.cond(x > 0, lambda x: x + h.sow(1.0, tag="t", name="one", mode="clobber"),
                            lambda x: x + h.sow(2.0, tag="t", name="one", mode="clobber"), x)

    with pytest.raises(ValueError, match="does not batch"):
        h.reap(jax.vmap(f), tag="t")(XS)


# ---- inject -----------------------------------------------------------------------

def count(ctx, token, params):
    return token, ctx + 1


def test_counting_injector_in_batched_cond_is_an_inject_error():
    def f(x):
        return jax.lax.cond(x > 0, lambda x: tx.tag(x, op="hit"), lambda x: x, x)

    closed = jax.make_jaxpr(jax.vmap(f))(XS)
    with pytest.raises(tx.InjectError) as e:
        tx.inject(closed, count, jnp.int32(0))
    msg = str(e.value)
    assert "op='hit'" in msg and "cond[branch=1]" in msg and "batched by vmap" in msg


def test_reading_injector_in_batched_cond_gives_the_eager_result():
    def f(x):
        return jax.lax.cond(x > 0, lambda x: tx.tag(x, op="scale") * 2, lambda x: x, x)

    closed = jax.make_jaxpr(jax.vmap(f))(XS)
    new = tx.inject(closed, lambda ctx, tok, p: (tok * ctx, ctx), jnp.float32(3.0))
    check(new)
    out, ctx = jaxpr_as_fun(new)(jnp.float32(3.0), XS)
    np.testing.assert_allclose(out, [x * 6 if x > 0 else x for x in XS.tolist()])
    assert float(ctx) == 3.0


def test_counting_injector_in_cond_with_unbatched_predicate_under_vmap():
    def f(x, flag):
        return jax.lax.cond(flag, lambda x: tx.tag(x, op="hit"), lambda x: x, x)

    closed = jax.make_jaxpr(jax.vmap(f, in_axes=(0, None)))(XS, True)
    new = tx.inject(closed, count, jnp.int32(0))
    for flag, want in ((True, 1), (False, 0)):
        _, n = jaxpr_as_fun(new)(jnp.int32(0), XS, flag)
        assert int(n) == want


# ---- the guard survives transformations and nesting --------------------------------

def test_guarded_tags_are_found_with_their_value_shape_and_dissolve():
    closed = jax.make_jaxpr(jax.vmap(read_in_branch))(XS)
    check(closed)
    (site,) = [s for s in tx.find_tags(closed)]
    assert site.shape.shape == ()  # the unbatched init; the guard is not part of it
    bare = tx.dissolve_tags(closed)
    check(bare)
    assert list(tx.iter_tags(bare)) == []
    np.testing.assert_allclose(jaxpr_as_fun(bare)(XS)[0], jaxpr_as_fun(closed)(XS)[0])
    assert "guard" in str(closed)  # printed as a hidden param naming the branch


def test_nested_batched_conds_combine_guards():
    def f(x):
        def outer(x):
            return jax.lax.cond(x > 3, lambda x: h.sow(x, tag="t", name="a", mode="clobber"),
                                lambda x: h.sow(x * 100, tag="t", name="a", mode="clobber"), x)
        h.sow(-x, tag="t", name="a", mode="clobber")
        return jax.lax.cond(x > 0, outer,
                            lambda x: h.sow(x * 10, tag="t", name="a", mode="clobber"), x)

    got = h.reap(jax.vmap(f), tag="t")(XS)
    assert_tree_close(got, per_example_reap(f, XS))
    np.testing.assert_allclose(got["a"], [-10.0, 200.0, -30.0, 4.0])


def test_batched_cond_inside_batched_while():
    def f(x):
        def body(c):
            c = jax.lax.cond(c > 1, lambda c: h.sow(c, tag="t", name="a", mode="clobber") + 1,
                             lambda c: h.sow(-c, tag="t", name="a", mode="clobber") * 0 + c + 1,
                             c)
            return c
        return jax.lax.while_loop(lambda c: c < x, body, 0.0)

    got = h.reap(jax.vmap(f), tag="t")(XS)
    assert_tree_close(got, per_example_reap(f, XS))


def test_scan_inside_batched_cond():
    def f(x):
        def run(x):
            return jax.lax.scan(lambda c, _: (h.sow(c * 2, tag="t", name="a", mode="clobber"),
                                              None), x, None, length=3)[0]
        return jax.lax.cond(x > 0, run, lambda x: h.sow(-x, tag="t", name="a", mode="clobber"), x)

    got = h.reap(jax.vmap(f), tag="t")(XS)
    assert_tree_close(got, per_example_reap(f, XS))


def test_guard_survives_jit_checkpoint_and_scan_around_vmap():
    def f(x):
        return jax.lax.cond(x > 0, lambda x: jax.jit(jax.checkpoint(
            lambda x: h.sow(x * 2, tag="t", name="a", mode="clobber")))(x),
            lambda x: h.sow(x, tag="t", name="a", mode="clobber"), x)

    want = per_example_reap(f, XS)
    got = h.reap(jax.jit(jax.vmap(f)), tag="t")(XS)
    assert_tree_close(got, want)

    def scanned(xs):
        return jax.lax.scan(lambda c, x: (c + jax.vmap(f)(x).sum(), None), 0.0, xs)[0]

    rows = jnp.stack([XS, -XS])
    got = h.reap(scanned, tag="t")(rows)
    assert_tree_close(got, per_example_reap(f, -XS))  # the last iteration's reap


def test_guard_survives_grad_of_the_vmapped_function():
    def f(w, x):
        def pos(x):
            return x * w * tx.get_state("s", jnp.float32(3.0))
        return jax.lax.cond(x > 0, pos, lambda x: x * w, x)

    def loss(w, xs):
        return jax.vmap(f, in_axes=(None, 0))(w, xs).sum()

    g = lambda w, xs: jax.grad(loss)(w, xs)  # noqa: E731
    pure, s0 = tx.uncurry(g, 1.0, XS)
    grad, _ = pure({"s": jnp.float32(5.0)}, 1.0, XS)
    want = sum(x * 5.0 if x > 0 else x for x in XS.tolist())
    np.testing.assert_allclose(grad, want, rtol=1e-6)

    def reaped(w, xs):
        return jax.grad(lambda w: jax.vmap(lambda x: jax.lax.cond(
            x > 0, lambda x: h.sow(x * w, tag="t", name="a", mode="clobber"),
            lambda x: h.sow(-x * w, tag="t", name="a", mode="clobber"), x))(xs).sum())(w)

    got = h.reap(reaped, tag="t")(2.0, XS)
    np.testing.assert_allclose(got["a"], [2.0, 4.0, 6.0, 8.0])


def test_vmap_of_vmap_with_batched_predicates():
    xs = jnp.stack([XS, -XS + 0.5, XS * 2])
    got = h.reap(jax.vmap(jax.vmap(sow_in_both_branches)), tag="t")(xs)
    want = jnp.stack([per_example_reap(sow_in_both_branches, row)["a"] for row in xs])
    np.testing.assert_allclose(got["a"], want)

    def inner_batched_outer_not(x, flag):
        return jax.lax.cond(flag > 0, lambda x: jax.vmap(sow_in_both_branches)(x),
                            lambda x: x, x)

    got = h.reap(jax.vmap(inner_batched_outer_not, in_axes=(0, 0)), tag="t")(
        xs, jnp.array([1.0, -1.0, 1.0]))
    assert got["a"].shape == xs.shape
    np.testing.assert_allclose(got["a"][0], per_example_reap(sow_in_both_branches, xs[0])["a"])
    np.testing.assert_allclose(got["a"][2], per_example_reap(sow_in_both_branches, xs[2])["a"])
    np.testing.assert_allclose(got["a"][1], 0.0)  # never sown for that example


def test_vmap_with_batched_predicate_and_no_tags_is_jaxs_own_rule():
    def f(x):
        return jax.lax.cond(x > 0, jnp.sin, jnp.cos, x)

    a = jax.make_jaxpr(jax.vmap(f))(XS)
    np.testing.assert_allclose(jaxpr_as_fun(a)(XS)[0], jnp.where(XS > 0, jnp.sin(XS), jnp.cos(XS)))


def test_transpose_of_a_tag_in_batched_branch_is_an_error():
    def f(x):
        return jax.lax.cond(x > 0, lambda x: tx.tag(x, name="b"), lambda x: x, x)

    with pytest.raises(ValueError, match="batched by vmap"):
        tx.transpose(jax.make_jaxpr(jax.vmap(f))(XS))


def test_switch_inside_while_with_batched_predicate_reaps_the_taken_case():
    def f(x):
        def body(c):
            cases = [lambda c, k=k: h.sow(c * 10.0 ** k, tag="t", name="s", mode="clobber") + 1
                     for k in range(3)]
            return jax.lax.switch(jnp.int32(c) % 3, cases, c)
        return jax.lax.while_loop(lambda c: c < x, body, 0.0)

    got = h.reap(jax.vmap(f), tag="t")(XS)
    assert_tree_close(got, per_example_reap(f, XS))
    np.testing.assert_allclose(got["s"], [0.0, 10.0, 0.0, 10.0])  # JAX alone: 100 (case 2)


def test_grad_of_a_sowing_custom_jvp_in_a_cond_with_a_batched_predicate_matches_eager():
    # Failed in JAX's linearization before (the guarded call kept its tags
    # staged), then on a float0 tangent (the guard) in the threaded rule.
    from jax import lax

    def body(x):
        return h.sow(x, tag="t", name="a", mode="clobber") * 2.0

    fn = jax.custom_jvp(body)
    fn.defjvp(lambda p, t: jax.jvp(body, p, t))

    def g(x):
        return lax.cond(x > 0, fn, lambda x: h.sow(x, tag="t", name="a", mode="clobber") * 3.0, x)

    xs = jnp.array([1.0, -1.0, 2.0], jnp.float32)
    want = [2.0 if x > 0 else 3.0 for x in xs.tolist()]  # eagerly, per example
    np.testing.assert_allclose(jax.vmap(jax.grad(g))(xs), want)
    np.testing.assert_allclose(
        jax.vmap(jax.grad(lambda x: h.call_and_reap(g, tag="t")(x)[0]))(xs), want)
    np.testing.assert_allclose(
        jax.grad(lambda xs: h.call_and_reap(jax.vmap(g), tag="t")(xs)[0].sum())(xs), want)
    out, reaps = h.call_and_reap(jax.vmap(g), tag="t")(xs)
    np.testing.assert_allclose(reaps["a"], xs)


def test_reap_of_vmap_whose_branches_sow_batched_and_unbatched_values_is_a_clear_error():
    # reap outside the vmap: one branch sows a value vmap batches, the other
    # one it does not (the predicate is not batched). The reaped value has no
    # single type; the error says why and what to do.
    from jax import lax

    def f(x, c):
        return lax.cond(c > 0, lambda x: h.sow(x * 2, tag="t", name="a", mode="clobber"),
                        lambda x: h.sow(c, tag="t", name="a", mode="clobber") + x, x)

    xs = jnp.array([1.0, 2.0], jnp.float32)
    with pytest.raises(ValueError, match=r"^Mismatched shape between branches: 'a'\. vmap "
                                         r"batches the sown value in one branch and not"):
        h.call_and_reap(jax.vmap(f, in_axes=(0, None)), tag="t")(xs, jnp.float32(1.0))
    # reaped inside the vmap: per example, as eagerly
    out, reaps = jax.vmap(h.call_and_reap(f, tag="t"), in_axes=(0, None))(xs, jnp.float32(1.0))
    np.testing.assert_allclose(out, 2 * xs)
    np.testing.assert_allclose(reaps["a"], 2 * xs)


@pytest.mark.parametrize("n", [0, 1])
def test_reap_of_vmap_of_a_sow_cond_whose_predicate_alone_is_batched_is_per_example(n):
    # reap outside the vmap: sow_cond of a value vmap does not batch, under a
    # predicate it does. Per example the reap is that example's value where
    # its predicate held (cond_clobber), so the reaped value is batched in
    # both branches of the unbatched cond (the ctx takes the value's batched
    # type, so the threaded program is valid).
    from jax import lax

    def f(x, c, n):
        return lax.cond(n % 2 == 0,
                        lambda x: h.sow_cond(jnp.float32(3.0), x > 0.1, tag="t", name="q"),
                        lambda x: h.sow_cond(c, x > 0.1, tag="t", name="q"), x)

    xs = jnp.array([0.5, -1.0, 2.0], jnp.float32)
    c = jnp.float32(5.0)
    out, reaps = h.call_and_reap(jax.vmap(f, in_axes=(0, None, None)), tag="t")(xs, c, n)
    want = per_example_reap(lambda x: f(x, c, n), xs)
    assert set(reaps) == {"q"} and set(want) == {"q"}
    np.testing.assert_array_equal(reaps["q"], want["q"])
    np.testing.assert_array_equal(reaps["q"], [3.0 if n == 0 else 5.0, 0.0, 3.0 if n == 0 else 5.0])
    np.testing.assert_array_equal(out, jnp.stack([f(x, c, n) for x in xs]))


def test_reap_of_vmap_of_a_switch_sowing_per_example_and_shared_values_is_a_clear_error():
    # Three branches: a batched value, an unbatched value under a batched
    # predicate (per example: batched too) and an unbatched value under an
    # unbatched predicate. The third has no per-example type; the error says
    # it is about vmap.
    from jax import lax

    def f(x, c, n):
        return lax.switch(n % 3, (
            lambda x: h.sow_cond(x, x > 0.1, tag="t", name="q"),
            lambda x: h.sow_cond(c, x > 0.1, tag="t", name="q"),
            lambda x: h.sow_cond(jnp.float32(1.0), n % 2 == 0, tag="t", name="q") + x), x)

    xs = jnp.array([0.5, -1.0], jnp.float32)
    c = jnp.float32(5.0)
    with pytest.raises(ValueError, match=r"^Mismatched shape between branches: 'q'\. vmap "
                                         r"batches the sown value in one branch and not"):
        h.call_and_reap(jax.vmap(f, in_axes=(0, None, None)), tag="t")(xs, c, 0)
    out, reaps = jax.vmap(h.call_and_reap(f, tag="t"), in_axes=(0, None, None))(xs, c, 1)
    np.testing.assert_array_equal(reaps["q"], [5.0, 0.0])


def _append_batched_then_unbatched(x, c):
    h.sow(x * 2, tag="t", name="a", mode="append")
    h.sow(c, tag="t", name="a", mode="append")
    return x


def _clobber_batched_in_a_jitted_while_then_unbatched(x, c):
    from jax import lax

    @jax.jit
    def j(x, c):
        def cond(k):
            h.sow(x, tag="t", name="a", mode="clobber")
            return k < 2
        lax.while_loop(cond, lambda k: k + 1, 0)
        h.sow(c, tag="t", name="a", mode="clobber")
        return x
    return j(x, c)


@pytest.mark.parametrize("f, want", [
    (_append_batched_then_unbatched, [[2.0, 5.0], [4.0, 5.0]]),
    (_clobber_batched_in_a_jitted_while_then_unbatched, [5.0, 5.0])])
def test_reap_of_vmap_of_sows_of_batched_and_unbatched_values_of_one_name_is_a_clear_error(f, want):
    # reap outside the vmap: one name sown with a value vmap batches and with
    # one it does not; the reap has no single type (a clear ValueError for
    # append and for clobber through a jitted while). Per example (inside the vmap) it
    # is what eager gives.
    xs = jnp.array([1.0, 2.0], jnp.float32)
    c = jnp.float32(5.0)
    with pytest.raises(ValueError, match=r"^Mismatched shape between sows: 'a'\. vmap "
                                         r"batches the sown value in one sow and not"):
        h.call_and_reap(jax.vmap(f, in_axes=(0, None)), tag="t")(xs, c)
    _, reaps = jax.vmap(h.call_and_reap(f, tag="t"), in_axes=(0, None))(xs, c)
    np.testing.assert_array_equal(reaps["a"], want)
    np.testing.assert_array_equal(h.reap(f, tag="t")(xs[1], c)["a"], want[1])  # eagerly


def test_reap_of_vmap_of_a_strict_sow_in_both_branches_of_a_batched_cond_says_why():
    # vmap runs both branches of a cond whose predicate it batches, so a
    # strict sow in each branch is sown twice; the error says where and why.
    from jax import lax

    def f(x):
        return lax.cond(x > 0.1, lambda x: h.sow(x * 2, tag="t", name="s"),
                        lambda x: h.sow(x * 3, tag="t", name="s"), x)

    xs = jnp.array([0.5, -1.0], jnp.float32)
    with pytest.raises(ValueError, match=r"^Variable has already been reaped: s\. The sow is "
                                         r"inside cond\[branch=\d\] whose predicate is batched by "
                                         r"vmap: .* reap inside the vmap\.$"):
        h.reap(jax.vmap(f), tag="t")(xs)
    reaps = jax.vmap(h.reap(f, tag="t"))(xs)
    np.testing.assert_array_equal(reaps["s"], [1.0, -3.0])
    np.testing.assert_array_equal(h.reap(f, tag="t")(xs[0])["s"], 1.0)  # eagerly, per example


def test_a_batched_set_state_error_names_the_users_line():
    def f(xs):
        def per(x):
            tx.set_state("m", tx.get_state("m", jnp.zeros(())) + x)  # the line named
            return x
        return jax.vmap(per)(xs)

    with pytest.raises(tx.StateError) as e:
        tx.uncurry(f, jnp.ones(3))
    line = f.__code__.co_firstlineno + 2
    assert f"test_vmap_predicates.py:{line}, in " in str(e.value)
    assert "'m'" in str(e.value) and "batched by vmap" in str(e.value)
    with pytest.raises(tx.StateError) as e:
        tx.uncurry(jax.vmap(counter_in_branch), XS)
    assert "test_vmap_predicates.py:" in str(e.value) and ".inc)" in str(e.value)

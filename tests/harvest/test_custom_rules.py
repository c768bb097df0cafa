"""taxpr.harvest: sows in ``custom_jvp`` / ``custom_vjp`` functions and their rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taxpr as tx
from taxpr import harvest as h

from helpers import check
from harvest_helpers import T, allclose, assert_tree_allclose, jax_still_works, raises


# ---- custom_jvp / custom_vjp ----------------------------------------------------------

def _rule_sows(sown=lambda x: x * 2.0):
    """A custom_jvp function whose JVP rule (not its body) sows: the rule
    sows ``sown(x)`` (2x) and scales the tangent by the (possibly planted)
    sown value."""
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        s = h.sow(sown(x), tag=T, name="s")
        return jnp.sin(x), t * s

    return f, f_jvp


def test_sow_in_custom_jvp_rule_is_reaped_when_jax_differentiates_the_call():
    f, f_jvp = _rule_sows()
    (want_out, want_t) = f_jvp((2.0,), (1.0,))  # eager: the rule by hand (sow = identity)
    (out, reaps), (out_t, reaps_t) = jax.jvp(h.call_and_reap(f, tag=T), (2.0,), (1.0,))
    allclose(out, want_out)
    allclose(out_t, want_t)
    assert_tree_allclose(reaps, {"s": 4.0})  # what the rule sowed
    assert_tree_allclose(reaps_t, {"s": 0.0})  # a value sown in the rule is a constant
    # the same under jit, and with the jvp taken inside the reaped function
    (_, reaps), (_, reaps_t) = jax.jit(lambda x, t: jax.jvp(h.call_and_reap(f, tag=T), (x,),
                                                            (t,)))(2.0, 1.0)
    assert_tree_allclose((reaps, reaps_t), ({"s": 4.0}, {"s": 0.0}))
    assert_tree_allclose(h.reap(lambda x, t: jax.jvp(f, (x,), (t,)), tag=T)(2.0, 1.0),
                         {"s": 4.0})


def test_sow_in_custom_jvp_rule_with_array_constants_is_reaped():
    """A rule whose trace has constants (a NumPy array): JAX returns its jaxpr
    open with the constants apart (on JAX 0.12 as leading invars)."""
    w = np.array([1.0, 2.0], np.float32)
    f, _ = _rule_sows(lambda x: jnp.sum(x * w))
    (out, reaps), (out_t, _) = jax.jvp(h.call_and_reap(f, tag=T), (2.0,), (1.0,))
    allclose(out, np.sin(2.0))
    allclose(out_t, 6.0)  # eagerly: t * sum(x * w) = 1 * (2 + 4)
    assert_tree_allclose(reaps, {"s": 6.0})
    # looked into (not run) under vmap: the same rule, batched
    (out, reaps) = jax.vmap(h.call_and_reap(f, tag=T))(jnp.array([2.0, 3.0]))
    allclose(out, np.sin([2.0, 3.0]))
    assert reaps == {}


def test_sow_in_custom_jvp_rule_is_not_reaped_when_the_rule_does_not_run():
    f, _ = _rule_sows()
    out, reaps = h.call_and_reap(f, tag=T)(2.0)
    allclose(out, np.sin(2.0))
    assert reaps == {}  # as oryx: the rule never ran
    assert jax.jit(h.reap(f, tag=T))(2.0) == {}
    # differentiated outside a jit that holds the harvest: the rule runs
    # after the harvest returned, so the name is absent, and the derivative
    # is the rule's
    (out, reaps), (out_t, reaps_t) = jax.jvp(jax.jit(h.call_and_reap(f, tag=T)), (2.0,), (1.0,))
    assert reaps == {} and reaps_t == {}
    allclose(out_t, 4.0)  # t * s with s = 2x = 4


def test_sow_in_custom_jvp_rule_under_grad():
    f, f_jvp = _rule_sows()
    # grad linearizes: the rule runs, the reaped value has derivative zero
    def loss(x):
        out, reaps = h.call_and_reap(f, tag=T)(x)
        return out + reaps["s"]
    allclose(jax.grad(loss)(2.0), f_jvp((2.0,), (1.0,))[1])
    allclose(jax.value_and_grad(loss)(2.0)[0], np.sin(2.0) + 4.0)


def test_plant_into_custom_jvp_rule_when_differentiated():
    f, _ = _rule_sows()
    planted = lambda x: h.plant(f, tag=T)({"s": 10.0}, x)
    out, out_t = jax.jvp(planted, (2.0,), (1.0,))
    allclose(out, np.sin(2.0))
    allclose(out_t, 10.0)  # the rule's tangent uses the planted value
    allclose(jax.grad(planted)(2.0), 10.0)
    allclose(planted(2.0), np.sin(2.0))  # not differentiated: the rule never runs
    bad = lambda x: h.plant(f, tag=T)({"s": jnp.ones(2)}, x)
    raises(ValueError, r"^Planted value for 's' has type float32\[2\], but the sow at "
           r"custom_jvp\[rule\] has type float32\[\]", jax.grad(bad), 2.0)


def test_append_sow_in_custom_jvp_rule_is_a_clear_error():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (jnp.sin(p[0]),
                           t[0] * h.sow(p[0], tag=T, name="a", mode="append")))
    with pytest.raises(NotImplementedError, match=r"custom_jvp\[rule\].*'a'"):
        jax.jvp(h.call_and_reap(f, tag=T), (2.0,), (1.0,))
    jax_still_works()


@jax.custom_jvp
def _cjvp(x):
    return h.sow(jnp.sin(x), tag=T, name="s") * 2


@_cjvp.defjvp
def _cjvp_rule(primals, tangents):
    (x,), (t,) = primals, tangents
    h.sow(t * 3, tag=T, name="jvp_t")  # a tangent: linear, gone under grad (as in oryx)
    h.sow(jnp.cos(x), tag=T, name="jvp_x")  # a primal value
    return _cjvp(x), 10.0 * t  # deliberately not the true derivative


@jax.custom_vjp
def _cvjp(x):
    return h.sow(jnp.sin(x), tag=T, name="s") * 2


def _cvjp_fwd(x):
    return h.sow(jnp.sin(x) * 2, tag=T, name="fwd"), x


def _cvjp_bwd(x, g):
    return (h.sow(7.0 * g, tag=T, name="bwd"),)


_cvjp.defvjp(_cvjp_fwd, _cvjp_bwd)


@pytest.mark.parametrize("fn", [_cjvp, _cvjp], ids=["custom_jvp", "custom_vjp"])
def test_custom_rule_reap_and_rule_kept(fn):
    user_grad = 10.0 if fn is _cjvp else 7.0
    out, reaps = h.call_and_reap(fn, tag=T)(0.5)
    allclose(out, 2 * np.sin(0.5), rtol=1e-6)
    assert_tree_allclose(reaps, {"s": np.sin(0.5)})
    # user rule kept: the derivative of the reaped function's output
    allclose(jax.grad(lambda x: h.call_and_reap(fn, tag=T)(x)[0])(0.5), user_grad)
    allclose(jax.jit(jax.grad(lambda x: h.call_and_reap(fn, tag=T)(x)[0]))(0.5), user_grad)
    # plant: output is the planted value times 2; the rule still gives the gradient in x
    allclose(h.plant(fn, tag=T)({"s": 4.0}, 0.5), 8.0)
    allclose(jax.grad(lambda x: h.plant(fn, tag=T)({"s": 4.0}, x))(0.5), user_grad)
    # ... and the derivative w.r.t. the plant flows through the function body
    allclose(jax.grad(lambda p: h.plant(fn, tag=T)({"s": p}, 0.5))(4.0), 2.0)
    check(jax.make_jaxpr(h.reap(fn, tag=T))(0.5))


def test_custom_jvp_sows_in_jvp_rule_reaped():
    out, reaps = h.call_and_reap(lambda x: jax.jvp(_cjvp, (x,), (2.0,)), tag=T)(0.5)
    allclose(out[0], 2 * np.sin(0.5), rtol=1e-6)
    allclose(out[1], 20.0)
    assert_tree_allclose(reaps, {"jvp_t": 6.0, "jvp_x": np.cos(0.5), "s": np.sin(0.5)})
    out, reaps = h.call_and_reap(jax.grad(_cjvp), tag=T)(0.5)
    allclose(out, 10.0)
    # under grad the tangent sow is transposed away (oryx drops it too)
    assert_tree_allclose(reaps, {"jvp_x": np.cos(0.5), "s": np.sin(0.5)})


def test_custom_jvp_rule_sows_reaped_from_outside_primal_values_only():
    # jvp / grad of call_and_reap: the rule runs; its sow of a primal value
    # ("jvp_x") is reaped, its sow of a tangent ("jvp_t") is not (it would
    # make a primal output depend on the tangents, which reverse mode cannot
    # linearize); the function's own sow "s" is reaped as without the rule.
    (out, reaps), (out_t, reaps_t) = jax.jvp(h.call_and_reap(_cjvp, tag=T), (0.5,), (1.0,))
    allclose(out, 2 * np.sin(0.5), rtol=1e-6)
    allclose(out_t, 10.0)  # the user's rule
    assert_tree_allclose(reaps, {"jvp_x": np.cos(0.5), "s": np.sin(0.5)})
    assert_tree_allclose(reaps_t, {"jvp_x": 0.0, "s": np.cos(0.5)})
    loss = lambda x: (lambda o, r: o + r["jvp_x"] + r["s"])(*h.call_and_reap(_cjvp, tag=T)(x))
    allclose(jax.grad(loss)(0.5), 10.0 + 0.0 + np.cos(0.5), rtol=1e-6)


def test_custom_jvp_rule_sows_inside_a_jit_reaped_from_outside_primal_values_only():
    # As above, with the rule's sows inside one jit that takes both the
    # primal and the tangent: the sow of the primal value is reaped, the
    # sow of the tangent stays a plain identity, so reverse mode works.
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x) * 2

    @jax.jit
    def sows(x, t):
        return h.sow(t * 3, tag=T, name="jvp_t"), h.sow(jnp.cos(x), tag=T, name="jvp_x")

    @f.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        t3, _ = sows(x, t)
        return f(x), 10.0 * t + 0.0 * t3

    (out, reaps), (out_t, reaps_t) = jax.jvp(h.call_and_reap(f, tag=T), (0.5,), (1.0,))
    allclose(out_t, 10.0)
    assert_tree_allclose(reaps, {"jvp_x": np.cos(0.5)})
    assert_tree_allclose(reaps_t, {"jvp_x": 0.0})
    loss = lambda x: (lambda o, r: o + r["jvp_x"])(*h.call_and_reap(f, tag=T)(x))
    allclose(jax.grad(loss)(0.5), 10.0)


def test_custom_vjp_sows_in_fwd_and_bwd_reaped():
    out, reaps = h.call_and_reap(jax.grad(_cvjp), tag=T)(0.5)
    allclose(out, 7.0)
    assert_tree_allclose(reaps, {"fwd": 2 * np.sin(0.5), "bwd": 7.0})
    # through jax.vjp too
    def f(x):
        y, vjp = jax.vjp(_cvjp, x)
        return y, vjp(3.0)[0]
    (y, g), reaps = h.call_and_reap(f, tag=T)(0.5)
    allclose(g, 21.0)
    assert_tree_allclose(reaps, {"fwd": 2 * np.sin(0.5), "bwd": 21.0})


def test_unused_sow_in_a_custom_jvp_rule_is_reaped_from_a_function_with_state():
    # The state layer rewrites the custom_jvp (its rule runs in the
    # function's place, threaded); the rule's sow, whose result it does not
    # use, is still there for a harvest of the uncurried function.
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    @f.defjvp
    def _(p, t):
        h.sow(p[0] * 2.0, tag=T, name="r", mode="clobber")
        return jax.jvp(jnp.sin, p, t)

    def program(x):
        y = f(x)
        tx.set_state("y", y)
        return y

    one = np.float32(1.0)
    want = {"r": 2.0}  # eagerly: the rule runs once, sowing 2 * x
    assert_tree_allclose(jax.jvp(h.reap(f, tag=T), (one,), (one,))[0], want)
    pure, state0 = tx.uncurry(program, one)
    (out, reaps), (out_t, _) = jax.jvp(
        lambda x: h.call_and_reap(pure, tag=T)(state0, x), (one,), (one,))
    assert_tree_allclose(reaps, want)
    allclose(out[0], np.sin(1.0))
    allclose(out[1]["y"], np.sin(1.0))
    allclose(out_t[0], np.cos(1.0))
    g = jax.grad(lambda x: h.call_and_reap(pure, tag=T)(state0, x)[0][0])(one)
    allclose(g, np.cos(1.0))


def _counting_custom(kind: str):
    """sin as a custom_jvp or custom_vjp function that sows its value as
    "s" and adds 1 to the state "n"; its rule (custom_jvp) or fwd
    (custom_vjp) adds 1 to the state "k" before calling it."""
    def fn(x):
        tx.set_state("n", tx.get_state("n", np.int32(0)) + 1)
        return h.sow(jnp.sin(x), tag=T, name="s", mode="clobber")

    def bump():
        tx.set_state("k", tx.get_state("k", np.int32(0)) + 1)

    if kind == "custom_jvp":
        f = jax.custom_jvp(fn)

        @f.defjvp
        def _(p, t):
            bump()
            return jax.jvp(fn, p, t)
    else:
        f = jax.custom_vjp(fn)

        def fwd(x):
            bump()
            return fn(x), x

        f.defvjp(fwd, lambda x, ct: (jnp.cos(x) * ct,))
    return f


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_a_harvest_of_pure_keeps_the_state_effects_of_a_custom_rule(kind):
    # Differentiated from outside, a harvest of the uncurried function gives
    # the outputs of the rule that runs in the call's place (the state
    # rewrite threads the state through it), as pure alone does.
    f = _counting_custom(kind)

    def program(x):
        tx.set_state("k", tx.get_state("k", np.int32(0)) + 10)
        return f(x)

    one = np.float32(1.0)
    pure, state0 = tx.uncurry(program, one)
    # eagerly: the program adds 10, then the rule runs once, adds 1 and
    # calls the function, which adds 1 to "n"
    (out, fin), _ = jax.vjp(lambda x: pure(state0, x), one)
    assert (int(fin["k"]), int(fin["n"])) == (11, 1)
    ((out2, fin), reaps), _ = jax.vjp(lambda x: h.call_and_reap(pure, tag=T)(state0, x), one)
    assert (int(fin["k"]), int(fin["n"])) == (11, 1)
    assert_tree_allclose(reaps, {"s": np.sin(1.0)})
    allclose(out2, out)

    def loss(x):
        (out, fin), reaps = h.call_and_reap(pure, tag=T)(state0, x)
        return out + reaps["s"], fin

    (value, fin), g = jax.value_and_grad(loss, has_aux=True)(one)
    assert (int(fin["k"]), int(fin["n"])) == (11, 1)
    allclose(value, 2 * np.sin(1.0))
    allclose(g, 2 * np.cos(1.0))  # the function's sow is reaped with its derivative


def _fwd_sows():
    """A custom_vjp of sin whose fwd sows its residual, cos(x), as "r"
    (clobber); the bwd scales the cotangent by the residual it gets."""
    f = jax.custom_vjp(jnp.sin)
    f.defvjp(lambda x: (jnp.sin(x), h.sow(jnp.cos(x), tag=T, name="r", mode="clobber")),
             lambda r, ct: (r * ct,))
    return f


def test_harvest_of_a_custom_jvp_calling_a_custom_vjp_under_grad():
    # The harvest rewrites the custom_jvp (its function sows); JAX has no
    # forward mode for the custom_vjp inside, so the tangents through ctx
    # hold the function's inputs constant and never reach it.
    g = jax.custom_vjp(jnp.sin)
    g.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (jnp.cos(x) * ct,))

    def fn(x):
        return h.sow(g(x), tag=T, name="b", mode="clobber")

    f = jax.custom_jvp(fn)
    f.defjvp(lambda p, t: jax.jvp(fn, p, t))
    x = np.float32(0.5)
    want = float(jnp.cos(x))
    assert float(jax.grad(f)(x)) == want
    assert float(jax.grad(lambda x: h.call_and_reap(f, tag=T)(x)[0])(x)) == want

    def loss(x):
        out, reaps = h.call_and_reap(f, tag=T)(x)
        return out + 2.0 * reaps["b"], reaps

    (value, reaps), grad = jax.value_and_grad(loss, has_aux=True)(x)
    allclose(value, 3.0 * np.sin(0.5))
    assert_tree_allclose(reaps, {"b": np.sin(0.5)})
    allclose(grad, 3.0 * np.cos(0.5))  # the function's sow, reaped with its derivative
    planted = jax.grad(lambda x: h.plant(f, tag=T)({"b": 2.0}, x))(x)
    allclose(planted, 0.0)  # the output is the planted constant


def test_sow_in_custom_vjp_fwd_is_reaped_and_planted_when_jax_differentiates_the_call():
    f, x = _fwd_sows(), 0.5
    # Differentiated from outside the harvest, the fwd runs in the call's
    # place: its sow is reaped (a constant w.r.t. x, as eagerly, where the
    # fwd sees primal values), as when the vjp is taken inside.
    (out, reaps), vjp = jax.vjp(h.call_and_reap(f, tag=T), x)
    allclose(out, np.sin(x))
    assert_tree_allclose(reaps, {"r": np.cos(x)})
    allclose(vjp((1.0, {"r": 1.0}))[0], np.cos(x))
    assert_tree_allclose(h.reap(lambda x: jax.vjp(f, x)[0], tag=T)(x), {"r": np.cos(x)})

    def loss(x):
        out, reaps = h.call_and_reap(f, tag=T)(x)
        return out + reaps["r"]

    for grad in (jax.value_and_grad(loss), jax.jit(jax.value_and_grad(loss))):
        value, g = grad(x)
        allclose(value, np.sin(x) + np.cos(x))
        allclose(g, np.cos(x))
    # Not differentiated, the fwd does not run: the name is absent.
    assert h.reap(f, tag=T)(x) == {}
    # A plant replaces the fwd's residual, so the bwd scales by it.
    planted = lambda x: h.plant(f, tag=T)({"r": 3.0}, x)
    allclose(planted(x), np.sin(x))
    allclose(jax.grad(planted)(x), 3.0)
    allclose(jax.jit(jax.grad(planted))(x), 3.0)
    check(jax.make_jaxpr(jax.grad(planted))(x))


def test_a_custom_vjp_fwds_sow_is_reaped_with_state_in_its_body_and_another_state():
    # The function's body uses a state and the program another one, which the
    # fwd hands on unchanged: harvest's look into the fwd (every input
    # differentiated) must still find its sow.
    def fn(x):
        tx.set_state("b", x)
        return jnp.sin(x)

    f = jax.custom_vjp(fn)

    def fwd(x):
        h.sow(x * 2.0, tag=T, name="w", mode="clobber")
        return fn(x), x

    f.defvjp(fwd, lambda x, ct: jax.vjp(fn, x)[1](ct))

    def program(x):
        tx.set_state("a", tx.get_state("a", np.float32(0.25)) + 1.0)
        return f(x)

    one = np.float32(1.0)
    pure, state0 = tx.uncurry(program, one)
    inside = h.reap(lambda x: jax.vjp(lambda y: pure(state0, y), x)[0], tag=T)(one)
    assert jax.tree_util.tree_map(float, inside) == {"w": 2.0}
    reaps = jax.vjp(lambda x: h.call_and_reap(pure, tag=T)(state0, x)[1], one)[0]
    assert jax.tree_util.tree_map(float, reaps) == {"w": 2.0}


def _sowing_rule(fn, name, value=lambda x: x * 2.0):
    """``jax.custom_jvp(fn)`` whose rule sows ``value(x)`` as ``name``
    (clobber; its result unused), then returns ``jax.jvp(fn, ...)``."""
    f = jax.custom_jvp(fn)

    @f.defjvp
    def rule(p, t):
        h.sow(value(p[0]), tag=T, name=name, mode="clobber")
        return jax.jvp(fn, p, t)

    return f


def test_a_rule_sow_of_a_name_also_sown_outside_rules_is_reaped():
    # The function's body does not sow "c": the rule's sow is its own,
    # reaped after the function's (which pass the earlier value on).
    f = _sowing_rule(jnp.sin, "c")

    def program(x):
        h.sow(x * 3.0, tag=T, name="c", mode="clobber")
        return f(x)

    one = np.float32(1.0)
    inside = h.reap(lambda x: jax.jvp(program, (x,), (one,)), tag=T)(one)
    assert float(inside["c"]) == 2.0  # eagerly: the rule's sow is the last
    outside = jax.jvp(h.reap(program, tag=T), (one,), (one,))[0]
    assert float(outside["c"]) == 2.0


def test_a_rule_sow_before_one_in_a_jit_in_its_function_is_clobbered():
    # The inner rule's sow, inside the jit the outer rule calls, depends on
    # primal values only: it is reaped after the outer rule's own.
    inner = _sowing_rule(jnp.sin, "c", lambda x: x * 2.0)
    outer = _sowing_rule(jax.jit(inner), "c", lambda x: x * 3.0)
    one = np.float32(1.0)
    inside = h.reap(lambda x: jax.jvp(outer, (x,), (one,)), tag=T)(one)
    assert float(inside["c"]) == 2.0  # eagerly: the outer rule's sow, then the inner's
    outside = jax.jvp(h.reap(outer, tag=T), (one,), (one,))[0]
    assert float(outside["c"]) == 2.0


@pytest.mark.parametrize("program", ["sown_outside_rules", "in_a_jitted_rule"])
def test_rule_sows_under_vmap_and_warm_caches(program):
    # The two cases above, per example under vmap and under a jitted grad
    # called twice: the rule's sow (2x) is the last, with derivative zero.
    if program == "sown_outside_rules":
        f = _sowing_rule(jnp.sin, "c")

        def fn(x):
            h.sow(x * 3.0, tag=T, name="c", mode="clobber")
            return f(x)
    else:
        fn = _sowing_rule(jax.jit(_sowing_rule(jnp.sin, "c")), "c", lambda x: x * 3.0)
    xs = jnp.array([1.0, 2.0, 3.0])
    reaped = jax.vmap(lambda x: jax.jvp(h.reap(fn, tag=T), (x,), (1.0,))[0])(xs)
    allclose(reaped["c"], 2.0 * xs)
    step = jax.jit(jax.grad(lambda x: (lambda o, r: o + r["c"])(*h.call_and_reap(fn, tag=T)(x))))
    for x in (1.0, 2.0):
        allclose(step(x), np.cos(x))


def test_a_symbolic_zeros_fwd_sows_by_what_jax_perturbs_as_when_differentiated_inside():
    # A fwd registered with symbolic zeros sows only for the inputs JAX
    # perturbs: differentiated from outside the harvest, the names reaped
    # are those of the perturbed inputs, as when the grad is taken inside.
    @jax.custom_vjp
    def f(x, y):
        return jnp.sin(x) * y

    def fwd(x, y):
        if x.perturbed:
            h.sow(jnp.cos(x.value), tag=T, name="dx", mode="clobber")
        if y.perturbed:
            h.sow(y.value * 10.0, tag=T, name="dy", mode="clobber")
        return f(x.value, y.value), (x.value, y.value)

    f.defvjp(fwd, lambda res, ct: (jnp.cos(res[0]) * res[1] * ct, jnp.sin(res[0]) * ct),
             symbolic_zeros=True)
    x, y = np.float32(0.5), np.float32(2.0)
    want = {"dx": np.cos(x), "dy": y * 10.0}
    for argnums in [(0,), (1,), (0, 1)]:
        inside = h.reap(lambda x, y: jax.grad(f, argnums)(x, y), tag=T)(x, y)
        (value, reaps), g = jax.value_and_grad(
            lambda x, y: h.call_and_reap(f, tag=T)(x, y), argnums, has_aux=True)(x, y)
        names = {("dx", "dy")[i] for i in argnums}
        assert set(reaps) == set(inside) == names, (argnums, reaps, inside)
        assert_tree_allclose(reaps, {n: want[n] for n in names})
        allclose(value, np.sin(x) * y)
        allclose(g, [(np.cos(x) * y, np.sin(x))[i] for i in argnums])


def _rule_sow_in_shard_map(kind: str, per_shard: bool = False, check_vma: bool = True):
    """sin on 4 shards as a custom_jvp (rule) or custom_vjp (fwd) that sows
    2 * psum(x) as "c" (the same on every shard), or 2x (``per_shard``)."""
    from jax.sharding import PartitionSpec as P

    from helpers import cpu_mesh, shard_map

    sown = (lambda x: x * 2.0) if per_shard else (
        lambda x: jax.lax.psum(x.sum(), "i") * 2.0)
    if kind == "custom_jvp":
        f = _sowing_rule(jnp.sin, "c", sown)
    else:
        f = jax.custom_vjp(jnp.sin)
        f.defvjp(lambda x: (jnp.sin(x), h.sow(sown(x), tag=T, name="c", mode="clobber") * 0.0
                            + jnp.cos(x)),
                 lambda r, ct: (r * ct,))
    return shard_map()(f, mesh=cpu_mesh("i"), in_specs=P("i"), out_specs=P("i"),
                       check_vma=check_vma)


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_a_rule_sow_inside_shard_map_is_reaped_when_differentiated_from_outside(kind):
    # The rule is looked into in the shard_map body's context (its psum
    # names the body's axis): its sow is reaped as when the derivative is
    # taken inside the harvest, where JAX runs the rule.
    sm = _rule_sow_in_shard_map(kind)
    xs = jnp.arange(1.0, 5.0)
    inside = h.reap(lambda x: jax.grad(lambda x: sm(x).sum())(x), tag=T)(xs)
    allclose(inside["c"], 20.0)

    def loss(x):
        out, reaps = h.call_and_reap(sm, tag=T)(x)
        return out.sum(), reaps

    for grad in (jax.value_and_grad(loss, has_aux=True),
                 jax.jit(jax.value_and_grad(loss, has_aux=True))):
        for x in (xs, xs * 2.0):  # the jitted grad twice: warm caches
            (value, reaps), g = grad(x)
            allclose(value, np.sin(x).sum())
            allclose(g, np.cos(x))
            assert set(reaps) == {"c"}
            allclose(reaps["c"], 2.0 * x.sum())


def test_a_per_shard_rule_sow_inside_shard_map_is_an_error_naming_it():
    sm = _rule_sow_in_shard_map("custom_jvp", per_shard=True)
    with pytest.raises(ValueError, match=r"sow 'c' at shard_map/custom_jvp\[rule\] reaps a value "
                                         r"that differs across the shards"):
        jax.grad(lambda x: h.call_and_reap(sm, tag=T)(x)[0].sum())(jnp.arange(1.0, 5.0))


def test_a_rule_sow_inside_shard_map_without_vma_checking_is_an_error_naming_it():
    # Without vma checking taxpr cannot tell that the sown value is the same
    # on every shard: the error reaping inside gives, from outside too.
    sm = _rule_sow_in_shard_map("custom_jvp", check_vma=False)
    xs = jnp.arange(1.0, 5.0)
    for run in (lambda: h.reap(lambda x: jax.grad(lambda x: sm(x).sum())(x), tag=T)(xs),
                lambda: jax.grad(lambda x: h.call_and_reap(sm, tag=T)(x)[0].sum())(xs)):
        with pytest.raises(ValueError, match=r"sow 'c' at shard_map.* is reaped inside a shard_map "
                                             r"without vma checking"):
            run()


def _rule_sowing_around_its_function(mode: str, calls: str, before: bool = False):
    """A custom_jvp function sowing ``3x`` as "c" whose rule calls it
    (``calls``: its JVP, the function plainly, or the custom function) and
    sows ``2x`` as "c" after it (``before``: before it)."""
    def fn(x):
        return h.sow(x * 3.0, tag=T, name="c", mode=mode) + 1.0

    f = jax.custom_jvp(fn)

    @f.defjvp
    def rule(p, t):
        if before:
            h.sow(p[0] * 2.0, tag=T, name="c", mode=mode)
        if calls == "jvp":
            out = jax.jvp(fn, p, t)
        else:
            out = ((fn if calls == "plain" else f)(p[0]), 3.0 * t[0])
        if not before:
            h.sow(p[0] * 2.0, tag=T, name="c", mode=mode)
        return out
    return f


@pytest.mark.parametrize("calls", ["jvp", "plain", "custom"])
@pytest.mark.parametrize("before", [False, True], ids=["sow_after", "sow_before"])
def test_a_rule_sow_around_its_function_sowing_the_same_name_is_reaped_as_eagerly(calls, before):
    # Eagerly (the harvest inside the jvp, where JAX runs the rule), the
    # last clobber sow of "c" the rule runs is reaped: the rule's own (2.0)
    # when it sows after calling the function, the function's (3.0) when
    # before. Differentiated from outside the harvest, the same.
    f = _rule_sowing_around_its_function("clobber", calls, before)
    one = np.float32(1.0)
    want = 3.0 if before else 2.0
    inside = h.reap(lambda x: jax.jvp(f, (x,), (one,)), tag=T)(one)
    assert float(inside["c"]) == want
    reaps, _ = jax.jvp(h.reap(f, tag=T), (one,), (one,))
    assert float(reaps["c"]) == want
    # reverse mode: the output keeps the rule's derivative, and undifferentiated
    # the function runs (its own sow)
    (value, reaps), g = jax.value_and_grad(lambda x: h.call_and_reap(f, tag=T)(x), has_aux=True)(one)
    assert (float(value), float(reaps["c"]), float(g)) == (4.0, want, 3.0)
    assert float(h.reap(f, tag=T)(one)["c"]) == 3.0
    # The reaped value's derivative: the function's (3) where its sow is
    # reaped, a constant's where the rule's own is (a rule runs on primal
    # values). The function called plainly after the rule's sow sows
    # unmarked, like a rule's own: its value is right, its derivative the
    # rule's (docs/limitations.md).
    if not (before and calls == "plain"):
        d = jax.grad(lambda x: h.call_and_reap(f, tag=T)(x)[1]["c"])(one)
        assert float(d) == (3.0 if before else 0.0)


@pytest.mark.parametrize("mode", ["strict", "append"])
def test_a_rule_sow_after_its_function_sows_the_same_name_in_strict_or_append_mode(mode):
    # Eagerly a strict name sown twice is oryx's error, and an append one
    # collects both values; differentiated from outside, the strict one is
    # the same error and the append one a clear NotImplementedError (a rule
    # cannot collect values per site) rather than a silently different value.
    f = _rule_sowing_around_its_function(mode, "jvp")
    one = np.float32(1.0)
    if mode == "strict":
        with pytest.raises(ValueError, match="Variable has already been reaped: c"):
            h.reap(lambda x: jax.jvp(f, (x,), (one,)), tag=T)(one)
        with pytest.raises(ValueError, match=r"Variable has already been reaped: c \(a strict "
                                             r"sow in a derivative rule"):
            jax.jvp(h.reap(f, tag=T), (one,), (one,))
    else:
        inside = h.reap(lambda x: jax.jvp(f, (x,), (one,)), tag=T)(one)
        np.testing.assert_array_equal(inside["c"], [3.0, 2.0])
        with pytest.raises(NotImplementedError, match=r"custom_jvp\[rule\] collect or are fed "
                                                      r"values per site \(reap 'c'\)"):
            jax.jvp(h.reap(f, tag=T), (one,), (one,))
    # undifferentiated, the function runs: one sow
    assert float(np.sum(h.reap(f, tag=T)(one)["c"])) == 3.0
    jax_still_works()


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_append_sow_in_custom_rule_function(kind):
    body = lambda x: h.sow(x * 2, tag=T, name="a", mode="append") + 1
    if kind == "custom_jvp":
        fn = jax.custom_jvp(body)
        fn.defjvp(lambda p, t: (fn(p[0]), t[0]))
    else:
        fn = jax.custom_vjp(body)
        fn.defvjp(lambda x: (fn(x), None), lambda _, g: (g,))
    # eager: the body runs once, sowing 1.0 * 2 in append mode
    assert_tree_allclose(h.reap(fn, tag=T)(1.0), {"a": np.array([2.0])})
    allclose(h.plant(fn, tag=T)({"a": jnp.array([5.0])}, 1.0), 6.0)


def test_custom_vjp_in_scan_reap():
    def f(xs):
        def body(c, x):
            return c + _cvjp(x), None
        return jax.lax.scan(body, 0.0, xs)[0]

    xs = jnp.array([0.1, 0.2])
    with pytest.raises(ValueError, match="Cannot use strict mode for 's' inside `scan`."):
        h.reap(f, tag=T)(xs)
    jax_still_works()


@pytest.mark.parametrize("kind", ["custom_jvp", "custom_vjp"])
def test_append_sow_in_custom_rule_function_reap_plant_and_grads(kind):
    body = lambda x: h.sow(x * 2, tag=T, name="a", mode="append") + 1
    if kind == "custom_jvp":
        fn = jax.custom_jvp(body)
        fn.defjvp(lambda p, t: (fn(p[0]), t[0] * 7))
    else:
        fn = jax.custom_vjp(body)
        fn.defvjp(lambda x: (fn(x), None), lambda _, g: (g * 7,))
    assert_tree_allclose(h.reap(fn, tag=T)(1.0), {"a": np.array([2.0])})
    allclose(h.plant(fn, tag=T)({"a": jnp.array([5.0])}, 1.0), 6.0)
    # the output keeps the user's rule; the reaped value has its own derivative
    allclose(jax.grad(lambda x: h.call_and_reap(fn, tag=T)(x)[0])(1.0), 7.0)
    allclose(jax.grad(lambda x: h.call_and_reap(fn, tag=T)(x)[1]["a"].sum())(1.0), 2.0)
    # Differentiated, JAX runs the rule in the function's place, and the
    # rule's own call of the function cannot be given the planted row: an
    # error naming the sow (the value would be the unplanted 3, not 6).
    for planted in (lambda p: h.plant(fn, tag=T)({"a": p}, 1.0),
                    lambda x: h.plant(fn, tag=T)({"a": jnp.array([5.0])}, x)):
        with pytest.raises(NotImplementedError, match=r"tag\(op=sow, tag='t', name='a', "
                                                      r"mode='append'\), planted with one value"):
            jax.value_and_grad(planted)(jnp.array([5.0]) if planted.__code__.co_varnames[0] == "p"
                                        else 1.0)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "jacrev", "jit_grad"])
def test_plant_into_a_custom_jvp_whose_rule_is_its_jvp_differentiates_the_planted_function(
        transform):
    # The rule (the JVP of the function, so it sows too) is planted too: it
    # must not add the tangent of the replaced value.
    def body(x, y):
        return h.sow(x * 3.0, tag=T, name="c0", mode="clobber") + y, y

    fn = jax.custom_jvp(body)
    fn.defjvp(lambda p, t: jax.jvp(body, p, t))
    planted = lambda c, x, y: h.plant(fn, tag=T)({"c0": c}, x, y)[0]  # noqa: E731
    eager = lambda c, x, y: c + y  # noqa: E731 - the sow's value replaced by c
    args = (jnp.float32(2.0), jnp.float32(3.0), jnp.float32(4.0))
    if transform == "jvp":
        for t in np.eye(3, dtype=np.float32):
            allclose(jax.jvp(planted, args, tuple(t))[1], jax.jvp(eager, args, tuple(t))[1])
        return
    d = {"jacfwd": jax.jacfwd, "jacrev": jax.jacrev,
         "jit_grad": lambda f, argnums: jax.jit(jax.grad(f, argnums=argnums))}[transform]
    assert_tree_allclose(d(planted, argnums=(0, 1, 2))(*args), (1.0, 0.0, 1.0))
    assert_tree_allclose(d(eager, argnums=(0, 1, 2))(*args), (1.0, 0.0, 1.0))


def test_plant_in_a_custom_vjp_whose_bwd_recomputes_is_planted_in_the_recomputation():
    # The bwd runs the function again (jax.vjp of it): the recomputation sees
    # the planted value too, so the output depends on the plant, not on x.
    def g(x):
        return h.sow(x * 1.0, tag="rv", name="c1", mode="clobber")

    g_vjp = jax.custom_vjp(g)
    g_vjp.defvjp(lambda x: (g(x), x), lambda x, ct: jax.vjp(g, x)[1](ct))

    def f(x):
        return g_vjp(g_vjp(x) * 3.0) * 2.0

    planted = lambda c1, x: h.plant(f, tag="rv")({"c1": c1}, x)  # noqa: E731
    assert float(planted(5.0, 1.0)) == 10.0
    d_c1, d_x = jax.grad(planted, argnums=(0, 1))(5.0, 1.0)
    # By hand: f = 2 * c1 whatever x is.
    assert float(d_c1) == 2.0 and float(d_x) == 0.0


def test_a_recomputing_custom_vjp_that_sows_in_a_branch_under_grad_is_reaped():
    def sow(x):
        return h.sow(x, tag=T, name="c", mode="clobber")

    def fn(x):
        return sow(jnp.sin(x))

    f = jax.custom_vjp(fn)
    f.defvjp(lambda x: (fn(x), x), lambda x, ct: jax.vjp(fn, x)[1](ct))

    def program(x):
        return jax.lax.cond(x > 0.3, sow, f, x)

    # The taken branch's value, once (the bwd's recomputation is not reaped).
    for x, want, grad in ((0.5, 0.5, 1.0), (0.1, np.sin(0.1), np.cos(0.1))):
        x = np.float32(x)
        allclose(h.reap(program, tag=T)(x)["c"], want)
        (g, reaps) = h.call_and_reap(jax.grad(program), tag=T)(x)
        allclose(reaps["c"], want)
        allclose(g, grad)


def test_a_strict_sow_in_a_recomputing_custom_vjp_under_grad_is_reaped():
    def fn(x):
        return h.sow(jnp.sin(x), tag=T, name="c", mode="strict") * 2.0

    f = jax.custom_vjp(fn)
    f.defvjp(lambda x: (fn(x), x), lambda x, ct: jax.vjp(fn, x)[1](ct))
    x = np.float32(0.5)
    assert float(h.reap(f, tag=T)(x)["c"]) == float(jnp.sin(x))
    g, reaps = h.call_and_reap(jax.grad(f), tag=T)(x)
    assert float(reaps["c"]) == float(jnp.sin(x))  # once: the recomputation is not reaped
    allclose(g, 2 * np.cos(x))


def test_plant_through_a_recomputing_bwd_under_jit_and_vmap_of_grad():
    # The replayed bwd is traced with the values JAX passes: tracers under
    # jit and vmap. Reference by hand: f = 2 * c1 * x0 ** 0 (x does not matter).
    def g(x):
        return h.sow(x * 1.0, tag="rj", name="c1", mode="clobber")

    g_vjp = jax.custom_vjp(g)
    g_vjp.defvjp(lambda x: (g(x), x), lambda x, ct: jax.vjp(g, x)[1](ct))

    def planted(c1, x):
        return h.plant(lambda y: g_vjp(g_vjp(y) * 3.0) * 2.0, tag="rj")({"c1": c1}, x)

    grad = jax.jit(jax.vmap(jax.grad(planted, argnums=(0, 1))))
    c1s, xs = jnp.array([5.0, -1.0]), jnp.array([1.0, 4.0])
    for _ in range(2):
        d_c1, d_x = grad(c1s, xs)
        assert [float(v) for v in d_c1] == [2.0, 2.0]
        assert [float(v) for v in d_x] == [0.0, 0.0]


def _custom_jvp_around_a_sowing_fwd(in_cond: bool, stateful: bool):
    """A custom_jvp (rule: the JVP of its function) whose function calls a
    custom_vjp whose fwd sows its input after calling the function, directly
    or in both branches of a cond; ``stateful``: the function scales its
    input by a state it reads."""
    inner = jax.custom_vjp(lambda x: x * 2.0)

    def fwd(x):
        out = inner.fun(x)
        h.sow(x, tag=T, name="c", mode="clobber")
        return out, None

    inner.defvjp(fwd, lambda _, ct: (ct * 2.0,))

    def fn(x):
        if stateful:
            x = x * tx.get_state("scale", np.float32(1.0))
        if in_cond:
            return jax.lax.cond(x > 0.1, inner, lambda x: inner(x * 3.0), x)
        return inner(x)

    f = jax.custom_jvp(fn)
    f.defjvp(lambda p, t: jax.jvp(fn, p, t))
    return f


@pytest.mark.parametrize("stateful", [
    True,
    pytest.param(False, marks=pytest.mark.xfail(
        strict=True, raises=TypeError,
        reason="a known gap (docs/limitations.md): without state, the harvest's rule of the "
               "custom_jvp gets instantiated zero tangents for the reaped values, whose JVP "
               "through the custom_vjp is JAX's \"can't apply forward-mode autodiff\""))],
    ids=["stateful", "stateless"])
@pytest.mark.parametrize("in_cond", [False, True], ids=["direct", "in_cond"])
def test_grad_of_a_harvest_of_a_custom_jvp_around_a_custom_vjp_whose_fwd_sows(in_cond, stateful):
    # JAX differentiates the custom_vjp in reverse mode inside the rule (no
    # forward mode needed); reaped from outside, the fwd's sow is the one
    # the rule ran, as when the harvest is inside the differentiation.
    f = _custom_jvp_around_a_sowing_fwd(in_cond, stateful)
    x0 = np.float32(0.5)
    pure, s0 = tx.uncurry(f, x0) if stateful else (lambda s, x: f(x), {})
    for x in (x0, np.float32(0.05)):
        inside = h.reap(lambda x: jax.vjp(lambda x: pure(s0, x), x)[0], tag=T)(x)
        (out, reaps), vjp_fn = jax.vjp(lambda x: h.call_and_reap(pure, tag=T)(s0, x), x)
        scale = 1.0 if x > 0.1 or not in_cond else 3.0
        out = out[0] if stateful else out
        allclose(out, 2.0 * scale * x)
        allclose(inside["c"], scale * x)
        allclose(reaps["c"], inside["c"])
        grad = jax.grad(lambda x: jax.tree_util.tree_leaves(
            h.call_and_reap(pure, tag=T)(s0, x)[0])[0])(x)
        allclose(grad, 2.0 * scale)


def test_an_equinox_custom_jvp_rule_sowing_after_its_function_under_jit_and_vmap():
    # equinox's filter_custom_jvp, its rule the JVP of the function and then
    # a sow of the same name: from outside the harvest (jitted, called twice:
    # warm caches; and per example under vmap) the rule's later sow is
    # reaped, as with the harvest inside the differentiation.
    import equinox as eqx

    def fn(x):
        return jnp.sin(h.sow(x * 3.0, tag=T, name="c", mode="clobber"))

    f = eqx.filter_custom_jvp(fn)

    @f.def_jvp
    def _(primals, tangents):
        out = jax.jvp(fn, primals, tangents)
        h.sow(primals[0] * 2.0, tag=T, name="c", mode="clobber")
        return out

    def loss(x):
        out, reaps = h.call_and_reap(f, tag=T)(x)
        return out, reaps

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    for x in (np.float32(0.5), np.float32(1.5)):  # the jitted grad twice
        inside = h.reap(lambda x: jax.vjp(f, x)[0], tag=T)(x)
        (value, reaps), g = grad(x)
        allclose(inside["c"], 2.0 * x)
        allclose(reaps["c"], inside["c"])
        allclose(value, np.sin(3.0 * x))
        allclose(g, 3.0 * np.cos(3.0 * x))
    xs = jnp.array([0.5, 1.0, 1.5], jnp.float32)
    (values, reaps), gs = jax.vmap(jax.value_and_grad(loss, has_aux=True))(xs)
    allclose(reaps["c"], 2.0 * xs)
    allclose(gs, 3.0 * np.cos(3.0 * np.asarray(xs)))
    allclose(h.reap(f, tag=T)(np.float32(0.5))["c"], 1.5)  # undifferentiated: the function's

"""taxpr inside equinox: `eqx.internal` loops and `nondifferentiable`,
`filter_vmap` with axis names, `nn.BatchNorm`, `nn.Dropout`,
`filter_checkpoint`, `filter_custom_jvp/vjp`, `filter_jit` of every
taxpr transformation, and a GRU cell trained by truncated backpropagation
through time with `tx.value_and_grad`.

References: Python loops with a dict, keys threaded by hand, equinox's own
state threaded by hand.
"""
import inspect

import pytest

eqx = pytest.importorskip("equinox")
eqxi = pytest.importorskip("equinox.internal")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import taxpr as tx  # noqa: E402
from taxpr import harvest as h  # noqa: E402

from ecohelpers import close  # noqa: E402


# --- the program A: eqxi.nondifferentiable ---------------------------

def _program_a(x):
    tx.set_state("n", tx.get_state("n", jnp.zeros(())) + x)
    return eqxi.nondifferentiable(x * 2)


def test_nondifferentiable_program_a():
    pure, s0 = tx.uncurry(_program_a, 1.0)
    out, s1 = pure(s0, 1.0)
    assert float(out) == 2.0
    assert set(s1) == {"n"} and float(s1["n"]) == 1.0


def test_nondifferentiable_program_a_jit_twice():
    pure, s0 = tx.uncurry(_program_a, 1.0)
    s = s0
    for _ in range(2):
        out, s = jax.jit(pure)(s, 1.5)
    assert float(out) == 3.0 and float(s["n"]) == 3.0


# --- eqxi.while_loop, every kind ------------------------------------------------

def _loop_loss(kind, steps=3):
    def body(carry):
        i, y = carry
        n = tx.get_state("wl_n", jnp.zeros(()))
        tx.set_state("wl_n", n + 1.0)
        return i + 1, y * (1.0 + 0.1 * n)  # reads the state it updates

    def loss(x):
        return eqxi.while_loop(lambda c: c[0] < steps, body, (0, x), max_steps=steps,
                               kind=kind)[1]
    return loss


def _python_loop(x, steps=3):
    n, y, dy = 0.0, x, 1.0
    for _ in range(steps):
        y, dy = y * (1.0 + 0.1 * n), dy * (1.0 + 0.1 * n)
        n += 1.0
    return y, dy, n


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
def test_eqxi_while_loop_forward(kind):
    loss = _loop_loss(kind)
    pure, s0 = tx.uncurry(loss, 2.0)
    out, s1 = pure(s0, 2.0)
    y, _, n = _python_loop(2.0)
    close(out, y)
    assert float(s1["wl_n"]) == n == 3.0
    out, s2 = jax.jit(pure)(s1, 2.0)  # continues from n=3: factors 1.3, 1.4, 1.5
    close(out, 2.0 * 1.3 * 1.4 * 1.5)
    assert float(s2["wl_n"]) == 6.0


def _stepping_loop(kind, prefix):
    """Adds state ``{prefix}_k`` until 3.0, counting steps in ``{prefix}_n``."""
    def f(x):
        def body(c):
            n = f"{prefix}_n"
            tx.set_state(n, tx.get_state(n, jnp.zeros((), jnp.int32)) + 1)
            return c + tx.get_state(f"{prefix}_k", jnp.float32(1.0))
        return eqxi.while_loop(lambda c: c < 3.0, body, x, max_steps=16, kind=kind)
    return f


def _python_step_counts(ks):
    """Per step size, the steps a Python loop takes from 0.0 to 3.0."""
    counts = []
    for k in ks:
        c, n = 0.0, 0
        while c < 3.0:
            c, n = c + k, n + 1
        counts.append(n)
    return counts


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
def test_eqxi_while_loop_vmap_over_states_counts_each_examples_iterations(kind):
    # Each example's loop runs a different number of times; its counter
    # counts its own iterations (a Python loop per example).
    pure, s0 = tx.uncurry(_stepping_loop(kind, "vw"), jnp.float32(0.0))
    ks = [0.5, 1.0, 3.0]
    batch = {"vw_k": jnp.array(ks), "vw_n": jnp.zeros(3, jnp.int32)}
    _, s1 = jax.vmap(pure, in_axes=(0, None))(batch, jnp.float32(0.0))
    assert [int(n) for n in s1["vw_n"]] == _python_step_counts(ks)


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
def test_eqxi_while_loop_vmap_cond_reads_a_batched_state(kind):
    # The loop's predicate reads a state that differs per example: each
    # example stops at its own limit, and its counter counts its own steps.
    def f(x):
        def body(c):
            tx.set_state("vc_n", tx.get_state("vc_n", jnp.zeros((), jnp.int32)) + 1)
            return c + 1.0
        return eqxi.while_loop(lambda c: c < tx.get_state("vc_limit", jnp.float32(2.0)),
                               body, x, max_steps=16, kind=kind)

    pure, s0 = tx.uncurry(f, jnp.float32(0.0))
    limits = [1.0, 4.0, 2.5]
    batch = {"vc_limit": jnp.array(limits), "vc_n": jnp.array([10, 0, 5], jnp.int32)}
    outs, s1 = jax.vmap(pure, in_axes=(0, None))(batch, jnp.float32(0.0))
    expected_out, expected_n = [], []
    for limit, n0 in zip(limits, [10, 0, 5]):
        c, n = 0.0, n0
        while c < limit:
            c, n = c + 1.0, n + 1
        expected_out.append(c)
        expected_n.append(n)
    close(outs, expected_out)
    assert [int(n) for n in s1["vc_n"]] == expected_n
    assert [float(v) for v in s1["vc_limit"]] == limits


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
def test_eqxi_while_loop_vmap_of_reap_keeps_each_examples_last_sow(kind):
    # Under vmap the loop runs until every example is done; the value reaped
    # for an example is the last one its own iterations sowed.
    def f(x):
        def body(c):
            return h.sow(c * 2.0, tag="vr", name="last", mode="clobber")
        return eqxi.while_loop(lambda c: c < 10.0, body, x, max_steps=16, kind=kind)

    xs = jnp.array([1.0, 3.0, 0.25])
    outs, reaped = jax.vmap(h.call_and_reap(f, tag="vr"))(xs)
    expected = []
    for x in [1.0, 3.0, 0.25]:
        c = x
        while c < 10.0:
            c = c * 2.0
        expected.append(c)
    close(outs, expected)
    close(reaped["last"], expected)


def test_cond_on_unvmap_any_gives_each_example_its_own_branchs_state():
    # A cond whose predicate is reduced over the batch (as equinox's bounded
    # loop does): an example whose own predicate is false gets the false
    # branch's state change, as it would run alone.
    from jax import lax

    def f(x):
        def yes(c):
            tx.set_state("ua_n", tx.get_state("ua_n", jnp.zeros(())) + 1.0)
            return c + 1.0

        def no(c):
            tx.set_state("ua_n", tx.get_state("ua_n", jnp.zeros(())) - 10.0)
            return c

        return lax.cond(eqxi.unvmap_any(x > 0.0), yes, no, x)

    pure, s0 = tx.uncurry(f, 1.0)
    out, s1 = pure(s0, 1.0)  # no vmap: the reduction is the identity
    assert float(out) == 2.0 and float(s1["ua_n"]) == 1.0
    xs = jnp.array([1.0, -1.0, 2.0])
    outs, s2 = jax.vmap(pure, in_axes=(None, 0))(s0, xs)
    # The batched cond runs `yes` for every example (as equinox's loops do,
    # which mask their own carry); the state follows each example's own branch.
    close(outs, [2.0, 0.0, 3.0])
    close(s2["ua_n"], [1.0, -10.0, 1.0])


@pytest.mark.parametrize("kind", ["checkpointed", "bounded"])
def test_eqxi_while_loop_grad_inside(kind):
    loss = _loop_loss(kind)

    def f(x):
        return jax.value_and_grad(loss)(x)

    pure, s0 = tx.uncurry(f, 2.0)
    (out, g), s1 = pure(s0, 2.0)
    y, dy, n = _python_loop(2.0)
    close(out, y)
    close(g, dy)  # 1.0 * 1.1 * 1.2: the backward pass must see each step's state
    assert float(s1["wl_n"]) == n == 3.0  # the recomputation sets nothing


def test_eqxi_while_loop_lax_jvp_inside():
    loss = _loop_loss("lax")

    def f(x):
        return jax.jvp(loss, (x,), (jnp.ones(()),))

    pure, s0 = tx.uncurry(f, 2.0)
    (out, t), s1 = pure(s0, 2.0)
    y, dy, n = _python_loop(2.0)
    close(out, y)
    close(t, dy)
    assert float(s1["wl_n"]) == n


@pytest.mark.parametrize("kind", ["checkpointed", "bounded"])
def test_eqxi_while_loop_grad_from_outside(kind):
    loss = _loop_loss(kind)
    pure, s0 = tx.uncurry(loss, 2.0)
    g = jax.grad(lambda x: pure(s0, x)[0])(2.0)
    _, dy, _ = _python_loop(2.0)
    close(g, dy)


def _sowing_loop(kind, name, mode):
    """Three iterations doubling ``y``, each sowing the new value."""
    def f(x):
        def body(c):
            i, y = c
            return i + 1, h.sow(y * 2.0, tag="wl", name=name, mode=mode)
        return eqxi.while_loop(lambda c: c[0] < 3, body, (0, x), max_steps=3, kind=kind)[1]
    return f


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
def test_eqxi_while_loop_reap_append(kind):
    # An append sow in a while loop: oryx's rule (only clobber sows in a
    # while_loop), a clear error naming the sow, never rows of a wrong count.
    # equinox's bounded loop is a scan of nested conds, one branch running the
    # body: oryx's cond rule, which comes first there, names no sow.
    f = _sowing_loop(kind, "wl_rows", "append")
    error = (r"^Mismatching number of `sow`s between branches\.$" if kind == "bounded" else
             r"^Must use clobber or cond_clobber mode for 'wl_rows' inside of a `while_loop`\.$")
    with pytest.raises(ValueError, match=error):
        h.call_and_reap(f, tag="wl")(1.0)


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
def test_eqxi_while_loop_reap_plant_clobber(kind):
    f = _sowing_loop(kind, "last", "clobber")
    out, reaped = h.call_and_reap(f, tag="wl")(1.0)
    close(out, 8.0)
    close(reaped["last"], 8.0)  # the last value sown, as a Python loop's dict
    close(h.plant(f, tag="wl")({"last": 5.0}, 1.0), 5.0)


def _planted_rate_loop(loop: str, kind: str):
    """``y <- y * k + x`` five times, ``k`` a sow in the loop's body."""
    def g(x):
        if loop == "while":
            def body(c):
                i, y = c
                k = h.sow(jnp.float32(0.5), tag="rate", name="k", mode="clobber")
                return i + 1, y * k + x
            return eqxi.while_loop(lambda c: c[0] < 5, body, (0, x), max_steps=5, kind=kind)[1]

        def step(y, _):
            k = h.sow(jnp.float32(0.5), tag="rate", name="k", mode="clobber")
            return y * k + x, None
        return eqxi.scan(step, x, None, length=5, kind=kind, checkpoints=2)[0]
    return lambda k: h.plant(g, tag="rate")({"k": k}, jnp.float32(1.3))


def _rate_loop_by_hand(k, x=1.3):
    y = x
    for _ in range(5):
        y = y * k + x
    return y


@pytest.mark.parametrize("loop", ["while", "scan"])
def test_grad_wrt_a_value_planted_in_a_checkpointed_loop_is_an_error_naming_it(loop):
    # The loop is a custom_vjp whose bwd differentiates the loop's own inputs
    # only, behind a rule that stops the gradient of a loop whose inputs are
    # not differentiated: the planted value's derivative has no way back.
    f = _planted_rate_loop(loop, "checkpointed")
    close(f(0.7), _rate_loop_by_hand(0.7))  # the value is right
    with pytest.raises(NotImplementedError,
                       match=r"the value planted for 'k' is differentiated.*while loop inside "
                             r"the custom_vjp function"):
        jax.grad(f)(0.7)


def test_grad_wrt_a_value_planted_in_a_lax_kind_scan_is_the_loops():
    f = _planted_rate_loop("scan", "lax")
    close(f(0.7), _rate_loop_by_hand(0.7))
    close(jax.grad(f)(0.7), jax.grad(_rate_loop_by_hand)(0.7))


# --- filter_vmap with an axis name and tx.next_key ---------------------------

def test_filter_vmap_axis_name_next_key():
    def f(xs):
        return eqx.filter_vmap(lambda x: x + jax.random.normal(tx.next_key()),
                               axis_name="b")(xs)

    xs = jnp.zeros(3)
    pure, s0 = tx.uncurry(f, xs)
    out, s1 = pure(s0, xs)
    key, sub = jax.random.split(jax.random.key(0))
    want = jnp.stack([jax.random.normal(jax.random.fold_in(sub, i)) for i in range(3)])
    close(out, want)
    assert (jax.random.key_data(s1["rng"]) == jax.random.key_data(key)).all()


def test_filter_vmap_axis_name_psum_and_state():
    def f(xs):
        tx.set_state("fv_n", tx.get_state("fv_n", jnp.zeros(())) + 1.0)
        scale = tx.get_state("fv_scale", jnp.float32(2.0))
        return eqx.filter_vmap(lambda x: jax.lax.psum(x * scale, "b"), axis_name="b")(xs)

    xs = jnp.arange(3.0)
    pure, s0 = tx.uncurry(f, xs)
    out, s1 = pure(s0, xs)
    close(out, jnp.full(3, 6.0))
    assert float(s1["fv_n"]) == 1.0


# --- eqx.nn.BatchNorm: equinox's own state kept in taxpr state -----------------

def _bn():
    return eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, axis_name="batch", mode="ema")


def test_batchnorm_state_in_taxpr_state():
    bn, bn_state0 = _bn()
    leaves0, treedef = jax.tree.flatten(bn_state0)

    def f(x):
        leaves = [tx.get_state(f"bn/{i}", leaf) for i, leaf in enumerate(leaves0)]
        st = jax.tree.unflatten(treedef, leaves)
        y, st = eqx.filter_vmap(bn, axis_name="batch", in_axes=(0, None),
                                out_axes=(0, None))(x, st)
        for i, leaf in enumerate(jax.tree.leaves(st)):
            tx.set_state(f"bn/{i}", leaf)
        tx.set_state("bn_calls", tx.get_state("bn_calls", jnp.zeros((), jnp.int32)) + 1)
        return y

    xs = [jnp.arange(12.0).reshape(4, 3) * (k + 1) for k in range(3)]
    pure, s = tx.uncurry(f, xs[0])
    # reference: equinox's state threaded by hand, the same number of calls
    st = bn_state0
    for x in xs:
        out, s = jax.jit(pure)(s, x)
        want, st = eqx.filter_vmap(bn, axis_name="batch", in_axes=(0, None),
                                   out_axes=(0, None))(x, st)
        close(out, want, rtol=1e-5, atol=1e-5)
    for i, leaf in enumerate(jax.tree.leaves(st)):
        close(s[f"bn/{i}"], leaf, rtol=1e-5, atol=1e-5)
    assert int(s["bn_calls"]) == 3


# --- eqx.nn.Dropout with keys from tx.next_key --------------------------------

def _mlp():
    k1, k2 = jax.random.split(jax.random.key(42))
    return (eqx.nn.Linear(3, 8, key=k1), eqx.nn.Linear(8, 2, key=k2), eqx.nn.Dropout(0.5))


def _mlp_apply(model, x, key1, key2):
    lin1, lin2, drop = model
    hdn = drop(jax.nn.relu(lin1(x)), key=key1)
    return drop(lin2(hdn), key=key2)


def test_dropout_keys_from_next_key_match_hand_threaded():
    model, x = _mlp(), jnp.array([0.5, -1.0, 2.0])

    def f(model, x):
        return _mlp_apply(model, x, tx.next_key(), tx.next_key())

    pure, s = tx.uncurry(f, model, x)
    key = jax.random.key(0)
    for _ in range(2):  # two calls: new masks each call
        out, s = pure(s, model, x)
        key, k1 = jax.random.split(key)
        key, k2 = jax.random.split(key)
        close(out, _mlp_apply(model, x, k1, k2))
        g = eqx.filter_grad(lambda m: pure(s, m, x)[0].sum())(model)
        kk, k1b = jax.random.split(key)
        kk, k2b = jax.random.split(kk)
        g_want = eqx.filter_grad(lambda m: _mlp_apply(m, x, k1b, k2b).sum())(model)
        close(g[0].weight, g_want[0].weight)
        close(g[1].weight, g_want[1].weight)
    assert (jax.random.key_data(s["rng"]) == jax.random.key_data(key)).all()


def test_dropout_seed_filter_jit():
    model, x = _mlp(), jnp.array([0.5, -1.0, 2.0])
    seeded = eqx.filter_jit(tx.seed(lambda m, x: _mlp_apply(m, x, tx.next_key(), tx.next_key()),
                                    jax.random.key(7)))
    key, k1 = jax.random.split(jax.random.key(7))
    _, k2 = jax.random.split(key)
    close(seeded(model, x), _mlp_apply(model, x, k1, k2))


# --- eqx.filter_checkpoint ----------------------------------------------------

@eqx.filter_checkpoint
def _ck_layer(x):
    tx.set_state("ck_n", tx.get_state("ck_n", jnp.zeros((), jnp.int32)) + 1)
    return jnp.sin(x) * tx.get_state("ck_scale", jnp.float32(1.0))


def _ck_grad_want(x):
    return 9.0 * np.cos(3.0 * np.sin(x)) * np.cos(x)


def test_filter_checkpoint_grad_inside():
    def f(x):
        tx.set_state("ck_scale", jnp.float32(3.0))
        return jax.grad(lambda x: _ck_layer(_ck_layer(x)))(x)

    pure, s0 = tx.uncurry(f, 0.3)
    g, s1 = pure(s0, 0.3)
    close(g, _ck_grad_want(0.3))
    assert int(s1["ck_n"]) == 2


def test_filter_checkpoint_grad_from_outside():
    def f(x):
        tx.set_state("ck_scale", jnp.float32(3.0))
        return _ck_layer(_ck_layer(x))

    pure, s0 = tx.uncurry(f, 0.3)
    (_, s1), = [pure(s0, 0.3)]
    assert int(s1["ck_n"]) == 2
    g = jax.grad(lambda x: pure(s0, x)[0])(0.3)
    close(g, _ck_grad_want(0.3))


# --- filter_custom_jvp / filter_custom_vjp ------------------------------------

@eqx.filter_custom_jvp
def _cj(x):
    tx.set_state("cj_n", tx.get_state("cj_n", jnp.zeros((), jnp.int32)) + 1)
    return x * tx.get_state("cj_scale", jnp.float32(1.0))


@_cj.def_jvp
def _cj_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _cj(x), 10.0 * t  # the rule runs the function once more (eagerly too)


def test_filter_custom_jvp_state_in_body_grad_inside():
    def f(x):
        tx.set_state("cj_scale", jnp.float32(2.0))
        return _cj(x), jax.grad(_cj)(x)

    pure, s0 = tx.uncurry(f, 1.5)
    (y, g), s1 = pure(s0, 1.5)
    close(y, 3.0)
    close(g, 10.0)
    assert int(s1["cj_n"]) == 2  # eager: the body once, the rule's call once


@eqx.filter_custom_vjp
def _cv(x, scale_hint):
    tx.set_state("cv_n", tx.get_state("cv_n", jnp.zeros((), jnp.int32)) + 1)
    return jnp.sin(x) * tx.get_state("cv_scale", jnp.float32(1.0))


@_cv.def_fwd
def _cv_fwd(perturbed, x, scale_hint):
    return _cv(x, scale_hint), x


@_cv.def_bwd
def _cv_bwd(residuals, g, perturbed, x, scale_hint):
    return g * scale_hint * jnp.cos(residuals)


def test_filter_custom_vjp_state_in_body_grad_inside():
    def f(x):
        tx.set_state("cv_scale", jnp.float32(2.0))
        return _cv(x, 7.0), jax.grad(lambda x: _cv(x, 7.0))(x)

    pure, s0 = tx.uncurry(f, 0.5)
    (y, g), s1 = pure(s0, 0.5)
    close(y, 2.0 * np.sin(0.5))
    close(g, 7.0 * np.cos(0.5))
    assert int(s1["cv_n"]) == 2  # eager: the call, and the fwd rule's call


def test_filter_custom_vjp_grad_from_outside():
    def f(x):
        tx.set_state("cv_scale", jnp.float32(2.0))
        return _cv(x, 7.0)

    pure, s0 = tx.uncurry(f, 0.5)
    out, s1 = pure(s0, 0.5)
    close(out, 2.0 * np.sin(0.5))
    assert int(s1["cv_n"]) == 1
    close(jax.grad(lambda x: pure(s0, x)[0])(0.5), 7.0 * np.cos(0.5))


def test_filter_custom_vjp_reap_sow_in_body():
    @eqx.filter_custom_vjp
    def fn(x):
        return h.sow(jnp.sin(x), tag="fcv", name="s") * 2.0

    fn.def_fwd(lambda perturbed, x: (fn(x), x))
    fn.def_bwd(lambda r, g, perturbed, x: g * 2.0 * jnp.cos(r))
    out, reaped = h.call_and_reap(fn, tag="fcv")(0.5)
    close(reaped["s"], np.sin(0.5))
    close(h.plant(fn, tag="fcv")({"s": 3.0}, 0.5), 6.0)


@eqx.filter_custom_vjp
def _fwd_sows(w, x):
    return jnp.sin(x) * w


@_fwd_sows.def_fwd
def _fwd_sows_fwd(perturbed, w, x):
    h.sow(jnp.cos(x) * w, tag="fcv", name="r", mode="clobber")
    return jnp.sin(x) * w, None


@_fwd_sows.def_bwd
def _fwd_sows_bwd(residuals, g, perturbed, w, x):
    return g * jnp.sin(x)


def test_filter_custom_vjp_fwd_sow_is_reaped_when_differentiated_from_outside():
    # equinox refuses a fwd traced with its ``*args`` perturbed: the harvest
    # still finds the fwd's sow. Eagerly the fwd runs only under
    # differentiation, and its sow is a constant w.r.t. w.
    x = np.float32(0.5)

    def loss(w):
        out, reaps = h.call_and_reap(_fwd_sows, tag="fcv")(w, x)
        return out + reaps["r"], reaps

    assert h.reap(_fwd_sows, tag="fcv")(np.float32(2.0), x) == {}
    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    for w in (np.float32(2.0), np.float32(-3.0)):  # the second call: warm caches
        (value, reaps), g = step(w)
        close(value, np.sin(x) * w + np.cos(x) * w)
        close(reaps["r"], np.cos(x) * w)
        close(g, np.sin(x))
        inside = h.reap(lambda w: jax.vjp(lambda w: _fwd_sows(w, x), w)[0], tag="fcv")(w)
        close(inside["r"], np.cos(x) * w)
    ws = np.array([1.0, 2.0, 3.0], np.float32)
    (values, reaps), gs = jax.vmap(jax.value_and_grad(loss, has_aux=True))(ws)
    close(reaps["r"], np.cos(x) * ws)
    close(gs, np.full(3, np.sin(x)))


# --- eqx.filter_jit of every taxpr transformation --------------------------------

def _sowing(x):
    return h.sow(x * 2.0, tag="t", name="a") + 1.0


def test_plant_signature_has_plants_first():
    params = list(inspect.signature(h.plant(_sowing, tag="t")).parameters)
    assert params[0] == "plants", params
    params = list(inspect.signature(h.harvest(_sowing, tag="t")).parameters)
    assert params[0] == "plants", params


def test_filter_jit_of_plant():
    assert float(eqx.filter_jit(h.plant(_sowing, tag="t"))({"a": 5.0}, 1.0)) == 6.0


def test_filter_jit_of_harvest():
    out, reaped = eqx.filter_jit(h.harvest(_sowing, tag="t"))({}, 1.5)
    assert float(out) == 4.0 and float(reaped["a"]) == 3.0


def test_filter_jit_of_reap_and_call_and_reap():
    assert float(eqx.filter_jit(h.reap(_sowing, tag="t"))(1.5)["a"]) == 3.0
    out, reaped = eqx.filter_jit(h.call_and_reap(_sowing, tag="t"))(1.5)
    assert float(out) == 4.0 and float(reaped["a"]) == 3.0


def test_filter_jit_of_uncurry_pure():
    pure, s0 = tx.uncurry(_program_a, 1.0)
    out, s1 = eqx.filter_jit(pure)(s0, 2.0)
    assert float(out) == 4.0 and float(s1["n"]) == 2.0


def test_filter_jit_of_seed():
    f = tx.seed(lambda x: x + jax.random.normal(tx.next_key()), jax.random.key(3))
    _, sub = jax.random.split(jax.random.key(3))
    close(eqx.filter_jit(f)(1.0), 1.0 + jax.random.normal(sub))


def test_filter_jit_of_pure_with_module_argument():
    lin = eqx.nn.Linear(2, 2, key=jax.random.key(1))

    def f(model, x):
        y = model(x)
        tx.set_state("fj_sum", tx.get_state("fj_sum", jnp.zeros(2)) + y)
        return y

    x = jnp.array([1.0, 2.0])
    pure, s = tx.uncurry(f, lin, x)
    for _ in range(2):
        out, s = eqx.filter_jit(pure)(s, lin, x)
    close(out, lin(x))
    close(s["fj_sum"], 2.0 * lin(x))


@pytest.mark.parametrize("kind", ["lax", "checkpointed"])
def test_eqxi_while_loop_vmap_after_a_plain_call_and_under_jit(kind):
    # Warm caches: the same pure function, called once without vmap, then
    # jitted and vmapped over states; each example counts its own steps.
    pure, s0 = tx.uncurry(_stepping_loop(kind, "vj"), jnp.float32(0.0))
    out, s1 = pure(s0, jnp.float32(0.0))
    assert float(out) == 3.0 and int(s1["vj_n"]) == 3
    ks = [0.5, 1.0, 3.0]
    batch = {"vj_k": jnp.array(ks), "vj_n": jnp.zeros(3, jnp.int32)}
    run = jax.jit(jax.vmap(pure, in_axes=(0, None)))
    for _ in range(2):  # the second call hits jit's cache
        _, s2 = run(batch, jnp.float32(0.0))
        assert [int(n) for n in s2["vj_n"]] == _python_step_counts(ks)


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
def test_cond_on_a_loop_result_sows_and_sets_as_eagerly(kind):
    # The loop's result depends on equinox's batch reduction only through its
    # number of steps (equinox masks the carry per example): a cond on it
    # takes each example's own branch, with or without vmap.
    from jax import lax

    def f(x):
        def body(c):
            i, y = c
            tx.set_state("cl_n", tx.get_state("cl_n", jnp.zeros(())) + 1.0)
            return i + 1, y * 0.5
        _, y = eqxi.while_loop(lambda c: c[0] < 2, body, (0, x), max_steps=2, kind=kind)

        def big(y):
            return h.sow(y, tag="cl", name="y", mode="strict")

        def small(y):
            tx.set_state("cl_small", tx.get_state("cl_small", jnp.zeros(())) + 1.0)
            return h.sow(-y, tag="cl", name="y", mode="strict")

        return lax.cond(y > 0.1, big, small, y)

    def eager(x):  # the Python loop with a dict
        y = x * 0.25
        return (y, {"cl_n": 2.0, "cl_small": 0.0}) if y > 0.1 else (
            -y, {"cl_n": 2.0, "cl_small": 1.0})

    pure, s0 = tx.uncurry(f, 1.0)
    for x in (1.0, 0.2):
        (out, s1), reaped = h.call_and_reap(pure, tag="cl")(s0, x)
        want, want_state = eager(x)
        close(out, want)
        close(reaped["y"], want)
        assert {k: float(v) for k, v in s1.items()} == want_state
    xs = jnp.array([1.0, 0.2])
    (outs, s2), reaped = jax.vmap(h.call_and_reap(pure, tag="cl"), in_axes=(None, 0))(s0, xs)
    close(outs, [eager(1.0)[0], eager(0.2)[0]])
    close(reaped["y"], outs)
    close(s2["cl_small"], [0.0, 1.0])
    close(s2["cl_n"], [2.0, 2.0])


def _counting_layer(state: str):
    """``layer(c, w) = sin(c) * w`` that counts its calls in ``state``."""
    def layer(c, w):
        tx.set_state(state, tx.get_state(state, jnp.zeros(())) + 1.0)
        return jnp.sin(c) * w
    return layer


def _checkpointed_loop_of(layer, inner: str, steps: int = 1):
    """An equinox checkpointed loop of ``steps`` steps, each applying
    ``layer(c, w)`` for w = 1 then 2: plainly (``plain``), in a lax.scan
    (``scan``), through jax.checkpoint (``checkpoint``), or checkpointed in a
    lax.scan (``scan_of_checkpoint``)."""
    from jax import lax

    call = jax.checkpoint(layer) if inner in ("checkpoint", "scan_of_checkpoint") else layer

    def step(x):
        if inner in ("scan", "scan_of_checkpoint"):
            return lax.scan(lambda c, w: (call(c, w), None), x, jnp.array([1.0, 2.0]))[0]
        return call(call(x, 1.0), 2.0)

    def loss(x):
        return eqxi.while_loop(lambda c: c[0] < steps, lambda c: (c[0] + 1, step(c[1])),
                               (0, x), max_steps=steps, kind="checkpointed")[1]
    return loss


@pytest.mark.parametrize("inner", ["plain", "scan", "checkpoint"])
def test_checkpointed_loop_grad_inside_counts_each_call_once(inner):
    # A checkpointed loop's body (one step) calls a layer twice: plainly, in a
    # lax.scan, or through jax.checkpoint. Under jax.grad inside, the
    # backward pass recomputes the step; the counter counts the forward's
    # calls only, as the Python loop does.
    loss = _checkpointed_loop_of(_counting_layer("ck_n"), inner)
    pure, s0 = tx.uncurry(lambda x: jax.value_and_grad(loss)(x), 0.5)
    (value, grad), s1 = pure(s0, 0.5)
    # by hand: y = 2 sin(sin x), dy/dx = 2 cos(sin x) cos x
    close(value, 2.0 * np.sin(np.sin(0.5)))
    close(grad, 2.0 * np.cos(np.sin(0.5)) * np.cos(0.5))
    assert float(s1["ck_n"]) == 2.0


def _grad_inside_keeps_the_key_stream(loss, seed: int):
    """``jax.value_and_grad(loss)`` inside ``tx.uncurry``: its value and key
    stream are those of ``loss`` run without grad. Returns ``(value, grad)``."""
    plain, s0 = tx.uncurry(loss, 0.5)
    s0 = {**s0, "rng": jax.random.key(seed)}
    value_plain, s_plain = plain(s0, 0.5)
    with_grad, _ = tx.uncurry(lambda x: jax.value_and_grad(loss)(x), 0.5)
    (value, grad), s1 = with_grad(s0, 0.5)
    close(value, value_plain)
    assert (jax.random.key_data(s1["rng"]).tolist()
            == jax.random.key_data(s_plain["rng"]).tolist())
    return value, grad


@pytest.mark.parametrize("inner", ["scan", "checkpoint"])
def test_checkpointed_loop_grad_inside_draws_the_forwards_keys(inner):
    # Keys drawn inside a scan or a checkpoint of a checkpointed loop's body:
    # under jax.grad inside, the backward pass's recomputation draws nothing
    # new, so the value and the key stream are those of the run without grad.
    # A gradient that depends on the draws is the documented StateError (what
    # the recomputation reads depends on the order of its restarts).
    from jax import lax

    def make(scale_by_draw):
        def layer(c, w):
            u = jax.random.uniform(tx.next_key(), minval=0.5, maxval=1.5)
            return c * u * w if scale_by_draw else c * w + lax.stop_gradient(u)
        return _checkpointed_loop_of(layer, inner, steps=2)

    _, grad = _grad_inside_keeps_the_key_stream(make(scale_by_draw=False), seed=7)
    close(grad, 4.0)  # two steps of w = 1, 2
    dependent = make(scale_by_draw=True)
    with pytest.raises(tx.StateError, match="state 'rng'"):
        tx.uncurry(lambda x: jax.value_and_grad(dependent)(x), 0.5)


def test_checkpointed_loop_grad_inside_counts_calls_in_a_custom_vjp_loop_once():
    # The loop's body calls a custom_vjp whose function runs a lax.fori_loop
    # of counting layers (diffrax's solver steps). equinox linearizes the
    # body speculatively in the forward pass, then again in the backward
    # pass: the counter counts the forward's calls only.
    from jax import lax

    layer = _counting_layer("ckv_n")

    @jax.custom_vjp
    def twice(x):
        return lax.fori_loop(1, 3, lambda i, c: layer(c, i.astype(jnp.float32)), x)

    def twice_fwd(x):
        return twice(x), x

    def twice_bwd(x, g):  # by hand: d/dx 2 sin(sin x)
        return (g * 2.0 * jnp.cos(jnp.sin(x)) * jnp.cos(x),)

    twice.defvjp(twice_fwd, twice_bwd)

    def loss(x):
        return eqxi.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, twice(c[1])),
                               (0, x), max_steps=2, kind="checkpointed")[1]

    pure, s0 = tx.uncurry(lambda x: jax.value_and_grad(loss)(x), 0.5)
    (value, grad), s1 = pure(s0, 0.5)
    y1 = 2.0 * np.sin(np.sin(0.5))
    close(value, 2.0 * np.sin(np.sin(y1)))
    close(grad, 2.0 * np.cos(np.sin(y1)) * np.cos(y1) * 2.0 * np.cos(np.sin(0.5)) * np.cos(0.5))
    assert float(s1["ckv_n"]) == 4.0


@pytest.mark.parametrize("inner", ["checkpoint", "scan_of_checkpoint"])
def test_checkpointed_loop_in_a_scan_grad_inside_counts_each_call_once(inner):
    # As above, the loop now inside a lax.scan, the layer checkpointed in the
    # loop's body (directly or in a scan).
    from jax import lax

    loop = _checkpointed_loop_of(_counting_layer("cks_n"), inner)

    def loss(x):
        return lax.scan(lambda c, _: (loop(c), None), x, None, length=1)[0]

    pure, s0 = tx.uncurry(lambda x: jax.value_and_grad(loss)(x), 0.5)
    (value, grad), s1 = pure(s0, 0.5)
    close(value, 2.0 * np.sin(np.sin(0.5)))
    close(grad, 2.0 * np.cos(np.sin(0.5)) * np.cos(0.5))
    assert float(s1["cks_n"]) == 2.0


@pytest.mark.parametrize("inner", ["checkpoint", "scan_of_checkpoint"])
def test_checkpointed_loop_in_a_scan_grad_inside_draws_the_forwards_keys(inner):
    # Keys drawn in a checkpointed layer of a checkpointed loop that a
    # differentiated lax.scan runs twice: the stream advances as without grad.
    from jax import lax

    def layer(c, w):
        return c * w + lax.stop_gradient(jax.random.uniform(tx.next_key()))

    loop = _checkpointed_loop_of(layer, inner)

    def loss(x):
        return lax.scan(lambda c, _: (loop(c), None), x, None, length=2)[0]

    value, grad = _grad_inside_keeps_the_key_stream(loss, seed=3)
    close(grad, 4.0)  # two scan steps of w = 1, 2
    # by hand: four draws from the stream, in program order
    key, expected = jax.random.key(3), 0.5
    for w in (1.0, 2.0, 1.0, 2.0):
        key, sub = jax.random.split(key)
        expected = expected * w + float(jax.random.uniform(sub))
    close(value, expected)


# --- a vmap inside the transformed function, around an equinox loop ----------
# equinox runs the batched loop while any example runs and masks its carry;
# each example's own predicate guards the body's tags (a read reads, a
# clobber sow keeps the example's last value, a set is the documented
# per-example StateError, as for lax.while_loop with a batched predicate).

_YS = np.array([1.0, 2.0, 5.0], np.float32)


def _halving_loop(kind, body_effect):
    def loop(y):
        def body(c):
            i, y = c
            body_effect()
            y = h.sow(y * tx.get_state("rate", jnp.float32(0.5)), tag="t", name="last",
                      mode="clobber")
            return i + 1, y
        return eqxi.while_loop(lambda c: c[1] > 0.1, body, (0, y), max_steps=50, kind=kind)
    return lambda ys: jax.vmap(loop)(ys)


def _halving_reference(ys, rate=0.5):
    steps, last = [], []
    for y in ys:
        i = 0
        while y > 0.1:
            y, i = y * rate, i + 1
        steps.append(i)
        last.append(y)
    return np.array(steps), np.array(last, np.float32)


@pytest.mark.parametrize("kind", ["lax", "checkpointed"])
def test_vmap_inside_uncurry_loop_reads_state_per_example(kind):
    f = _halving_loop(kind, lambda: None)
    pure, s0 = tx.uncurry(f, _YS)
    (steps, ys), s1 = jax.jit(pure)({**s0, "rate": jnp.float32(0.25)}, _YS)
    ref_steps, ref_last = _halving_reference(_YS, 0.25)
    np.testing.assert_array_equal(steps, ref_steps)
    np.testing.assert_allclose(ys, ref_last)
    assert float(s1["rate"]) == 0.25


@pytest.mark.parametrize("kind", ["lax", "checkpointed"])
def test_vmap_inside_reap_keeps_each_examples_last_sow(kind):
    reaped = h.reap(_halving_loop(kind, lambda: None), tag="t")(_YS)
    np.testing.assert_allclose(reaped["last"], _halving_reference(_YS)[1])


@pytest.mark.parametrize("kind", ["lax", "checkpointed"])
def test_vmap_inside_plant_stops_each_example_as_eagerly(kind):
    steps, ys = h.plant(_halving_loop(kind, lambda: None), tag="t")(
        {"last": jnp.array([0.05, 0.2, 0.01], jnp.float32)}, _YS)
    # planted 0.2 keeps the second example running until max_steps
    np.testing.assert_array_equal(steps, [1, 50, 1])


@pytest.mark.parametrize("kind", ["lax", "checkpointed"])
def test_vmap_inside_uncurry_loop_set_state_is_a_per_example_error(kind):
    def count():
        tx.set_state("n", tx.get_state("n", 0) + 1)
    with pytest.raises(tx.StateError, match=r"state 'n'.*while\[body\].*batched by vmap"):
        tx.uncurry(_halving_loop(kind, count), _YS)


def test_vmap_inside_bounded_loop_with_tags_is_a_clear_error():
    with pytest.raises(NotImplementedError, match=r"cond at .*scan.*whole batch of a vmap"):
        tx.uncurry(_halving_loop("bounded", lambda: None), _YS)


def test_vmap_inside_loop_condition_callback_runs_as_without_taxpr():
    """Guarding the body by each example's predicate evaluates no effect of
    the loop's condition again: its callback runs as often as without taxpr."""
    calls = []

    def loop(y, rate):
        def cond(c):
            jax.debug.callback(lambda: calls.append(1))
            return c[1] > 0.1
        return eqxi.while_loop(cond, lambda c: (c[0] + 1, c[1] * rate()), (0, y),
                               max_steps=50, kind="lax")

    jax.block_until_ready(jax.jit(jax.vmap(lambda y: loop(y, lambda: 0.5)))(_YS))
    jax.effects_barrier()
    want, calls[:] = len(calls), []
    pure, s0 = tx.uncurry(
        lambda ys: jax.vmap(lambda y: loop(y, lambda: tx.get_state("rate", 0.5)))(ys), _YS)
    calls.clear()
    (steps, _), _ = jax.jit(pure)(s0, _YS)
    jax.effects_barrier()
    np.testing.assert_array_equal(steps, _halving_reference(_YS)[0])
    assert want > 0 and len(calls) == want


def test_vmap_of_vmap_inside_after_warm_caches_reads_state_per_example():
    """Two nested vmaps inside the transformed function, after JAX's caches
    were warmed by the same loop without taxpr."""
    ys = np.array([[1.0, 2.0], [5.0, 0.5]], np.float32)

    def loop(y, rate):
        return eqxi.while_loop(lambda c: c[1] > 0.1, lambda c: (c[0] + 1, c[1] * rate()),
                               (0, y), max_steps=50, kind="checkpointed")

    jax.jit(jax.vmap(jax.vmap(lambda y: loop(y, lambda: 0.5))))(ys)
    pure, s0 = tx.uncurry(lambda ys: jax.vmap(jax.vmap(
        lambda y: loop(y, lambda: tx.get_state("rate", jnp.float32(0.5)))))(ys), ys)
    (steps, last), _ = pure({"rate": jnp.float32(0.25)}, ys)
    ref_steps, ref_last = _halving_reference(ys.ravel(), 0.25)
    np.testing.assert_array_equal(steps, ref_steps.reshape(2, 2))
    np.testing.assert_allclose(last, ref_last.reshape(2, 2))


# --- KV caches of layers stacked with filter_vmap and applied under lax.scan ----

_D, _MAX, _LAYERS, _STEPS = 8, 6, 3, 5


class _CachedAttention(eqx.Module):
    """One head; ``__call__(x, pos, layer)`` decodes one position, its keys
    and values kept in one state holding every layer's cache (the layers run
    inside a scan, so one traced body serves them all)."""

    qkv: eqx.nn.Linear

    def __init__(self, key):
        self.qkv = eqx.nn.Linear(_D, 3 * _D, key=key)

    def __call__(self, x, pos, layer):
        q, k, v = jnp.split(self.qkv(x), 3)
        cache = tx.get_state("kv", {"k": jnp.zeros((_LAYERS, _MAX, _D)),
                                    "v": jnp.zeros((_LAYERS, _MAX, _D))})
        cache = {"k": cache["k"].at[layer, pos].set(k), "v": cache["v"].at[layer, pos].set(v)}
        tx.set_state("kv", cache)
        scores = jnp.where(jnp.arange(_MAX) <= pos, cache["k"][layer] @ q, -jnp.inf)
        return x + jax.nn.softmax(scores) @ cache["v"][layer]

    def full(self, xs):
        q, k, v = jnp.split(jax.vmap(self.qkv)(xs), 3, axis=-1)
        n = len(xs)
        scores = jnp.where(jnp.tril(jnp.ones((n, n), bool)), q @ k.T, -jnp.inf)
        return xs + jax.nn.softmax(scores, axis=-1) @ v


def test_kv_cache_of_layers_stacked_with_filter_vmap_under_scan():
    layers = eqx.filter_vmap(_CachedAttention)(jax.random.split(jax.random.key(0), _LAYERS))
    params, static = eqx.partition(layers, eqx.is_array)

    def decode(x):
        pos = tx.get_state("pos", jnp.int32(0))

        def one_layer(h, layer_and_params):
            i, p = layer_and_params
            return eqx.combine(p, static)(h, pos, i), None

        h, _ = jax.lax.scan(one_layer, x, (jnp.arange(_LAYERS), params))
        tx.set_state("pos", pos + 1)
        return h

    step, state0 = tx.uncurry(decode, jnp.zeros(_D))
    xs = jax.random.normal(jax.random.key(1), (_STEPS, _D))

    @jax.jit
    def run(state, xs):
        def body(state, x):
            out, state = step(state, x)
            return state, out
        return jax.lax.scan(body, state, xs)

    state, outs = run(state0, xs)
    # Reference: the layers one after another on the whole sequence, no cache.
    want = xs
    for i in range(_LAYERS):
        layer = jax.tree_util.tree_map(lambda a: a[i], params)
        want_kv = jnp.split(jax.vmap(eqx.combine(layer, static).qkv)(want), 3, axis=-1)[1:]
        close(state["kv"]["k"][i, :_STEPS], want_kv[0], rtol=1e-5, atol=1e-5)
        close(state["kv"]["v"][i, :_STEPS], want_kv[1], rtol=1e-5, atol=1e-5)
        want = eqx.combine(layer, static).full(want)
    close(outs, want, rtol=1e-4, atol=1e-5)
    assert int(state["pos"]) == _STEPS


# --- harvest of functions taking equinox modules ------------------------------

def _sowing_mlp():
    """An MLP (its activation functions are pytree leaves that are not
    arrays) and a forward pass sowing the hidden layer."""
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(1))

    def forward(m, x):
        hidden = h.sow(m.activation(m.layers[0](x)), tag="mlp", name="hidden", mode="clobber")
        return m.layers[1](hidden)

    return model, forward


def test_harvest_of_a_function_taking_an_equinox_module():
    # The module's non-array leaves are static, as eqx.filter_jit treats them;
    # its arrays (and the input) are traced.
    model, forward = _sowing_mlp()
    x = jnp.arange(2.0)
    hidden = jax.nn.relu(model.layers[0](x))
    out, reaped = h.call_and_reap(forward, tag="mlp")(model, x)
    close(out, model.layers[1](hidden))
    close(reaped["hidden"], hidden)
    close(h.reap(forward, tag="mlp")(model, x)["hidden"], hidden)
    planted = jnp.ones(4)
    close(h.plant(forward, tag="mlp")({"hidden": planted}, model, x), model.layers[1](planted))
    out, reaped = h.harvest(forward, tag="mlp")({"hidden": planted}, model, x)
    close(out, model.layers[1](planted))
    assert reaped == {}
    # jitted and vmapped with equinox, differentiated with respect to the module
    xs = jnp.arange(6.0).reshape(3, 2)
    _, reaped = eqx.filter_jit(h.call_and_reap(
        lambda m, xs: eqx.filter_vmap(forward, in_axes=(None, 0))(m, xs), tag="mlp"))(model, xs)
    close(reaped["hidden"], jax.nn.relu(jax.vmap(model.layers[0])(xs)))
    grads = eqx.filter_grad(lambda m: h.plant(forward, tag="mlp")({"hidden": planted}, m, x).sum())(
        model)
    want = eqx.filter_grad(lambda m: m.layers[1](planted).sum())(model)
    close(grads.layers[1].weight, want.layers[1].weight)
    close(grads.layers[0].weight, jnp.zeros_like(model.layers[0].weight))  # planted over


# --- tx.value_and_grad: truncated backpropagation through time ---------------

def test_gru_trained_with_its_hidden_state_in_a_state_by_truncated_bptt():
    # An equinox GRU cell trained by SGD over chunks of a sequence: the
    # hidden state lives in a state across chunks (taxpr threads it), each
    # chunk's loss is differentiated through the hidden state within the
    # chunk (tx.value_and_grad) and not into earlier chunks (the state's
    # value before the call is a constant). Reference: the same loop with
    # the hidden state carried by hand and stop_gradient at chunk starts.
    cell = eqx.nn.GRUCell(2, 3, key=jax.random.key(0))
    params, static = eqx.partition(cell, eqx.is_array)

    def sgd(params, g):
        return jax.tree.map(lambda p, d: p - 0.05 * d, params, g)

    xs = jnp.sin(jnp.linspace(0.0, 6.0, 24)).reshape(4, 3, 2)  # 4 chunks of 3 steps
    targets = jnp.cos(jnp.linspace(0.0, 6.0, 36)).reshape(4, 3, 3)

    def chunk_loss(params, xs, ys):
        cell = eqx.combine(params, static)

        def step(loss, xy):
            h = cell(xy[0], tx.get_state("h", lambda: jnp.zeros(3)))
            tx.set_state("h", h)
            return loss + jnp.sum((h - xy[1]) ** 2), None
        return jax.lax.scan(step, 0.0, (xs, ys))[0]

    def train(params, xs, targets):
        def chunk(params, xy):
            loss, g = tx.value_and_grad(chunk_loss)(params, *xy)
            return sgd(params, g), loss
        return jax.lax.scan(chunk, params, (xs, targets))

    def by_hand(params, xs, targets):
        def loss_from(params, h, xs, ys):
            cell = eqx.combine(params, static)

            def step(carry, xy):
                loss, h = carry
                h = cell(xy[0], h)
                return (loss + jnp.sum((h - xy[1]) ** 2), h), None
            (loss, h), _ = jax.lax.scan(step, (0.0, h), (xs, ys))
            return loss, h

        h, losses = jnp.zeros(3), []
        for c in range(xs.shape[0]):
            (loss, h), g = jax.value_and_grad(loss_from, has_aux=True)(
                params, jax.lax.stop_gradient(h), xs[c], targets[c])
            params = sgd(params, g)
            losses.append(loss)
        return params, jnp.stack(losses), h

    pure, state0 = tx.uncurry(train, params, xs, targets)
    (trained, losses), state = eqx.filter_jit(pure)(state0, params, xs, targets)
    trained_ref, losses_ref, h_ref = by_hand(params, xs, targets)
    close(losses, losses_ref)
    close(state["h"], h_ref)
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(trained_ref)):
        close(a, b)
    # Training moved every parameter array (the gradient is not zero).
    assert all(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(trained),
                                                     jax.tree.leaves(params)))

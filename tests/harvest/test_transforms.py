"""taxpr.harvest._transforms: public names, signatures, reap/plant/harvest/perturb."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np

import taxpr as tx
from taxpr import harvest as h

from harvest_helpers import T, allclose, assert_tree_allclose, raises, _basic


# ---- names and signatures ----------------------------------------------------------

def test_public_names():
    for name in ["sow", "sow_cond", "reap", "call_and_reap", "plant", "harvest", "nest",
                 "sow_p"]:
        assert hasattr(h, name), name
    assert set(h.__all__) >= {"sow", "sow_cond", "reap", "call_and_reap", "plant", "harvest",
                              "nest", "sow_p"}
    assert tx.harvest is h
    # sow_p is the primitive that sow binds.
    closed = jax.make_jaxpr(lambda x: h.sow(x, tag=T, name="a"))(1.0)
    assert [e.primitive for e in closed.jaxpr.eqns] == [h.sow_p]


def _sig(fn):
    return {n: (p.kind, p.default) for n, p in inspect.signature(fn).parameters.items()}


def test_signatures():
    K, E, POS = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty,
                 inspect.Parameter.POSITIONAL_OR_KEYWORD)
    assert _sig(h.sow) == {"value": (POS, E), "tag": (K, E), "name": (K, E),
                           "mode": (K, "strict"), "key": (K, None)}
    s = _sig(h.sow_cond)
    assert list(s)[:2] == ["value", "pred"]
    assert s["tag"] == (K, E) and s["name"] == (K, E)
    for fn in (h.reap, h.call_and_reap, h.plant, h.harvest):
        s = _sig(fn)
        # oryx's signature, plus taxpr's keyword-only ``strict`` last
        assert list(s) == ["f", "tag", "allowlist", "blocklist", "exclusive", "strict"], fn
        assert s["strict"] == (K, False)
        assert s["tag"] == (K, E)
        assert s["allowlist"] == (K, None)
        assert tuple(s["blocklist"][1]) == () and s["blocklist"][0] == K
        assert s["exclusive"] == (K, False)
    s = _sig(h.nest)
    assert list(s) == ["f", "scope"] and s["scope"] == (K, E)


# ---- reap / call_and_reap / plant / harvest --------------------------------------

def test_reap_returns_dict():
    assert_tree_allclose(h.reap(_basic, tag=T)(3.0), {"a": 6.0, "b": 7.0})


def test_call_and_reap():
    out, reaps = h.call_and_reap(_basic, tag=T)(3.0)
    allclose(out, 42.0)
    assert_tree_allclose(reaps, {"a": 6.0, "b": 7.0})


def test_plant():
    allclose(h.plant(_basic, tag=T)({"a": 10.0}, 3.0), 10.0 * 11.0)
    allclose(h.plant(_basic, tag=T)({"b": 10.0}, 3.0), 6.0 * 10.0)
    allclose(h.plant(_basic, tag=T)({"a": 1.0, "b": 5.0}, 3.0), 5.0)
    allclose(h.plant(_basic, tag=T)({}, 3.0), 42.0)


def test_harvest_planted_names_not_reaped():
    out, reaps = h.harvest(_basic, tag=T)({"a": 10.0}, 3.0)
    allclose(out, 110.0)
    assert_tree_allclose(reaps, {"b": 11.0})
    out, reaps = h.harvest(_basic, tag=T)({}, 3.0)
    allclose(out, 42.0)
    assert_tree_allclose(reaps, {"a": 6.0, "b": 7.0})


def test_key_is_accepted():
    f = lambda x: h.sow(x * 2, tag=T, name="a", key=x + 1, mode="clobber") + 1
    out, reaps = h.call_and_reap(f, tag=T)(3.0)
    allclose(out, 7.0)
    assert_tree_allclose(reaps, {"a": 6.0})
    allclose(h.plant(f, tag=T)({"a": 1.0}, 3.0), 2.0)


def test_kwargs_and_pytree_args():
    def f(d, *, scale):
        return h.sow(d["u"] * scale, tag=T, name="a") + d["v"]

    out, reaps = h.call_and_reap(f, tag=T)({"u": 2.0, "v": 1.0}, scale=3.0)
    allclose(out, 7.0)
    assert_tree_allclose(reaps, {"a": 6.0})


def test_array_values_and_dtypes():
    def f(x, i):
        h.sow(i * 2, tag=T, name="i")
        return h.sow(x.T, tag=T, name="xt") @ x

    x = jnp.arange(6.0).reshape(2, 3)
    out, reaps = h.call_and_reap(f, tag=T)(x, jnp.int32(4))
    allclose(out, np.arange(6.0).reshape(2, 3).T @ np.arange(6.0).reshape(2, 3))
    allclose(reaps["xt"], np.arange(6.0).reshape(2, 3).T)
    assert reaps["i"].dtype == jnp.int32 and int(reaps["i"]) == 8


def _pytree_sow(x):
    v = h.sow({"p": x, "q": (x + 1, x + 2)}, tag=T, name="b")
    return v["p"] + v["q"][1]


def test_reap_pytree_value_keeps_structure():
    assert_tree_allclose(h.reap(_pytree_sow, tag=T)(1.0), {"b": {"p": 1.0, "q": (2.0, 3.0)}})


def test_plant_pytree_value():
    out = h.plant(_pytree_sow, tag=T)({"b": {"p": 10.0, "q": (0.0, 5.0)}}, 1.0)
    allclose(out, 15.0)


def test_plant_tuple_value():
    def f(x):
        a, b = h.sow((x, x * 2), tag=T, name="ab")
        return a * b

    allclose(h.plant(f, tag=T)({"ab": (3.0, 4.0)}, 1.0), 12.0)


# ---- perturb: gradients with respect to sown values ---------------------------------------

def _mlp_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (3, 4)) * 0.5, "w2": jax.random.normal(k2, (4, 2)) * 0.5}


def _mlp_loss(params, x):
    hidden = h.sow(jnp.tanh(x @ params["w1"]), tag="act", name="hidden")
    out = h.sow(hidden @ params["w2"], tag="act", name="out")
    return jnp.sum(out ** 2)


def _mlp_loss_by_hand(params, x, d_hidden, d_out):
    # The same MLP with the perturbations written in.
    hidden = jnp.tanh(x @ params["w1"]) + d_hidden
    out = hidden @ params["w2"] + d_out
    return jnp.sum(out ** 2)


def test_perturb_gives_the_gradient_wrt_sown_activations_in_one_backward_pass():
    params, x = _mlp_params(), jnp.array([[0.5, -1.0, 2.0], [1.0, 0.0, -0.5]])
    zeros = jax.tree.map(jnp.zeros_like, h.reap(_mlp_loss, tag="act")(params, x))
    assert set(zeros) == {"hidden", "out"}
    loss, (d_acts, d_params) = jax.jit(jax.value_and_grad(
        h.perturb(_mlp_loss, tag="act"), argnums=(0, 1)))(zeros, params, x)
    want = jax.grad(_mlp_loss_by_hand, argnums=(0, 2, 3))(
        params, x, zeros["hidden"], zeros["out"])
    np.testing.assert_allclose(loss, _mlp_loss(params, x), rtol=1e-6)
    np.testing.assert_allclose(d_acts["hidden"], want[1], rtol=1e-5)
    np.testing.assert_allclose(d_acts["out"], want[2], rtol=1e-5)
    # The sown values keep their derivative: the parameters' gradient is f's.
    for k in params:
        np.testing.assert_allclose(d_params[k], want[0][k], rtol=1e-5)
    # d loss / d out = 2 out, by hand; and a central finite difference for one entry.
    out = jnp.tanh(x @ params["w1"]) @ params["w2"]
    np.testing.assert_allclose(d_acts["out"], 2 * out, rtol=1e-5)
    eps = 1e-2
    bump = zeros["hidden"].at[0, 1].set(eps)
    fd = (_mlp_loss_by_hand(params, x, bump, zeros["out"])
          - _mlp_loss_by_hand(params, x, -bump, zeros["out"])) / (2 * eps)
    np.testing.assert_allclose(d_acts["hidden"][0, 1], fd, rtol=1e-3)


def test_perturb_equals_plant_and_differentiate():
    params, x = _mlp_params(), jnp.ones((1, 3))
    acts = h.reap(_mlp_loss, tag="act")(params, x)
    d_perturb = jax.grad(h.perturb(_mlp_loss, tag="act"))(
        jax.tree.map(jnp.zeros_like, acts), params, x)
    # Planting the sown value itself, differentiated w.r.t. the planted
    # value: only the output's direct dependence, as plant's derivative rule says.
    d_plant = jax.grad(lambda a: h.plant(_mlp_loss, tag="act", allowlist=["out"])(
        a, params, x))({"out": acts["out"]})
    np.testing.assert_allclose(d_perturb["out"], d_plant["out"], rtol=1e-6)


def test_perturb_of_append_sows_in_scan_is_one_row_per_iteration():
    def f(xs):
        def body(c, x):
            y = h.sow(jnp.tanh(c * x), tag="s", name="y", mode="append")
            return c + y, None
        return jax.lax.scan(body, 1.0, xs)[0]

    def by_hand(xs, deltas):  # the Python loop with the perturbations added
        c = 1.0
        for x, d in zip(xs, deltas):
            c = c + jnp.tanh(c * x) + d
        return c

    xs = jnp.array([1.0, 2.0, 0.5])
    zeros = {"y": jnp.zeros(3)}
    d_rows, d_xs = jax.grad(h.perturb(f, tag="s"), argnums=(0, 1))(zeros, xs)
    want_rows, want_xs = jax.grad(by_hand, argnums=(1, 0))(xs, jnp.zeros(3))
    np.testing.assert_allclose(d_rows["y"], want_rows, rtol=1e-5)
    np.testing.assert_allclose(d_xs, want_xs, rtol=1e-5)
    # A nonzero perturbation changes the value as the loop says.
    deltas = jnp.array([0.1, -0.2, 0.3])
    np.testing.assert_allclose(h.perturb(f, tag="s")({"y": deltas}, xs), by_hand(xs, deltas),
                               rtol=1e-6)


def test_perturb_under_vmap_per_example():
    params = _mlp_params()
    xs = jnp.arange(6.0).reshape(2, 1, 3) / 6.0
    zeros = jax.tree.map(jnp.zeros_like, h.reap(_mlp_loss, tag="act")(params, xs[0]))
    grads = jax.vmap(jax.grad(h.perturb(_mlp_loss, tag="act")), in_axes=(None, None, 0))(
        zeros, params, xs)
    for i in range(2):
        want = jax.grad(_mlp_loss_by_hand, argnums=(2, 3))(params, xs[i], zeros["hidden"],
                                                             zeros["out"])
        np.testing.assert_allclose(grads["hidden"][i], want[0], rtol=1e-5)
        np.testing.assert_allclose(grads["out"][i], want[1], rtol=1e-5)


def test_perturb_errors_name_the_sow():
    params, x = _mlp_params(), jnp.ones((1, 3))
    raises(ValueError, r"^Perturbation for 'out' has type float32\[5\], but the sow at "
           r"<top level> has type float32\[1, 2\]", h.perturb(_mlp_loss, tag="act"),
           {"out": jnp.zeros(5)}, params, x)
    raises(ValueError, r"rows\(\.\.\.\) given as the perturbation of 'out'",
           h.perturb(_mlp_loss, tag="act"), {"out": h.rows({0: jnp.zeros(2)})}, params, x)
    assert list(inspect.signature(h.perturb(_mlp_loss, tag="act")).parameters) == [
        "perturbations", "params", "x"]

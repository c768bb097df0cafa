"""The tag primitive."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import partial_eval as pe

import taxpr as tx
from helpers import check, hlo_ops, n_tags, tag_paths

# ---- identity on many kinds of values ------------------------------------------------

VALUES = {
    "float32": lambda: jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3),
    "float16": lambda: jnp.ones(3, jnp.float16),
    "int32": lambda: jnp.arange(5, dtype=jnp.int32),
    "uint8": lambda: jnp.arange(5, dtype=jnp.uint8),
    "bool": lambda: jnp.array([True, False, True]),
    "complex64": lambda: jnp.array([1 + 2j, 3 - 1j], jnp.complex64),
    "bfloat16": lambda: jnp.linspace(0, 1, 4).astype(jnp.bfloat16),
    "empty": lambda: jnp.zeros((0, 3)),
    "scalar": lambda: jnp.float32(2.5),
    "prng_key": lambda: jax.random.key(0),
    "prng_keys": lambda: jax.random.split(jax.random.key(1), 3),
    "pytree": lambda: {"a": jnp.ones(2), "b": (jnp.arange(3), [jnp.array(True)]),
                       "c": jax.random.key(2)},
    "python_scalars": lambda: (1, 2.0, True),
}


def _same(a, b):
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        x, y = jnp.asarray(x), jnp.asarray(y)
        assert x.shape == y.shape and x.dtype == y.dtype
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind", sorted(VALUES))
def test_identity_eager(kind):
    v = VALUES[kind]()
    out = tx.tag(v, op="get", id=0)
    _same(out, v)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(v)


@pytest.mark.parametrize("kind", sorted(VALUES))
def test_identity_jit(kind):
    v = VALUES[kind]()
    out = jax.jit(lambda v: tx.tag(v, op="get", id=0))(v)
    _same(out, v)
    j = jax.make_jaxpr(lambda v: tx.tag(v, op="get", id=0))(v)
    check(j)
    (site,) = tx.find_tags(j)
    assert jax.tree_util.tree_structure(site.shape) == jax.tree_util.tree_structure(v)


def test_outside_trace_returns_values_unchanged():
    x = np.arange(3.0)
    assert tx.tag(x, a=1) is x
    assert tx.tag(2.0, a=1) == 2.0
    tree = {"a": x, "b": [1, 2]}
    assert tx.tag(tree)["a"] is x
    assert tx.tag({}) == {}
    assert tx.tag(None) is None


def test_empty_pytree_under_jit():
    out = jax.jit(lambda x: (tx.tag((), a=1), x))(1.0)
    assert out[0] == ()


def test_prng_key_usable_after_tag():
    k = jax.random.key(0)
    want = jax.random.normal(k, (3,))
    got = jax.jit(lambda k: jax.random.normal(tx.tag(k, op="rng"), (3,)))(k)
    np.testing.assert_array_equal(got, want)
    got = jax.jit(jax.vmap(lambda k: jax.random.normal(tx.tag(k, op="rng"))))(
        jax.random.split(k, 4))
    assert got.shape == (4,)


# ---- weak types ------------------------------------------------------------------------

@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit], ids=["eager", "jit"])
def test_weak_type_preserved(wrap):
    x = jnp.ones(3, jnp.float16)
    want = x + 1.0
    got = wrap(lambda x: x + tx.tag(1.0, op="c"))(x)
    assert got.dtype == want.dtype == jnp.float16
    i = jnp.ones(3, jnp.int8)
    got = wrap(lambda i: i + tx.tag(1, op="c"))(i)
    assert got.dtype == (i + 1).dtype == jnp.int8


def test_weak_type_in_aval():
    j = jax.make_jaxpr(lambda: tx.tag(1.0, op="c"))()
    (site,) = tx.find_tags(j)
    assert site.shape.weak_type
    j = jax.make_jaxpr(lambda x: tx.tag(x, op="c"))(jnp.float32(1.0))
    (site,) = tx.find_tags(j)
    assert not site.shape.weak_type


# ---- transformations -------------------------------------------------------------------

def f_tagged(x):
    y = tx.tag(jnp.sin(x), op="a")
    z = tx.tag({"p": y * x, "q": x}, op="b")
    return z["p"] + z["q"] ** 2


def f_plain(x):
    y = jnp.sin(x)
    return y * x + x ** 2


X = jnp.linspace(-1.0, 1.0, 5)


def test_jit():
    np.testing.assert_allclose(jax.jit(f_tagged)(X), f_plain(X), rtol=1e-6)


def test_grad():
    g = jax.grad(lambda x: f_tagged(x).sum())(X)
    np.testing.assert_allclose(g, jax.grad(lambda x: f_plain(x).sum())(X), rtol=1e-6)
    gg = jax.jit(jax.grad(lambda x: jax.grad(lambda x: f_tagged(x).sum())(x).sum()))(X)
    np.testing.assert_allclose(
        gg, jax.grad(lambda x: jax.grad(lambda x: f_plain(x).sum())(x).sum())(X), rtol=1e-5)


def test_vmap():
    xs = jnp.stack([X, 2 * X, -X])
    np.testing.assert_allclose(jax.vmap(f_tagged)(xs), jax.vmap(f_plain)(xs), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.vmap(f_tagged, in_axes=1, out_axes=1))(xs.T),
                               jax.vmap(f_plain, in_axes=1, out_axes=1)(xs.T), rtol=1e-6)
    # A tag on an unbatched value inside vmap.
    out = jax.vmap(lambda x: x + tx.tag(jnp.ones(5), op="c"))(xs)
    np.testing.assert_allclose(out, xs + 1)
    # vmap of grad and grad of vmap.
    vg = jax.jit(jax.vmap(jax.grad(lambda x: f_tagged(x).sum())))(xs)
    np.testing.assert_allclose(vg, jax.jit(jax.vmap(jax.grad(lambda x: f_plain(x).sum())))(xs),
                               rtol=1e-6)


def test_jvp_and_vjp():
    t = jnp.ones_like(X) * 0.5
    p1, t1 = jax.jvp(f_tagged, (X,), (t,))
    p2, t2 = jax.jvp(f_plain, (X,), (t,))
    np.testing.assert_allclose(p1, p2, rtol=1e-6)
    np.testing.assert_allclose(t1, t2, rtol=1e-6)
    out, vjp = jax.vjp(f_tagged, X)
    (ct,) = vjp(t)
    np.testing.assert_allclose(ct, jax.vjp(f_plain, X)[1](t)[0], rtol=1e-6)
    check(jax.make_jaxpr(lambda x, t: jax.jvp(f_tagged, (x,), (t,)))(X, t))
    check(jax.make_jaxpr(jax.grad(lambda x: f_tagged(x).sum()))(X))


def test_linear_transpose():
    def lin(x):
        return 3.0 * tx.tag(x, op="lin") + tx.tag(2.0 * x, op="lin2")

    (ct,) = jax.linear_transpose(lin, X)(jnp.ones_like(X))
    np.testing.assert_allclose(ct, 5.0 * jnp.ones_like(X))
    (ct,) = jax.jit(jax.linear_transpose(lin, X))(jnp.arange(5.0))
    np.testing.assert_allclose(ct, 5.0 * jnp.arange(5.0))


def test_float0_tangents():
    i = jnp.arange(4, dtype=jnp.int32)
    float0 = np.zeros(i.shape, dtype=jax.dtypes.float0)
    p, t = jax.jvp(lambda i: tx.tag(i, op="int"), (i,), (float0,))
    np.testing.assert_array_equal(p, i)
    assert t.dtype == jax.dtypes.float0
    # A mixed pytree: one float leaf, one int leaf.
    p, t = jax.jvp(lambda x, i: tx.tag((x, i), op="mix"), (X, i),
                   (jnp.ones_like(X), float0))
    np.testing.assert_allclose(t[0], jnp.ones_like(X))
    assert t[1].dtype == jax.dtypes.float0
    gx, gi = jax.grad(lambda x, i: (tx.tag(x, op="a") * tx.tag(i, op="b")).sum(),
                      argnums=(0, 1), allow_int=True)(jnp.ones(4), i)
    np.testing.assert_allclose(gx, i.astype(jnp.float32))
    assert gi.dtype == jax.dtypes.float0
    gi = jax.jit(jax.grad(lambda x, i: (x * tx.tag(i, op="b")).sum(),
                          argnums=1, allow_int=True))(jnp.ones(4), i)
    assert gi.dtype == jax.dtypes.float0


def test_complex_grad():
    z = jnp.array([1 + 1j, 2 - 1j], jnp.complex64)
    f = lambda z: jnp.abs(tx.tag(z, op="z") ** 2).sum()
    np.testing.assert_allclose(jax.grad(f)(z), jax.grad(lambda z: jnp.abs(z ** 2).sum())(z))


# ---- params ----------------------------------------------------------------------------

def test_unhashable_param_names_key():
    with pytest.raises(TypeError, match="'bad_key'"):
        tx.tag(1.0, ok=1, bad_key=[1, 2])
    with pytest.raises(TypeError, match="'arr'"):
        jax.make_jaxpr(lambda x: tx.tag(x, arr=np.arange(3)))(1.0)
    with pytest.raises(TypeError, match="'d'"):
        tx.tag(jnp.ones(2), d={"a": 1})
    # JAX still works afterwards.
    assert jax.jit(lambda x: x + 1)(1.0) == 2.0


def test_hidden_param_names_rejected():
    with pytest.raises(TypeError, match="_taxpr_"):
        tx.tag(1.0, _taxpr_kept=True)


def test_params_round_trip():
    j = jax.make_jaxpr(lambda x: tx.tag(x, op="get", id=(1, "a"), scale=0.5))(1.0)
    (site,) = tx.find_tags(j)
    assert site.params == {"op": "get", "id": (1, "a"), "scale": 0.5}


def test_taxprs_record_is_one_typed_param_apart_from_the_users():
    from taxpr.primitives._tag import META, TagMeta, tag_p

    def f(x):
        return tx.tag({"a": x, "b": (x, x)}, op="get", id=0)

    with tx.keep_tags():
        j = jax.make_jaxpr(f)(1.0)
    (eqn,) = [e for e in j.jaxpr.eqns if e.primitive is tag_p]
    assert set(eqn.params) == {"op", "id", META}
    record = eqn.params[META]
    assert isinstance(record, TagMeta)
    assert record.tree == jax.tree_util.tree_structure({"a": 0, "b": (0, 0)})
    assert record.kept and not record.batched and record.guard is None
    plain = jax.make_jaxpr(f)(1.0)
    (eqn,) = [e for e in plain.jaxpr.eqns if e.primitive is tag_p]
    assert not eqn.params[META].kept
    batched = jax.make_jaxpr(jax.vmap(f))(jnp.ones(3))
    (eqn,) = [e for e in batched.jaxpr.eqns if e.primitive is tag_p]
    assert eqn.params[META].batched


# ---- printing --------------------------------------------------------------------------

def test_compact_pretty_print():
    def f(x):
        y = tx.tag({"a": x, "b": (x, x)}, id=0, op="get")
        return jnp.sum(y["a"])

    text = str(jax.make_jaxpr(f)(jnp.ones(3)))
    assert "tag[id=0 op=get]" in text
    assert "_taxpr_" not in text
    assert "PyTreeDef" not in text
    text = str(jax.make_jaxpr(jax.grad(f))(jnp.ones(3)))
    assert "tag[id=0 op=get]" in text
    assert "_taxpr_" not in text
    assert "PyTreeDef" not in text


# ---- no cost in compiled code ----------------------------------------------------------

def _chain(x, tags: bool, n: int = 100):
    for i in range(n):
        if tags:
            x = tx.tag(x, id=i, op="get")
        x = x * 1.01 + 0.5 if i % 10 == 0 else x
    return jnp.sin(x)


def _hlo(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


def test_no_ops_in_optimized_hlo():
    x = jnp.ones(8)
    with_tags = hlo_ops(_hlo(lambda x: _chain(x, True), x))
    without = hlo_ops(_hlo(lambda x: _chain(x, False), x))
    assert with_tags and with_tags == without


def test_no_ops_in_optimized_hlo_under_grad():
    # Under grad the tags are re-bound as kept (effectful) tags.
    x = jnp.ones(8)
    g = lambda tags: jax.grad(lambda x: _chain(x, tags).sum())
    assert hlo_ops(_hlo(g(True), x)) == hlo_ops(_hlo(g(False), x))


# ---- unused tags survive dead-code elimination -----------------------------------------

def h(x):
    tx.tag(x, op="unused")
    return jnp.sin(x)


def h_used(x):
    return jnp.sin(tx.tag(x, op="used"))


def _scan(g, length=3):
    return lambda x: jax.lax.scan(lambda c, _: (g(c), None), x, None, length=length)[0]


DCE_CASES = {
    "make_jaxpr": lambda: jax.make_jaxpr(h)(X),
    "jit": lambda: jax.make_jaxpr(jax.jit(h))(X),
    "vmap": lambda: jax.make_jaxpr(jax.vmap(h))(jnp.ones((2, 5))),
    "scan": lambda: jax.make_jaxpr(_scan(h))(X),
    "cond": lambda: jax.make_jaxpr(lambda x: jax.lax.cond(x[0] > 0, h, jnp.cos, x))(X),
    "while": lambda: jax.make_jaxpr(
        lambda x: jax.lax.while_loop(lambda c: c[0] < 3, h, x))(X),
    "checkpoint": lambda: jax.make_jaxpr(jax.checkpoint(h))(X),
    "jit_jit": lambda: jax.make_jaxpr(jax.jit(jax.jit(h)))(X),
}


@pytest.mark.parametrize("case", sorted(DCE_CASES))
def test_unused_tag_survives(case):
    j = DCE_CASES[case]()
    check(j)
    assert n_tags(j, op="unused") == 1


def test_unused_tag_survives_pe_dce_jaxpr():
    # Traced under keep_tags(), as a taxpr transformation (or a user passing
    # the jaxpr to inject) traces: the tag will be consumed.
    with tx.keep_tags():
        j = jax.make_jaxpr(lambda x: (h(x), jnp.cos(tx.tag(x, op="unused2"))))(X)
    open_jaxpr = j.jaxpr
    dced, used_inputs = pe.dce_jaxpr(open_jaxpr, [True, True])
    assert n_tags(dced, op="unused") == 1
    assert used_inputs == [True]
    # Also when the only output using the input is dropped.
    dced, used_inputs = pe.dce_jaxpr(open_jaxpr, [True, False])
    assert n_tags(dced, op="unused") == 1
    check(dced)


def test_unconsumed_unused_tag_is_dropped_by_pe_dce_jaxpr():
    # Outside keep_tags() nothing will consume the tag: dead-code elimination
    # drops it like any unused value, so it blocks no analysis of a body
    # (flax's nn.scan broadcast check), as flax's own sow does.
    def body(c):
        tx.tag(c * 2.0, op="unused")
        return jnp.ones(())

    j = jax.make_jaxpr(body)(1.0)
    assert n_tags(j, op="unused") == 1  # tracing keeps it
    dced, used_inputs = pe.dce_jaxpr(j.jaxpr, [True])
    assert used_inputs == [False] and n_tags(dced) == 0
    check(dced)


def test_unused_tag_survives_dce_inside_scan_body():
    # The scan body is DCE'd when one of the scan's outputs is unused.
    def f(x):
        def body(c, _):
            tx.tag(c, op="unused")
            return c + 1, c * 2

        c, _ = jax.lax.scan(body, x, None, length=3)
        return c

    j = jax.make_jaxpr(jax.jit(f))(X)
    check(j)
    assert n_tags(j, op="unused") == 1


GRAD_CASES = {
    "jit": jax.jit,
    "checkpoint": jax.checkpoint,
    "scan": _scan,
    "scan_checkpoint": lambda g: _scan(jax.checkpoint(g)),
    "checkpoint_scan": lambda g: jax.checkpoint(_scan(g)),
    "scan_scan": lambda g: _scan(_scan(g)),
    "fori": lambda g: (lambda x: jax.lax.fori_loop(0, 3, lambda i, c: g(c), x)),
    "cond": lambda g: (lambda x: jax.lax.cond(x[0] > 0, g, jnp.cos, x)),
    "jit_checkpoint": lambda g: jax.jit(jax.checkpoint(g)),
}


@pytest.mark.parametrize("body", [h, h_used], ids=["unused", "used"])
@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_tag_exactly_once_under_grad(case, body):
    g = GRAD_CASES[case](body)
    op = "unused" if body is h else "used"
    with tx.keep_tags():  # traced as a taxpr transformation traces
        jg = jax.make_jaxpr(jax.grad(lambda x: g(x).sum()))(X)
        jv = jax.make_jaxpr(lambda x, t: jax.jvp(g, (x,), (t,)))(X, X)
    check(jg)
    assert n_tags(jg, op=op) == 1, jg
    check(jv)
    assert n_tags(jv, op=op) == 1, jv
    # Outside a taxpr transformation the differentiated tags stay plain: no
    # effect reaches the jitted function (JAX's fast dispatch path stays on).
    assert not jax.make_jaxpr(jax.grad(lambda x: g(x).sum()))(X).effects
    # And the values are right.
    plain = GRAD_CASES[case](jnp.sin)
    np.testing.assert_allclose(jax.grad(lambda x: g(x).sum())(X),
                               jax.grad(lambda x: plain(x).sum())(X), rtol=1e-6)


def test_grad_checkpoint_not_duplicated():
    with tx.keep_tags():
        jg = jax.make_jaxpr(jax.grad(lambda x: jax.checkpoint(h)(x).sum()))(X)
    assert n_tags(jg) == 1


def test_grad_scan_path():
    with tx.keep_tags():
        jg = jax.make_jaxpr(jax.grad(lambda x: _scan(h, 5)(x).sum()))(X)
    assert tag_paths(jg) == [("scan[length=5]",)]


def test_vmap_of_grad_keeps_tag():
    with tx.keep_tags():
        jg = jax.make_jaxpr(jax.vmap(jax.grad(lambda x: _scan(h)(x).sum())))(jnp.ones((2, 5)))
    check(jg)
    assert n_tags(jg, op="unused") == 1


def test_batched_derivatives():
    # vmap over derivatives where primal and tangent/cotangent batching differ.
    xs = jnp.stack([X, 2 * X])
    _, vjp = jax.vjp(lambda x: tx.tag(jnp.sin(x), op="s"), X)
    (cts,) = jax.jit(jax.vmap(vjp))(xs)  # primal unbatched, cotangent batched
    np.testing.assert_allclose(cts, xs * jnp.cos(X), rtol=1e-6)
    tans = jax.vmap(lambda t: jax.jvp(lambda x: tx.tag(jnp.sin(x), op="s"), (X,), (t,))[1])(xs)
    np.testing.assert_allclose(tans, xs * jnp.cos(X), rtol=1e-6)
    i = jnp.arange(5)
    f = lambda x, i: (tx.tag((x, i), op="m")[0] * 2).sum()
    gx, gi = jax.jit(jax.vmap(lambda x, i: jax.grad(f, argnums=(0, 1), allow_int=True)(x, i)))(
        xs, jnp.stack([i, i]))
    np.testing.assert_allclose(gx, 2 * jnp.ones_like(xs))
    assert gi.dtype == jax.dtypes.float0


def test_prng_key_under_grad_and_vmap():
    k = jax.random.key(0)

    def fk(x, k):
        x, k = tx.tag((x, k), op="xk")
        return (x * jax.random.normal(k, x.shape)).sum()

    want = jax.random.normal(k, X.shape)
    np.testing.assert_allclose(jax.jit(jax.grad(fk))(X, k), want)
    keys = jax.random.split(k, 3)
    got = jax.jit(jax.vmap(jax.grad(fk), in_axes=(None, 0)))(X, keys)
    np.testing.assert_allclose(got, jax.vmap(lambda k: jax.random.normal(k, X.shape))(keys))
    got = jax.jit(jax.vmap(jax.grad(fk), in_axes=(0, None)))(jnp.stack([X, X]), k)
    np.testing.assert_allclose(got, jnp.stack([want, want]))


def _sows_in_every_body(x):
    """Sows (nothing reaps them) at the top level and inside a scan, a cond
    and a checkpoint under jit, around a state counter."""
    from taxpr import harvest as hv

    x = hv.sow(jnp.sin(x), tag="log", name="top")
    x = jax.lax.scan(lambda c, _: (hv.sow(c * 0.5, tag="log", name="scan", mode="clobber"),
                                   None), x, None, length=2)[0]
    x = jax.lax.cond(x[0] > 0, lambda v: hv.sow(v + 1.0, tag="log", name="cond"),
                     lambda v: hv.sow(v - 1.0, tag="log", name="cond"), x)
    x = jax.jit(jax.checkpoint(lambda v: hv.sow(jnp.cos(v), tag="log", name="ckpt")))(x)
    tx.set_state("n", tx.get_state("n", jnp.int32(0)) + 1)
    return _custom_vjp_sowing(_custom_jvp_sowing(x)).sum()


@jax.custom_jvp
def _custom_jvp_sowing(x):
    """3x, sowing in its function and in its rule (which calls it)."""
    from taxpr import harvest as hv

    return hv.sow(x * 3.0, tag="log", name="jvp_fn", mode="clobber")


@_custom_jvp_sowing.defjvp
def _(primals, tangents):
    from taxpr import harvest as hv

    (x,), (dx,) = primals, tangents
    return _custom_jvp_sowing(x), hv.sow(dx * 3.0, tag="log", name="jvp_t", mode="clobber")


@jax.custom_vjp
def _custom_vjp_sowing(x):
    """x squared, sowing in its function, its fwd and its bwd."""
    from taxpr import harvest as hv

    return hv.sow(x * x, tag="log", name="vjp_fn", mode="clobber")


def _vjp_fwd(x):
    from taxpr import harvest as hv

    hv.sow(x, tag="log", name="vjp_fwd", mode="clobber")
    return _custom_vjp_sowing(x), x


def _vjp_bwd(x, ct):
    from taxpr import harvest as hv

    return (hv.sow(2.0 * x * ct, tag="log", name="vjp_bwd", mode="clobber"),)


_custom_vjp_sowing.defvjp(_vjp_fwd, _vjp_bwd)


def _without_sows(x):
    x = jnp.sin(x)
    x = x * 0.25
    x = jnp.where(x[0] > 0, x + 1.0, x - 1.0)
    return ((jnp.cos(x) * 3.0) ** 2).sum()


def test_tags_a_transformation_leaves_are_plain_outside_every_transformation():
    # A model with sows trained through uncurry without reaping them: the
    # sows stay in `pure`, plain (no effect reaches a top-level jit, so its
    # fast dispatch path stays on, and jax.export takes it), and an
    # enclosing transformation still finds them.
    from taxpr import harvest as hv

    pure, s0 = tx.uncurry(_sows_in_every_body, X)
    value_grad = jax.value_and_grad(lambda x: pure(s0, x)[0])
    for program in (jax.make_jaxpr(pure)(s0, X), jax.make_jaxpr(jax.jit(pure))(s0, X),
                    jax.make_jaxpr(value_grad)(X),
                    jax.make_jaxpr(jax.jit(tx.seed(lambda x: pure(s0, x)[0],
                                                   jax.random.key(0))))(X)):
        check(program)
        assert not program.effects, program
    assert len(tx.find_tags(jax.make_jaxpr(pure)(s0, X))) >= 4
    exported = jax.export.export(jax.jit(pure))(s0, X)
    assert not exported.ordered_effects and not exported.unordered_effects
    # The values, against the program without sows.
    for _ in range(2):  # jitted twice: a warm cache
        (out, s1) = jax.jit(pure)(s0, X)
        np.testing.assert_allclose(out, _without_sows(X), rtol=1e-6)
        assert int(s1["n"]) == 1
        v, g = jax.jit(value_grad)(X)
        want_v, want_g = jax.value_and_grad(_without_sows)(X)
        np.testing.assert_allclose(v, want_v, rtol=1e-6)
        np.testing.assert_allclose(g, want_g, rtol=1e-6)
    # vmapped over a batch of inputs: plain too, each row as alone.
    xs = jnp.stack([X, -X])
    batched = jax.jit(jax.vmap(pure, in_axes=(None, 0)))
    assert not jax.make_jaxpr(batched)(s0, xs).effects
    outs, s_b = batched(s0, xs)
    np.testing.assert_allclose(outs, jax.vmap(_without_sows)(xs), rtol=1e-6)
    np.testing.assert_array_equal(s_b["n"], [1, 1])
    # Inside another transformation (a reap of `pure`, itself jitted and
    # differentiated), the sows left in `pure` are still kept and reaped.
    reaped = jax.jit(hv.reap(lambda x: jax.grad(lambda y: pure(s0, y)[0])(x), tag="log"))(X)
    assert {"top", "scan", "cond", "ckpt", "jvp_fn", "vjp_fn", "vjp_fwd"} <= set(reaped)
    np.testing.assert_allclose(reaped["top"], np.sin(X), rtol=1e-6)
    ckpt = np.cos(np.sin(X) * 0.25 + np.where(np.sin(X)[0] * 0.25 > 0, 1.0, -1.0))
    np.testing.assert_allclose(reaped["ckpt"], ckpt, rtol=1e-6)
    np.testing.assert_allclose(reaped["vjp_fwd"], 3.0 * ckpt, rtol=1e-6)


def test_tags_a_reap_leaves_are_plain_outside_it():
    from taxpr import harvest as hv

    def f(x):
        # Sows of tag "a" and "b", and of "log" in custom functions' bodies
        # and rules (run when JAX differentiates the reap's result).
        y = hv.sow(jnp.sin(x), tag="a", name="s") * hv.sow(x, tag="b", name="t")
        return _custom_vjp_sowing(_custom_jvp_sowing(y))

    reap_a = hv.call_and_reap(f, tag="a")
    loss = jax.grad(lambda x: reap_a(x)[0].sum())
    program = jax.make_jaxpr(jax.jit(loss))(X)
    check(program)
    assert not program.effects and len(tx.find_tags(program)) >= 1
    want = jax.grad(lambda x: ((jnp.sin(x) * x * 3.0) ** 2).sum())(X)
    np.testing.assert_allclose(jax.jit(loss)(X), want, rtol=1e-5)
    # An enclosing reap of the other tags finds the sows left in.
    got = hv.reap(lambda x: reap_a(x)[1]["s"], tag="b")(X)
    np.testing.assert_allclose(got["t"], X)
    got = hv.reap(loss, tag="log")(X)
    np.testing.assert_allclose(got["vjp_fwd"], np.sin(X) * X * 3.0, rtol=1e-6)
    np.testing.assert_allclose(got["jvp_fn"], np.sin(X) * X * 3.0, rtol=1e-6)


def test_every_tag_effect_is_equal_as_jax_export_rebuilds_it():
    from taxpr.primitives._tag import TagEffect, tag_effect

    assert TagEffect() == tag_effect and hash(TagEffect()) == hash(tag_effect)

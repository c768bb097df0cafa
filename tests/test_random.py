"""``tx.next_key`` / ``tx.seed``: random keys as a state stream.

Every program is compared with the same program run eagerly with Python
control flow and a key variable that each draw splits (``key, sub =
split(key)``; the draw is ``sub``): ``Eager`` from state_helpers plus
``next_key``.
"""

from __future__ import annotations

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import taxpr as tx

from helpers import check, cpu_mesh, shard_map as _shard_map_fn
from state_helpers import Eager, _TX, assert_close, jax_still_works

f32 = jnp.float32
kd = jax.random.key_data


class RngTX(_TX):
    """Raw JAX with taxpr's state and keys."""

    next_key = staticmethod(tx.next_key)


class RngEager(Eager):
    """Eager reference: a Python key variable per stream, split on each draw."""

    def next_key(self, stream="rng"):
        key = self.get(stream, lambda: jax.random.key(0))
        key, sub = jax.random.split(key)
        self.set(stream, key)
        return sub

    def while_loop(self, cond_fun, body_fun, val):
        # Eager's while_loop calls cond_fun once more to spot a tracer: a
        # cond that draws must run exactly once per test.
        while bool(cond_fun(val)):
            val = body_fun(val)
        return val


TX = RngTX()


def same_keys(got, want) -> None:
    """Two pytrees (keys compared by their data) are equal."""
    def data(x):
        return kd(x) if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key) else x
    assert_close(jax.tree_util.tree_map(data, got), jax.tree_util.tree_map(data, want),
                 rtol=1e-6, atol=1e-6)


def check_against_eager(prog, example, inputs=None, starts=None):
    """uncurry(prog(TX, ...)) against prog(RngEager, ...) from ``state0`` and
    from reseeded streams; also jitted."""
    fn = functools.partial(prog, TX)
    pure, state0 = tx.uncurry(fn, *example)
    ref = RngEager()
    prog(ref, *example)
    same_keys({n: state0[n] for n in ref.first}, ref.first)
    for args in inputs or [example]:
        for start in [state0, *(starts or [])]:
            for p in (pure, jax.jit(pure)):
                out, state1 = p(start, *args)
                ref = RngEager(start)
                want = prog(ref, *args)
                same_keys(out, want)
                same_keys(state1, ref.state)
    jaxpr, _ = tx.make_jaxpr(fn)(*example)
    check(jaxpr)
    return pure, state0


RESEED = [{"rng": jax.random.key(42)}]


# ---- the stream as state ------------------------------------------------------------------

def test_state0_holds_key_zero_and_make_jaxpr_lists_the_stream():
    def f(x):
        return x * jax.random.normal(tx.next_key())
    pure, s0 = tx.uncurry(f, f32(1.0))
    assert list(s0) == ["rng"]
    assert s0["rng"].dtype == jax.random.key(0).dtype and s0["rng"].shape == ()
    np.testing.assert_array_equal(kd(s0["rng"]), kd(jax.random.key(0)))
    _, states = tx.make_jaxpr(f)(f32(1.0))
    assert [(s.name, s.read, s.written) for s in states] == [("rng", True, True)]
    assert states[0].dtype == jax.random.key(0).dtype


def _draws(S, x):
    a = jax.random.normal(S.next_key(), (3,))
    b = jax.random.uniform(S.next_key())
    return x * a + b, S.next_key()


def test_straight_line_draws_match_eager_and_reseed_from_the_state_dict():
    check_against_eager(_draws, (f32(1.0),), starts=RESEED)


def test_same_numbers_eagerly_under_jit_and_after_uncurry():
    pure, s0 = tx.uncurry(functools.partial(_draws, TX), f32(2.0))
    ref = RngEager()
    want = _draws(ref, f32(2.0))
    inner_jit = jax.jit(functools.partial(_draws, TX))
    pure_jit, s0j = tx.uncurry(inner_jit, f32(2.0))
    for p, s in ((pure, s0), (jax.jit(pure), s0), (pure_jit, s0j)):
        out, s1 = p(s, f32(2.0))
        same_keys(out, want)
        same_keys(s1, ref.state)


def test_two_streams_are_independent_states():
    def prog(S, x):
        a = jax.random.normal(S.next_key("dropout"))
        b = jax.random.normal(S.next_key())
        c = jax.random.normal(S.next_key("dropout"))
        return x + a + 2 * b + 3 * c
    pure, s0 = check_against_eager(prog, (f32(1.0),),
                                   starts=[{"rng": jax.random.key(1),
                                            "dropout": jax.random.key(2)}])
    assert sorted(s0) == ["dropout", "rng"]


def test_key_impls_threefry_and_rbg_both_work_as_streams():
    for impl in ("threefry2x32", "rbg"):
        start = {"rng": jax.random.key(7, impl=impl)}
        pure = tx.seed(functools.partial(_draws, TX), start["rng"])
        ref = RngEager(start)
        same_keys(pure(f32(1.0)), _draws(ref, f32(1.0)))
        assert pure(f32(1.0))[1].dtype == start["rng"].dtype


# ---- raw control flow -------------------------------------------------------------------

def _scan(S, x):
    def body(c, _):
        k = S.next_key()
        return c + jax.random.normal(k), k
    return S.scan(body, x, None, length=4)


def test_scan_draws_a_distinct_key_every_iteration():
    pure, s0 = check_against_eager(_scan, (f32(0.0),), starts=RESEED)
    (_, keys), _ = pure(s0, f32(0.0))
    data = np.asarray(kd(keys)).reshape(4, -1)
    assert len({tuple(r) for r in data}) == 4


def _fori(S, x):
    return S.fori_loop(0, 5, lambda i, c: c * 0.5 + jax.random.normal(S.next_key()), x)


def test_fori_loop_draws_match_eager():
    check_against_eager(_fori, (f32(1.0),), starts=RESEED)


def _while(S, x):
    # The cond draws too: eagerly it runs once more than the body.
    def cond(c):
        return (jax.random.uniform(S.next_key()) < 0.8) & (c[1] < 20)

    def body(c):
        return c[0] + jax.random.normal(S.next_key()), c[1] + 1
    return S.while_loop(cond, body, (x, jnp.int32(0)))


def test_while_loop_draws_in_cond_and_body_match_eager():
    check_against_eager(_while, (f32(0.0),),
                        starts=[{"rng": jax.random.key(k)} for k in (1, 2, 3)])


def _cond(S, x):
    def draw(x):
        return x + jax.random.normal(S.next_key())

    y = S.cond(x > 0, draw, lambda x: x - 1.0, x)
    z = S.switch(jnp.int32(x > 0) + 1, [lambda x: x, draw, lambda x: draw(draw(x))], y)
    return z, S.next_key()


def test_cond_and_switch_advance_the_stream_only_in_the_taken_branch():
    check_against_eager(_cond, (f32(1.0),), inputs=[(f32(1.0),), (f32(-1.0),)],
                        starts=RESEED)


def _dropout(S, h, rate=0.5):
    keep = jax.random.bernoulli(S.next_key(), 1.0 - rate, h.shape)
    return jnp.where(keep, h / (1.0 - rate), 0.0)


def test_checkpoint_under_grad_uses_the_same_mask_in_forward_and_recomputation():
    x = jnp.linspace(0.5, 2.0, 16, dtype=f32)

    def prog(S, w):
        h = S.checkpoint(lambda w: _dropout(S, jnp.sin(w * x)))(w)
        return (h * h).sum()

    def loss_and_grad(S, w):
        return jax.value_and_grad(functools.partial(prog, S))(w)

    pure, s0 = check_against_eager(loss_and_grad, (f32(0.7),), starts=RESEED)
    # The gradient through the recomputation uses the forward's mask: it
    # matches the one of an explicit, fixed mask.
    keep = jax.random.bernoulli(jax.random.split(jax.random.key(0))[1], 0.5, x.shape)
    mask = jnp.where(keep, 2.0, 0.0)
    want = jax.value_and_grad(lambda w: ((mask * jnp.sin(w * x)) ** 2).sum())(f32(0.7))
    same_keys(pure(s0, f32(0.7))[0], want)
    # And from outside: grad of the pure function (checkpoint inside).
    pure2, s0 = tx.uncurry(functools.partial(prog, TX), f32(0.7))
    g = jax.grad(lambda w: pure2(s0, w)[0])(f32(0.7))
    assert_close(g, want[1])


def test_grad_and_jacfwd_of_the_pure_function_match_eager():
    def prog(S, x):
        def body(c, _):
            return c * jax.random.normal(S.next_key()) + jnp.sin(c), None
        return S.scan(body, x, None, length=3)[0]
    pure, s0 = tx.uncurry(functools.partial(prog, TX), f32(0.3))
    eager = lambda x: prog(RngEager(s0), x)  # noqa: E731 - fresh key variable per call
    for diff in (jax.grad, jax.jacfwd, jax.jacrev, jax.hessian):
        assert_close(diff(lambda x: pure(s0, x)[0])(f32(0.3)), diff(eager)(f32(0.3)),
                     rtol=1e-5, atol=1e-6)


def test_custom_jvp_and_custom_vjp_functions_drawing_keys_match_eager():
    def prog(S, x):
        @jax.custom_jvp
        def noisy(x):
            return x * jax.random.normal(S.next_key())

        @noisy.defjvp
        def noisy_jvp(primals, tangents):  # a straight-through tangent
            (x,), (t,) = primals, tangents
            return noisy(x), t

        @jax.custom_vjp
        def clip(x, key):
            return jnp.clip(x + jax.random.normal(key), -1.0, 1.0)

        def fwd(x, key):
            return clip(x, key), None

        def bwd(_, g):
            return g, None
        clip.defvjp(fwd, bwd)
        # Keys drawn in the function, passed to the rules as arguments.
        y = clip(x, S.next_key())
        return jax.grad(lambda x: noisy(x) * y)(x) + noisy(y)
    check_against_eager(prog, (f32(0.4),), starts=RESEED)


# ---- vmap --------------------------------------------------------------------------------

def test_vmap_without_axis_name_is_an_error_naming_the_stream():
    def f(x):
        return x * jax.random.normal(tx.next_key("noise"))
    with pytest.raises(tx.StateError, match=r"next_key\('noise'\).*vmap without an axis name"):
        tx.uncurry(jax.vmap(f), jnp.ones(3))
    pure, s0 = tx.uncurry(f, f32(1.0))
    with pytest.raises(tx.StateError, match=r"next_key\('noise'\).*axis_name"):
        jax.vmap(lambda x: pure(s0, x)[0])(jnp.ones(3))
    jax_still_works()


def _per_example(x):
    return x + jax.random.normal(tx.next_key()), tx.next_key()


def _eager_per_example(xs, key):
    """Eager with an axis name: example i draws fold_in(sub, i)."""
    outs, keys = [], []
    key, sub1 = jax.random.split(key)
    key, sub2 = jax.random.split(key)
    for i, x in enumerate(xs):
        outs.append(x + jax.random.normal(jax.random.fold_in(sub1, i)))
        keys.append(jax.random.fold_in(sub2, i))
    return (jnp.stack(outs), jnp.stack(keys)), key


def test_vmap_with_axis_name_gives_each_example_fold_in_of_its_index():
    xs = jnp.arange(3.0)
    inside = jax.vmap(_per_example, axis_name="b")
    pure_in, s0 = tx.uncurry(inside, xs)
    pure_out, _ = tx.uncurry(_per_example, f32(0.0))
    outside = jax.vmap(pure_out, in_axes=(None, 0), out_axes=(0, None), axis_name="b")
    for p in (pure_in, jax.jit(pure_in), outside, jax.jit(outside)):
        for start in (s0, *RESEED):
            out, s1 = p(start, xs)
            want, key = _eager_per_example(xs, start["rng"])
            same_keys(out, want)
            same_keys(s1["rng"], key)  # the stream stays one unbatched key
    keys = np.asarray(kd(pure_in(s0, xs)[0][1])).reshape(3, -1)
    assert len({tuple(r) for r in keys}) == 3


def test_nested_named_vmaps_fold_in_both_indices():
    xs = jnp.arange(6.0).reshape(2, 3)
    f = jax.vmap(jax.vmap(lambda x: tx.next_key(), axis_name="j"), axis_name="i")
    pure, s0 = tx.uncurry(f, xs)
    keys, s1 = pure(s0, xs)
    _, sub = jax.random.split(s0["rng"])
    for i in range(2):
        for j in range(3):
            same_keys(keys[i, j], jax.random.fold_in(jax.random.fold_in(sub, j), i))
    # an unnamed vmap around a named one is still an error
    g = jax.vmap(jax.vmap(lambda x: tx.next_key(), axis_name="j"))
    with pytest.raises(tx.StateError, match="without an axis name"):
        tx.uncurry(g, xs)


def test_vmap_of_pure_over_a_batch_of_keys_draws_from_each_key():
    pure, s0 = tx.uncurry(_per_example, f32(0.0))
    starts = jax.random.split(jax.random.key(3), 3)
    xs = jnp.arange(3.0)
    (outs, keys), s1 = jax.vmap(pure)({"rng": starts}, xs)
    for i in range(3):
        ref = RngEager({"rng": starts[i]})
        want = (xs[i] + jax.random.normal(ref.next_key()), ref.next_key())
        same_keys((outs[i], keys[i]), want)
        same_keys(s1["rng"][i], ref.state["rng"])


def _loops(S, x, pred=True):
    def body(c, _):
        return c + jax.random.normal(S.next_key()), None
    y = S.scan(body, x, None, length=2)[0]
    y = S.cond(pred, lambda y: y + jax.random.uniform(S.next_key()), lambda y: y, y)
    return S.while_loop(lambda c: c[1] < 2,
                        lambda c: (c[0] * jax.random.normal(S.next_key()), c[1] + 1),
                        (y, 0))[0]


class Folded(RngEager):
    """Eager under a named vmap: example ``index`` draws fold_in(sub, index)."""

    def __init__(self, state, index):
        super().__init__(state)
        self.index = index

    def next_key(self, stream="rng"):
        return jax.random.fold_in(super().next_key(stream), self.index)


def test_named_vmap_folds_in_inside_scan_cond_and_while_bodies():
    xs = jnp.arange(3.0)
    fn = jax.vmap(functools.partial(_loops, TX), in_axes=(0, None), axis_name="b")
    pure, s0 = tx.uncurry(fn, xs, jnp.array(True))
    for p in (pure, jax.jit(pure)):
        out, s1 = p(s0, xs, jnp.array(True))
        want = [_loops(Folded(s0, i), x, True) for i, x in enumerate(xs)]
        assert_close(out, jnp.stack(want))
        ref = Folded(s0, 0)
        _loops(ref, xs[0], True)
        same_keys(s1, ref.state)  # the stream splits once per draw, as without vmap


def test_next_key_in_a_cond_whose_predicate_vmap_batches_is_an_error_naming_the_stream():
    fn = jax.vmap(lambda x: _loops(TX, x, x > 1.0), axis_name="b")
    with pytest.raises(tx.StateError, match=r"'rng'.*predicate is batched"):
        tx.uncurry(fn, jnp.arange(3.0))
    jax_still_works()


def _draw_in_branch(x):
    return lax.cond(x > 0, lambda x: x + jax.random.normal(tx.next_key()), lambda x: x, x)


def _draw_in_loop(x):
    return lax.while_loop(lambda c: c < x, lambda c: c + jnp.abs(jax.random.normal(
        tx.next_key())) + 0.5, 0.0)


@pytest.mark.parametrize("fn,place", [(_draw_in_branch, r"cond\[branch=1\]"),
                                      (_draw_in_loop, r"while\[body\]")])
def test_next_key_under_a_batched_predicate_names_the_draw_and_the_users_line(fn, place):
    # The error names the call the user wrote (next_key, at its line), not
    # the set_state of the stream's key that next_key makes.
    batched = jax.vmap(fn, axis_name="b")
    lines, first = inspect.getsourcelines(fn)
    line = first + next(i for i, text in enumerate(lines) if "next_key" in text)
    for run in (lambda: tx.seed(batched, jax.random.key(0))(jnp.array([1.0, -1.0])),
                lambda: tx.uncurry(batched, jnp.array([1.0, -1.0]))):
        with pytest.raises(tx.StateError) as e:
            run()
        msg = str(e.value)
        assert msg.startswith("taxpr: stream 'rng': next_key "), msg
        assert f"test_random.py:{line}" in msg and "set_state" not in msg, msg
        assert re.search(place + " whose predicate is batched by vmap", msg), msg
    jax_still_works()


# ---- shard_map ------------------------------------------------------------------------------

def test_shard_map_gives_each_shard_fold_in_of_its_index():
    shard_map = _shard_map_fn()
    mesh = cpu_mesh("d")
    xs = jnp.arange(4.0)

    def body(x):
        return x + jax.random.normal(tx.next_key(), x.shape)
    sm = shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    pure_in, s0 = tx.uncurry(sm, xs)
    pure_body, _ = tx.uncurry(body, xs[:1])
    outside = shard_map(pure_body, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P("d"), P()))
    for p in (pure_in, jax.jit(pure_in), outside):
        for start in (s0, *RESEED):
            out, s1 = p(start, xs)
            key, sub = jax.random.split(start["rng"])
            want = jnp.concatenate([xs[i:i + 1] + jax.random.normal(
                jax.random.fold_in(sub, i), (1,)) for i in range(4)])
            assert_close(out, want)
            same_keys(s1["rng"], key)


# ---- seed ---------------------------------------------------------------------------------

def test_seed_runs_the_function_from_the_given_key_and_returns_its_outputs_only():
    f = functools.partial(_scan, TX)
    for key in (jax.random.key(5), jax.random.PRNGKey(5)):
        seeded = tx.seed(f, key)
        for run in (seeded, jax.jit(seeded)):
            ref = RngEager({"rng": jax.random.key(5)})
            same_keys(run(f32(1.0)), _scan(ref, f32(1.0)))


def test_seed_seeds_only_its_stream_and_other_states_stay_effects():
    def f(x):
        tx.set_state("count", tx.get_state("count", jnp.int32(0)) + 1)
        return x + jax.random.normal(tx.next_key("noise")) + jax.random.normal(tx.next_key())
    seeded = tx.seed(f, jax.random.key(9), stream="noise")
    pure, s0 = tx.uncurry(seeded, f32(0.0))
    assert sorted(s0) == ["count", "rng"]
    out, s1 = pure(s0, f32(0.0))
    ref = RngEager({"noise": jax.random.key(9)})
    want = f32(0.0) + jax.random.normal(ref.next_key("noise")) + jax.random.normal(ref.next_key())
    assert_close(out, want)
    assert int(s1["count"]) == 1


def test_seed_rejects_a_key_array():
    with pytest.raises(tx.StateError, match="'rng'.*one key"):
        tx.seed(lambda: tx.next_key(), jax.random.split(jax.random.key(0)))


def test_pmap_draws_per_device_keys_and_advances_the_stream_once():
    # pmap is a shard_map without vma checking: the stream's new key is
    # split from the replicated key, provably the same on every device, and
    # each device draws fold_in(sub, its index), as under shard_map.
    f = jax.pmap(lambda x: x + jax.random.normal(tx.next_key("noise")),
                 devices=cpu_mesh("d").devices.ravel().tolist())
    pure, s0 = tx.uncurry(f, jnp.zeros(4))
    for start in (s0, {"noise": jax.random.key(7)}):
        out, s1 = pure(start, jnp.zeros(4))
        key, sub = jax.random.split(start["noise"])  # by hand
        want = [jax.random.normal(jax.random.fold_in(sub, i)) for i in range(4)]
        assert_close(out, jnp.stack(want))
        assert jnp.array_equal(jax.random.key_data(s1["noise"]), jax.random.key_data(key))
    jax_still_works()


def test_unreached_next_key_starts_the_stream_at_key_zero():
    def f(x):
        body = lambda c, _: (c + jax.random.normal(tx.next_key()), None)  # noqa: E731
        return lax.scan(body, x, None, length=0)[0]
    pure, s0 = tx.uncurry(f, f32(1.0))
    same_keys(s0["rng"], jax.random.key(0))
    out, s1 = pure(s0, f32(1.0))
    assert float(out) == 1.0
    same_keys(s1["rng"], jax.random.key(0))

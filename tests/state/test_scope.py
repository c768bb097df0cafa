"""Scopes (``taxpr._state._scope``, ``taxpr._state._dicts``): ``tx.scope``
gives the states accessed inside their own names, so one layer used twice
keeps two states; the state dict nests them by scope; ``tx.split_states`` /
``tx.merge_states`` select part of it.

Every program runs twice: with taxpr (raw JAX, ``uncurry``) and eagerly with
Python control flow and a dict keyed by the full names (``"bn1/mean"``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx

from helpers import check
from state_helpers import (
    Eager, TX, assert_close, check_vmap_over_states, f32, i32, jax_still_works,
)


class _ScopedTX(type(TX)):
    scope = staticmethod(tx.scope)


STX = _ScopedTX()


class ScopedEager(Eager):
    """The eager reference: states keyed ``"scope/name"`` in one flat dict,
    pytree values kept as they are."""

    def __init__(self, state=None):
        super().__init__(state)
        self.prefix: tuple[str, ...] = ()

    @contextlib.contextmanager
    def scope(self, name):
        self.prefix = (*self.prefix, name)
        try:
            yield
        finally:
            self.prefix = self.prefix[:-1]

    def _full(self, name):
        return "/".join((*self.prefix, name))

    def get(self, name, init):
        name = self._full(name)
        if name not in self.state:
            self.state[name] = self.first[name] = jax.tree_util.tree_map(jnp.asarray, init)
        return self.state[name]

    def set(self, name, value):
        name = self._full(name)
        if name not in self.state:
            self.first[name] = jax.tree_util.tree_map(jnp.zeros_like, value)
        self.state[name] = value
        return value


def flat(state: dict) -> dict:
    """A nested state dict keyed by full names, as the eager run keeps it."""
    return {"/".join(k): v for k, v in tx._state._dicts.state_keys(state)}


class Stats(NamedTuple):
    mean: jax.Array
    var: jax.Array


def batchnorm(S, x, momentum=0.9):
    """A BatchNorm-like layer: running statistics (a NamedTuple state), a
    step counter, and a scale it only reads."""
    stats = S.get("stats", Stats(jnp.zeros(x.shape[-1]), jnp.ones(x.shape[-1])))
    m, v = x.mean(0), x.var(0)
    S.set("stats", Stats(momentum * stats.mean + (1 - momentum) * m,
                         momentum * stats.var + (1 - momentum) * v))
    S.set("steps", S.get("steps", i32(0)) + 1)
    return (x - m) / jnp.sqrt(v + 1e-5) * S.get("gamma", jnp.ones(x.shape[-1]))


def two_batchnorms(S, x):
    with S.scope("bn1"):
        h = batchnorm(S, x)
    h = jnp.tanh(h)
    with S.scope("bn2"):
        h = batchnorm(S, h)
    return h


def in_scan(S, xs):
    def body(c, x):
        return c + 1, two_batchnorms(S, x)
    with S.scope("seq"):
        return S.scan(body, i32(0), xs)[1]


def in_cond_and_while(S, x, p):
    def grow(h):
        with S.scope("grow"):
            return batchnorm(S, h) + 1.0
    h = S.cond(p > 0, grow, lambda h: h, x)
    with S.scope("loop"):
        def body(c):
            i, h = c
            with S.scope("inner"):
                return i + 1, batchnorm(S, h)
        return S.while_loop(lambda c: c[0] < 2, body, (i32(0), h))[1]


_JIT_BN = jax.jit(functools.partial(batchnorm, STX))  # one jitted function, two scopes


def jitted_twice(S, x):
    layer = _JIT_BN if S is STX else functools.partial(batchnorm, S)
    with S.scope("a"):
        h = layer(x)
    with S.scope("b"):
        h = S.checkpoint(layer)(h * 2.0)
    return h


X = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3)), f32)
XS = jnp.stack([X, X * 2.0 + 1.0, -X])


def check_scoped(prog, *args):
    """uncurry against the eager run, from state0 and from a changed start."""
    pure, s0 = tx.uncurry(functools.partial(prog, STX), *args)
    ref = ScopedEager()
    prog(ref, *args)
    # (A state only an untaken branch uses has its init in state0.)
    assert set(ref.first) <= set(flat(s0))
    assert_close({n: flat(s0)[n] for n in ref.first}, ref.first)
    start = jax.tree_util.tree_map(lambda v: v + jnp.ones_like(v), s0)
    for begin in (s0, start):
        out, s1 = jax.jit(pure)(begin, *args)
        ref = ScopedEager(flat(begin))
        want = prog(ref, *args)
        assert_close(out, want)
        assert_close(flat(s1), ref.state)
    check(jax.make_jaxpr(pure)(s0, *args))
    return pure, s0


# ---- one layer, two scopes, two states ---------------------------------------------------

def test_two_batchnorms_keep_two_states_nested_by_scope():
    pure, s0 = check_scoped(two_batchnorms, X)
    assert sorted(s0) == ["bn1", "bn2"] and isinstance(s0["bn1"], tx.StateScope)
    assert sorted(s0["bn1"]) == ["gamma", "stats", "steps"]
    assert isinstance(s0["bn1"]["stats"], Stats)
    _, s1 = pure(s0, X)
    assert not np.allclose(s1["bn1"]["stats"].mean, s1["bn2"]["stats"].mean)
    assert int(s1["bn1"]["steps"]) == int(s1["bn2"]["steps"]) == 1


@pytest.mark.parametrize("prog,args", [
    (in_scan, (XS,)),
    (in_cond_and_while, (X, f32(1.0))),
    (in_cond_and_while, (X, f32(-1.0))),
    (jitted_twice, (X,)),
], ids=["scan", "cond_while_taken", "cond_while_skipped", "one_jit_two_scopes"])
def test_scopes_through_control_flow_match_the_eager_run(prog, args):
    _, s0 = check_scoped(prog, *args)
    jax_still_works()


def test_one_jitted_layer_in_two_scopes_is_traced_for_each():
    _, s0 = tx.uncurry(functools.partial(jitted_twice, STX), X)
    assert sorted(s0) == ["a", "b"]
    _, states = tx.make_jaxpr(functools.partial(jitted_twice, STX))(X)
    assert {s.name.split("/")[0] for s in states} == {"a", "b"}
    assert "a/stats.mean" in [s.name for s in states]


def test_a_scan_body_traced_in_one_scope_is_not_reused_in_another():
    def body(c, x):
        tx.set_state("n", tx.get_state("n", i32(0)) + 1)
        return c, x

    def fn(xs):
        with tx.scope("first"):
            lax.scan(body, 0, xs)
        with tx.scope("second"):
            lax.scan(body, 0, xs[:2])
        return xs

    pure, s0 = tx.uncurry(fn, XS)
    _, s1 = pure(s0, XS)
    assert int(s1["first"]["n"]) == 3 and int(s1["second"]["n"]) == 2


def test_nested_scopes_and_their_names():
    def fn(x):
        with tx.scope("model"):
            for i in range(2):
                with tx.scope(f"block{i}"):
                    x = tx.set_state("h", x * tx.get_state("w", f32(i + 2.0)))
        return x + tx.get_state("w", f32(10.0))

    pure, s0 = tx.uncurry(fn, f32(1.0))
    assert flat(s0) == {"model/block0/w": 2.0, "model/block1/w": 3.0, "w": 10.0,
                        "model/block0/h": 0.0, "model/block1/h": 0.0}
    out, s1 = pure(s0, f32(1.0))
    assert float(out) == 16.0 and float(s1["model"]["block1"]["h"]) == 6.0
    _, states = tx.make_jaxpr(fn)(f32(1.0))
    names = [s.name for s in states]
    assert "model/block1/w" in names and states[names.index("model/block1/w")].name.scope == (
        "model", "block1")


def test_scope_is_a_named_scope_for_sites():
    def fn(x):
        with tx.scope("bn1"):
            return jnp.sin(x) * tx.get_state("g", f32(1.0))

    pure, s0 = tx.uncurry(fn, f32(1.0))
    assert any(s.scope.startswith("bn1") and s.primitive == "sin"
               for s in tx.sites(lambda x: pure(s0, x)[0], f32(1.0)))


def test_next_key_is_not_scoped():
    def fn():
        with tx.scope("a"):
            k1 = tx.next_key()
        with tx.scope("b"):
            k2 = tx.next_key()
        return jax.random.key_data(k1), jax.random.key_data(k2)

    pure, s0 = tx.uncurry(fn)
    assert sorted(s0) == ["rng"]
    (k1, k2), _ = pure(s0)
    # One stream, split once per draw, as a Python run with one key would.
    key = s0["rng"]
    key, sub1 = jax.random.split(key)
    _, sub2 = jax.random.split(key)
    np.testing.assert_array_equal(k1, jax.random.key_data(sub1))
    np.testing.assert_array_equal(k2, jax.random.key_data(sub2))


def test_vmap_over_a_batch_of_scoped_states_and_grad_with_respect_to_one_scope():
    pure, s0 = tx.uncurry(functools.partial(two_batchnorms, STX), X)
    check_vmap_over_states(pure, s0, (X,), pure)

    gammas, rest = tx.split_states(s0, "*gamma")
    assert flat(gammas).keys() == {"bn1/gamma", "bn2/gamma"}

    def loss(g):
        return pure(tx.merge_states(g, rest), X)[0].sum()

    def eager_loss(g):
        return two_batchnorms(ScopedEager(flat(tx.merge_states(g, rest))), X).sum()

    assert_close(jax.grad(loss)(gammas), jax.grad(eager_loss)(gammas))


# ---- the state dict ----------------------------------------------------------------------

def test_split_and_merge_states():
    pure, s0 = tx.uncurry(functools.partial(two_batchnorms, STX), X)
    bn1, rest = tx.split_states(s0, "bn1/*")
    assert list(bn1) == ["bn1"] and "bn1" not in rest
    back = tx.merge_states(bn1, rest)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(s0)
    assert_close(back, s0)
    # A predicate; a pytree-valued state is one state, never split apart.
    stats, _ = tx.split_states(s0, lambda name: name.endswith("stats"))
    assert isinstance(stats["bn2"]["stats"], Stats)
    with pytest.raises(tx.StateError, match="'bn1/gamma' is given twice"):
        tx.merge_states(bn1, bn1)


def test_pure_keeps_the_other_states_of_a_scope():
    def uses_one(x):
        with tx.scope("bn1"):
            return tx.set_state("mean", x)

    pure, s0 = tx.uncurry(uses_one, f32(1.0))
    full = {"bn1": {"mean": f32(0.0), "other": f32(5.0)}, "top": f32(7.0)}
    _, s1 = pure(full, f32(3.0))
    assert s1 == {"bn1": {"mean": 3.0, "other": 5.0}, "top": 7.0}
    # A scope given as a plain dict stays one: a scan carries it unchanged.
    assert type(s1["bn1"]) is dict and type(pure(s0, f32(3.0))[1]["bn1"]) is tx.StateScope
    carried, _ = lax.scan(lambda s, x: (pure(s, x)[1], None), full, jnp.arange(3.0))
    assert carried == {"bn1": {"mean": 2.0, "other": 5.0}, "top": 7.0}


def test_save_and_load_a_scoped_state(tmp_path):
    pure, s0 = tx.uncurry(functools.partial(two_batchnorms, STX), X)
    _, s1 = pure(s0, X)
    tx.save_state(tmp_path / "s.npz", s1)
    back = tx.load_state(tmp_path / "s.npz", s0)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(s1)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, s1)
    np.testing.assert_array_equal(pure(back, X)[0], pure(s1, X)[0])


# ---- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["", "a/b", 3])
def test_a_scope_name_must_be_a_plain_string(name):
    with pytest.raises(ValueError, match="tx.scope takes a non-empty name"):
        with tx.scope(name):
            pass


def test_a_scope_and_a_state_sharing_a_name_is_an_error():
    def fn(x):
        with tx.scope("bn1"):
            tx.set_state("mean", x)
        return tx.set_state("bn1", x)

    with pytest.raises(tx.StateError, match=r"'bn1' is both a state and a tx.scope: "
                                            r"set_state\('bn1'\) at <top level>, and "
                                            r"set_state\('bn1/mean'\) at <top level> inside "
                                            r"tx.scope\('bn1'\)"):
        tx.uncurry(fn, f32(1.0))

    def in_scan(xs):  # the places are named through nested primitives
        with tx.scope("bn1"):
            lax.scan(lambda c, x: (c, tx.set_state("mean", x)), 0.0, xs)
        tx.get_state("bn1", f32(0.0))
        return xs

    with pytest.raises(tx.StateError, match=r"get_state\('bn1'\) at <top level>, and "
                                            r"set_state\('bn1/mean'\) at scan\[length=3\]"):
        tx.uncurry(in_scan, XS)


def test_a_missing_scoped_state_is_named():
    pure, s0 = tx.uncurry(functools.partial(two_batchnorms, STX), X)
    del s0["bn2"]
    with pytest.raises(tx.StateError, match=r"missing \['bn2/gamma'"):
        pure(s0, X)


# ---- custom derivative rules run in the scope of their call ------------------------------

@jax.custom_jvp
def _counted_sin(x):
    n = tx.get_state("calls", i32(0))
    tx.set_state("calls", n + 1)
    return tx.get_state("scale", f32(2.0)) * jnp.sin(x)


@_counted_sin.defjvp
def _counted_sin_rule(primals, tangents):  # JAX's idiom: the rule calls the function
    (x,), (dx,) = primals, tangents
    return _counted_sin(x), 3.0 * jnp.cos(x) * dx


@jax.custom_vjp
def _counted_identity(x):
    tx.set_state("seen", tx.get_state("seen", i32(0)) + 1)
    tx.get_state("gain", f32(0.5))  # (a state of the function: uncurry threads it)
    return x


def _counted_identity_fwd(x):
    tx.set_state("seen", tx.get_state("seen", i32(0)) + 10)
    return x, tx.get_state("gain", f32(0.5))


_counted_identity.defvjp(_counted_identity_fwd, lambda gain, g: (gain * g,))


def two_scoped_custom_calls(x):
    with tx.scope("a"):
        y = _counted_identity(_counted_sin(x))
    with tx.scope("b"):
        return y + _counted_identity(_counted_sin(2.0 * x))


def test_rules_traced_when_differentiated_from_outside_use_the_calls_scope():
    pure, s0 = tx.uncurry(two_scoped_custom_calls, f32(0.5))
    gains, rest = tx.split_states(s0, "*/gain")
    start = tx.merge_states(rest, {"a": tx.StateScope(gain=f32(0.5)),
                                   "b": tx.StateScope(gain=f32(0.25))})
    x = f32(0.5)
    (out, s1), g = jax.value_and_grad(lambda x: pure(start, x), has_aux=True)(x)
    # By hand: JAX runs each jvp rule (which calls the function once) and
    # each fwd, in the states of their own scope.
    assert_close(out, 2.0 * jnp.sin(x) + 2.0 * jnp.sin(2.0 * x))
    assert_close(g, 0.5 * 3.0 * jnp.cos(x) + 0.25 * 3.0 * jnp.cos(2.0 * x) * 2.0)
    assert flat(s1) == {"a/calls": 1, "a/scale": 2.0, "a/seen": 10, "a/gain": 0.5,
                        "b/calls": 1, "b/scale": 2.0, "b/seen": 10, "b/gain": 0.25}
    # Run plainly, the functions run: the same calls, seen once each.
    _, plain = pure(start, x)
    assert flat(plain)["a/seen"] == flat(plain)["b/seen"] == 1
    # Differentiated inside the function, the rules run there, in their scope.
    pure_g, s0_g = tx.uncurry(jax.grad(two_scoped_custom_calls), x)
    g_inside, s1_g = pure_g(s0_g, x)
    assert_close(g_inside, 0.5 * 3.0 * jnp.cos(x) + 0.5 * 3.0 * jnp.cos(2.0 * x) * 2.0)
    assert flat(s1_g)["a/calls"] == flat(s1_g)["b/calls"] == 1
    assert flat(s1_g)["a/seen"] == flat(s1_g)["b/seen"] == 10


def test_scopes_around_vmap_and_sows_which_keep_their_names():
    from taxpr import harvest as h

    def layer(x):  # per example: reads the scope's scale, sows its output
        y = x * tx.get_state("scale", f32(2.0))
        return h.sow(y, tag="acts", name="y", mode="clobber")

    def fn(xs):
        with tx.scope("outer"):
            ys = jax.vmap(layer)(xs)
            tx.set_state("mean", ys.mean())
        return ys

    pure, s0 = tx.uncurry(fn, X[0])
    assert flat(s0) == {"outer/scale": 2.0, "outer/mean": 0.0}
    ys, s1 = pure({"outer": {"scale": f32(3.0), "mean": f32(0.0)}}, X[0])
    assert_close(ys, X[0] * 3.0)
    assert_close(s1["outer"]["mean"], (X[0] * 3.0).mean())
    # tx.scope scopes states only: a sow keeps its name (harvest.nest scopes sows).
    reaped = h.reap(lambda xs: pure(s0, xs)[0], tag="acts")(X[0])
    assert list(reaped) == ["y"]
    assert_close(reaped["y"], X[0] * 2.0)


def test_scopes_inside_and_around_a_shard_map():
    # One layer used in two scopes inside a shard_map body (a statistic made
    # the same on every shard by psum), inside a scope around the shard_map:
    # three levels of names, each state as a Python run over the shards.
    from jax.sharding import PartitionSpec as P

    from helpers import cpu_mesh, shard_map

    def layer(xs, scale):
        total = lax.psum(xs.sum(0), "d")  # the same on every shard
        tx.set_state("sum", tx.get_state("sum", jnp.zeros(2)) + total)
        tx.set_state("calls", tx.get_state("calls", i32(0)) + 1)
        return xs * scale

    def body(xs):
        with tx.scope("first"):
            xs = layer(xs, 2.0)
        with tx.scope("second"):
            return layer(xs, 3.0)

    def fn(xs):
        with tx.scope("net"):
            return shard_map()(body, mesh=cpu_mesh("d"), in_specs=P("d"), out_specs=P("d"))(xs)

    xs = jnp.arange(16.0).reshape(8, 2)
    pure, s0 = tx.uncurry(fn, xs)
    assert sorted(s0) == ["net"] and sorted(s0["net"]) == ["first", "second"]
    state = s0
    sums = {"first": np.zeros(2), "second": np.zeros(2)}
    for step in range(2):
        x = np.asarray(xs) + step
        out, state = jax.jit(pure)(state, x)
        assert_close(out, x * 6.0)
        sums["first"] += x.sum(0)  # each layer sums its input
        sums["second"] += (x * 2.0).sum(0)
        for scope in ("first", "second"):
            assert int(state["net"][scope]["calls"]) == step + 1
            assert_close(state["net"][scope]["sum"], sums[scope])


def test_split_states_of_a_state_dict_written_by_hand_with_plain_dict_scopes():
    def model(x):
        with tx.scope("l0"):
            b0 = tx.get_state("bias", jnp.zeros(2))
            tx.set_state("bias", b0 + x)
        with tx.scope("l1"):
            b1 = tx.get_state("bias", jnp.zeros(2))
            tx.set_state("bias", b1 - x)
        return b0 + b1

    pure, _ = tx.uncurry(model, jnp.ones(2))
    plain = {"l0": {"bias": jnp.zeros(2)}, "l1": {"bias": jnp.ones(2)}}  # restored by hand
    _, new = pure(plain, jnp.ones(2))
    selected, rest = tx.split_states(new, "*bias")
    assert rest == {}
    np.testing.assert_array_equal(selected["l0"]["bias"], [1.0, 1.0])
    np.testing.assert_array_equal(selected["l1"]["bias"], [0.0, 0.0])
    assert type(selected["l0"]) is dict  # the user's plain dicts stay plain
    # a plain dict picked whole is one state; split and merged back, the same dict
    with_w = {"l0": {"bias": jnp.zeros(2), "w": jnp.ones(2)}, "step": jnp.zeros(())}
    assert tx.split_states(with_w, "l0")[0] == {"l0": with_w["l0"]}
    part, others = tx.split_states(with_w, "l0/bias")
    assert sorted(part["l0"]) == ["bias"] and sorted(others["l0"]) == ["w"]
    merged = tx.merge_states(part, others)
    assert sorted(merged["l0"]) == ["bias", "w"] and "step" in merged


def test_an_array_of_a_pytree_state_in_a_scope_names_its_scope_and_base():
    def f(x):
        with tx.scope("bn1"):
            st = tx.get_state("stats", lambda: {"mean": jnp.zeros(()), "n": jnp.zeros(())})
            tx.set_state("stats", {"mean": st["mean"] + x, "n": st["n"] + 1})
        tx.get_state("pair", lambda: (jnp.zeros(()), jnp.ones(())))
        return x

    _, infos = tx.make_jaxpr_with_states(f)(1.0)
    names = {str(i.name): i.name for i in infos}
    mean = names["bn1/stats['mean']"]
    assert (mean.state, mean.path, mean.scope, mean.base) == ("bn1/stats", "['mean']",
                                                               ("bn1",), "stats")
    first = names["pair[0]"]
    assert (first.state, first.path, first.scope, first.base) == ("pair", "[0]", (), "pair")

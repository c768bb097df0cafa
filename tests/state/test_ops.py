"""State accesses (``taxpr._state._ops``): ``get_state`` / ``set_state`` are
tags marked by a private ``StateOp``, so a user's tag with state-like params
(``op="get"``) is never a state access; a ``set_state`` compiled or run
eagerly without ``uncurry`` says that its update is lost
(``StateNotUncurriedWarning``, at the user's line), and ``uncurry`` / ``seed``
say nothing.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taxpr as tx

from helpers import check
from state_helpers import assert_close, check_vmap_over_states, f32


# ---- user tags are not state accesses ----------------------------------------------------

def test_user_tags_are_not_states():
    def fn(x):
        n = tx.get_state("n", jnp.zeros((), f32))
        y = tx.tag(x * 2.0, op="get", name="n")
        z = tx.tag(x + 1.0, op="set", name="m")
        tx.set_state("n", n + y)
        return y + z

    jaxpr, states = tx.make_jaxpr(fn)(f32(1.0))
    check(jaxpr)
    assert [s.name for s in states] == ["n"]
    user = [s.params for s in tx.find_tags(jaxpr)]
    assert {"op": "get", "name": "n"} in [dict(p) for p in user]
    assert {"op": "set", "name": "m"} in [dict(p) for p in user]
    assert len(user) == 2  # only the user's tags are left

    pure, s0 = tx.uncurry(fn, f32(1.0))
    assert list(s0) == ["n"]
    out, s1 = pure({"n": f32(5.0)}, f32(3.0))
    assert_close(out, f32(6.0 + 4.0))
    assert_close(s1, {"n": f32(11.0)})
    # A user tag whose name matches no state and a state-free program.
    jaxpr2, states2 = tx.make_jaxpr(lambda x: tx.tag(x, op="get", name="q"))(f32(1.0))
    assert states2 == () and len(tx.find_tags(jaxpr2)) == 1


# ---- a set_state without uncurry warns ---------------------------------------------------

def counter(x):
    n = tx.get_state("n", jnp.zeros(()))
    tx.set_state("n", n + x)
    return x * 2


def _compile_warnings(fn, *args) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(fn).lower(*args).compile()
    return [w for w in caught if issubclass(w.category, tx.StateNotUncurriedWarning)]


def test_jit_without_uncurry_warns_naming_the_state_and_uncurry():
    (w,) = _compile_warnings(counter, 1.0)
    assert "set_state('n')" in str(w.message)
    assert "tx.uncurry" in str(w.message)


def test_the_warning_can_be_made_an_error():
    with warnings.catch_warnings():
        warnings.simplefilter("error", tx.StateNotUncurriedWarning)
        with pytest.raises(tx.StateNotUncurriedWarning, match="set_state\\('n'\\)"):
            jax.jit(lambda x: counter(x) + 1).lower(1.0)


def test_uncurried_function_compiles_silently():
    pure, state0 = tx.uncurry(counter, 1.0)
    assert _compile_warnings(pure, state0, 1.0) == []
    out, state1 = jax.jit(pure)(state0, 3.0)
    assert float(out) == 6.0 and float(state1["n"]) == 3.0


def test_read_only_state_and_user_tags_compile_silently():
    def reads(x):
        return x + tx.get_state("n", jnp.ones(()))

    def user_tags(x):  # a user's own tag with state-like params is not state
        return tx.tag(x, op="set", name="n")

    assert _compile_warnings(reads, 1.0) == []
    assert _compile_warnings(user_tags, 1.0) == []


def _eager_warnings(fn, *args) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args)
    return [w for w in caught if issubclass(w.category, tx.StateNotUncurriedWarning)]


def test_an_eager_call_without_uncurry_warns_at_the_set_state_line():
    (w,) = _eager_warnings(counter, 1.0)
    assert "set_state('n') ran eagerly" in str(w.message) and "tx.uncurry" in str(w.message)
    # the warning points at the user's set_state, not at taxpr or JAX
    assert w.filename == __file__
    assert w.lineno == counter.__code__.co_firstlineno + 2


def test_jit_under_disable_jit_runs_eagerly_and_warns():
    with jax.disable_jit():
        (w,) = _eager_warnings(jax.jit(counter), jnp.float32(1.0))
    assert "set_state('n') ran eagerly" in str(w.message)


def test_next_key_without_uncurry_or_seed_warns_that_every_call_gives_the_same_key():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a, b = tx.next_key(), tx.next_key()
    assert (jax.random.key_data(a) == jax.random.key_data(b)).all()
    assert len(caught) == 2 and all(w.category is tx.StateNotUncurriedWarning for w in caught)
    assert "set_state('rng')" in str(caught[0].message)
    assert "tx.next_key the same key" in str(caught[0].message)
    assert "tx.seed" in str(caught[0].message)


def test_uncurry_and_seed_run_without_warnings_eagerly_and_under_disable_jit():
    for disabled in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("error", tx.StateNotUncurriedWarning)
            with jax.disable_jit(disabled):
                pure, state0 = tx.uncurry(counter, 1.0)
                out, state1 = pure(state0, 3.0)
                assert float(out) == 6.0 and float(state1["n"]) == 3.0
                tx.seed(lambda: jax.random.normal(tx.next_key()), jax.random.key(1))()


# ---- pytree-valued states ------------------------------------------------------------

class Stats(NamedTuple):
    mean: jax.Array
    count: jax.Array


def _stats0():
    return Stats(jnp.zeros(2), jnp.zeros((), jnp.int32))


def running_stats(xs):
    """A NamedTuple state updated in a scan, a dict state in a cond, a tuple
    state in a while loop, read again in a checkpoint."""
    def step(c, x):
        st = tx.get_state("stats", _stats0)
        n = st.count + 1
        tx.set_state("stats", Stats(st.mean + (x - st.mean) / n, n))
        ext = tx.get_state("ext", lambda: {"lo": jnp.full(2, jnp.inf), "hi": jnp.full(2, -jnp.inf)})
        ext = jax.lax.cond(jnp.sum(x) > 0,
                           lambda e: {"lo": e["lo"], "hi": jnp.maximum(e["hi"], x)},
                           lambda e: {"lo": jnp.minimum(e["lo"], x), "hi": e["hi"]}, ext)
        tx.set_state("ext", ext)
        return c, None

    jax.lax.scan(step, None, xs)

    def halve(c):
        a, b = tx.get_state("pair", (jnp.ones(2), jnp.zeros((), jnp.int32)))
        tx.set_state("pair", (a / 2, b + 1))
        return c + 1

    jax.lax.while_loop(lambda c: c < 3, halve, 0)
    return jax.checkpoint(lambda: tx.get_state("stats", _stats0).mean * 2.0)()


def running_stats_by_hand(xs, state):
    """``running_stats`` with a Python dict and Python control flow."""
    state = dict(state)
    for x in xs:
        st = state["stats"]
        n = st.count + 1
        state["stats"] = Stats(st.mean + (x - st.mean) / n, n)
        e = state["ext"]
        state["ext"] = ({"lo": e["lo"], "hi": jnp.maximum(e["hi"], x)} if jnp.sum(x) > 0
                        else {"lo": jnp.minimum(e["lo"], x), "hi": e["hi"]})
    for _ in range(3):
        a, b = state["pair"]
        state["pair"] = (a / 2, b + 1)
    return state["stats"].mean * 2.0, state


XS = jnp.array([[1.0, 2.0], [-3.0, 0.5], [2.0, 2.0], [-1.0, -1.0]])


def _check_tree_close(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    jax.tree_util.tree_map(assert_close, a, b)


def test_pytree_states_keep_their_structure_through_scan_cond_while_and_checkpoint():
    pure, state0 = tx.uncurry(running_stats, XS)
    assert isinstance(state0["stats"], Stats) and set(state0["ext"]) == {"lo", "hi"}
    assert isinstance(state0["pair"], tuple) and state0["pair"][1].dtype == jnp.int32
    state = state0
    for f in (pure, jax.jit(pure)):
        out, new = f(state, XS)
        want_out, want = running_stats_by_hand(XS, state)
        assert_close(out, want_out)
        _check_tree_close(new, want)
        state = new  # the second call continues from the first's states


def test_pytree_states_under_vmap_over_a_batch_of_states_and_grad():
    pure, state0 = tx.uncurry(running_stats, XS)
    check_vmap_over_states(pure, state0, (XS,), lambda state, xs: running_stats_by_hand(xs, state))
    # the derivative with respect to a leaf of a pytree state (forward mode:
    # the states pass through a while loop)
    g = jax.jacfwd(lambda m: jnp.sum(pure({**state0, "stats": state0["stats"]._replace(mean=m)},
                                        XS)[0]))(jnp.ones(2))
    g_ref = jax.jacfwd(lambda m: jnp.sum(running_stats_by_hand(
        XS, {**state0, "stats": state0["stats"]._replace(mean=m)})[0]))(jnp.ones(2))
    assert_close(g, g_ref)


def test_make_jaxpr_describes_each_array_of_a_pytree_state():
    _, infos = tx.make_jaxpr_with_states(running_stats)(XS)
    by_name = {str(i.name): i for i in infos}
    assert {"stats.mean", "stats.count", "ext['hi']", "ext['lo']", "pair[0]",
            "pair[1]"} == set(by_name)
    mean = by_name["stats.mean"]
    assert (mean.name.state, mean.name.path, mean.shape) == ("stats", ".mean", (2,))
    assert mean.tree == jax.tree_util.tree_structure(_stats0())
    assert by_name["pair[1]"].dtype == jnp.int32 and by_name["pair[1]"].written


def test_a_typed_key_as_a_leaf_of_a_pytree_state():
    def draw(x):
        key, n = tx.get_state("rng", lambda: (jax.random.key(0), jnp.zeros((), jnp.int32)))
        key, sub = jax.random.split(key)
        tx.set_state("rng", (key, n + 1))
        return x + jax.random.normal(sub)

    pure, state0 = tx.uncurry(draw, jnp.float32(0.0))
    key, sub = jax.random.split(jax.random.key(0))
    out, state1 = pure(state0, jnp.float32(0.0))
    assert_close(out, jax.random.normal(sub))
    assert jnp.array_equal(jax.random.key_data(state1["rng"][0]), jax.random.key_data(key))
    assert int(state1["rng"][1]) == 1


def test_pytree_states_in_custom_rules_differentiated_from_outside():
    # A custom_jvp whose rule calls the function (its state a tuple), and a
    # custom_vjp whose function and fwd update a dict state, the bound the
    # bwd uses kept as a residual.
    @jax.custom_jvp
    def scaled_sin(x):
        calls, scale = tx.get_state("sin", (jnp.int32(0), f32(2.0)))
        tx.set_state("sin", (calls + 1, scale))
        return scale * jnp.sin(x)

    @scaled_sin.defjvp
    def _(primals, tangents):
        (x,), (dx,) = primals, tangents
        return scaled_sin(x), 3.0 * jnp.cos(x) * dx

    def seen():
        st = tx.get_state("clip", {"bound": f32(0.5), "seen": jnp.int32(0)})
        tx.set_state("clip", {"bound": st["bound"], "seen": st["seen"] + 1})
        return st["bound"]

    @jax.custom_vjp
    def clip_grad(x):
        seen()
        return x

    def fwd(x):
        return x, seen()

    clip_grad.defvjp(fwd, lambda bound, g: (jnp.clip(g, -bound, bound),))

    def fn(x):
        return clip_grad(scaled_sin(x)) * 4.0

    pure, state0 = tx.uncurry(fn, f32(0.3))
    (out, state1), g = jax.value_and_grad(lambda x: pure(state0, x), has_aux=True)(f32(0.3))
    # By hand: JAX runs the jvp rule (which calls scaled_sin once) and the fwd.
    assert_close(out, 4.0 * 2.0 * jnp.sin(f32(0.3)))
    assert_close(g, jnp.clip(4.0, -0.5, 0.5) * 3.0 * jnp.cos(f32(0.3)))
    assert isinstance(state1["sin"], tuple) and int(state1["sin"][0]) == 1
    assert set(state1["clip"]) == {"bound", "seen"} and int(state1["clip"]["seen"]) == 1
    # Without differentiation the function runs: the same counts.
    _, plain = pure(state0, f32(0.3))
    _check_tree_close(plain, state1)


def test_pytree_state_set_in_shard_map_from_a_replicated_value():
    from jax.sharding import PartitionSpec as P

    from helpers import cpu_mesh, shard_map

    def body(xs):
        st = tx.get_state("stats", _stats0)
        total = jax.lax.psum(xs.sum(0), "d")  # the same on every shard
        n = st.count + xs.shape[0] * 4
        tx.set_state("stats", Stats(st.mean + (total - st.mean * xs.shape[0] * 4) / n, n))
        return xs - st.mean

    fn = shard_map()(body, mesh=cpu_mesh("d"), in_specs=P("d"), out_specs=P("d"))
    xs = jnp.arange(16.0).reshape(8, 2)
    pure, state0 = tx.uncurry(fn, xs)
    state = state0
    mean, count = np.zeros(2), 0
    for step in range(2):
        out, state = jax.jit(pure)(state, xs + step)
        assert_close(out, xs + step - mean)
        count += 8
        mean = mean + (np.asarray(xs + step).sum(0) - mean * 8) / count
        assert isinstance(state["stats"], Stats) and int(state["stats"].count) == count
        assert_close(state["stats"].mean, mean)


def test_a_state_init_with_a_leaf_that_is_not_an_array_is_an_error_naming_state_and_leaf():
    import equinox as eqx

    def with_config(x):
        cfg = tx.get_state("cfg", lambda: {"scale": jnp.ones(()), "name": "relu"})
        return x * cfg["scale"]

    with pytest.raises(TypeError, match=r"state 'cfg'.*\['name'\]: 'relu' \(str\)"):
        tx.uncurry(with_config, 1.0)

    def with_model(x):
        model = tx.get_state("model", lambda: eqx.nn.MLP(2, 2, 4, 1, activation=jax.nn.relu,
                                                         key=jax.random.key(0)))
        return model(x)

    with pytest.raises(TypeError, match=r"state 'model'.*\.activation.*equinox.partition"):
        tx.uncurry(with_model, jnp.ones(2))
    # the recipe the message gives works
    params, static = eqx.partition(eqx.nn.MLP(2, 2, 4, 1, activation=jax.nn.relu,
                                              key=jax.random.key(0)), eqx.is_array)

    def with_params(x):
        return eqx.combine(tx.get_state("model", lambda: params), static)(x)

    pure, s0 = tx.uncurry(with_params, jnp.ones(2))
    np.testing.assert_allclose(pure(s0, jnp.ones(2))[0], eqx.combine(params, static)(jnp.ones(2)))

"""``tx.register_thread_rule``: a rule registered for a primitive taxpr does
not handle (``lax.custom_linear_solve``, the example rule of docs/extending.md) makes
state, ``inject`` and the walkers work through it, compared with the same
program run eagerly with a dict for state."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun

import taxpr as tx

from helpers import check, thread_rules_restored

EXTENDING = Path(__file__).resolve().parent.parent / "docs" / "extending.md"
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
OFF_DIAG = 0.1  # A = diag(d) + OFF_DIAG * (ones - I): diagonally dominant


@pytest.fixture
def registry():
    """A private copy of the rule registry without custom_linear_solve's
    rule, restored after the test."""
    with thread_rules_restored() as rules:
        rules.pop(jax.lax.linear_solve_p, None)
        yield rules


@pytest.fixture
def solve_rule(registry):
    """The ``linear_solve_rule`` of docs/extending.md, registered by that
    page's code."""
    namespace: dict = {"__name__": "docs_extending"}
    exec(compile(BLOCK.search(EXTENDING.read_text()).group(1), "docs/extending.md", "exec"),
         namespace)
    assert registry[jax.lax.linear_solve_p] is namespace["linear_solve_rule"]
    return namespace["linear_solve_rule"]


def _matvec(d, x):
    return d * x + OFF_DIAG * (x.sum() - x)


def _jacobi(d, b, iters=60):
    return jax.lax.fori_loop(0, iters, lambda _, x: (b - OFF_DIAG * (x.sum() - x)) / d,
                             jnp.zeros_like(b))


def solve_with_state(b):
    """One linear solve whose matrix is kept in state (read in matvec and in
    the Jacobi solver), and a call counter set outside it."""
    tx.set_state("calls", tx.get_state("calls", lambda: jnp.int32(0)) + 1)

    def matvec(x):
        return _matvec(tx.get_state("diag", lambda: jnp.array([2.0, 3.0, 4.0])), x)

    def solve(matvec, b):
        return _jacobi(tx.get_state("diag", lambda: jnp.array([2.0, 3.0, 4.0])), b)

    return jax.lax.custom_linear_solve(matvec, b, solve, symmetric=True)


def solve_eager(state: dict, b):
    state = dict(state, calls=state["calls"] + 1)
    d = np.asarray(state["diag"], np.float64)
    a = np.diag(d) + OFF_DIAG * (np.ones((3, 3)) - np.eye(3))
    return np.linalg.solve(a, np.asarray(b, np.float64)), state


def _pure(fn, *args):
    """``(state, *args) -> (out, state)`` from ``tx.make_jaxpr`` (no init run)."""
    jaxpr, states = tx.make_jaxpr(fn)(*args)
    check(jaxpr)
    names = [s.name for s in states]
    n_out = len(jaxpr.out_avals) - len(names)

    def pure(state, *a):
        outs = jaxpr_as_fun(jaxpr)(*(state[n] for n in names), *a)
        return outs[:n_out], dict(zip(names, outs[n_out:]))

    return pure


STATE0 = {"calls": jnp.int32(4), "diag": jnp.array([2.0, 5.0, 3.0])}
B = jnp.array([1.0, -2.0, 0.5])


def test_unregistered_custom_linear_solve_runs_through_its_implementation(registry):
    pure = _pure(solve_with_state, B)
    (x,), state = pure(STATE0, B)
    np.testing.assert_allclose(x, solve_eager(STATE0, B)[0], rtol=1e-5)
    assert int(state["calls"]) == 5


def test_unregistered_primitive_without_implementation_says_how_to_register(registry):
    from jax.extend.core import Primitive

    call_p = Primitive("call_without_impl")
    call_p.multiple_results = True
    call_p.def_abstract_eval(lambda x, *, jaxpr: [x])

    def f(x):
        with tx.keep_tags():
            body = jax.make_jaxpr(lambda y: y * tx.get_state("s", jnp.float32(1.0)))(x)
        return call_p.bind(x, jaxpr=body)[0]

    with pytest.raises(NotImplementedError,
                       match=r"'call_without_impl' at <top level>: it holds "
                             r"tag\(op=state\.get, name='s'\).*"
                             r"taxpr\.register_thread_rule\(primitive, rule\).*Adding a primitive"):
        tx.make_jaxpr(f)(jnp.float32(1.0))


def test_unregistered_primitive_in_a_rule_run_from_outside_says_to_differentiate_inside(
        registry):
    # A custom_jvp whose rule solves with the matrix kept in state (as an
    # implicit-function rule does): differentiated from outside `pure`, JAX
    # runs the rule after the rewrite, where custom_linear_solve has no rule.
    @jax.custom_jvp
    def scaled(b):
        return b * tx.get_state("diag", lambda: jnp.array([2.0, 3.0, 4.0]))

    @scaled.defjvp
    def _(primals, tangents):
        (b,), (db,) = primals, tangents
        return scaled(b), solve_with_state(db) * 0.0 + db * tx.get_state(
            "diag", lambda: jnp.array([2.0, 3.0, 4.0]))

    pure, state0 = tx.uncurry(lambda b: scaled(b).sum(), B)
    with pytest.raises(NotImplementedError,
                       match=r"'custom_linear_solve' at custom_jvp\[jvp rule\]: it holds "
                             r"tag\(op=state\.get, name='diag'\).*differentiated from outside: "
                             r"take the derivative inside the transformed function instead"):
        jax.grad(lambda b: pure(state0, b)[0])(B)
    # Inside, JAX runs the rule while taxpr traces: the derivative is right.
    pure_g, state0 = tx.uncurry(jax.grad(lambda b: scaled(b).sum()), B)
    g, _ = pure_g(state0, B)
    np.testing.assert_allclose(g, [2.0, 3.0, 4.0])


def test_registered_rule_threads_state_reads_through_custom_linear_solve(solve_rule):
    pure = _pure(solve_with_state, B)
    (x,), state = pure(STATE0, B)
    x_ref, state_ref = solve_eager(STATE0, B)
    np.testing.assert_allclose(x, x_ref, rtol=1e-5)
    assert int(state["calls"]) == int(state_ref["calls"]) == 5
    np.testing.assert_array_equal(state["diag"], STATE0["diag"])
    # Under jit and grad: the derivative of the solve uses matvec, which reads
    # the state too (d x / d b = A^-T).
    g = jax.jit(jax.grad(lambda b: pure(STATE0, b)[0][0] @ jnp.arange(3.0)))(B)
    a = np.diag(np.asarray(STATE0["diag"], np.float64)) + OFF_DIAG * (np.ones((3, 3)) - np.eye(3))
    np.testing.assert_allclose(g, np.linalg.solve(a.T, np.arange(3.0)), rtol=1e-5)


def test_state_set_between_solves_in_a_scan_is_read_by_the_next_solve(solve_rule):
    def f(bs):
        def step(_, b):
            x = solve_with_state(b)
            tx.set_state("diag", tx.get_state("diag", jnp.zeros(3)) + 1.0)
            return None, x
        return jax.lax.scan(step, None, bs)[1]

    bs = jnp.stack([B, 2 * B, -B])
    (xs,), state = jax.jit(_pure(f, bs))(STATE0, bs)
    ref_state, ref_xs = dict(STATE0), []
    for b in bs:
        x, ref_state = solve_eager(ref_state, b)
        ref_state["diag"] = ref_state["diag"] + 1.0
        ref_xs.append(x)
    np.testing.assert_allclose(xs, np.stack(ref_xs), rtol=1e-5)
    assert int(state["calls"]) == int(ref_state["calls"]) == 7
    np.testing.assert_allclose(state["diag"], ref_state["diag"])


def test_inject_reads_ctx_inside_custom_linear_solve(solve_rule):
    def f(b):
        return jax.lax.custom_linear_solve(
            lambda x: tx.tag(jnp.ones(3), op="diag") * x, b,
            lambda mv, b: b / mv(jnp.ones_like(b)), symmetric=True)

    def injector(ctx, token, params):
        return ctx, ctx  # the tag's value becomes ctx

    closed = jax.make_jaxpr(f)(B)
    new = tx.inject(closed, injector, jnp.ones(3))
    check(new)
    x, ctx = jaxpr_as_fun(new)(STATE0["diag"], B)
    np.testing.assert_allclose(x, B / STATE0["diag"], rtol=1e-6)
    np.testing.assert_array_equal(ctx, STATE0["diag"])


def test_state_set_inside_the_solve_is_a_clear_error(solve_rule):
    def f(b):
        def matvec(x):
            return tx.set_state("diag", jnp.ones(3)) * x
        return jax.lax.custom_linear_solve(matvec, b, lambda mv, b: b / mv(jnp.ones_like(b)),
                                           symmetric=True)

    with pytest.raises(NotImplementedError,
                       match=r"custom_linear_solve\[matvec\].*change the context.*'diag'"):
        tx.make_jaxpr(f)(B)


def test_find_and_dissolve_tags_walk_custom_linear_solve(solve_rule):
    closed = jax.make_jaxpr(solve_with_state)(B)
    paths = {s.path for s in tx.find_tags(closed) if s.params.get("name") == "diag"}
    assert paths == {("custom_linear_solve[matvec]",), ("custom_linear_solve[vecmat]",),
                     ("custom_linear_solve[solve]",), ("custom_linear_solve[transpose_solve]",)}
    bare = tx.dissolve_tags(closed)
    check(bare)
    assert list(tx.iter_tags(bare)) == []
    # Without tags the states are their inits: diag [2, 3, 4].
    (x,) = jaxpr_as_fun(bare)(B)
    x_ref, _ = solve_eager({"calls": 0, "diag": jnp.array([2.0, 3.0, 4.0])}, B)
    np.testing.assert_allclose(x, x_ref, rtol=1e-5)


def test_register_thread_rule_rejects_non_primitives(registry):
    with pytest.raises(TypeError, match="expected a jax Primitive"):
        tx.register_thread_rule("custom_linear_solve", lambda *a: a[3])
    with pytest.raises(TypeError, match="must be callable"):
        tx.register_thread_rule(jax.lax.linear_solve_p, None)

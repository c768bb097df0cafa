"""taxpr inside lineax: LU, CG and GMRES on a `FunctionLinearOperator`
whose matvec reads a state, counts its calls in another, or sows; grad
inside and from outside `pure`. Includes the issue's program C.

References: dense NumPy solves, the same solve without taxpr with a
`jax.debug.callback` count of matvecs.
"""
import pytest

lx = pytest.importorskip("lineax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import taxpr as tx  # noqa: E402
from taxpr import harvest as h  # noqa: E402

from ecohelpers import Counter, close  # noqa: E402

A = jnp.array([[4.0, 1.0], [1.0, 3.0]])
B = jnp.array([1.0, 2.0])
SCALE = 2.0
X_WANT = np.linalg.solve(SCALE * np.asarray(A), np.asarray(B))
STRUCT = jax.ShapeDtypeStruct((2,), jnp.float32)


def _solvers():
    return {"lu": lx.LU(), "cg": lx.CG(rtol=1e-7, atol=1e-7),
            "gmres": lx.GMRES(rtol=1e-7, atol=1e-7)}


def _op(mv, solver):
    tags = lx.positive_semidefinite_tag if solver == "cg" else ()
    return lx.FunctionLinearOperator(mv, STRUCT, tags=tags)


# --- a sow in an iterative solver's matvec ------------------------------------

def test_strict_sow_in_cg_matvec_is_oryxs_while_loop_error():
    def solve(b):
        mv = lambda x: h.sow(jnp.float32(1.0), tag="lin", name="scale") * (A @ x)  # noqa: E731
        op = lx.FunctionLinearOperator(mv, jax.ShapeDtypeStruct((2,), jnp.float32),
                                       tags=lx.positive_semidefinite_tag)
        return lx.linear_solve(op, b, lx.CG(rtol=1e-7, atol=1e-7)).value

    # CG calls the matvec in its while loop: oryx's rule for a strict sow
    # there, never an ignored sow (an empty reap).
    with pytest.raises(ValueError, match=r"^Must use clobber or cond_clobber mode for 'scale' "
                                         r"inside of a `while_loop`\.$"):
        h.reap(solve, tag="lin")(jnp.ones(2))


# --- matvec reading state ----------------------------------------------------

def _stateful(solver):
    def f(b):
        tx.set_state("lx_scale", jnp.float32(SCALE))

        def mv(x):
            return tx.get_state("lx_scale", jnp.float32(1.0)) * (A @ x)

        return lx.linear_solve(_op(mv, solver), b, _solvers()[solver]).value
    return f


@pytest.mark.parametrize("solver", ["lu", "cg", "gmres"])
def test_matvec_reads_state(solver):
    pure, s0 = tx.uncurry(_stateful(solver), B)
    x, s1 = jax.jit(pure)(s0, B)
    close(x, X_WANT, rtol=1e-4, atol=1e-5)
    assert float(s1["lx_scale"]) == SCALE


@pytest.mark.parametrize("solver", ["lu", "cg", "gmres"])
def test_grad_from_outside_pure(solver):
    pure, s0 = tx.uncurry(_stateful(solver), B)
    g = jax.grad(lambda b: pure(s0, b)[0].sum())(B)
    # d sum(M^-1 b) / db = M^-T 1
    close(g, np.linalg.solve((SCALE * np.asarray(A)).T, np.ones(2)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("solver", ["lu", "cg", "gmres"])
def test_grad_inside_pure(solver):
    solve = _stateful(solver)
    pure, s0 = tx.uncurry(lambda b: jax.grad(lambda b: solve(b).sum())(b), B)
    g, s1 = pure(s0, B)
    close(g, np.linalg.solve((SCALE * np.asarray(A)).T, np.ones(2)), rtol=1e-4, atol=1e-5)
    assert float(s1["lx_scale"]) == SCALE


@pytest.mark.parametrize("solver", ["cg", "gmres"])
def test_matvec_counts_calls_in_state(solver):
    def f(b):
        def mv(x):
            tx.set_state("lx_n", tx.get_state("lx_n", jnp.zeros((), jnp.int32)) + 1)
            return SCALE * (A @ x)
        return lx.linear_solve(_op(mv, solver), b, _solvers()[solver]).value

    pure, s0 = tx.uncurry(f, B)
    x, s1 = jax.jit(pure)(s0, B)

    counter = Counter()

    def mv(x):
        counter.tick()
        return SCALE * (A @ x)

    ref = jax.jit(lambda b: lx.linear_solve(_op(mv, solver), b, _solvers()[solver]).value)(B)
    jax.effects_barrier()
    close(x, ref, rtol=1e-6)
    close(x, X_WANT, rtol=1e-4, atol=1e-5)
    assert counter.n > 0
    assert int(s1["lx_n"]) == counter.n


@pytest.mark.parametrize("solver", ["lu", "cg", "gmres"])
def test_reap_and_plant_sow_in_matvec(solver):
    def f(b):
        mv = lambda x: h.sow(jnp.float32(1.0), tag="lx", name="lx_scale", mode="clobber") * (A @ x)  # noqa: E731
        return lx.linear_solve(_op(mv, solver), b, _solvers()[solver]).value

    out, reaped = h.call_and_reap(f, tag="lx")(B)
    close(out, np.linalg.solve(np.asarray(A), np.asarray(B)), rtol=1e-4, atol=1e-5)
    assert set(reaped) == {"lx_scale"} and float(reaped["lx_scale"]) == 1.0
    planted = h.plant(f, tag="lx")({"lx_scale": jnp.float32(SCALE)}, B)
    close(planted, X_WANT, rtol=1e-4, atol=1e-5)


def test_vmap_over_states_cg():
    pure, s0 = tx.uncurry(_stateful("cg"), B)

    def g(b):  # the scale read inside the solve comes from the batch of states
        def f(b):
            def mv(x):
                return tx.get_state("lx_scale", jnp.float32(1.0)) * (A @ x)
            return lx.linear_solve(_op(mv, "cg"), b, _solvers()["cg"]).value
        return f(b)

    pure2, _ = tx.uncurry(g, B)
    xs, _ = jax.vmap(pure2, in_axes=(0, None))({"lx_scale": jnp.array([1.0, 2.0])}, B)
    close(xs[0], np.linalg.solve(np.asarray(A), np.asarray(B)), rtol=1e-4, atol=1e-5)
    close(xs[1], X_WANT, rtol=1e-4, atol=1e-5)


# --- a patch or a plant in the matvec, differentiated ----------------------------------------

def _scaled_solution(s: float) -> np.ndarray:
    return np.linalg.solve(s * np.asarray(A, np.float64), np.asarray(B, np.float64))


def _solve_with_named_matvec(solver):
    def f(b):
        def mv(x):
            with jax.named_scope("matvec"):
                return A @ x
        return lx.linear_solve(_op(mv, solver), b, _solvers()[solver]).value
    return f


# lineax's linear_solve differentiates the solve through its operator's
# matvec, which it keeps (the Python function) and runs in its own rule,
# while LU materializes the matrix from a copy of the matvec in the traced
# program and stops its gradient. taxpr rewrites the copy only: a derivative
# that would come through a value the rewrite changed there is a clear error.
_KEPT_CODE = r"from outside the transformed function is not supported: 'linear_solve' .* keeps the code"


def test_a_patched_matvec_is_what_the_solve_and_its_derivative_wrt_b_use():
    # The matvec's product scaled by 2 by a patch: the solve is of 2 A, and
    # so is its derivative w.r.t. b: d sum(x) / db = (2 A)^-T 1.
    f = _solve_with_named_matvec("lu")
    site = [s.name for s in tx.sites(f, B) if s.primitive == "dot_general"][0]
    patched = lambda b: tx.patch(f, {site: lambda v: v * SCALE})(b).sum()  # noqa: E731
    value, d_b = jax.value_and_grad(patched)(B)
    close(value, _scaled_solution(SCALE).sum(), rtol=1e-4)
    close(d_b, np.linalg.solve((SCALE * np.asarray(A, np.float64)).T, np.ones(2)), rtol=1e-4)


def test_grad_wrt_a_value_a_matvec_patch_closes_over_is_an_error():
    f = _solve_with_named_matvec("lu")
    site = [s.name for s in tx.sites(f, B) if s.primitive == "dot_general"][0]

    def patched(s):
        return tx.patch(f, {site: lambda v: v * s})(B).sum()

    close(patched(jnp.float32(SCALE)), _scaled_solution(SCALE).sum(), rtol=1e-4)
    with pytest.raises(NotImplementedError, match=r"taxpr: differentiating the site 'matvec/dot_general' .*in "
                                                  r"_solve_with_named_matvec.<locals>.f.<locals>.mv\).*"
                                                  + _KEPT_CODE):
        jax.grad(patched)(jnp.float32(SCALE))


def test_grad_wrt_a_value_planted_in_the_matvec_is_an_error():
    def f(b):
        mv = lambda x: h.sow(jnp.float32(1.0), tag="lx", name="s", mode="clobber") * (A @ x)  # noqa: E731
        return lx.linear_solve(_op(mv, "lu"), b, _solvers()["lu"]).value

    planted = lambda s: h.plant(f, tag="lx")({"s": s}, B).sum()  # noqa: E731
    close(planted(jnp.float32(SCALE)), _scaled_solution(SCALE).sum(), rtol=1e-4)
    with pytest.raises(NotImplementedError, match=r"taxpr: differentiating tag\(op=sow, tag='lx', "
                                                  r"name='s'.*" + _KEPT_CODE):
        jax.grad(planted)(jnp.float32(SCALE))


@pytest.mark.parametrize("matrix", ["global", "argument"])
def test_grad_wrt_a_state_read_in_the_matvec_is_an_error(matrix):
    # "argument": the matvec closes over a traced matrix, so lineax keeps
    # its closure-converted jaxpr (with the read in it), not the function.
    def f(b, a):
        m = A if matrix == "global" else a
        mv = lambda x: tx.get_state("lx_scale", jnp.float32(1.0)) * (m @ x)  # noqa: E731
        return lx.linear_solve(_op(mv, "lu"), b, _solvers()["lu"]).value

    pure, _ = tx.uncurry(f, B, A)
    loss = lambda s: pure({"lx_scale": s}, B, A)[0].sum()  # noqa: E731
    close(loss(jnp.float32(SCALE)), _scaled_solution(SCALE).sum(), rtol=1e-4)
    with pytest.raises(NotImplementedError, match=r"name='lx_scale'.*" + _KEPT_CODE):
        jax.grad(loss)(jnp.float32(SCALE))


def test_grad_wrt_a_state_the_matvec_closes_over():
    # Read outside the matvec, the state is a leaf of the operator, which
    # lineax's rule differentiates: d sum(x) / ds = -sum(x) / s.
    def f(b):
        scale = tx.get_state("lx_scale", jnp.float32(1.0))
        return lx.linear_solve(_op(lambda x: scale * (A @ x), "lu"), b, _solvers()["lu"]).value

    pure, _ = tx.uncurry(f, B)
    value, d_s = jax.value_and_grad(lambda s: pure({"lx_scale": s}, B)[0].sum())(
        jnp.float32(SCALE))
    want = _scaled_solution(SCALE)
    close(value, want.sum(), rtol=1e-4)
    close(d_s, -want.sum() / SCALE, rtol=1e-3)

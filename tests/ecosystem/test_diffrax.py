"""taxpr inside diffrax: adaptive ODE solves (Tsit5 / Dopri5 with a PID
controller) whose vector field reads and writes state, every adjoint, grad
inside and from outside `pure`, vmap over states, an SDE whose Brownian
motion key comes from `tx.next_key`, sows in a vector field.

References: the same solve without taxpr (state values passed as `args`),
a `jax.debug.callback` count of vector-field evaluations in the same program
without taxpr, `sol.stats`, and closed forms (y' = -k y).
"""
import pytest

diffrax = pytest.importorskip("diffrax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import taxpr as tx  # noqa: E402
from taxpr import harvest as h  # noqa: E402

from ecohelpers import Counter, close  # noqa: E402

T1 = 1.0
K = 2.0
SOLVERS = {"tsit5": diffrax.Tsit5, "dopri5": diffrax.Dopri5}
ADJOINTS = {"recursive": diffrax.RecursiveCheckpointAdjoint,
            "backsolve": diffrax.BacksolveAdjoint,
            "direct": diffrax.DirectAdjoint}


def _controller():
    return diffrax.PIDController(rtol=1e-5, atol=1e-5, pcoeff=0.3, icoeff=0.4)


def _solve(vf, y0, solver="tsit5", adjoint="recursive", args=None, max_steps=64):
    return diffrax.diffeqsolve(
        diffrax.ODETerm(vf), SOLVERS[solver](), 0.0, T1, 0.1, y0, args=args,
        stepsize_controller=_controller(), adjoint=ADJOINTS[adjoint](),
        max_steps=max_steps)


def _stateful_vf(t, y, args):
    tx.set_state("dx_evals", tx.get_state("dx_evals", jnp.zeros((), jnp.int32)) + 1)
    return -tx.get_state("dx_k", jnp.float32(1.0)) * y


def _stateful_solve(solver="tsit5", adjoint="recursive"):
    def f(y0):
        tx.set_state("dx_k", jnp.float32(K))
        return _solve(_stateful_vf, y0, solver, adjoint).ys[-1]
    return f


def _reference(y0, solver="tsit5", adjoint="recursive"):
    """The same solve without taxpr (k passed as args), counting vector-field
    evaluations at run time with jax.debug.callback."""
    counter = Counter()

    def vf(t, y, k):
        counter.tick()
        return -k * y

    sol = jax.jit(lambda y0: _solve(vf, y0, solver, adjoint, args=jnp.float32(K)))(y0)
    jax.effects_barrier()
    return sol, counter.n


@pytest.mark.parametrize("solver", sorted(SOLVERS))
def test_adaptive_solve_reads_state_and_counts_evaluations(solver):
    y0 = jnp.array([1.0, 0.5])
    pure, s0 = tx.uncurry(_stateful_solve(solver), y0)
    y1, s1 = jax.jit(pure)(s0, y0)
    sol, evals = _reference(y0, solver)
    close(y1, sol.ys[-1])
    close(y1, y0 * np.exp(-K * T1), rtol=1e-4, atol=1e-5)
    assert int(sol.stats["num_steps"]) > 2  # adaptive: several steps were taken
    assert int(s1["dx_evals"]) == evals, (int(s1["dx_evals"]), evals)
    assert float(s1["dx_k"]) == K


@pytest.mark.parametrize("adjoint", sorted(ADJOINTS))
def test_grad_from_outside_pure(adjoint):
    y0 = jnp.array([1.0, 0.5])
    pure, s0 = tx.uncurry(_stateful_solve(adjoint=adjoint), y0)
    g, s1 = jax.grad(lambda y0: (lambda o: (o[0].sum(), o[1]))(pure(s0, y0)), has_aux=True)(y0)
    close(g, np.full(2, np.exp(-K * T1)), rtol=1e-3)
    # The states `pure` returns are the forward pass's: its evaluations
    # counted once each (a backward solve runs after `pure` has returned,
    # as eagerly after the dict was returned).
    _, evals = _reference(y0, adjoint=adjoint)
    assert int(s1["dx_evals"]) == evals, (int(s1["dx_evals"]), evals)
    assert float(s1["dx_k"]) == K


@pytest.mark.parametrize("adjoint", sorted(ADJOINTS))
def test_grad_wrt_overwritten_state_from_outside_pure(adjoint):
    # The gradient with respect to the state (k), through the solve.
    y0 = jnp.array([1.0, 0.5])
    pure, s0 = tx.uncurry(_stateful_solve(adjoint=adjoint), y0)
    gk = jax.grad(lambda k: pure({**s0, "dx_k": k}, y0)[0].sum())(s0["dx_k"])
    # k is set to K inside f before the solve: the input k does not matter
    assert float(gk) == 0.0


@pytest.mark.parametrize("adjoint", sorted(ADJOINTS))
def test_grad_inside_pure(adjoint):
    solve = _stateful_solve(adjoint=adjoint)

    def f(y0):
        return jax.value_and_grad(lambda y0: solve(y0).sum())(y0)

    y0 = jnp.array([1.0, 0.5])
    pure, s0 = tx.uncurry(f, y0)
    (val, g), s1 = pure(s0, y0)
    close(val, 1.5 * np.exp(-K * T1), rtol=1e-4)
    close(g, np.full(2, np.exp(-K * T1)), rtol=1e-3)
    assert float(s1["dx_k"]) == K
    if adjoint != "backsolve":  # its backward solve evaluates the field again
        _, evals = _reference(y0, adjoint=adjoint)
        assert int(s1["dx_evals"]) == evals  # the recomputation counts nothing


def test_grad_from_outside_pure_of_solves_in_a_scan_reading_a_float_state():
    # The vector field reads k (a float state nothing sets): the solve of the
    # previous step, a custom_vjp call, passes k through, which must not make
    # k look differentiated for the next step's solve.
    def f(y0):
        def step(y, _):
            return _solve(_stateful_vf, y).ys[-1], None
        return jax.lax.scan(step, y0, None, length=2)[0]

    counter = Counter()

    def reference(y0):
        def vf(t, y, k):
            counter.tick()
            return -k * y

        def step(y, _):
            return _solve(vf, y, args=jnp.float32(K)).ys[-1], None
        return jax.lax.scan(step, y0, None, length=2)[0]

    y0 = jnp.array([1.0, 0.5])
    pure, s0 = tx.uncurry(f, y0)
    state = {**s0, "dx_k": jnp.float32(K)}
    g, s1 = jax.grad(lambda y0: (lambda o: (o[0].sum(), o[1]))(pure(state, y0)),
                     has_aux=True)(y0)
    close(g, np.full(2, np.exp(-2 * K * T1)), rtol=1e-3)
    counter.reset()
    jax.block_until_ready(jax.jit(reference)(y0))
    jax.effects_barrier()
    assert int(s1["dx_evals"]) == counter.n, (int(s1["dx_evals"]), counter.n)
    assert float(s1["dx_k"]) == K


def test_grad_wrt_state_read_in_vector_field():
    # k only read from the state: d y1 / d k = -T1 * y1
    def f(y0):
        return _solve(_stateful_vf, y0).ys[-1]

    y0 = jnp.array([1.0])
    pure, s0 = tx.uncurry(f, y0)
    s = {**s0, "dx_k": jnp.float32(K)}
    gk = jax.grad(lambda k: pure({**s, "dx_k": k}, y0)[0].sum())(s["dx_k"])
    close(gk, -T1 * np.exp(-K * T1), rtol=1e-3)


def test_vmap_over_states():
    def f(y0):
        return _solve(_stateful_vf, y0).ys[-1]

    y0 = jnp.array([1.0])
    pure, s0 = tx.uncurry(f, y0)
    ks = jnp.array([0.5, 1.0, 2.0])
    batch = {"dx_k": ks, "dx_evals": jnp.zeros(3, jnp.int32)}
    y1, s1 = jax.vmap(pure, in_axes=(0, None))(batch, y0)
    close(y1[:, 0], np.exp(-np.asarray(ks) * T1), rtol=1e-4)
    # each member counts its own evaluations: those of its own solve
    for i, k in enumerate([0.5, 1.0, 2.0]):
        counter = Counter()

        def vf(t, y, k):
            counter.tick()
            return -k * y
        jax.jit(lambda y0: _solve(vf, y0, args=jnp.float32(k)))(y0)
        jax.effects_barrier()
        assert int(s1["dx_evals"][i]) == counter.n


def test_continue_from_saved_state():
    y0 = jnp.array([1.0])
    pure, s = tx.uncurry(_stateful_solve(), y0)
    _, evals = _reference(y0)
    for i in range(1, 3):
        _, s = pure(s, y0)
        assert int(s["dx_evals"]) == i * evals


def test_sde_brownian_key_from_next_key():
    def drift(t, y, args):
        return -y

    def diffusion(t, y, args):
        return 0.5 * jnp.ones_like(y)

    def sde(y0, key):
        bm = diffrax.VirtualBrownianTree(0.0, T1, tol=1e-3, shape=(), key=key)
        terms = diffrax.MultiTerm(diffrax.ODETerm(drift),
                                  diffrax.ControlTerm(diffusion, bm))
        return diffrax.diffeqsolve(terms, diffrax.Euler(), 0.0, T1, 0.1, y0).ys[-1]

    pure, s = tx.uncurry(lambda y0: sde(y0, tx.next_key()), 1.0)
    key = jax.random.key(0)
    outs = []
    for _ in range(2):
        out, s = jax.jit(pure)(s, 1.0)
        key, sub = jax.random.split(key)
        close(out, sde(1.0, sub), rtol=1e-5)
        outs.append(float(out))
    assert outs[0] != outs[1]  # a new Brownian path per call
    assert (jax.random.key_data(s["rng"]) == jax.random.key_data(key)).all()
    seeded = tx.seed(lambda y0: sde(y0, tx.next_key()), jax.random.key(5))
    close(seeded(1.0), sde(1.0, jax.random.split(jax.random.key(5))[1]), rtol=1e-5)


def _sowing_vf(t, y, args):
    k = h.sow(jnp.float32(1.0), tag="dx", name="dx_k", mode="clobber")
    return -k * y


def test_reap_sow_in_vector_field():
    f = lambda y0: _solve(_sowing_vf, y0).ys[-1]  # noqa: E731
    out, reaped = h.call_and_reap(f, tag="dx")(jnp.array([1.0]))
    close(out, [np.exp(-T1)], rtol=1e-4)
    assert set(reaped) == {"dx_k"} and float(reaped["dx_k"]) == 1.0


def test_plant_sow_in_vector_field():
    f = lambda y0: _solve(_sowing_vf, y0).ys[-1]  # noqa: E731
    out = h.plant(f, tag="dx")({"dx_k": jnp.float32(K)}, jnp.array([1.0]))
    close(out, [np.exp(-K * T1)], rtol=1e-4)


# --- issue G: a vector field that reads a state it updates, grad inside ----------

EULER_STEPS = 5
DT = 0.1


def _euler_python_loop(y0):
    """Euler steps with the evaluation count in a dict: y_{i+1} = y_i + dt *
    (-(1 + 0.1 n) y_i), n the count before the evaluation."""
    state, y, dy = {"g_n": 0.0}, y0, 1.0
    for _ in range(EULER_STEPS):
        factor = 1.0 - DT * (1.0 + 0.1 * state["g_n"])
        state["g_n"] += 1.0
        y, dy = y * factor, dy * factor
    return y, dy, state["g_n"]


@pytest.mark.parametrize("adjoint", ["recursive", "direct"])
def test_vector_field_reads_state_it_updates_grad_inside(adjoint):
    def vf(t, y, args):
        n = tx.get_state("g_n", jnp.zeros(()))
        tx.set_state("g_n", n + 1.0)
        return -(1.0 + 0.1 * n) * y

    def solve(y0):
        return diffrax.diffeqsolve(
            diffrax.ODETerm(vf), diffrax.Euler(), 0.0, EULER_STEPS * DT, DT, y0,
            adjoint=ADJOINTS[adjoint](), max_steps=16).ys[-1]

    def f(y0):
        return jax.value_and_grad(solve)(y0)

    pure, s0 = tx.uncurry(f, 2.0)
    (val, g), s1 = pure(s0, 2.0)
    y, dy, n = _euler_python_loop(2.0)
    close(val, y, rtol=1e-5)
    close(g, dy, rtol=1e-5)  # the backward pass sees each step's count
    assert float(s1["g_n"]) == n == EULER_STEPS


def test_vmap_inside_pure_vector_field_reads_state():
    """A batch of initial conditions solved with `jax.vmap` inside the
    uncurried function, the decay rate read from a state in the vector
    field: each example as its own solve, and the gradient from outside."""
    def solve(y0):
        return _solve(lambda t, y, a: -tx.get_state("k", jnp.float32(K)) * y, y0).ys[-1]

    ys = jnp.array([1.0, 2.0, 5.0])
    pure, s0 = tx.uncurry(lambda ys: jax.vmap(solve)(ys), ys)
    out, s1 = jax.jit(pure)({"k": jnp.float32(3.0)}, ys)
    ref = jax.vmap(lambda y: _solve(lambda t, y, a: -a * y, y, args=3.0).ys[-1])(ys)
    close(out, ref)
    close(out, ys * np.exp(-3.0), rtol=1e-4)
    g = jax.grad(lambda ys: pure(s1, ys)[0].sum())(ys)
    close(g, np.full(3, np.exp(-3.0)), rtol=1e-4)


def test_grad_inside_of_vmap_inside_pure_vector_field_reads_state():
    def solve(y0):
        return _solve(lambda t, y, a: -tx.get_state("k", jnp.float32(K)) * y, y0).ys[-1]

    ys = jnp.array([1.0, 2.0, 5.0])
    pure, s0 = tx.uncurry(lambda ys: jax.grad(lambda ys: jax.vmap(solve)(ys).sum())(ys), ys)
    g, s1 = pure({"k": jnp.float32(3.0)}, ys)
    close(g, np.full(3, np.exp(-3.0)), rtol=1e-4)
    assert float(s1["k"]) == 3.0


# --- harvest differentiated from outside: the adjoints' custom_vjps ----------

def _sowing_vf_and_last_y(t, y, args):
    h.sow(y[0], tag="dx", name="last_y", mode="clobber")
    return _sowing_vf(t, y, args)


@pytest.mark.parametrize("adjoint", ["recursive", "backsolve"])
def test_grad_of_a_harvest_of_a_solve_whose_vector_field_sows(adjoint):
    # Each adjoint is a custom_vjp around the solve's while loop, which JAX
    # cannot reverse: the reaped values, not differentiated, must not make
    # taxpr differentiate the loop itself. Reference: the same solves
    # without taxpr (k = 1, and k = K for the plant), differentiated by JAX.
    f = lambda y0: _solve(_sowing_vf_and_last_y, y0, adjoint=adjoint).ys[-1]  # noqa: E731
    plain = lambda k: lambda y0: _solve(lambda t, y, a: -k * y, y0, adjoint=adjoint).ys[-1][0]  # noqa: E731
    y0 = jnp.array([1.0])
    want_1, want_k = jax.value_and_grad(plain(1.0))(y0), jax.grad(plain(K))(y0)

    def loss(y0):
        out, reaps = h.call_and_reap(f, tag="dx")(y0)
        return out[0], reaps

    planted = jax.grad(lambda y0: h.plant(f, tag="dx")({"dx_k": jnp.float32(K)}, y0)[0])
    # Twice: the second time equinox's caches hand taxpr the traces of the first.
    for _ in range(2):
        (value, reaps), g = jax.value_and_grad(loss, has_aux=True)(y0)
        close(value, want_1[0], rtol=1e-6)
        close(g, want_1[1], rtol=1e-6)
        assert set(reaps) == {"dx_k", "last_y"} and float(reaps["dx_k"]) == 1.0
        close(reaps["last_y"], h.reap(f, tag="dx")(y0)["last_y"], rtol=1e-6)
        close(planted(y0), want_k, rtol=1e-6)


@pytest.mark.parametrize("adjoint", ["recursive", "backsolve"])
def test_grad_wrt_a_value_planted_in_the_vector_field_is_an_error_naming_it(adjoint):
    # The adjoint's bwd gives derivatives of the solve's own inputs; the
    # planted rate is not one of them (eagerly it would be: a value the
    # vector field closes over), and JAX cannot reverse the solve's while
    # loop: an error naming the plant, never a zero. Passed as the solve's
    # args, the same rate differentiates (the reference).
    f = lambda k: h.plant(lambda y0: _solve(_sowing_vf, y0, adjoint=adjoint).ys[-1][0],  # noqa: E731
                          tag="dx")({"dx_k": k}, jnp.array([1.0]))
    by_args = lambda k: _solve(lambda t, y, a: -a * y, jnp.array([1.0]), adjoint=adjoint,  # noqa: E731
                               args=k).ys[-1][0]
    close(f(jnp.float32(K)), by_args(jnp.float32(K)), rtol=1e-6)
    close(jax.grad(by_args)(jnp.float32(K)), -T1 * np.exp(-K * T1), rtol=1e-3)
    with pytest.raises(NotImplementedError,
                       match=r"the value planted for 'dx_k' is differentiated.*while loop"):
        jax.grad(f)(jnp.float32(K))


@pytest.mark.parametrize("adjoint", ["recursive", "backsolve"])
def test_tx_value_and_grad_through_a_state_passed_as_the_solves_args(adjoint):
    # A decay rate set from the differentiated parameter, kept in a state and
    # passed to the solve as its args, while the vector field counts its
    # evaluations in another state: the solve's adjoint hands the rate's
    # state on unchanged (identity derivative there) and differentiates the
    # args. Reference: the same solve without taxpr, differentiated by JAX,
    # and its evaluations counted at run time.
    def loss(a, y0):
        tx.set_state("k", a * 2.0)

        def vf(t, y, k):
            tx.set_state("evals", tx.get_state("evals", jnp.zeros((), jnp.int32)) + 1)
            return -k * y
        return _solve(vf, y0, adjoint=adjoint, args=tx.get_state("k", jnp.float32(0.0))).ys[-1, 0]

    y0 = jnp.array([1.0])
    pure, s0 = tx.uncurry(tx.value_and_grad(loss), jnp.float32(1.0), y0)
    (value, grad), s1 = jax.jit(pure)(s0, jnp.float32(1.0), y0)
    counter = Counter()

    def vf_ref(t, y, k):
        counter.tick()
        return -k * y
    value_ref, grad_ref = jax.jit(jax.value_and_grad(
        lambda a: _solve(vf_ref, y0, adjoint=adjoint, args=a * 2.0).ys[-1, 0]))(jnp.float32(1.0))
    counter.reset()
    jax.jit(lambda a: _solve(vf_ref, y0, adjoint=adjoint, args=a * 2.0))(jnp.float32(1.0))
    jax.effects_barrier()
    close(value, value_ref)
    close(grad, grad_ref, rtol=1e-4)
    close(grad, -2.0 * T1 * np.exp(-2.0 * T1), rtol=1e-3)
    assert int(s1["evals"]) == counter.n  # the forward solve's evaluations
    assert float(s1["k"]) == 2.0

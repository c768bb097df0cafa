"""``tx.progress`` on library code, unmodified: a diffrax solve's steps
(counted against diffrax's own ``num_steps``), an optax training loop of
epochs and steps in one ``jit`` (against the loop structure written in
Python)."""

import pytest

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import taxpr as tx  # noqa: E402

from progress_recorder import Recorder  # noqa: E402


def test_a_diffrax_solve_shows_its_steps():
    diffrax = pytest.importorskip("diffrax")

    def solve(y0):
        sol = diffrax.diffeqsolve(diffrax.ODETerm(lambda t, y, a: -y), diffrax.Tsit5(), 0.0, 3.0,
                                  0.1, y0, stepsize_controller=diffrax.PIDController(1e-5, 1e-5))
        return sol.ys[-1], sol.stats["num_steps"]

    rec = Recorder()
    (y, steps), (y_ref, steps_ref) = tx.progress(solve, display=rec)(1.0), jax.jit(solve)(1.0)
    jax.effects_barrier()
    # (the same bits at XLA's default optimization level; the suite's level
    # 0 compiles the watched loop's body arithmetic differently, in the
    # last bit)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6)
    assert int(steps) == int(steps_ref)
    loop = rec.events[0][1]
    assert rec.events[0] == ("start", loop, None) and loop.endswith("/while")
    # every iteration of the solve's loop is a step (accepted or rejected)
    updates = [n for kind, name, n in rec.events if kind == "update" and name == loop]
    assert updates == list(range(1, len(updates) + 1))
    assert rec.events[-1] == ("close", loop, len(updates)) and len(updates) >= int(steps)


def test_a_diffrax_solve_shown_by_its_time():
    # The bar follows the solver's time t (tprev = min(tprev, t1) in its
    # loop), from t0 to t1: the distinct values shown are the times diffrax
    # itself reports for its accepted steps (SaveAt(steps=True)).
    diffrax = pytest.importorskip("diffrax")

    def solve(y0, saveat=diffrax.SaveAt(t1=True)):
        return diffrax.diffeqsolve(diffrax.ODETerm(lambda t, y, a: -y), diffrax.Tsit5(), 0.0,
                                   3.0, 0.1, y0, saveat=saveat,
                                   stepsize_controller=diffrax.PIDController(1e-5, 1e-5)).ys[-1]

    rec = Recorder()
    time = tx.select.source(function="*body_fun_aux") & tx.select.primitive("min")
    y = tx.progress(solve, value=time, total=3.0, display=rec)(1.0)
    jax.effects_barrier()
    np.testing.assert_allclose(np.asarray(y), np.asarray(jax.jit(solve)(1.0)), rtol=1e-6)
    steps = diffrax.diffeqsolve(diffrax.ODETerm(lambda t, y, a: -y), diffrax.Tsit5(), 0.0, 3.0,
                                0.1, 1.0, saveat=diffrax.SaveAt(steps=True),
                                stepsize_controller=diffrax.PIDController(1e-5, 1e-5)).ts
    accepted = [float(t) for t in np.asarray(steps) if np.isfinite(t)]
    loop = rec.events[0][1]
    assert rec.events[0] == ("start", loop, 3.0) and loop.endswith("/while")
    shown = [n for kind, _, n in rec.events if kind == "update"]
    # (a rejected step shows the same t again; diffrax's run is compiled
    # apart, and its step size controller amplifies last-bit differences)
    np.testing.assert_allclose(list(dict.fromkeys(shown)), accepted, rtol=1e-4)
    assert rec.events[-1] == ("close", loop, 3.0)


def test_an_optax_training_loop_shows_epochs_and_steps():
    optax = pytest.importorskip("optax")
    opt = optax.adam(1e-2)
    epochs, steps = 3, 25

    def train(w, xs, ys):
        def loss(w, x, y):
            return jnp.mean((x @ w - y) ** 2)

        def step(carry, batch):
            w, state = carry
            g = jax.grad(loss)(w, *batch)
            updates, state = opt.update(g, state)
            return (optax.apply_updates(w, updates), state), None

        def epoch(carry, _):
            return lax.scan(step, carry, (xs, ys))[0], None

        return lax.scan(epoch, (w, opt.init(w)), None, length=epochs)[0][0]

    key = jax.random.key(0)
    xs = jax.random.normal(key, (steps, 16, 4))
    ys = xs @ jnp.arange(4.0)
    w0 = jnp.zeros(4)
    rec = Recorder()
    w = jax.jit(tx.progress(train, display=rec, nested=True, every=5))(w0, xs, ys)
    jax.effects_barrier()
    assert np.asarray(w).tobytes() == np.asarray(jax.jit(train)(w0, xs, ys)).tobytes()
    outer = "scan[length=3]"
    inner = f"{outer}/scan[length={steps}]"
    want = [("start", outer, epochs)]
    for _ in range(epochs):
        want += [("start", inner, steps)]
        want += [("update", inner, n) for n in range(5, steps + 1, 5)]
        want += [("close", inner, steps)]
    # (every 5 epochs, or the last)
    assert rec.events == want + [("update", outer, epochs), ("close", outer, epochs)]

"""taxpr.capture inside a diffrax solve: the step sizes its adaptive
controller chose, without touching diffrax, against the solve's own
statistics and ``SaveAt(steps=True)``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

diffrax = pytest.importorskip("diffrax")

import taxpr as tx  # noqa: E402

MAX_STEPS = 64


def solve(y0, rate=2.0):
    term = diffrax.ODETerm(lambda t, y, a: -a * y + jnp.sin(3.0 * t))
    sol = diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 3.0, 0.1, y0, args=rate,
                              stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-7),
                              saveat=diffrax.SaveAt(steps=True), max_steps=MAX_STEPS)
    return sol.ys, sol.ts, sol.stats


def controller_sites(*args):
    """The step tried (``t1 - t0``) and whether it was kept, as the PID
    controller computes them."""
    pid = [s for s in tx.sites(solve, *args) if s.function == "PIDController.adapt_step_size"]
    tried = next(s for s in pid if s.primitive == "sub")
    kept = next(s for s in pid if s.primitive == "lt")
    assert tried.loops and tried.loops[-1].kind == "while_loop"
    return tried.name, kept.name


def check_against_the_solve(ts, stats, tried, kept):
    n = int(stats["num_steps"])
    assert int(tried.count) == int(kept.count) == n
    keep = np.asarray(kept.rows[:n])
    assert keep.sum() == int(stats["num_accepted_steps"])
    accepted = np.asarray(tried.rows[:n])[keep]
    times = np.asarray(ts)[: int(stats["num_accepted_steps"])]
    np.testing.assert_allclose(accepted, np.diff(np.concatenate([[0.0], times])), rtol=1e-5)
    assert not np.asarray(tried.rows[n:]).any()


def test_the_step_sizes_the_controller_chose_are_the_solves_steps():
    y0 = jnp.array(1.0)
    tried, kept = controller_sites(y0)
    (ys, ts, stats), acts = tx.capture(solve, tried, kept, loop_rows=MAX_STEPS)(y0)
    check_against_the_solve(ts, stats, acts[tried], acts[kept])
    np.testing.assert_allclose(ys, solve(y0)[0])
    (ys, ts, stats), acts = jax.jit(tx.capture(solve, tried, kept, loop_rows=MAX_STEPS))(y0)
    check_against_the_solve(ts, stats, acts[tried], acts[kept])


def test_without_loop_rows_the_last_step_is_captured():
    y0 = jnp.array(1.0)
    tried, _ = controller_sites(y0)
    (_, ts, stats), acts = tx.capture(solve, tried)(y0)
    rows = tx.capture(solve, tried, loop_rows=MAX_STEPS)(y0)[1][tried]
    np.testing.assert_allclose(acts[tried], rows.rows[int(stats["num_steps"]) - 1])


def test_step_sizes_under_vmap_per_initial_condition():
    y0s = jnp.array([1.0, 5.0, -3.0])
    tried, kept = controller_sites(y0s[0])
    (_, ts, stats), acts = jax.vmap(tx.capture(solve, tried, kept, loop_rows=MAX_STEPS))(y0s)
    for i in range(3):
        _, ts_i, stats_i = solve(y0s[i])
        pick = lambda r: tx.LoopRows(r.rows[i], r.count[i])  # noqa: E731
        check_against_the_solve(ts_i, stats_i, pick(acts[tried]), pick(acts[kept]))


def test_the_gradient_of_the_solution_with_step_sizes_captured():
    y0 = jnp.array(1.0)
    tried, kept = controller_sites(y0, 2.0)

    def final(rate):
        (ys, _, stats), acts = tx.capture(solve, tried, kept, loop_rows=MAX_STEPS)(y0, rate)
        return ys[stats["num_accepted_steps"] - 1], acts

    (g, acts) = jax.grad(final, has_aux=True)(2.0)
    want = jax.grad(lambda r: (lambda o: o[0][o[2]["num_accepted_steps"] - 1])(solve(y0, r)))(2.0)
    np.testing.assert_allclose(g, want, rtol=1e-5)
    _, ts, stats = solve(y0)
    check_against_the_solve(ts, stats, acts[tried], acts[kept])

"""Constraint tracking with `find_tags`: a simulation marks the quantities
that must stay non-negative; the tooling finds every marked constraint
(also inside `lax.scan` and `lax.cond`), reports where it sits, and
evaluates all of them at once with `tx.transpose`.

Run: python examples/constraint_tracking.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import taxpr as tx


def nonnegative(x, name):
    """Mark `x` as a quantity that must stay >= 0 (an identity)."""
    return tx.tag(x, kind="constraint", name=name)


def simulate(state, dt):
    def step(s, _):
        pos, vel = s
        vel = vel - 9.81 * dt
        pos = pos + vel * dt
        # bounce: reflect the velocity when hitting the floor
        pos, vel = jax.lax.cond(pos < 0, lambda: (-pos, -0.9 * vel), lambda: (pos, vel))
        nonnegative(pos, "height")
        return (pos, vel), None

    (pos, vel), _ = jax.lax.scan(step, state, None, length=50)
    energy = 0.5 * vel ** 2 + 9.81 * pos
    return nonnegative(energy, "energy")


def python_heights(state, dt):
    pos, vel = state
    out = []
    for _ in range(50):
        vel = vel - 9.81 * dt
        pos = pos + vel * dt
        if pos < 0:
            pos, vel = -pos, -0.9 * vel
        out.append(pos)
    return np.array(out)


def main():
    state, dt = (jnp.float32(2.0), jnp.float32(0.0)), jnp.float32(0.05)
    jaxpr = jax.make_jaxpr(simulate)(state, dt)

    constraints = [s for s in tx.find_tags(jaxpr) if s.params.get("kind") == "constraint"]
    for site in constraints:
        print(f"constraint {site.params['name']!r:10} at {'/'.join(site.path) or '<top>'}")
    assert [s.params["name"] for s in constraints] == ["height", "energy"]
    assert constraints[0].path == ("scan[length=50]",)

    # Evaluate every constraint's value (stacked over the scan's steps).
    values_jaxpr, params, _ = tx.transpose(
        jaxpr, predicate=lambda p, shape: p.get("kind") == "constraint")
    heights, energy = jax.jit(jax.extend.core.jaxpr_as_fun(values_jaxpr))(*state, dt)
    np.testing.assert_allclose(heights, python_heights((2.0, 0.0), 0.05), rtol=1e-4, atol=1e-4)
    ok = bool(jnp.all(heights >= 0)) and bool(energy >= 0)
    print(f"{heights.shape[0]} height checks and 1 energy check: all satisfied = {ok}")
    assert ok


if __name__ == "__main__":
    main()

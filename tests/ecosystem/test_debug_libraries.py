"""``tx.debug_nans`` on library code: a diffrax solve whose solution blows
up, an equinox MLP with a bad initialization. The origin is known by
construction (the vector field's ``mul``, the loss's square) and the step
by a NumPy run of the same updates."""

import inspect

import pytest

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import taxpr as tx  # noqa: E402


def _line(marker: str) -> str:
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()
    n = next(i for i, text in enumerate(lines, 1) if marker in text and "_line(" not in text)
    return f"test_debug_libraries.py:{n}"


def test_a_diffrax_solve_that_blows_up():
    diffrax = pytest.importorskip("diffrax")
    dt, t1 = 0.1, 3.0

    def vf(t, y, args):
        return y * y  # origin: the vector field

    def solve(y0):
        sol = diffrax.diffeqsolve(diffrax.ODETerm(vf), diffrax.Euler(), 0.0, t1, dt, y0,
                                  saveat=diffrax.SaveAt(t1=True), throw=False,
                                  max_steps=64)
        return sol.ys[-1]

    # The reference: Euler's updates in float32, the first step whose y * y overflows.
    y, step = np.float32(1.0), 0
    with np.errstate(over="ignore"):
        while np.isfinite(y * y):
            y = np.float32(y + np.float32(dt) * (y * y))
            step += 1
    with pytest.raises(tx.NonFiniteError) as info:
        tx.debug_nans(solve)(jnp.float32(1.0))
    e = info.value
    assert (e.kind, e.primitive, e.phase) == ("inf", "mul", "forward")
    assert e.source.startswith(_line("origin: the vector field"))
    loops = [i for kind, i in e.iterations if kind == "while"]
    assert loops and loops[0] == step, (e.iterations, step)


def test_an_equinox_mlp_with_a_bad_initialization():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 1, 32, 3, key=jax.random.key(0))
    # Weights scaled by 1e8: the output reaches about 1e32 and its square
    # overflows.
    model = jax.tree_util.tree_map(lambda w: w * 1e8 if eqx.is_array(w) and w.ndim == 2 else w,
                                   model)
    x = jax.random.normal(jax.random.key(1), (8, 4))

    def loss(model, x):
        pred = jax.vmap(model)(x)
        return jnp.mean(pred ** 2)  # origin: the loss's square

    assert np.isinf(np.asarray(loss(model, x)))
    # The model's activation (a function) is a static leaf of the call.
    with pytest.raises(tx.NonFiniteError) as info:
        tx.debug_nans(eqx.filter_jit(loss))(model, x)
    e = info.value
    assert (e.kind, e.primitive) == ("inf", "integer_pow")
    assert e.source.startswith(_line("origin: the loss's square"))
    # Inside filter_jit, the report comes as JAX's runtime error.
    with pytest.raises(Exception, match=r"inf produced by `integer_pow` at "
                       + _line("origin: the loss's square")):
        eqx.filter_jit(tx.debug_nans(loss))(model, x)
        jax.effects_barrier()

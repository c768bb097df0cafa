"""taxpr inside JAX's own higher-order primitives: `lax.custom_root`,
`lax.custom_linear_solve`, `custom_vmap`, `lax.map(batch_size=)`,
`ensure_compile_time_eval`, pallas (interpret mode), `jax.new_ref`, and
JAX 0.12's hi primitives (`generic_batching`, `jax_scan3`, `jax_remat3`,
`jax_custom_vjp3`, `jax_custom_jvp3`), detected by feature.

References: Python loops with a dict, or values computed by hand.
"""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx
from taxpr import harvest as h

from ecohelpers import Counter, close


# --- lax.custom_root (the program B) --------------------------------

def newton(fn, y0):
    return lax.fori_loop(0, 6, lambda i, y: y - fn(y) / (2 * y), y0)


def sqrt2x(x):
    tx.set_state("scale", jnp.float32(2.0))

    def fn(y):
        tx.set_state("evals", tx.get_state("evals", jnp.zeros((), jnp.int32)) + 1)
        return y ** 2 - x * tx.get_state("scale", jnp.float32(1.0))

    return lax.custom_root(fn, 1.0, newton, lambda g, y: y / g(1.0))


def _newton_by_hand(x, scale, steps=6):
    y, evals, residual = 1.0, 0, None
    for _ in range(steps):
        residual = y ** 2 - x * scale
        evals += 1
        y = y - residual / (2 * y)
    return y, evals, residual


def test_custom_root_reads_and_counts_state():
    pure, s0 = tx.uncurry(sqrt2x, 2.0)
    out, s1 = pure(s0, 2.0)
    y, evals, _ = _newton_by_hand(2.0, 2.0)
    close(out, y)
    close(out, 2.0)
    assert int(s1["evals"]) == evals == 6
    assert float(s1["scale"]) == 2.0


def test_custom_root_jit_of_pure():
    pure, s0 = tx.uncurry(sqrt2x, 2.0)
    out, s1 = jax.jit(pure)(s0, 2.0)
    close(out, 2.0)
    assert int(s1["evals"]) == 6


def test_custom_root_grad_inside():
    # d/dx sqrt(2x) = 1/sqrt(2x) = 0.5 at x=2 (tangent_solve: implicit function)
    def f(x):
        return jax.grad(sqrt2x)(x)

    pure, s0 = tx.uncurry(f, 2.0)
    g, s1 = pure(s0, 2.0)
    close(g, 0.5, rtol=1e-4)
    assert float(s1["scale"]) == 2.0
    # The evaluations of f JAX runs: the solve's, then the derivative rule's
    # (f linearized at the root, and its transpose applied), counted at run
    # time without taxpr.
    counter = Counter()

    def counted(x):
        def fn(y):
            counter.tick()
            return y ** 2 - x * 2.0
        return lax.custom_root(fn, 1.0, newton, lambda g, y: y / g(1.0))

    close(jax.grad(counted)(2.0), 0.5, rtol=1e-4)
    jax.effects_barrier()
    assert int(s1["evals"]) == counter.n > 6


def _sow_root(x):
    def fn(y):
        scale = h.sow(jnp.float32(1.0), tag="root", name="scale", mode="clobber")
        return y ** 2 - x * scale

    return lax.custom_root(fn, 1.0, newton, lambda g, y: y / g(1.0))


def test_custom_root_reap_sow_inside_fn():
    out, reaped = h.call_and_reap(_sow_root, tag="root")(2.0)
    close(out, np.sqrt(2.0), rtol=1e-5)
    assert set(reaped) == {"scale"}
    assert float(reaped["scale"]) == 1.0


def test_custom_root_plant_sow_inside_fn():
    out = h.plant(_sow_root, tag="root")({"scale": jnp.float32(2.0)}, 2.0)
    close(out, 2.0, rtol=1e-5)


# --- lax.custom_linear_solve ------------------------------------------------

A = jnp.array([[4.0, 1.0], [1.0, 3.0]])
B = jnp.array([1.0, 2.0])
RICHARDSON_STEPS = 40


def _richardson(matvec, b):
    return lax.fori_loop(0, RICHARDSON_STEPS, lambda i, x: x + 0.1 * (b - matvec(x)),
                         jnp.zeros_like(b))


def _linsolve_with_state(b):
    tx.set_state("ls_scale", jnp.float32(2.0))

    def matvec(x):
        tx.set_state("ls_evals", tx.get_state("ls_evals", jnp.zeros((), jnp.int32)) + 1)
        return tx.get_state("ls_scale", jnp.float32(1.0)) * (A @ x)

    return lax.custom_linear_solve(matvec, b, _richardson, symmetric=True)


def test_custom_linear_solve_matvec_reads_and_counts_state():
    pure, s0 = tx.uncurry(_linsolve_with_state, B)
    x, s1 = pure(s0, B)
    # Python loop, scale 2.0
    xr = np.zeros(2, np.float32)
    for _ in range(RICHARDSON_STEPS):
        xr = xr + 0.1 * (np.asarray(B) - 2.0 * np.asarray(A) @ xr)
    close(x, xr, rtol=1e-4)
    close(x, np.linalg.solve(2.0 * np.asarray(A), np.asarray(B)), rtol=1e-4)
    assert int(s1["ls_evals"]) == RICHARDSON_STEPS
    assert float(s1["ls_scale"]) == 2.0


def test_custom_linear_solve_reap_sow_in_matvec():
    def solve(b):
        def matvec(x):
            return h.sow(jnp.float32(1.0), tag="ls", name="scale", mode="clobber") * (A @ x)
        return lax.custom_linear_solve(matvec, b, _richardson, symmetric=True)

    reaped = h.reap(solve, tag="ls")(B)
    assert set(reaped) == {"scale"} and float(reaped["scale"]) == 1.0
    planted = h.plant(solve, tag="ls")({"scale": jnp.float32(2.0)}, B)
    close(planted, np.linalg.solve(2.0 * np.asarray(A), np.asarray(B)), rtol=1e-4)


# --- custom_vmap --------------------------------------------------------------

@jax.custom_batching.custom_vmap
def _scaled(x):
    return x * tx.get_state("cv_scale", jnp.float32(1.0))


@_scaled.def_vmap
def _scaled_rule(axis_size, in_batched, x):
    return x * tx.get_state("cv_scale", jnp.float32(1.0)), in_batched[0]


def test_custom_vmap_reads_state():
    def f(xs):
        tx.set_state("cv_scale", jnp.float32(3.0))
        return jax.vmap(_scaled)(xs) + _scaled(xs[0])

    xs = jnp.arange(3.0)
    pure, s0 = tx.uncurry(f, xs)
    out, s1 = pure(s0, xs)
    close(out, 3.0 * xs + 3.0 * xs[0])
    assert float(s1["cv_scale"]) == 3.0


def test_custom_vmap_body_counts_state_unbatched():
    @jax.custom_batching.custom_vmap
    def counted(x):
        tx.set_state("cv_n", tx.get_state("cv_n", jnp.zeros((), jnp.int32)) + 1)
        return 2.0 * x

    @counted.def_vmap
    def rule(axis_size, in_batched, x):
        return 2.0 * x, in_batched[0]

    def f(x):
        return counted(x) + counted(x + 1.0)

    pure, s0 = tx.uncurry(f, 1.0)
    out, s1 = pure(s0, 1.0)
    close(out, 2.0 + 4.0)
    assert int(s1["cv_n"]) == 2


# --- lax.map(batch_size=) ----------------------------------------------------

def test_lax_map_batch_size_reads_state():
    def f(xs):
        tx.set_state("map_scale", jnp.float32(2.0))
        return lax.map(lambda x: x * tx.get_state("map_scale", jnp.float32(1.0)), xs,
                       batch_size=2)

    xs = jnp.arange(5.0)
    pure, s0 = tx.uncurry(f, xs)
    out, _ = pure(s0, xs)
    close(out, 2.0 * xs)


def test_lax_map_batch_size_reaps_sow():
    def f(xs):
        return lax.map(lambda x: h.sow(x * 2.0, tag="map", name="y", mode="append"), xs,
                       batch_size=2)[-1]

    xs = jnp.arange(4.0)
    out, reaped = h.call_and_reap(f, tag="map")(xs)
    close(out, 6.0)
    # one row per element in a Python loop; under the batched map, rows may be
    # grouped by batch: the values must be the elements' values in order.
    close(np.asarray(reaped["y"]).reshape(-1), 2.0 * np.arange(4.0))


# --- ensure_compile_time_eval --------------------------------------------

def test_ensure_compile_time_eval_get_after_set():
    def f(x):
        tx.set_state("ctev_n", jnp.float32(5.0))
        with jax.ensure_compile_time_eval():
            n = tx.get_state("ctev_n", jnp.float32(0.0))
        return x * n

    def check(res):
        out, s1 = res
        close(out, 10.0)  # the eager value, never the init (0.0)
        assert float(s1["ctev_n"]) == 5.0

    pure, s0 = tx.uncurry(f, 2.0)
    check(pure(s0, 2.0))


def test_ensure_compile_time_eval_set_is_not_lost():
    def f(x):
        with jax.ensure_compile_time_eval():
            n = tx.get_state("ctev_m", jnp.float32(1.0))
            tx.set_state("ctev_m", n + 1.0)
        return x * tx.get_state("ctev_m", jnp.float32(1.0))

    def check(res):
        out, s1 = res
        close(out, 4.0)
        assert float(s1["ctev_m"]) == 2.0

    pure, s0 = tx.uncurry(f, 2.0)
    check(pure(s0, 2.0))


# --- pallas, interpret mode --------------------------------------------------

def _pallas():
    return pytest.importorskip("jax.experimental.pallas")


def test_pallas_interpret_kernel_reads_state():
    pl = _pallas()

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * tx.get_state("pl_scale", jnp.float32(1.0))

    def f(x):
        tx.set_state("pl_scale", jnp.float32(3.0))
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=True)(x)

    x = jnp.arange(4.0)

    def check(res):
        out, s1 = res
        close(out, 3.0 * x)

    pure, s0 = tx.uncurry(f, x)
    check(pure(s0, x))


def test_pallas_interpret_state_around_kernel():
    pl = _pallas()

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    def f(x):
        s = tx.get_state("pl_total", jnp.zeros(()))
        y = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                           interpret=True)(x * s)
        tx.set_state("pl_total", s + y.sum())
        return y

    x = jnp.arange(4.0)
    pure, s0 = tx.uncurry(f, x)
    s = {"pl_total": jnp.float32(2.0)}
    out, s1 = pure(s, x)
    close(out, 2.0 * x + 1.0)
    close(s1["pl_total"], 2.0 + float((2.0 * x + 1.0).sum()))


def test_pallas_interpret_kernel_counts_grid_steps():
    pl = _pallas()

    def kernel(x_ref, o_ref):
        tx.set_state("pl_n", tx.get_state("pl_n", jnp.zeros((), jnp.int32)) + 1)
        o_ref[...] = x_ref[...] * 2.0

    def f(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(2,), in_specs=[pl.BlockSpec((2,), lambda i: (i,))],
                              out_specs=pl.BlockSpec((2,), lambda i: (i,)),
                              interpret=True)(x)

    x = jnp.arange(4.0)

    def check(res):
        out, s1 = res
        close(out, 2.0 * x)
        assert int(s1["pl_n"]) == 2  # one per grid step, as a Python loop over the grid

    pure, s0 = tx.uncurry(f, x)
    check(pure(s0, x))


def test_pallas_interpret_state_in_kernel_is_a_clear_error():
    pl = _pallas()

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * tx.get_state("pl_scale", jnp.float32(1.0))

    def f(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              interpret=True)(x)

    with pytest.raises(NotImplementedError, match=r"'pallas_call' at .* holds "
                                                  r"tag\(op=state.get, name='pl_scale'\)"):
        tx.uncurry(f, jnp.arange(4.0))


# --- jax.new_ref -------------------------------------------------------------

@pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="this JAX has no jax.new_ref")
def test_new_ref_beside_state_in_a_loop():
    def f(x):
        ref = jax.new_ref(jnp.zeros(()))

        def body(i, c):
            ref[...] += tx.get_state("nr_scale", jnp.float32(1.0))
            tx.set_state("nr_n", tx.get_state("nr_n", jnp.zeros((), jnp.int32)) + 1)
            return c + 1.0

        c = lax.fori_loop(0, 3, body, 0.0)
        return ref[...] * x + c

    pure, s0 = tx.uncurry(f, 2.0)
    out, s1 = pure({**s0, "nr_scale": jnp.float32(2.0)}, 2.0)
    close(out, 6.0 * 2.0 + 3.0)
    assert int(s1["nr_n"]) == 3
    out, s1 = jax.jit(pure)({**s0, "nr_scale": jnp.float32(2.0)}, 2.0)
    close(out, 15.0)
    assert int(s1["nr_n"]) == 3


@pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="this JAX has no jax.new_ref")
def test_new_ref_reap_sow_of_ref_value():
    def f(x):
        ref = jax.new_ref(x)

        def body(i, c):
            ref[...] = h.sow(ref[...] * 2.0, tag="ref", name="v", mode="append")
            return c

        lax.fori_loop(0, 3, body, 0)
        return ref[...]

    out, reaped = h.call_and_reap(f, tag="ref")(1.0)
    close(out, 8.0)
    close(reaped["v"], [2.0, 4.0, 8.0])


# --- JAX 0.12's hi primitives ------------------------------------------------

@contextlib.contextmanager
def _config(name):
    if name not in jax.config.values:
        pytest.skip(f"this JAX has no {name}")
    old = jax.config.values[name]
    jax.config.update(name, True)
    try:
        yield
    finally:
        jax.config.update(name, old)


def _generic_batching_supported():
    try:
        f = jax.custom_vjp(lambda x: x)
        f.defvjp(lambda x: (x, None), lambda r, g: (g,), generic_batching=True)
    except TypeError:
        return False
    return True


def _make_cvjp(generic_batching=False):
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x) * tx.get_state("cvjp_scale", jnp.float32(1.0))

    def fwd(x):
        return f(x), x

    def bwd(x, g):
        return (g * 10.0 * jnp.cos(x),)  # deliberately not the true derivative

    kwargs = {"generic_batching": True} if generic_batching else {}
    f.defvjp(fwd, bwd, **kwargs)
    return f


def _cvjp_program(f):
    def prog(x):
        tx.set_state("cvjp_scale", jnp.float32(2.0))
        n = tx.get_state("cvjp_n", jnp.zeros((), jnp.int32))
        tx.set_state("cvjp_n", n + 1)
        y = f(x)
        g = jax.grad(lambda x: f(x))(x)
        ys = jax.vmap(f)(jnp.stack([x, x + 1.0]))
        return y, g, ys
    return prog


def _check_cvjp(res, x):
    (y, g, ys), s1 = res
    close(y, 2.0 * np.sin(x))
    close(g, 10.0 * np.cos(x))  # the user's bwd rule
    close(ys, 2.0 * np.sin([x, x + 1.0]))
    assert int(s1["cvjp_n"]) == 1 and float(s1["cvjp_scale"]) == 2.0


@pytest.mark.skipif(not _generic_batching_supported(),
                    reason="custom_vjp.defvjp has no generic_batching here")
def test_custom_vjp_generic_batching_reads_state():
    prog = _cvjp_program(_make_cvjp(generic_batching=True))
    pure, s0 = tx.uncurry(prog, 0.5)
    _check_cvjp(pure(s0, 0.5), 0.5)


@pytest.mark.skipif(not _generic_batching_supported(),
                    reason="custom_vjp.defvjp has no generic_batching here")
def test_custom_vjp_generic_batching_reap_sow():
    @jax.custom_vjp
    def f(x):
        return h.sow(jnp.sin(x), tag="gb", name="s", mode="clobber")

    f.defvjp(lambda x: (f(x), x), lambda x, g: (g * jnp.cos(x),), generic_batching=True)
    out, reaped = h.call_and_reap(lambda x: jax.vmap(f)(x), tag="gb")(jnp.array([0.1, 0.2]))
    close(out, np.sin([0.1, 0.2]))
    close(reaped["s"], np.sin([0.1, 0.2]))


def _scan3_program(mode):
    def f(x):
        def body(c, _):
            tx.set_state("s3_n", tx.get_state("s3_n", jnp.zeros((), jnp.int32)) + 1)
            c = h.sow(c * tx.get_state("s3_scale", jnp.float32(1.0)), tag="s3", name="c",
                      mode=mode)
            return c, None
        tx.set_state("s3_scale", jnp.float32(2.0))
        return lax.scan(body, x, None, length=3)[0]
    return f


def test_scan3_state_clobber_sow_and_jvp_inside():
    f = _scan3_program("clobber")
    with _config("jax_scan3"):
        pure, s0 = tx.uncurry(f, 1.0)
        out, s1 = pure(s0, 1.0)
        close(out, 8.0)
        assert int(s1["s3_n"]) == 3
        out, reaped = h.call_and_reap(lambda x: pure(s0, x)[0], tag="s3")(1.0)
        close(reaped["c"], 8.0)  # the last iteration's
        close(h.plant(lambda x: pure(s0, x)[0], tag="s3")({"c": 5.0}, 1.0), 5.0)
        # JAX's Scan3 has a JVP rule only (no grad)
        (y, t), s1 = tx.uncurry(lambda x: jax.jvp(f, (x,), (1.0,)), 1.0)[0](s0, 1.0)
        close(y, 8.0)
        close(t, 8.0)
        assert int(s1["s3_n"]) == 3


def test_scan3_append_sow():
    with _config("jax_scan3"):
        pure, s0 = tx.uncurry(_scan3_program("append"), 1.0)
        out, reaped = h.call_and_reap(lambda x: pure(s0, x)[0], tag="s3")(1.0)
        close(reaped["c"], [2.0, 4.0, 8.0])


def test_remat3_state_and_grad_inside():
    def f(x):
        @jax.checkpoint
        def layer(x):
            n = tx.get_state("r3_n", jnp.zeros((), jnp.int32))
            tx.set_state("r3_n", n + 1)
            return jnp.sin(x) * tx.get_state("r3_scale", jnp.float32(1.0))
        tx.set_state("r3_scale", jnp.float32(3.0))
        return jax.grad(lambda x: layer(layer(x)))(x)

    with _config("jax_remat3"):
        pure, s0 = tx.uncurry(f, 0.3)
        g, s1 = pure(s0, 0.3)
        # by hand: y = 3 sin(3 sin x); dy/dx = 3 cos(3 sin x) * 3 cos x
        close(g, 9.0 * np.cos(3.0 * np.sin(0.3)) * np.cos(0.3), rtol=1e-5)
        assert int(s1["r3_n"]) == 2  # two layer calls; the recomputation sets nothing


def test_remat3_recomputation_reads_what_the_forward_read():
    def f(x):
        @jax.checkpoint
        def layer(x):
            n = tx.get_state("r3_calls", jnp.zeros((), jnp.float32))
            tx.set_state("r3_calls", n + 1.0)
            return jnp.sin(x) * (n + 1.0)
        return jax.grad(lambda x: layer(layer(x)))(x)

    with _config("jax_remat3"):
        pure, s0 = tx.uncurry(f, 0.3)
        g, s1 = pure(s0, 0.3)
        # by hand: the layers scale by 1 and 2, y = 2 sin(sin x), dy/dx = 2 cos(sin x) cos x
        close(g, 2.0 * np.cos(np.sin(0.3)) * np.cos(0.3), rtol=1e-5)
        close(s1["r3_calls"], 2.0)


def test_remat3_grad_inside_flows_through_set_state_and_sow_values():
    # A value returned by set_state or sown is differentiated through the
    # recomputation: the derivative is the eager one.
    def f(x):
        @jax.checkpoint
        def layer(x):
            y = tx.set_state("r3_last", jnp.sin(x))
            return h.sow(y, tag="r3g", name="y") * 3.0
        return jax.grad(layer)(x)

    with _config("jax_remat3"):
        pure, s0 = tx.uncurry(f, 0.3)
        g, s1 = pure(s0, 0.3)
        close(g, 3.0 * np.cos(0.3), rtol=1e-5)
        close(s1["r3_last"], np.sin(0.3), rtol=1e-5)


@pytest.mark.parametrize("mode", ["append", "clobber"])
def test_remat3_grad_inside_reaps_and_plants_each_sow_once(mode):
    # The backward pass's recomputation of a checkpointed layer binds its sow
    # again: reap collects the forward's value only (an append sow, once per
    # layer call), and a clobber plant gives the recomputation the planted
    # value.
    def f(x):
        @jax.checkpoint
        def layer(x):
            return jnp.sin(h.sow(x * 2.0, tag="r3a", name="y", mode=mode))
        return jax.value_and_grad(lambda x: layer(layer(x)))(x)

    with _config("jax_remat3"):
        (value, grad), reaped = h.call_and_reap(f, tag="r3a")(0.3)
        y1 = 2.0 * 0.3
        y2 = 2.0 * np.sin(y1)
        close(value, np.sin(y2), rtol=1e-5)
        close(grad, np.cos(y2) * 2.0 * np.cos(y1) * 2.0, rtol=1e-5)
        close(reaped["y"], [y1, y2] if mode == "append" else y2, rtol=1e-5)
        # planted: each layer is sin(c), with a zero derivative
        if mode == "clobber":
            value, grad = h.plant(f, tag="r3a")({"y": jnp.float32(0.5)}, 0.3)
            close(value, np.sin(0.5), rtol=1e-5)
            close(grad, 0.0)
        else:  # which row the recomputation's sow gets is not known: a clear error
            with pytest.raises(NotImplementedError, match="append-mode sow 'y' .* recomputes"):
                h.plant(f, tag="r3a")({"y": jnp.array([0.5, 0.7])}, 0.3)


def test_remat3_reap_sow():
    def f(x):
        return jax.checkpoint(lambda x: h.sow(jnp.sin(x), tag="r3", name="s"))(x) * 2.0

    with _config("jax_remat3"):
        out, reaped = h.call_and_reap(f, tag="r3")(0.3)
        close(reaped["s"], np.sin(0.3))
        close(h.plant(f, tag="r3")({"s": 5.0}, 0.3), 10.0)


def test_custom_vjp3_state():
    with _config("jax_custom_vjp3"):
        prog = _cvjp_program(_make_cvjp())
        pure, s0 = tx.uncurry(prog, 0.5)
        _check_cvjp(pure(s0, 0.5), 0.5)


def test_custom_vjp3_reap_plant_sow():
    with _config("jax_custom_vjp3"):
        @jax.custom_vjp
        def f(x):
            return h.sow(jnp.sin(x), tag="v3", name="s") * 2.0

        f.defvjp(lambda x: (f(x), x), lambda x, g: (g * 2.0 * jnp.cos(x),))
        out, reaped = h.call_and_reap(f, tag="v3")(0.5)
        close(reaped["s"], np.sin(0.5))
        close(h.plant(f, tag="v3")({"s": 3.0}, 0.5), 6.0)


def test_custom_jvp3_state():
    with _config("jax_custom_jvp3"):
        @jax.custom_jvp
        def f(x):
            return jnp.sin(x) * tx.get_state("cjvp_scale", jnp.float32(1.0))

        @f.defjvp
        def f_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            return f(x), 10.0 * jnp.cos(x) * t

        def prog(x):
            tx.set_state("cjvp_scale", jnp.float32(2.0))
            tx.set_state("cjvp_n", tx.get_state("cjvp_n", jnp.zeros((), jnp.int32)) + 1)
            return f(x), jax.grad(f)(x)

        pure, s0 = tx.uncurry(prog, 0.5)
        (y, g), s1 = pure(s0, 0.5)
        close(y, 2.0 * np.sin(0.5))
        close(g, 10.0 * np.cos(0.5))
        assert int(s1["cjvp_n"]) == 1


def test_custom_jvp3_reap_plant_sow():
    with _config("jax_custom_jvp3"):
        @jax.custom_jvp
        def f(x):
            return h.sow(jnp.sin(x), tag="j3", name="s") * 2.0

        f.defjvp(lambda p, t: (f(p[0]), 2.0 * jnp.cos(p[0]) * t[0]))
        out, reaped = h.call_and_reap(f, tag="j3")(0.5)
        close(out, 2.0 * np.sin(0.5))
        close(reaped["s"], np.sin(0.5))
        close(h.plant(f, tag="j3")({"s": 3.0}, 0.5), 6.0)

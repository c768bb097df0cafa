"""taxpr.capture / taxpr.patch on plain JAX (scan, cond, while, checkpoint,
jit, custom_jvp) against the program run eagerly by hand, under jit, grad
and vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import taxpr as tx
from taxpr import harvest as h

from capture_programs import assert_close, layers, layers_reference

X_POS = jnp.array([0.3, -0.2])
X_NEG = jnp.array([-0.9, -0.4])
NAMES = ["pre/mul", "layer/mul", "layer/exp", "layer/neg", "loop/cos", "top/tanh", "top/mul"]


@pytest.mark.parametrize("x", [X_POS, X_NEG], ids=["pos", "neg"])
def test_capture_matches_the_eager_run_in_every_control_flow_primitive(x):
    out, acts = tx.capture(layers, *NAMES)(x)
    ref_out, ref = layers_reference(x)
    assert_close(out, ref_out)
    assert set(acts) == set(NAMES)
    for name in NAMES:
        assert_close(acts[name], ref[name], err_msg=name)
    # a scan stacks one row per iteration
    assert acts["layer/mul"].shape == (3, 2)


def test_capture_under_jit_called_twice_with_different_values():
    f = jax.jit(tx.capture(layers, *NAMES))
    for x in (X_POS, X_NEG):
        out, acts = f(x)
        ref_out, ref = layers_reference(x)
        assert_close(out, ref_out)
        for name in NAMES:
            assert_close(acts[name], ref[name], err_msg=name)


def test_capture_under_vmap_batches_each_value():
    xs = jnp.stack([X_POS, X_NEG])
    out, acts = jax.vmap(tx.capture(layers, *NAMES))(xs)
    for i, x in enumerate(xs):
        ref_out, ref = layers_reference(x)
        assert_close(out[i], ref_out)
        for name in NAMES:
            assert_close(acts[name][i], ref[name], err_msg=name)


def test_gradient_of_a_captured_value_is_the_hand_written_one():
    def via_capture(x):
        return jnp.sum(tx.capture(layers, "layer/exp")(x)[1]["layer/exp"])

    def by_hand(x):
        return jnp.sum(layers_reference(x)[1]["layer/exp"])

    for x in (X_POS, X_NEG):
        assert_close(jax.grad(via_capture)(x), jax.grad(by_hand)(x))
        assert_close(jax.jit(jax.grad(via_capture))(x), jax.grad(by_hand)(x))


def test_capture_inside_checkpoint_jit_and_custom_jvp():
    @jax.custom_jvp
    def soft(v):
        with jax.named_scope("soft"):
            return jnp.log1p(jnp.exp(v))

    @soft.defjvp
    def _(p, t):
        (v,), (dv,) = p, t
        return soft(v), jax.nn.sigmoid(v) * dv

    @jax.jit
    def inner(v):
        with jax.named_scope("inner"):
            return jnp.sin(v) * 3.0

    def f(x):
        return jnp.sum(jax.checkpoint(lambda x: soft(inner(x)))(x))

    names = [s.name for s in tx.sites(f, X_POS)]
    assert "inner/sin" in names and "soft/log1p" in names
    out, acts = tx.capture(f, "inner/sin", "soft/log1p")(X_POS)
    assert_close(acts["inner/sin"], jnp.sin(X_POS))
    assert_close(acts["soft/log1p"], jnp.log1p(jnp.exp(jnp.sin(X_POS) * 3.0)))
    g = jax.grad(lambda x: tx.capture(f, "soft/log1p")(x)[0])(X_POS)
    assert_close(g, jax.nn.sigmoid(jnp.sin(X_POS) * 3.0) * 3.0 * jnp.cos(X_POS))


def test_a_while_loop_that_runs_no_iteration_captures_zeros():
    def f(x, n):
        with jax.named_scope("loop"):
            return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.cos(c[1])),
                                      (0, x))[1]
    _, acts = tx.capture(f, "loop/cos")(X_POS, 0)
    assert_close(acts["loop/cos"], jnp.zeros(2))
    _, acts = tx.capture(f, "loop/cos")(X_POS, 3)
    assert_close(acts["loop/cos"], jnp.cos(jnp.cos(jnp.cos(X_POS))))


@pytest.mark.parametrize("x", [X_POS, X_NEG], ids=["pos", "neg"])
def test_patch_by_function_applies_where_the_value_is_computed(x):
    patches = {"layer/mul": lambda v: v * 0.5 + 0.1, "loop/cos": lambda v: v - 0.2,
               "top/tanh": jnp.abs, "top/mul": jnp.abs}
    out = tx.patch(layers, patches)(x)
    ref_out, _ = layers_reference(x, patches)
    assert_close(out, ref_out)
    assert_close(jax.jit(tx.patch(layers, patches))(x), ref_out)


def test_patch_by_value_replaces_every_row_or_selected_rows():
    new = jnp.array([[0.1, 0.2], [0.3, -0.4], [0.5, 0.6]])
    rows = iter(new)
    out = tx.patch(layers, {"layer/mul": new})(X_POS)
    assert_close(out, layers_reference(X_POS, {"layer/mul": lambda v: next(rows)})[0])
    calls = iter(range(3))
    one = lambda v: jnp.full_like(v, 0.7) if next(calls) == 1 else v  # noqa: E731
    out = tx.patch(layers, {"layer/mul": h.rows({1: jnp.full((2,), 0.7)})})(X_POS)
    assert_close(out, layers_reference(X_POS, {"layer/mul": one})[0])


def test_patch_is_differentiable_in_a_patched_value_and_a_closed_over_perturbation():
    # ``layers`` holds a while loop: JAX differentiates it in forward mode only
    v0, d0 = jnp.array([0.4, 0.9]), jnp.array([0.05, -0.1])
    for name in ("pre/mul", "loop/cos"):
        def patched_value(v):
            return tx.patch(layers, {name: v})(X_POS)

        def by_hand_value(v):
            return layers_reference(X_POS, {name: lambda _: v})[0]

        assert_close(jax.jacfwd(patched_value)(v0), jax.jacfwd(by_hand_value)(v0))

    def patched_delta(d):
        return tx.patch(layers, {"layer/mul": lambda v: v + d})(X_POS)

    def by_hand_delta(d):
        return layers_reference(X_POS, {"layer/mul": lambda v: v + d})[0]

    assert_close(jax.jacfwd(patched_delta)(d0), jax.jacfwd(by_hand_delta)(d0))


def scanned(x):
    def body(c, w):
        with jax.named_scope("layer"):
            return jnp.tanh(c * w), None
    return jnp.sum(jax.lax.scan(body, x, jnp.asarray([0.5, 2.0, -1.0]))[0] ** 2)


def scanned_by_hand(x, f=lambda i, v: v):
    for i, w in enumerate([0.5, 2.0, -1.0]):
        x = f(i, jnp.tanh(x * w))
    return jnp.sum(x ** 2)


def test_reverse_mode_gradient_of_patches_inside_a_scan():
    d0, rows = jnp.array([0.05, -0.1]), jnp.array([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])

    def by_delta(d):
        return tx.patch(scanned, {"layer/tanh": lambda v: v + d})(X_POS)

    expected = jax.grad(lambda d: scanned_by_hand(X_POS, lambda i, v: v + d))(d0)
    assert_close(jax.grad(by_delta)(d0), expected)
    assert_close(jax.jit(jax.grad(by_delta))(d0), expected)

    def by_stack(stack):
        return tx.patch(scanned, {"layer/tanh": stack})(X_POS)

    expected = jax.grad(lambda s: scanned_by_hand(X_POS, lambda i, v: s[i]))(rows)
    assert_close(jax.grad(by_stack)(rows), expected)

    def by_row(r):
        return tx.patch(scanned, {"layer/tanh": h.rows({1: r})})(X_POS)

    expected = jax.grad(lambda r: scanned_by_hand(X_POS, lambda i, v: r if i == 1 else v))(d0)
    assert_close(jax.grad(by_row)(d0), expected)


def test_patch_under_vmap_with_a_batched_perturbation():
    ds = jnp.array([[0.0, 0.0], [0.3, -0.3]])
    outs = jax.vmap(lambda d: tx.patch(layers, {"layer/mul": lambda v: v + d})(X_POS))(ds)
    for i, d in enumerate(ds):
        assert_close(outs[i], layers_reference(X_POS, {"layer/mul": lambda v: v + d})[0])


def test_a_patch_of_the_wrong_shape_is_an_error_naming_the_site():
    with pytest.raises(ValueError, match="loop/cos"):
        tx.patch(layers, {"loop/cos": jnp.zeros(3)})(X_POS)
    with pytest.raises(ValueError, match="'pre/mul'.*keep the value's shape"):
        tx.patch(layers, {"pre/mul": lambda v: v[:1]})(X_POS)


def test_a_site_selected_by_two_patches_is_an_error():
    with pytest.raises(ValueError, match="'pre/mul' is selected by both"):
        tx.patch(layers, {"pre/mul": jnp.zeros(2), tx.select.scope("pre"): jnp.ones(2)})(X_POS)


def test_a_selector_matching_nothing_lists_the_nearest_names():
    with pytest.raises(ValueError, match=r"'layer/expp' matches none.*'layer/exp'"):
        tx.capture(layers, "layer/expp")(X_POS)
    with pytest.raises(ValueError, match=r"primitive\('cholesky',\) matches none"):
        tx.patch(layers, {tx.select.primitive("cholesky"): jnp.zeros(2)})(X_POS)


def test_a_scan_inside_a_cond_branch_is_a_clear_error():
    def f(x):
        def scanned(x):
            return jax.lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=2)[0]
        return jax.lax.cond(x.sum() > 0, scanned, lambda x: x, x)
    with pytest.raises(NotImplementedError, match="'sin' is inside a scan inside a branch"):
        tx.capture(f, "sin")(X_POS)


def test_capture_leaves_the_users_own_sows_and_harvests_alone():
    def f(x):
        y = h.sow(jnp.sin(x), tag="mine", name="s")
        with jax.named_scope("after"):
            return jnp.sum(y * 2.0)
    reaped_f = h.call_and_reap(tx.capture(f, "after/mul"), tag="mine")
    (out, acts), mine = reaped_f(X_POS)
    assert_close(mine["s"], jnp.sin(X_POS))
    assert_close(acts["after/mul"], jnp.sin(X_POS) * 2.0)
    assert_close(out, jnp.sum(jnp.sin(X_POS) * 2.0))


def test_static_arguments_are_not_traced():
    def f(x, how):
        return getattr(jnp, how)(x)
    assert [s.name for s in tx.sites(f, X_POS, "tanh")] == ["tanh"]
    _, acts = tx.capture(f, "cos")(X_POS, "cos")
    assert_close(acts["cos"], jnp.cos(X_POS))


def test_perturb_gives_the_gradient_with_respect_to_every_layers_value_in_one_pass():
    acts = tx.capture(scanned, "layer/tanh")(X_POS)[1]
    zeros = {name: jnp.zeros_like(v) for name, v in acts.items()}
    d_acts, d_x = jax.grad(tx.perturb(scanned, "layer/tanh"), argnums=(0, 1))(zeros, X_POS)

    def by_hand(rows, x):
        return scanned_by_hand(x, lambda i, v: v + rows[i])

    want_rows, want_x = jax.grad(by_hand, argnums=(0, 1))(jnp.zeros((3, 2)), X_POS)
    assert_close(d_acts["layer/tanh"], want_rows)
    assert_close(d_x, want_x)
    # a nonzero perturbation is added to the value, row by row
    rows = jnp.array([[0.1, 0.0], [0.0, 0.2], [-0.1, 0.1]])
    assert_close(tx.perturb(scanned, "layer/tanh")({"layer/tanh": rows}, X_POS),
                 by_hand(rows, X_POS))


def test_perturb_of_a_name_not_selected_is_an_error():
    with pytest.raises(ValueError, match=r"perturbations of \['layer/nope'\]"):
        tx.perturb(scanned, "layer/tanh")({"layer/nope": jnp.zeros(2)}, X_POS)


def test_a_jitted_function_called_twice_has_a_site_per_call():
    @jax.jit
    def g(v):
        with jax.named_scope("g"):
            return jnp.sin(v) * 2.0

    def f(a, b):
        return g(a) + g(b)

    a, b = jnp.float32(1.0), jnp.float32(2.0)
    assert [s.name for s in tx.sites(f, a, b)] == ["g/sin", "g/mul", "g/sin:1", "g/mul:1", "add"]
    _, acts = tx.capture(f, "g/mul", "g/sin:1", "add")(a, b)
    assert_close(acts["g/mul"], 2 * jnp.sin(a))
    assert_close(acts["g/sin:1"], jnp.sin(b))
    assert_close(acts["add"], 2 * jnp.sin(a) + 2 * jnp.sin(b))  # the program's output
    assert_close(tx.patch(f, {"g/mul:1": lambda v: v * 0})(a, b), 2 * jnp.sin(a))


def test_inside_shard_map_a_value_the_same_on_every_shard_or_a_clear_error():
    from jax.sharding import PartitionSpec as P
    from helpers import cpu_mesh, shard_map

    mesh = cpu_mesh("i", 4)

    def f(x):
        def body(x):
            with jax.named_scope("body"):
                total = jax.lax.psum(jnp.sum(x * 2.0), "i")
                return x * total
        return shard_map()(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x)

    x = jnp.arange(8.0)
    (psum,) = [s.name for s in tx.sites(f, x) if s.primitive.startswith("psum")]
    out, acts = tx.capture(f, psum)(x)
    assert_close(acts[psum], 2 * x.sum())
    assert_close(out, x * 2 * x.sum())
    with pytest.raises(ValueError, match="'body/mul' .*differs across the shards"):
        tx.capture(f, "body/mul")(x)


def test_switch_with_sites_in_several_branches():
    def f(i, x):
        branches = [lambda x: jnp.sin(x) * 2.0, lambda x: x, lambda x: jnp.cos(x) + 1.0]
        with jax.named_scope("sw"):
            return jax.lax.switch(i, branches, x)

    names = [s.name for s in tx.sites(f, 0, X_POS) if s.in_cond]
    assert names == ["sw/sin", "sw/mul", "sw/cos", "sw/add"]
    for i in range(3):
        out, acts = tx.capture(f, *names)(i, X_POS)
        want = {"sw/sin": jnp.sin(X_POS), "sw/mul": 2 * jnp.sin(X_POS),
                "sw/cos": jnp.cos(X_POS), "sw/add": jnp.cos(X_POS) + 1.0}
        for name in names:
            taken = (i == 0) if name in ("sw/sin", "sw/mul") else (i == 2)
            assert_close(acts[name], want[name] if taken else jnp.zeros(2))
        patched = tx.patch(f, {"sw/mul": lambda v: -v, "sw/add": jnp.ones(2)})(i, X_POS)
        assert_close(patched, [-2 * jnp.sin(X_POS), X_POS, jnp.ones(2)][i])
    # a batched index (vmap): each example's own branch
    idx = jnp.array([0, 1, 2])
    _, acts = jax.vmap(tx.capture(f, "sw/mul", "sw/add"), in_axes=(0, None))(idx, X_POS)
    assert_close(acts["sw/mul"], jnp.stack([2 * jnp.sin(X_POS), jnp.zeros(2), jnp.zeros(2)]))
    assert_close(acts["sw/add"], jnp.stack([jnp.zeros(2), jnp.zeros(2), jnp.cos(X_POS) + 1]))


def test_an_output_of_a_multi_output_equation_and_an_integer_value():
    def f(x):
        values, order = jax.lax.sort((x, jnp.arange(x.shape[0])), num_keys=1)
        return values * 2.0, order

    x = jnp.array([3.0, 1.0, 2.0])
    _, acts = tx.capture(f, "sort#0", "sort#1")(x)
    assert_close(acts["sort#0"], jnp.sort(x))
    np.testing.assert_array_equal(acts["sort#1"], jnp.argsort(x))
    values, order = tx.patch(f, {"sort#1": lambda o: o[::-1], "sort#0": jnp.zeros(3)})(x)
    assert_close(values, jnp.zeros(3))
    np.testing.assert_array_equal(order, jnp.argsort(x)[::-1])


def _fixed_point_per_layer(ws, x):
    """A layer solved by fixed-point iteration (a while_loop), per layer (a scan)."""
    def layer(h, w):
        def body(c):
            with jax.named_scope("fp"):
                return jnp.tanh(w * c[0] + h), c[1] + 1
        return jax.lax.while_loop(lambda c: c[1] < 3, body, (jnp.zeros_like(h), 0))[0], None
    return jax.lax.scan(layer, x, ws)[0]


def _fixed_point_by_hand(ws, x):
    rows, h = [], x
    for w in np.asarray(ws):
        c = np.zeros_like(h)
        for _ in range(3):
            c = np.tanh(w * c + h)
        rows.append(c)
        h = c
    return np.stack(rows)


def _decode(ws, x):
    """Decoding steps (a while_loop) over scanned layers (a scan)."""
    def step(c):
        h, i = c

        def layer(h, w):
            with jax.named_scope("layer"):
                return jnp.tanh(w * h + 0.1 * i), None
        return jax.lax.scan(layer, h, ws)[0], i + 1
    return jax.lax.while_loop(lambda c: c[1] < 2, step, (x, 0))[0]


def _decode_last_step_by_hand(ws, x):
    h = np.asarray(x)
    for i in range(2):
        rows = []
        for w in np.asarray(ws):
            h = np.tanh(w * h + 0.1 * i)
            rows.append(h)
    return np.stack(rows)


@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
def test_a_while_loop_inside_a_scan_captures_each_rows_last_iteration(how):
    ws, x = jnp.array([0.3, 0.9, 0.1]), jnp.float32(0.2)
    f = tx.capture(_fixed_point_per_layer, "fp/tanh")
    if how == "vmap":
        xs = jnp.array([0.2, -0.5])
        got = jax.vmap(lambda x: f(ws, x)[1]["fp/tanh"])(xs)
        want = np.stack([_fixed_point_by_hand(ws, np.float32(a)) for a in np.asarray(xs)])
    else:
        got = (jax.jit(f) if how == "jit" else f)(ws, x)[1]["fp/tanh"]
        want = _fixed_point_by_hand(ws, np.float32(0.2))
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("how", ["eager", "jit", "jvp"])
def test_a_scan_inside_a_while_loop_captures_the_last_iterations_rows(how):
    ws, x = jnp.array([0.5, -0.7]), jnp.array([0.3, 1.0, -2.0])
    f = tx.capture(_decode, "layer/tanh")
    if how == "jvp":  # forward mode through the while loop, against the hand-written loops
        def by_hand(ws):
            h = x
            for i in range(2):
                rows = []
                for j in range(2):
                    h = jnp.tanh(ws[j] * h + 0.1 * i)
                    rows.append(h)
            return jnp.stack(rows).sum()
        got = jax.jacfwd(lambda ws: f(ws, x)[1]["layer/tanh"].sum())(ws)
        np.testing.assert_allclose(got, jax.grad(by_hand)(ws), rtol=1e-5)
        return
    got = (jax.jit(f) if how == "jit" else f)(ws, x)[1]["layer/tanh"]
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got, _decode_last_step_by_hand(ws, x), rtol=1e-6)


def test_loop_rows_of_a_while_loop_inside_a_scan_keeps_every_computation_in_order():
    ws, x = jnp.array([0.3, 0.9, 0.1]), jnp.float32(0.2)
    got = tx.capture(_fixed_point_per_layer, "fp/tanh", loop_rows=12)(ws, x)[1]["fp/tanh"]
    values, h = [], 0.2
    for w in np.asarray(ws):
        c = 0.0
        for _ in range(3):
            c = np.tanh(w * c + h)
            values.append(c)
        h = c
    assert int(got.count) == 9
    np.testing.assert_allclose(got.rows[:9], values, rtol=1e-6)
    np.testing.assert_array_equal(got.rows[9:], 0.0)


def test_patch_errors_name_the_site_and_the_selector_not_a_sow():
    def f(x):
        with jax.named_scope("a"):
            y = jnp.sin(x)
        return y * 2

    def g(xs):
        def body(c, x):
            with jax.named_scope("b"):
                c = c + jnp.cos(x)
            return c, c
        return jax.lax.scan(body, 0.0, xs)[1]

    cases = [
        (lambda: tx.patch(f, {"a/*": h.rows({0: 1.0})})(1.0),
         r"rows\(\.\.\.\) given for site 'a/sin' \(selected by 'a/\*'\), which is not inside a scan"),
        (lambda: tx.patch(f, {"a/sin": jnp.int32(1)})(1.0),
         r"replacement of site 'a/sin' .* is int32\[\]; the site holds float32\[\]"),
        (lambda: tx.patch(g, {"b/cos": jnp.ones(5)})(jnp.ones(3)),
         r"is float32\[5\]; the site holds float32\[\], one per iteration of the scan around "
         r"it: float32\[3\]"),
        (lambda: tx.patch(g, {"b/cos": h.rows({7: 1.0})})(jnp.ones(3)),
         r"row 7 is out of range; the scan around it has 3 iterations"),
    ]
    for run, message in cases:
        with pytest.raises(ValueError, match=message) as caught:
            run()
        assert "sow" not in str(caught.value) and "Planted" not in str(caught.value)


@pytest.mark.parametrize("how", ["function", "value"])
def test_capture_of_a_patched_function_gives_the_value_after_the_patch(how):
    def f(x):
        with jax.named_scope("a"):
            y = jnp.sin(x)
        return y * 2

    patched = tx.patch(f, {"a/sin": (lambda v: v + 10.0) if how == "function" else 5.0})
    out, got = tx.capture(patched, "a/sin")(1.0)
    want = np.sin(1.0) + 10.0 if how == "function" else 5.0
    np.testing.assert_allclose(got["a/sin"], want, rtol=1e-6)
    np.testing.assert_allclose(out, 2 * want, rtol=1e-6)


def _nested_scans(x):
    def outer(c, _):
        def inner(c2, _):
            with jax.named_scope("cell"):
                c2 = jnp.sin(c2) + 0.5
            return c2, c2
        return jax.lax.scan(inner, c, None, length=2)
    return jax.lax.scan(outer, x, None, length=3)[1]


def _nested_scans_by_hand(x, replaced: dict):
    c, rows = float(x), []
    for i in range(3):
        row = []
        for j in range(2):
            c = np.sin(c) + 0.5
            if i in replaced:
                c = float(replaced[i][j])
            row.append(c)
        rows.append(row)
    return np.array(rows)


@pytest.mark.parametrize("form", ["index", "mask"])
def test_rows_of_a_site_inside_nested_scans_index_the_outer_scan(form):
    x = jnp.float32(0.3)
    assert tx.capture(_nested_scans, "cell/add")(x)[1]["cell/add"].shape == (3, 2)
    new_row = jnp.array([7.0, 8.0])
    if form == "index":
        replacement = h.rows({1: new_row})
    else:
        replacement = h.rows(mask=jnp.array([False, True, False]),
                             values=jnp.zeros((3, 2)).at[1].set(new_row))
    got = tx.patch(_nested_scans, {"cell/add": replacement})(x)
    np.testing.assert_allclose(got, _nested_scans_by_hand(x, {1: new_row}), rtol=1e-6)
    with pytest.raises(ValueError, match=r"row 1 has shape \[\]; a row of the site holds "
                                         r"float32\[2\]"):
        tx.patch(_nested_scans, {"cell/add": h.rows({1: 7.0})})(x)

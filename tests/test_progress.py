"""``tx.progress``: what a display is told, against the loop structure
computed by hand (a Python loop's count of iterations), and the outputs
against the function without the bars, bit for bit."""

from __future__ import annotations

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import taxpr as tx

from progress_recorder import Recorder


def _simulate(x):
    def step(c, i):
        return c * 0.99 + jnp.sin(i) * 0.01, c
    c, ys = lax.scan(step, x, jnp.arange(1000.0))
    k, c = lax.while_loop(lambda s: s[0] < 37, lambda s: (s[0] + 1, s[1] * 1.001), (0, c))
    return c, ys.sum()


SCAN, WHILE = "scan[length=1000]", "while"


def _expected(every_scan: int, every_while: int, n_while: int = 37) -> list:
    """The events of one call, written out in Python."""
    events = [("start", SCAN, 1000)]
    events += [("update", SCAN, n) for n in range(1, 1001) if n % every_scan == 0 or n == 1000]
    events += [("close", SCAN, 1000), ("start", WHILE, None)]
    events += [("update", WHILE, n) for n in range(1, n_while + 1) if n % every_while == 0]
    return events + [("close", WHILE, n_while)]


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("every", [1, 250, 300])
def test_events_of_one_call_in_order(every):
    rec = Recorder()
    f = tx.progress(_simulate, display=rec, every=every)
    out = f(jnp.float32(1.0))
    jax.effects_barrier()
    assert _bits(out) == _bits(jax.jit(_simulate)(jnp.float32(1.0)))
    assert rec.events == _expected(every, every)


def test_by_default_a_fast_loop_is_updated_a_few_times():
    # Updates a few times a second at the loop's speed: this scan ends in
    # milliseconds, so it is polled after its first 1% and then at most a
    # few times, the counts growing, each a multiple of the 1% chunk.
    rec = Recorder()
    out = tx.progress(_simulate, display=rec)(jnp.float32(1.0))
    jax.effects_barrier()
    assert _bits(out) == _bits(jax.jit(_simulate)(jnp.float32(1.0)))
    scan = [e for e in rec.events if e[1] == SCAN]
    assert scan[0] == ("start", SCAN, 1000) and scan[-1] == ("close", SCAN, 1000)
    counts = [n for kind, _, n in scan if kind == "update"]
    assert counts[0] == 10 and counts == sorted(set(counts)) and len(counts) <= 5, counts
    assert all(n % 10 == 0 for n in counts)
    assert rec.events[len(scan):] == _expected(1, 1)[-39:]  # the while loop: every iteration


def test_a_warm_second_call_under_jit_starts_new_bars():
    rec = Recorder()
    f = jax.jit(tx.progress(_simulate, display=rec, every=500))
    for _ in range(2):
        f(jnp.float32(1.0))
        jax.effects_barrier()
    assert rec.events == _expected(500, 500) * 2


def test_vmap_one_bar_and_the_slowest_example():
    def f(n):
        return lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, s[1] + 1.0),
                              (0, 0.0))[1]
    rec = Recorder()
    out = jax.vmap(tx.progress(f, display=rec))(jnp.array([3, 7, 5]))
    jax.effects_barrier()
    np.testing.assert_array_equal(np.asarray(out), [3.0, 7.0, 5.0])
    assert rec.events == ([("start", WHILE, None)]
                          + [("update", WHILE, n) for n in range(1, 8)]
                          + [("close", WHILE, 7)])


def test_nested_loops():
    def f(x):
        def outer(c, _):
            return lax.scan(lambda d, _: (d * 1.01, None), c, None, length=4)[0], None
        return lax.scan(outer, x, None, length=3)[0]
    rec = Recorder()
    tx.progress(f, display=rec, every=1)(jnp.float32(1.0))
    jax.effects_barrier()
    assert [e for e in rec.events if e[1].startswith("scan[length=3]/")] == []  # outer only
    rec.events.clear()
    out = tx.progress(f, display=rec, every=1, nested=True)(jnp.float32(1.0))
    jax.effects_barrier()
    assert _bits(out) == _bits(jax.jit(f)(jnp.float32(1.0)))
    inner = "scan[length=3]/scan[length=4]"
    want = [("start", "scan[length=3]", 3)]
    for k in range(1, 4):
        want += [("start", inner, 4)] + [("update", inner, n) for n in range(1, 5)]
        want += [("close", inner, 4), ("update", "scan[length=3]", k)]
    assert rec.events == want + [("close", "scan[length=3]", 3)]


def test_grad_shows_the_forward_loop_and_differentiates_as_without():
    def f(x):
        def step(c, i):
            return c * 0.99 + jnp.sin(c * i) * 0.01, c
        return lax.scan(step, x, jnp.arange(1000.0))[1].sum()
    rec = Recorder()
    g = jax.grad(tx.progress(f, display=rec, every=500))(1.0)
    jax.effects_barrier()
    assert np.asarray(g).tobytes() == np.asarray(jax.grad(f)(1.0)).tobytes()
    assert rec.events == [("start", SCAN, 1000), ("update", SCAN, 500), ("update", SCAN, 1000),
                          ("close", SCAN, 1000)]


def test_select_loops_by_path_and_a_while_total():
    rec = Recorder()
    tx.progress(_simulate, display=rec, loops="while", total=37, desc="settling")(1.0)
    jax.effects_barrier()
    assert rec.events[0] == ("start", WHILE, 37) and rec.events[-1] == ("close", WHILE, 37)
    assert all(e[1] == WHILE for e in rec.events)


def test_plain_lines_without_a_terminal():
    stream = io.StringIO()
    tx.progress(_simulate, display=tx.PlainDisplay(stream, interval=0.0), loops="scan*",
                every=500, desc="steps")(1.0)
    jax.effects_barrier()
    assert stream.getvalue().splitlines() == [
        "steps: 0/1000 (0%)", "steps: 500/1000 (50%)", "steps: 1000/1000 (100%)",
        "steps: 1000/1000 (100%) done"]


def _clocked(x, dt=0.25, end=2.0):
    """A while loop whose progress is a carried time, not a count."""
    def body(s):
        t, y = s
        with jax.named_scope("clock"):
            t = jnp.minimum(t + dt, end)
        return t, y * 0.9
    return lax.while_loop(lambda s: s[0] < end, body, (jnp.zeros_like(dt), x))


def _times(dt: float, end: float) -> list:
    """The clock's values, computed by a Python loop (in float32)."""
    t, out = np.float32(0), []
    while t < end:
        t = np.minimum(t + np.float32(dt), np.float32(end))
        out.append(float(t))
    return out


def test_a_while_loop_shown_by_a_carried_value():
    rec = Recorder()
    f = tx.progress(_clocked, value="clock/min", total=2.0, display=rec)
    out = f(jnp.float32(1.0))
    jax.effects_barrier()
    assert _bits(out) == _bits(jax.jit(_clocked)(jnp.float32(1.0)))
    times = _times(0.25, 2.0)
    assert rec.events == ([("start", WHILE, 2.0)] + [("update", WHILE, t) for t in times]
                          + [("close", WHILE, 2.0)])
    # every=: one update in k iterations (the 1st, the (k+1)th, ...)
    rec.events.clear()
    tx.progress(_clocked, value="clock/min", total=2.0, every=3, display=rec)(jnp.float32(1.0))
    jax.effects_barrier()
    assert [n for kind, _, n in rec.events if kind == "update"] == times[::3]
    assert rec.events[-1] == ("close", WHILE, times[::3][-1])


def test_a_value_under_vmap_shows_the_slowest_example():
    rec = Recorder()
    def clocked(x, dt):
        return _clocked(x, dt, 1.0)
    args = jnp.ones(3), jnp.array([0.5, 0.125, 0.25])
    out = jax.vmap(tx.progress(clocked, value="clock/min", total=1.0, display=rec))(*args)
    jax.effects_barrier()
    slowest = _times(0.125, 1.0)
    assert rec.events == ([("start", WHILE, 1.0)] + [("update", WHILE, t) for t in slowest]
                          + [("close", WHILE, 1.0)])
    assert _bits(out) == _bits(jax.jit(jax.vmap(clocked))(*args))


def test_a_value_in_plain_lines():
    stream = io.StringIO()
    tx.progress(_clocked, value="clock/min", total=2.0, desc="t",
                display=tx.PlainDisplay(stream, interval=0.0))(1.0)
    jax.effects_barrier()
    lines = stream.getvalue().splitlines()
    assert lines[:3] == ["t: 0/2 (0%)", "t: 0.25/2 (12%)", "t: 0.5/2 (25%)"]
    assert lines[-2:] == ["t: 2/2 (100%)", "t: 2/2 (100%) done"]


def test_a_value_must_be_one_site_inside_a_loop():
    with pytest.raises(ValueError, match="value= must select one site; it selects 2"):
        tx.progress(lambda x: (_clocked(x), _clocked(x)), value="clock/min*",
                    total=2.0)(jnp.float32(1.0))
    with pytest.raises(ValueError, match="'sin' that value= selects is not inside a loop"):
        tx.progress(lambda x: _clocked(jnp.sin(x)), value="sin", total=2.0)(jnp.float32(1.0))
    with pytest.raises(ValueError, match="matches none"):
        tx.progress(_clocked, value="nowhere/*", total=2.0)(jnp.float32(1.0))


def _scanned(x):
    def step(c, i):
        return c * 0.99 + jnp.sin(c * i) * 0.01, c
    return lax.scan(step, x, jnp.arange(100.0))[1].sum()


def _scanned_checkpointed_body(x):
    def step(c, i):
        return c * 0.99 + jnp.sin(c * i) * 0.01, c
    return lax.scan(jax.checkpoint(step), x, jnp.arange(100.0))[1].sum()


@pytest.mark.parametrize("program", [
    jax.checkpoint(_scanned),
    jax.checkpoint(_scanned, policy=jax.checkpoint_policies.nothing_saveable),
    jax.checkpoint(_scanned, policy=jax.checkpoint_policies.dots_saveable),
    _scanned_checkpointed_body,
], ids=["checkpoint", "nothing_saveable", "dots_saveable", "checkpointed_body"])
@pytest.mark.parametrize("how", ["grad", "jit_grad", "vjp", "vmap_grad"])
def test_a_loop_in_a_checkpoint_shows_one_bar_under_differentiation(program, how):
    # The backward pass recomputes the checkpoint's forward loop, but the
    # bar's callbacks depend only on the iteration count, which is not
    # differentiated: they stay in the forward pass, and run once.
    rec = Recorder()
    watched = tx.progress(program, display=rec, every=50)
    run = {"grad": jax.grad, "jit_grad": lambda f: jax.jit(jax.grad(f)),
           "vjp": lambda f: lambda x: jax.vjp(f, x)[1](jnp.float32(1.0))[0],
           "vmap_grad": lambda f: jax.vmap(jax.grad(f))}[how]
    x = jnp.ones(2) if how == "vmap_grad" else jnp.float32(1.0)
    if how == "vmap_grad" and not _checker_takes_callbacks_in_batched_checkpoints():
        pytest.skip("this JAX's jaxpr checker rejects the closed_call equations with a name "
                    "that JAX makes of a custom_vmap in a checkpoint under vmap(grad)")
    got = run(watched)(x)
    jax.effects_barrier()
    assert _bits(got) == _bits(run(program)(x))
    name = rec.events[0][1]
    assert rec.events == [("start", name, 100), ("update", name, 50), ("update", name, 100),
                          ("close", name, 100)]


def _checker_takes_callbacks_in_batched_checkpoints() -> bool:
    """Whether ``jax_enable_checks`` (on in this suite) takes the
    ``closed_call`` equations with a ``name`` that JAX makes of a
    ``custom_vmap`` (the bar's callbacks) in a checkpoint under
    ``vmap(grad)``: its checking rule for ``closed_call`` takes the name."""
    import inspect

    from jax._src import core
    rule = core.custom_typechecks.get(core.closed_call_p)
    if rule is None:
        return True
    params = inspect.signature(rule).parameters
    return "name" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _sharded(program):
    """``program`` of one shard, run by shard_map over 4 devices (see
    conftest) on 2 values each."""
    from jax.sharding import Mesh, PartitionSpec as P
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # (JAX without jax.shard_map)
        from jax.experimental.shard_map import shard_map
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    return lambda x: shard_map(program, mesh=mesh, in_specs=P("d"), out_specs=P("d"))(x)


@pytest.mark.parametrize("every", [50, None])
def test_a_loop_in_a_shard_map_shows_one_bar_for_the_mesh(every):
    # Every shard runs the loop; the bar is the first shard's, once.
    def shard(b):
        def step(c, i):
            return c * 0.99 + i, c
        return lax.scan(step, b, jnp.arange(100.0))[0]
    f = _sharded(shard)
    rec = Recorder()
    out = tx.progress(f, display=rec, every=every)(jnp.arange(8.0))
    jax.effects_barrier()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(f)(jnp.arange(8.0))))
    name = "shard_map/scan[length=100]"
    assert [e for e in rec.events if e[0] != "update"] == [("start", name, 100),
                                                            ("close", name, 100)]
    counts = [n for kind, _, n in rec.events if kind == "update"]
    assert counts == sorted(set(counts)) and counts[-1] == 100
    if every == 50:
        assert counts == [50, 100]


def test_a_while_loop_in_a_shard_map_shows_one_bar_in_order():
    def shard(b):
        return lax.while_loop(lambda s: s[0] < 5, lambda s: (s[0] + 1, s[1] * 2.0), (0, b))[1]
    f = _sharded(shard)
    rec = Recorder()
    out = tx.progress(f, display=rec)(jnp.arange(8.0))
    jax.effects_barrier()
    np.testing.assert_array_equal(np.asarray(out), np.arange(8.0) * 32)
    assert rec.events == ([("start", "shard_map/while", None)]
                          + [("update", "shard_map/while", n) for n in range(1, 6)]
                          + [("close", "shard_map/while", 5)])


def test_the_backward_loop_is_a_second_bar_with_the_bar_outside_grad():
    def f(x):
        def step(c, i):
            return c * 0.99 + jnp.sin(i) * 0.01, c
        return lax.scan(step, x, jnp.arange(1000.0))[1].sum()
    rec = Recorder()
    g = tx.progress(jax.grad(f), display=rec, every=500)(jnp.float32(1.0))
    jax.effects_barrier()
    assert np.asarray(g).tobytes() == np.asarray(jax.jit(jax.grad(f))(jnp.float32(1.0))).tobytes()
    backward = "scan[length=1000,reverse]"
    assert rec.events == [("start", SCAN, 1000), ("update", SCAN, 500), ("update", SCAN, 1000),
                          ("close", SCAN, 1000), ("start", backward, 1000),
                          ("update", backward, 500), ("update", backward, 1000),
                          ("close", backward, 1000)]

"""The thread rule of ``custom_vjp`` calls: the user's fwd and bwd for the
outputs, what flows through ctx from the VJP of the threaded function; a
bwd run as a replay of the forward pass; the errors where no rule gives a
derivative."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from .._jax.internals import core
from .. import _compat, _dependence, _jaxpr, _traverse
from ..primitives._tag import evaluated_fun, keep_tags, keeping_tags
from ._api import (emit_rebuilt_eqn, format_path, is_inexact, register_thread_rule, site_name,
                   sub_label, trace_in)
from ._custom_common import (SPECULATIVE_TRACES, add_cts, emit_ctx_through, instantiate_ct,
                             is_symbolic_zero, is_zero_ct,
                             of_some_inputs, passes_through,
                             reject_rule_sites, threaded_rule,
                             zeros_like_ct)


def _custom_vjp_rule(engine, eqn, level, ctx, subs):
    """custom_vjp: ctx enters last (so the residual forwarding indices of
    ``out_trees`` stay valid) and leaves last. The forward pass takes
    residuals from the user's fwd and outputs (and ctx) from the threaded
    function; the backward pass takes the inputs' cotangents w.r.t. the
    outputs from the user's bwd, and everything that flows through ctx from
    the VJP of the threaded function (whose inputs are forwarded residuals).
    Consts become ordinary inputs (``num_consts=0``)."""
    p = eqn.params
    n, n_all, n_out = len(ctx), len(eqn.invars), len(eqn.outvars)
    nc = p["num_consts"]
    call = p["call_jaxpr"]
    threaded = engine.thread_jaxpr(call, level.path + (sub_label(subs, "call_jaxpr"),), n_all, n_out,
                                   level.context)
    feeds, collects = engine.pass_channels(level, threaded)
    # Extra inputs (ctx, fed values) and outputs (ctx, collected values).
    n_x, n_y = n + len(feeds), n + len(collects)
    rest_avals = [*engine.ctx_avals, *(v.aval for v in collects)]
    threaded_fn = evaluated_fun(threaded)
    user_fwd, user_bwd, user_out_trees = p["fwd_jaxpr_thunk"], p["bwd"], p["out_trees"]
    in_avals = [*(v.aval for v in eqn.invars), *engine.ctx_avals, *(v.aval for v in feeds)]
    n_prims = n_all - nc
    fwd_cache: dict = {}

    def out_trees():
        out_tree, res_tree, fwds = user_out_trees()
        ones = lambda k: [0] * k
        res = jax.tree_util.tree_unflatten(res_tree, ones(res_tree.num_leaves))
        outs = jax.tree_util.tree_unflatten(out_tree, ones(out_tree.num_leaves))
        return (jax.tree_util.tree_structure((outs, ones(n_y))),
                jax.tree_util.tree_structure((res, ones(n_all + n_x))),
                [*fwds, *range(n_all + n_x)])

    fwd_path = level.path + ("custom_vjp[fwd]",)
    threads_fwd = engine.hooks.rules.in_place
    # Without ``RulePolicy.in_place``, a fwd holding tags the layer rewrites in
    # rules (harvest: names its function does not sow) acts on ctx after the
    # function.
    fwd_after_function = not threads_fwd and engine._rule_selected(eqn)
    # The ctx leaves and fed values JAX differentiates the call w.r.t. (seen
    # by the fwd): only their cotangents are computed through the function.
    differentiated_ctx: set[int] = set()
    # With ``RulePolicy.in_place`` the user's fwd, threaded, runs in the function's
    # place: ``(*ctx, *inputs) -> (*residuals, *outputs, *ctx)``; the ctx
    # flows of the backward pass are the function's (``_bwd_through_ctx``).

    def fwd_jaxpr_thunk(*nonzeros):
        nonzeros = tuple(nonzeros)
        key = (nonzeros, keeping_tags())
        if key in fwd_cache:
            return fwd_cache[key]
        # A speculative trace (harvest looking for sows) differentiates every
        # input: it neither checks nor records what JAX differentiates, and
        # its result is not cached for JAX's own call.
        speculative = SPECULATIVE_TRACES.get()
        with keep_tags():  # as the JVP rule of a custom_jvp
            fwd_jaxpr, fwd_consts = user_fwd.call_wrapped(*nonzeros[nc:nc + n_prims])
        if not speculative:
            differentiated_ctx.update(i for i in range(n_x) if nonzeros[n_all + i])
            if not threads_fwd:
                _reject_differentiated_into_loops(
                    engine, threaded, nonzeros[n_all:], n_all,
                    level.path + (sub_label(subs, "call_jaxpr"),))
        if threads_fwd:
            rule = threaded_rule(engine, eqn, fwd_jaxpr, fwd_consts, n_prims, fwd_path,
                                level.context)
            if not speculative:
                _reject_differentiated_ctx(engine, rule, nonzeros[n_all:n_all + n], fwd_path)
            rule_fn = evaluated_fun(rule)

            def f(*primals):
                return rule_fn(*primals[n_all:n_all + n], *primals[nc:nc + n_prims])
        elif fwd_after_function:
            rule_fn = evaluated_fun(
                threaded_rule(engine, eqn, fwd_jaxpr, fwd_consts, n_prims, fwd_path,
                             level.context))

            def f(*primals):
                # The function's ctx and collected values, then the fwd's
                # tags on that ctx: (*residuals, *outputs, *ctx).
                by_function = threaded_fn(*primals)
                ran = rule_fn(*by_function[n_out:n_out + n], *primals[nc:nc + n_prims])
                return [*ran, *by_function[n_out + n:]]
        else:
            reject_rule_sites(engine, fwd_jaxpr, fwd_path)

            def f(*primals):
                # The fwd's residuals and outputs (JAX's outputs of a
                # differentiated call), the function's ctx and collected values.
                res_and_outs = evaluated_fun(_jaxpr.close_traced(fwd_jaxpr, fwd_consts))(
                    *primals[nc:nc + n_prims])
                return [*res_and_outs, *threaded_fn(*primals)[n_out:]]

        result = _jaxpr.open_with_constvars(_jaxpr.trace_flat(f, in_avals))
        if not speculative:
            fwd_cache[key] = result
        return result

    out_avals = [v.aval for v in eqn.outvars]

    def bwd(*args):
        n_res = len(args) - n_out - n_y
        user_res, primals = args[:n_res - n_all - n_x], args[n_res - n_all - n_x:n_res]
        ct_outs, ct_rest = args[n_res:n_res + n_out], args[n_res + n_out:]
        # The call is rebuilt with symbolic zeros (so that a cotangent nothing
        # flows into is known to be zero); the user's bwd gets them as
        # registered.
        user_ct_outs = ct_outs if p["symbolic_zeros"] else list(
            map(instantiate_ct, ct_outs, out_avals))
        if threads_fwd:
            _reject_differentiated_writes(engine, threaded, ct_rest[:n], nc, n_all, n_out,
                                          level.path + ("custom_vjp[bwd]",))
        user_cts, logs = _replayed_bwd(engine, user_bwd, user_res, user_ct_outs,
                                       primals[n_all:], threaded,
                                       level.path + ("custom_vjp[bwd]",), level.context)
        if threads_fwd or all(map(is_zero_ct, ct_rest)):
            # Nothing flows back into ctx or the collected values (harvest:
            # no reaped value is differentiated): the function itself is
            # differentiated only w.r.t. the ctx leaves JAX differentiates,
            # so a function JAX cannot reverse (a while loop under equinox's
            # or diffrax's checkpointing) is left to the user's bwd.
            handed_on = {i for i in differentiated_ctx if i < n and passes_through(
                engine, threaded, i, n_all + i, n_out + i)}
            return _compat.custom_vjp_bwd_result(
                _bwd_through_ctx(threaded_fn, primals, user_cts, ct_outs, ct_rest, out_avals,
                                 rest_avals, nc, n_all, differentiated_ctx, handed_on),
                logs)
        _, vjp_fn = jax.vjp(threaded_fn, *primals)
        via_ctx = vjp_fn([*map(zeros_like_ct, out_avals), *map(instantiate_ct, ct_rest, rest_avals)])
        via_outs = vjp_fn([*map(instantiate_ct, ct_outs, out_avals), *map(zeros_like_ct, rest_avals)])
        cts = [*via_ctx[:nc],
               *(add_cts(u, c) for u, c in zip(user_cts, via_ctx[nc:n_all])),
               *(add_cts(a, b) for a, b in zip(via_ctx[n_all:], via_outs[n_all:]))]
        return _compat.custom_vjp_bwd_result(cts, logs)

    ctx_out = engine.fresh_ctx()
    emit_rebuilt_eqn(level, eqn, {("call_jaxpr", None): threaded}, [*eqn.invars, *ctx, *feeds],
                  [*eqn.outvars, *ctx_out, *collects], num_consts=0, out_trees=out_trees,
                  fwd_jaxpr_thunk=_jaxpr.wrap_fun(fwd_jaxpr_thunk, user_fwd),
                  bwd=_jaxpr.wrap_fun(bwd, user_bwd), symbolic_zeros=True)
    written = engine.writes(threaded)
    return [emit_ctx_through(level, after, before)
            if i not in written and is_inexact(engine.ctx_avals[i]) and type(before) is core.Var
            else after for i, (after, before) in enumerate(zip(ctx_out, ctx))]


def _reject_differentiated_into_loops(engine, threaded, differentiated: Sequence[bool],
                                      at: int, path: tuple[str, ...]) -> None:
    """A ctx leaf or fed value (a planted value: ``differentiated`` per ctx
    leaf, then per fed value, from input ``at`` of ``threaded``) that JAX
    differentiates and that reaches a while loop of the custom_vjp function (outside the custom rules nested
    in it, which give their own derivatives): its cotangent could only come
    from reversing the loop, which JAX cannot do, and the user's bwd knows
    nothing of it (a library rule may even stop its gradient: equinox's
    checkpointed loops stop the gradient of a loop whose own inputs are not
    differentiated), so an error naming the value instead of a zero."""
    if not any(differentiated):
        return
    own_loops = set()
    pending = [threaded]
    while pending:
        for eqn in _jaxpr.jaxpr_parts(pending.pop()).eqns:
            if eqn.primitive is _compat.while_p:
                own_loops.add(id(eqn))
            if eqn.primitive not in _compat.CUSTOM_CALL_PRIMITIVES:
                pending.extend(sj for _, sj in _traverse.subjaxprs(eqn))
    if not own_loops:
        return
    n_in = len(_jaxpr.jaxpr_parts(threaded).invars)
    n = len(engine.ctx_avals)
    names = [*map(engine.hooks.describe_ctx, range(n)),
             *(f"the value fed to {site_name(k)}"
               for k, avals in engine.channels(threaded).feeds for _ in avals)]
    for j, d in enumerate(differentiated):
        if not d or not is_inexact(_jaxpr.jaxpr_parts(threaded).invars[at + j].aval):
            continue
        reached: list = []

        def visit(eqn, ins, looked_into):
            if id(eqn) in own_loops and any(ins):
                reached.append(eqn)
        dep = _dependence.dependence(threaded, [i == at + j for i in range(n_in)], visit=visit)
        if reached and any(dep.outputs):
            raise engine.hooks.differentiated_into_loop(names[j], path)


def _reject_differentiated_writes(engine, threaded, ct_ctx, nc: int, n_all: int, n_out: int,
                                  path: tuple[str, ...]) -> None:
    """A ctx leaf the function writes from its (inexact) inputs, with a
    nonzero cotangent: its derivative would be dropped (a fwd ran in the
    function's place, and the user's bwd knows nothing of ctx), a silent
    zero. The layer's error instead."""
    written = engine.writes(threaded)
    live = [i for i, ct in enumerate(ct_ctx) if i in written and not is_zero_ct(ct)]
    if not live:
        return
    invars = _jaxpr.jaxpr_parts(threaded).invars
    wrt = [nc <= j < n_all and is_inexact(v.aval) for j, v in enumerate(invars)]
    dep = _dependence.dependence(threaded, wrt).outputs
    for i in live:
        if dep[n_out + i]:
            raise engine.hooks.differentiated_write(i, path)


def _replayed_bwd(engine, user_bwd, res: Sequence[Any], ct_outs: Sequence[Any],
                  ctx_and_feeds: Sequence[Any], fn_threaded: Any, path: tuple[str, ...],
                  context: Callable | None) -> tuple[list, Any]:
    """Run a custom_vjp's bwd as a replay of its forward pass: ``(cts, logs)``.

    A bwd that runs the function again (``jax.vjp(f, ...)`` in it, equinox's
    checkpointed loops, diffrax's adjoints) recomputes the forward pass, so its
    tags see what the forward saw: the ctx at the call (``ctx_and_feeds``
    starts with it) and the values fed to the function (planted values).
    Its effects already happened in the forward pass: what it writes to ctx
    and collects is dropped, and a bwd that writes a ctx entry or collects a
    value the function does not is an error (an effect of the backward pass
    itself, which has no place in the program's order)."""
    closed, results = traced_bwd(user_bwd, [*res, *ct_outs], context)
    engine.hooks.rules.check(closed, path)
    n_outs = len(_jaxpr.jaxpr_parts(closed).outvars)
    if engine.has_selected(closed):
        outs = _run_replay(engine, closed, n_outs, ctx_and_feeds, fn_threaded, path, context)
    else:
        outs = evaluated_fun(closed)()
    return results(outs)


def traced_bwd(user_bwd, args: Sequence[Any], context: Callable | None = None
               ) -> tuple[Any, Callable[[Sequence[Any]], tuple[list, Any]]]:
    """A custom_vjp's flat bwd traced at the very values JAX passes it
    (closed over: concrete values stay concrete, as when JAX calls it),
    keeping its tags: ``(closed jaxpr, results)``, ``results(outs)`` giving
    ``(cts, logs)`` from the jaxpr's outputs (symbolic zeros kept)."""
    shape: dict = {}

    def flat():
        cts, logs = _compat.call_custom_vjp_bwd(user_bwd, args)
        shape["cts"] = [c if is_symbolic_zero(c) else None for c in cts]
        log_leaves, shape["logs"] = jax.tree_util.tree_flatten(logs)
        return [*(c for c in cts if not is_symbolic_zero(c)), *log_leaves]

    with keep_tags():  # as the JVP rule of a custom_jvp
        closed = trace_in(context, flat, [])

    def results(outs: Sequence[Any]) -> tuple[list, Any]:
        given = iter(outs)
        cts = [next(given) if c is None else c for c in shape["cts"]]
        return cts, jax.tree_util.tree_unflatten(shape["logs"], list(given))

    return closed, results


def _run_replay(engine, closed, n_outs: int, ctx_and_feeds: Sequence[Any], fn_threaded: Any,
                path: tuple[str, ...], context: Callable | None) -> list:
    """``closed`` (a traced bwd) threaded from the ctx and fed values of its
    function's call; its own ctx writes and collected values dropped."""
    n = len(engine.ctx_avals)
    threaded = engine.thread_jaxpr(closed, path, 0, n_outs, context)
    parts = _jaxpr.jaxpr_parts(threaded)
    fn_channels, channels = engine.channels(fn_threaded), engine.channels(threaded)
    written = engine.writes(fn_threaded)
    own_writes = sorted(engine.writes(threaded) - written)
    if own_writes:
        raise engine.hooks.replay_write(own_writes[0], path)
    # A replay reads the ctx of the call's entry; a leaf the forward pass
    # changes reads right only if the bwd recomputes in the forward's order,
    # from the start (checkpointed loops restart from saved steps): so the
    # cotangents may depend only on leaves the forward leaves unchanged.
    for i in sorted(written):
        dep = _dependence.dependence(threaded, [j == i for j in range(len(parts.invars))])
        if any(dep.outputs[:n_outs]) or dep.reaches_effect:
            raise engine.hooks.replay_read(i, path)
    fn_collected = {k for k, _ in fn_channels.collects}
    fed: dict = {}
    values = iter(ctx_and_feeds[n:])
    for k, avals in fn_channels.feeds:
        fed[k] = [next(values) for _ in avals]
    for k in [k for k, _ in channels.collects if k not in fn_collected] + [
            k for k, _ in channels.feeds if k not in fed]:
        raise NotImplementedError(
            f"taxpr: the custom_vjp bwd at {format_path(path)} collects or is fed values "
            f"({k!r}) that its function's forward pass does not: a backward pass replays the "
            f"forward pass, and a value of its own cannot be reaped or planted")
    feeds = [v for k, _ in channels.feeds for v in fed[k]]
    outs = evaluated_fun(threaded)(*ctx_and_feeds[:n], *feeds)
    return list(outs[:n_outs])


def _reject_differentiated_ctx(engine, rule, nonzeros: Sequence[bool], path) -> None:
    """Derivatives w.r.t. ctx entries that a threaded custom_vjp fwd reads
    (a state differentiated from outside, read inside the function) would
    reach them only through the VJP of the function, which libraries' custom
    VJPs (equinox's checkpointed loops, diffrax's adjoints) do not provide:
    rather than a zero gradient, an error naming the entry."""
    # A ctx entry the fwd hands on unchanged is not read: its derivative is
    # the identity, which the function's VJP gives. Handed on directly, or
    # through nested calls that thread it (the fwd calling its function,
    # whose body uses another state): no site writes it and no other output
    # depends on it.
    invars, outvars = _jaxpr.jaxpr_parts(rule).invars, _jaxpr.jaxpr_parts(rule).outvars
    n = len(nonzeros)
    handed_on = {len(outvars) - n + i for i in range(n) if outvars[len(outvars) - n + i] is invars[i]}
    used = _jaxpr.used_invars(rule, [i not in handed_on for i in range(len(outvars))])[:n]
    for i, (nz, u, aval) in enumerate(zip(nonzeros, used, engine.ctx_avals)):
        if (nz and u and is_inexact(aval)
                and not passes_through(engine, rule, i, i, len(outvars) - n + i)):
            raise NotImplementedError(
                f"taxpr: differentiating w.r.t. {engine.hooks.describe_ctx(i)}, which the "
                f"custom_vjp function at {format_path(path)} reads, is not supported: the "
                f"function's own rules give no derivative for it. Differentiate w.r.t. the "
                f"function's arguments (pass the value in), or hold the state constant "
                f"(jax.lax.stop_gradient) around the call")


def _bwd_through_ctx(threaded_fn, primals, user_cts, ct_outs, ct_rest, out_avals, rest_avals,
                     nc, n_all, differentiated: set[int], handed_on: set[int] = frozenset()):
    """The cotangents of a custom_vjp's inputs ``[*consts, *args, *ctx,
    *feeds]`` where what the function adds to ctx or collects is a constant
    w.r.t. its args (a fwd ran in its place, as eagerly; or no cotangent
    flows there): the args' from the user's bwd, those of ctx and fed values
    from the VJP of the threaded function ``threaded_fn(*consts, *args, *ctx,
    *feeds) -> (*outputs, *ctx, *collects)`` w.r.t. those JAX differentiates
    (``differentiated``, positions after the args), taken only where a
    nonzero cotangent flows there. A ctx leaf the function hands on
    unchanged (``handed_on``) takes its output's cotangent, without
    differentiating the function (which JAX may not reverse: a while loop
    under a library's checkpointing)."""
    in_avals = [core.typeof(p) for p in primals]
    held = [zeros_like_ct(a) for a in in_avals[:nc]]
    args_ct = [instantiate_ct(c, a) for c, a in zip(user_cts, in_avals[nc:n_all])]
    ctx_ct = [zeros_like_ct(a) for a in in_avals[n_all:]]
    for i in handed_on:
        if is_inexact(in_avals[n_all + i]):
            ctx_ct[i] = instantiate_ct(ct_rest[i], rest_avals[i])
    wrt = [i for i in sorted(differentiated)
           if is_inexact(in_avals[n_all + i]) and i not in handed_on]
    if not wrt or (all(map(is_zero_ct, ct_outs)) and all(map(is_zero_ct, ct_rest))):
        return [*held, *args_ct, *ctx_ct]
    positions = [n_all + i for i in wrt]
    through = of_some_inputs(threaded_fn, primals, positions)
    _, vjp_fn = jax.vjp(through, *(primals[i] for i in positions))
    cts = vjp_fn([*map(instantiate_ct, ct_outs, out_avals),
                  *map(instantiate_ct, ct_rest, rest_avals)])
    for i, ct in zip(wrt, cts):
        ctx_ct[i] = ct
    return [*held, *args_ct, *ctx_ct]


register_thread_rule(_compat.custom_vjp_call_p, _custom_vjp_rule)

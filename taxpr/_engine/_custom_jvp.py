"""The thread rule of ``custom_jvp`` calls: the function threaded, the
user's rule run with what flows through ctx differentiated through the
threaded function."""

from __future__ import annotations

from typing import Callable

import jax

from .._jax.internals import core
from .. import _compat, _dependence, _jaxpr, _traverse
from ..primitives._tag import evaluated_fun, keep_tags, keeping_tags, tag_p
from ._api import emit_rebuilt_eqn, register_thread_rule, sub_label, zeros_of_aval
from ._custom_common import (DIFFERENTIATING_CTX_ONLY, add_cts, differentiating_ctx_only,
                             jvp_again, of_some_inputs,
                             passes_through, reject_rule_sites,
                             threaded_rule)


def _custom_jvp_rule(engine, eqn, level, ctx, subs):
    """custom_jvp: ctx enters first as an ordinary input. The new JVP takes
    the outputs' tangents w.r.t. the original inputs from the user's rule,
    and everything that flows through ctx and the channels (ctx_out,
    collected values, and the outputs' dependence on ctx_in and fed values)
    from the derivative of the threaded function."""
    p = eqn.params
    n, nc, n_out, n_all = len(ctx), p["num_consts"], len(eqn.outvars), len(eqn.invars)
    call = p["call_jaxpr"]
    threaded = engine.thread_jaxpr(call, level.path + (sub_label(subs, "call_jaxpr"),), 0, n_out,
                                   level.context)
    feeds, collects = engine.pass_channels(level, threaded)
    threaded_fn = evaluated_fun(threaded)
    user_jvp = p["jvp_jaxpr_fun"]
    in_avals = [*engine.ctx_avals, *(v.aval for v in eqn.invars), *(v.aval for v in feeds)]
    user = slice(n + nc, n + n_all)  # the user's rule sees the original non-const inputs
    cache: dict = {}
    rule_path = level.path + ("custom_jvp[rule]",)
    rule_context = level.context
    thread_rule = engine._rule_selected(eqn)  # definite: harvest's hooks
    if engine.hooks.rules.in_place:
        jvp_jaxpr_fun = _jvp_of_threaded_rule(engine, eqn, user_jvp, p["symbolic_zeros"], threaded,
                                              in_avals, user, n_out,
                                              level.path + ("custom_jvp[jvp rule]",),
                                              rule_context)
        ctx_out = engine.fresh_ctx()
        # Symbolic zeros: JAX then tells the rule which inputs (ctx
        # included) it differentiates, as it decides whether to run a rule.
        emit_rebuilt_eqn(level, eqn, {("call_jaxpr", None): threaded}, [*ctx, *eqn.invars, *feeds],
                      [*eqn.outvars, *ctx_out, *collects], num_consts=0, symbolic_zeros=True,
                      jvp_jaxpr_fun=_jaxpr.wrap_fun(jvp_jaxpr_fun, user_jvp))
        return ctx_out

    def jvp_jaxpr_fun(*zeros):
        zeros = tuple(zeros)
        ctx_only = DIFFERENTIATING_CTX_ONLY.get()
        key = (zeros, ctx_only, keeping_tags())  # what is left in it is kept or plain
        if key in cache:
            return cache[key]
        # Traced keeping its tags (as the function's are): this layer threads
        # them, and a rule of an inner layer's rewrite holds tags for it.
        nz_avals = [a.to_tangent_aval() for a, z in zip(in_avals, zeros) if not z]
        k = len(in_avals)
        if all(zeros[user]) or ctx_only:
            # Only ctx and fed values are differentiated (a planted value, an
            # array a patch closes over): the rule defines no derivative for
            # them, and JAX runs no rule for a call whose inputs it does not
            # differentiate. Autodiff of the threaded function gives them
            # (a rule that calls its function would otherwise be
            # differentiated w.r.t. ctx through its own call, without end).
            def by_function(*args):
                primals, tangents = args[:k], iter(args[k:])
                nz = [i for i, z in enumerate(zeros) if not z]
                outs, outs_t = jvp_again(threaded_fn, primals, nz,
                                          [next(tangents) for _ in nz])
                return [*outs, *outs_t]

            closed = _jaxpr.trace_flat(by_function, [*in_avals, *nz_avals])
            n_all_out = len(_jaxpr.jaxpr_parts(threaded).outvars)
            result = (*_jaxpr.open_with_constvars(closed), [False] * n_all_out)
            cache[key] = result
            return result
        with keep_tags():
            jvp_jaxpr, jvp_consts, out_zeros = user_jvp.call_wrapped(*zeros[user])
        reject_rule_sites(engine, jvp_jaxpr, level.path + ("custom_jvp[jvp rule]",))
        rule = None
        if thread_rule:  # tags in the user's rule: thread ctx through it too
            rule = threaded_rule(engine, eqn, jvp_jaxpr, jvp_consts, n_all - nc, rule_path,
                                rule_context)

        def f(*args):
            primals, tangents = args[:k], iter(args[k:])
            per_input = [zeros_of_aval(a.to_tangent_aval()) if z else next(tangents)
                         for a, z in zip(in_avals, zeros)]
            user_t = [t for t, z in zip(per_input[user], zeros[user]) if not z]
            res = (evaluated_fun(_jaxpr.close_traced(jvp_jaxpr, jvp_consts))(
                *primals[user], *user_t) if rule is None else None)
            # Tangents through the differentiated ctx / fed values only, the
            # original inputs (and those with symbolic-zero tangents) held
            # as constants: a custom_vjp in the function that does not
            # depend on them is then not differentiated (JAX has no forward
            # mode for it; of an instantiated zero tangent, its linear part
            # runs when JAX linearizes this rule: "can't apply forward-mode
            # autodiff").
            wrt = [i for i in range(k) if not n <= i < n + n_all and not zeros[i]]
            with differentiating_ctx_only():
                outs, through_t = jvp_again(threaded_fn, primals, wrt,
                                             [per_input[i] for i in wrt])
            outs_t_ctx = through_t[:n_out]
            # ctx's tangents w.r.t. every differentiated input (the reaped
            # values' own derivatives), the others held likewise.
            nz = [i for i, z in enumerate(zeros) if not z]
            rest_t = jvp_again(threaded_fn, primals, nz, [per_input[i] for i in nz])[1][n_out:]
            if rule is not None:
                # The rule's tags act on ctx after the function's; what they
                # write is a constant (tangent zero), other entries keep theirs.
                n_res = len(_jaxpr.jaxpr_parts(jvp_jaxpr).outvars)
                rule_fn = evaluated_fun(rule)
                args = [*primals[user], *user_t]
                ctx_body = list(outs[n_out:n_out + n])
                with differentiating_ctx_only():
                    r_out, r_t = jax.jvp(lambda *c: rule_fn(*c, *args), ctx_body,
                                         list(rest_t[:n]))
                res = r_out[:n_res]  # the rule's outputs (with its plants)
                outs = [*outs[:n_out], *r_out[n_res:], *outs[n_out + n:]]
                rest_t = [*r_t[n_res:], *rest_t[n:]]
            # JAX's outputs of a differentiated call are its rule's (they may
            # differ from the function's: a rule of a function rewritten for
            # state also writes the state), ctx and collected values are the
            # function's, then the rule's tags'.
            outs = [*res[:n_out], *outs[n_out:]]
            user_out_t = iter(res[len(out_zeros):])
            out_t = [t if z else add_cts(next(user_out_t), t)
                     for t, z in zip(outs_t_ctx, out_zeros)]
            return [*outs, *out_t, *rest_t]

        closed = _jaxpr.trace_flat(f, [*in_avals, *nz_avals])
        n_rest = len(_jaxpr.jaxpr_parts(threaded).outvars) - n_out
        result = (*_jaxpr.open_with_constvars(closed), [False] * (n_out + n_rest))
        cache[key] = result
        return result

    ctx_out = engine.fresh_ctx()
    emit_rebuilt_eqn(level, eqn, {("call_jaxpr", None): threaded}, [*ctx, *eqn.invars, *feeds],
                  [*eqn.outvars, *ctx_out, *collects], num_consts=0,
                  jvp_jaxpr_fun=_jaxpr.wrap_fun(jvp_jaxpr_fun, user_jvp))
    return ctx_out


def _jvp_of_threaded_rule(engine, eqn, user_jvp, user_symbolic: bool, threaded, in_avals,
                          user: slice, n_out: int, path, context):
    """The ``jvp_jaxpr_fun`` of a rewritten custom_jvp function for a layer
    whose rules run in the function's place (``RulePolicy.in_place``), as
    eagerly:

    - where some of the function's own inputs have nonzero tangents, its
      rule runs instead of it, threaded with the ctx before the call: the
      outputs, the ctx after the call and the outputs' tangents w.r.t. the
      inputs come from the rule. What the rule writes is a constant w.r.t.
      the inputs (a rule runs on primal values); tangents through ctx (of
      the outputs and ctx w.r.t. the ctx before) are autodiff's of the
      function w.r.t. ctx, in which nested custom functions see zero
      tangents for their inputs and so run their bodies, not their rules;
    - where only ctx has nonzero tangents (``DIFFERENTIATING_CTX_ONLY``, or
      symbolic zeros for every input), the function runs (JAX calls no rule
      when no input is differentiated): autodiff of the threaded function
      w.r.t. ctx.

    ``in_avals`` are ``[*ctx, *consts, *inputs, *feeds]``; the rule takes
    ``in_avals[user]`` (the inputs)."""
    n = len(engine.ctx_avals)
    k = len(in_avals)
    cache: dict = {}
    threaded_fn = evaluated_fun(threaded)
    out_tangent_avals = [v.aval.to_tangent_aval() for v in _jaxpr.jaxpr_parts(threaded).outvars]

    def jvp_through_ctx(ctx_zeros: tuple) -> Callable:
        """``(primals, tangents) -> output tangents`` of the threaded function
        w.r.t. the ctx leaves with nonzero tangents: only the outputs that
        depend on them are differentiated (the others get zeros), so that a
        body whose outputs ignore ctx is not differentiated again (the JVP of
        a custom_vjp in it would fail)."""
        live = _dependence.dependence(threaded, [not z for z in ctx_zeros]
                                      + [False] * (k - n)).outputs
        pruned = evaluated_fun(threaded if all(live) else _jaxpr.dce_closed(threaded, live))
        wrt = [i for i, z in enumerate(ctx_zeros) if not z]

        def jvp(primals, tangents):
            _, live_t = (jvp_again(pruned, primals, wrt, [tangents[i] for i in wrt])
                         if any(live) else (None, []))
            given = iter(live_t)
            return [next(given) if l else zeros_of_aval(a) for l, a in zip(live, out_tangent_avals)]
        return jvp

    def jvp_jaxpr_fun(*zeros):
        zeros = tuple(zeros)
        by_function = all(zeros[user]) or DIFFERENTIATING_CTX_ONLY.get()
        key = (zeros, by_function, keeping_tags())
        if key in cache:
            return cache[key]
        nz_avals = [a.to_tangent_aval() for a, z in zip(in_avals, zeros) if not z]
        ctx_t_in = not all(zeros[:n])

        def tangents_of(args):
            primals, tangents = args[:k], iter(args[k:])
            return primals, [zeros_of_aval(a.to_tangent_aval()) if z else next(tangents)
                             for a, z in zip(in_avals, zeros)]

        if by_function:
            # Tangents through ctx and fed values only (consts and inputs
            # held, as for a rule: JAX differentiates a custom function's
            # inputs). A ctx leaf the function hands on unchanged passes its
            # tangent through without differentiating the body (which may
            # hold what JAX cannot differentiate: a library's nextafter).
            passing = [j for j in range(n) if not zeros[j]
                       and passes_through(engine, threaded, j, j, n_out + j)]
            wrt = [i for i, z in enumerate(zeros)
                   if not z and not n <= i < user.stop and i not in passing]

            def f(*args):
                primals, per_input = tangents_of(args)
                if wrt:
                    outs, outs_t = jax.jvp(of_some_inputs(threaded_fn, primals, wrt),
                                           [primals[i] for i in wrt], [per_input[i] for i in wrt])
                else:
                    outs, outs_t = threaded_fn(*primals), list(map(zeros_of_aval, out_tangent_avals))
                outs_t = list(outs_t)
                for j in passing:
                    outs_t[n_out + j] = add_cts(outs_t[n_out + j], per_input[j])
                return [*outs, *outs_t]
        else:
            # A rule defined without symbolic zeros gets them instantiated.
            user_zeros = zeros[user] if user_symbolic else (False,) * (user.stop - user.start)
            # The rule runs in a rewritten function (its tags are kept as the
            # function's are): an unused sow in it must outlive the DCE below.
            with keep_tags():
                jvp_jaxpr, jvp_consts, out_zeros = user_jvp.call_wrapped(*user_zeros)
            n_rule = len(jvp_jaxpr.outvars)  # outputs, then their nonzero tangents
            if any(e.primitive is tag_p and engine.predicate(e.params)
                   for e, _ in _traverse.iter_eqns(jvp_jaxpr)):
                rule = threaded_rule(engine, eqn, jvp_jaxpr, jvp_consts, user.stop - user.start,
                                    path, context)
                rule_fn = evaluated_fun(rule)
            else:  # a rule without sites runs as JAX runs it, ctx passing by
                user_rule = evaluated_fun(_jaxpr.close_traced(jvp_jaxpr, jvp_consts))

                def rule_fn(*a):
                    return [*user_rule(*a[n:]), *a[:n]]

            ctx_jvp = jvp_through_ctx(zeros[:n]) if ctx_t_in else None

            def f(*args):
                primals, per_input = tangents_of(args)
                user_t = [t for t, z in zip(per_input[user], user_zeros) if not z]
                ins = list(primals[user])

                def run(*c):
                    return rule_fn(*c, *ins, *user_t)

                outs = run(*primals[:n])
                via_ctx = None
                if ctx_t_in:
                    # Through the function, not the rule: a rule may hold
                    # what forward mode cannot differentiate again (the JVP
                    # of a custom_vjp in it), and the function's tangents
                    # w.r.t. ctx are what eagerly flows through a closure.
                    rest = list(primals[n:])
                    through = [*per_input[:n], *(zeros_of_aval(a.to_tangent_aval())
                                                 for a in in_avals[n:])]
                    with differentiating_ctx_only():
                        via_ctx = ctx_jvp([*primals[:n], *rest], through)
                rule_t = iter(outs[n_out:n_rule])
                out_t = []
                for i, z in enumerate(out_zeros):
                    t = zeros_of_aval(core.typeof(outs[i]).to_tangent_aval()) if z else next(rule_t)
                    out_t.append(t if via_ctx is None else add_cts(t, via_ctx[i]))
                ctx_t = (list(via_ctx[n_out:n_out + n]) if via_ctx is not None else
                         [zeros_of_aval(a.to_tangent_aval()) for a in engine.ctx_avals])
                return [*outs[:n_out], *outs[n_rule:], *out_t, *ctx_t]

        closed = _jaxpr.trace_flat(f, [*in_avals, *nz_avals])
        n_rest = (len(_jaxpr.jaxpr_parts(closed).outvars) - 2 * n_out) // 2
        # With no tangent for ctx and the fed values, ctx and what is
        # collected after the call have none either: symbolic zeros, so that
        # JAX goes on differentiating only what depends on the inputs (a
        # rule downstream runs as JAX would run it, or not at all).
        rest_zero = all(zeros[:n]) and all(zeros[user.stop:])
        if rest_zero and n_rest:
            n_all_out = 2 * n_out + 2 * n_rest
            closed = _jaxpr.dce_closed(closed, [True] * (n_all_out - n_rest) + [False] * n_rest)
        result = (*_jaxpr.open_with_constvars(closed),
                  [False] * n_out + [rest_zero] * n_rest)
        cache[key] = result
        return result

    return jvp_jaxpr_fun


register_thread_rule(_compat.custom_jvp_call_p, _custom_jvp_rule)

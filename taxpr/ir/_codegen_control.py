"""Rules writing higher-order primitives and tags (see
``FunctionWriter.rules``): ``scan`` / ``while`` / ``cond`` / ``jit`` /
``checkpoint`` / ``shard_map`` become ``lax.scan`` / ``lax.while_loop`` (or
a module helper, for a predicate vmap batched) / ``lax.switch`` /
``jax.jit`` / ``jax.checkpoint`` / ``jax.shard_map`` of generated
functions; a ``custom_jvp`` / ``custom_vjp`` call or a closed call becomes
a call of its function; a tag becomes ``taxpr.tag(...)``. Each rule returns
None, and the primitive is bound as it is, when it cannot write the
equation exactly. ``control_rules()`` maps the primitives to them."""

from __future__ import annotations

import keyword
from typing import Callable

import jax

from .. import _compat, _jaxpr, _traverse
from .._jax.internals import core
from ..primitives import _tag
from ._build import jit_inlining_loses_nothing
from ._codegen_functions import FunctionWriter, Single
from ._codegen_source import NoSource, Src, tree_src, tuple_src

__all__ = ["control_rules"]


def _scan_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    n_consts, n_carry = _jaxpr.scan_counts(p)
    body = g.function(p["jaxpr"], "scan_body", "scan", n_carry)
    consts, carry, xs = args[:n_consts], args[n_consts:n_consts + n_carry], \
        args[n_consts + n_carry:]
    call = f"lambda carry, xs: {body}({', '.join([*consts, '*carry', '*xs'])})"
    opts = f"length={p['length']!r}, reverse={p['reverse']!r}, unroll={p['unroll']!r}"
    if p.get("_split_transpose"):
        opts += ", _split_transpose=True"
    return f"lax.scan({call}, {tuple_src(carry)}, {tuple_src(xs)}, {opts})", n_carry


def _while_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond = g.function(p["cond_jaxpr"], "while_cond", "value")
    body = g.function(p["body_jaxpr"], "while_body", "tuple")
    cc, bc, init = args[:nc], args[nc:nc + nb], args[nc + nb:]
    if _jaxpr.jaxpr_parts(p["cond_jaxpr"]).outvars[0].aval.shape:
        # vmap batched the predicate: ``while_p`` loops while any example's
        # holds and selects the carry per example (``lax.while_loop`` takes
        # only a scalar predicate), as JAX lowers it.
        return (f"{_batched_while_loop(g)}({cond}, {body}, {tuple_src(cc)}, {tuple_src(bc)}, "
                f"{tuple_src(init)})")
    return (f"lax.while_loop(lambda carry: {cond}({', '.join([*cc, '*carry'])}), "
            f"lambda carry: {body}({', '.join([*bc, '*carry'])}), {tuple_src(init)})")


def _batched_while_loop(g: FunctionWriter) -> str:
    """The name of the module's helper running a ``while`` whose
    predicate vmap batched (written once, when first needed)."""
    hit = g.fn_memo.get("batched_while_loop")
    if hit is None:
        hit = g.fn_memo["batched_while_loop"] = g.fn_name("batched_while_loop")
        g.functions.append(_BATCHED_WHILE_LOOP.format(name=hit))
    return hit


_BATCHED_WHILE_LOOP = '''def {name}(cond, body, cond_consts, body_consts, init):
    """lax.while_loop for a predicate vmap batched: loop while any example's
    predicate holds; an example whose predicate is false keeps its carry."""
    def step(carry):
        pred = cond(*cond_consts, *carry)
        new = body(*body_consts, *carry)
        return tuple(lax.select(lax.broadcast_in_dim(pred, n.shape, tuple(range(pred.ndim))),
                                n, c) for n, c in zip(new, carry))
    return lax.while_loop(lambda carry: jnp.any(cond(*cond_consts, *carry)), step, init)'''


def _cond_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    branches = [g.function(b, "branch", "tuple") for b in eqn.params["branches"]]
    return f"lax.switch({', '.join([args[0], tuple_src(branches), *args[1:]])})"


def _jit_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    if not jit_inlining_loses_nothing(p):
        return None  # shardings, donation, ...: bind with the params as they are
    fn = g.function(p["jaxpr"], str(p.get("name", "jit")), "tuple",
                    py_name=str(p.get("name", "jit")))
    opts = [f"keep_unused={bool(p.get('keep_unused', False))!r}"]
    if p.get("inline") is True:  # (0.12's Inline enum defaults: left to jax.jit)
        opts.append("inline=True")
    return f"jax.jit({fn}, {', '.join(opts)})({', '.join(args)})"


def _remat_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    fn = g.function(p["jaxpr"], "checkpointed", "tuple")
    policy = g.param(p.get("policy"), "policy")
    return (f"jax.checkpoint({fn}, prevent_cse={bool(p.get('prevent_cse', True))!r}, "
            f"policy={policy})({', '.join(args)})")


def _shard_map_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = eqn.params
    known = {"mesh", "in_specs", "out_specs", "jaxpr", "check_vma", "check_rep",
             "newly_manual_axes", "manual_axes"}
    if not set(p) <= known:
        return None
    fn = g.function(p["jaxpr"], "shard_map_body", "tuple")
    axes = p.get("newly_manual_axes", p.get("manual_axes"))
    opts = [f"mesh={g.param(p['mesh'], 'mesh')}",
            f"in_specs={g.param(tuple(p['in_specs']), 'in_specs')}",
            f"out_specs={g.param(tuple(p['out_specs']), 'out_specs')}",
            f"check_vma={_jaxpr.shard_map_checks_vma(p)!r}"]
    if axes is not None:
        opts.append(f"axis_names={g.param(frozenset(axes), 'axis_names')}")
    return f"jax.shard_map({fn}, {', '.join(opts)})({', '.join(args)})"


def _call_rule(hint: str) -> Callable:
    def rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
        subs = _traverse.subjaxprs(eqn)
        if len(subs) != 1:
            return None
        fn = g.function(subs[0][1], hint, "tuple")
        return f"{fn}({', '.join(args)})"
    return rule


def _tag_rule(g: FunctionWriter, eqn: core.JaxprEqn, args: list[str]) -> str | None:
    p = _tag.user_params(eqn.params)
    tree = _tag.meta(eqn.params).tree
    if tree is None or _tag.meta(eqn.params) != _tag.TagMeta(tree=tree):
        return None  # kept / batched / guarded / scoped tags: bind as they are
    try:
        value = tree_src(jax.tree_util.tree_unflatten(tree, [Src(a) for a in args]))
    except NoSource:
        return None
    if not all(k.isidentifier() and not keyword.iskeyword(k) for k in p):
        return None
    kw = ", ".join(f"{k}={g.param(v, 'tag_' + k)}" for k, v in p.items())
    g.import_module("taxpr.tag")  # import taxpr
    call = f"taxpr.tag({value}{', ' + kw if kw else ''})"
    if tree.num_leaves == 1 and tree.num_nodes == 1:  # a single array
        return Single(call)
    return f"jax.tree_util.tree_leaves({call})"


def control_rules() -> dict:
    """The rules of higher-order primitives and tags, keyed by the primitive."""
    return {
        _compat.scan_p: _scan_rule,
        _compat.while_p: _while_rule,
        _compat.cond_p: _cond_rule,
        _compat.jit_p: _jit_rule,
        _compat.remat_p: _remat_rule,
        _compat.custom_jvp_call_p: _call_rule("custom_jvp_primal"),
        _compat.custom_vjp_call_p: _call_rule("custom_vjp_primal"),
        _compat.shard_map_p: _shard_map_rule,
        _tag.tag_p: _tag_rule,
        **{p: _call_rule("closed_call") for p in _compat.CLOSED_CALL_PRIMITIVES},
    }

"""One harvest run: trace the function, find the selected sows (also in
``custom_jvp`` rules), thread them with the engine, and return the
outputs, the reaped values and what was planted."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import equinox as eqx
import jax
import numpy as np
from .._jax.internals import core
from .._jax.internals import pe

from .. import _jaxpr
from .._engine import Engine, format_path
from .._find import dissolve_tags
from .._collector import collector_paused
from .._inject import split_arguments, trace_program
from ..primitives._tag import evaluated_fun, meta, tag_p
from ._checks import SowFilter, check_sows, display_name, is_sow, site_aval
from ._plants import (MISSING, PlantRows, lookup_plant, plant_for_feed, plant_value, SowSite,
                      stack_occurrences, strict_check, unflatten_value)
from ._sites import HarvestHooks, JvpRules, HarvestSites
from ._sow import RETYPE


def _flat_trace(fn: Callable, args, kwargs, retype: dict, select: "SowFilter"):
    """Trace ``fn``; while tracing, the sows named in ``retype`` produce the
    given types (added to those an enclosing plant's trace asked for).
    Leaves of the arguments that JAX can trace (arrays, Python and NumPy
    scalars) are traced, as oryx traces them; other leaves (an equinox
    module's activation function, a string) are static."""
    split = split_arguments(args, kwargs, eqx.is_array_like)
    token = RETYPE.set({**RETYPE.get(), **retype})
    try:
        closed, out_tree = trace_program(fn, split.tree,
                                         [_jaxpr.abstractify(x) for x in split.leaves],
                                         rebuild=split.rebuild, consumes=select)
    finally:
        RETYPE.reset(token)
    return closed, out_tree, split.leaves


def _nest_dict(flat: dict) -> dict:
    out: dict = {}
    for name, v in flat.items():
        if isinstance(name, tuple):
            d = out
            for part in name[:-1]:
                d = d.setdefault(part, {})
            d[name[-1]] = v
        else:
            out[name] = v
    return out


def _may_differentiate(values) -> bool:
    """Whether JAX may differentiate the program while a harvest evaluates
    it: some input is a tracer of a trace that is not plain jit staging
    (``jvp`` / ``grad`` / ``vmap`` / ..., conservatively)."""
    return any(isinstance(x, core.Tracer) and not isinstance(x, pe.DynamicJaxprTracer)
               for x in values)


def _find_sites(closed, select: SowFilter, tag_, rules: JvpRules) -> tuple[dict, list, set]:
    """The selected sows (first occurrence of each name), the names of all
    sows of ``tag_``, and the selected names found only in custom JVP rules."""
    sites: dict = {}
    all_names: dict = {}
    outside: set = set()
    for eqn, path, in_rule in rules.iter_eqns(closed):
        if eqn.primitive is not tag_p or not is_sow(eqn.params) or eqn.params["tag"] != tag_:
            continue
        all_names.setdefault(eqn.params["name"], None)
        if not in_rule:
            outside.add(eqn.params["name"])
        if select(eqn.params):
            mode, tree = eqn.params["mode"], meta(eqn.params).tree
            if mode == "cond_clobber":  # the tag holds (value, pred)
                tree = jax.tree_util.tree_structure(
                    jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves)[0])
            sites.setdefault(eqn.params["name"], SowSite(mode, site_aval(eqn), path, tree))
    return sites, list(all_names), set(sites) - outside


@dataclasses.dataclass(frozen=True)
class HarvestSpec:
    """What a harvest transformation (``reap``, ``plant``, ``harvest``,
    ``perturb``) was asked for: the arguments it shares."""

    tag: Any
    allowlist: Iterable | None
    blocklist: Iterable
    exclusive: bool
    strict: bool
    reaps: bool  # whether it returns reaped values
    perturb: bool = False  # plants are perturbations, added to the sown values


@collector_paused()
def run_harvest(fn: Callable, spec: HarvestSpec, plants: dict, args, kwargs):
    tag_, allowlist, blocklist = spec.tag, spec.allowlist, spec.blocklist
    strict, perturb = spec.strict, spec.perturb
    select = SowFilter(tag_, allowlist, blocklist)
    retype: dict = {}  # (tag, name) -> the types the sow takes (see _plant_fit)
    while True:
        closed, out_tree, leaves = _flat_trace(fn, args, kwargs, retype, select)
        rules = JvpRules(_may_differentiate([*leaves, *_jaxpr.jaxpr_parts(closed).consts,
                                              *jax.tree_util.tree_leaves(plants)]))
        sites, all_names, rule_only = _find_sites(closed, select, tag_, rules)
        for name in sites:  # oryx: a nest scope and a sow may not share a name
            if isinstance(name, tuple) and name[0] in sites:
                verb = "planted" if lookup_plant(plants, name[0]) is not MISSING else "reaped"
                raise ValueError(f"Variable has already been {verb}: {display_name(name[0])}")
        planted_values = {n: v for n in sites if (v := lookup_plant(plants, n)) is not MISSING}
        if strict:
            strict_check(tag_, all_names, allowlist, blocklist, plants, planted_values)
        ctx_plants, more = {}, {}
        for name, value in planted_values.items():
            site = sites[name]
            if isinstance(value, PlantRows) and perturb:
                raise ValueError(f"rows(...) given as the perturbation of '{display_name(name)}': a "
                                 f"perturbation is added to every row; give the whole stack")
            if isinstance(value, PlantRows) and site.mode != "append":
                raise ValueError(f"rows(...) planted for '{display_name(name)}', but its sow at "
                                 f"{format_path(site.path)} is in {site.mode!r} mode; rows "
                                 f"select rows of an 'append' sow's stack")
            if site.mode == "append":
                continue
            # A sow already re-traced keeps its type: a mismatch now is an error.
            # A perturbation is added to the sown value: it never retypes it.
            fitted, types = plant_value(name, value, site,
                                         (tag_, name) not in retype and not perturb,
                                         "Perturbation" if perturb else "Planted value")
            if types is not None:
                more[(tag_, name)] = types
            ctx_plants[name] = fitted
        if not more:
            break
        retype.update(more)
    planted = {n: sites[n].mode for n in planted_values}
    partial = frozenset(n for n, v in planted_values.items() if isinstance(v, PlantRows))
    reaped = {n: s.mode for n, s in sites.items() if n not in planted} if spec.reaps else {}
    # Only the sows this call transforms are rewritten (the others stay, for
    # an enclosing harvest) and follow oryx's static rules.
    transformed = SowFilter(tag_, allowlist, blocklist)
    transformed.allow = set(planted) | set(reaped)
    check_sows(closed, select, set(transformed.allow),
           lambda name: "planted" if name in planted else "reaped")

    # ctx: carried reaps (zeros first) and planted non-append values.
    ctx_leaves, ctx_index = [], {}
    for name, mode in reaped.items():
        if mode != "append":
            avals = sites[name].avals
            ctx_index[("reap", name)] = list(range(len(ctx_leaves), len(ctx_leaves) + len(avals)))
            ctx_leaves.extend(np.zeros(a.shape, a.dtype) for a in avals)
    for name, value in ctx_plants.items():
        ctx_index[("plant", name)] = list(range(len(ctx_leaves), len(ctx_leaves) + len(value)))
        ctx_leaves.extend(value)
    ctx_avals = [_jaxpr.abstractify(x) for x in ctx_leaves]
    site_rule = HarvestSites(reaped, planted, ctx_index, partial, perturb)
    site_rule.rule_only = rule_only
    engine = Engine(site_rule, transformed, ctx_avals, HarvestHooks(site_rule, rules))
    threaded = engine.thread_jaxpr(closed, (), 0, len(_jaxpr.jaxpr_parts(closed).outvars))
    if spec.exclusive:
        threaded = dissolve_tags(threaded, lambda p, s: is_sow(p))
    chans = engine.channels(threaded)
    feeds = []
    for key, avals in chans.feeds:
        feeds.extend(plant_for_feed(key, avals, planted_values, sites, chans.feeds))
    outs = evaluated_fun(threaded)(*ctx_leaves, *leaves, *feeds)
    n_out = out_tree.num_leaves
    out = jax.tree_util.tree_unflatten(out_tree, outs[:n_out])
    ctx_out = outs[n_out:n_out + len(ctx_leaves)]
    collected = outs[n_out + len(ctx_leaves):]
    reaps = {}
    for name, mode in reaped.items():
        if mode != "append":
            vals = [ctx_out[i] for i in ctx_index[("reap", name)]]
            reaps[name] = unflatten_value(sites[name], vals)
    appended: dict = {}
    it = iter(collected)
    for key, avals in chans.collects:
        vals = [next(it) for _ in avals]
        appended.setdefault(key.site.name, []).append((key, vals))
    for name, items in appended.items():
        stacked = [stack_occurrences([v[i] for _, v in items], [k for k, _ in items])
                   for i in range(len(items[0][1]))]
        reaps[name] = unflatten_value(sites[name], stacked)
    # oryx: a sow in a custom JVP rule is reaped only when the rule ran (JAX
    # differentiated the call while this harvest evaluated it).
    for name in rule_only & set(reaps):
        if name not in site_rule.rewritten:
            del reaps[name]
    for name, mode in reaped.items():  # append sows that never ran (e.g. zero-length scan)
        if mode == "append" and name not in reaps and name not in rule_only:
            reaps[name] = unflatten_value(
                sites[name], [np.zeros((0, *a.shape), a.dtype) for a in sites[name].avals])
    return out, _nest_dict(reaps)

"""Insert harvest sows at selected sites of a traced program.

Each selected equation output gets a ``sow`` of the capture tag right
after the equation (its uses read the sow's output), in the mode that
gives eager semantics where it sits:

* outside loops: ``clobber`` (``cond_clobber`` in a ``cond`` branch: the
  value where the branch ran, zeros where it did not);
* inside a ``scan``: ``append``, one row per iteration (nested scans stack
  outer first);
* inside a ``while_loop``: the last iteration's value (``clobber`` /
  ``cond_clobber``; zeros if the loop ran no iteration).

A sow in one branch of a ``cond`` gets a placeholder sow of zeros in its
other branches (``sow_cond(..., False)`` / an ``append`` of zeros), so
that every branch sows the same names, as harvest requires. A patch by a
function inlines the function after the site; the arrays it closes over
are planted into sows of their own (so a closed-over tracer of an outer
``grad`` or ``vmap`` flows in as JAX would have it).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Sequence

import jax
import numpy as np
from .._jax.internals import core

from .. import _compat, _jaxpr, _traverse
from ..harvest._sow import sow, sow_cond
from ..primitives._tag import keep_tags, tag, tag_p
from . import _carry, _rules
from ._sites import Site


class _CaptureTag:
    """The harvest tag of the sows capture and patch insert (never a user's)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "taxpr.capture"

    def describe_sow(self, name: str) -> str:
        """How an error names the site of a sow of this tag."""
        return f"the site {name.partition('|')[0]!r}"


CAPTURE_TAG = _CaptureTag()


def sow_mode(site: Site) -> str:
    """The mode that gives ``site``'s value eager semantics (module docstring)."""
    if site.loops and all(loop.kind == "scan" for loop in site.loops):
        return "append"
    return "cond_clobber" if site.in_cond else "clobber"


def const_mode(site: Site) -> str:
    """The mode of a sow that carries one planted value to ``site``."""
    return "cond_clobber" if site.in_cond else "clobber"


@dataclasses.dataclass(frozen=True)
class Insertion:
    """What to insert after one equation output: ``build(var) -> fragment``,
    a function of the output's value traced into the program, at ``site``;
    ``changes`` says whether the fragment changes the value (a patch) or
    only records it (a capture)."""

    output: int
    build: Callable[[Any], Any]
    site: Site
    changes: bool = False
    # The loops (their equations' ordinals, outermost first) the value is
    # carried out of before ``build`` applies, where a sow inside them has no
    # mode giving its semantics (a while_loop inside a scan: per scan row,
    # the loop's last value): a scan stacks it, a while_loop keeps the last.
    carried_out_of: tuple[int, ...] = ()
    # The user's function of a patch by function (None for a patch by value
    # or a capture): a derivative rule evaluating the site again is given
    # the same patch (``_carry``).
    patch_fn: Callable[[Any], Any] | None = None


def _sow_as(value: Any, name: str, mode: str) -> Any:
    if mode == "cond_clobber":
        return sow_cond(value, True, tag=CAPTURE_TAG, name=name)
    return sow(value, tag=CAPTURE_TAG, name=name, mode=mode)


# The tag param that marks a value recorded row by row inside a while loop
# (``rows_insertion``), rewritten by ``inject`` into a write to a buffer.
ROWS_PARAM = "taxpr_capture_rows"


def rows_insertion(site: Site) -> Insertion:
    """A tag that ``inject`` rewrites into a write of the value to the next
    row of the site's buffer (``_api``'s ``loop_rows``)."""
    return Insertion(site.output, lambda v: tag(v, **{ROWS_PARAM: site.name}), site)


def capture_insertion(site: Site, changes: bool = False) -> Insertion:
    """A sow of ``site``'s value (``changes``: a value is planted into it)."""
    mode = sow_mode(site)
    return Insertion(site.output, lambda v: _sow_as(v, site.name, mode), site, changes)


def carried_capture_insertion(site: Site) -> Insertion:
    """A capture of a value inside loops of both kinds: carried out of the
    innermost loops until those around are of one kind, then sown there
    (``sow_mode`` of those)."""
    kinds = [loop.kind for loop in site.loops]
    keep = 1
    while keep < len(kinds) and kinds[keep] == kinds[0]:
        keep += 1
    loops = [(o, p) for o, p in site.enclosing if p in (_compat.scan_p, _compat.while_p)]
    inner = site.enclosing[-(len(kinds) - keep):]
    if loops[keep:] != list(inner):
        raise NotImplementedError(
            f"taxpr.capture: site {site.name!r} is inside loops of both kinds (at "
            f"{'/'.join(site.path)}) with other primitives between them: capture can carry "
            f"a value out of loops nested directly in one another only. Select a value "
            f"outside the inner loop")
    mode = ("append" if kinds[0] == "scan" else
            "cond_clobber" if site.in_cond else "clobber")
    return Insertion(site.output, lambda v: _sow_as(v, site.name, mode), site,
                     carried_out_of=tuple(o for o, _ in inner))


def needs_carrying(site: Site) -> bool:
    """Whether ``site`` is inside loops of both kinds (see
    ``carried_capture_insertion``)."""
    return len({loop.kind for loop in site.loops}) > 1


def patch_insertion(site: Site, fn: Callable[[Any], Any], mark: bool = False
                    ) -> tuple[Insertion, dict]:
    """The insertion applying ``fn`` at ``site`` and the values to plant
    (the arrays ``fn`` closes over, each into a sow of its own); ``mark``:
    the patched value is marked for an enclosing ``capture``."""
    aval = site.aval
    with keep_tags():
        traced = _jaxpr.trace_flat(lambda v: [fn(v)], [aval], name="patch")
    out_aval = _jaxpr.jaxpr_parts(traced).outvars[0].aval
    if (tuple(out_aval.shape), out_aval.dtype) != (tuple(site.shape), site.dtype):
        raise ValueError(
            f"taxpr.patch: the function patching site {site.name!r} returns "
            f"{out_aval.str_short()}; the site holds {aval.str_short()} (a patch must keep "
            f"the value's shape and dtype)")
    jaxpr, consts = _jaxpr.open_with_constvars(traced)
    names = [f"{site.name}|const{i}" for i in range(len(consts))]
    mode = const_mode(site)

    def build(v):
        cs = [_sow_as(jax.lax.full(np.shape(c), 0, c.dtype), n, mode)
              for c, n in zip(consts, names)]
        out = core.eval_jaxpr(jaxpr, cs, v)[0]
        return patched_marker(out, site) if mark else out

    return (Insertion(site.output, build, site, True, patch_fn=fn),
            dict(zip(names, consts)))


# The tag param marking a site's value after a patch: ``capture`` of a
# patched program selects it for the site of that name (a user checking a
# patch sees the patched value). Only a patch traced inside a taxpr
# transformation is marked (``keeping_tags()``): elsewhere nothing would
# consume the mark.
PATCHED_PARAM = "taxpr_patched"


def patched_marker(value: Any, site: Site) -> Any:
    return tag(value, **{PATCHED_PARAM: site.name})


def patch_value_insertion(site: Site, mark: bool = False) -> Insertion:
    """A sow of ``site``'s value that a planted array replaces (``mark``: as
    ``patch_insertion``)."""
    mode = sow_mode(site)

    def build(v):
        out = _sow_as(v, site.name, mode)
        return patched_marker(out, site) if mark else out
    return Insertion(site.output, build, site, True)


def patched_sites(closed: Any) -> dict[str, int]:
    """``{site name: ordinal}`` of the patched-value markers in ``closed``
    (a program ``tx.patch`` rewrote), in ``_traverse.walk``'s order."""
    found: dict[str, int] = {}
    for ordinal, (eqn, _, _) in enumerate(_traverse.walk(closed)):
        if eqn.primitive is tag_p and PATCHED_PARAM in eqn.params:
            found.setdefault(eqn.params[PATCHED_PARAM], ordinal)
    return found


def _fragment(build: Callable[..., Any], in_atoms: Sequence[Any]) -> tuple[list, Any]:
    """The equations of ``build`` traced at the types of ``in_atoms``, reading
    them; and the atom of its result."""
    avals = [a.aval for a in in_atoms]
    with keep_tags():
        closed = _jaxpr.trace_flat(lambda *a: [build(*a)], avals, name="capture")
    parts = _jaxpr.jaxpr_parts(closed)
    env: dict = dict(zip(parts.invars, in_atoms))
    for cv, c in zip(parts.constvars, parts.consts):
        if np.ndim(c) != 0 or isinstance(c, core.Tracer):
            raise AssertionError(f"taxpr: an inserted sow captured a constant {c!r}")
        env[cv] = _jaxpr.literal(c, cv.aval)
    eqns = [e.replace(invars=[env.get(v, v) if type(v) is core.Var else v for v in e.invars])
            for e in parts.eqns]
    out = parts.outvars[0]
    return eqns, env.get(out, out) if type(out) is core.Var else out


def _bound_at(eqns: list, site_eqn: core.JaxprEqn) -> list:
    """``eqns`` (a fragment inserted after ``site_eqn``) with the site's
    traceback: what code bound them is the site's (a site in code that
    another equation keeps for its rules is known by it, ``_expand``)."""
    tb = site_eqn.source_info.traceback
    return [e.replace(source_info=e.source_info.replace(traceback=tb)) for e in eqns]


def insert(closed: Any, plan: dict[int, list[Insertion]]) -> Any:
    """``closed`` with ``plan[ordinal]``'s fragments after the equation at
    that place of ``_traverse.walk``'s order (``Site.ordinal``)."""
    counter = itertools.count()
    walked = [0]  # how many equations the walk has passed
    # Loops values are carried out of: ordinal -> the insertions carried
    # through it; and while a loop's body is rewritten, the values its body
    # hands out (``carried``: a stack, one list per loop being rewritten).
    carrying: dict[int, list[Insertion]] = {}
    for items in plan.values():
        for item in items:
            for o in item.carried_out_of:
                carrying.setdefault(o, []).append(item)
    carried: list[list] = []
    family: list = []  # the custom calls rewritten (``_rules.with_carrying_rules``)

    def rewrite(eqn, path, env):
        ordinal = next(counter)
        walked[0] = ordinal + 1
        if eqn.primitive is _compat.cond_p:
            return _rewrite_cond(eqn, path, env, rewrite)
        if ordinal in carrying:
            return _rewrite_carrying_loop(eqn, path, env, rewrite, ordinal, carried)
        if eqn.primitive in _rules.RULES_OF:
            # the function's equations are the next ones of the walk
            new_eqn, call_after = _rewrite_subjaxprs(eqn, path, env, rewrite)
            if call_after is None:  # (a replacement all the same: map_jaxpr
                return [new_eqn]    # must not walk the function again)
            sites = tuple(i for o in range(ordinal + 1, walked[0]) for i in plan.get(o, ()))
            return [_rules.with_carrying_rules(new_eqn, eqn, call_after, sites, path, family)]
        todo = plan.get(ordinal)
        if todo is None:
            return None
        eqn = eqn.replace(invars=[_traverse._sub(env, v) for v in eqn.invars])
        if any(item.changes for item in todo):
            # Evaluated again inside a rule that carries patches, the site
            # and its patch are not patched a second time.
            eqn = _carry.marked_carried(eqn)
        out = [eqn]
        for item in todo:
            v = eqn.outvars[item.output]
            if item.carried_out_of:  # handed to the loop around, sown after it
                carried[-1].append((item, env.get(v, v)))
                continue
            frag, new = _fragment(item.build, [v])
            frag = _bound_at(frag, eqn)
            out.extend(map(_carry.marked_carried, frag) if item.changes else frag)
            env[v] = new
        return out

    return _traverse.map_jaxpr(closed, rewrite)


def _rewrite_carrying_loop(eqn, path, env, rewrite, ordinal: int, carried: list) -> list:
    """A scan / while_loop whose body hands values out (``carried``): each
    becomes one more output (a scan's stacked ``ys``, a while_loop's carry,
    zeros before the first iteration); then it is handed to the loop around
    or, at the outermost loop it is carried out of, sown."""
    carried.append([])
    eqn, _ = _rewrite_subjaxprs(eqn, path, env, rewrite)
    handed = carried.pop()
    if not handed:
        return [eqn]
    before: list = []
    values = [v for _, v in handed]
    if eqn.primitive is _compat.scan_p:
        body = eqn.params["jaxpr"]
        length = int(eqn.params["length"])
        outs = [_jaxpr.new_var(v.aval.update(shape=(length, *v.aval.shape))) for v in values]
        n_consts, n_carry = _jaxpr.scan_counts(eqn.params)
        eqn = _traverse.with_subjaxprs(eqn, {("jaxpr", None): _with_outputs(body, [], values)})
        eqn = eqn.replace(params=_jaxpr.scan_params(
            eqn.params, n_consts, n_carry, len(eqn.invars) - n_consts - n_carry,
            len(eqn.outvars) - n_carry + len(values)))
    else:
        cond, body = eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]
        inits = []
        for v in values:
            frag, zeros = _fragment(lambda a=v.aval: jax.lax.full(a.shape, 0, a.dtype), [])
            before.extend(frag)
            inits.append(zeros)
        carry_in = [_jaxpr.new_var(v.aval) for v in values]
        eqn = _traverse.with_subjaxprs(eqn, {
            ("body_jaxpr", None): _with_outputs(body, carry_in, values),
            ("cond_jaxpr", None): _with_outputs(cond, [_jaxpr.new_var(v.aval) for v in values],
                                                []),
        })
        eqn = eqn.replace(invars=[*eqn.invars, *inits])
        outs = [_jaxpr.new_var(v.aval) for v in values]
    eqn = eqn.replace(outvars=[*eqn.outvars, *outs])
    after: list = []
    for (item, _), out in zip(handed, outs):
        if item.carried_out_of[0] == ordinal:  # the outermost: sown here
            after.extend(_fragment(item.build, [out])[0])
        else:
            carried[-1].append((item, out))
    return [*before, eqn, *after]


def _with_outputs(closed: Any, invars: list, outvars: list) -> Any:
    """``closed`` with ``invars`` added after its inputs and ``outvars``
    after its outputs."""
    parts = _jaxpr.jaxpr_parts(closed)
    return _jaxpr.make_jaxpr_like(closed, parts.constvars, parts.consts or [],
                                  [*parts.invars, *invars], parts.eqns,
                                  [*parts.outvars, *outvars], parts.effects, parts.debug_info)


def _sows_in(jaxpr: Any) -> dict[str, tuple[str, Any]]:
    """The capture sows in ``jaxpr`` (any depth, outside nested loops'
    own branches too): name -> (mode, value aval)."""
    found: dict = {}
    for eqn, _ in _traverse.iter_eqns(jaxpr):
        if eqn.primitive is tag_p and eqn.params.get("tag") is CAPTURE_TAG:
            found.setdefault(eqn.params["name"], (eqn.params["mode"], eqn.invars[0].aval))
    return found


def _rewrite_cond(eqn, path, env, rewrite):
    """A cond whose branches are rewritten first (in the walk's order);
    then each branch gets placeholder sows for the names others sow."""
    new = {}
    branches = []
    for sub, sj in _traverse.subjaxprs(eqn):
        nj = _traverse.map_jaxpr(sj, rewrite, path + (sub.label,))
        branches.append((sub, nj))
        if nj is not sj:
            new[(sub.key, sub.index)] = nj
    # Harvest compares the sows of branches in order: a name sown in branch
    # j gets placeholders before the own sows of the branches after j, and
    # after those of the branches before j.
    sown = [_sows_in(nj) for _, nj in branches]
    first: dict = {}  # name -> (branch that sows it first, mode, aval)
    for j, have in enumerate(sown):
        for name, how in have.items():
            first.setdefault(name, (j, how))
    if first:
        for j, ((sub, nj), have) in enumerate(zip(branches, sown)):
            before = {n: how for n, (k, how) in first.items() if k < j and n not in have}
            after = {n: how for n, (k, how) in first.items() if k > j and n not in have}
            if before or after:
                new[(sub.key, sub.index)] = _with_placeholders(nj, before, after)
    # Always a replacement: map_jaxpr must not walk the branches again.
    if new:
        eqn = _traverse.with_subjaxprs(eqn, new)
    return [eqn.replace(invars=[_traverse._sub(env, v) for v in eqn.invars])]


def _with_placeholders(branch: Any, before: dict, after: dict) -> Any:
    """``branch`` with a sow of zeros, not taken, for each name of
    ``before`` (first) and of ``after`` (last)."""
    parts = _jaxpr.jaxpr_parts(branch)
    eqns = _placeholders(before) + list(parts.eqns) + _placeholders(after)
    effects = _traverse.recompute_effects(parts.effects, parts.eqns, eqns)
    return _jaxpr.make_jaxpr_like(branch, parts.constvars, parts.consts or [], parts.invars,
                                  eqns, parts.outvars, effects, parts.debug_info)


def _placeholders(names: dict) -> list:
    eqns: list = []
    for name, (mode, aval) in names.items():
        def build(name=name, mode=mode, aval=aval):
            zeros = jax.lax.full(aval.shape, 0, aval.dtype)
            if mode == "cond_clobber":
                return sow_cond(zeros, False, tag=CAPTURE_TAG, name=name)
            return sow(zeros, tag=CAPTURE_TAG, name=name, mode=mode)
        eqns.extend(_fragment(build, [])[0])
    return eqns


def _rewrite_subjaxprs(eqn, path, env, rewrite):
    """An equation with its sub-jaxprs rewritten first (in the walk's order;
    a custom call's function, a loop's body): ``(the new equation, its new
    ``call_jaxpr`` or None if that is unchanged)``."""
    new = {}
    for sub, sj in _traverse.subjaxprs(eqn):
        nj = _traverse.map_jaxpr(sj, rewrite, path + (sub.label,))
        if nj is not sj:
            new[(sub.key, sub.index)] = nj
    if new:
        eqn = _traverse.with_subjaxprs(eqn, new)
    return (eqn.replace(invars=[_traverse._sub(env, v) for v in eqn.invars]),
            new.get(("call_jaxpr", None)))

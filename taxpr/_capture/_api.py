"""``sites`` / ``capture`` / ``patch`` / ``perturb``: intermediates of code you did not write."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple

import jax
import numpy as np

from .. import _jaxpr
from .._collector import collector_paused
from .._inject import inject, split_arguments, trace_program
from ..primitives._tag import evaluated_fun, keeping_tags
from ..harvest import _transforms as _harvest
from .._engine import format_path
from ..harvest._plants import PlantRows
from ..harvest._sites import PerShardReapError
from . import _rewrite, _sites
from ._select import SelectorLike, select
from ._sites import Site


class Traced:
    """``fn`` traced at the arrays among its arguments (other leaves are
    static, as ``equinox.filter_jit`` and ``uncurry`` treat them)."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict):
        split = split_arguments(args, kwargs)
        self.leaves = split.leaves
        self.closed, self.out_tree = trace_program(
            fn, split.tree, [_jaxpr.abstractify(x) for x in self.leaves],
            name=getattr(fn, "__name__", "fn"), rebuild=split.rebuild)
        self.sites = _sites.list_sites(self.closed)

    def run(self, rewritten: Any) -> Callable:
        """``rewritten`` (this program with sows inserted) as a function of
        the dynamic leaves returning the flat outputs."""
        fun = evaluated_fun(rewritten)
        return lambda *leaves: list(fun(*leaves))

    def unflatten(self, outs) -> Any:
        return jax.tree_util.tree_unflatten(self.out_tree, list(outs))


def sites(fn: Callable, *args: Any, **kwargs: Any) -> tuple[Site, ...]:
    """Every value of ``fn(*args, **kwargs)`` that ``capture`` and ``patch``
    can select, in program order.

    Arguments:
        fn: any JAX function (a flax ``apply``, an equinox module, a solver),
            or a traced program (a closed jaxpr, e.g. from ``jax.make_jaxpr``),
            then given no arguments.
        *args, **kwargs: example arguments (arrays or ``jax.ShapeDtypeStruct``
            are traced; other leaves are static).

    Returns:
        A tuple of ``taxpr.Site``: each has a unique ``name``, its ``scope``,
        ``primitive``, ``shape``, ``dtype``, ``source``, the ``loops``
        around it and the scopes it ``leaves``.
    """
    if _jaxpr.is_jaxpr(fn):
        if args or kwargs:
            raise TypeError("taxpr.sites: a traced program takes no arguments")
        return _sites.list_sites(fn)
    args, kwargs = jax.tree_util.tree_map(
        lambda x: jax.numpy.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct)
        else x, (args, kwargs))
    return Traced(fn, args, kwargs).sites


def _check_sow_mode(site: Site, what: str) -> None:
    if _rewrite.sow_mode(site) == "append" and site.scan_in_cond:
        raise NotImplementedError(
            f"taxpr.{what}: site {site.name!r} is inside a scan inside a branch of a "
            f"cond/switch (at {'/'.join(site.path)}): its rows exist only where the branch "
            f"runs, which capture cannot stack yet. Select a value outside that cond")


class LoopRows(NamedTuple):
    """A value captured inside a ``while_loop`` with ``loop_rows=n``: the
    value each time it was computed, in order, in ``rows[:count]`` (rows
    past ``count`` are zeros; computations past ``n`` are counted, not
    kept)."""

    rows: Any
    count: Any


def capture(fn: Callable, *selectors: SelectorLike, loop_rows: int | None = None) -> Callable:
    """``fn`` that also returns the values of the selected sites.

    Arguments:
        fn: any JAX function.
        *selectors: globs over site names (``"MLP/*/add"``), predicates over
            ``taxpr.Site``, or ``taxpr.select`` helpers. Each must match at
            least one site.
        loop_rows: for values computed inside a ``while_loop`` (whose number
            of iterations is known only when it runs): keep up to this many
            of them, in order, as a ``LoopRows``. Default: the last one.

    Returns:
        ``wrapped(*args, **kwargs) -> (out, {site.name: value})``. A value
        computed inside a ``scan`` is stacked, one row per iteration; inside
        a ``while_loop`` it is the last iteration's (zeros if none ran), or
        a ``LoopRows`` with ``loop_rows``; in a ``cond`` branch, the value
        where the branch ran (zeros where it did not). Under ``vmap`` values
        are batched. ``wrapped`` composes with ``jit``, ``grad`` and ``vmap``.

    Raises:
        ValueError: a selector matches no site (the message lists the
            nearest names).
    """
    if not selectors:
        raise TypeError("taxpr.capture: give at least one selector")
    if loop_rows is not None and (not isinstance(loop_rows, int) or loop_rows < 1):
        raise ValueError(f"taxpr.capture: loop_rows must be a positive int, not {loop_rows!r}")

    @functools.wraps(fn, updated=())
    @collector_paused()
    def wrapped(*args, **kwargs):
        traced = Traced(fn, args, kwargs)
        chosen: dict[str, Site] = {}
        patched = _rewrite.patched_sites(traced.closed)
        for sel in selectors:
            for site in select(traced.sites, sel, "capture"):
                _check_sow_mode(site, "capture")
                if site.name in patched:  # (a patched program: its value after the patch)
                    site = dataclasses.replace(site, ordinal=patched[site.name], output=0)
                chosen.setdefault(site.name, site)
        plan: dict[int, list] = {}
        buffers: dict[str, tuple] = {}  # site name -> (rows, count), for loop_rows
        for site in chosen.values():
            if loop_rows is not None and any(loop.kind == "while_loop" for loop in site.loops):
                insertion = _rewrite.rows_insertion(site)
                buffers[site.name] = (np.zeros((loop_rows, *site.shape), site.dtype),
                                      np.zeros((), np.int32))
            elif _rewrite.needs_carrying(site):
                insertion = _rewrite.carried_capture_insertion(site)
            else:
                insertion = _rewrite.capture_insertion(site)
            plan.setdefault(site.ordinal, []).append(insertion)
        rewritten = _rewrite.insert(traced.closed, plan)
        run = traced.run(rewritten)
        if buffers:
            run = _with_row_buffers(rewritten, buffers)
        try:
            outs, reaped = _harvest.call_and_reap(run, tag=_rewrite.CAPTURE_TAG)(*traced.leaves)
        except PerShardReapError as e:
            raise ValueError(
                f"taxpr.capture: site {e.name!r} at {format_path(e.path)} holds a value that "
                f"differs across the shards of a shard_map, and a capture outside the "
                f"shard_map gets one value for the whole mesh: capture inside the body "
                f"(tx.capture of the body function) and return the values through out_specs "
                f"(stacked per shard)") from e
        n_out = traced.out_tree.num_leaves
        values = {}
        if buffers:
            tree = jax.tree_util.tree_structure(buffers)
            after = jax.tree_util.tree_unflatten(tree, outs[n_out:])
            values = {name: LoopRows(*after[name]) for name in buffers}
        values.update({name: reaped[name] for name in chosen if name not in buffers})
        return traced.unflatten(outs[:n_out]), {name: values[name] for name in chosen}

    return wrapped


def _with_row_buffers(rewritten: Any, buffers: dict) -> Callable:
    """``rewritten`` with each rows tag writing its value to the next row of
    its buffer (threaded by ``inject`` through every loop and branch), as a
    function of the dynamic leaves returning the outputs, then the buffers."""

    def write(ctx, value, params):
        name = params[_rewrite.ROWS_PARAM]
        rows, count = ctx[name]
        # past the last row, the write is dropped and only counted
        return value, {**ctx, name: (rows.at[count].set(value, mode="drop"), count + 1)}

    injected = inject(rewritten, write, buffers,
                      predicate=lambda params, shape: _rewrite.ROWS_PARAM in params)
    fun = evaluated_fun(injected)
    initial = jax.tree_util.tree_leaves(buffers)
    return lambda *leaves: list(fun(*initial, *leaves))


def patch(fn: Callable, patches: Mapping[SelectorLike, Any]) -> Callable:
    """``fn`` with the values of selected sites replaced.

    Arguments:
        fn: any JAX function.
        patches: ``{selector: replacement}``. A replacement is an array (the
            value; inside a ``scan`` the stack of every iteration's, or
            ``taxpr.harvest.rows({i: value})`` for selected iterations) or a
            function ``value -> value`` applied where the value is computed
            (per iteration inside loops, per example under ``vmap``). The
            arrays a function closes over may be tracers of an enclosing
            ``grad`` / ``vmap``: the patch is differentiable in them.

    Returns:
        ``wrapped(*args, **kwargs) -> out``.

    Raises:
        ValueError: a selector matches no site, or a replacement's shape or
            dtype differs from the site's (the messages name the site).
    """
    items = list(patches.items())

    @functools.wraps(fn, updated=())
    @collector_paused()
    def wrapped(*args, **kwargs):
        traced = Traced(fn, args, kwargs)
        plan: dict[int, list] = {}
        planted: dict[str, Any] = {}
        taken: dict[str, Any] = {}
        mark = keeping_tags()  # (traced inside capture: marked for it)
        for sel, replacement in items:
            by_function = callable(replacement) and not isinstance(replacement, PlantRows)
            for site in select(traced.sites, sel, "patch"):
                if not by_function:  # (a function's constants are planted whole)
                    _check_sow_mode(site, "patch")
                if site.name in taken:
                    raise ValueError(
                        f"taxpr.patch: site {site.name!r} is selected by both "
                        f"{taken[site.name]!r} and {sel!r}")
                taken[site.name] = sel
                if not by_function:
                    _check_replacement(site, sel, replacement)
                if by_function or _rewrite.sow_mode(site) != "append":
                    # Outside a scan a value is the same wherever the site is
                    # evaluated: the function returning it, which a custom
                    # rule evaluating the site again is given too (its arrays
                    # are planted as a function's constants are).
                    patch_fn = replacement if by_function else _returning(replacement)
                    insertion, consts = _rewrite.patch_insertion(site, patch_fn, mark)
                    planted.update(consts)
                else:
                    insertion = _rewrite.patch_value_insertion(site, mark)
                    planted[site.name] = replacement
                plan.setdefault(site.ordinal, []).append(insertion)
        rewritten = _rewrite.insert(traced.closed, plan)
        outs = _harvest.plant(traced.run(rewritten), tag=_rewrite.CAPTURE_TAG)(
            planted, *traced.leaves)
        return traced.unflatten(outs)

    return wrapped


def _returning(value: Any) -> Callable[[Any], Any]:
    """The patch function of a patch by value (outside a scan)."""
    return lambda v: jax.numpy.asarray(value, v.dtype)


def _check_replacement(site: Site, sel: Any, replacement: Any) -> None:
    """A patch's array (or ``rows``) must fit ``site``: checked here, so that
    the error speaks of the site and its selector (a patch is planted into
    sows the user never wrote)."""
    scans = [loop.length for loop in site.loops] if _rewrite.sow_mode(site) == "append" else []
    where = f"site {site.name!r} (selected by {sel!r})"
    what = (f"{jax.numpy.dtype(site.dtype).name}{list(site.shape)}" +
            (f", one per iteration of the scan{'s' if len(scans) > 1 else ''} around it: "
             f"{jax.numpy.dtype(site.dtype).name}{[*scans, *site.shape]}" if scans else ""))
    if isinstance(replacement, PlantRows):
        if not scans:
            raise ValueError(f"taxpr.patch: rows(...) given for {where}, which is not inside a "
                             f"scan: replace its value by an array of {what}, or by a function")
        for i, value in (replacement.index_values or {}).items():
            if not 0 <= i < scans[0]:
                raise ValueError(f"taxpr.patch: rows(...) for {where}: row {i} is out of "
                                 f"range; the scan around it has {scans[0]} iterations")
            want = (*scans[1:], *site.shape)
            if tuple(np.shape(value)) != want:
                raise ValueError(f"taxpr.patch: rows(...) for {where}: row {i} has shape "
                                 f"{list(np.shape(value))}; a row of the site holds "
                                 f"{jax.numpy.dtype(site.dtype).name}{list(want)}")
        return
    want = (*scans, *site.shape)
    shape = tuple(np.shape(replacement))
    python_scalar = isinstance(replacement, (bool, int, float, complex))
    dtype = None if python_scalar else jax.numpy.result_type(replacement)
    if shape != want or (dtype is not None and dtype != site.dtype):
        got = f"{'Python scalar' if python_scalar else dtype.name}{list(shape)}"
        raise ValueError(f"taxpr.patch: the replacement of {where} is {got}; the site holds "
                         f"{what} (give an array of that type, or a function of the value)")


def perturb(fn: Callable, *selectors: SelectorLike) -> Callable:
    """``fn`` with perturbations added to the selected values: the gradient
    of the output with respect to intermediates, in one backward pass.

    Arguments:
        fn: any JAX function.
        *selectors: as for ``capture``; each must match at least one site.

    Returns:
        ``wrapped(perturbations, *args, **kwargs) -> out``: ``perturbations``
        maps site names to arrays of the captured values' shapes (inside a
        ``scan``, the stack: row ``i`` is added to iteration ``i``'s value;
        a name left out is not perturbed). The gradient with respect to
        zero perturbations is d out / d value, per row::

            acts = tx.capture(loss, "layer/*")(x)[1]
            zeros = {name: jnp.zeros_like(v) for name, v in acts.items()}
            d_acts, d_x = jax.grad(tx.perturb(loss, "layer/*"), argnums=(0, 1))(zeros, x)

    Raises:
        ValueError: a selector matches no site, or a perturbation's shape or
            dtype differs from its value's (the messages name the site).
    """
    if not selectors:
        raise TypeError("taxpr.perturb: give at least one selector")

    def wrapped(perturbations, *args, **kwargs):
        traced = Traced(fn, args, kwargs)
        plan: dict[int, list] = {}
        chosen: set = set()
        for sel in selectors:
            for site in select(traced.sites, sel, "perturb"):
                _check_sow_mode(site, "perturb")
                if site.name not in chosen:
                    chosen.add(site.name)
                    plan.setdefault(site.ordinal, []).append(_rewrite.capture_insertion(site))
        unknown = set(perturbations) - chosen
        if unknown:
            raise ValueError(f"taxpr.perturb: perturbations of {sorted(unknown)}, which the "
                             f"selectors do not select (they select {sorted(chosen)})")
        rewritten = _rewrite.insert(traced.closed, plan)
        outs = _harvest.perturb(traced.run(rewritten), tag=_rewrite.CAPTURE_TAG)(
            dict(perturbations), *traced.leaves)
        return traced.unflatten(outs)

    return functools.wraps(fn, updated=())(wrapped)

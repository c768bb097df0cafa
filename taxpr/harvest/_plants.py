"""Planted values: looking them up by name, checking their structure, shape
and dtype against the sow, and ``rows`` for planting selected rows of an
``append`` sow."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from .._jax.internals import core

from .. import _jaxpr
from .._engine import format_path
from ._checks import display_name


MISSING = object()


def lookup_plant(plants: dict, name: Any) -> Any:
    """``plants[name]``, or for a nested name ``plants[s1][s2]...``."""
    if not isinstance(name, tuple):
        return (plants or {}).get(name, MISSING)
    d = plants or {}
    for part in name:
        if not isinstance(d, dict) or part not in d:
            return MISSING
        d = d[part]
    return d


def _plant_names(plants: dict, site_names) -> list:
    """The names a plants dict gives values for (a nest scope's dict is
    descended into; any other value is one name's value)."""
    scopes = {n[:i] for n in site_names if isinstance(n, tuple) for i in range(1, len(n))}
    out: list = []

    def walk(d, prefix):
        for k, v in d.items():
            path = (*prefix, k)
            if isinstance(v, dict) and path in scopes:
                walk(v, path)
            else:
                out.append(path if prefix else k)

    walk(plants or {}, ())
    return out


def _list(names) -> str:
    return "[" + ", ".join(repr(display_name(n)) for n in sorted(names, key=display_name)) + "]"


def strict_check(tag_, all_names, allowlist, blocklist, plants, planted) -> None:
    """``strict=True``: every allowlist / blocklist entry and every planted
    name must match a sow of ``tag_`` in the program (a typo raises)."""
    def matches(entry):
        return any(n == entry or (isinstance(n, tuple) and n[0] == entry) for n in all_names)

    problems = []
    for what, entries in (("allowlist", allowlist or ()), ("blocklist", blocklist or ())):
        missing = [e for e in entries if not matches(e)]
        if missing:
            problems.append(f"{what} names {_list(missing)} match no sow")
    unplanted = [n for n in _plant_names(plants, all_names) if n not in planted]
    if unplanted:
        problems.append(f"planted names {_list(unplanted)} were never planted (no selected sow "
                        f"has them)")
    if problems:
        raise ValueError(f"taxpr.harvest (strict=True), tag {tag_!r}: " + "; ".join(problems)
                         + f". Sows of tag {tag_!r} in this program: {_list(all_names)}")


class SowSite(NamedTuple):
    mode: str
    avals: tuple
    path: tuple
    tree: Any  # the sown value's pytree structure


class PlantRows:
    """A planted value that replaces only some rows of an ``append`` sow's
    stack (the iterations of a scan, in order); the other rows keep the
    value the program computes. Made by ``rows``."""

    __slots__ = ("index_values", "mask", "values")

    def __init__(self, index_values: dict | None, mask: Any, values: Any):
        self.index_values, self.mask, self.values = index_values, mask, values

    def __repr__(self) -> str:
        if self.index_values is not None:
            return f"rows({{{', '.join(map(str, self.index_values))}: ...}})"
        return "rows(mask=..., values=...)"


def _rows_flatten(r: PlantRows):
    if r.index_values is not None:
        keys = tuple(r.index_values)
        return tuple(r.index_values[k] for k in keys), ("index", keys)
    return (r.mask, r.values), ("mask", None)


def _rows_unflatten(aux, children) -> PlantRows:
    if aux[0] == "index":
        return PlantRows(dict(zip(aux[1], children)), None, None)
    return PlantRows(None, *children)


# A pytree (rows are static, values may be traced), so it passes through jit.
jax.tree_util.register_pytree_node(PlantRows, _rows_flatten, _rows_unflatten)


def rows(index_values: dict | None = None, *, mask: Any = None, values: Any = None) -> PlantRows:
    """A plant value for an ``append`` sow that overrides selected rows of its
    stack, e.g. one layer of a scan-over-layers model.

    The stack of an ``append`` sow has one row per time the sow ran (inside
    ``scan``: one per iteration, in order). ``plant`` normally replaces every
    row; with ``rows`` the unselected rows keep what the program computes
    (the program is not changed and no ``jnp.where`` is needed in it).

    Arguments:
        index_values: ``{row: value}``; each ``value`` has the sow's shape and
            dtype (one row). Negative rows count from the end.
        mask: instead of ``index_values``, a boolean array with one entry per
            row (may be traced) ...
        values: ... and the full stack the selected rows are taken from.

    Returns:
        A value to put in a ``plant`` / ``harvest`` plants dict.

    Raises:
        ValueError: at ``plant`` time, if the sow is not in ``append`` mode,
            a row is out of range, or a value's shape/dtype differs from the
            sow's.

    Example:
        >>> patched = plant(model, tag="acts")({"layer": rows({1: jnp.zeros(8)})}, x)
    """
    if (index_values is None) == (mask is None):
        raise TypeError("rows() takes either {row: value} or mask=..., values=...")
    if mask is not None and values is None:
        raise TypeError("rows(mask=...) needs values=... (the stack to take rows from)")
    if index_values is not None:
        if not isinstance(index_values, dict) or not all(
                isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in index_values):
            raise TypeError(f"rows() takes a dict {{int row: value}}, got {index_values!r}")
    return PlantRows(None if index_values is None else dict(index_values), mask, values)


class _Like:
    """An aval as an argument of ``jax.dtypes.result_type`` (weak type kept)."""

    def __init__(self, aval):
        self.aval, self.dtype, self.shape = aval, aval.dtype, aval.shape


def _plant_fit(value: Any, aval: Any) -> str:
    """How a planted leaf fits a sow leaf of type ``aval`` (shapes equal):
    ``"same"`` dtype; ``"convert"``: the value is weakly typed (a Python
    scalar) and JAX's promotion with the sow's type gives the sow's dtype, so
    it becomes that dtype; ``"retype"``: the sow is weakly typed (it sowed a
    Python scalar) and promotion gives the planted dtype, so the sow takes the
    planted type (the program is traced again); ``""``: refused."""
    vd, v_weak = jax.dtypes.result_type(value, return_weak_type_flag=True)
    if vd == aval.dtype:
        return "same"
    try:
        both = jax.dtypes.result_type(value, _Like(aval))
    except jax.dtypes.TypePromotionError:  # refused by jax_numpy_dtype_promotion="strict"
        return ""
    if v_weak and both == aval.dtype:
        return "convert"
    if getattr(aval, "weak_type", False) and both == vd:
        return "retype"
    return ""


def _type_str(dtype, shape) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


def _plant_mismatch(name, value, aval, where: str, noun: str = "Planted value") -> ValueError:
    return ValueError(
        f"{noun} for '{display_name(name)}' has type "
        f"{_type_str(jax.dtypes.result_type(value), np.shape(value))}, but "
        f"{where.format(type=_type_str(aval.dtype, aval.shape))}"
        f"{' (weakly typed)' if aval.weak_type else ''}; "
        f"a planted value must have the sow's shape and dtype, or be weakly typed (a Python "
        f"scalar) of a kind that promotes to it, or replace a sown Python scalar with a value "
        f"of a kind it promotes to")


def _conform(name, value: Any, aval: Any, where: str, allow_retype: bool,
             noun: str = "Planted value") -> tuple[Any, Any]:
    """(the planted leaf in the sow's type, or ``None`` if the sow must take
    the planted type; that type)."""
    if tuple(np.shape(value)) != tuple(aval.shape):
        raise _plant_mismatch(name, value, aval, where, noun)
    fit = _plant_fit(value, aval)
    if fit == "same":
        return value, None
    if fit == "convert":
        return _jaxpr.cast_weak_type(jax.lax.convert_element_type(value, aval.dtype), aval), None
    if fit == "retype" and allow_retype:
        vd, v_weak = jax.dtypes.result_type(value, return_weak_type_flag=True)
        return None, core.ShapedArray(aval.shape, vd, weak_type=v_weak)
    raise _plant_mismatch(name, value, aval, where, noun)


def plant_value(name, value, site: SowSite, allow_retype: bool,
                 noun: str = "Planted value") -> tuple[list, list | None]:
    """Checked leaves of a non-append plant (or perturbation: ``noun``), or
    the types its sow must take."""
    leaves = jax.tree_util.tree_leaves(value)
    if len(leaves) != len(site.avals):
        raise ValueError(f"{noun} for '{display_name(name)}' has {len(leaves)} leaves, "
                         f"expected {len(site.avals)}")
    where = f"the sow at {format_path(site.path)} has type {{type}}"
    fitted = [_conform(name, v, a, where, allow_retype, noun)
              for v, a in zip(leaves, site.avals)]
    if any(v is None for v, _ in fitted):
        return [], [t for _, t in fitted]
    return [v for v, _ in fitted], None


def stack_occurrences(values: list, keys: list) -> Any:
    # A collected value straight from a sow gets a new leading axis; one that
    # came out of a scan is already stacked along it.
    parts = [jnp.asarray(v) if k.stacked else jnp.asarray(v)[None] for v, k in zip(values, keys)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def unflatten_value(site: "SowSite", vals):
    return jax.tree_util.tree_unflatten(site.tree, [jnp.asarray(v) for v in vals])


def _rows_stack(name, plant: PlantRows, total: int, site: SowSite,
                inner: tuple[int, ...] = ()) -> list:
    """``[mask, *stacked leaves]`` (``total`` rows each) for a rows(...) plant.
    A sow inside nested scans stacks to ``(total, *inner, ...)``: a row is an
    iteration of the outermost scan, its value the stack of the inner ones."""
    where = f"a row of its append sows (at {format_path(site.path)}) has type {{type}}"
    if plant.index_values is None:
        mask = jnp.asarray(plant.mask)
        if mask.shape != (total,) or mask.dtype != jnp.bool_:
            raise ValueError(f"rows(mask=...) for '{display_name(name)}' has type "
                             f"{_type_str(mask.dtype, mask.shape)}, but its append sows (at "
                             f"{format_path(site.path)}) stack to {total} rows: want "
                             f"bool[{total}]")
        mask = jnp.broadcast_to(mask.reshape((total,) + (1,) * len(inner)), (total, *inner))
        return [mask, *jax.tree_util.tree_leaves(plant.values)]
    mask = np.zeros((total, *inner), bool)
    stacks = [jnp.zeros((total, *inner, *a.shape), a.dtype) for a in site.avals]
    for row, value in plant.index_values.items():
        if not -total <= row < total:
            raise ValueError(f"rows(...) for '{display_name(name)}': row {row} is out of range; its "
                             f"append sows (at {format_path(site.path)}) stack to {total} rows")
        row %= total
        mask[row] = True
        leaves = jax.tree_util.tree_leaves(value)
        if len(leaves) != len(site.avals):
            raise ValueError(f"Planted row {row} for '{display_name(name)}' has {len(leaves)} leaves, "
                             f"expected {len(site.avals)}")
        for i, (v, a) in enumerate(zip(leaves, site.avals)):
            v, _ = _conform(name, v, a.update(shape=(*inner, *a.shape)), where,
                            allow_retype=False)
            stacks[i] = stacks[i].at[row].set(v)
    return [jnp.asarray(mask), *stacks]


def plant_for_feed(key, avals, plants, sites, all_feeds) -> list:
    """The planted values for one fed occurrence: the occurrences of a name
    at the top level split the planted stack along its leading axis (one
    row per direct sow, one block per scan); its length must match."""
    name = key.site.name
    start, total = 0, 0
    for k, kav in all_feeds:
        if k.site.name != name:
            continue
        size = kav[0].shape[0] if k.stacked else 1
        if k == key:
            start, mine = total, size
        total += size
    value = plants[name]
    if isinstance(value, PlantRows):
        # (the mask's feed: a row per iteration of the scans around the sow)
        inner = tuple(avals[0].shape[1:]) if key.stacked else ()
        value = _rows_stack(name, value, total, sites[name], inner)
    out = []
    leaves = jax.tree_util.tree_leaves(value)
    if len(leaves) != len(avals):
        raise ValueError(f"Planted value for '{display_name(name)}' has {len(leaves)} leaves, "
                         f"expected {len(avals)}")
    for v, a in zip(leaves, avals):
        row = a.update(shape=a.shape[1:]) if key.stacked else a
        want = core.ShapedArray((total, *row.shape), row.dtype)
        where = f"its append sows (at {format_path(sites[name].path)}) stack to {{type}}"
        v, _ = _conform(name, v, want, where, allow_retype=False)
        v = jnp.asarray(v)
        out.append(v[start:start + mine] if key.stacked else v[start])
    return out

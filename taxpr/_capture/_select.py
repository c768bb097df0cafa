"""Selectors: which sites a capture or a patch acts on.

A selector is a glob over site names (``"MLP/*/add"``), a predicate over
``Site``, or one of the ``Selector`` helpers below, combined with ``&``,
``|`` and ``~``."""

from __future__ import annotations

import difflib
import fnmatch
import os
from typing import Any, Callable, Sequence, Union

import numpy as np

from ._sites import Site


class Selector:
    """A predicate over ``Site`` with a readable description, combined with
    ``&``, ``|``, ``~``."""

    def __init__(self, predicate: Callable[[Site], bool], description: str):
        self.predicate = predicate
        self.description = description

    def __call__(self, site: Site) -> bool:
        return bool(self.predicate(site))

    def __and__(self, other: Any) -> "Selector":
        o = as_selector(other)
        return Selector(lambda s: self(s) and o(s), f"({self.description} & {o.description})")

    def __or__(self, other: Any) -> "Selector":
        o = as_selector(other)
        return Selector(lambda s: self(s) or o(s), f"({self.description} | {o.description})")

    def __invert__(self) -> "Selector":
        return Selector(lambda s: not self(s), f"~{self.description}")

    def __repr__(self) -> str:
        return self.description


SelectorLike = Union[str, Selector, Callable[[Site], bool]]


def as_selector(selector: SelectorLike) -> Selector:
    if isinstance(selector, Selector):
        return selector
    if isinstance(selector, str):
        return name(selector)
    if callable(selector):
        return Selector(selector, getattr(selector, "__name__", repr(selector)))
    raise TypeError(f"taxpr: a selector is a glob over site names, a predicate over "
                    f"taxpr.Site or a taxpr.select helper, not {type(selector).__name__}: "
                    f"{selector!r}")


def name(glob: str) -> Selector:
    """Sites whose name matches ``glob`` (``fnmatch``: ``*``, ``?``, ``[ab]``)."""
    return Selector(lambda s: fnmatch.fnmatchcase(s.name, glob), repr(glob))


def scope(glob: str) -> Selector:
    """Sites computed in a scope matching ``glob`` (``"MLP/fc1"``, ``"Block_*/attn"``)."""
    return Selector(lambda s: fnmatch.fnmatchcase(s.scope, glob), f"scope({glob!r})")


def primitive(*names: str) -> Selector:
    """Sites computed by one of the primitives ``names`` (``"dot_general"``)."""
    return Selector(lambda s: s.primitive in names, f"primitive{names!r}")


def source(file: str | None = None, function: str | None = None,
           line: int | None = None) -> Selector:
    """Sites computed at a source location: ``file`` a glob over the file's
    path or base name, ``function`` a glob over the function's name
    (``"Block.__call__"``), ``line`` the line number."""
    def pred(s: Site) -> bool:
        if file is not None and (s.file is None or not (
                fnmatch.fnmatchcase(s.file, file)
                or fnmatch.fnmatchcase(os.path.basename(s.file), file))):
            return False
        if function is not None and (s.function is None
                                     or not fnmatch.fnmatchcase(s.function, function)):
            return False
        return line is None or s.line == line
    return Selector(pred, f"source(file={file!r}, function={function!r}, line={line!r})")


def shape(shape_: Sequence[int]) -> Selector:
    """Sites whose (per-iteration, per-example) shape is ``shape_``."""
    want = tuple(shape_)
    return Selector(lambda s: s.shape == want, f"shape({want!r})")


def dtype(dtype_: Any) -> Selector:
    """Sites of dtype ``dtype_``."""
    want = np.dtype(dtype_)
    return Selector(lambda s: s.dtype is not None and np.dtype(s.dtype) == want
                    if _is_numpy(s.dtype) else False, f"dtype({want})")


def _is_numpy(d: Any) -> bool:
    try:
        np.dtype(d)
        return True
    except TypeError:
        return False


def leaving(glob: str) -> Selector:
    """What leaves a scope matching ``glob``: the values computed inside it
    that code outside it uses (a module's outputs; the residual stream
    between blocks)."""
    return Selector(lambda s: any(fnmatch.fnmatchcase(sc, glob) for sc in s.leaves),
                    f"leaving({glob!r})")


def select(sites: Sequence[Site], selector: SelectorLike, what: str) -> list[Site]:
    """The sites ``selector`` matches; none is an error naming the nearest
    site names."""
    sel = as_selector(selector)
    chosen = [s for s in sites if sel(s)]
    if chosen:
        return chosen
    names = [s.name for s in sites]
    hint = difflib.get_close_matches(selector, names, n=5, cutoff=0.3) if isinstance(
        selector, str) else []
    if not hint:
        hint = names[:5]
    raise ValueError(
        f"taxpr.{what}: the selector {sel.description} matches none of the program's "
        f"{len(sites)} sites; the nearest names: {hint} (taxpr.sites(fn, *args) lists "
        f"them all)")

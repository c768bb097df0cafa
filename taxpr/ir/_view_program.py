"""The viewer's records of a program (``Pane``: its containers, equations
and values), made by one walk of its nested jaxprs (``program``)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, NamedTuple

import jax

from .._jax.internals import core, source_info_util

from .. import _compat, _jaxpr, _traverse
from .._capture._sites import scope_of, site_names
from .._collector import collector_paused
from ..primitives._tag import tag_p, user_params


# ---- the program as records --------------------------------------------------

class Eqn(NamedTuple):
    """One equation as the page receives it (a JSON array, in this order).

    Fields:
        prim: index into ``Pane.prims``.
        ins: operands: a value id (int), or a literal as text.
        outs: result value ids (-1 for a dropped result).
        src: index into ``Pane.srcs`` (the user's ``file:line (function)``),
            -1 when unknown.
        sites: the ``tx.sites`` names of its results ([] if none: an
            equation with sub-jaxprs, a tag, a while's predicate).
        node: the container it sits in (index into ``Pane.nodes``). An
            equation with sub-jaxprs is not one of its children: the
            containers of its sub-jaxprs (``Node.eqn``) stand for it.
        mark: compare mode: ``""``, ``"r"`` removed, ``"a"`` added,
            ``"w"`` rewritten.
        tag: for a taxpr tag, ``[kind, name]`` (kind ``"tag"``,
            ``"state.get"``, ``"sow"``, ...); else 0.
        params: index into ``Pane.params`` (the params other than jaxprs,
            as text), -1 if none.
    """

    prim: int
    ins: list
    outs: list
    src: int
    sites: list
    node: int
    mark: str
    tag: Any
    params: int


class Node(NamedTuple):
    """A container (a JSON array, in this order).

    Fields:
        kind: ``"program"``, ``"sub"`` (a jaxpr in an equation's params) or
            ``"scope"`` (a named scope).
        label: ``"scan[length=12]"``, ``"while[body]"``, a scope's name.
        parent: the enclosing container (-1 for the program).
        kids: its children in order: an equation ``e`` as ``e``, a
            container ``n`` as ``-n - 1``.
        eqn: a ``"sub"``'s equation; -1 otherwise.
        ins, outs: a ``"sub"``'s (and the program's) input / output value
            ids (an output may be a literal, as text).
        scope: the full scope path (``"Model/layers_0"``) of a scope, the
            scope a sub-jaxpr's equation is in, or ``""``.
    """

    kind: str
    label: str
    parent: int
    kids: list
    eqn: int
    ins: list
    outs: list
    scope: str


@dataclasses.dataclass
class Pane:
    """One program of the page.

    Attributes:
        label: shown above it.
        eqns, nodes: the records above; ``nodes[0]`` is the program.
        types: interned type texts (``"f32[3,4]"``).
        values: per value id: ``[type index, producer]``; the producer is an
            equation index, ``-n - 1`` for an input of container ``n``, or
            ``None`` for a constant.
        binds: a sub-jaxpr's input value id -> the outer operand's value id
            it is bound to (where known).
        prims, srcs, params: interned texts.
        n_sites: how many ``tx.sites`` names the program has.
    """

    label: str
    eqns: list = dataclasses.field(default_factory=list)
    nodes: list = dataclasses.field(default_factory=list)
    types: list = dataclasses.field(default_factory=list)
    values: list = dataclasses.field(default_factory=list)
    binds: dict = dataclasses.field(default_factory=dict)
    prims: list = dataclasses.field(default_factory=list)
    srcs: list = dataclasses.field(default_factory=list)
    params: list = dataclasses.field(default_factory=list)
    n_sites: int = 0

    @classmethod
    def from_json(cls, d: dict) -> "Pane":
        """The pane ``to_json`` gave (a page's saved ``HTML.data``)."""
        return cls(d["label"], [Eqn(*e) for e in d["E"]], [Node(*n) for n in d["N"]],
                   d["T"], d["V"], {int(k): v for k, v in d["B"].items()}, d["P"], d["S"],
                   d["Q"], d["nSites"])

    def to_json(self) -> dict:
        return {"label": self.label, "E": [list(e) for e in self.eqns],
                "N": [list(n) for n in self.nodes], "T": self.types, "V": self.values,
                "B": self.binds, "P": self.prims, "S": self.srcs, "Q": self.params,
                "nSites": self.n_sites}


class _Interned:
    """Texts numbered in order of first use."""

    __slots__ = ("items", "index")

    def __init__(self, items: list):
        self.items = items
        self.index: dict = {}

    def __call__(self, key: Any, text: Callable[[], str]) -> int:
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.items)
            self.items.append(text())
        return i


@dataclasses.dataclass
class _Level:
    """One jaxpr being laid out (the ``ctx`` of the walk): its container,
    the scope groups open in it and its variables' value ids."""

    node: int
    scope: tuple[str, ...]  # the absolute scope of the container
    vals: dict
    open: list = dataclasses.field(default_factory=list)  # [(name, node)]
    # Inside a jaxpr that a high-level operation holds in its object (not
    # walked by tx.sites: its equations have no site names).
    hidden: bool = False


def _type_text(aval: Any) -> str:
    if hasattr(aval, "str_short"):
        try:
            return aval.str_short(short_dtypes=True)
        except TypeError:
            return aval.str_short()
    return str(aval)


def _param_text(params: dict) -> str:
    parts = []
    for k, v in params.items():
        if isinstance(v, JAXPR_TYPES) or (isinstance(v, (tuple, list)) and v
                                           and isinstance(v[0], JAXPR_TYPES)):
            continue
        if callable(v) and not isinstance(v, type):
            text = getattr(v, "__name__", type(v).__name__)
        else:
            text = repr(v)
        if len(text) > 80:
            text = text[:77] + "..."
        parts.append(f"{k}={text}")
    return " ".join(parts)


JAXPR_TYPES = _compat.JAXPR_TYPES
_TAXPR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class _Builder:
    """Lays out one program as a ``Pane`` in one ``_traverse.walk``."""

    def __init__(self, closed: Any, label: str):
        self.pane = Pane(label)
        self.types = _Interned(self.pane.types)
        self.prims = _Interned(self.pane.prims)
        self.srcs = _Interned(self.pane.srcs)
        self.params = _Interned(self.pane.params)
        self.closed = closed
        # The last equation laid out: (index, container, scope, sub-jaxprs
        # as (Sub, jaxpr, held in a high-level operation's object)).
        self.owner: tuple[int, int, tuple, list] = (-1, 0, (), [])
        self.by_traceback: dict = {}
        self.type_by_id: dict[int, int] = {}
        self.avals: list = []
        self.by_params: dict = {}

    def value(self, v: Any, producer: Any) -> int:
        # Types by the aval object (comparing equal avals costs more than
        # printing one), then by text.
        aval = v.aval
        t = self.type_by_id.get(id(aval))
        if t is None:
            text = _type_text(aval)
            t = self.type_by_id[id(aval)] = self.types(text, lambda: text)
            self.avals.append(aval)  # kept alive: its id is not reused
        self.pane.values.append([t, producer])
        return len(self.pane.values) - 1

    def node(self, kind: str, label: str, parent: int, eqn: int = -1, scope: str = "") -> int:
        n = len(self.pane.nodes)
        self.pane.nodes.append(Node(kind, label, parent, [], eqn, [], [], scope))
        if parent >= 0:
            self.pane.nodes[parent].kids.append(-n - 1)
        return n

    def place(self, level: _Level, scope: tuple[str, ...]) -> int:
        """The container of an equation with this (relative) scope: scope
        groups are opened and closed as consecutive equations' scopes
        change."""
        keep = 0
        while keep < len(level.open) and keep < len(scope) and level.open[keep][0] == scope[keep]:
            keep += 1
        del level.open[keep:]
        parent = level.open[-1][1] if level.open else level.node
        for i in range(keep, len(scope)):
            full = "/".join(level.scope + scope[:i + 1])
            parent = self.node("scope", scope[i], parent, scope=full)
            level.open.append((scope[i], parent))
        return parent

    def source(self, eqn: Any) -> int:
        # Equations made by one line share equal tracebacks (a loop's body,
        # a layer called again): each traceback is read once.
        tb = eqn.source_info.traceback
        try:
            return self.by_traceback[tb]
        except (KeyError, TypeError):
            pass
        # The user's line, not taxpr's own (a tag's bind) nor JAX's.
        frame = next((f for f in source_info_util.user_frames(tb)
                      if not f.file_name.startswith(_TAXPR_DIR)), None)
        if frame is None:
            i = -1
        else:
            key = (frame.file_name, frame.start_line, frame.function_name)
            i = self.srcs(key, lambda: f"{os.path.basename(frame.file_name)}:"
                                       f"{frame.start_line} ({frame.function_name})")
        if tb is not None:
            self.by_traceback[tb] = i
        return i

    def param_text(self, eqn: Any, params: dict) -> int:
        """The index of ``params``' text (-1 for none); equal params (often
        hashable: shapes, dtypes, axes) are rendered once."""
        try:
            key = (eqn.primitive, tuple(params.items()))
            hit = self.by_params.get(key)
        except TypeError:  # an unhashable param
            key, hit = None, None
        if hit is not None:
            return hit
        text = _param_text(params)
        i = self.params(text, lambda: text) if text else -1
        if key is not None:
            self.by_params[key] = i
        return i

    def build(self) -> Pane:
        pane = self.pane
        sites = site_names(self.closed)
        pane.n_sites = sum(map(len, sites.values()))
        top = self.node("program", self.pane.label, -1)
        constvars, _, invars, _, outvars, _, _ = _jaxpr.jaxpr_parts(self.closed)
        level = _Level(top, (), {})
        for v in constvars:
            level.vals[v] = self.value(v, None)
        for v in invars:
            level.vals[v] = self.value(v, -top - 1)
            pane.nodes[top].ins.append(level.vals[v])
        walk = _traverse.walk(self.closed, self.subs, level)
        ordinal = 0  # the place in tx.sites' walk, which skips hidden jaxprs
        for eqn, _, lvl in walk:
            if lvl.hidden:
                self.eqn(eqn, lvl, [])
            else:
                self.eqn(eqn, lvl, sites.get(ordinal, []))
                ordinal += 1
        pane.nodes[top].outs.extend(self.atom(v, level) for v in outvars)
        return pane

    def atom(self, v: Any, level: _Level) -> Any:
        if isinstance(v, core.Literal):
            return _literal(v)
        vid = level.vals.get(v)
        if vid is None:  # a free variable of an open jaxpr
            vid = level.vals[v] = self.value(v, None)
        return vid

    def eqn(self, eqn: Any, level: _Level, sites: list[str]) -> None:
        pane = self.pane
        rel = scope_of(eqn.source_info)
        parent = self.place(level, rel)
        e = len(pane.eqns)
        ins = [self.atom(v, level) for v in eqn.invars]
        outs = []
        for v in eqn.outvars:
            if isinstance(v, core.DropVar):
                outs.append(-1)
            else:
                outs.append(self.value(v, e))
                level.vals[v] = outs[-1]
        prim = eqn.primitive.name
        tag: Any = 0
        if eqn.primitive is tag_p:
            user = user_params(eqn.params)
            op = user.get("op")
            kind = str(op) if op is not None else "tag"
            if any(_is_key(v) for v in eqn.invars):  # a random stream's state
                kind = kind.replace("state.", "key.")
            tag = [kind, str(user.get("name", ""))]
            params = self.param_text(eqn, user)
        else:
            params = self.param_text(eqn, eqn.params)
        pane.eqns.append(Eqn(self.prims(prim, lambda: prim), ins, outs, self.source(eqn),
                             sites, parent, "", tag, params))
        subs = [(sub, sj, False) for sub, sj in _traverse.subjaxprs(eqn)]
        if _compat.call_hi_primitive_p is not None and eqn.primitive is _compat.call_hi_primitive_p:
            label = _traverse.hi_name(eqn)
            subs.extend((_traverse.Sub("_prim", i, label), sj, True)
                        for i, sj in enumerate(_traverse.hidden_jaxprs(eqn)))
        if not subs:  # else its sub-jaxprs' containers stand for it
            pane.nodes[parent].kids.append(e)
        self.owner = (e, parent, level.scope + rel, subs)

    def subs(self, eqn: Any, path: tuple, level: _Level):
        e, parent, scope, subs = self.owner
        outer = self.pane.eqns[e].ins
        for sub, sj, hidden in subs:
            n = self.node("sub", sub.label, parent, eqn=e, scope="/".join(scope))
            inner = _Level(n, scope, {}, hidden=level.hidden or hidden)
            constvars, _, invars, _, outvars, _, _ = _jaxpr.jaxpr_parts(sj)
            for v in constvars:
                inner.vals[v] = self.value(v, None)
            # Operands feed a body's inputs from the end (a cond's index, a
            # while's constants of the other part come first).
            shift = len(outer) - len(invars)
            for i, v in enumerate(invars):
                vid = inner.vals[v] = self.value(v, -n - 1)
                self.pane.nodes[n].ins.append(vid)
                if (not hidden and 0 <= shift + i < len(outer)
                        and isinstance(outer[shift + i], int)):
                    self.pane.binds[vid] = outer[shift + i]
            yield sub, sj, inner
            self.pane.nodes[n].outs.extend(self.atom(v, inner) for v in outvars)


def _is_key(v: Any) -> bool:
    dtype = getattr(v.aval, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _literal(v: Any) -> str:
    val = v.val
    try:
        text = str(val.item()) if getattr(val, "shape", None) == () else str(val)
    except Exception:  # an extended dtype's literal
        text = str(val)
    return text if len(text) <= 40 else text[:37] + "..."


def program(closed: Any, label: str = "program") -> Pane:
    """``closed`` (a ``ClosedJaxpr`` or ``Jaxpr``) laid out as a ``Pane``."""
    with collector_paused():
        return _Builder(as_closed(closed), label).build()


def as_closed(j: Any) -> Any:
    """A ``Jaxpr`` without constants as a closed jaxpr (a JAX without
    ``ClosedJaxpr`` closes every ``Jaxpr``)."""
    if not _jaxpr.is_closed(j):
        return _jaxpr.close_traced(j, ())
    return j



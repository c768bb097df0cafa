"""An interactive, offline HTML view of a jaxpr (``view``, ``HTML``).

The program is laid out by one walk of its nested jaxprs
(``_traverse.walk``) as a tree of containers: each sub-jaxpr of an equation
(``jit``, ``scan``, ``while`` cond and body, ``cond`` branches, custom rules,
``checkpoint``, ``shard_map``, ...) and each named scope of the equations'
name stacks (flax / equinox module paths, ``jax.named_scope``). The tree,
the values with their types, the source lines, the site names of
``tx.sites`` and the tags are one JSON document embedded in a single HTML
file with the page's own script (``_view_page``): nothing is loaded from the
network, and a container's children are drawn only when it is opened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import gc
import html as _html
import json
import os
from typing import Any, Callable, NamedTuple

import jax

from .._jax.internals import core, source_info_util

from .. import _compat, _jaxpr, _traverse
from .._capture._sites import scope_of, site_names
from ..primitives._tag import tag_p, user_params
from . import _view_page

__all__ = ["HTML", "view"]


class HTML:
    """A generated viewer page: one self-contained HTML document.

    Shown inline by Jupyter (``_repr_html_``: the page in an ``iframe``),
    written with ``save``; ``str(page)`` is the document.

    Attributes:
        html: the document's text.
        path: where ``view(..., out=...)`` or ``save`` wrote it (None if
            nowhere).
        data: the embedded program description (a JSON-ready dict).
    """

    def __init__(self, html: str, data: dict | None = None, path: str | None = None):
        self.html = html
        self.data = data
        self.path = path

    def save(self, path: str | os.PathLike) -> str:
        """Write the document to ``path``.

        Arguments:
            path: a file name (``"model.html"``).

        Returns:
            The path written, as a string.
        """
        path = os.fspath(path)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.html)
        self.path = path
        return path

    def _repr_html_(self) -> str:
        # Notebook front ends may not run a script placed in an output
        # directly; a sandboxed iframe runs the page as a file would.
        return ('<iframe style="width:100%;height:640px;border:1px solid #ccc" '
                'sandbox="allow-scripts allow-popups allow-modals" srcdoc="'
                + _html.escape(self.html, quote=True) + '"></iframe>')

    def __str__(self) -> str:
        return self.html

    def __repr__(self) -> str:
        where = f" at {self.path!r}" if self.path else ""
        return f"<taxpr.ir.HTML viewer page{where}, {len(self.html)} characters>"


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
        if isinstance(v, _JAXPR_TYPES) or (isinstance(v, (tuple, list)) and v
                                           and isinstance(v[0], _JAXPR_TYPES)):
            continue
        if callable(v) and not isinstance(v, type):
            text = getattr(v, "__name__", type(v).__name__)
        else:
            text = repr(v)
        if len(text) > 80:
            text = text[:77] + "..."
        parts.append(f"{k}={text}")
    return " ".join(parts)


_JAXPR_TYPES = _compat.JAXPR_TYPES
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
    with _no_gc():
        return _Builder(_as_closed(closed), label).build()


@contextlib.contextmanager
def _no_gc():
    """The layout and its JSON make a few small lists per equation and free
    none: the cyclic collector, run again and again as they pile up, would
    find nothing (a third of the time of a large page)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _as_closed(j: Any) -> Any:
    """A ``Jaxpr`` without constants as a closed jaxpr (a JAX without
    ``ClosedJaxpr`` closes every ``Jaxpr``)."""
    if not _jaxpr.is_closed(j):
        return _jaxpr.close_traced(j, ())
    return j


# ---- compare mode ----------------------------------------------------------------

def _paths(pane: Pane) -> list[str]:
    """Per node: the labels of the enclosing sub-jaxprs and scopes."""
    out: list[str] = []
    for n in pane.nodes:
        out.append("" if n.parent < 0 else f"{out[n.parent]}/{n.label}")
    return out


def _keys(pane: Pane) -> tuple[list[str], list[str]]:
    """Per equation: where it is and what it computes (``coarse``), and
    that plus its operands' and results' types and params (``fine``); value
    names are left out, so renamed programs compare equal."""
    paths = _paths(pane)
    coarse, fine = [], []
    for e in pane.eqns:
        c = f"{paths[e.node]}|{pane.prims[e.prim]}"
        ins = ",".join(pane.types[pane.values[a][0]] if isinstance(a, int) else f"={a}"
                       for a in e.ins)
        outs = ",".join(pane.types[pane.values[o][0]] if o >= 0 else "_" for o in e.outs)
        coarse.append(c)
        fine.append(f"{c}|{ins}|{outs}|{pane.params[e.params] if e.params >= 0 else ''}")
    return coarse, fine


def _origin(pane: Pane, a: Any) -> tuple:
    """Where an operand comes from: a literal, a constant, output ``k`` of
    equation ``e``, or input ``k`` of its container."""
    if not isinstance(a, int):
        return ("literal", a)
    producer = pane.values[a][1]
    if producer is None:
        return ("const",)
    if producer >= 0:
        return ("eqn", producer, pane.eqns[producer].outs.index(a))
    return ("input", pane.nodes[-producer - 1].ins.index(a))


def _same_operands(left: Pane, right: Pane, i: int, j: int, matched: dict) -> bool:
    for a, b in zip(left.eqns[i].ins, right.eqns[j].ins):
        oa, ob = _origin(left, a), _origin(right, b)
        if oa[0] == "eqn" == ob[0]:
            if matched.get(oa[1]) != ob[1] or oa[2] != ob[2]:
                return False
        elif oa != ob:
            return False
    return True


class Diff(NamedTuple):
    """What changed between two programs: equation indices of the left
    program (``removed``; ``rewritten``'s first items) and of the right
    (``added``; ``rewritten``'s second items)."""

    removed: list[int]
    added: list[int]
    rewritten: list[tuple[int, int]]


def diff(left: Pane, right: Pane) -> Diff:
    """Match the equations of two programs in program order.

    Equations equal in place, primitive, types and params, whose operands
    come from equations matched alike, are unchanged; equal ones reading
    other values are rewritten. In the stretches between them, those with
    the same place and primitive are paired as rewritten (their operands'
    types or params differ), the rest of the left program's are removed and
    of the right's added.

    Arguments:
        left, right: the programs (``program``).

    Returns:
        A ``Diff``; the panes' equations are marked too (``Eqn.mark``).
    """
    lc, lf = _keys(left)
    rc, rf = _keys(right)
    removed, added, rewritten = [], [], []
    fine = difflib.SequenceMatcher(None, lf, rf, autojunk=False)
    opcodes = fine.get_opcodes()
    matched = {i1 + k: j1 + k for op, i1, i2, j1, j2 in opcodes if op == "equal"
               for k in range(i2 - i1)}
    for op, i1, i2, j1, j2 in opcodes:
        if op == "equal":
            # Equal alike, but reading other values (CSE pointed an operand
            # at another equation): rewritten.
            rewritten.extend((i, matched[i]) for i in range(i1, i2)
                             if not _same_operands(left, right, i, matched[i], matched))
            continue
        coarse = difflib.SequenceMatcher(None, lc[i1:i2], rc[j1:j2], autojunk=False)
        for op2, a1, a2, b1, b2 in coarse.get_opcodes():
            if op2 == "equal":
                rewritten.extend((i1 + a, j1 + b) for a, b in zip(range(a1, a2), range(b1, b2)))
                continue
            removed.extend(range(i1 + a1, i1 + a2))
            added.extend(range(j1 + b1, j1 + b2))
    for i in removed:
        left.eqns[i] = left.eqns[i]._replace(mark="r")
    for j in added:
        right.eqns[j] = right.eqns[j]._replace(mark="a")
    for i, j in rewritten:
        left.eqns[i] = left.eqns[i]._replace(mark="w")
        right.eqns[j] = right.eqns[j]._replace(mark="w")
    return Diff(removed, added, rewritten)


# ---- the public function -------------------------------------------------------------

def _closed(fn: Any, args: tuple, kwargs: dict) -> Any:
    if isinstance(fn, _JAXPR_TYPES):
        return _as_closed(fn)
    if not callable(fn):
        raise TypeError(f"taxpr.ir.view: expected a function, a ClosedJaxpr or a Jaxpr, "
                        f"got {type(fn).__name__}")
    return jax.make_jaxpr(fn)(*args, **kwargs)


def _name(fn: Any, default: str) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or default


def page_data(closed: Any, compare: Any = None, title: str = "jaxpr",
              labels: tuple[str, str] = ("before", "after")) -> dict:
    """The JSON document a page embeds: one or two programs (the second
    compared with the first)."""
    if compare is None:
        return panes_data(title, program(closed, title))
    return panes_data(title, program(closed, labels[0]), program(compare, labels[1]))


def panes_data(title: str, left: Pane, right: Pane | None = None) -> dict:
    """The JSON document of one program, or of two compared (``diff``)."""
    if right is None:
        return {"title": title, "compare": None, "panes": [left.to_json()]}
    d = diff(left, right)
    summary = {"removed": len(d.removed), "added": len(d.added), "rewritten": len(d.rewritten)}
    return {"title": title, "compare": summary, "panes": [left.to_json(), right.to_json()]}


def view(fn: Any, *args: Any, out: str | os.PathLike | None = None, compare: Any = None,
         title: str | None = None, labels: tuple[str, str] = ("before", "after"),
         **kwargs: Any) -> HTML:
    """An interactive HTML page of a program, working offline.

    The program is shown as a tree of collapsible containers: ``jit``,
    ``scan``, ``while`` (cond and body), ``cond`` branches, custom rules,
    ``checkpoint``, ``shard_map`` and the named scopes of its equations
    (flax / equinox module paths). Every equation shows its values with
    shapes and dtypes, its source ``file:line`` and its ``tx.sites`` name
    (a selector for ``tx.capture`` / ``tx.patch``, copied with a click);
    taxpr tags, states, sows and keys are highlighted and listed; search
    finds site names, primitives and source lines; clicking a value
    highlights where it comes from and where it goes.

    Arguments:
        fn: a function (traced with ``jax.make_jaxpr`` on ``args`` and
            ``kwargs``), a ``ClosedJaxpr`` or a ``Jaxpr``.
        *args, **kwargs: ``fn``'s example arguments (arrays or
            ``jax.ShapeDtypeStruct``).
        out: a file to write the page to (optional).
        compare: a second program shown beside the first, with equations
            removed, added or rewritten marked: a ``ClosedJaxpr`` /
            ``Jaxpr``, or a function traced on the same arguments
            (``ir.optimize_jaxpr(closed)``; a program before and after
            ``tx.uncurry``).
        title: the page's title (the function's name by default).
        labels: the two programs' labels in compare mode.

    Returns:
        An ``HTML`` page (shown inline in Jupyter; ``.save(path)``).
    """
    closed = _closed(fn, args, kwargs)
    other = None if compare is None else _closed(compare, args, kwargs)
    if title is None:
        title = "jaxpr" if isinstance(fn, _JAXPR_TYPES) else _name(fn, "jaxpr")
    with _no_gc():
        data = page_data(closed, other, title, labels)
        page = HTML(render_page(data), data)
    if out is not None:
        page.save(out)
    return page


def render_page(data: dict) -> str:
    """The HTML document for ``data`` (``page_data``): the page's style
    and script with the data as embedded JSON."""
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    # Inside <script>, "</" would end the element and "<!--" start a
    # comment: "<" occurs only in strings, where JSON may escape it.
    text = text.replace("<", "\\u003c")
    return _view_page.PAGE.replace("%TITLE%", _html.escape(data["title"])).replace(
        "%DATA%", text)

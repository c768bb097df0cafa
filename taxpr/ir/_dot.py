"""Graphviz DOT text of a jaxpr (no dependency), and rendering with ``dot``."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

from .._jax.internals import core

from .. import _jaxpr, _traverse

__all__ = ["render", "to_dot"]

INSTALL_HINT = ("the Graphviz `dot` program is not installed (or not on PATH): install it "
                "with `apt-get install graphviz` (Debian/Ubuntu), `brew install graphviz` "
                "(macOS) or `conda install graphviz`, or write `to_dot(jaxpr)` to a .dot "
                "file and render it elsewhere")


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class _Dot:
    """Builds the DOT lines; variables are named by JAX's ``JaxprPpContext``
    in the order the pretty-printer names them (binders first, an
    equation's outputs before the jaxprs in its params)."""

    def __init__(self):
        self.ctx = core.JaxprPpContext()
        self.lines: list[str] = []
        # Edges go after every cluster: an edge written inside a cluster
        # would pull both of its nodes into that cluster.
        self.edges: list[str] = []
        self.n = 0

    def name(self, v: Any) -> str:
        if isinstance(v, core.Literal):
            return v.pretty_print(self.ctx)
        return self.ctx.var_names[v]

    def typed(self, v: Any) -> str:
        return f"{self.name(v)}:{v.aval.str_short(short_dtypes=True)}" \
            if hasattr(v.aval, "str_short") else self.name(v)

    def node(self, label: str, shape: str = "box", extra: str = "") -> str:
        self.n += 1
        nid = f"n{self.n}"
        self.lines.append(f"{nid} [label={_quote(label)} shape={shape}{extra}];")
        return nid

    def jaxpr(self, j: Any) -> list[str]:
        """Emit ``j``'s nodes, its nested jaxprs as clusters. Returns the
        nodes producing its outputs."""
        top = self._enter(j, None)
        for eqn, _, frame in _traverse.walk(j, self._subs, top):
            outs = [self.typed(v) if not isinstance(v, core.DropVar) else "_"
                    for v in eqn.outvars]
            args = " ".join(self.name(a) for a in eqn.invars)
            label = f"{', '.join(outs)} = {eqn.primitive.name} {args}".strip()
            frame.node = nid = self.node(label, extra=' style="bold"' if eqn.effects else "")
            for a in eqn.invars:
                if not isinstance(a, core.Literal) and a in frame.producer:
                    self.edges.append(
                        f"{frame.producer[a]} -> {nid} [label={_quote(self.name(a))}];")
            for v in eqn.outvars:
                frame.producer[v] = nid
        return self._leave(j, top)

    def _subs(self, eqn, path, frame: "_Frame"):
        """``eqn``'s nested jaxprs, each a cluster fed by dashed edges from
        the nodes of ``eqn``'s operands, its outputs feeding ``eqn``'s node."""
        nid = frame.node
        feeds = [frame.producer.get(a) if not isinstance(a, core.Literal) else None
                 for a in eqn.invars]
        for sub, sj in _traverse.subjaxprs(eqn):
            self.n += 1
            self.lines.append(f"subgraph cluster_{self.n} {{ label={_quote(sub.label)}; "
                              f"style=rounded; color=gray50;")
            n_in = len(_jaxpr.jaxpr_parts(sj).invars)
            inner = self._enter(sj, feeds[len(feeds) - n_in:] if n_in <= len(feeds) else None)
            yield sub, sj, inner
            sub_outs = self._leave(sj, inner)
            self.lines.append("}")
            for o in sub_outs:
                self.edges.append(f"{o} -> {nid} [style=dashed];")

    def _enter(self, j: Any, inputs: list[str] | None) -> "_Frame":
        """Nodes for ``j``'s constants and inputs; ``inputs`` are the outer
        nodes feeding its invars (dashed edges)."""
        constvars, _, invars, _, _, _, _ = _jaxpr.jaxpr_parts(j)
        frame = _Frame()
        for v in constvars:
            frame.producer[v] = self.node(f"const {self.typed(v)}", "note")
        for i, v in enumerate(invars):
            frame.producer[v] = self.node(self.typed(v), "ellipse")
            if inputs is not None and i < len(inputs) and inputs[i] is not None:
                self.edges.append(f"{inputs[i]} -> {frame.producer[v]} [style=dashed];")
        return frame

    def _leave(self, j: Any, frame: "_Frame") -> list[str]:
        """The nodes producing ``j``'s outputs."""
        out_nodes = []
        for v in _jaxpr.jaxpr_parts(j).outvars:
            if isinstance(v, core.Literal):
                out_nodes.append(self.node(self.name(v), "plaintext"))
            else:
                out_nodes.append(frame.producer.get(v) or self.node(self.typed(v), "ellipse"))
        return out_nodes


class _Frame:
    """One jaxpr being drawn: the node producing each of its variables, and
    the node of the equation drawn last."""

    __slots__ = ("producer", "node")

    def __init__(self):
        self.producer: dict = {}
        self.node: str | None = None


def to_dot(jaxpr: Any, name: str = "jaxpr") -> str:
    """Graphviz DOT text of ``jaxpr``: one box per equation (its outputs,
    primitive and inputs as JAX's pretty-printer names them; equations with
    effects in bold), an edge per use of a variable, inputs as ellipses, and
    every nested jaxpr as a cluster labelled by its path element (e.g.
    ``scan[length=3]``, ``cond[branch=1]``), fed by dashed edges.

    Arguments:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
      name: the graph's name.

    Returns:
      The DOT source.
    """
    d = _Dot()
    d.lines.append(f"digraph {_quote(name)} {{")
    d.lines.append('rankdir=TB; node [fontname="monospace" fontsize=10]; '
                   'edge [fontname="monospace" fontsize=9];')
    outs = d.jaxpr(jaxpr)
    sink = d.node("outputs", "doublecircle")
    for o in outs:
        d.edges.append(f"{o} -> {sink};")
    d.lines.extend(d.edges)
    d.lines.append("}")
    return "\n".join(d.lines) + "\n"


def render(jaxpr: Any, path: str | os.PathLike, format: str | None = None) -> str:
    """Write the graph of ``jaxpr`` to ``path`` with Graphviz's ``dot``.

    Arguments:
      jaxpr: a ``Jaxpr`` or ``ClosedJaxpr``.
      path: the output file; its suffix (``.svg``, ``.png``, ``.pdf``) picks
        the format unless ``format`` is given.
      format: a ``dot -T`` format.

    Returns:
      ``path`` as a string.

    Raises:
      RuntimeError: when ``dot`` is not installed (the message says how to
        install it) or fails.
    """
    path = os.fspath(path)
    fmt = format or os.path.splitext(path)[1].lstrip(".").lower() or "svg"
    exe = shutil.which("dot")
    if exe is None:
        raise RuntimeError(f"taxpr.ir.render({path!r}): {INSTALL_HINT}")
    proc = subprocess.run([exe, f"-T{fmt}", "-o", path], input=to_dot(jaxpr).encode(),
                          capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"taxpr.ir.render({path!r}): dot -T{fmt} failed: "
                           f"{proc.stderr.decode(errors='replace').strip()}")
    return path

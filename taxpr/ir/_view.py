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

import html as _html
import json
import os
from typing import Any

import jax

from . import _view_page
from ._view_diff import diff
from .._collector import collector_paused
from ._view_program import Pane as Pane, JAXPR_TYPES, as_closed, program as program

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


# ---- the public function -------------------------------------------------------------

def _closed(fn: Any, args: tuple, kwargs: dict) -> Any:
    if isinstance(fn, JAXPR_TYPES):
        return as_closed(fn)
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
        title = "jaxpr" if isinstance(fn, JAXPR_TYPES) else _name(fn, "jaxpr")
    with collector_paused():
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

"""``python -m taxpr.ir view ...``: write a viewer page (``taxpr.ir.view``)
from the command line.

    python -m taxpr.ir view model:loss --args 'f32[8,16],i32[8]' --out loss.html
    python -m taxpr.ir view model:CLOSED_JAXPR --out model.html
    python -m taxpr.ir view saved.json --out model.html

The program is ``module:name`` (a module importable from the current
directory or ``sys.path``) naming a function, traced with example arguments
given by ``--args`` (comma-separated ``dtype[shape]`` specs: ``f32[3,4]``,
``i32[]``, ``bf16[2]``, ``bool[5]``), or naming a ``ClosedJaxpr`` / ``Jaxpr``;
or a saved program: a ``.json`` file holding a page's ``HTML.data`` (written
with ``json.dump(ir.view(...).data, f)``: the program as the page shows it,
values, types, sources and site names included; JAX cannot pickle a jaxpr,
whose primitives and source tracebacks are not picklable). ``--compare``
adds a second program of the same kinds, shown beside the first with its
changes marked.

``python -m taxpr.ir.view ...`` runs the same command (``taxpr/ir/view.py``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from .. import _compat
from . import _view

DTYPES = {"f16": jnp.float16, "bf16": jnp.bfloat16, "f32": jnp.float32, "f64": jnp.float64,
          "i8": jnp.int8, "i16": jnp.int16, "i32": jnp.int32, "i64": jnp.int64,
          "u8": jnp.uint8, "u16": jnp.uint16, "u32": jnp.uint32, "u64": jnp.uint64,
          "bool": jnp.bool_, "c64": jnp.complex64, "c128": jnp.complex128}
_SPEC = re.compile(r"\s*(\w+)\[([\d,\s]*)\]\s*")


def parse_args_spec(spec: str) -> list[jax.ShapeDtypeStruct]:
    """``"f32[3,4],i32[]"`` as ``jax.ShapeDtypeStruct`` s.

    Arguments:
        spec: comma-separated ``dtype[shape]`` items; dtypes are
            ``DTYPES``' keys.

    Returns:
        One ``ShapeDtypeStruct`` per item.

    Raises:
        ValueError: an item is not ``dtype[shape]`` or names an unknown dtype.
    """
    out: list[jax.ShapeDtypeStruct] = []
    pos = 0
    spec = spec.strip()
    while pos < len(spec):
        m = _SPEC.match(spec, pos)
        if m is None:
            raise ValueError(f"--args: expected dtype[shape] at {spec[pos:]!r} "
                             f"(e.g. 'f32[3,4],i32[]')")
        dtype, dims = m.group(1), m.group(2)
        if dtype not in DTYPES:
            raise ValueError(f"--args: unknown dtype {dtype!r}; one of {', '.join(DTYPES)}")
        shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d)
        out.append(jax.ShapeDtypeStruct(shape, DTYPES[dtype]))
        pos = m.end()
        if pos < len(spec):
            if spec[pos] != ",":
                raise ValueError(f"--args: expected ',' at {spec[pos:]!r}")
            pos += 1
    return out


def load_program(target: str, args_spec: str | None, label: str) -> tuple[_view.Pane, str]:
    """The program ``target`` names (see the module docstring) laid out for
    the page with this label, and a title for it."""
    if os.path.isfile(target):
        with open(target, encoding="utf-8") as f:
            data = json.load(f)
        if not (isinstance(data, dict) and data.get("panes")):
            raise SystemExit(f"{target}: not a saved page's data (json.dump(page.data, f))")
        pane = _view.Pane.from_json(data["panes"][0])
        pane.label = label
        return pane, data.get("title") or os.path.basename(target)
    if ":" not in target:
        raise SystemExit(f"{target!r}: give module:function, module:jaxpr or a .json file")
    module_name, _, attr = target.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, _compat.JAXPR_TYPES):
        return _view.program(obj, label), attr
    if args_spec is None:
        raise SystemExit(f"{target} is a function: give its example arguments with --args "
                         f"(e.g. --args 'f32[3,4],i32[]')")
    return _view.program(jax.make_jaxpr(obj)(*parse_args_spec(args_spec)), label), attr


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m taxpr.ir",
        description="Tools of taxpr.ir. `view`: write an interactive HTML page of a program.")
    commands = parser.add_subparsers(dest="command", required=True)
    v = commands.add_parser("view", help="write an interactive HTML page of a program")
    v.add_argument("program", help="module:function (with --args), module:jaxpr, or a "
                                   "pickle file holding a ClosedJaxpr")
    v.add_argument("--args", help="example arguments: 'f32[3,4],i32[]'")
    v.add_argument("--compare", help="a second program, shown beside the first with its "
                                     "changes marked (same forms; traced with --args)")
    v.add_argument("--out", required=True, help="the HTML file to write")
    v.add_argument("--title", help="the page's title")
    ns = parser.parse_args(argv)
    first, title = load_program(ns.program, ns.args, "before" if ns.compare else "")
    title = ns.title or title
    if ns.compare is None:
        first.label = title
        data = _view.panes_data(title, first)
    else:
        data = _view.panes_data(title, first, load_program(ns.compare, ns.args, "after")[0])
    page = _view.HTML(_view.render_page(data), data)
    page.save(ns.out)
    print(f"wrote {ns.out}: {len(first.eqns)} equations")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""taxpr.ir.to_dot / render."""

from __future__ import annotations

import os
import re
import shutil
import stat

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import taxpr as tx
from taxpr import ir


def program(x):
    def body(c, _):
        jax.debug.print("c={c}", c=c)
        return lax.cond(c > 0, jnp.sin, jnp.cos, c) * 2.0, None
    return tx.tag(lax.scan(body, x, None, length=3)[0], op="out") + 1.0


def test_to_dot_has_a_node_per_equation_and_a_cluster_per_nested_jaxpr():
    j = jax.make_jaxpr(program)(jnp.float32(1.0))
    dot = ir.to_dot(j)
    assert dot.startswith('digraph "jaxpr" {') and dot.rstrip().endswith("}")
    assert dot.count("subgraph cluster_") == 3  # scan body, 2 cond branches
    assert 'label="scan[length=3]"' in dot and 'label="cond[branch=1]"' in dot
    assert "Var(id=" not in dot
    assert dot.count("{") == dot.count("}")
    # Inputs, outputs and equations are named as JAX's pretty-printer names them.
    text = str(j)
    (first,) = re.findall(r"lambda ; (\w+):f32\[\]", text)[:1]
    assert f'label="{first}:f32[]"' in dot
    for prim in ("scan", "cond", "sin", "cos", "tag", "add", "mul"):
        assert re.search(rf'= {prim}\b', dot), prim
    assert 'style="bold"' in dot  # the debug print has an effect


def test_render_without_dot_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    j = jax.make_jaxpr(program)(jnp.float32(1.0))
    with pytest.raises(RuntimeError, match="apt-get install graphviz"):
        ir.render(j, tmp_path / "g.svg")


def test_render_runs_dot_with_the_format_of_the_suffix(tmp_path, monkeypatch):
    # A stand-in `dot` that records its arguments and copies stdin to -o.
    fake = tmp_path / "bin" / "dot"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\n'
                    'while [ "$1" != "-o" ]; do shift; done\ncat > "$2"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    j = jax.make_jaxpr(program)(jnp.float32(1.0))
    out = ir.render(j, tmp_path / "g.png")
    assert open(out).read() == ir.to_dot(j)
    assert (fake.parent / "args").read_text().split()[0] == "-Tpng"


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_render_writes_an_svg_with_graphviz(tmp_path):
    j = jax.make_jaxpr(program)(jnp.float32(1.0))
    out = ir.render(j, tmp_path / "g.svg")
    assert "<svg" in open(out).read()


def test_edges_come_after_every_cluster_so_nodes_stay_in_their_own_cluster():
    # An edge written inside a cluster would pull the outer node into it.
    j = jax.make_jaxpr(lambda x: lax.scan(
        lambda c, _: (lax.cond(c > 0, jnp.sin, jnp.cos, c), None), x, None, length=2)[0])(1.0)
    lines = ir.to_dot(j).splitlines()
    last_cluster_end = max(i for i, line in enumerate(lines) if line == "}" and i < len(lines) - 1)
    edges = [i for i, line in enumerate(lines) if "->" in line]
    assert edges and min(edges) > last_cluster_end


def test_the_rendered_graph_in_the_docs_is_committed_and_shown():
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    svg = root / "docs" / "images" / "ir_graph.svg"
    assert svg.read_text().lstrip().startswith("<?xml") and "scan[length=4]" in svg.read_text()
    assert "images/ir_graph.svg" in (root / "docs" / "ir.md").read_text()

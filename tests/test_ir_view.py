"""``ir.view``'s page without a browser: one offline file, its embedded
program (containers, named scopes, values, sources, site names, tags) checked
against the jaxpr walked here independently of taxpr, the compare mode's
matching, and the command line (``python -m taxpr.ir view``). The page in
Chromium: ``test_ir_view_browser.py``."""

from __future__ import annotations

import inspect
import json
import os
import re
import runpy
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import taxpr as tx
from taxpr import ir
from taxpr.ir import _view
from taxpr.ir.__main__ import main as cli_main, parse_args_spec

from view_programs import eqn_list, inside, mixed_program, nesting, unrolled_program

ROOT = Path(__file__).resolve().parent.parent


def _embedded(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="data">(.*?)</script>', html, re.S)
    assert m is not None
    return json.loads(m.group(1))


def _sub_prims(pane: dict) -> Counter:
    return Counter(pane["P"][pane["E"][n[4]][0]] for n in pane["N"] if n[0] == "sub")


def test_page_is_one_file_with_nothing_from_the_network(tmp_path):
    model, args = mixed_program()
    page = ir.view(model, *args, out=tmp_path / "model.html")
    assert isinstance(page, ir.HTML) and page.path == str(tmp_path / "model.html")
    html = (tmp_path / "model.html").read_text()
    assert html == page.html == str(page)
    # No element loads anything: no src, no stylesheet link, no URL at all.
    assert not re.search(r"<(script|img|link|iframe)[^>]*\s(src|href)=", html)
    assert "http://" not in html and "https://" not in html
    assert _embedded(html) == json.loads(json.dumps(page.data))
    assert page.data["title"] == "mixed_program.<locals>.model"


def test_containers_are_the_nested_jaxprs_and_named_scopes():
    model, args = mixed_program()
    closed = jax.make_jaxpr(model)(*args)
    expected = nesting(closed)
    pane = ir.view(closed).data["panes"][0]
    assert len(pane["E"]) == expected.n_eqns
    assert _sub_prims(pane) == Counter(expected.subs_by_primitive)
    assert {"scan", "while", "cond", "custom_jvp_call", "custom_vjp_call"} <= set(
        expected.subs_by_primitive)
    assert {n[7] for n in pane["N"] if n[0] == "scope"} == expected.scopes == {
        "encoder", "encoder/mlp"}
    labels = {n[1] for n in pane["N"] if n[0] == "sub"}
    assert {"scan[length=4]", "while[cond]", "while[body]", "cond[branch=0]",
            "cond[branch=1]", "checkpoint", "custom_jvp", "custom_vjp"} <= labels
    # Every equation sits in one container; every container's children are
    # its equations (one without jaxprs) and containers, each listed once.
    listed = Counter()
    for i, n in enumerate(pane["N"]):
        for k in n[3]:
            listed[k] += 1
            if k >= 0:
                assert pane["E"][k][5] == i
            else:
                assert pane["N"][-k - 1][2] == i
    leaf_eqns = [e for e, q in enumerate(pane["E"])
                 if not any(n[0] == "sub" and n[4] == e for n in pane["N"])]
    assert sorted(k for k in listed if k >= 0) == leaf_eqns
    assert sorted(-k - 1 for k in listed if k < 0) == list(range(1, len(pane["N"])))
    assert set(listed.values()) == {1}


def test_values_have_types_and_equations_their_source_line():
    def f(x):
        y = jnp.sin(x)
        return jnp.cumsum(y.astype(jnp.int32))

    pane = ir.view(f, jnp.ones((2, 3))).data["panes"][0]
    closed = jax.make_jaxpr(f)(jnp.ones((2, 3)))
    eqns = eqn_list(closed)
    assert [pane["P"][q[0]] for q in pane["E"]] == [e.primitive.name for e in eqns]
    for q, eqn in zip(pane["E"], eqns):
        outs = [pane["T"][pane["V"][o][0]] for o in q[2]]
        assert outs == [v.aval.str_short(short_dtypes=True) for v in eqn.outvars]
    first = inspect.getsourcelines(f)[1]
    src = pane["S"][pane["E"][0][3]]
    assert src == f"test_ir_view.py:{first + 1} (test_values_have_types_and_equations_their_source_line.<locals>.f)"
    assert "f32[2,3]" in pane["T"] and "i32[2,3]" in pane["T"]


def test_site_names_are_the_names_tx_sites_gives():
    model, args = mixed_program()
    pane = ir.view(model, *args).data["panes"][0]
    names = [n for q in pane["E"] for n in q[4]]
    assert names == [s.name for s in tx.sites(model, *args)]
    assert pane["nSites"] == len(names) > 20
    assert "encoder/mlp/tanh" in names


def test_tags_states_sows_and_keys_are_marked():
    model, args = mixed_program()
    pane = ir.view(model, *args).data["panes"][0]
    tags = [tuple(q[7]) for q in pane["E"] if q[7]]
    assert tags == [("tag", "inputs"), ("state.get", "calls"), ("state.set", "calls"),
                    ("sow", "head"), ("key.get", "rng"), ("key.set", "rng")]


def test_a_value_leads_to_its_producer_and_consumers():
    def f(x):
        y = jnp.sin(x)
        return lax_scan_sum(y) + y

    def lax_scan_sum(y):
        return jax.lax.scan(lambda c, r: (c + r, None), jnp.zeros(3), y)[0]

    pane = ir.view(f, jnp.ones((4, 3))).data["panes"][0]
    prims = [pane["P"][q[0]] for q in pane["E"]]
    sin = prims.index("sin")
    y = pane["E"][sin][2][0]
    assert pane["V"][y] == [pane["V"][y][0], sin]  # produced by sin
    users = [e for e, q in enumerate(pane["E"]) if y in q[1]]
    assert [prims[e] for e in users] == ["scan", "add"]
    # The scan body's input row is bound to y.
    scan_node = next(i for i, n in enumerate(pane["N"]) if n[0] == "sub")
    row = pane["N"][scan_node][5][-1]
    assert pane["V"][row][1] == -scan_node - 1 and pane["B"][row] == y


# ---- compare mode -----------------------------------------------------------------

def test_compare_marks_what_optimize_jaxpr_removed():
    def f(x):
        a = jnp.sin(x)
        b = jnp.sin(x)  # the same as a: common subexpression
        _ = jnp.cos(x)  # dead
        return a + b * 1.0

    closed = jax.make_jaxpr(f)(jnp.ones(3))
    opt = ir.optimize_jaxpr(closed)
    page = ir.view(closed, compare=opt)
    left, right = (_view.Pane.from_json(p) for p in page.data["panes"])
    d = _view.diff(_view.program(closed), _view.program(opt))
    assert page.data["compare"] == {"removed": len(d.removed), "added": len(d.added),
                                    "rewritten": len(d.rewritten)}
    prims_left = [left.prims[q.prim] for q in left.eqns]
    assert sorted(prims_left[i] for i in d.removed) == ["cos", "mul", "sin"]
    # The sum now reads the first sin twice: rewritten.
    assert [(prims_left[i], right.prims[right.eqns[j].prim]) for i, j in d.rewritten] == [
        ("add", "add")]
    # What is not removed on the left is unchanged or rewritten on the right.
    kept = len(left.eqns) - len(d.removed)
    assert kept == len(right.eqns) - len(d.added)
    assert [q.mark for q in left.eqns].count("r") == len(d.removed)
    assert len(right.eqns) == len(opt.eqns)


def test_compare_finds_added_and_rewritten_equations():
    def before(x):
        return jnp.tanh(x) * 2.0

    def after(x):
        return jnp.exp(jnp.tanh(x.astype(jnp.float32))) * 2.0

    page = ir.view(before, jnp.ones(3, jnp.int32), compare=after)
    left, right = page.data["panes"]
    marks_left = {left["P"][q[0]]: q[6] for q in left["E"]}
    marks_right = {right["P"][q[0]]: q[6] for q in right["E"]}
    assert marks_right["exp"] == "a"
    assert marks_left["tanh"] == marks_right["tanh"] == ""
    assert page.data["compare"]["added"] == 1 and page.data["compare"]["removed"] == 0


def test_a_program_compared_with_itself_has_no_marks():
    f, args = unrolled_program(12)
    page = ir.view(f, *args, compare=f)
    assert page.data["compare"] == {"removed": 0, "added": 0, "rewritten": 0}


def test_compare_before_and_after_uncurry():
    def f(x):
        n = tx.get_state("n", init=jnp.zeros(()))
        tx.set_state("n", n + x.sum())
        return x * 2

    closed = jax.make_jaxpr(f)(jnp.ones(3))
    pure, state0 = tx.uncurry(f, jnp.ones(3))
    uncurried = jax.make_jaxpr(pure)(state0, jnp.ones(3))
    page = ir.view(closed, compare=uncurried)
    left = page.data["panes"][0]
    gone = [tuple(q[7]) for q in left["E"] if q[6] == "r"]
    assert ("state.get", "n") in gone and ("state.set", "n") in gone


# ---- Jupyter and the command line ------------------------------------------------------

def test_jupyter_shows_the_page_in_a_sandboxed_iframe():
    page = ir.view(jnp.sin, jnp.ones(2))
    shown = page._repr_html_()
    assert shown.startswith("<iframe") and 'sandbox="allow-scripts' in shown
    assert "&lt;!DOCTYPE html&gt;" in shown and "<script" not in shown


def test_args_spec():
    specs = parse_args_spec("f32[3,4], i32[],bf16[2],bool[5]")
    assert [(s.shape, s.dtype) for s in specs] == [
        ((3, 4), jnp.float32), ((), jnp.int32), ((2,), jnp.bfloat16), ((5,), jnp.bool_)]
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_args_spec("f33[1]")
    with pytest.raises(ValueError, match="expected dtype"):
        parse_args_spec("f32(3)")


MODULE = textwrap.dedent("""
    import jax, jax.numpy as jnp

    def loss(w, idx):
        with jax.named_scope("head"):
            return jnp.tanh(w[idx]).sum()

    CLOSED = jax.make_jaxpr(loss)(jnp.ones((3, 4)), jnp.int32(0))
""")


def test_command_line_writes_pages_and_ir_view_stays_the_function(tmp_path, monkeypatch,
                                                                    capsys):
    (tmp_path / "viewmod.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "loss.html"
    assert cli_main(["view", "viewmod:loss", "--args", "f32[3,4],i32[]", "--out", str(out)]) == 0
    data = _embedded(out.read_text())
    assert data["title"] == "loss"
    assert {n[7] for n in data["panes"][0]["N"] if n[0] == "scope"} == {"head"}
    assert "wrote" in capsys.readouterr().out

    # A saved page's data, compared with a module's ClosedJaxpr.
    saved = tmp_path / "loss.json"
    saved.write_text(json.dumps(data))
    both = tmp_path / "both.html"
    monkeypatch.setattr(sys, "argv", ["python -m taxpr.ir", "view", str(saved),
                                      "--compare", "viewmod:CLOSED", "--out", str(both)])
    # Run as `python -m` runs it: a fresh __main__ module.
    monkeypatch.delitem(sys.modules, "taxpr.ir.__main__")
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("taxpr.ir", run_name="__main__")
    assert exit_.value.code == 0
    compared = _embedded(both.read_text())
    assert compared["compare"] == {"removed": 0, "added": 0, "rewritten": 0}
    assert [p["label"] for p in compared["panes"]] == ["before", "after"]

    # Running the command did not replace the function by a module.
    from taxpr import ir as ir_again
    assert ir_again.view is _view.view and callable(ir_again.view)
    assert ir.view is _view.view


def test_importing_the_command_module_keeps_ir_view_callable(monkeypatch):
    import importlib

    from taxpr import ir
    # (the package's attribute and the module table restored afterwards)
    monkeypatch.setattr(ir, "view", ir.view)
    monkeypatch.delitem(sys.modules, "taxpr.ir.view", raising=False)
    module = importlib.import_module("taxpr.ir.view")
    monkeypatch.delitem(sys.modules, "taxpr.ir.view")
    assert ir.view is module or ir.view is _view.view
    page = ir.view(lambda x: jnp.sin(x) * 2.0, jnp.ones(3))
    assert [n for q in page.data["panes"][0]["E"] for n in q[4]] == ["sin", "mul"]


def test_command_line_in_a_fresh_process(tmp_path):
    (tmp_path / "viewmod.py").write_text(MODULE)
    out = tmp_path / "p.html"
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "taxpr.ir", "view", "viewmod:loss", "--args",
                           "f32[3,4],i32[]", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(_embedded(out.read_text())["panes"][0]["E"]) > 3
    # The same command as a module of its own.
    dotted = subprocess.run([sys.executable, "-m", "taxpr.ir.view", "viewmod:loss", "--args",
                             "f32[3,4],i32[]", "--out", str(out)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert dotted.returncode == 0, dotted.stderr[-2000:]
    assert "wrote" in dotted.stdout
    bad = subprocess.run([sys.executable, "-m", "taxpr.ir", "view", "viewmod:loss", "--out",
                          str(out)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--args" in bad.stderr


def test_the_docs_table_is_made_from_the_committed_benchmark_results():
    import importlib.util

    spec = importlib.util.spec_from_file_location("taxpr_docs_make_plots_view",
                                                  ROOT / "docs" / "make_plots.py")
    make_plots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_plots)
    results = json.loads((ROOT / "bench" / "results_view.json").read_text())
    table = make_plots.view_table()
    for row in results["rows"]:
        assert f"| {row['eqns']:,} | **{row['ratio']:.2f}**" in table
    assert results["rows"][0]["eqns"] >= 10_000 and results["rows"][-1]["eqns"] >= 50_000
    assert "<!-- bench-view-table -->" in (ROOT / "docs" / "ir.md").read_text()
    assert "bench-view-table" in (ROOT / "docs" / "hooks.py").read_text()


def test_a_shard_map_is_a_container():
    from jax.sharding import PartitionSpec as P

    from helpers import cpu_mesh, shard_map

    def f(x):
        with jax.named_scope("sharded"):
            return shard_map()(lambda v: jax.lax.psum(jnp.sin(v), "i"), mesh=cpu_mesh("i", 2),
                               in_specs=P("i"), out_specs=P())(x)

    closed = jax.make_jaxpr(f)(jnp.ones(4))
    expected = nesting(closed)
    pane = ir.view(closed).data["panes"][0]
    assert _sub_prims(pane) == Counter(expected.subs_by_primitive)
    shard = [n for n in pane["N"] if n[1] == "shard_map"]
    assert len(shard) == 1 and shard[0][7] == "sharded"
    body = [pane["P"][pane["E"][k][0]] for k in shard[0][3] if k >= 0]
    assert body[0] == "sin" and body[-1].startswith("psum")  # psum_invariant on newer JAX


def test_markup_in_names_stays_text():
    def f(x):
        with jax.named_scope("</script><b>scope"):
            return jnp.sin(x)

    page = ir.view(f, jnp.ones(2), title="<i>title</i></script>")
    assert page.html.count("</script>") == 2  # the data's and the program's elements
    assert "<i>title" not in page.html and "&lt;i&gt;title&lt;/i&gt;" in page.html
    data = _embedded(page.html)
    assert {n[7] for n in data["panes"][0]["N"] if n[0] == "scope"} == {"</script><b>scope"}


def test_a_high_level_operations_jaxprs_are_containers_without_site_names():
    def g(x):
        y = jnp.sin(x)
        r = jax.lax.custom_root(lambda t: t ** 2 - x, y,
                                lambda f, t0: t0 - f(t0) / (2 * t0), lambda f, t: t / 2)
        return jnp.cos(r)

    closed = jax.make_jaxpr(g)(2.0)
    root = next(e for e in closed.eqns if e.primitive.name not in ("sin", "cos"))
    pane = ir.view(closed).data["panes"][0]
    names = [n for q in pane["E"] for n in q[4]]
    assert names == [s.name for s in tx.sites(g, 2.0)]
    if root.primitive.name != "call_hi_primitive":  # custom_root binds custom_jvp_call
        assert _sub_prims(pane) == Counter(nesting(closed).subs_by_primitive)
        return
    assert names == ["sin", "cos"]
    held = [i for i, n in enumerate(pane["N"]) if n[1] == type(root.params["_prim"]).__name__]
    assert held, [n[1] for n in pane["N"]]
    held_eqns = [q for q in pane["E"] if any(inside(pane, q[5], h) for h in held)]
    assert held_eqns and all(q[4] == [] for q in held_eqns)



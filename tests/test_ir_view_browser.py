"""``ir.view``'s pages in headless Chromium: the container tree of a flax
``nn.scan`` transformer, opening a scan, search, the producers and consumers
of a clicked value, and the marks of a compare view, each checked against
the jaxpr walked independently of taxpr (``view_programs``).

Skipped without Chromium (``apt-get install chromium``). Marked ``slow`` in
``tests/conftest.py``.
"""

from __future__ import annotations

import json
from collections import Counter

import jax
import jax.numpy as jnp
import pytest

import taxpr as tx
from taxpr import ir

from headless_chromium import INSTALL_HINT, Browser, chromium
from view_programs import flax_transformer, inside, mixed_program, nesting, unrolled_program

pytestmark = pytest.mark.skipif(chromium() is None, reason=INSTALL_HINT)

OPEN_ALL = """(() => {
  for (let round = 0; round < 100; round++) {
    const closed = [...document.querySelectorAll('.c > .kids[hidden]')];
    const more = [...document.querySelectorAll('button.more')];
    if (!closed.length && !more.length) return round;
    closed.forEach(k => k.previousElementSibling.click());
    more.forEach(b => b.click());
  }
  return -1;
})()"""


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


@pytest.fixture(autouse=True)
def no_script_errors(browser):
    browser.errors.clear()
    yield
    assert browser.errors == [], browser.errors


def _open(browser, page, tmp_path, name="page.html"):
    path = tmp_path / name
    page.save(path)
    browser.open(path)
    assert browser.eval("window.taxprView !== undefined")
    return page.data


def _leaf(pane, e):
    """Whether equation ``e`` is drawn as a line (not as its containers)."""
    return not any(n[0] == "sub" and n[4] == e for n in pane["N"])


def test_flax_scan_transformer_shows_its_containers(browser, tmp_path):
    pytest.importorskip("flax.linen")
    apply, params, tokens = flax_transformer()
    closed = jax.make_jaxpr(apply)(params, tokens)
    expected = nesting(closed)
    pane = _open(browser, ir.view(closed), tmp_path)["panes"][0]

    # Collapsed: only the program's own children are drawn.
    top = pane["N"][0][3]
    assert browser.eval("document.querySelectorAll('.root > .e, .root > .c').length") == len(top)
    assert browser.eval("document.querySelectorAll('.e').length") == sum(1 for k in top if k >= 0)
    assert browser.eval(OPEN_ALL) > 0
    shown = browser.eval("""[...document.querySelectorAll('.c')].map(c => {
        const n = window.taxprView.data.panes[0].N[+c.dataset.n];
        const prim = c.querySelector(':scope > .h .eqline .prim');
        return [c.querySelector(':scope > .h .k').className, n[7], prim ? prim.textContent : null];
    })""")
    subs = Counter(prim for kind, _, prim in shown if kind == "k sub")
    assert subs == Counter(expected.subs_by_primitive) == Counter({"jit": 2, "scan": 1})
    scopes = {path for kind, path, _ in shown if kind == "k scope"}
    assert scopes == expected.scopes
    assert {"Transformer/blocks/attn", "Transformer/blocks/up", "Transformer/embed"} <= scopes
    lines = browser.eval("document.querySelectorAll('.e').length")
    assert lines == sum(_leaf(pane, e) for e in range(len(pane["E"])))


def test_opening_a_scan_draws_its_body(browser, tmp_path):
    model, args = mixed_program()
    pane = _open(browser, ir.view(model, *args), tmp_path)["panes"][0]
    scan = next(i for i, n in enumerate(pane["N"]) if n[1].startswith("scan["))
    body = pane["N"][scan][3]
    kids = f"document.querySelector('#p0n{scan} > .kids')"
    # The scan sits in the "encoder" scope: open that first.
    browser.click(f"#p0n{pane['N'][scan][2]} > .h")
    assert browser.eval(f"{kids}.hidden && {kids}.children.length") == 0
    browser.click(f"#p0n{scan} > .h")
    drawn = browser.eval(f"[...{kids}.children].map(el => el.id)")
    assert drawn == [f"p0e{k}" if k >= 0 else f"p0n{-k - 1}" for k in body]
    assert browser.eval(f"{kids}.hidden") is False
    assert browser.eval(f"document.querySelector('#p0n{scan} > .h .cnt').textContent") == (
        f"{sum(1 for e in pane['E'] if inside(pane, e[5], scan))} eqns")
    browser.click(f"#p0n{scan} > .h")  # closes again
    assert browser.eval(f"{kids}.hidden") is True


def test_search_finds_a_site_and_shows_it(browser, tmp_path):
    model, args = mixed_program()
    _open(browser, ir.view(model, *args), tmp_path)
    site = "encoder/mlp/tanh"
    assert site in [s.name for s in tx.sites(model, *args)]
    browser.eval(f"""(() => {{ const q = document.getElementById('q');
        q.value = {json.dumps(site)}; q.dispatchEvent(new Event('input')); }})()""")
    browser.eval("new Promise(r => setTimeout(r, 400))")
    results = browser.eval("[...document.querySelectorAll('#results .r')].map(r => r.textContent)")
    assert results and results[0].startswith(site)
    browser.click("#results .r")
    sel = browser.eval("""(() => { const el = document.querySelector('.e.sel');
        return el && [el.querySelector('.site').textContent, el.offsetParent !== null]; })()""")
    assert sel == [site, True]
    # The detail panel offers the selector to copy.
    assert browser.eval("document.querySelector('#detail .copy').dataset.copy") == json.dumps(site)
    # Enter goes to the first match of another query: a primitive.
    browser.eval("""(() => { const q = document.getElementById('q'); q.value = 'log1p';
        q.dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter'})); })()""")
    assert browser.eval("document.querySelector('.e.sel .prim').textContent") == "log1p"


def test_clicking_a_value_highlights_its_producers_and_consumers(browser, tmp_path):
    model, args = mixed_program()
    pane = _open(browser, ir.view(model, *args), tmp_path)["panes"][0]
    prims = [pane["P"][q[0]] for q in pane["E"]]
    scan = next(i for i, n in enumerate(pane["N"]) if n[1].startswith("scan["))
    tag = prims.index("tag")
    # The body's carry input, bound to the tagged input.
    carry = next(v for v in pane["N"][scan][5] if pane["B"].get(v) == pane["E"][tag][2][0])
    users = [e for e, q in enumerate(pane["E"]) if carry in q[1]]
    assert users  # the jitted block and the row sum
    browser.eval(f"window.taxprView.reveal(0, {users[0]})")
    browser.click(f'.v[data-v="{carry}"]')
    prod = browser.eval("[...document.querySelectorAll('.prod')].map(el => el.id || el.parentElement.id)")
    assert sorted(prod) == sorted([f"p0n{scan}", f"p0e{tag}"])

    def element(e):  # an equation with jaxprs is shown by its first container
        sub = next((i for i, n in enumerate(pane["N"]) if n[0] == "sub" and n[4] == e), None)
        return f"p0e{e}" if sub is None else f"p0n{sub}"

    cons = browser.eval("[...document.querySelectorAll('.cons')].map(el => el.id || el.parentElement.id)")
    assert sorted(cons) == sorted(element(e) for e in users)
    assert browser.eval("window.taxprView.selected.producers") == [-scan - 1, tag]


def test_compare_view_marks_each_change(browser, tmp_path):
    def f(x):
        a = jnp.sin(x)
        b = jnp.sin(x)
        _ = jnp.cos(x) * 3.0
        return jax.lax.scan(lambda c, r: (c + r * 1.0, None), a + b, x[None])[0]

    closed = jax.make_jaxpr(f)(jnp.ones(3))
    data = _open(browser, ir.view(closed, compare=ir.optimize_jaxpr(closed)), tmp_path)
    summary = data["compare"]
    assert summary["removed"] > 0
    text = browser.eval("document.getElementById('changes').textContent")
    for kind in ("removed", "added", "rewritten"):
        assert f"{summary[kind]} {kind}" in text
    marked = {(k, e) for k, p in enumerate(data["panes"]) for e, q in enumerate(p["E"]) if q[6]}
    seen = set()
    for _ in range(len(marked)):
        browser.click("#next")
        seen.add(tuple(browser.eval(
            "(() => { const el = document.querySelector('.sel'); const c = el.closest('[data-p]');"
            " const e = el.dataset.e !== undefined ? +el.dataset.e"
            " : window.taxprView.data.panes[+c.dataset.p].N[+c.dataset.n][4];"
            " return [+c.dataset.p, e]; })()")))
    assert seen == marked
    browser.eval(OPEN_ALL)
    for cls, kind in (("m-r", "removed"), ("m-a", "added")):
        n = browser.eval(f"document.querySelectorAll('.e.{cls}').length")
        assert n == summary[kind]


def test_a_ten_thousand_equation_page_opens_quickly(browser, tmp_path):
    f, args = unrolled_program(1100)
    page = ir.view(f, *args)
    n = len(page.data["panes"][0]["E"])
    assert n >= 10_000
    load_s = browser.open(page.save(tmp_path / "big.html"))
    ready_ms = browser.eval("window.taxprView.readyMs")
    # A second on a quiet machine (bench/bench_view.py reports it); loose
    # here, for busy test machines.
    assert load_s < 5 and ready_ms < 5000, (load_s, ready_ms)
    assert browser.eval("document.querySelectorAll('.e, .c').length") <= 301

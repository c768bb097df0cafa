"""The jaxpr toolchain page's screenshots of ``taxpr.ir.view``, taken in
headless Chromium (``tests/headless_chromium.py``):

* ``docs/images/view_transformer.png``: a flax linen transformer whose
  blocks are one ``nn.scan``, the scan and an attention scope opened, a
  value clicked (its producer outlined blue, its consumers green);
* ``docs/images/view_compare.png``: a program before and after
  ``ir.optimize_jaxpr``, side by side, its changes marked.

Run: ``python docs/make_view_shots.py`` with a Python that has taxpr and
flax installed, and Chromium (``apt-get install chromium``).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's taxpr
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from taxpr import ir  # noqa: E402

from headless_chromium import Browser  # noqa: E402
from view_programs import flax_transformer  # noqa: E402

IMAGES = ROOT / "docs" / "images"


def transformer_shot(browser: Browser, tmp: Path) -> Path:
    apply, params, tokens = flax_transformer()
    page = ir.view(apply, params, tokens, out=tmp / "transformer.html",
                   title="Transformer.apply")
    browser.open(page.path)
    pane = page.data["panes"][0]
    scan = next(i for i, n in enumerate(pane["N"]) if n[1].startswith("scan["))
    scopes = {n[7]: i for i, n in enumerate(pane["N"]) if n[0] == "scope"}
    attn = scopes["Transformer/blocks/attn"]
    logits = scopes["Transformer/blocks/attn/...qhd,...khd->...hqk"]
    # Open the scan and the attention scope, click the attention logits
    # (their producer and consumers outlined), and search the up projection.
    browser.eval(f"window.taxprView.reveal(0, {-attn - 1}); window.taxprView.open(0, {attn})")
    first = next(k for k in pane["N"][logits][3] if k >= 0)
    browser.eval(f"window.taxprView.reveal(0, {first})")
    browser.click(f'#p0e{first} .v')
    browser.eval("""(() => { const q = document.getElementById('q');
        q.value = 'blocks/up'; q.dispatchEvent(new Event('input')); })()""")
    browser.eval("new Promise(r => setTimeout(r, 300))")
    browser.eval(f"document.getElementById('p0n{scan}').scrollIntoView()")
    browser.eval("document.getElementById('pane0').scrollTop -= 40")
    out = IMAGES / "view_transformer.png"
    browser.screenshot(out)
    return out


def compare_program(x):
    a = jnp.sin(x)
    b = jnp.sin(x)  # the same as a
    jnp.cos(x) * 3.0  # dead code

    def body(c, r):
        return c + r * 1.0, c * 2.0

    c, ys = lax.scan(body, a + b, jnp.stack([x, x]))
    return c + ys.sum(0) * 0.0 + 1.0


def compare_shot(browser: Browser, tmp: Path) -> Path:
    closed = jax.make_jaxpr(compare_program)(jnp.ones(3))
    page = ir.view(closed, compare=ir.optimize_jaxpr(closed), out=tmp / "compare.html",
                   title="optimize_jaxpr", labels=("traced", "optimize_jaxpr"))
    browser.open(page.path)
    for k in (0, 1):  # every container open
        for n in range(1, len(page.data["panes"][k]["N"])):
            browser.eval(f"window.taxprView.open({k}, {n})")
    browser.click("#next")
    out = IMAGES / "view_compare.png"
    browser.screenshot(out)
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, Browser(width=1500, height=760) as browser:
        for shot in (transformer_shot, compare_shot):
            print("wrote", shot(browser, Path(tmp)))
        assert not browser.errors, browser.errors


if __name__ == "__main__":
    main()

"""The built documentation site as a browser shows it.

Renders pages of the site that ``mkdocs build`` writes into ``site/`` in
headless Chromium (``--dump-dom``: the page after its scripts ran) and
checks that each shows every code block and image of its Markdown source,
and that every image it shows is a file of the site. Skipped when Chromium
or the built site is missing (``pip install -e '.[docs]' && mkdocs build``;
``apt-get install chromium``). Marked ``slow`` in ``tests/conftest.py``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "site"
DOCS = ROOT / "docs"
PAGES = ["index", "state", "ir", "performance", "utilities", "getting-started"]
FENCE = re.compile(r"^```(\w*)[ \t]*\n.*?^```[ \t]*$", re.DOTALL | re.MULTILINE)
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if path := shutil.which(name):
            return path
    return None


def _html(page: str) -> Path:
    return SITE / "index.html" if page == "index" else SITE / page / "index.html"


def _rendered(page: str) -> str:
    proc = subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
         _html(page).as_uri()],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


pytestmark = [
    pytest.mark.skipif(_chromium() is None, reason="no Chromium (apt-get install chromium)"),
    pytest.mark.skipif(not (SITE / "index.html").exists(),
                       reason="the site is not built (mkdocs build)"),
]


@pytest.mark.parametrize("page", PAGES)
def test_rendered_page_shows_its_code_blocks_and_images(page):
    source = (DOCS / f"{page}.md").read_text()
    dom = _rendered(page)
    assert "<article" in dom and "</article>" in dom
    article = dom.split("<article", 1)[1].split("</article>", 1)[0]

    # Every fenced block of the source is a highlighted code block.
    fences = FENCE.findall(source)
    blocks = re.findall(r'<div class="(?:language-\w+ )?highlight">', article)
    assert len(blocks) == len(fences), (page, len(blocks), len(fences))
    python_code = [m.group(0) for m in FENCE.finditer(source) if m.group(1) == "python"]
    for block in python_code:  # the first statement of each, as text
        first = next(line for line in block.splitlines()[1:] if line.strip())
        words = re.findall(r"\w+", first)
        assert all(w in article for w in words), (page, first)

    # Every image of the source is shown, and is a file of the built site.
    images = IMAGE.findall(source)
    srcs = re.findall(r'<img [^>]*src="([^"]+)"', article)
    assert len(srcs) == len(images), (page, srcs, images)
    for src in srcs:
        url = urlparse(urljoin(_html(page).as_uri(), src))
        path = Path(unquote(url.path))
        assert path.is_file() and path.stat().st_size > 0, (page, src)
        if path.suffix == ".svg":
            assert "<svg" in path.read_text()[:2000], (page, src)


def test_built_site_has_every_page_of_the_navigation():
    for md in DOCS.glob("*.md"):
        assert _html(md.stem).is_file(), md.name

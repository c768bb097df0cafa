"""mkdocs hooks (mkdocs.yml ``hooks:``): draw the performance plots before
every build and fill in the table of benchmark figures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "taxpr_docs_make_plots", Path(__file__).resolve().parent / "make_plots.py")
make_plots = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_plots)

# Where a page asks for the generated table of bench/results.json's figures.
FIGURES_TABLE = "<!-- bench-figures-table -->"


def on_pre_build(config, **kwargs) -> None:
    # Before mkdocs collects the files, so the plots are part of the site.
    make_plots.write_plots()


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if FIGURES_TABLE in markdown:
        markdown = markdown.replace(FIGURES_TABLE, make_plots.figures_table(make_plots.load_results()))
    return markdown

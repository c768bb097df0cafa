"""mkdocs hooks (mkdocs.yml ``hooks:``): draw the performance plots before
every build and fill in the performance page's tables, generated from the
committed benchmark results (``bench/results*.json``), so that each number
has one source."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "taxpr_docs_make_plots", Path(__file__).resolve().parent / "make_plots.py")
make_plots = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(make_plots)

# Where a page asks for a generated table: marker -> the table's Markdown.
TABLES = {
    "<!-- bench-figures-table -->": lambda: make_plots.figures_table(make_plots.load_results()),
    "<!-- bench-headline-table -->": lambda: make_plots.headline_table(make_plots.load_all_results()),
    "<!-- bench-dispatch-table -->": lambda: make_plots.dispatch_table(make_plots.load_all_results()),
    "<!-- bench-states-table -->": lambda: make_plots.states_table(),
    "<!-- debug-tools-table -->": lambda: make_plots.debug_tools_table(),
    "<!-- progress-tools-table -->": lambda: make_plots.progress_tools_table(),
    "<!-- bench-view-table -->": lambda: make_plots.view_table(),
    "<!-- coming-from-brainstate-bench -->": lambda: make_plots.coming_from_table(),
    "<!-- bench-gpu-table -->": lambda: make_plots.gpu_table(
        make_plots.load_results(make_plots.GPU_RESULTS)),
}


def on_pre_build(config, **kwargs) -> None:
    # Before mkdocs collects the files, so the plots are part of the site.
    make_plots.write_plots()


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    for marker, table in TABLES.items():
        if marker in markdown:
            markdown = markdown.replace(marker, table())
    return markdown

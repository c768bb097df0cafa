"""Watching compiled loops run: progress bars (``progress``) and live taps
of intermediate values (``tap``), on unmodified code.

Modules: ``_loops`` (a traced program run again with its selected loops
bound with an iteration count and host callbacks around and in them),
``_display`` (bars: ``tqdm`` or plain lines), ``_progress``, ``_tap``.
The host callbacks are ``taxpr._host``'s, shared with ``taxpr._debug``.
"""

from ._display import LoopInfo as LoopInfo, PlainDisplay as PlainDisplay
from ._progress import progress as progress
from ._tap import tap as tap

__all__ = ["LoopInfo", "PlainDisplay", "progress", "tap"]

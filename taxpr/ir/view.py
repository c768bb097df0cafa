"""``python -m taxpr.ir.view program --out page.html``: the same command as
``python -m taxpr.ir view ...`` (``taxpr/ir/__main__.py``).

Run with ``-m``, this file is never imported as ``taxpr.ir.view``, so the
package's ``view`` stays the function. Imported explicitly
(``import taxpr.ir.view``), Python makes the package's ``view`` attribute
this module: the module is then callable as the function is
(``ir.view(fn, *args, out=...)``).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from . import _view


class _CallableModule(types.ModuleType):
    """This module, callable as ``taxpr.ir.view`` the function."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _view.view(*args, **kwargs)


if __name__ == "__main__":
    from .__main__ import main

    sys.exit(main(["view", *sys.argv[1:]]))
else:
    sys.modules[__name__].__class__ = _CallableModule

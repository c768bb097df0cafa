"""Names in the code ``jaxpr_to_python_code`` generates: the modules it
imports, the names it never uses for a variable (``RESERVED``), variable
names per function (``Names``) and identifiers made from hints
(``identifier``)."""

from __future__ import annotations

import builtins
import keyword

__all__ = ["IMPORT_LINES", "RESERVED", "Names", "identifier"]

# Module aliases the generated code imports (never used as variable names).
IMPORT_LINES = ("import jax", "import jax.numpy as jnp", "import numpy as np",
                "from jax import lax")
_IMPORT_NAMES = frozenset({"jax", "jnp", "np", "lax", "taxpr", "OBJECTS"})
RESERVED = (frozenset(keyword.kwlist) | frozenset(keyword.softkwlist)
            | frozenset(dir(builtins)) | _IMPORT_NAMES)


class Names:
    """Variable names of one function: a, b, ..., z, ba, bb, ... (the
    pretty-printer's scheme) minus reserved words."""

    def __init__(self):
        self.n = 0

    def fresh(self) -> str:
        while True:
            i, s = self.n, ""
            self.n += 1
            while True:
                s = chr(ord("a") + i % 26) + s
                i //= 26
                if i == 0:
                    break
            if s not in RESERVED:
                return s


def identifier(hint: str) -> str:
    """A Python identifier made from ``hint`` (other characters become
    underscores)."""
    s = "".join(c if c.isalnum() or c == "_" else "_" for c in hint).strip("_") or "fn"
    return s if not s[0].isdigit() else "_" + s

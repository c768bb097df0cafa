"""Debugging compiled code: where a NaN was born (``debug_nans``) and
errors raised from inside ``jit`` (``error_if`` / ``checked``).

Modules: ``_eager`` (the eager interpreter that blames each non-finite
value on the equation where it was born), ``_notify`` (a host callback run
only when a device flag is set, told the ``vmap`` example), ``_nans``
(``debug_nans``), ``_checks`` (``error_if``, ``checked``).
"""

from ._eager import Origin as Origin
from ._nans import NonFiniteError as NonFiniteError, debug_nans as debug_nans
from ._checks import CheckError as CheckError, checked as checked, error_if as error_if

__all__ = ["CheckError", "NonFiniteError", "Origin", "checked", "debug_nans", "error_if"]

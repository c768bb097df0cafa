"""Shared helpers of the ecosystem suite (imported as `ecohelpers`)."""
import jax
import numpy as np

import taxpr as tx

# What counts as a clear taxpr error where taxpr cannot see inside a library:
# its message must name the state or sow.
CLEAR_ERRORS = (tx.StateError, ValueError, NotImplementedError)


def eager_or_clear_error(thunk, check, *names):
    """Run `thunk`; either `check(result)` passes or it raised a clear error
    naming one of `names` (used only where the brief allows an error)."""
    try:
        result = thunk()
    except CLEAR_ERRORS as err:
        msg = str(err)
        assert any(name in msg for name in names), (
            f"{type(err).__name__} does not name any of {names}: {msg[:500]}")
        return None
    check(result)
    return result


class Counter:
    """A run-time count with `jax.debug.callback`, independent of taxpr."""

    def __init__(self):
        self.n = 0

    def _inc(self):
        self.n += 1

    def tick(self):
        jax.debug.callback(self._inc, ordered=False)

    def reset(self):
        self.n = 0


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)

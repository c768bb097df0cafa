"""Shared helpers of the ecosystem suite (imported as `ecohelpers`)."""
import jax
import numpy as np

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

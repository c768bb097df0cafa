"""The fuzzer's profiles: hypothesis settings per test.

CI (``ci_settings``): fixed counts of programs (``SHARES``), derandomized.
The long profile (``long_settings``; ``TAXPR_FUZZ_LONG=1`` makes the CI
tests use it too, ``pytest -m long`` runs its own tests):
``TAXPR_FUZZ_EXAMPLES`` programs in all (default 20,000), split in the
proportions of ``SHARES``, derandomized unless ``TAXPR_FUZZ_SEED`` seeds it.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


LONG = os.environ.get("TAXPR_FUZZ_LONG") == "1"
LONG_EXAMPLES = int(os.environ.get("TAXPR_FUZZ_EXAMPLES", "20000"))
_SEED = os.environ.get("TAXPR_FUZZ_SEED")


def ci_settings(n: int):
    """``n`` examples in CI (fixed, derandomized); the long profile's share of
    LONG_EXAMPLES when TAXPR_FUZZ_LONG=1."""
    if LONG:
        return long_settings(n)
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


# Programs per check in CI; the long profile splits LONG_EXAMPLES in these proportions.
# "as_users_run": each program is warmed up, uncurried, run eagerly and
# jitted (about 0.5 s each on a 2-core machine).
SHARES = {"uncurry": 120, "uncurry_jit": 50, "reap": 100, "harvest": 90, "raw": 40, "vmap": 50,
          "derivatives": 50, "grad_inside": 40, "tx_grad_inside": 40, "vmap_inside": 30, "as_users_run": 40,
          "disable_jit": 30}


def long_settings(n: int):
    # The long tests' counts add up to LONG_EXAMPLES (rounded up).
    count = max(1, -(-LONG_EXAMPLES * n // sum(SHARES.values())))
    return settings(max_examples=count, deadline=None, database=None, derandomize=_SEED is None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def _seeded(test, long: bool = False):
    """TAXPR_FUZZ_SEED=S seeds the long profile (else it is derandomized)."""
    if _SEED is not None and (LONG or long):
        from hypothesis import seed
        return seed(int(_SEED))(test)
    return test


def _seeded_long(test):
    return _seeded(test, long=True)

"""The ecosystem suite: taxpr inside real JAX libraries.

Each file mirrors one library and starts with `pytest.importorskip` of it, so
a missing library skips that whole file (and only it). Every test compares
with a reference computed without taxpr: a Python loop with a dict, the
library's own statistics, a `jax.debug.callback` count of the same program
without taxpr, or a hand-threaded version. Install the libraries with
`pip install -e '.[ecosystem]'`.
"""
import pytest

# The importable module each file needs (a file whose library is missing is
# skipped by its own `pytest.importorskip`; listed here for `-m ecosystem`).
LIBRARIES = {
    "test_diffrax.py": "diffrax",
    "test_optimistix.py": "optimistix",
    "test_lineax.py": "lineax",
    "test_equinox.py": "equinox",
    "test_optax.py": "optax",
    "test_flax_linen.py": "flax.linen",
    "test_flax_nnx.py": "flax.nnx",
    "test_jax_primitives.py": "jax",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in LIBRARIES and item.path.parent.name == "ecosystem":
            item.add_marker(pytest.mark.ecosystem)

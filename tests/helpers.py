"""Small helpers shared by the tests (version-agnostic)."""

from __future__ import annotations

import collections
import contextlib
import re

import jax
from jax._src import core

import taxpr as tx

# 0.12 merged ClosedJaxpr into Jaxpr.
MERGED_JAXPR = not hasattr(core, "ClosedJaxpr")


def check(j) -> None:
    """``core.check_jaxpr`` on a Jaxpr or ClosedJaxpr (0.10 and 0.12 forms)."""
    if hasattr(j, "jaxpr") and hasattr(j, "consts") and not MERGED_JAXPR:
        j = j.jaxpr
    core.check_jaxpr(j)


def n_tags(j, **match) -> int:
    """Number of tag equations in ``j`` whose params include ``match``."""
    return sum(all(s.params.get(k) == v for k, v in match.items())
               for s in tx.find_tags(j))


def tag_paths(j, **match) -> list[tuple[str, ...]]:
    return [s.path for s in tx.find_tags(j)
            if all(s.params.get(k) == v for k, v in match.items())]


def cpu_devices(n: int = 4) -> list:
    """``n`` CPU devices (the simulated host devices of conftest.py) whatever
    the default backend is, so multi-device tests run the same on a GPU
    machine; skips the test when fewer exist."""
    import pytest

    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.skip(f"needs {n} CPU devices, found {len(devices)} (set XLA_FLAGS="
                    f"--xla_force_host_platform_device_count={n} before importing jax)",
                    allow_module_level=True)
    return devices[:n]


def cpu_mesh(axis: str, n: int = 4):
    """A 1-d ``Mesh`` of ``n`` CPU devices named ``axis`` (see ``cpu_devices``)."""
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(cpu_devices(n)), (axis,))


def shard_map():
    """``shard_map`` from wherever this JAX version has it."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map as sm  # pragma: no cover
    return sm


def closed_call(closed_jaxpr, *args):
    """Bind ``closed_call`` (0.10) / ``eval_jaxpr`` (0.12) on ``closed_jaxpr``.

    0.10's ClosedCallPrimitive needs the ``subfuns`` param that
    ``get_bind_params`` builds; 0.12's ``get_bind_params`` is the identity.
    """
    p = core.closed_call_p
    return p.bind(*args, **p.get_bind_params({"call_jaxpr": closed_jaxpr}))


_HLO_OP = re.compile(r"\s*(?:ROOT )?%?[\w.\-]+ = [^=]*? ([a-z][\w\-]*)\(")


def hlo_ops(text: str) -> collections.Counter:
    """Multiset of instruction op names in an optimized HLO module's text."""
    ops: collections.Counter = collections.Counter()
    for line in text.splitlines():
        line = re.sub(r", metadata=\{.*?\}", "", line)
        m = _HLO_OP.match(line)
        if m:
            ops[m.group(1)] += 1
    return ops


def all_effects(j) -> set:
    """The union of the effects of ``j``, its equations and nested jaxprs."""
    from taxpr import _traverse

    out = set(j.effects)
    for eqn, _ in _traverse.iter_eqns(j):
        out |= set(eqn.effects)
        for _, sj in _traverse.subjaxprs(eqn):
            out |= set(sj.effects)
    return out


def assert_same_bits(got, want) -> None:
    """``got`` has ``want``'s dtype and, bit for bit, its values (compared as
    unsigned integers of the dtype's width: bfloat16, the float8s and int4
    included; complex and bool as values)."""
    import numpy as np

    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    if want.dtype.kind in "cb":
        np.testing.assert_array_equal(got, want)
    else:
        width = f"u{want.dtype.itemsize}"
        np.testing.assert_array_equal(got.view(width), want.view(width))


@contextlib.contextmanager
def thread_rules_restored():
    """The registry of thread rules as it was, after the block (code that
    registers a rule, such as docs/extending.md's, keeps it out of the other
    tests)."""
    from taxpr._engine import THREAD_RULES
    saved = dict(THREAD_RULES)
    try:
        yield THREAD_RULES
    finally:
        THREAD_RULES.clear()
        THREAD_RULES.update(saved)

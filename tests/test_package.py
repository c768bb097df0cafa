"""The package's public surface: version, ``__all__``, ``dir``."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.extend

import taxpr as tx


def test_version_matches_pyproject():
    text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
    (version,) = re.findall(r'^version = "([^"]+)"', text, flags=re.M)
    assert tx.__version__ == version


def test_all_names_exist_and_are_public():
    assert tx.__all__, "taxpr.__all__ is empty"
    for name in tx.__all__:
        assert not name.startswith("_"), name
        assert hasattr(tx, name), name


def test_dir_lists_no_private_modules():
    names = dir(tx)
    assert "__version__" in names
    assert not [n for n in names if n.startswith("_") and n != "__version__"]
    assert set(tx.__all__) <= set(names)


def test_every_public_function_has_a_docstring():
    import inspect

    objs = {n: getattr(tx, n) for n in tx.__all__}
    # Everything public is a function, class or module with its own
    # docstring, except the tag primitive (a JAX Primitive instance).
    documented = {n: o for n, o in objs.items()
                  if inspect.isfunction(o) or inspect.isclass(o) or inspect.ismodule(o)}
    assert set(objs) - set(documented) == {"tag_p"}
    assert isinstance(tx.tag_p, jax.extend.core.Primitive)
    missing = [n for n, o in documented.items() if not (o.__doc__ or "").strip()]
    assert not missing, missing


def test_compatibility_names_are_the_recommended_objects():
    # taxpr 0.0.3's names keep working: each is the very object of the
    # self-explaining name the documentation uses.
    assert tx._COMPATIBILITY_NAMES == {
        "make_jaxpr": "make_jaxpr_with_states",
        "partial": "fix_inputs",
        "tcj_transpose": "TypedClosedJaxpr.transpose",
        "tcj_partition_out": "TypedClosedJaxpr.partition_out",
    }
    for old, new in tx._COMPATIBILITY_NAMES.items():
        obj = tx
        for part in new.split("."):
            obj = getattr(obj, part)
        assert getattr(tx, old) is obj, (old, new)
        assert old in tx.__all__ and new.split(".")[0] in tx.__all__

"""The code's layers, read from its imports.

Every import of a taxpr module points to a layer below it (or to its own
layer, without a cycle); JAX's private modules (``jax._src``) are imported
only by the adapter layer and by the replacements of JAX's rules;
``docs/development.md``'s layer picture is this module's ``LAYERS``
(``python tests/test_layers.py`` writes it there).
"""

from __future__ import annotations

import ast
import pathlib
import sys
import textwrap
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "taxpr"
DOCS = ROOT / "docs" / "development.md"


class Layer(NamedTuple):
    name: str
    units: tuple[str, ...]  # modules or packages directly under taxpr/
    says: str  # what the layer does, for the picture


# Bottom to top. A unit is a module (``_engine``) or a package (``_state``)
# directly under ``taxpr/``; ``taxpr`` is the package's ``__init__``.
LAYERS = (
    Layer("adapter", ("_compat", "_jaxpr", "_jax"),
          "JAX's versions and private modules: feature detection (_compat), jaxpr "
          "building (_jaxpr), the switches set while JAX traces and the private "
          "modules taxpr uses (_jax)"),
    Layer("base", ("_traverse", "_libraries", "primitives", "_find", "_dependence",
                   "_per_example", "_host", "_calls", "_collector"),
          "the tag primitive and its own rules (primitives), one traversal of nested "
          "jaxprs (_traverse), what taxpr knows of equinox and flax (_libraries), "
          "selecting tags (_find), data dependence, per-example values under vmap "
          "(_per_example), host callbacks that know vmap (_host), a call's static and "
          "array arguments (_calls), the garbage collector paused during a rewrite "
          "(_collector)"),
    Layer("engine", ("_replay", "_engine", "_guards", "_expand", "_inject"),
          "one interpreter with thread rules per Primitive (_engine), replayed "
          "backward passes, guards of batched predicates, expanding high-level "
          "primitives, inject"),
    Layer("clients", ("_state", "harvest", "_random", "_dataflow", "_typed", "_debug"),
          "effects as site rules and hooks of the engine: states, sow/reap/plant, "
          "keys; jaxpr utilities; debug_nans and error_if (_debug)"),
    Layer("clients of clients", ("_capture", "select", "_watch", "_lanes", "_loops", "ir"),
          "capture and patch of any equation (harvest sows inserted at the sites); "
          "progress bars and taps of loops (_watch); states per vmap lane (_lanes), a bounded while loop "
          "that reverse-differentiates (_loops); taxpr.ir (its viewer names values as "
          "tx.sites does)"),
    Layer("patches", ("_patches",),
          "every replacement of JAX's own rules, installed by `import taxpr`"),
    Layer("package", ("taxpr",), "the public names (taxpr/__init__.py)"),
)

# Where ``jax._src`` may be imported.
JAX_PRIVATE_ALLOWED = {"_compat", "_jaxpr", "_jax", "_patches"}


class Import(NamedTuple):
    module: str  # the importing module, dotted
    target: str  # the imported taxpr module (or package), dotted
    names: tuple[str, ...]  # names imported from it (empty for ``import x``)
    in_function: bool
    line: int
    type_only: bool  # under ``if TYPE_CHECKING:`` (annotations only, never run)


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _function_nodes(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(node) if n is not node)
    return inside


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING",
                                                                     "typing.TYPE_CHECKING"):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def _resolve(module: str, node: ast.ImportFrom) -> str | None:
    if not node.level:
        return node.module
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports() -> tuple[list[Import], dict[str, list[int]]]:
    """Every import of a taxpr module, and per module the lines that import
    ``jax._src``."""
    found, private = [], {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        inside = _function_nodes(tree)
        typing_only = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("jax._src"):
                        private.setdefault(module, []).append(node.lineno)
                    if alias.name.startswith("taxpr."):
                        found.append(Import(module, alias.name, (), id(node) in inside,
                                            node.lineno, id(node) in typing_only))
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, node)
                if target is None:
                    continue
                if target.startswith("jax._src") or (
                        target == "jax" and any(a.name == "_src" for a in node.names)):
                    private.setdefault(module, []).append(node.lineno)
                if target != "taxpr" and not target.startswith("taxpr."):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    at = (id(node) in inside, node.lineno, id(node) in typing_only)
                    if sub in MODULES:  # ``from . import _engine``
                        found.append(Import(module, sub, (), *at))
                    else:
                        found.append(Import(module, target, (alias.name,), *at))
    return found, private


IMPORTS, JAX_PRIVATE = _imports()


def unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "taxpr"


def layer_of(module: str) -> int:
    u = unit(module)
    for i, layer in enumerate(LAYERS):
        if u in layer.units:
            return i
    raise AssertionError(f"{module} ({u}) is in no layer of LAYERS: add it to one")


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)
    listed = [u for layer in LAYERS for u in layer.units]
    assert len(listed) == len(set(listed)), listed
    present = {unit(m) for m in MODULES}
    assert set(listed) <= present, set(listed) - present


def test_imports_point_down_the_layers():
    wrong = [f"{i.module}:{i.line} imports {i.target} ({LAYERS[layer_of(i.target)].name}, "
             f"above {LAYERS[layer_of(i.module)].name})"
             for i in IMPORTS if layer_of(i.target) > layer_of(i.module)]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle_counting_imports_inside_functions():
    # Imports for annotations only (``if TYPE_CHECKING:``) never run.
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for i in IMPORTS:
        if i.target != i.module and not i.type_only:
            graph[i.module].add(i.target)
    # A package's __init__ imports its modules; a module importing a name
    # from its own package goes to the module that defines it, so an edge to
    # an enclosing package is not a cycle by itself.
    for m in graph:
        graph[m] = {t for t in graph[m] if not m.startswith(t + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_no_taxpr_module_is_imported_inside_a_function():
    inside = [f"{i.module}:{i.line} imports {i.target}" for i in IMPORTS if i.in_function]
    assert not inside, "\n".join(inside)


def test_jax_private_modules_only_in_the_adapter_and_the_patches():
    outside = {m: lines for m, lines in JAX_PRIVATE.items()
               if unit(m) not in JAX_PRIVATE_ALLOWED}
    assert not outside, f"jax._src imported outside the adapter layer: {outside}"


def test_the_patches_are_imported_by_the_package_alone():
    importers = {i.module for i in IMPORTS
                 if unit(i.target) == "_patches" and unit(i.module) != "_patches"}
    assert importers == {"taxpr"}, importers


def test_no_private_name_is_imported_from_another_module():
    private = [f"{i.module}:{i.line} imports {n} from {i.target}"
               for i in IMPORTS for n in i.names
               if n.startswith("_") and not n.startswith("__")]
    assert not private, "\n".join(private)


# ---- the picture in docs/development.md ----------------------------------------

BEGIN, END = "<!-- layers: begin (tests/test_layers.py writes this) -->", "<!-- layers: end -->"


def render_layers() -> str:
    lines = ["```text"]
    for layer in reversed(LAYERS):
        lines.append(f"{layer.name:<19} {', '.join(layer.units)}")
        lines.extend(textwrap.wrap(layer.says, 78, initial_indent=" " * 22,
                                   subsequent_indent=" " * 22))
    lines.append("```")
    return "\n".join([BEGIN, *lines, END])


def test_the_layer_picture_in_the_development_docs_is_the_codes():
    text = DOCS.read_text()
    assert BEGIN in text and END in text, f"{DOCS} has no layer picture markers"
    current = text[text.index(BEGIN):text.index(END) + len(END)]
    assert current == render_layers(), (
        "docs/development.md's layer picture differs from tests/test_layers.py's LAYERS: "
        "run `python tests/test_layers.py` to write it")


if __name__ == "__main__":
    text = DOCS.read_text()
    new = text[:text.index(BEGIN)] + render_layers() + text[text.index(END) + len(END):]
    DOCS.write_text(new)
    print(f"wrote the layer picture into {DOCS}", file=sys.stderr)

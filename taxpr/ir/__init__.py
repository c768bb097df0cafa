"""The jaxpr toolchain: optimization passes that work inside every nested
jaxpr, jaxpr building and jit inlining, Python code generation, Graphviz
graphs and an interactive HTML viewer. Names follow brainstate's transform module where it has them."""

from ._build import (
    eqns_to_closed_jaxpr as eqns_to_closed_jaxpr,
    eqns_to_jaxpr as eqns_to_jaxpr,
    inline_jit as inline_jit,
)
from ._codegen import (
    PythonCode as PythonCode,
    fn_to_python_code as fn_to_python_code,
    jaxpr_to_python_code as jaxpr_to_python_code,
)
from ._dot import render as render, to_dot as to_dot
from ._view import HTML as HTML, view as view
from ._passes import (
    algebraic_simplification as algebraic_simplification,
    common_subexpression_elimination as common_subexpression_elimination,
    constant_fold as constant_fold,
    copy_propagation as copy_propagation,
    dead_code_elimination as dead_code_elimination,
    optimize_jaxpr as optimize_jaxpr,
)

__all__ = [
    "algebraic_simplification", "common_subexpression_elimination", "constant_fold",
    "eqns_to_closed_jaxpr", "eqns_to_jaxpr", "fn_to_python_code", "inline_jit",
    "jaxpr_to_python_code", "PythonCode",
    "copy_propagation", "dead_code_elimination", "optimize_jaxpr", "render", "to_dot",
    "HTML", "view",
]

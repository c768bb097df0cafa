"""The differential fuzzer of state and harvest (its tests: tests/test_fuzz.py).

- ``model``: the program model, an AST of expressions and statements, and
  the tables of function kinds, states, sow names and typed states;
- ``render``: a program as Python source over JAX and taxpr, and built
  (exec'd) from it; also with its inner functions at module level;
- ``analysis``: static views of a program (walks, sows, states, append
  sites, stateful rules);
- ``reference``: the eager reference interpreter (float64 NumPy, Python
  control flow);
- ``strategies``: the hypothesis strategies drawing programs and
  arguments;
- ``checks``: the checks of each transformation against the reference,
  the assert helpers and ``run_check``;
- ``cases``: one fuzz case per check (draw, then check);
- ``profiles``: hypothesis settings of the CI and long profiles;
- ``nests``: fixed programs for the deterministic tests.

Test modules import it as ``fuzz`` (pytest puts tests/ on ``sys.path``, as
for ``helpers``). What ``run_check`` records and whether it checks
(``_CHECKED``, ``_GENERATED``, ``_DRAW_ONLY``) are attributes of ``checks``:
set them there.
"""

"""Differential fuzzing of the taxpr.ir passes (its tests: tests/test_ir_fuzz.py).

A compact generator builds random programs from a seed: float32 scalars and
vectors, a bfloat16 vector and int32 scalars; literals including -0.0, NaN
and +-inf; integer ``div``/``rem`` (by 0 and -1 too); identity copies,
constant subexpressions and repeated work (so every pass has work);
``lax.scan`` (length 0 to 3), ``lax.cond``, bounded ``lax.while_loop``,
``jax.jit`` (a jitted block called once or twice on the same inputs),
``jax.checkpoint``, nested up to depth 3; tags, ``io_callback`` and
``jax.debug.callback`` anywhere. (The state/harvest fuzzer's generator,
tests/fuzz/, is specialised to state/harvest programs over values in
[-2, 2], so it is not reused here.)

For every pass, the pipeline and Python code generation (the generated
function traced again): ``check_jaxpr`` passes, the outputs are
bitwise equal to the original's (any NaN equals any NaN), the number of
callback calls at run time and the tags are unchanged.

Programs also run transformed, as users run them: under ``jax.vmap``
(``check_program(seed, batched=True)``: three examples, every argument
batched), so the passes see what vmap makes of control flow (a ``cond``
with a batched predicate becomes both branches and ``select_n``; a
``while`` with a batched predicate, each example looping ``trips`` more
times, a ``while_p`` whose predicate is per example), and under
``jax.jvp`` (``differentiated=True``), both where JAX can.

Profiles: CI runs ``TAXPR_IR_FUZZ_CI`` programs (default 16, under a
minute), some of them vmapped and differentiated; ``pytest -m long`` runs
``TAXPR_IR_FUZZ_EXAMPLES`` (default 20,000) starting at seed
``TAXPR_IR_FUZZ_SEED`` (default 0), and for three seeds in four a
transformed run too (``long_profile_modes``).

- ``generator``: the statement model (tuples over ``SLOTS``) and the seeded
  generator ``program(seed)``; ``vmappable`` / ``differentiable``;
- ``build``: statements run as JAX (``make_fn``), a program's arguments,
  ``traced_program`` (plain, vmapped, differentiated), the host callbacks
  and their shared counter ``CALLS``;
- ``checks``: ``check_program``, every pass (``VARIANTS``) against the
  original, bit for bit;
- ``profiles``: the CI and long profiles (counts, seeds, modes);
- ``regressions``: seeds of generated programs kept as regression cases.

Test modules import it as ``ir_fuzz`` (pytest puts tests/ on ``sys.path``,
as for ``ir_helpers``). ``CALLS`` is an attribute of ``build``: clear and
read it there.
"""

"""The fuzzer's profiles: how many programs, which seeds, which modes.

CI runs ``CI_COUNT`` programs (``TAXPR_IR_FUZZ_CI``, default 16), the
vmappable ones among them also vmapped (``BATCHED_SEEDS``) and the
differentiable ones differentiated (``DIFFERENTIATED_SEEDS``). The long
profile (``pytest -m long``) runs ``LONG_COUNT`` programs
(``TAXPR_IR_FUZZ_EXAMPLES``, default 20,000) starting at ``LONG_SEED``
(``TAXPR_IR_FUZZ_SEED``, default 0), each in the modes of
``long_profile_modes``; ``_log`` appends its progress to a file.
"""

from __future__ import annotations

import os

from .generator import differentiable, program, vmappable

CI_COUNT = int(os.environ.get("TAXPR_IR_FUZZ_CI", "16"))
LONG_COUNT = int(os.environ.get("TAXPR_IR_FUZZ_EXAMPLES", "20000"))
LONG_SEED = int(os.environ.get("TAXPR_IR_FUZZ_SEED", "0"))
# The long profile also runs transformed programs: with seed % 4 == 0
# vmapped, == 1 differentiated (jvp), == 2 both (where JAX can), unless
# TAXPR_IR_FUZZ_TRANSFORMED=0.
TRANSFORMED = os.environ.get("TAXPR_IR_FUZZ_TRANSFORMED", "1") != "0"


def long_profile_modes(seed: int) -> list[tuple[bool, bool]]:
    """``(batched, differentiated)`` runs of program ``seed`` in the long
    profile: always the plain one, and one transformed where JAX can."""
    stmts = program(seed)
    modes = [(False, False)]
    wanted = {0: (True, False), 1: (False, True), 2: (True, True)}.get(seed % 4)
    if TRANSFORMED and wanted is not None:
        batched, differentiated = wanted
        if (not batched or vmappable(stmts)) and (not differentiated or differentiable(stmts)):
            modes.append(wanted)
    return modes


BATCHED_SEEDS = [s for s in range(CI_COUNT) if vmappable(program(s))][:8]
DIFFERENTIATED_SEEDS = [s for s in range(CI_COUNT) if differentiable(program(s))][:6]


def _log(path: str | None, line: str) -> None:
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")

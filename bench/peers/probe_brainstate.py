"""brainstate: a ``brainstate.ShortTermState`` read and written inside raw JAX
control flow (not ``brainstate.transform``'s wrappers).
Run: ``python bench/peers/probe_brainstate.py``."""

import brainstate
import jax.numpy as jnp

from _probe import CASES, classify, report


def probe(program):
    total = brainstate.ShortTermState(jnp.zeros((), jnp.float32))

    def add(x):
        total.value = total.value + x
        return total.value

    program(add, jnp.float32(1.0))
    return total.value


report("brainstate", brainstate.__version__,
       {case: classify(lambda: probe(prog), exp) for case, (prog, exp) in CASES.items()})

"""taxpr: ``tx.get_state`` / ``tx.set_state`` inside raw JAX control flow, made
pure by ``tx.uncurry``. Run with the project's environment:
``python bench/peers/probe_taxpr.py``."""

from importlib.metadata import version

import jax.numpy as jnp

import taxpr as tx
from _probe import CASES, classify, report


def add(x):
    total = tx.get_state("total", jnp.zeros((), jnp.float32))
    return tx.set_state("total", total + x)


def probe(program):
    x = jnp.float32(1.0)
    pure, state0 = tx.uncurry(lambda x: program(add, x), x)
    _, state1 = pure(state0, x)
    return state1["total"]


report("taxpr", version("taxpr"),
       {case: classify(lambda: probe(prog), exp) for case, (prog, exp) in CASES.items()})

"""Flax Linen: a ``self.variable('state', ...)`` in an ``nn.Module`` applied with
``mutable=['state']``, used inside raw JAX control flow.
Run: ``python bench/peers/probe_flax.py``."""

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from _probe import CASES, classify, leaks, report

NOTES = {}


class Counter(nn.Module):
    program: object

    @nn.compact
    def __call__(self, x):
        total = self.variable("state", "total", lambda: jnp.zeros((), jnp.float32))

        def add(x):
            total.value = total.value + x
            return total.value

        self.program(add, x)
        return total.value


def probe(case, program):
    model, x = Counter(program), jnp.float32(1.0)
    if leaks(model.init(jax.random.key(0), x)):
        NOTES[case] = "init also returns a tracer as the initial state"
    variables = {"state": {"total": jnp.zeros((), jnp.float32)}}  # start from 0
    _, mutated = model.apply(variables, x, mutable=["state"])
    return mutated["state"]["total"]


results = {case: classify(lambda: probe(case, prog), exp) for case, (prog, exp) in CASES.items()}
report("flax.linen", flax.__version__, results, NOTES)

"""Haiku: hk.get_state / hk.set_state in hk.transform_with_state, used inside
raw JAX control flow. Run: ``python bench/peers/probe_haiku.py``."""

import haiku as hk
import jax.numpy as jnp

from _probe import CASES, classify, leaks, report

NOTES = {}


def add(x):
    total = hk.get_state("total", [], jnp.float32, init=jnp.zeros)
    hk.set_state("total", total + x)
    return total + x


def probe(case, program):
    f = hk.transform_with_state(lambda x: program(add, x))
    x = jnp.float32(1.0)
    _, state = f.init(None, x)
    if leaks(state):
        NOTES[case] = "init also returns a tracer as the initial state"
    state = {"~": {"total": jnp.zeros((), jnp.float32)}}  # start from 0
    _, state = f.apply({}, state, None, x)
    return state["~"]["total"]


results = {case: classify(lambda: probe(case, prog), exp) for case, (prog, exp) in CASES.items()}
report("haiku", hk.__version__, results, NOTES)

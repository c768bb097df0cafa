"""One fuzz case per check: draw a program and the check's parameters from
hypothesis' ``data``, then run the check (``run_check``). The CI and long
profiles' tests each run one of these.
"""

from __future__ import annotations

import jax
from hypothesis import assume, event, strategies as st

from .analysis import sow_names, stateful_custom_rules, walk
from .checks import (WARM_UPS, check_as_users_run, check_derivatives, check_grad_inside,
                     check_harvest, check_raw_reap, check_reap, check_tx_grad_inside,
                     check_uncurry, check_vmap, check_vmap_inside, run_check)
from .model import Fori, Root, While, not_differentiated
from .render import INIT_STYLES
from .strategies import F32, arguments, programs


def _uncurry_case(data, jit):
    program = data.draw(programs())
    args, args2 = data.draw(arguments()), data.draw(arguments())
    run_check(check_uncurry, program, args, args2, jit)


def _reap_case(data):
    program = data.draw(programs())
    args = data.draw(arguments())
    compose = data.draw(st.sampled_from(("reap(pure)", "uncurry(reap)")))
    jit = data.draw(st.booleans())
    kind = data.draw(st.sampled_from((None, "allowlist", "blocklist")))
    names = sorted(sow_names(program))
    filt = (kind, data.draw(st.sets(st.sampled_from(names))) if names and kind else set())
    run_check(check_reap, program, args, jit, compose, filt)


def _harvest_case(data):
    program = data.draw(programs())
    args = data.draw(arguments())
    seed = data.draw(st.integers(0, 2**16))
    jit = data.draw(st.booleans())
    run_check(check_harvest, program, args, seed, jit)


def _vmap_case(data):
    program = data.draw(programs())
    args, args2 = data.draw(arguments()), data.draw(arguments())
    with_reap = data.draw(st.booleans())
    run_check(check_vmap, program, args, args2, with_reap)


def _vmap_inside_case(data):
    program = data.draw(programs())
    args = data.draw(arguments())
    p0s = data.draw(st.lists(F32, min_size=2, max_size=3))
    jit = data.draw(st.booleans())
    with_reap = data.draw(st.booleans())
    run_check(check_vmap_inside, program, args, p0s, jit, with_reap)


DERIVATIVE_FEATURES = frozenset({"counter_state", "custom_rules", "rule_sows"})


def _derivative_case(data):
    program = data.draw(programs(allow=DERIVATIVE_FEATURES))
    args = data.draw(arguments())
    seed = data.draw(st.integers(0, 2**16))
    variant = data.draw(st.sampled_from(("pure", "reap", "plant")))
    run_check(check_derivatives, program, args, seed, variant)


def _grad_inside_case(data, check=check_grad_inside):
    # Reverse mode does not go through while loops (fori with traced bounds).
    program = data.draw(programs(allow=DERIVATIVE_FEATURES))
    assume(not any(isinstance(s, (While, Fori, Root)) for s in walk(program.body)))
    args = data.draw(arguments())
    run_check(check, program, args)


def _tx_grad_inside_case(data):
    _grad_inside_case(data, check_tx_grad_inside)


def _raw_case(data):
    # Without a state handler set_state is a no-op: a while on the counter
    # state would never stop.
    program = data.draw(programs(allow=frozenset()))
    args = data.draw(arguments())
    run_check(check_raw_reap, program, args)


def _disable_jit_case(data):
    # As users debug: under jax.disable_jit(), a while_loop first tries its
    # loop in Python; taxpr must trace what jax.jit would (no tags of that
    # attempt left behind).
    with jax.disable_jit():
        check = data.draw(st.sampled_from(("uncurry", "reap", "harvest")))
        if check == "uncurry":
            _uncurry_case(data, jit=data.draw(st.booleans()))
        elif check == "reap":
            _reap_case(data)
        else:
            _harvest_case(data)


def _as_users_run_case(data):
    program = data.draw(programs())
    args, args2 = data.draw(arguments()), data.draw(arguments())
    warm = data.draw(st.sampled_from(WARM_UPS))
    init_style = data.draw(st.sampled_from(INIT_STYLES))
    extra = data.draw(st.booleans())
    with_reap = data.draw(st.booleans())
    # Reverse mode of a while loop (incl. fori with traced bounds) is not
    # supported (as in check_derivatives); nor a custom_jvp rule with state.
    linearize = data.draw(st.booleans()) and not any(
        isinstance(s, (While, Fori)) or not_differentiated(s) for s in walk(program.body)
    ) and not stateful_custom_rules(program)
    event(f"warm-up {warm}")
    event(f"init {init_style}")
    run_check(check_as_users_run, program, args, args2, warm, init_style, extra, with_reap,
              linearize)

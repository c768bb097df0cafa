"""State effects: ``get_state`` / ``set_state`` made pure by ``uncurry``.

A state access is a tag whose ``op`` param is a private ``StateOp`` value,
so user tags (even ``op="get"``) are never mistaken for state accesses.
``uncurry`` traces the function once, finds every state access (also inside
loops and branches), computes the initial values (a state's initial value
is its ``init`` at first use: taken from the program where every first use
is certain from its structure, else found by running the program once with
the example arguments, as Haiku's ``init`` does), and rewrites the accesses
into a pure function of ``(state, *args)``: each access becomes a
substitution of the state's current value (``inject`` with a ``direct``
rule), with no equations of its own.

Modules, each importing only those above it:

* ``_inits``: callable inits, called once per trace and state;
* ``_scope``: ``tx.scope``, the scoped names of states;
* ``_ops``: ``get_state`` / ``set_state``, ``StateOp``, errors;
* ``_dicts``: the state dict nested by scope, split and merged;
* ``_replicated``: which sets in a shard_map without vma checking (``pmap``)
  are provably the same on every device;
* ``_collect``: a program's states, and the rules taxpr cannot thread;
* ``_rewrite``: the rewrite into a pure function (the engine's hooks);
* ``_initial``: initial values, with or without running the program;
* ``_uncurry``: ``uncurry`` / ``make_jaxpr``, traced once per signature;
* ``_grad``: ``value_and_grad`` / ``grad``, derivatives through states;
* ``_checkpoint``: ``save_state`` / ``load_state`` (NumPy ``.npz``).
"""

from ._checkpoint import load_state as load_state, save_state as save_state
from ._collect import StateInfo as StateInfo, collect_states as collect_states
from ._dicts import (
    StateScope as StateScope,
    merge_states as merge_states,
    split_states as split_states,
)
from ._ops import (
    StateError as StateError,
    StateNotUncurriedWarning as StateNotUncurriedWarning,
    get_state as get_state,
    is_state_tag as is_state_tag,
    set_state as set_state,
)
from ._grad import grad as grad, value_and_grad as value_and_grad
from ._scope import scope as scope
from ._rewrite import stream_pure_jaxpr as stream_pure_jaxpr
from ._uncurry import (
    make_jaxpr as make_jaxpr,
    make_jaxpr_with_states as make_jaxpr_with_states,
    per_signature as per_signature,
    uncurry as uncurry,
)

"""The threading engine: rewrite selected tags into explicit context threading.

One interpreter (``Engine.thread_eqns``) walks a jaxpr's equations; a tag
that is selected is replaced by an inlined copy of the injector's jaxpr;
a higher-order primitive whose sub-jaxprs contain a selected tag is handed
to its thread rule (one small rule per primitive, keyed by the ``Primitive``
object and registered with ``register_thread_rule``, which is public so that
other libraries can add their primitives). Every other equation is kept as
it is.

The engine works by jaxpr surgery rather than by re-tracing the program:
only the injector is traced (once per distinct signature), and inlining it
is a copy of a few equations, which keeps ``inject`` far cheaper than
tracing the program in the first place.

Convention: a threaded jaxpr takes the ctx leaves as inputs at ``in_pos``
and returns them as outputs at ``out_pos``; the rules pick the positions the
primitive needs (e.g. scan: after the consts / before the carry).

Modules, each importing only those above it:

* ``_api``: what clients and rules see: errors and paths, ``Level``,
  channels, ``RulePolicy`` / ``Hooks``, the registry of thread rules;
* ``_interpreter``: ``Engine``;
* ``_control_flow``: the rules of calls, ``scan``, ``while``, ``cond``,
  ``checkpoint``, ``shard_map``;
* ``_custom_common``: what the custom-derivative rules share;
* ``_custom_vjp``, ``_custom_jvp``: the rules of ``custom_vjp`` and
  ``custom_jvp`` calls.
"""

from __future__ import annotations

# The thread rules register themselves on import.
from . import _control_flow, _custom_jvp, _custom_vjp  # noqa: F401
from ._api import (
    ChannelKey as ChannelKey,
    Channels as Channels,
    Hooks as Hooks,
    InjectError as InjectError,
    Level as Level,
    NO_CHANNELS as NO_CHANNELS,
    RulePolicy as RulePolicy,
    THREAD_RULES as THREAD_RULES,
    ThreadRule as ThreadRule,
    describe_site as describe_site,
    describe_tag as describe_tag,
    format_path as format_path,
    in_custom_vjp as in_custom_vjp,
    inline as inline,
    register_thread_rule as register_thread_rule,
    trace_in as trace_in,
)
from ._interpreter import (
    Engine as Engine,
    changed_positions as changed_positions,
)
from ._control_flow import (
    ShardMapBody as ShardMapBody,
)
from ._custom_common import (
    FUNCTION_AGAIN as FUNCTION_AGAIN,
    ctx_through_p as ctx_through_p,
    speculative_rule_traces as speculative_rule_traces,
)
from ._custom_vjp import (
    traced_bwd as traced_bwd,
)

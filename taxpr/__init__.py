"""taxpr: a tag-and-inject effect system for JAX."""

__version__ = "0.1.0"

from . import _patches as _patches
from . import harvest as harvest
from . import ir as ir
from . import select as select

from ._dataflow import (
    fix_inputs as fix_inputs,
    partial as partial,
    partition_out as partition_out,
    strip_outputs as strip_outputs,
    transpose as transpose,
)
from ._capture import (
    CustomRuleError as CustomRuleError,
    LoopRows as LoopRows,
    Site as Site,
    capture as capture,
    patch as patch,
    perturb as perturb,
    sites as sites,
)
from ._debug import (
    CheckError as CheckError,
    NonFiniteError as NonFiniteError,
    Origin as Origin,
    checked as checked,
    debug_nans as debug_nans,
    error_if as error_if,
)
from ._engine import (
    InjectError as InjectError,
    ThreadRule as ThreadRule,
    register_thread_rule as register_thread_rule,
)
from ._find import (
    TagSite as TagSite,
    dissolve_tags as dissolve_tags,
    find_tags as find_tags,
    iter_tags as iter_tags,
)
from ._inject import Injected as Injected, inject as inject, injected as injected
from ._state import (
    StateError as StateError,
    StateInfo as StateInfo,
    StateNotUncurriedWarning as StateNotUncurriedWarning,
    get_state as get_state,
    grad as grad,
    load_state as load_state,
    make_jaxpr as make_jaxpr,
    make_jaxpr_with_states as make_jaxpr_with_states,
    merge_states as merge_states,
    save_state as save_state,
    scope as scope,
    set_state as set_state,
    split_states as split_states,
    StateScope as StateScope,
    uncurry as uncurry,
    value_and_grad as value_and_grad,
)
from ._random import next_key as next_key, seed as seed
from ._lanes import uncurry_vmap as uncurry_vmap
from ._loops import bounded_while_loop as bounded_while_loop
from ._watch import (
    LoopInfo as LoopInfo,
    PlainDisplay as PlainDisplay,
    progress as progress,
    tap as tap,
)
from ._typed import (
    TypedClosedJaxpr as TypedClosedJaxpr,
    tcj_partition_out as tcj_partition_out,
    tcj_transpose as tcj_transpose,
)
from .primitives import keep_tags as keep_tags, tag as tag, tag_p as tag_p

_patches.install()  # JAX's rules taxpr replaces: the table in taxpr._patches

# Compatibility names (taxpr 0.0.3's), each the same object as the name that
# says what it is: ``_COMPATIBILITY_NAMES[old]`` is the recommended name.
_COMPATIBILITY_NAMES = {
    "make_jaxpr": "make_jaxpr_with_states",
    "partial": "fix_inputs",
    "tcj_transpose": "TypedClosedJaxpr.transpose",
    "tcj_partition_out": "TypedClosedJaxpr.partition_out",
}

__all__ = [
    "CheckError", "CustomRuleError", "InjectError", "LoopInfo", "NonFiniteError", "Origin", "PlainDisplay", "checked", "debug_nans", "error_if", "progress", "tap", "Injected", "LoopRows", "Site", "capture", "patch", "perturb", "select", "sites", "StateError", "StateInfo", "StateNotUncurriedWarning", "StateScope", "TagSite", "TypedClosedJaxpr",
    "dissolve_tags", "find_tags", "fix_inputs", "get_state", "grad", "harvest", "inject", "injected", "ir", "iter_tags",
    "keep_tags", "load_state", "make_jaxpr", "make_jaxpr_with_states", "merge_states", "next_key", "partial", "partition_out", "set_state", "strip_outputs",
    "register_thread_rule", "save_state", "scope", "seed", "split_states", "ThreadRule",
    "tag", "tag_p", "tcj_partition_out", "tcj_transpose", "transpose", "uncurry", "uncurry_vmap",
    "bounded_while_loop",
    "value_and_grad",
]


def __dir__() -> list[str]:
    # ``dir(taxpr)`` lists the public API, not the private modules.
    return sorted(__all__ + ["__version__"])

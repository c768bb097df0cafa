"""Patches carried into derivative rules that re-evaluate their function's
code instead of calling it.

A custom_vjp's fwd and bwd may run the function's code as a jaxpr they
were given rather than call the function: equinox's checkpointed
``while_loop`` / ``scan`` (and so diffrax's default adjoint) closure-convert
the loop body and evaluate that jaxpr in the fwd, and in the bwd under
``jax.vjp``. A patch rewritten into the traced function never reaches that
jaxpr. While such a rule is traced, the equations that evaluate the patched
site again are patched as they are bound: an equation of the site's
primitive re-evaluated from a recorded jaxpr (``jax.core.eval_jaxpr`` binds
it with the recorded equation's traceback) at the site's program point (the
stack it was traced at) gets the patch applied to its output, so the fwd
computes the patched value and the bwd differentiates through the patch as
eager code would.

Only re-evaluations are patched: a fresh trace of Python code reaches a
primitive through JAX's trace caches (``jnp.multiply`` is traced once per
type and reused from every line), so a fresh bind's stack does not say
which program point it is. A patch is carried only where every equation of
the function traced at that point with that primitive is patched by the
same function (their re-evaluations cannot be told apart); anything else is
a ``CustomRuleError`` naming the site.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import sys
import threading
from typing import Any, Callable, Iterator

import jax

from .. import _compat, _jaxpr, _traverse
from .._jax import flags
from .._jax.internals import source_info_util

# The named scope of the equations a carried patch binds (the site's and
# the patch's): a jaxpr holding them, evaluated again, is not patched twice.
CARRIED_SCOPE = "taxpr_patched"


@dataclasses.dataclass(frozen=True)
class PointKey:
    """A program point as a re-evaluation shows it: the primitive and the
    stack it was traced at (``_compat.stack_key``: every frame's file and
    line), which an equation evaluated again from a recorded jaxpr keeps."""

    primitive: Any
    stack: tuple


@dataclasses.dataclass
class CarriedPatch:
    """The patch of the equations at one ``PointKey``: ``build(value)`` (the
    site's insertion) applied to output ``output``."""

    key: PointKey
    output: int
    build: Callable[[Any], Any]
    site_name: str
    applied: int = 0


class CarryPlan:
    """The patches to carry into one rule's trace, by ``PointKey``."""

    def __init__(self, patches: list[CarriedPatch],
                 copies: Callable[[dict], dict] | None = None):
        self.by_key = {p.key: p for p in patches}
        # A re-evaluated custom call's params -> its params with rules that
        # carry the patches (where its function is a patched one).
        self.copies = copies
        self.primitives = {p.key.primitive for p in patches}
        self._holds = _traverse.IdMemo()  # jaxpr -> whether it holds an uncarried site

    def uncarried(self, eqn: Any) -> CarriedPatch | None:
        """The patch of ``eqn`` if it computes a site at a patched point and
        is not patched yet."""
        patch = self.by_key.get(PointKey(eqn.primitive,
                                        _compat.stack_key(eqn.source_info.traceback)))
        return None if patch is None or carried_in(eqn.source_info.name_stack) else patch

    def holds_uncarried(self, jaxpr: Any) -> bool:
        return self._holds.get_or_compute(
            jaxpr, lambda: _traverse.any_eqn(jaxpr, lambda e: self.uncarried(e) is not None))

    def unapplied_sites(self) -> list[str]:
        return [p.site_name for p in self.by_key.values() if not p.applied]

    def applied_sites(self) -> set[str]:
        return {p.site_name for p in self.by_key.values() if p.applied}


class NotCarried(Exception):
    """Why the patch of site ``site`` cannot be carried (the message
    completes a sentence about the site)."""

    def __init__(self, site: str, why: str):
        super().__init__(why)
        self.site = site


def plan(function: Any, insertions: Any, copies: Callable[[dict], dict] | None = None
         ) -> CarryPlan:
    """The carry of ``insertions`` (the patches inside a custom call's
    ``function``, a closed jaxpr); ``copies``: ``CarryPlan.copies``.

    Raises:
        NotCarried: a patch is by value, its site has no traceback, or
            another equation of the function traced at the same point with
            the same primitive is not patched by the same function.
    """
    groups: dict[PointKey, list] = {}
    for ins in insertions:
        if not ins.changes:
            continue
        if ins.patch_fn is None:
            raise NotCarried(ins.site.name, "it is patched by a value (only a patch by a "
                             "function can be applied where the rule evaluates it again)")
        stack = _compat.stack_key(ins.site.source_info[0].traceback)
        if stack is None:
            raise NotCarried(ins.site.name, "its equation has no traceback")
        groups.setdefault((ins.site.primitive, stack), []).append(ins)
    patches = []
    for (name, stack), group in groups.items():
        same_point = [eqn for eqn, _ in _traverse.iter_eqns(function)
                      if eqn.primitive.name == name
                      and _compat.stack_key(eqn.source_info.traceback) == stack]
        fns = {id(ins.patch_fn) for ins in group}
        if len(same_point) != len(group) or len(fns) != 1:
            line = _compat.user_line(group[0].site.source_info[0].traceback) or "its line"
            raise NotCarried(
                group[0].site.name,
                f"it was traced at the same point ({line}) as {len(same_point) - 1} other "
                f"{name} equation(s) of the function, "
                f"{'not all patched' if len(fns) == 1 else 'patched differently'}: where the "
                f"rule evaluates that code again, they cannot be told apart")
        first = group[0]
        patches.append(CarriedPatch(PointKey(same_point[0].primitive, stack), first.output,
                                    first.build, first.site.name))
    return CarryPlan(patches, copies)


_ACTIVE: contextvars.ContextVar[CarryPlan | None] = contextvars.ContextVar(
    "taxpr_carried_patches", default=None)
_HOOKED: dict[Any, int] = {}  # primitive -> number of active carries hooking it
# Installing and removing the hooks is one step per primitive: two threads
# each tracing a rule must not both install (or one remove the other's).
_HOOKS_LOCK = threading.Lock()
_SCOPE_IDS = itertools.count(1)
# The custom calls whose re-evaluation re-binds their rules (from params).
_CUSTOM_CALLS = frozenset((_compat.custom_jvp_call_p, _compat.custom_vjp_call_p))


@contextlib.contextmanager
def carrying(carry: CarryPlan) -> Iterator[CarryPlan]:
    """Within the block, re-evaluated equations at ``carry``'s points are
    patched (the module's docstring). JAX's trace caches are keyed apart
    (a trace made in the block is never reused outside it, nor one made
    before inside it)."""
    hooked = carry.primitives | _compat.REEVALUATED_HIGHER_ORDER | _CUSTOM_CALLS
    with _HOOKS_LOCK:
        for prim in hooked:
            if not _HOOKED.get(prim):
                if prim in _CUSTOM_CALLS:
                    prim.get_bind_params = _hooked_get_bind_params(prim)
                else:
                    prim.bind = (_hooked_bind(prim) if prim in carry.primitives
                                 else _hooked_higher_order_bind(prim))
            _HOOKED[prim] = _HOOKED.get(prim, 0) + 1
    token = _ACTIVE.set(carry)
    try:
        with flags.CARRY_SCOPE(str(next(_SCOPE_IDS))):
            yield carry
    finally:
        _ACTIVE.reset(token)
        with _HOOKS_LOCK:
            for prim in hooked:
                _HOOKED[prim] -= 1
                if not _HOOKED[prim]:
                    del _HOOKED[prim]
                    # the class's methods again
                    del prim.__dict__["get_bind_params" if prim in _CUSTOM_CALLS else "bind"]


def _hooked_bind(prim: Any) -> Callable:
    original = type(prim).bind

    def bind(*args, **params):
        carry = _ACTIVE.get()
        patch = (None if carry is None or not _re_evaluating(sys._getframe(1))
                 else _carried_here(carry, prim))
        if patch is None:
            return original(prim, *args, **params)
        token = _ACTIVE.set(None)  # the patch's own equations are not patched
        try:
            with jax.named_scope(CARRIED_SCOPE):
                out = original(prim, *args, **params)
                if prim.multiple_results:
                    out = list(out)
                    out[patch.output] = patch.build(out[patch.output])
                else:
                    out = patch.build(out)
        finally:
            _ACTIVE.reset(token)
        patch.applied += 1
        return out

    return bind


def _hooked_higher_order_bind(prim: Any) -> Callable:
    """A higher-order primitive's bind that, re-evaluating a recorded
    equation, re-traces the jaxprs in its params that hold an uncarried
    site: their equations are then bound one by one (and patched), where
    binding the primitive alone would copy them (a jit inlined, a loop's
    body kept)."""
    original = type(prim).bind

    def bind(*args, **params):
        carry = _ACTIVE.get()
        if carry is not None and _re_evaluating(sys._getframe(1)):
            params = {k: _retraced(v, carry) for k, v in params.items()}
        return original(prim, *args, **params)

    return bind


def _hooked_get_bind_params(prim: Any) -> Callable:
    """A custom call's ``get_bind_params`` that, re-evaluating a recorded
    equation, gives its rules the patches (``CarryPlan.copies``): its rule
    traced afresh calls the function, whose call it then replaces by the
    patched one."""
    original = type(prim).get_bind_params

    def get_bind_params(params):
        carry = _ACTIVE.get()
        # (called by eval_jaxpr before it sets the equation's traceback)
        if (carry is not None and carry.copies is not None
                and sys._getframe(1).f_code is _compat.EVAL_JAXPR_CODE):
            params = carry.copies(params)
        return original(prim, params)

    return get_bind_params


def _re_evaluating(caller: Any) -> bool:
    """Whether a bind called from frame ``caller`` re-evaluates a recorded
    equation (``jax.core.eval_jaxpr`` binds it, with its traceback), rather
    than traces Python code (which may run under a recorded equation's
    traceback too: JAX traces a rule under the equation it differentiates)."""
    return (caller.f_code is _compat.EVAL_JAXPR_CODE
            and _compat.recorded_traceback() is not None)


def _retraced(value: Any, carry: CarryPlan) -> Any:
    """A param value with each closed jaxpr in it that holds an uncarried
    site traced again by evaluating it (an open jaxpr is left: the check
    after the rule's trace reports its site)."""
    if isinstance(value, tuple) and value and _jaxpr.is_closed(value[0]):
        return tuple(_retraced(v, carry) for v in value)
    if not _jaxpr.is_closed(value) or not carry.holds_uncarried(value):
        return value
    return _jaxpr.trace_flat(_jaxpr.jaxpr_as_fun(value), _jaxpr.in_avals(value), name="carried")


def _carried_here(carry: CarryPlan, prim: Any) -> CarriedPatch | None:
    """The patch of the equation being bound now, if it is a re-evaluation
    of a recorded equation at a patched point not patched already."""
    traceback = _compat.recorded_traceback()
    if traceback is None:
        return None
    stack = _compat.stack_key(traceback)
    patch = carry.by_key.get(PointKey(prim, stack)) if stack is not None else None
    if patch is None or carried_in(source_info_util.current_name_stack()):
        return None
    return patch


def marked_carried(eqn: Any) -> Any:
    """``eqn`` in ``CARRIED_SCOPE``: a patched site's equation or its patch,
    evaluated again while carrying, is not patched again."""
    info = eqn.source_info
    return eqn.replace(source_info=info.replace(name_stack=info.name_stack.extend(CARRIED_SCOPE)))


def carried_in(name_stack: Any) -> bool:
    """Whether a name stack is inside a carried patch's equations."""
    return any(getattr(s, "name", None) == CARRIED_SCOPE for s in name_stack.stack)


def uncarried_equations(closed: Any, carry: CarryPlan) -> list[str]:
    """The sites of ``carry`` that ``closed`` (a rule traced while carrying)
    computes at their point without the patch: traced afresh from Python
    there, where no patch can be applied."""
    found = []
    for eqn, _ in _traverse.iter_eqns(closed):
        patch = carry.uncarried(eqn)
        if patch is not None and patch.site_name not in found:
            found.append(patch.site_name)
    return found

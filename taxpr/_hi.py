"""JAX's high-level primitives, seen and threaded as jaxprs.

Newer JAX binds some higher-order operations (``lax.custom_root``, a
``custom_vjp`` with ``generic_batching=True``, the opt-in ``jax_scan3`` /
``jax_remat3`` / ``jax_custom_vjp3`` / ``jax_custom_jvp3``) as one
``call_hi_primitive`` equation whose only param is an object holding the
traced functions (jaxprs, ``Traced`` objects, nested such objects). taxpr's
generic traversal finds jaxprs in params, not inside those objects, so:

* ``hidden_jaxprs(eqn)`` yields the jaxprs such an equation holds (what
  ``find_tags`` and every walk over a program look into);
* ``expand_hi_primitives(program)`` replaces each such equation whose
  jaxprs hold tags by a ``jit`` call of its expansion into ordinary
  primitives (JAX's own ``to_lojax``, what it compiles), which taxpr then
  threads like any call. Done once, right after tracing, by every taxpr
  transformation.

The expansion runs the operation's primal computation (a root finder's
iterations, a custom_vjp function's body), as JAX runs it when it compiles.
Its custom derivative is not part of the expansion: differentiating the
rewritten program from outside, through such an operation holding a
consumed tag, differentiates its primal computation. The equation stays as
it is (with its rules) wherever no tag is inside.
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
from jax._src import core

from . import _compat, _traverse
from ._traverse import hi_name, hidden_jaxprs
from .primitives._tag import keep_tags, tag_p

HI_PRIMITIVE = _compat.call_hi_primitive_p  # None where JAX has no high-level primitives


def is_hi(eqn: core.JaxprEqn) -> bool:
    return HI_PRIMITIVE is not None and eqn.primitive is HI_PRIMITIVE


def holds_tags(eqn: core.JaxprEqn) -> bool:
    return any(e.primitive is tag_p for j in hidden_jaxprs(eqn)
               for e, _ in _traverse.iter_eqns(j))


def expand_hi_primitives(program: Any) -> Any:
    """``program`` with every high-level equation that holds tags replaced by
    a ``jit`` call of its expansion (at any depth; nested ones expanded too).
    The same object when there is none."""
    if HI_PRIMITIVE is None:
        return program

    def rewrite(eqn, path, env):
        if not is_hi(eqn) or not holds_tags(eqn):
            return None
        return [_expanded_call(eqn.replace(
            invars=[env.get(v, v) if type(v) is core.Var else v for v in eqn.invars]))]

    return _traverse.map_jaxpr(program, rewrite)


def _expanded_call(eqn: core.JaxprEqn) -> core.JaxprEqn:
    """A ``jit`` equation computing what ``eqn`` computes, through its
    expansion into ordinary primitives (tags in it kept and expanded too)."""
    params = eqn.params
    n_in, n_out = len(eqn.invars), len(eqn.outvars)

    def lo(*args):
        return HI_PRIMITIVE.to_lojax(*args, **params)

    with keep_tags():
        body = _compat.trace_flat(lo, [v.aval for v in eqn.invars], hi_name(eqn))
    body = expand_hi_primitives(body)
    jit = _jit_template()
    unspec = _compat.unspecified_sharding()
    new_params = dict(jit.params, jaxpr=body, name=hi_name(eqn),
                      in_shardings=(unspec,) * n_in, out_shardings=(unspec,) * n_out,
                      in_layouts=(None,) * n_in, out_layouts=(None,) * n_out,
                      donated_invars=(False,) * n_in)
    effects = _traverse.effects_of([body])
    return eqn.replace(primitive=_compat.jit_p, params=new_params, effects=effects)


_TEMPLATE: list = []


def _jit_template() -> core.JaxprEqn:
    """A ``jit`` equation whose params other than the callee and its
    signature are JAX's defaults."""
    if not _TEMPLATE:
        closed = jax.make_jaxpr(jax.jit(lambda x: x))(0.0)
        _TEMPLATE.append(_compat.jaxpr_parts(closed).eqns[0])
    return _TEMPLATE[0]

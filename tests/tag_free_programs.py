"""Tag-free JAX programs, printed as their jaxprs and lowered StableHLO.

Run as a script (``python tests/tag_free_programs.py [--import-taxpr]``) it
prints, for every program, its name, the jaxpr JAX traces for it and the
text of its lowering. ``test_leaves_jax_as_found.py`` runs it in two fresh
processes, with and without ``import taxpr`` first, and compares: taxpr
registers rules on JAX's primitives, and a program without tags must trace
and lower exactly as it does without taxpr.

The programs are those whose JAX rules taxpr touches: ``vmap`` of ``cond``
(batched predicate) and ``while`` (batched and unbatched), ``grad`` /
``linearize`` / ``jvp`` / ``vjp`` of ``scan``, ``cond``, ``while``
(forward), ``checkpoint`` (with and without a policy), ``custom_jvp`` and
``custom_vjp`` functions, partial evaluation of loops with loop-invariant
work, ``jax.debug.callback`` under ``grad``, and ``shard_map``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

if "--import-taxpr" in sys.argv:
    import taxpr  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402


@jax.custom_jvp
def _scaled_sin(x):
    return 2.0 * jnp.sin(x)


@_scaled_sin.defjvp
def _scaled_sin_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    return _scaled_sin(x), 3.0 * jnp.cos(x) * dx


@jax.custom_vjp
def _clipped(x):
    return jnp.tanh(x) * 2.0


def _clipped_fwd(x):
    return _clipped(x), jnp.cos(x)


def _clipped_bwd(res, g):
    return (jnp.clip(g * res, -1.0, 1.0),)


_clipped.defvjp(_clipped_fwd, _clipped_bwd)


def _scan_body(c, x):
    w = jnp.sin(c) * x + jnp.cos(x)  # loop-invariant work mixed in
    return c * 0.9 + w, w * 2.0


def _scan(x):
    c, ys = lax.scan(_scan_body, x[0], x)
    return c + ys.sum()


def _cond(x):
    return lax.cond(x.sum() > 0.0, lambda v: jnp.sin(v) * 2.0, lambda v: v * v, x).sum()


def _while(x):
    def body(c):
        i, v = c
        return i + 1, v * 0.5 + jnp.sin(v)
    return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1].sum()


def _fori(x):
    return lax.fori_loop(0, 4, lambda i, v: v * 1.1 + jnp.cos(v), x).sum()


def _switch(i, x):
    return lax.switch(i, [jnp.sin, jnp.cos, lambda v: v * 3.0], x)


def _remat(x):
    f = jax.checkpoint(lambda v: jnp.sin(jnp.sin(v)) * v)
    return f(f(x)).sum()


def _remat_policy(x):
    f = jax.checkpoint(lambda v: jnp.sin(v @ v.T).sum() * v,
                       policy=jax.checkpoint_policies.dots_saveable)
    return f(x).sum()


def _callback(x):
    jax.debug.callback(lambda v: None, x)
    return jnp.sin(x).sum()


def _shard_map(x):
    from jax.sharding import Mesh, PartitionSpec as P
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # pragma: no cover
        from jax.experimental.shard_map import shard_map
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("i",))
    return shard_map(lambda v: lax.psum(jnp.sin(v) * 2.0, "i"), mesh=mesh,
                     in_specs=P("i"), out_specs=P())(x)


X = np.linspace(-1.0, 1.0, 8, dtype=np.float32)
XS = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)
M = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(4, 4)
IDX = np.array([0, 2, 1], np.int32)


def _linearized(f):
    def g(x):
        y, f_lin = jax.linearize(f, x)
        return y, f_lin(jnp.ones_like(x))
    return g


def _vjp_of(f):
    def g(x):
        y, f_vjp = jax.vjp(f, x)
        return y, f_vjp(jnp.ones_like(y))
    return g


PROGRAMS = {
    "vmap_cond_batched_predicate": (jax.vmap(lambda v: _cond(v[None])), (X,)),
    "vmap_cond_unbatched_predicate": (
        jax.vmap(lambda v, p: lax.cond(p > 0.0, jnp.sin, jnp.cos, v), (0, None)), (X, 1.0)),
    "vmap_while_batched_predicate": (
        jax.vmap(lambda v: lax.while_loop(lambda c: c < 2.0, lambda c: c + 0.3, v)), (X,)),
    "vmap_while_unbatched_predicate": (jax.vmap(lambda v: _while(v)), (XS,)),
    "vmap_switch": (jax.vmap(_switch), (IDX, XS[:, 0])),
    "grad_scan": (jax.grad(_scan), (X,)),
    "grad_cond": (jax.grad(_cond), (X,)),
    "grad_fori": (jax.grad(_fori), (X,)),
    "jvp_while": (lambda x: jax.jvp(_while, (x,), (jnp.ones_like(x),)), (X,)),
    "linearize_scan": (_linearized(_scan), (X,)),
    "linearize_cond": (_linearized(_cond), (X,)),
    "linearize_custom_jvp": (_linearized(lambda x: _scaled_sin(x).sum()), (X,)),
    "vjp_scan": (_vjp_of(lambda x: lax.scan(_scan_body, x[0], x)[1]), (X,)),
    "grad_remat": (jax.grad(_remat), (X,)),
    "grad_remat_policy": (jax.grad(_remat_policy), (M,)),
    "grad_custom_jvp": (jax.grad(lambda x: _scaled_sin(x).sum()), (X,)),
    "grad_custom_vjp": (jax.grad(lambda x: _clipped(x).sum()), (X,)),
    "vmap_grad_custom_vjp": (jax.vmap(jax.grad(lambda x: _clipped(x).sum())), (XS,)),
    "grad_of_scan_of_custom_jvp": (
        jax.grad(lambda x: lax.scan(lambda c, v: (c + _scaled_sin(v), None), 0.0, x)[0]),
        (X,)),
    "grad_debug_callback": (jax.grad(_callback), (X,)),
    "hessian_scan": (jax.hessian(_scan), (X[:4],)),
    "jit_grad_vmap_cond": (jax.jit(jax.grad(lambda x: jax.vmap(_cond)(x[:, None]).sum())),
                           (X,)),
    "shard_map_psum": (_shard_map, (X,)),
    "grad_shard_map": (jax.grad(lambda x: _shard_map(x).sum()), (X,)),
}


def main() -> None:
    for name, (fn, args) in PROGRAMS.items():
        jaxpr = jax.make_jaxpr(fn)(*args)
        hlo = jax.jit(fn).lower(*args).as_text()
        print(f"==== {name}\n{jaxpr}\n---- lowered\n{hlo}")


if __name__ == "__main__":
    main()

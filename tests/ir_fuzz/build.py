"""A program's statements run as JAX, and its arguments.

``exec_block`` / ``exec_stmt`` run statements on a dict of JAX values
(``lax`` ops, ``lax.scan`` / ``cond`` / ``while_loop``, ``jax.jit``,
``jax.checkpoint``, tags, ``io_callback`` and ``jax.debug.callback``);
``make_fn`` is a program as a function of the slots, ``arguments(seed)``
its arguments (-0.0, NaN, +-inf, int32 extremes), ``batched_arguments``
``BATCH`` examples of them for ``jax.vmap``, ``differentiate`` the function
under ``jax.jvp`` and ``traced_program`` the jaxpr of a program, plain,
vmapped or differentiated. The host callbacks count their calls in
``CALLS``, one ``Counter`` shared by every user (cleared before a run).
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

import taxpr as tx

from .generator import SLOTS, program

CALLS: Counter = Counter()


def _io_identity(x):
    CALLS["io"] += 1
    return x


def _debug_cb(x):
    CALLS["debug"] += 1


def _fbin(op, x, y):
    if jax.config.jax_enable_x64 and (type(x) is float or type(y) is float):
        # Under x64 lax takes a Python float as float64; jnp promotes it
        # weakly, to the same weak literal that lax makes without x64.
        return {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply,
                "div": jnp.divide, "max": jnp.maximum, "min": jnp.minimum}[op](x, y)
    return {"add": lax.add, "sub": lax.sub, "mul": lax.mul, "div": lax.div,
            "max": lax.max, "min": lax.min, "rem": lax.rem}[op](x, y)


def _lit(a, dtype, shape):
    # A Python scalar keeps the literal weak and inline in the jaxpr.
    v = a[1]
    return lax.broadcast(jnp.asarray(v, dtype), shape) if shape else v


def exec_block(stmts, env):
    env = dict(env)
    for s in stmts:
        env = exec_stmt(s, env)
    return env


def exec_stmt(s, env):
    k = s[0]
    if k == "bin":
        _, dst, op, a, b = s
        like = env[dst]
        xa = _lit(a, like.dtype, like.shape) if isinstance(a, tuple) else env[a]
        xb = _lit(b, like.dtype, like.shape) if isinstance(b, tuple) else env[b]
        if isinstance(xa, float) and isinstance(xb, float):
            xa = jnp.asarray(xa, like.dtype)
        res = _fbin(op, xa, xb) if not isinstance(xa, float) else _fbin(op, xb * 0 + xa, xb)
        env[dst] = lax.convert_element_type(res, like.dtype)
    elif k == "un":
        _, dst, op, a = s
        x = env[a]
        env[dst] = lax.neg(lax.neg(x)) if op == "negneg" else getattr(lax, op)(x)
    elif k == "constexpr":
        _, dst, op, c1, c2 = s
        like = env[dst]
        c = _fbin(op, jnp.float32(c1), c2)
        env[dst] = lax.add(like, lax.broadcast(c, like.shape)) if like.shape else like + c
    elif k == "copy":
        env[s[1]] = lax.copy_p.bind(env[s[1]])
    elif k == "tag":
        env[s[1]] = tx.tag(env[s[1]], op="fuzz")
    elif k == "callback":
        x = env[s[1]]
        if s[2] == "io":
            env[s[1]] = io_callback(_io_identity, jax.ShapeDtypeStruct(x.shape, x.dtype), x,
                                    ordered=False)
        else:
            jax.debug.callback(_debug_cb, x)
    elif k == "bf_from":
        env["b0"] = env[s[1]].astype(jnp.bfloat16)
    elif k == "bf_bin":
        b = env["b0"]
        y = s[2]
        yb = lax.broadcast(jnp.asarray(y[1], jnp.bfloat16), b.shape) if isinstance(y, tuple) \
            else lax.broadcast(env[y].astype(jnp.bfloat16), b.shape)
        env["b0"] = _fbin(s[1], b, yb)
    elif k == "bf_to":
        env[s[1]] = env["b0"].astype(jnp.float32) * 1.0
    elif k == "ibin":
        _, dst, op, a, b = s
        xa = jnp.int32(a[1]) if isinstance(a, tuple) else env[a]
        # JAX 0.10's XLA traps (SIGFPE) when it evaluates at compile time an
        # integer division by a zero it can prove, in the original program
        # already: a literal 0, or e.g. ``i0 = i0 - i0; i1 = rem(1, i0);
        # i0 = i1 + i1`` (PROVABLE_ZERO_DIVISOR; an optimization barrier does not help on
        # CPU, XLA expands it first). So literal divisors are nonzero and a
        # variable divisor is offset by the argument ``zero`` (0 at run time,
        # unknown to XLA and to taxpr); at run time x / 0 is defined.
        xb = jnp.int32(b[1] or 3) if isinstance(b, tuple) else env[b]
        if op in ("div", "rem") and not isinstance(b, tuple):
            xb = xb + env["zero"]
        env[dst] = _fbin(op, xa, xb)
    elif k == "scan":
        _, length, body = s
        env, _ = lax.scan(lambda c, _: (exec_block(body, c), None), env, None, length=length)
    elif k == "cond":
        _, p, t, f = s
        env = lax.cond(env[p] % 2 == 0, lambda e: exec_block(t, e), lambda e: exec_block(f, e),
                       env)
    elif k == "while":
        _, n, body = s
        # Batched programs add each example's own extra trips (``trips``),
        # so vmap batches the predicate and the examples stop apart.
        bound = n + env["trips"] if "trips" in env else n
        _, env = lax.while_loop(lambda c: c[0] < bound,
                                lambda c: (c[0] + 1, exec_block(body, c[1])), (0, env))
    elif k == "jit":
        _, times, body = s
        fn = jax.jit(lambda e: exec_block(body, e))
        if times == "twin":
            a, b = fn(env), fn(env)
            env = dict(a, f0=a["f0"] + b["f0"])
        else:
            for _ in range(times):
                env = fn(env)
    elif k == "ckpt":
        env = jax.checkpoint(lambda e: exec_block(s[1], e))(env)
    else:  # pragma: no cover
        raise AssertionError(s)
    return env


def make_fn(stmts):
    def f(f0, f1, f2, v0, v1, b0, i0, i1, zero, *trips):
        env = dict(f0=f0, f1=f1, f2=f2, v0=v0, v1=v1, b0=b0, i0=i0, i1=i1, zero=zero)
        if trips:  # batched programs: extra while trips per example
            env["trips"] = trips[0]
        env = exec_block(stmts, env)
        return [env[n] for n in SLOTS]
    return f


def arguments(seed: int):
    r = np.random.default_rng(seed)
    pal = np.array([0.0, -0.0, 1.5, -2.25, np.nan, np.inf, -np.inf, 0.3, 7.0], np.float32)
    f = [np.float32(r.choice(pal)) for _ in range(3)]
    v = [r.choice(pal, 4).astype(np.float32) for _ in range(2)]
    b = r.choice(pal, 4).astype(jnp.bfloat16)
    i = [np.int32(r.choice([0, 1, -1, 5, -7, 2**31 - 1, -2**31])) for _ in range(2)]
    return (*f, *v, b, *i, np.int32(0))  # the last: ``zero``


BATCH = 3


def batched_arguments(seed: int) -> list:
    """``BATCH`` examples of every argument, stacked (those of seeds
    ``seed``, ``seed + 1``, ...), and ``trips`` (0, 1, 2: each example's
    extra ``while`` iterations), so vmap batches every predicate."""
    examples = [arguments(seed + k) for k in range(BATCH)]
    return [*(np.stack(column) for column in zip(*examples)),
            np.arange(BATCH, dtype=np.int32)]


N_FLOAT_ARGS = 5  # f0, f1, f2, v0, v1: the arguments jvp differentiates


def differentiate(fn):
    """``fn`` with ``N_FLOAT_ARGS`` tangent arguments put first, returning
    its outputs (by ``jax.jvp``) and the tangents of its float32 outputs."""
    def jvp_fn(*args):
        tangents, args = args[:N_FLOAT_ARGS], args[N_FLOAT_ARGS:]
        primals, rest = args[:N_FLOAT_ARGS], args[N_FLOAT_ARGS:]

        def split(*p):
            outs = fn(*p, *rest)
            floats = [o for o in outs if o.dtype == jnp.float32]
            return floats, [o for o in outs if o.dtype != jnp.float32]

        floats, tangents_out, others = jax.jvp(split, primals, tangents, has_aux=True)
        return [*floats, *others, *tangents_out]
    return jvp_fn


def traced_program(seed: int, batched: bool = False, differentiated: bool = False):
    """``(statements, arguments, jaxpr)`` of the program ``seed``:
    forward-differentiated (``differentiate``; the tangents are the float
    arguments of a later seed: NaN, inf, -0.0 included) when
    ``differentiated``, then vmapped over ``batched_arguments`` when
    ``batched``."""
    stmts = program(seed)
    fn = make_fn(stmts)
    args = batched_arguments(seed) if batched else list(arguments(seed))
    if differentiated:
        fn = differentiate(fn)
        later = batched_arguments(seed + BATCH) if batched else arguments(seed + BATCH)
        args = [*later[:N_FLOAT_ARGS], *args]
    if batched:
        fn = jax.vmap(fn)
    return stmts, args, jax.make_jaxpr(fn)(*args)

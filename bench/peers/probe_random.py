"""Implicit random keys inside raw JAX transformations: taxpr's ``next_key``
vs Flax NNX ``Rngs``, Haiku ``next_rng_key``, numpyro's ``seed`` handler and
JAX's ``jax.experimental.random.stateful_rng``.

Each library draws ``uniform()`` from its own implicit key source ("draw")
inside raw JAX code (never the library's own wrappers such as ``hk.scan``
or ``nnx.scan``), seeded by its own handler around the whole program. A case
is **correct** when the draws that must differ do differ (a fresh key per
draw) and, for ``checkpoint``, when the forward and its recomputation under
``grad`` used the same key; otherwise:

- **same numbers silently**: draws that must differ are equal, no error;
- **different keys in forward and recomputation**: checkpoint only;
- **leaked tracer**: a JAX tracer came back, no error;
- **error**: the exception type and the first line of its message.

Libraries that are not importable are reported as such. Run with the
interpreter of a venv holding the peers (see bench/peers/README.md), with
this repository on ``PYTHONPATH`` for taxpr::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=. \\
        /tmp/peers/bin/python bench/peers/probe_random.py

It prints one line per library and case, then ``JSON {...}``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402


def _shard_map():
    if hasattr(jax, "shard_map"):
        return jax.shard_map
    from jax.experimental.shard_map import shard_map
    return shard_map


# ---- the programs: program(draw, x) -> (values, kind) ---------------------------
# kind "distinct": every value must differ; "equal": the two values must agree.

def p_scan(draw, x):
    return lax.scan(lambda c, _: (c, draw()), x, None, length=4)[1], "distinct"


def p_while(draw, x):
    def body(c):
        i, out = c
        return i + 1, out.at[i].set(draw())
    return lax.while_loop(lambda c: c[0] < 3, body, (0, jnp.zeros(3)))[1], "distinct"


def p_cond(draw, x):
    a = lax.cond(x > 0, lambda: draw(), lambda: jnp.float32(-1.0))
    return jnp.stack([a, draw()]), "distinct"


def p_jit(draw, x):
    f = jax.jit(lambda x: x * 0.0 + draw())
    return jnp.stack([f(x), f(x)]), "distinct"


def p_checkpoint(draw, x):
    # value == grad (x = 1) iff the recomputation drew the forward's key
    v, g = jax.value_and_grad(lambda x: jax.checkpoint(lambda x: x * draw())(x))(x)
    return jnp.stack([v, g]), "equal"


def p_grad(draw, x):
    g = jax.grad(lambda x: x * draw() + draw())(x)
    return jnp.stack([g, draw()]), "distinct"


def p_vmap(draw, x):
    return jax.vmap(lambda x: x * 0.0 + draw(), axis_name="batch")(jnp.zeros(4)), "distinct"


def p_shard_map(draw, x):
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("d",))
    f = _shard_map()(lambda x: x * 0.0 + draw(), mesh=mesh, in_specs=P("d"),
                     out_specs=P("d"))
    return f(jnp.zeros(4)), "distinct"


CASES = {"lax.scan": p_scan, "lax.while_loop": p_while, "lax.cond": p_cond, "jax.jit": p_jit,
         "jax.checkpoint (under grad)": p_checkpoint, "jax.grad": p_grad,
         "jax.vmap (axis_name)": p_vmap, "shard_map": p_shard_map}


def classify(run) -> str:
    try:
        values, kind = run()
    except Exception as e:  # noqa: BLE001 - record whatever the library raises
        first = (str(e).strip().splitlines() or [""])[0][:100]
        return f"error: {type(e).__name__}: {first}"
    if isinstance(values, jax.core.Tracer):
        return "leaked tracer (no error)"
    v = np.asarray(values, np.float64).ravel()
    if kind == "equal":
        return ("correct" if np.allclose(v[0], v[1])
                else "different keys in forward and recomputation (silently)")
    return "correct" if len(set(v.tolist())) == len(v) else "same numbers silently"


# ---- the libraries: runner(program) -> program's result ----------------------------

def taxpr_runner():
    import taxpr as tx

    def run(program):
        # tx.seed around the whole program; draw = uniform(next_key())
        seeded = tx.seed(lambda x: program(lambda: jax.random.uniform(tx.next_key()), x)[0],
                         jax.random.key(0))
        return seeded(jnp.float32(1.0)), _kind_of(program)
    return "taxpr", tx.__version__, run


def _kind_of(program) -> str:
    return "equal" if program is p_checkpoint else "distinct"


def haiku_runner():
    import haiku as hk

    def run(program):
        f = hk.transform(lambda x: program(lambda: jax.random.uniform(hk.next_rng_key()), x)[0])
        return f.apply({}, jax.random.PRNGKey(0), jnp.float32(1.0)), _kind_of(program)
    return "Haiku", hk.__version__, run


def numpyro_runner():
    import numpyro
    from numpyro.handlers import seed

    def run(program):
        with seed(rng_seed=0):
            out = program(lambda: jax.random.uniform(numpyro.prng_key()), jnp.float32(1.0))[0]
        return out, _kind_of(program)
    return "numpyro", numpyro.__version__, run


def nnx_runner(hijax: bool):
    from flax import nnx
    import flax

    def run(program):
        import contextlib
        # opt-in mode: the Rngs made, and the program run, under var_defaults(hijax=True)
        # (ref=True alone still raises TraceContextError in raw scan)
        with nnx.var_defaults(hijax=True) if hijax else contextlib.nullcontext():
            rngs = nnx.Rngs(0)
            return (program(lambda: jax.random.uniform(rngs()), jnp.float32(1.0))[0],
                    _kind_of(program))
    label = "Flax NNX Rngs" + (" (hijax mode: nnx.var_defaults(hijax=True))" if hijax else "")
    return label, flax.__version__, run


def stateful_rng_runner():
    from jax.experimental.random import stateful_rng

    def run(program):
        rng = stateful_rng(0)
        return program(lambda: rng.uniform(), jnp.float32(1.0))[0], _kind_of(program)
    return "jax.experimental.random.stateful_rng", jax.__version__, run


RUNNERS = {"taxpr": taxpr_runner, "flax_nnx": lambda: nnx_runner(False),
           "flax_nnx_hijax": lambda: nnx_runner(True), "haiku": haiku_runner,
           "numpyro": numpyro_runner, "stateful_rng": stateful_rng_runner}


def main(argv: list[str]) -> None:
    only = [a for a in argv if not a.startswith("-")]
    results = {}
    for key, make in RUNNERS.items():
        if only and key not in only:
            continue
        try:
            label, version, run = make()
        except ImportError as e:
            results[key] = {"library": key, "version": None, "results": {},
                            "note": f"not installed here ({e})"}
            print(f"{key}: not installed ({e})")
            continue
        row = {case: classify(lambda p=program: run(p)) for case, program in CASES.items()}
        results[key] = {"library": label, "version": version, "results": row}
        print(f"{label} {version} (jax {jax.__version__}, python {sys.version.split()[0]})")
        for case, r in row.items():
            print(f"  {case:28s} {r}")
    print("JSON " + json.dumps({"jax": jax.__version__, "python": sys.version.split()[0],
                               "libraries": results}))


if __name__ == "__main__":
    main(sys.argv[1:])

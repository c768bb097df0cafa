"""An eager interpreter of a traced program that finds where a non-finite
value was born.

It runs a closed jaxpr equation by equation on concrete values (loops
unrolled in Python, the taken ``cond`` branch only, calls entered), and
gives every non-finite value the ``Origin`` it comes from: the equation
that made it from finite inputs, or, for an equation with a non-finite
input, the earliest origin among those inputs (a NaN propagating through
``add`` keeps the ``log`` that made it). A value that is finite carries no
origin, so a NaN that a ``jnp.where`` masks away is never blamed for
anything. The origin of a program's non-finite output is where it was
born.

Rules are registered per ``Primitive`` (``EAGER_RULES``): loops and
branches, which need their own control flow; every equation holding a
jaxpr that maps its inputs to its outputs (``jit``, ``custom_jvp`` /
``custom_vjp`` calls, ``checkpoint``) is entered; anything else is bound as
JAX binds it, whole.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from .._jax.internals import core
from .. import _compat, _jaxpr, _traverse


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a non-finite value was born.

    Attributes:
        kind: ``"NaN"`` or ``"inf"``.
        primitive: the primitive whose output it was (``"log"``), or
            ``"input"`` / ``"constant"`` for a value the program was given.
        source: ``"model.py:42, in Block.__call__"`` (the user's frame that
            bound the equation), or None.
        path: the enclosing primitives (``("jit[loss]", "scan[length=12]")``).
        iterations: ``((loop label, index), ...)`` for each enclosing loop,
            outermost first.
        phase: ``"forward"``, or ``"backward"`` for an equation of a
            transposed (reverse-mode) program.
        inputs: the equation's inputs, described (``"x = -0.5"``).
        order: when it ran: the earliest origin is the one reported.
    """

    kind: str
    primitive: str
    source: str | None
    path: tuple[str, ...]
    iterations: tuple[tuple[str, int], ...]
    phase: str
    inputs: tuple[str, ...]
    order: int


class Value(NamedTuple):
    """A concrete value and the origin of its non-finite elements (None
    when it is finite, or not a float)."""

    array: Any
    origin: Origin | None


@dataclasses.dataclass(frozen=True)
class Frame:
    """Where the interpreter is: the path of enclosing primitives and loop
    iterations; ``run`` holds what all frames share."""

    path: tuple[str, ...]
    iterations: tuple[tuple[str, int], ...]
    run: "Run"

    def inside(self, label: str, iteration: tuple[str, int] | None = None) -> "Frame":
        its = self.iterations + ((iteration,) if iteration is not None else ())
        return Frame(self.path + (label,), its, self.run)


@dataclasses.dataclass
class Run:
    """One interpretation: what counts as non-finite (``inf``: infinities
    too) and the counter giving origins their order."""

    inf: bool
    counter: Any = dataclasses.field(default_factory=itertools.count)
    # Called on each equation with (frame, eqn, input values) before it
    # runs; may raise (``tx.checked`` reports its errors this way).
    on_eqn: Callable[[Frame, core.JaxprEqn, list], None] | None = None

    def bad(self, x: Any) -> bool:
        """Whether ``x`` holds a value that counts as non-finite."""
        a = np.asarray(x)
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.complexfloating)):
            if a.dtype.name not in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
                return False
            a = a.astype(np.float32)
        return bool(np.isnan(a).any() or (self.inf and np.isinf(a).any()))

    def kind(self, x: Any) -> str:
        a = np.asarray(x)
        if a.dtype.name == "bfloat16" or a.dtype.name.startswith("float8"):
            a = a.astype(np.float32)
        return "NaN" if np.isnan(a).any() else "inf"


RuleFn = Callable[[Frame, core.JaxprEqn, list], list]
EAGER_RULES: dict[Any, RuleFn] = {}


def register_eager_rule(primitive: Any, rule: RuleFn) -> None:
    """``rule(frame, eqn, ins: list[Value]) -> list[Value]`` interprets
    ``primitive``'s equations."""
    EAGER_RULES[primitive] = rule


def run_jaxpr(frame: Frame, jaxpr: Any, args: Sequence[Value]) -> list[Value]:
    """``jaxpr`` (closed or open) run on ``args``."""
    parts = _jaxpr.jaxpr_parts(jaxpr)
    env: dict = {}
    for v, c in zip(parts.constvars, parts.consts or ()):
        env[v] = _given(frame, c, "constant")
    for v, a in zip(parts.invars, args):
        env[v] = a

    def read(atom) -> Value:
        if type(atom) is core.Literal:
            return _given(frame, atom.val, "constant")
        return env[atom]

    for eqn in parts.eqns:
        ins = [read(v) for v in eqn.invars]
        if frame.run.on_eqn is not None:
            frame.run.on_eqn(frame, eqn, ins)
        rule = EAGER_RULES.get(eqn.primitive)
        if rule is not None:
            outs = rule(frame, eqn, ins)
        else:
            call = _call_jaxpr(eqn)
            outs = (run_jaxpr(frame.inside(_traverse.subjaxprs(eqn)[0][0].label), call, ins)
                    if call is not None else bind(frame, eqn, ins))
        for v, o in zip(eqn.outvars, outs):
            if not isinstance(v, core.DropVar):
                env[v] = o
    return [read(v) for v in parts.outvars]


def _given(frame: Frame, value: Any, what: str) -> Value:
    """A value the program holds (a constant) or is given (an input). A
    non-finite constant is usually meant (an ``inf`` a library starts a
    minimum from): blamed last, after any equation; an input, first."""
    if not frame.run.bad(value):
        return Value(value, None)
    order = _CONSTANT_ORDER if what == "constant" else -1
    return Value(value, Origin(frame.run.kind(value), what, None, frame.path, frame.iterations,
                               "forward", (), order))


_CONSTANT_ORDER = 1 << 62


def _call_jaxpr(eqn: core.JaxprEqn) -> Any:
    """The jaxpr of a call-like equation (one jaxpr, taking the equation's
    inputs and giving its outputs), or None."""
    subs = _traverse.subjaxprs(eqn)
    if len(subs) != 1 or eqn.primitive in _NOT_CALLS:
        return None
    parts = _jaxpr.jaxpr_parts(subs[0][1])
    if len(parts.invars) != len(eqn.invars) or len(parts.outvars) != len(eqn.outvars):
        return None
    if any(a.aval.shape != getattr(b.aval, "shape", None) for a, b in zip(parts.invars, eqn.invars)):
        return None
    return subs[0][1]


# Primitives with one jaxpr that is not a plain call of their inputs.
_NOT_CALLS = {p for p in (_compat.scan_p, _compat.while_p, _compat.cond_p) if p is not None}


def bind(frame: Frame, eqn: core.JaxprEqn, ins: list[Value]) -> list[Value]:
    """``eqn`` run as JAX runs it, its outputs blamed."""
    # (as ``core.eval_jaxpr`` binds it: a primitive holding a function,
    # shard_map's body, takes it as a bind param)
    params = eqn.primitive.get_bind_params(eqn.params)
    outs = eqn.primitive.bind(*[v.array for v in ins], **params)
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    return blame(frame, eqn, ins, outs)


def blame(frame: Frame, eqn: core.JaxprEqn, ins: list[Value], outs: list) -> list[Value]:
    run = frame.run
    inherited = _earliest(v.origin for v in ins)
    result = []
    for o in outs:
        if not run.bad(o):
            result.append(Value(o, None))
        elif inherited is not None:
            result.append(Value(o, inherited))
        else:
            result.append(Value(o, Origin(
                run.kind(o), eqn.primitive.name, _compat.user_line(eqn.source_info.traceback),
                frame.path, frame.iterations, _phase(eqn),
                tuple(_describe_input(eqn, i, v.array, o) for i, v in enumerate(ins)),
                next(run.counter))))
    return result


def _earliest(origins) -> Origin | None:
    best = None
    for o in origins:
        if o is not None and (best is None or o.order < best.order):
            best = o
    return best


def _phase(eqn: core.JaxprEqn) -> str:
    """``"backward"`` for a transposed equation of reverse mode (JAX names
    them ``transpose(...)``), else ``"forward"`` (in ``jax.grad``'s forward
    pass, JAX names the primal and the linearization alike: ``jvp(...)``)."""
    return "backward" if "transpose(" in str(eqn.source_info.name_stack) else "forward"


def _describe_input(eqn: core.JaxprEqn, i: int, x: Any, out: Any) -> str:
    """``"x = -0.5"``; for an array, its type and, where it has the output's
    shape, its element at the first non-finite output element."""
    name = f"input {i}"
    a, o = np.asarray(x), np.asarray(out)
    if a.size == 1:
        return f"{name} = {a.reshape(()).item()!r}"
    text = f"{name}: {a.dtype}{list(a.shape)}"
    if a.shape == o.shape and o.size:
        at = np.unravel_index(np.flatnonzero(~np.isfinite(o.astype(np.float64)
                                                          if o.dtype.kind == "f" else o))[:1],
                              o.shape)
        if at[0].size:
            index = tuple(int(k[0]) for k in at)
            text += f", at {list(index)} = {a[index].item()!r}"
    return text


# ---- loops and branches -----------------------------------------------------------

def _slice(v: Value, i: int, run: Run) -> Value:
    row = v.array[i]
    return Value(row, v.origin if v.origin is not None and run.bad(row) else None)


def _stack(rows: list[Value], aval: Any) -> Value:
    if not rows:
        return Value(np.zeros(aval.shape, aval.dtype), None)
    return Value(np.stack([np.asarray(r.array) for r in rows]),
                 _earliest(r.origin for r in rows))


def _scan_rule(frame: Frame, eqn: core.JaxprEqn, ins: list[Value]) -> list[Value]:
    p = eqn.params
    (nc, ncarry), length = _jaxpr.scan_counts(p), p["length"]
    consts, carry, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
    body = p["jaxpr"]
    label = _traverse.subjaxprs(eqn)[0][0].label
    ys_rows: list[list[Value]] = []
    order = range(length - 1, -1, -1) if p["reverse"] else range(length)
    for i in order:
        inner = frame.inside(label, ("scan", i))
        outs = run_jaxpr(inner, body, [*consts, *carry, *(_slice(x, i, frame.run) for x in xs)])
        carry, ys = outs[:ncarry], outs[ncarry:]
        ys_rows.append(ys)
    if p["reverse"]:
        ys_rows.reverse()
    y_avals = [v.aval for v in eqn.outvars[ncarry:]]
    ys = [_stack([r[k] for r in ys_rows], a) for k, a in enumerate(y_avals)]
    return [*carry, *ys]


def _while_rule(frame: Frame, eqn: core.JaxprEqn, ins: list[Value]) -> list[Value]:
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, carry = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
    labels = {sub.key: sub.label for sub, _ in _traverse.subjaxprs(eqn)}
    for i in itertools.count():
        inner = frame.inside(labels["body_jaxpr"], ("while", i))
        pred, = run_jaxpr(frame.inside(labels["cond_jaxpr"], ("while", i)), p["cond_jaxpr"],
                          [*cond_consts, *carry])
        if not bool(np.asarray(pred).any()):
            return list(carry)
        carry = run_jaxpr(inner, p["body_jaxpr"], [*body_consts, *carry])
    raise AssertionError("unreachable")


def _cond_rule(frame: Frame, eqn: core.JaxprEqn, ins: list[Value]) -> list[Value]:
    index = int(np.clip(np.asarray(ins[0].array), 0, len(eqn.params["branches"]) - 1))
    sub, branch = _traverse.subjaxprs(eqn)[index]
    return run_jaxpr(frame.inside(sub.label), branch, ins[1:])


# ---- shard_map -----------------------------------------------------------------
# The program runs on the mesh while the diagnosis runs in one of its host
# callbacks: running a shard_map there would wait for the devices the
# program holds. Its body runs on the CPU instead, shard by shard (the
# origin then names the body's equation and the shard), or, where it
# calls a collective, for all shards at once under a vmap per mesh axis
# (the origin is the shard_map).

def _shard_map_rule(frame: Frame, eqn: core.JaxprEqn, ins: list[Value]) -> list[Value]:
    p = eqn.params
    mesh, body = p["mesh"], p["jaxpr"]
    names, sizes = tuple(mesh.axis_names), tuple(mesh.axis_sizes)
    label = _traverse.subjaxprs(eqn)[0][0].label
    coords = list(np.ndindex(*sizes))
    blocks = [[_block(np.asarray(v.array), spec, names, sizes, c) for v, spec
               in zip(ins, p["in_specs"])] for c in coords]
    if _calls_collectives(body, set(names)):
        def fn(*args):
            return _eval_across_shards(body, args)
        for name in reversed(names):
            fn = jax.vmap(fn, axis_name=name)
        stacked = [np.stack([b[k] for b in blocks]).reshape(*sizes, *blocks[0][k].shape)
                   for k in range(len(ins))]
        outs = [np.asarray(o).reshape(len(coords), *np.shape(o)[len(sizes):])
                for o in fn(*stacked)]
        per_shard = [[Value(o[i], None) for o in outs] for i in range(len(coords))]
        whole = [_assemble([r[k].array for r in per_shard], spec, names, sizes, coords, v.aval)
                 for k, (spec, v) in enumerate(zip(p["out_specs"], eqn.outvars))]
        return blame(frame, eqn, ins, whole)
    per_shard = []
    for i, c in enumerate(coords):
        origins = [v.origin if v.origin is not None and frame.run.bad(b) else None
                   for v, b in zip(ins, blocks[i])]
        args = [Value(b, o) for b, o in zip(blocks[i], origins)]
        per_shard.append(run_jaxpr(frame.inside(label, ("shard", i)), body, args))
    return [Value(_assemble([r[k].array for r in per_shard], spec, names, sizes, coords, v.aval),
                  _earliest(r[k].origin for r in per_shard))
            for k, (spec, v) in enumerate(zip(p["out_specs"], eqn.outvars))]


def _eval_across_shards(body: Any, args: Sequence[Any]) -> list:
    """``body`` evaluated under a ``vmap`` per mesh axis (named as the
    mesh's), which runs its collectives; ``pvary`` (a type for
    ``check_vma``, meaningless there) as the identity."""
    parts = _jaxpr.jaxpr_parts(body)
    env = dict(zip(parts.constvars, parts.consts or ()))
    env.update(zip(parts.invars, args))

    def read(atom):
        return atom.val if type(atom) is core.Literal else env[atom]

    for eqn in parts.eqns:
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive is _compat.pvary_p:
            outs = ins
        else:
            outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in parts.outvars]


def _spec_axes(spec: Any, dim: int) -> tuple[str, ...]:
    """The mesh axes a ``PartitionSpec`` splits dimension ``dim`` over."""
    entry = spec[dim] if dim < len(spec) else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _block_slices(shape: tuple, spec: Any, names: tuple, sizes: tuple, coord: tuple) -> tuple:
    """The slices of an array of ``shape`` that the shard at mesh
    coordinates ``coord`` holds (``spec``: its ``PartitionSpec``)."""
    out = []
    for d, n in enumerate(shape):
        index, count = 0, 1
        for axis in _spec_axes(spec, d):  # (the first axis varies slowest)
            k = names.index(axis)
            index, count = index * sizes[k] + coord[k], count * sizes[k]
        step = n // count
        out.append(slice(index * step, (index + 1) * step))
    return tuple(out)


def _block(x: Any, spec: Any, names: tuple, sizes: tuple, coord: tuple) -> Any:
    return x[_block_slices(np.shape(x), spec, names, sizes, coord)]


def _assemble(blocks: list, spec: Any, names: tuple, sizes: tuple, coords: list,
              aval: Any) -> Any:
    """The array of type ``aval`` whose shards (by ``spec``) are ``blocks``
    (one per mesh coordinate; a replicated part is every shard's, equal)."""
    out = np.zeros(aval.shape, aval.dtype)
    for block, coord in zip(blocks, coords):
        out[_block_slices(aval.shape, spec, names, sizes, coord)] = np.asarray(block)
    return out


def _calls_collectives(body: Any, axes: set) -> bool:
    """Whether an equation of ``body`` (or nested in it) names a mesh axis
    (``psum``, ``all_gather``, ``axis_index``, ...)."""
    def names_axis(eqn) -> bool:
        if eqn.primitive is _compat.pvary_p:  # (a type on values, run per shard as identity)
            return False
        for key in ("axes", "axis_name", "axis_names"):
            value = eqn.params.get(key)
            values = value if isinstance(value, (tuple, list, frozenset, set)) else (value,)
            if any(isinstance(v, str) and v in axes for v in values):
                return True
        return False
    return _traverse.any_eqn(body, names_axis)


register_eager_rule(_compat.scan_p, _scan_rule)
register_eager_rule(_compat.while_p, _while_rule)
register_eager_rule(_compat.cond_p, _cond_rule)
register_eager_rule(_compat.shard_map_p, _shard_map_rule)
if _compat.pvary_p is not None:
    register_eager_rule(_compat.pvary_p, lambda frame, eqn, ins: list(ins))


def trace_on_cpu(fn: Callable, values: Sequence[Any]) -> Any:
    """``fn`` traced at the types of ``values``, on the CPU (the host may be
    inside a callback of a program holding the accelerator), its equations
    keeping their own lines (not those of a backward pass running around)."""
    with jax.default_device(jax.devices("cpu")[0]), _compat.own_source_info():
        return jax.make_jaxpr(fn)(*values)


def run_closed(closed: Any, args: Sequence[Any], run: Run, path: tuple[str, ...] = ()
               ) -> list[Value]:
    """``closed`` run eagerly on ``args``, on the CPU (the program this
    runs for may hold the accelerator: see ``_nans``)."""
    frame = Frame(path, (), run)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        values = [_given(frame, np.asarray(a), "input") for a in args]
        values = [Value(v.array, dataclasses.replace(v.origin, primitive=f"input {i}")
                        if v.origin is not None else None) for i, v in enumerate(values)]
        return run_jaxpr(frame, closed, values)

"""Programs as Python source.

``to_source`` renders a ``Program`` as a function ``program(p0, p1, p2, pv,
n)`` using raw JAX control flow, ``tx.get_state`` / ``tx.set_state`` (of
pytree-valued states too), ``with tx.scope(...)`` blocks, ``tx.next_key``
and ``h.sow``; ``build`` execs exactly that source (its
lines show in tracebacks), so a failing program prints as the code that
failed. ``to_source_hoisted`` / ``build_hoisted`` render the same program
with its inner functions defined once at module level (so that JAX's trace
caches are warm when it ran before) and its states' inits in one of
``INIT_STYLES``.
"""

from __future__ import annotations

import linecache
from typing import Callable

from .analysis import rule_functions, takes_p0
from .model import (ARGUMENTS_ONLY, CALL_WRAPPERS, CUSTOM_RULES, ENV, FUNCTION_KINDS, FUNCTIONS,
                    MIX, NUMPY_DTYPES, OP_SOURCE, P0_USE, PYTREE_INT, PYTREE_STATES, RULE_DEFS,
                    FWD_SCALE, T, TYPED_STATES, AddC, Assign, Bin, Bump, Cond, Const, Draw, Fori,
                    FPred, Get, IdxF, IPred, Mean, MulC, Program, RULE_SCALE, Scan, Scope, Set,
                    SIdx, Sow, Switch, Tree, Un, Var, VConst, While, has_rule, rule_reads_env,
                    rule_results, rule_split, typed_kind, typed_shape)


# ---------------------------------------------------------------------------------
# Rendering as Python source (the JAX interpreter execs exactly this)
# ---------------------------------------------------------------------------------

HEADER = """\
import jax, jax.numpy as jnp, ml_dtypes, numpy as np
from jax import lax
import equinox.internal as eqxi
import taxpr as tx
from taxpr import harvest as h
T, OTHER = "fuzz", "other"
"""


def _f(x: float) -> str:
    return repr(float(x))


def _vec(vals) -> str:
    return f"jnp.array([{', '.join(_f(x) for x in vals)}], jnp.float32)"


def _npinit(init) -> str:
    if isinstance(init, tuple):
        return f"np.array([{', '.join(_f(x) for x in init)}], np.float32)"
    return f"np.float32({_f(init)})"


def rexpr(e, top: bool = True) -> str:
    def wrap(s):
        return s if top else f"({s})"

    if isinstance(e, Var):
        return e.name
    if isinstance(e, Const):
        return f"jnp.float32({_f(e.value)})"
    if isinstance(e, VConst):
        return _vec(e.values)
    if isinstance(e, Un):
        return f"jnp.{e.op}({rexpr(e.a)})"
    if isinstance(e, Bin):
        if e.op == "avg":
            return wrap(f"({rexpr(e.a, False)} + {rexpr(e.b, False)}) * 0.5")
        return wrap(f"{rexpr(e.a, False)} * {rexpr(e.b, False)} * 0.25")
    if isinstance(e, AddC):
        return wrap(f"({rexpr(e.a, False)} + {_f(e.c)}) * 0.5")
    if isinstance(e, MulC):
        return wrap(f"{rexpr(e.a, False)} * {_f(e.c)}")
    if isinstance(e, Mean):
        return f"jnp.mean({rexpr(e.a)})"
    if isinstance(e, IdxF):
        return wrap(f"jnp.float32({e.ivar} % 3) * 0.5")
    if isinstance(e, IPred):
        return f"({e.ivar} + {e.c}) % {e.m} == 0"
    if isinstance(e, FPred):
        return f"{rexpr(e.e, False)} > {_f(e.t)}"
    if isinstance(e, SIdx):
        return f"({e.ivar} + {e.c}) % {e.m}"
    raise TypeError(e)


def _state_get(state: str, init) -> str:
    return f'tx.get_state("{state}", {_npinit(init)})'


def _typed_lit(d: str, value) -> str:
    """One value of dtype ``d`` as a Python literal."""
    k = typed_kind(d)
    if k == "b":
        return repr(bool(value))
    if k == "i":
        return repr(int(value))
    if k == "f":
        return _f(value)
    return f"complex({_f(value[0])}, {_f(value[1])})"  # no -0.0 from a "-2j" literal


def _typed_type(d: str) -> str:
    """The NumPy scalar type of dtype ``d`` in source."""
    if d not in NUMPY_DTYPES:
        return f"ml_dtypes.{d}"
    return "np.bool_" if d == "bool" else f"np.{d}"


def _typed_init(d: str, init, form: str) -> str:
    """A typed state's init as a NumPy constant (or a callable returning one)."""
    if typed_shape(d):
        src = f"np.array([{', '.join(_typed_lit(d, x) for x in init)}], {_typed_type(d)})"
    elif form == "scalar":
        src = f"{_typed_type(d)}({_typed_lit(d, init)})"
    else:
        src = f"np.array({_typed_lit(d, init)}, {_typed_type(d)})"
    return f"lambda: {src}" if form == "callable" else src


def bump_lines(s: Bump, init_src: str) -> list[str]:
    """The source lines of a ``Bump`` whose init renders as ``init_src``."""
    d = TYPED_STATES[s.state]
    y = f"y{s.uid}"
    arg = (rexpr(s.arg) if s.op == "xor" else f"{_typed_type(d)}({s.arg})" if s.op == "add"
           else None)
    lines = [f'{y} = tx.get_state("{s.state}", {init_src})',
             f"{y} = {OP_SOURCE[s.op].format(y=y, arg=arg)}",
             f'tx.set_state("{s.state}", {y})']
    if s.target:
        mix = MIX[typed_kind(d)].format(y=y)
        lines.append(f"{s.target} = {s.target} * 0.5 + {mix} * 0.25")
    return lines


def _tree_init(state: str, init, style: str = "numpy") -> str:
    """A pytree state's init (its leaves in leaf order) in ``style``
    (``INIT_STYLES``): a tuple or dict of NumPy or JAX constants, or a
    callable returning one."""
    leaves = []
    for (_, kind), x in zip(PYTREE_STATES[state][1], init):
        if style == "numpy":
            leaves.append(f"np.{PYTREE_INT}({int(x)})" if kind == "i8" else _npinit(x))
            continue
        if kind == "i8":
            value, shape = f"jnp.{PYTREE_INT}({int(x)})", "()"
        elif kind == "V":
            value, shape = f"jnp.array([{', '.join(_f(v) for v in x)}], jnp.float32)", "(3,)"
        else:
            value, shape = f"jnp.float32({_f(x)})", "()"
        dtype = f"jnp.{PYTREE_INT}" if kind == "i8" else "jnp.float32"
        leaves.append(f"{value} * jnp.ones({shape}, {dtype})" if style == "ones" else value)
    src = _tree_src(state, leaves)
    return f"lambda: {src}" if style == "callable" else src


def _tree_src(state: str, leaves: list) -> str:
    """A pytree state's value from its leaves' source, in leaf order."""
    container, spec = PYTREE_STATES[state]
    if container == "tuple":
        return f"({', '.join(leaves)})"
    return "{" + ", ".join(f'"{key}": {x}' for (key, _), x in zip(spec, leaves)) + "}"


def tree_lines(s: Tree, init_src: str) -> list[str]:
    """The source lines of a ``Tree`` whose init renders as ``init_src``."""
    spec = PYTREE_STATES[s.state][1]
    t = f"t{s.uid}"
    leaf = [f"{t}[{key!r}]".replace("'", '"') for key, _ in spec]
    if s.op == "set":
        es = iter(s.es)
        new = [f"({s.arg} % 5).astype(jnp.{PYTREE_INT})" if kind == "i8" else rexpr(next(es))
               for _, kind in spec]
        return [f'tx.set_state("{s.state}", {_tree_src(s.state, new)})']
    lines = [f'{t} = tx.get_state("{s.state}", {init_src})']
    for (_, kind), x, target in zip(spec, leaf, s.targets):
        if target is None:
            continue
        if kind == "i8":
            mix = MIX["i"].format(y=x)
            lines.append(f"{target} = {target} * 0.5 + {mix} * 0.25")
        else:
            lines.append(f"{target} = ({target} + {x}) * 0.5")
    if s.op == "update":
        es = iter(s.es)
        new = [f"{x} + np.{PYTREE_INT}({s.arg})" if kind == "i8"
               else f"({x} + {rexpr(next(es), False)}) * 0.5" for (_, kind), x in zip(spec, leaf)]
        lines.append(f'tx.set_state("{s.state}", {_tree_src(s.state, new)})')
    return lines


def scope_lines(name: str, body: list) -> list[str]:
    """``with tx.scope(name):`` around the (indented) lines ``body``."""
    return [f'with tx.scope("{name}"):', *(body or ["    pass"])]


def call_lines(s, call: str) -> list[str]:
    """The lines calling function statement ``s`` (``call``, one line) once
    per call, each in its own scope where ``s.scopes`` gives one."""
    out = []
    for c in range(s.calls):
        sc = s.scopes[c] if s.scopes else None
        out += scope_lines(sc, ["    " + call]) if sc else [call]
    return out


CNT_GET = 'tx.get_state("cnt", np.int32(0))'
DRAW = "jax.random.uniform(tx.next_key(), minval=-1.0, maxval=1.0)"
ENV_S = ", ".join(ENV)


def rblock(stmts, ind: str, out: list) -> None:
    for s in stmts:
        rstmt(s, ind, out)


def rstmt(s, ind: str, out: list) -> None:
    w = lambda line: out.append(ind + line)  # noqa: E731
    i2 = ind + "    "
    if isinstance(s, Assign):
        w(f"{s.target} = {rexpr(s.e)}")
    elif isinstance(s, Get):
        w(f"{s.target} = {_state_get(s.state, s.init)}")
    elif isinstance(s, Set):
        w(f'tx.set_state("{s.state}", {rexpr(s.e)})')
    elif isinstance(s, Draw):
        w(f"{s.target} = {DRAW}")
    elif isinstance(s, Bump):
        for line in bump_lines(s, _typed_init(TYPED_STATES[s.state], s.init, s.form)):
            w(line)
    elif isinstance(s, Tree):
        for line in tree_lines(s, _tree_init(s.state, s.init) if s.op != "set" else ""):
            w(line)
    elif isinstance(s, Scope):
        body: list = []
        rblock(s.body, "    ", body)
        for line in scope_lines(s.name, body):
            w(line)
    elif isinstance(s, Sow):
        tag = "T" if s.tag == T else "OTHER"
        if s.mode == "cond_clobber":
            call = f'h.sow_cond({rexpr(s.e)}, {rexpr(s.pred)}, tag={tag}, name="{s.name}")'
        else:
            call = f'h.sow({rexpr(s.e)}, tag={tag}, name="{s.name}", mode="{s.mode}")'
        w(f"{s.target} = {call}" if s.target else call)
    elif isinstance(s, Scan):
        u = s.uid
        w(f"def scan{u}(carry, xi):")
        out.append(f"{i2}{ENV_S} = carry")
        out.append(f"{i2}x{u}, i{u} = xi")
        rblock(s.body, i2, out)
        out.append(f"{i2}return ({ENV_S}), {s.yvar}")
        coefs = _vec(s.coefs) if s.length else "jnp.zeros((0,), jnp.float32)"
        rev = ", reverse=True" if s.reverse else ""
        w(f"({ENV_S}), ys{u} = lax.scan(scan{u}, ({ENV_S}), ({coefs} * {rexpr(s.xsrc, False)}, "
          f"jnp.arange({s.length}, dtype=jnp.int32)){rev})")
        w(f"{s.out} = jnp.tanh(jnp.sum(ys{u}, axis=0))")
    elif isinstance(s, Fori):
        u = s.uid
        w(f"def fori{u}(i{u}, carry):")
        out.append(f"{i2}{ENV_S} = carry")
        rblock(s.body, i2, out)
        out.append(f"{i2}return {ENV_S}")
        w(f"{ENV_S} = lax.fori_loop(jnp.clip({s.ivar} + {s.lo}, 0, 2), "
          f"jnp.clip({s.ivar} + {s.hi}, 0, 3), fori{u}, ({ENV_S}))")
    elif isinstance(s, While):
        u = s.uid
        carry = f"k{u}, ({ENV_S})" if s.kind == "carry" else ENV_S
        if s.kind == "state":
            w(f"lim{u} = {CNT_GET} + {s.bound}")
        w(f"def wcond{u}(carry):")
        out.append(f"{i2}{carry} = carry")
        if s.csow:
            out.append(f'{i2}h.sow({s.csow[0]}, tag=T, name="{s.csow[1]}", mode="clobber")')
        if s.cbump:
            out += [i2 + line for line in bump_lines(
                s.cbump, _typed_init(TYPED_STATES[s.cbump.state], s.cbump.init, s.cbump.form))]
        pred = f"k{u} < {s.bound}" if s.kind == "carry" else f"{CNT_GET} < lim{u}"
        if s.spred:
            st_, init, t = s.spred
            pred = f"({pred}) & ({_state_get(st_, init)} > {_f(t)})"
        out.append(f"{i2}return {pred}")
        w(f"def wbody{u}(carry):")
        out.append(f"{i2}{carry} = carry")
        if s.kind == "state":
            out.append(f'{i2}tx.set_state("cnt", {CNT_GET} + 1)')
        rblock(s.body, i2, out)
        out.append(f"{i2}return " + (f"k{u} + 1, ({ENV_S})" if s.kind == "carry" else ENV_S))
        if s.loop == "lax":
            loop = "lax.while_loop({})"
        else:  # at most `bound` steps: equinox's max_steps
            # equinox's bounded loop of one step runs its body unconditionally
            # (a "false step" whose carry it masks: its effects happen, as a
            # jax.debug.callback's would), which the reference's while does
            # not model: at least two steps, each under a cond.
            least = 2 if s.loop == "eqx_bounded" else 1
            loop = (f"eqxi.while_loop({{}}, max_steps={max(s.bound, least)}, "
                    f"kind=\"{s.loop.removeprefix('eqx_')}\")")
        if s.kind == "carry":
            w(f"_, ({ENV_S}) = " + loop.format(f"wcond{u}, wbody{u}, (jnp.int32(0), ({ENV_S}))"))
        else:
            w(f"{ENV_S} = " + loop.format(f"wcond{u}, wbody{u}, ({ENV_S})"))
    elif isinstance(s, (Cond, Switch)):
        u = s.uid
        for b, body in enumerate(s.branches):
            w(f"def br{u}_{b}({ENV_S}):")
            rblock(body, i2, out)
            out.append(f"{i2}return {ENV_S}")
        w(branch_call(s, ENV_S))
    elif isinstance(s, FUNCTIONS):
        kind = FUNCTION_KINDS[type(s)]
        custom = kind in ARGUMENTS_ONLY
        if kind in ("jit", "ckpt"):
            w("@jax.jit" if kind == "jit" else "@jax.checkpoint")
        # A custom function takes ``n`` (and ``p0``, see ``takes_p0``) as an
        # argument: closing over a traced value is not supported by JAX's
        # custom derivatives.
        params = f"{ENV_S}, n" if custom else ENV_S
        params += ", p0" if takes_p0(s) else ""
        w(f"def {kind}{s.uid}({params}):")
        rblock(s.body, i2, out)
        if has_rule(s):
            out.append(f"{i2}{P0_USE}")
        out.append(f"{i2}return {ENV_S}")
        if custom:
            f = f"{kind}{s.uid}"
            w(f"{f}_fn = {f}")
            if kind in CALL_WRAPPERS:
                w(f"{f} = " + CALL_WRAPPERS[kind].format(f=f))
            else:
                wrap, rules = CUSTOM_RULES[kind]
                w(f"{f} = {wrap}({f}_fn)")
                if has_rule(s):
                    w(RULE_DEFS[kind][0].format(f=f))

                    def render(stmts):
                        lines: list = []
                        rblock(stmts, "    ", lines)
                        return lines
                    out += [ind + line for line in rule_lines(s, f, [f"{params} = p"], render)]
                    w(rule_install(s, f))
                else:
                    w(rules.format(f=f))
        for line in call_lines(s, f"{ENV_S} = {kind}{s.uid}({params})"):
            w(line)
    else:
        raise TypeError(s)


def rule_lines(s, f: str, unpack: list, render: Callable[[tuple], list]) -> list:
    """The lines of the rule of custom function ``s`` (named ``f``) after its
    header: ``unpack`` (its arguments from ``p``, where a rule statement
    reads them), its statements before its call of the function, the call,
    its statements after (``render(stmts)``: their lines), and what it
    returns (``RULE_DEFS``; ``RULE_SCALE`` / ``FWD_SCALE`` where it uses its
    sows' results)."""
    before, after = rule_split(s)
    kind = FUNCTION_KINDS[type(s)]
    _, call, ret, _ = RULE_DEFS[kind]
    lines = ["    " + line for line in unpack] if rule_reads_env(s) else []
    lines += [*render(before), "    " + call.format(f=f), *render(after)]
    results = rule_results(s)
    if results:
        r = " + ".join(f"jnp.sum({x})" for x in results)
        ret = RULE_SCALE if kind == "cjvp" else FWD_SCALE[0]
        lines.append("    " + ret.format(r=r))
    else:
        lines.append("    " + ret)
    return lines


def rule_install(s, f: str) -> str:
    """The line installing the rule of custom function ``s`` (named ``f``):
    a custom_vjp whose fwd saves its sows' results gets ``FWD_SCALE``'s bwd."""
    kind = FUNCTION_KINDS[type(s)]
    if kind == "cvjp" and rule_results(s):
        return FWD_SCALE[1].format(f=f)
    return RULE_DEFS[kind][3].format(f=f)


def branch_call(s, operands: str) -> str:
    """The line calling a Cond / Switch statement's branch functions
    ``br{uid}_{b}`` on ``operands``."""
    names = ", ".join(f"br{s.uid}_{b}" for b in range(len(s.branches)))
    names += "," if len(s.branches) == 1 else ""
    if isinstance(s, Cond):
        return f"{ENV_S} = lax.cond({rexpr(s.pred)}, {names}, {operands})"
    return f"{ENV_S} = lax.switch({rexpr(s.idx)}, ({names}), {operands})"


def to_source(program: Program, header: bool = True) -> str:
    """The program as a Python function ``program(p0, p1, p2, pv, n)``."""
    out = [HEADER] if header else []
    out.append("def program(p0, p1, p2, pv, n):")
    out.append(f"    {ENV_S} = p0, p1, p2, pv")
    rblock(program.body, "    ", out)
    out.append(f"    return {ENV_S}")
    return "\n".join(out) + "\n"


_BUILD_COUNT = [0]


def build(program: Program):
    """exec ``to_source(program)``; tracebacks show its lines."""
    src = to_source(program)
    _BUILD_COUNT[0] += 1
    fname = f"<fuzz-program-{_BUILD_COUNT[0]}>"
    linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
    namespace: dict = {}
    exec(compile(src, fname, "exec"), namespace)
    return namespace["program"]


# ---------------------------------------------------------------------------------
# Rendering with the inner functions at module level (programs as users run
# them: warm trace caches, inits built inside the trace)
# ---------------------------------------------------------------------------------
# ``to_source_hoisted`` renders a program with every inner function (scan /
# fori / while bodies, branches, jitted and checkpointed functions) defined
# once at module level, its free variables passed explicitly (``ex``): the
# functions keep their identity across calls, so JAX's trace caches (keyed by
# function identity) are warm when the program ran before (under ``jax.jit``,
# eagerly or ``jax.make_jaxpr``) and taxpr transforms it. ``init_style``
# renders a state's init as a NumPy constant, a JAX constant (a tracer inside
# a traced body), ``c * jnp.ones(())`` or a callable: unreached states must
# start at that init in every style.


INIT_STYLES = ("numpy", "jnp", "ones", "callable")


def _styled_init(init, style: str) -> str:
    if style == "numpy":
        return _npinit(init)
    if isinstance(init, tuple):
        value = f"jnp.array([{', '.join(_f(x) for x in init)}], jnp.float32)"
        ones = f"{value} * jnp.ones((3,), jnp.float32)"
    else:
        value = f"jnp.float32({_f(init)})"
        ones = f"{_f(init)} * jnp.ones((), jnp.float32)"
    if style == "jnp":
        return value
    if style == "ones":
        return ones
    return f"lambda: {value}"


class _Hoisted:
    """The renderer of ``to_source_hoisted``."""

    def __init__(self, init_style: str):
        self.init_style = init_style
        self.defs: list[str] = []

    def get(self, state: str, init) -> str:
        return f'tx.get_state("{state}", {_styled_init(init, self.init_style)})'

    def typed_init(self, s: Bump) -> str:
        """A typed state's init in ``init_style`` ("numpy": the Bump's own form)."""
        d = TYPED_STATES[s.state]
        if self.init_style == "numpy":
            return _typed_init(d, s.init, s.form)
        jd = "jnp.bool_" if d == "bool" else f"jnp.{d}"
        lit = (f"[{', '.join(_typed_lit(d, x) for x in s.init)}]" if typed_shape(d)
               else _typed_lit(d, s.init))
        value = f"jnp.array({lit}, {jd})"
        if self.init_style == "jnp":
            return value
        if self.init_style == "ones":
            return f"{value} * jnp.ones({typed_shape(d)}, {jd})"
        return f"lambda: {value}"

    def function(self, header: str, scope: tuple, lines: list) -> None:
        """A module-level def: ``header`` then unpacking ``ex`` into ``scope``."""
        self.defs.append(header)
        self.defs.append(f"    {', '.join(scope)}, = ex")
        self.defs.extend(lines)
        self.defs.append("")

    def block(self, stmts, ind: str, out: list, scope: tuple) -> None:
        for s in stmts:
            self.stmt(s, ind, out, scope)

    def body(self, stmts, scope: tuple) -> list:
        lines: list = []
        self.block(stmts, "    ", lines, scope)
        return lines

    def stmt(self, s, ind: str, out: list, scope: tuple) -> None:
        w = lambda line: out.append(ind + line)  # noqa: E731
        ex = f"({', '.join(scope)},)"
        if isinstance(s, Get):
            w(f"{s.target} = {self.get(s.state, s.init)}")
        elif isinstance(s, Bump):
            for line in bump_lines(s, self.typed_init(s)):
                w(line)
        elif isinstance(s, Tree):
            init = _tree_init(s.state, s.init, self.init_style) if s.op != "set" else ""
            for line in tree_lines(s, init):
                w(line)
        elif isinstance(s, Scope):
            body: list = []
            self.block(s.body, "    ", body, scope)
            for line in scope_lines(s.name, body):
                w(line)
        elif isinstance(s, (Assign, Set, Sow, Draw)):
            rstmt(s, ind, out)
        elif isinstance(s, Scan):
            u, inner = s.uid, (*scope, f"x{s.uid}", f"i{s.uid}")
            lines = [f"    x{u}, i{u} = xi", *self.body(s.body, inner),
                     f"    return (({ENV_S}), ex), {s.yvar}"]
            self.defs.append(f"def scan{u}(carry, xi):")
            self.defs.append(f"    ({ENV_S}), ex = carry")
            self.function_tail(scope, lines)
            coefs = _vec(s.coefs) if s.length else "jnp.zeros((0,), jnp.float32)"
            rev = ", reverse=True" if s.reverse else ""
            w(f"(({ENV_S}), _), ys{u} = lax.scan(scan{u}, (({ENV_S}), {ex}), "
              f"({coefs} * {rexpr(s.xsrc, False)}, jnp.arange({s.length}, dtype=jnp.int32)){rev})")
            w(f"{s.out} = jnp.tanh(jnp.sum(ys{u}, axis=0))")
        elif isinstance(s, Fori):
            u, inner = s.uid, (*scope, f"i{s.uid}")
            lines = [*self.body(s.body, inner), f"    return ({ENV_S}), ex"]  # nested defs first
            self.defs.append(f"def fori{u}(i{u}, carry):")
            self.defs.append(f"    ({ENV_S}), ex = carry")
            self.function_tail(scope, lines)
            w(f"({ENV_S}), _ = lax.fori_loop(jnp.clip({s.ivar} + {s.lo}, 0, 2), "
              f"jnp.clip({s.ivar} + {s.hi}, 0, 3), fori{u}, (({ENV_S}), {ex}))")
        elif isinstance(s, While):
            u = s.uid
            outer = scope
            if s.kind == "state":
                w(f"lim{u} = {CNT_GET} + {s.bound}")
                scope = (*scope, f"lim{u}")
                ex = f"({', '.join(scope)},)"
            carry = f"k{u}, ({ENV_S}), ex" if s.kind == "carry" else f"({ENV_S}), ex"
            inner = (*outer, f"k{u}") if s.kind == "carry" else scope
            cond_lines = []
            if s.csow:
                cond_lines.append(f'    h.sow({s.csow[0]}, tag=T, name="{s.csow[1]}", '
                                  f'mode="clobber")')
            if s.cbump:
                cond_lines += ["    " + line for line in bump_lines(s.cbump, self.typed_init(s.cbump))]
            pred = f"k{u} < {s.bound}" if s.kind == "carry" else f"{CNT_GET} < lim{u}"
            if s.spred:
                st_, init, t = s.spred
                pred = f"({pred}) & ({self.get(st_, init)} > {_f(t)})"
            cond_lines.append(f"    return {pred}")
            self.defs.append(f"def wcond{u}(carry):")
            self.defs.append(f"    {carry} = carry")
            self.function_tail(scope, cond_lines)
            body_lines = []
            if s.kind == "state":
                body_lines.append(f'    tx.set_state("cnt", {CNT_GET} + 1)')
            # The body sees k{u} (carry kind) as a free variable of nested functions.
            body_lines += self.body(s.body, inner)
            body_lines.append("    return " + (f"k{u} + 1, ({ENV_S}), ex" if s.kind == "carry"
                                               else f"({ENV_S}), ex"))
            self.defs.append(f"def wbody{u}(carry):")
            self.defs.append(f"    {carry} = carry")
            self.function_tail(scope, body_lines)
            if s.kind == "carry":
                w(f"_, ({ENV_S}), _ = lax.while_loop(wcond{u}, wbody{u}, "
                  f"(jnp.int32(0), ({ENV_S}), {ex}))")
            else:
                w(f"({ENV_S}), _ = lax.while_loop(wcond{u}, wbody{u}, (({ENV_S}), {ex}))")
        elif isinstance(s, (Cond, Switch)):
            u = s.uid
            for b, body in enumerate(s.branches):
                self.function(f"def br{u}_{b}({ENV_S}, ex):", scope,
                              [*self.body(body, scope), f"    return {ENV_S}"])
            w(branch_call(s, f"{ENV_S}, {ex}"))
        elif isinstance(s, FUNCTIONS):
            kind = FUNCTION_KINDS[type(s)]
            f = f"{kind}{s.uid}"
            p0_use = [f"    {P0_USE}"] if has_rule(s) else []  # p0: in ``ex`` (scope)
            self.function(f"def {f}_fn({ENV_S}, ex):", scope,
                          [*self.body(s.body, scope), *p0_use, f"    return {ENV_S}"])
            if kind in CALL_WRAPPERS:
                self.defs.append(f"{f} = " + CALL_WRAPPERS[kind].format(f=f))
            else:
                wrap, rules = CUSTOM_RULES.get(kind, ({"jit": "jax.jit", "ckpt": "jax.checkpoint"}
                                                      .get(kind), None))
                self.defs.append(f"{f} = {wrap}({f}_fn)")
                if has_rule(s):
                    def render(stmts):
                        lines: list = []
                        self.block(stmts, "    ", lines, ())  # no nested functions
                        return lines
                    unpack = [f"{ENV_S}, ex = p", f"{', '.join(scope)}, = ex"]
                    self.defs += [RULE_DEFS[kind][0].format(f=f),
                                  *rule_lines(s, f, unpack, render), rule_install(s, f)]
                elif rules:
                    self.defs.append(rules.format(f=f))
            self.defs.append("")
            for line in call_lines(s, f"{ENV_S} = {kind}{s.uid}({ENV_S}, {ex})"):
                w(line)
        else:
            raise TypeError(s)

    def function_tail(self, scope: tuple, lines: list) -> None:
        """The rest of a def whose header unpacked ``ex`` from its carry."""
        self.defs.append(f"    {', '.join(scope)}, = ex")
        self.defs.extend(lines)
        self.defs.append("")


def to_source_hoisted(program: Program, init_style: str = "numpy") -> str:
    """The program as ``program(p0, p1, p2, pv, n)`` with its inner functions
    at module level (see above)."""
    r = _Hoisted(init_style)
    main = ["def program(p0, p1, p2, pv, n):", f"    {ENV_S} = p0, p1, p2, pv"]
    # With rule statements every function gets ``p0`` too (in ``ex``).
    r.block(program.body, "    ", main, ("n", "p0") if rule_functions(program) else ("n",))
    main.append(f"    return {ENV_S}")
    return "\n".join([HEADER, *r.defs, *main]) + "\n"


def build_hoisted(program: Program, init_style: str):
    src = to_source_hoisted(program, init_style)
    _BUILD_COUNT[0] += 1
    fname = f"<fuzz-hoisted-{_BUILD_COUNT[0]}>"
    linecache.cache[fname] = (len(src), None, src.splitlines(True), fname)
    namespace: dict = {}
    exec(compile(src, fname, "exec"), namespace)
    return namespace["program"]

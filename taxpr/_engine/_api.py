"""What the engine's clients and thread rules see: errors and paths, the
jaxpr under construction (``Level``), channels, the policies and hooks of
a client (``RulePolicy``, ``Hooks``) and the registry of thread rules
(``register_thread_rule``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, Sequence

import jax
import numpy as np

from .._jax.internals import core
from .. import _jaxpr, _traverse

if TYPE_CHECKING:  # annotations only: the interpreter is built on this module
    from ._interpreter import Engine


class InjectError(ValueError):
    """An injector returned something of the wrong structure, shape or dtype."""


def format_path(path: Sequence[str]) -> str:
    return "/".join(path) if path else "<top level>"


def describe_tag(params: dict) -> str:
    """``tag(k=v, ...)`` with the params a user passed."""
    return "tag(" + ", ".join(f"{k}={v!r}" for k, v in params.items()) + ")"


def describe_site(params: dict, path: Sequence[str]) -> str:
    return f"{describe_tag(params)} at {format_path(path)}"


# Path labels of the derivative rules JAX traces when it differentiates a
# custom function (a custom_jvp rule, a custom_vjp fwd or bwd).
RULE_PATH_SUFFIXES = ("[rule]", "[jvp rule]", "[fwd]", "[bwd]")


def trace_in(context: Callable | None, fn: Callable, avals: Sequence[Any]) -> Any:
    """``fn`` traced to a closed jaxpr, inside ``context()`` (a shard_map
    body's tracing context) when given."""
    if context is None:
        return _jaxpr.trace_flat(fn, avals)
    with context():
        return _jaxpr.trace_flat(fn, avals)


class ChannelKey(NamedTuple):
    """Names a channel: values collected from (or fed to) one site besides
    ctx, carried out of (into) every jaxpr around it. ``site`` is the
    layer's own hashable description of the site; ``occurrence`` numbers
    the channels of one ``site`` afresh in every jaxpr they pass through
    (``Level.channel``), so that sites in different calls (two jits, two
    scans) never share a key there; ``stacked``: the values come out of (go
    into) a scan, one row per step."""

    site: Any
    occurrence: int
    stacked: bool


class Level:
    """Equations being emitted for one jaxpr under construction."""

    __slots__ = ("eqns", "env", "consts", "path", "context", "collected", "feeds", "dropped",
                 "changed", "_local", "_occurrences")

    def __init__(self, path: tuple[str, ...], context: Callable | None = None):
        # ``context()`` enters the tracing context of this jaxpr's body (set
        # inside shard_map), used when tracing injectors for its sites.
        self.context = context
        self.eqns: list = []
        self.env: dict = {}
        self.consts = _traverse.IdMemo()  # const value -> its var
        self.path = path
        # Channels besides ctx: values collected per site (scan stacks them
        # into ys) and values fed to sites (scan slices them from xs).
        self.collected: list[tuple[Any, list]] = []
        self.feeds: dict[Any, list] = {}
        # Atoms a site rewrite stopped using (e.g. a get_state's init, which
        # the state read replaces): their producers are dropped at the end
        # if nothing else uses them (``drop_unused_producers``).
        self.dropped: list = []
        # ``(new ctx, the positions it changed)`` as a site rule that knows
        # them records it (one state's set changes one leaf of n): the
        # engine then does not compare all n leaves per site.
        self.changed: tuple | None = None
        self._local: dict = {}
        self._occurrences: dict = {}  # site -> channels of it so far

    def channel(self, site: Any, stacked: bool = False) -> ChannelKey:
        """The key of a new channel of ``site`` in this jaxpr."""
        n = self._occurrences.get(site, 0)
        self._occurrences[site] = n + 1
        return ChannelKey(site, n, stacked)

    def local(self, owner: Any) -> dict:
        """A table private to ``owner`` (a site rule) for what it keeps while
        this jaxpr is built, e.g. what a tag's site saw for the tag's tangent
        bound right after it."""
        table = self._local.get(owner)
        if table is None:
            table = self._local[owner] = {}
        return table

    def collect(self, key: ChannelKey, atoms: Sequence[Any]) -> None:
        self.collected.append((key, list(atoms)))

    def trace(self, fn: Callable, avals: Sequence[Any]) -> Any:
        """``fn`` traced to a closed jaxpr in this jaxpr's tracing context."""
        return trace_in(self.context, fn, avals)

    def feed(self, key: ChannelKey, avals: Sequence[Any]) -> list:
        """Inputs fed to this jaxpr under ``key`` (the same vars if asked twice)."""
        if key not in self.feeds:
            self.feeds[key] = [_jaxpr.new_var(a) for a in avals]
        return self.feeds[key]

    def atom(self, v: Any) -> Any:
        if type(v) is core.Var:
            return self.env.get(v, v)
        return v

    def const_var(self, value: Any) -> core.Var:
        return self.consts.get_or_compute(value, lambda: _jaxpr.new_var(_jaxpr.abstractify(value)))

    def emit(self, eqn: core.JaxprEqn) -> None:
        env = self.env
        if env and any(type(v) is core.Var and v in env for v in eqn.invars):
            eqn = eqn.replace(invars=[self.atom(v) for v in eqn.invars])
        self.eqns.append(eqn)

    def emit_rebuilt(self, eqn: core.JaxprEqn, new_subs: dict, invars: Sequence[Any],
                     outvars: Sequence[Any], **params: Any) -> None:
        """Emit ``eqn`` with sub-jaxprs replaced (``new_subs``: ``{(key,
        index): jaxpr}``, ``index`` None for a jaxpr-valued param), new
        inputs and outputs and updated ``params``; its effects are
        recomputed from the new sub-jaxprs."""
        emit_rebuilt_eqn(self, eqn, new_subs, invars, outvars, **params)

    def hoisted(self) -> tuple[list, list]:
        pairs = self.consts.items()
        return [v for _, v in pairs], [c for c, _ in pairs]


def inline(level: Level, closed: Any, in_atoms: Sequence[Any]) -> list:
    """Copy ``closed``'s equations into ``level`` with fresh variables."""
    constvars, consts, invars, eqns, outvars, _, _ = _jaxpr.jaxpr_parts(closed)
    env: dict = {}
    for v, c in zip(constvars, consts):
        env[v] = level.const_var(c)
    for v, a in zip(invars, in_atoms):
        env[v] = a
    get = env.get
    for e in eqns:
        outs = []
        for o in e.outvars:
            if isinstance(o, core.DropVar):
                outs.append(o)
            else:
                n = _jaxpr.new_var(o.aval)
                env[o] = n
                outs.append(n)
        ins = [get(v, v) if type(v) is core.Var else v for v in e.invars]
        level.eqns.append(e.replace(invars=ins, outvars=outs))
    return [get(v, v) if type(v) is core.Var else v for v in outvars]


class Channels(NamedTuple):
    """What a threaded jaxpr collects (extra outputs, appended last) and is
    fed (extra inputs, appended last): ``((key, avals), ...)`` each."""

    collects: tuple = ()
    feeds: tuple = ()


NO_CHANNELS = Channels()


class RulePolicy:
    """How a layer treats its tags in custom derivative rules: a custom_jvp
    rule, a custom_vjp fwd or bwd, which JAX traces only when it
    differentiates the call, after the rewrite. Two semantics:

    * eager (``in_place``; state and keys): the rule runs in the function's
      place with ctx threaded through it, so the effects of what runs happen
      once, in program order;
    * oryx's (harvest): the function's own effects stand; a rule whose tags
      the layer rewrites (``has_selected``) acts on ctx after the function,
      and other selected tags in rules go to ``untraced_site``.

    The defaults are oryx's with nothing rewritten in rules.
    """

    in_place = False

    # Whether any custom_jvp rule may hold a selected tag (rules are not
    # traced ahead of JAX): custom_jvp functions outside custom_vjp functions
    # are then threaded, their rules when JAX runs them; a primitive without
    # a thread rule whose only reason to be threaded is such a rule is left
    # as it is.
    may_hold_sites = False

    # Whether ``untraced_site`` can raise (tracing a bwd to look costs a trace).
    checks_untraced = False

    def has_selected(self, engine: "Engine", eqn: core.JaxprEqn) -> bool:
        """Whether the custom JVP rule of ``eqn`` (a ``custom_jvp_call``), or
        its fwd (a ``custom_vjp_call``), traced only when differentiated,
        holds tags to rewrite there; if so, without ``in_place``, ctx is
        threaded through the rule after the function when JAX
        differentiates ``eqn``."""
        return False

    def prepare(self, engine: "Engine", rule: Any, n_primals: int, eqn: core.JaxprEqn) -> Any:
        """The custom JVP rule jaxpr ``rule`` (inputs: ``n_primals`` primals,
        then tangents) of the custom call ``eqn``, as it should be threaded:
        its ctx outputs must not depend on the tangents, or reverse mode
        cannot linearize it."""
        return rule

    def untraced_site(self, params: dict, path: tuple[str, ...]) -> Exception | None:
        """A selected tag inside a user's derivative rule that runs only when
        the rewritten program is differentiated from outside, after the
        rewrite, where the layer does not thread it: the error to raise, or
        None to leave it a tag (oryx's harvest does)."""
        return None

    def check(self, rule: Any, path: tuple[str, ...]) -> None:
        """Called with a threaded rule, or a traced custom_vjp bwd, before it
        runs: raise for tags left in it that the layer owns but could not
        thread."""


class Hooks:
    """How an effect layer reports channel misuse (harvest overrides these
    to give oryx's messages) and treats derivative rules (``rules``)."""

    rules = RulePolicy()

    def loop_channel(self, key: Any, loop: str, path: tuple[str, ...]) -> Exception:
        return NotImplementedError(
            f"taxpr: values collected or fed per iteration ({key!r}) are not supported "
            f"inside {loop} at {format_path(path)}")

    def describe_ctx(self, index: int) -> str:
        """How an error names ctx leaf ``index``."""
        return f"the context's entry {index}"

    def differentiated_write(self, index: int, path: tuple[str, ...]) -> Exception:
        """A ctx leaf that a custom_vjp call writes from its differentiated
        inputs, whose cotangent the user's bwd cannot give (the fwd ran in
        the function's place, the function may not be reversible)."""
        name = self.describe_ctx(index)
        return NotImplementedError(
            f"taxpr: {name} is written by the custom_vjp call at {format_path(path)} from "
            f"inputs JAX differentiates, and its derivative is needed: the call's bwd gives "
            f"no derivative for it")

    def differentiated_into_loop(self, what: str, path: tuple[str, ...]) -> Exception:
        """A ctx leaf or fed value (``what``, as ``describe_ctx`` or
        ``site_name`` name it) that JAX differentiates and that reaches a
        while loop inside a custom_vjp function: its cotangent would need
        the loop reversed, which JAX cannot do, and the user's bwd does not
        give it (it knows only the function's own inputs)."""
        return NotImplementedError(
            f"taxpr: {what} is differentiated, and it reaches a "
            f"while loop inside the custom_vjp function at {format_path(path)}: the call's "
            f"bwd gives derivatives of the function's own inputs only (a library's "
            f"checkpointed loop or adjoint), and JAX cannot reverse a while loop. Pass the "
            f"value in as an argument of the function instead")

    def varying_ctx(self, index: int, params: dict, path: tuple[str, ...],
                    axes: Sequence[str]) -> Exception:
        """The error for a site (its user ``params``, at ``path``) inside a
        shard_map whose rewrite makes ctx leaf ``index`` differ across the
        shards (it varies over mesh ``axes``): ctx enters a shard_map
        replicated."""
        return InjectError(
            f"taxpr.inject: the injector for {describe_site(params, path)} makes ctx leaf "
            f"{index} differ across the shards of a shard_map (it varies over mesh axes "
            f"{sorted(axes)}); ctx enters shard_map replicated and must stay the same on "
            f"every shard")

    def replay_read(self, index: int, path: tuple[str, ...]) -> Exception:
        """The error for a custom_vjp bwd whose cotangents depend on ctx
        leaf ``index``, which the forward pass changes."""
        return NotImplementedError(
            f"taxpr: the custom_vjp bwd at {format_path(path)} recomputes the forward pass "
            f"with {self.describe_ctx(index)}, which the forward pass changes: what it reads "
            f"there depends on the order in which the bwd recomputes (a checkpointed loop "
            f"restarts from saved steps), which taxpr cannot see")

    def replay_write(self, index: int, path: tuple[str, ...]) -> Exception:
        """The error for a custom_vjp bwd (run as a replay of its forward
        pass) that writes ctx leaf ``index``, which the forward does not."""
        return NotImplementedError(
            f"taxpr: the custom_vjp bwd at {format_path(path)} changes "
            f"{self.describe_ctx(index)}, which the function's forward pass does not: a "
            f"backward pass replays the forward pass (it sees what the forward saw and its "
            f"effects are not repeated), so an effect of its own has no place in the "
            f"program's order")

    def branches(self, collects: list[tuple], path: tuple[str, ...]) -> None:
        if len(set(collects)) > 1:
            raise ValueError(f"taxpr: cond branches at {format_path(path)} collect "
                             f"different values: {collects}")


class ThreadRule(Protocol):
    """How to thread a context through one higher-order primitive.

    The engine calls the rule for an equation of the primitive only when one
    of its sub-jaxprs contains a selected tag; other equations are kept as
    they are.
    """

    def __call__(self, engine: "Engine", eqn: core.JaxprEqn, level: Level,
                 ctx: list, subs: list) -> list:
        """Emit the rewritten ``eqn`` into ``level``; return the ctx after it.

        Arguments:
            engine: the ``Engine``. ``engine.thread_jaxpr(sub, path, in_pos,
                out_pos, level.context)`` gives a sub-jaxpr that takes the ctx
                leaves as inputs at ``in_pos`` and returns them at
                ``out_pos`` (a closed jaxpr; consts the engine added are
                attached); ``engine.thread_read_only(sub, path, in_pos,
                level.context)`` one that takes the ctx leaves but returns only
                its own outputs (for primitives whose outputs are fixed).
                ``engine.fresh_ctx()`` gives new variables for the
                ctx after the equation; ``engine.ctx_avals`` their types;
                ``engine.pass_channels(level, threaded)`` connects values
                that the threaded sub-jaxpr collects or is fed (harvest's
                reap/plant) and returns the equation's extra (inputs,
                outputs); ``engine.has_selected(sub)`` says whether a
                sub-jaxpr contains a selected tag.
            eqn: the equation, as in the jaxpr being rewritten. Its inputs
                are variables of the enclosing jaxpr (``level`` substitutes
                renamed ones when the equation is emitted).
            level: the jaxpr under construction: ``level.emit(eqn)`` appends
                an equation, ``level.emit_rebuilt(eqn, new_subs, invars,
                outvars, **params)`` one with new sub-jaxprs, ``level.path`` is the path of enclosing
                primitives (for sub-jaxpr paths and error messages),
                ``level.context`` the tracing context to pass on.
            ctx: the ctx leaves (atoms of the enclosing jaxpr) before ``eqn``.
            subs: ``[(Sub(key, index, label), jaxpr), ...]``, the sub-jaxprs
                of ``eqn`` as ``taxpr._traverse.subjaxprs`` finds them
                (``label`` is the path element naming the sub-jaxpr).

        Returns:
            The ctx leaves after ``eqn`` (one atom per leaf of ``ctx``).
        """
        ...


# Keyed by the Primitive object: names are not unique (two libraries may
# define a "call"), objects are.
THREAD_RULES: dict[core.Primitive, ThreadRule] = {}


def register_thread_rule(primitive: core.Primitive, rule: ThreadRule) -> ThreadRule:
    """Teach taxpr to thread state, reaps/plants and ``inject``'s ctx
    through a higher-order primitive.

    Arguments:
        primitive: the ``jax.extend.core.Primitive`` (the object an
            equation's ``eqn.primitive`` is, not its name).
        rule: a ``ThreadRule``: ``rule(engine, eqn, level, ctx, subs) ->
            ctx_out`` emits the rewritten equation and returns the ctx after
            it. A rule registered again for the same primitive replaces the
            previous one.

    Returns:
        ``rule`` itself.

    Raises:
        TypeError: ``primitive`` is not a JAX ``Primitive`` or ``rule`` is not
            callable.
    """
    if not isinstance(primitive, core.Primitive):
        raise TypeError(f"taxpr.register_thread_rule: expected a jax Primitive, got "
                        f"{type(primitive).__name__}: {primitive!r}")
    if not callable(rule):
        raise TypeError(f"taxpr.register_thread_rule: the rule for '{primitive.name}' "
                        f"must be callable, got {type(rule).__name__}")
    THREAD_RULES[primitive] = rule
    return rule


def aval_of(atom) -> Any:
    return atom.aval


def zeros_of_aval(aval) -> Any:
    if aval.dtype == jax.dtypes.float0:
        return np.zeros(aval.shape, aval.dtype)
    return jax.numpy.zeros(aval.shape, aval.dtype)


# ---- rules -----------------------------------------------------------------------

def sub_label(subs, key, index=None) -> str:
    for sub, _ in subs:
        if sub.key == key and sub.index == index:
            return sub.label
    raise KeyError(key)


def emit_rebuilt_eqn(level: Level, eqn, new_subs: dict, invars, outvars, **params) -> None:
    new = _traverse.with_subjaxprs(eqn, new_subs, **params)
    level.emit(new.replace(invars=list(invars), outvars=list(outvars)))


def in_custom_vjp(path: tuple[str, ...]) -> bool:
    """Whether ``path`` runs through a custom_vjp function (its body or rules)."""
    return any(p.startswith("custom_vjp") for p in path)


def site_name(key: ChannelKey) -> str:
    """A channel's site for an error: a layer's site records a ``kind`` and
    a ``name`` (harvest: "reap 'a'")."""
    kind, name = getattr(key.site, "kind", None), getattr(key.site, "name", None)
    return repr(key.site) if kind is None or name is None else f"{kind} {name!r}"


def is_inexact(aval) -> bool:
    return jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact)

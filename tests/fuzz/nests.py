"""Fixed programs that the deterministic tests run: every typed state's
dtype through every primitive's carries (``TYPED_NESTS``), programs inside
library operations (``LIBRARY_NESTS``), custom functions with state in
their body differentiated inside the uncurried function
(``GRAD_INSIDE_NESTS``), custom functions whose rules touch states and
keys themselves (``RULE_NESTS``), custom_jvp functions whose rules sow
(``RULE_SOW_NESTS``), custom_vjp functions whose fwds sow
(``FWD_SOW_NESTS``), and pytree-valued states in ``tx.scope`` blocks and in
functions called in two scopes through every primitive (``SCOPE_NESTS``).
"""

from __future__ import annotations

from .model import (OTHER, SVARS, TYPED_DTYPES, TYPED_OPS, AddC, Assign, Bin, Bump, Ckpt, Cond,
                    CustomJvp, CustomVjp, Draw, EqxLoop, Fori, FPred, Get, IPred, Jit, Mean, MulC,
                    Program, Root, Scan, Scope, Set, SIdx, Sow, Switch, Tree, Un, Var, While,
                    typed_adds, typed_inits, typed_kind, typed_shape)


def _all_typed_bumps(uid: int) -> tuple:
    """One Bump per dtype (uids from ``uid``), every update and init form."""
    out = []
    for i, d in enumerate(TYPED_DTYPES):
        values = typed_inits(d)
        init = (tuple(values[(i + j) % len(values)] for j in range(3)) if typed_shape(d)
                else values[i % len(values)])
        ops = TYPED_OPS[typed_kind(d)]
        op = ops[i % len(ops)]
        arg = (IPred("n", 1, 2) if op == "xor" else typed_adds(d)[i % 3] if op == "add"
               else None)
        target = ("v" if typed_shape(d) else SVARS[i % 3]) if i % 2 else None
        out.append(Bump(uid + i, f"y_{d}", init, ("scalar", "array", "callable")[i % 3], op,
                        arg, target))
    # bool's other update: xor with a predicate of the program
    out.append(Bump(uid + len(out), "y_bool", (False, True, False), "array", "xor",
                    IPred("n", 1, 2), "v"))
    return tuple(out)


# Every dtype's state in the carries of scan, cond, switch, jit (called twice)
# and checkpoint; of while, fori and custom_jvp, then of custom_vjp.
TYPED_NESTS = {
    "scan_cond_switch_jit_ckpt": Program((Scan(
        1, (Cond(2, IPred("i1", 0, 2), ((Switch(3, SIdx("n", 0, 2), (
            (Jit(4, (Ckpt(5, _all_typed_bumps(100)),), calls=2),), ())),), ())),
            Assign("f0", Un("sin", Var("x1")))),
        2, False, (0.5, -1.0), Var("f1"), "f0", "f2"),)),
    "while_fori_cjvp_cvjp": Program((While(
        1, (Fori(2, (CustomJvp(3, _all_typed_bumps(100)),), "n", 0, 2),), "carry", 2),
        CustomVjp(4, _all_typed_bumps(200), calls=2))),
    "root_eqxloop": Program((Root(1, _all_typed_bumps(100)),
                             EqxLoop(2, _all_typed_bumps(200), calls=2))),
}


# Programs inside library operations: custom_root (a high-level primitive on
# newer JAX) and equinox's checkpointed while loop, each with state reads and
# writes, sows and key draws, called once and twice.
LIBRARY_NESTS = {
    "root": Program((
        Get("f0", "s0", 0.5),
        Root(1, (Get("f1", "s1", -1.0), Set("s0", Bin("avg", Var("f0"), Var("f1"))),
                 Sow(2, "f2", Var("f0"), "t0", "strict"),
                 Sow(3, None, Var("f1"), "c0", "clobber"), Draw("f1"))),
        Root(4, (Set("s1", Un("sin", Var("f2"))), Sow(5, None, Var("f2"), "c1", "clobber")),
             calls=2),
        Set("s1", Var("f2")))),
    "eqxloop": Program((
        EqxLoop(1, (Get("f0", "s0", 0.25), Set("s0", AddC(Var("f0"), 1.0)),
                    Sow(2, "f1", Var("f0"), "c0", "clobber"), Draw("f2")), calls=2),
        Set("s1", Var("f1")))),
    "nested": Program((
        EqxLoop(1, (Root(2, (Get("f0", "s0", 1.5), Set("s0", Un("sin", Var("f0"))),
                             Sow(3, None, Var("f0"), "c0", "clobber"))),)),)),
}


# Custom functions whose body uses state, keys and sows (their rules call the
# function: a custom_vjp's bwd recomputes it, as equinox's checkpointed loop
# does), differentiated inside the uncurried function.
GRAD_INSIDE_NESTS = {
    "cvjp_counts_and_reads_a_constant_state": Program((
        Set("s1", Var("f1")),
        CustomVjp(1, (Get("f0", "s0", 0.5), Set("s0", AddC(Var("f0"), 1.0)),
                      Get("f2", "s1", 0.0), Assign("f1", Bin("mul", Var("f1"), Var("f2"))),
                      Sow(2, None, Var("f1"), "c0", "clobber"), Draw("f3")), calls=2),
        Assign("f0", Bin("avg", Var("f0"), Var("f1"))))),
    "cvjp_reads_a_state_it_updates": Program((
        CustomVjp(1, (Get("f0", "s0", 0.5), Set("s0", Un("sin", Var("f0"))),
                      Assign("f1", Bin("mul", Var("f1"), Var("f0")))),),)),
    "cjvp_in_a_scan": Program((Scan(
        1, (CustomJvp(2, (Get("f0", "s0", 0.25), Set("s0", AddC(Var("f0"), 1.0)),
                          Assign("f1", Un("sin", Var("f1"))))),),
        3, False, (0.5, -1.0, 2.0), Var("f2"), "f0", "f2"),)),
    "eqxloop_in_a_jit": Program((Jit(1, (
        EqxLoop(2, (Get("f0", "s0", 0.75), Set("s0", AddC(Var("f0"), 1.0)),
                    Assign("f1", MulC(Var("f1"), 0.5)),
                    Sow(3, None, Var("f1"), "c1", "clobber"))),), calls=2),)),
}


# Custom functions whose rules touch states and keys themselves (``rule``
# statements run before the rule calls the function): a counter bumped and a
# key drawn by a custom_jvp rule (called twice), rules of custom_jvp functions
# nested in a custom_jvp in a scan, a custom_vjp fwd counting and drawing.
RULE_NESTS = {
    "cjvp_rule_counts_and_draws": Program((
        Bump(1, "y_int8", 5, "scalar", "add", 1), Draw("f1"),
        CustomJvp(2, (Assign("f1", Un("sin", Var("f1"))),),
                  calls=2, rule=(Bump(3, "y_int8", 0, "array", "add", 127), Draw("_"))),
        Draw("f2"))),
    "nested_cjvp_rules_in_a_scan": Program((
        Bump(1, "y_uint8", 5, "scalar", "add", 1), Draw("f1"),
        Scan(2, (CustomJvp(3, (
            Assign("f1", Un("sin", Var("f1"))),
            CustomJvp(4, (Assign("f2", Un("tanh", Var("f1"))), Draw("f0")),
                      rule=(Draw("_"),)),
            Bump(5, "y_uint8", 0, "callable", "add", 128, "f2")),
            calls=2, rule=(Bump(6, "y_uint8", 0, "array", "add", 255), Draw("_"))),),
            2, False, (0.5, -1.0), Var("f2"), "f0", "f2"),
        Draw("f0"))),
    "cvjp_fwd_counts_and_draws": Program((
        Bump(1, "y_int32", 5, "scalar", "add", 1), Draw("f1"),
        CustomVjp(2, (Get("f2", "s0", 0.5), Assign("f1", Bin("mul", Var("f1"), Var("f2"))),
                      Set("s0", Var("f1"))),
                  rule=(Bump(3, "y_int32", 0, "array", "add", 7), Draw("_"))),
        Draw("f2"))),
}


# custom_jvp functions whose rules sow (``rule`` sows, of names sown nowhere
# outside rules; see ``Gen.rule_sow``): a rule sowing every kind (clobber of
# a scalar and of a vector, sow_cond on ``n``) and calling the function,
# which uses state, twice; a rule sowing (its result unused: the program
# has no state) and calling a function that sows itself (clobber, append,
# a strict sow after); rules of custom_jvp functions nested in a custom_jvp
# in a scan (``RULE_SOW_PLANTS``: what the deterministic test plants); a
# rule's sow in one branch of a cond.
RULE_SOW_NESTS = {
    "cjvp_rule_sows_every_kind_called_twice": Program((
        Bump(1, "y_int8", 5, "scalar", "add", 1),
        CustomJvp(2, (Assign("f1", Bin("avg", Var("f1"), Un("sin", Var("f0")))),
                      Set("s1", Var("f1"))),
                  calls=2, rule=(Sow(3, "r3", Bin("avg", Var("f0"), Var("f1")), "c0", "clobber"),
                                 Sow(4, "r4", MulC(Var("v"), -0.5), "cv", "clobber"),
                                 Sow(5, "r5", Var("f1"), "q0", "cond_clobber",
                                     pred=IPred("n", 1, 2)))),
        Get("f2", "s1", 0.0))),
    "rule_sows_and_calls_a_sowing_function": Program((
        CustomJvp(1, (Sow(2, "f1", Un("sin", Var("f1")), "c1", "clobber"),
                      Sow(3, None, Var("v"), "av", "append"),
                      Assign("f0", Bin("mul", Var("f0"), Var("f1")))),
                  rule=(Sow(4, None, Mean(Var("v")), "c0", "clobber"),
                        Sow(5, "r5", Var("f0"), "o", "clobber", OTHER))),
        Sow(6, None, Var("f1"), "t0", "strict"))),
    "planted_rule_sows_nested_in_a_scan": Program((
        Get("f2", "s0", 0.25),
        Scan(1, (CustomJvp(2, (Assign("f1", Un("tanh", Var("f1"))),
                               CustomJvp(3, (Assign("f0", MulC(Var("f0"), 0.5)),),
                                         rule=(Sow(4, "r4", Var("f0"), "c1", "clobber"),))),
                           rule=(Sow(5, "r5", AddC(Var("f1"), 0.5), "c0", "clobber"),)),),
             2, False, (0.5, -1.0), Var("f2"), "f0", "f2"),
        Set("s0", Var("f2")))),
    "rule_sow_in_a_cond_branch": Program((
        Cond(1, FPred(Var("f1"), 0.1), (
            (CustomJvp(2, (Assign("f1", Un("sin", Var("f1"))),),
                       rule=(Sow(3, None, Var("f1"), "c0", "clobber"),)),),
            (Assign("f0", MulC(Var("f0"), 0.5)),))),)),
}
RULE_SOW_PLANTS = {"c0": 1.25, "c1": -0.75, "cv": (0.5, -1.5, 2.0), "q0": -0.25}


# custom_vjp functions whose fwds sow (``CustomVjp.rule`` sows, of names sown
# nowhere outside rules; planted with ``RULE_SOW_PLANTS``): a fwd sowing
# every kind (its clobber's result a residual the bwd scales by) of a
# function called twice, which sows itself (clobber, append, a strict sow
# after); a fwd sowing (its result unused) of a function that sets a state,
# in a program that sets another, in a scan beside a custom_jvp whose rule
# sows; a fwd's sow in one branch of a cond.
FWD_SOW_NESTS = {
    "cvjp_fwd_sows_every_kind_called_twice": Program((
        CustomVjp(1, (Sow(2, "f1", Un("sin", Var("f1")), "c1", "clobber"),
                      Sow(3, None, Var("v"), "av", "append"),
                      Assign("f0", Bin("mul", Var("f0"), Var("f1")))),
                  calls=2, rule=(Sow(4, "r4", Bin("avg", Var("f0"), Var("f1")), "c0", "clobber"),
                                 Sow(5, None, MulC(Var("v"), -0.5), "cv", "clobber"),
                                 Sow(6, None, Var("f1"), "q0", "cond_clobber",
                                     pred=IPred("n", 1, 2)),
                                 Sow(7, "r7", Var("f0"), "o", "clobber", OTHER))),
        Sow(8, None, Var("f1"), "t0", "strict"))),
    "fwd_sows_of_a_stateful_function_in_a_scan": Program((
        Set("s0", AddC(Var("f0"), 1.0)),
        Scan(1, (CustomVjp(2, (Assign("f1", Un("tanh", Var("f1"))), Set("s1", Var("f1"))),
                           rule=(Sow(3, None, AddC(Var("f1"), 0.5), "c0", "clobber"),)),
                 CustomJvp(4, (Assign("f0", MulC(Var("f0"), 0.5)),),
                           rule=(Sow(5, "r5", Var("f0"), "c1", "clobber"),))),
             2, False, (0.5, -1.0), Var("f2"), "f0", "f2"),)),
    "fwd_sow_in_a_cond_branch": Program((
        Cond(1, FPred(Var("f1"), 0.1), (
            (CustomVjp(2, (Assign("f1", Un("sin", Var("f1"))),),
                       rule=(Sow(3, "r3", Var("f1"), "c0", "clobber"),)),),
            (Assign("f0", MulC(Var("f0"), 0.5)),))),)),
}


# Custom functions whose rules (or fwds) sow names the function sows too,
# before and after their call of it (``after``): eagerly the last one
# reaped is the rule's own after sow (it clobbers the function's), the
# function's where the rule sows only before. A custom_jvp called twice
# whose function uses state, its rule bumping a typed state and sowing
# (clobber, sow_cond) around the call; a custom_vjp whose fwd sows after a
# function that sows and sets a state, in a scan; a custom_jvp in a scan
# whose rule sows only before.
AROUND_NESTS = {
    "cjvp_rule_sows_before_and_after_its_function_called_twice": Program((
        Bump(1, "y_int8", 5, "scalar", "add", 1),
        CustomJvp(2, (Sow(3, "f1", Un("sin", Var("f1")), "c0", "clobber"),
                      Sow(4, None, Var("f0"), "q0", "cond_clobber", pred=IPred("n", 1, 2)),
                      Set("s1", Var("f1"))),
                  calls=2, after=2,
                  rule=(Bump(5, "y_int8", 3, "scalar", "add", 2),
                        Sow(6, "r6", Var("f0"), "c0", "clobber"),
                        Sow(7, "r7", Bin("avg", Var("f0"), Var("f1")), "c0", "clobber"),
                        Sow(8, None, AddC(Var("f1"), 0.5), "q0", "cond_clobber",
                            pred=IPred("n", 1, 2)))),
        Get("f2", "s1", 0.0))),
    "cvjp_fwd_sows_after_a_stateful_sowing_function_in_a_scan": Program((
        Set("s0", AddC(Var("f0"), 1.0)),
        Scan(1, (CustomVjp(2, (Assign("f1", Un("tanh", Var("f1"))),
                               Sow(3, "f1", MulC(Var("f1"), 0.5), "c1", "clobber"),
                               Set("s1", Var("f1"))),
                           after=1, rule=(Sow(4, "r4", AddC(Var("f0"), 0.5), "c1", "clobber"),)),),
             2, False, (0.5, -1.0), Var("f2"), "f0", "f2"),)),
    "cjvp_rule_sows_only_before_its_function_in_a_scan": Program((
        Get("f2", "s0", 0.25),
        Scan(1, (CustomJvp(2, (Sow(3, "f1", Un("sin", Var("f1")), "c1", "clobber"),),
                           rule=(Sow(4, "r4", Var("f0"), "c1", "clobber"),)),),
             2, False, (0.5, -1.0), Var("f2"), "f0", "f2"),
        Set("s0", Var("f2")))),
}


def _trees(uid: int) -> tuple:
    """Both pytree states (uids from ``uid``) read and updated, their leaves
    mixed into the env, beside a float state and a key draw: in a ``Scope``
    all but the key stream are renamed."""
    return (Tree(uid, "pt", "update", (0.5, (1.0, -1.0, 0.25)), (Un("sin", Var("f0")), Var("v")),
                 targets=("f1", None)),
            Tree(uid + 1, "pd", "update", (127, (0.5, -0.5, 1.0)), (MulC(Var("v"), 0.9),), 64,
                 ("f2", "v")),
            Set("s0", Bin("avg", Var("f0"), Var("f1"))), Draw("f2"))


def _fresh_trees(uid: int) -> tuple:
    """Both pytree states set before they are read (first set: zeros)."""
    return (Tree(uid, "pd", "set", es=(Var("v"),), arg="n"),
            Tree(uid + 1, "pt", "set", es=(Mean(Var("v")), MulC(Var("v"), -0.5))),
            Tree(uid + 2, "pt", "get", (1.5, (0.0, 1.0, -2.0)), targets=("f0", "v")))


# Pytree-valued states and tx.scope through every primitive's carries: the
# same states in scopes (nested ones, in loop bodies and branches) and
# outside them, functions called in two scopes (one jitted function traced
# for each), in the same scope twice and in none.
SCOPE_NESTS = {
    "scan_cond_switch_jit_ckpt": Program((
        *_trees(100),
        Scan(1, (Scope(2, "sa", (Cond(3, IPred("i1", 0, 2), ((Switch(4, SIdx("n", 0, 2), (
            (Jit(5, (Ckpt(6, _trees(200), calls=2, scopes=("sb", None)),), calls=2,
                 scopes=("sa", "sb")),),
            (Scope(7, "sb", _fresh_trees(300)),))),), (Scope(8, "sa", _trees(400)),))),)),
            Assign("f0", Un("sin", Var("x1")))),
            2, False, (0.5, -1.0), Var("f1"), "f0", "f2"),
        Jit(9, _fresh_trees(500), calls=2, scopes=("sa", "sa")))),
    "while_fori_custom_root_eqxloop": Program((
        Scope(1, "sb", (While(2, (Fori(3, (CustomJvp(4, _trees(100), calls=2,
                                                     scopes=("sa", "sb")),), "n", 0, 2),),
                              "state", 2, spred=("s1", 1.5, -0.37)),)),
        CustomVjp(5, _fresh_trees(200), calls=2, scopes=(None, "sa")),
        Root(6, _trees(300), scopes=("sa",)),
        Scope(7, "sb", (EqxLoop(8, _fresh_trees(400), calls=2, scopes=("sa", None)),)),
        Scope(9, "sa", (Scope(10, "sa", _trees(500)),)))),
}

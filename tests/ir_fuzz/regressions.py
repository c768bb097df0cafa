"""Generated programs kept as regression cases, by what they hold (the value
is the program's seed: ``generator.program(seed)``)."""

# ``rem(1, i0 - i0)``: an integer division by a zero XLA can prove.
PROVABLE_ZERO_DIVISOR = 5033
# A bfloat16 chain after a cond whose index constant folding decides.
BF16_CHAIN_AFTER_FOLDED_COND = 576
# An unused cond / scan / while whose body holds only (effect-free) tags,
# which JAX's own DCE rules would drop.
UNUSED_CALLS_OF_TAG_ONLY_JAXPRS = {"unused_call_of_tags_a": 324, "unused_call_of_tags_b": 493,
                                   "unused_call_of_tags_c": 617, "unused_call_of_tags_d": 663}
# A while holding only tags inside a jit that was jitted before (JAX 0.10
# caches the DCE of a jit's callee).
WHILE_OF_TAGS_IN_A_JIT_CALLED_TWICE = {"while_of_tags_in_jit_called_twice_a": 12590,
                                       "while_of_tags_in_jit_called_twice_b": 13349}
# A scan whose inputs are all constants constant_fold folds.
SCAN_OF_FOLDED_CONSTANTS = 4777
# Constants XLA's compile-time folding computes differently from eager
# evaluation (program, the output that differs, the backends where it does:
# XLA's GPU backend folds tanh(1.5) as eager computes it).
XLA_FOLDING_DEPARTS_FROM_EAGER = {
    "negative_zero_minus_negative_zero": (835, 3, frozenset({"cpu", "gpu"})),
    "tanh_of_a_constant": (856, 0, frozenset({"cpu"}))}
# ``exp`` of a fused NaN constant, which JAX 0.10.2's XLA CPU backend
# computes as garbage (program, the output).
NAN_EXP_PROGRAMS = {"exp_of_nan_constant_a": (10015, 1), "exp_of_nan_constant_b": (10272, 3)}

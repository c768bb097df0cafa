"""taxpr.ir Python code generation: the generated code runs and computes
what the original program computes eagerly, bit for bit, for every
primitive family; names never clash; literals keep their exact type."""

from __future__ import annotations

import ast
import builtins
import keyword
import sys
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src import core
from jax.experimental import io_callback

import taxpr as tx
from taxpr import _jaxpr, ir

from helpers import cpu_devices
from ir_helpers import assert_bitwise

CALLS: Counter = Counter()


def _flat(x):
    return [np.asarray(v) for v in jax.tree_util.tree_leaves(x)]


def _generated(f, *args):
    code = ir.fn_to_python_code(f, *args)
    compile(str(code), "<generated>", "exec")  # valid Python
    return code, code.load()


def assert_reproduces(f, *args, jit: bool = False):
    """The generated code of ``f`` computes ``f``'s eager outputs, bitwise
    (run eagerly too, so that both group operations into the same compiled
    computations, on every backend); returns the code."""
    want = _flat(f(*jax.tree_util.tree_map(jnp.asarray, args)))  # eager, JAX semantics
    code, g = _generated(f, *args)
    flat_args = jax.tree_util.tree_leaves(args)
    got = _flat((jax.jit(g) if jit else g)(*flat_args))
    assert_bitwise(got, want, str(code))
    return code


def test_cond_and_switch_become_lax_switch():
    def f(x, i):
        a = lax.switch(i, [jnp.sin, jnp.cos, lambda v: -v], x)
        b = lax.cond(x[0] > 0, lambda v: v * 2.0, lambda v: v - 1.0, x)
        return a, b

    for i in (np.int32(0), np.int32(2), np.int32(7)):
        code = assert_reproduces(f, np.array([0.5, -1.0], np.float32), i)
    assert "lax.switch(" in code


def test_while_loop_becomes_lax_while_loop():
    def f(x, n):
        def body(c):
            i, v = c
            return i + 1, v * 1.5 - 0.25
        return lax.while_loop(lambda c: c[0] < n, body, (0, x))

    code = assert_reproduces(f, np.float32(0.75), np.int32(5))
    assert "lax.while_loop(" in code


def test_while_loop_whose_predicate_vmap_batched_loops_per_example():
    # vmap keeps a per-example predicate in while_p (its cond returns
    # bool[3]), which lax.while_loop refuses ("cond_fun must return a boolean
    # scalar"): the code loops while any example's holds, and an example
    # whose predicate is false keeps its carry (as in the batched programs of
    # the ir fuzzer, tests/ir_fuzz/).
    def f(x, n):
        def body(c):
            i, v = c
            jax.debug.callback(lambda: CALLS.update(["body"]))
            return i + 1, v * 1.5 - 0.25
        return lax.while_loop(lambda c: c[0] < n, body, (0, x))

    batched = jax.vmap(f)
    xs, ns = np.array([0.75, -2.0, 3.0], np.float32), np.array([0, 4, 2], np.int32)
    cond_jaxpr = jax.make_jaxpr(batched)(xs, ns).eqns[-1].params["cond_jaxpr"]
    assert cond_jaxpr.out_avals[0].shape == (3,)
    CALLS.clear()
    code = assert_reproduces(batched, xs, ns)
    jax.effects_barrier()
    assert "_batched_while_loop_" in str(code)
    assert CALLS["body"] == 2 * 4  # the loop runs 4 times, eager and generated
    code.load()(xs, np.array([0, 0, 0], np.int32))  # no example loops: no iteration
    jax.effects_barrier()
    assert CALLS["body"] == 2 * 4


def test_scan_with_consts_carry_xs_and_ys_becomes_lax_scan():
    k = np.array([1.0, 2.0, 3.0], np.float32)

    def f(x, xs):
        def body(c, x_t):
            return c * x_t + k, (c.sum(), x_t * 2.0)
        return lax.scan(body, x, xs, reverse=True)

    code = assert_reproduces(f, np.ones(3, np.float32), np.linspace(-1, 1, 4, dtype=np.float32))
    assert "lax.scan(" in code and "reverse=True" in code


def _io_identity(x):
    CALLS["io"] += 1
    return x


def test_jitted_function_called_twice_with_callback_calls_twice():
    @jax.jit
    def g(x):
        return jnp.sin(io_callback(_io_identity, jax.ShapeDtypeStruct(x.shape, x.dtype), x))

    def f(x):
        return g(x) + g(x)

    CALLS.clear()
    want = _flat(f(np.float32(0.5)))
    jax.effects_barrier()
    assert CALLS["io"] == 2
    code, fn = _generated(f, np.float32(0.5))
    CALLS.clear()
    got = _flat(fn(np.float32(0.5)))
    jax.effects_barrier()
    assert_bitwise(got, want)
    assert CALLS["io"] == 2
    assert code.count("def _g_") == 1 and code.count("jax.jit(_g_") == 2
    # The module-level callback is imported by its module path.
    assert not code.objects and f"import {__name__} as _M_" in code
    assert "jax.experimental.io_callback(_M_" in code


def test_checkpoint_becomes_jax_checkpoint_and_keeps_gradients():
    def f(x):
        return jax.checkpoint(lambda v: jnp.sin(v) * v)(x)

    code = assert_reproduces(f, np.float32(1.25))
    assert "jax.checkpoint(" in code
    g = code.load()
    assert_bitwise(_flat(jax.grad(g)(np.float32(1.25))), _flat(jax.grad(f)(np.float32(1.25))))


def test_custom_jvp_and_custom_vjp_become_their_primal_computation():
    @jax.custom_jvp
    def cj(x):
        return jnp.exp(x) - 1.0

    cj.defjvp(lambda p, t: (cj(p[0]), t[0] * 100.0))

    @jax.custom_vjp
    def cv(x):
        return jnp.log1p(x * x)

    cv.defvjp(lambda x: (cv(x), x), lambda r, g: (g * 100.0,))

    def f(x):
        return cj(x) * cv(x)

    code = assert_reproduces(f, np.float32(0.3))
    assert "custom_jvp_call" not in code and "custom_vjp_call" not in code
    assert "_custom_jvp_primal_" in code and "_custom_vjp_primal_" in code


def test_gather_and_scatter_with_dimension_numbers():
    def f(x, idx, upd):
        a = x[idx]
        b = x.at[idx].add(upd)
        c = x.at[idx].set(upd, mode="drop")
        d = x.at[idx].mul(upd)
        return a, b, c, d

    x = np.arange(6, dtype=np.float32) - 2.5
    code = assert_reproduces(f, x, np.array([4, 0, 9, -1], np.int32),
                             np.array([1.5, -2.0, 3.0, 0.5], np.float32))
    assert "lax.GatherDimensionNumbers(" in code and "lax.ScatterDimensionNumbers(" in code
    assert "lax.GatherScatterMode." in code


def test_sort_with_several_operands_and_keys():
    def f(k, v):
        return lax.sort((k, v), num_keys=1), jnp.argsort(v), jnp.sort(-k)

    code = assert_reproduces(f, np.array([3, 1, 2, 1], np.int32),
                             np.array([0.5, -0.0, 0.0, np.nan], np.float32))
    assert "lax.sort((" in code and "_p.bind(" not in code


def test_debug_print_and_debug_callback_run_once_each(capsys):
    seen = []

    def f(x):
        jax.debug.print("x is {}", x)
        jax.debug.callback(lambda v: seen.append(float(v)), x)
        return x + 1.0

    code, fn = _generated(f, np.float32(2.0))
    out = fn(np.float32(2.0))
    jax.effects_barrier()
    assert float(out) == 3.0 and seen == [2.0]
    assert capsys.readouterr().out.count("x is 2.0") == 1
    assert "jax.debug.print('x is {}', a)" in code
    # A lambda has no source form: it is read from OBJECTS, named at the top.
    assert "jax.debug.callback(OBJECTS['debug_callback_0'], a)" in code
    assert list(code.objects) == ["debug_callback_0"] and "_p.bind(" not in code
    assert "#   'debug_callback_0': function test_ir_codegen." in code


def test_tags_become_taxpr_tag_with_their_params():
    def f(x):
        y = tx.tag({"a": x, "b": x * 2.0}, op="hello", layer=3)
        return y["a"] + tx.tag(y["b"], op="single")

    code, g = _generated(f, np.float32(1.5))
    assert "taxpr.tag({'a': " in code and "op='hello', layer=3" in code
    tags = [(s.params, str(s.path)) for s in tx.find_tags(jax.make_jaxpr(f)(np.float32(1.5)))]
    regen = [(s.params, str(s.path)) for s in tx.find_tags(jax.make_jaxpr(g)(np.float32(1.5)))]
    assert regen == tags and len(tags) == 2
    assert_bitwise(_flat(g(np.float32(1.5))), _flat(f(np.float32(1.5))))


def test_integer_div_and_rem_stay_integer_operations():
    def f(a, b, c):
        return (lax.div(a, b), lax.rem(a, b), lax.div(a, np.int32(-2)), a // 3,
                lax.div(c, np.uint8(7)), lax.rem(c, np.uint8(200)))

    a = np.array([-7, 7, -2**31, 5], np.int32)
    b = np.array([2, -2, -3, 1], np.int32)
    c = np.array([255, 3, 0, 200], np.uint8)
    code = assert_reproduces(f, a, b, c)
    assert "lax.div(" in code and "lax.rem(" in code and " / " not in code
    assert "np.int32(-2)" in code and "np.uint8(7)" in code
    got = _flat(code.load()(a, b, c))
    assert got[0].tolist() == [int(x / y) for x, y in zip(a.tolist(), b.tolist())]


def test_literals_keep_dtype_weak_type_and_bits():
    def f(x, h):
        return (x + 2, x * -0.0, x + jnp.float32(np.inf), jnp.where(x > 0, x, np.nan),
                h * jnp.bfloat16(2.5), h + 1, jnp.int8(-128) + jnp.int8(1), x * 1e-45)

    x, h = np.array([1.0, -0.0, -3.0], np.float32), np.array([0.5, -2.0], jnp.bfloat16)
    code = assert_reproduces(f, x, h)
    assert "jnp.bfloat16(2.5)" in code
    j = jax.make_jaxpr(f)(x, h)
    regen = jax.make_jaxpr(code.load())(x, h)
    assert [v.aval for v in regen.jaxpr.outvars if hasattr(v, "aval")] == \
        [v.aval for v in j.jaxpr.outvars if hasattr(v, "aval")] \
        if hasattr(j, "jaxpr") else True
    assert [str(v.aval) for v in _jaxpr.jaxpr_parts(regen).outvars] == \
        [str(v.aval) for v in _jaxpr.jaxpr_parts(j).outvars]


def test_weakly_typed_inputs_stay_weak():
    j = jax.make_jaxpr(lambda x, y: (x * 2, y + 1.0))(1, 2.0)
    code = ir.jaxpr_to_python_code(j)
    regen = jax.make_jaxpr(code.load())(1, 2.0)
    assert [v.aval for v in _jaxpr.jaxpr_parts(regen).outvars] == \
        [v.aval for v in _jaxpr.jaxpr_parts(j).outvars]
    assert all(v.aval.weak_type for v in _jaxpr.jaxpr_parts(j).outvars)


def test_closure_constants_inline_or_from_objects():
    small = np.linspace(-1, 1, 5, dtype=np.float32)
    big = np.arange(20_000, dtype=np.float32)
    j = jax.make_jaxpr(lambda x: (jnp.asarray(small) * x, jnp.asarray(big).sum() + x))(
        np.float32(2.0))
    code = ir.jaxpr_to_python_code(j)
    assert len(code.objects) == 1 and next(iter(code.objects.values())).size == 20_000
    want = _flat(jax.extend.core.jaxpr_as_fun(j)(np.float32(2.0)))
    assert_bitwise(_flat(code.load()(np.float32(2.0))), want)
    # Raising the limit makes the code self-contained.
    full = ir.jaxpr_to_python_code(j, max_inline_elements=100_000)
    assert not full.objects and "OBJECTS" not in full


def test_python_code_without_objects_runs_as_a_plain_module():
    def f(x):
        return lax.fori_loop(0, 3, lambda i, c: c * 2.0 + i, x)

    code = ir.fn_to_python_code(f, np.float32(1.0))
    assert not code.objects and "OBJECTS" not in code
    namespace: dict = {}
    exec(str(code), namespace)
    assert float(namespace["f"](np.float32(1.0))) == float(f(np.float32(1.0)))


class Scale:
    """A param with no source form (compared by value)."""

    def __init__(self, k):
        self.k = k

    def __eq__(self, other):
        return isinstance(other, Scale) and other.k == self.k

    def __hash__(self):
        return hash(self.k)


scaled_p = core.Primitive("test_scaled")
scaled_p.def_impl(lambda x, *, scale, offset: x * scale.k + offset)
scaled_p.def_abstract_eval(lambda x, *, scale, offset: x)
jax.interpreters.mlir.register_lowering(
    scaled_p, jax.interpreters.mlir.lower_fun(
        lambda x, *, scale, offset: x * scale.k + offset, multiple_results=False))


def test_any_other_primitive_is_bound_where_its_module_defines_it():
    def f(x):
        return scaled_p.bind(x, scale=Scale(3.0), offset=0.5)

    code = assert_reproduces(f, np.float32(2.0))
    here = __name__
    assert f"import {here} as _M_" in code and "scaled_p.bind(" in code
    assert list(code.objects.values()) == [Scale(3.0)]  # the param with no source
    assert sys.modules[here].scaled_p is scaled_p


def _names_bound(code: str) -> set[str]:
    tree = ast.parse(code)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
    return out


def test_no_name_clashes_with_20_000_variables():
    def f(x):
        for _ in range(10_000):
            x = jnp.sin(x) * 0.999
        return x

    code = assert_reproduces(f, np.float32(0.5))
    bound = _names_bound(code)
    assert len(bound) > 20_000
    reserved = (set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins))
                | {"jax", "jnp", "np", "lax", "taxpr", "OBJECTS"})
    assert not bound & reserved
    for name in ("jax", "np", "lax", "jnp", "if", "in", "is", "as", "or", "id"):
        assert name not in bound


@pytest.mark.parametrize("bad", ["jax", "lax", "class", "print", "_f", "2f", "a-b"])
def test_unusable_function_names_are_refused(bad):
    j = jax.make_jaxpr(jnp.sin)(1.0)
    with pytest.raises(ValueError, match="fn_name"):
        ir.jaxpr_to_python_code(j, fn_name=bad)


def test_variable_names_are_distinct_and_never_reserved_at_any_size():
    from taxpr.ir._codegen_names import RESERVED as _RESERVED, Names as _Names
    names = _Names()
    got = [names.fresh() for _ in range(200_000)]
    assert len(set(got)) == len(got)
    assert not set(got) & _RESERVED
    assert {"jax", "np", "lax", "jnp", "if", "as", "id"} <= _RESERVED


def test_generated_code_reproduces_a_20_000_equation_fuzz_program():
    from ir_fuzz.build import arguments, make_fn
    from ir_fuzz.checks import _calls, regenerate
    from ir_fuzz.generator import program
    from ir_helpers import total

    stmts: tuple = ()
    seed = 0
    while len(stmts) < 6200:
        stmts += program(seed)
        seed += 1
    args = arguments(0)
    j = jax.make_jaxpr(make_fn(stmts))(*args)
    assert total(j) >= 20_000
    want, want_calls = _calls(j, args)
    regen = regenerate(j)
    got, got_calls = _calls(regen, args)
    assert_bitwise(got, want)
    assert got_calls == want_calls and want_calls["io"] > 0 and want_calls["debug"] > 0


def test_shard_map_becomes_jax_shard_map_with_its_mesh_and_specs():
    from jax.sharding import PartitionSpec as P

    from helpers import cpu_mesh, shard_map

    mesh = cpu_mesh("i")

    def f(x):
        return shard_map()(lambda v: lax.psum(jnp.sin(v) * 2.0, "i"), mesh=mesh,
                           in_specs=P("i"), out_specs=P())(x)

    code = assert_reproduces(f, np.linspace(-1, 1, 8, dtype=np.float32))
    assert "jax.shard_map(" in code and "jax.sharding.PartitionSpec('i')" in code
    assert not code.objects, code.objects  # the mesh is written, its devices found by id
    assert "jax.sharding.Mesh(_mesh_devices_" in code and "((0, 1, 2, 3), (4,), 'cpu'), ('i',))" in code


def test_a_mesh_whose_devices_are_missing_fails_naming_their_ids():
    from helpers import cpu_mesh

    namespace: dict = {}
    exec(compile(_mesh_code(cpu_mesh("i", 2)), "<mesh>", "exec"), namespace)
    helper = next(v for k, v in namespace.items() if k.startswith("_mesh_devices_"))
    with pytest.raises(RuntimeError, match=r"cpu devices with ids \[99, 1000\]"):
        helper((0, 99, 1000), (3,), "cpu")


def _mesh_code(mesh):
    from jax.sharding import PartitionSpec as P

    from helpers import shard_map

    return ir.fn_to_python_code(
        lambda x: shard_map()(lambda v: v * 2.0, mesh=mesh, in_specs=P(mesh.axis_names[0]),
                              out_specs=P(mesh.axis_names[0]))(x),
        np.zeros(4, np.float32))


def test_meshes_and_abstract_meshes_are_written_with_their_axis_types():
    from jax.sharding import AbstractMesh, AxisType, Mesh

    from taxpr.ir._codegen import _Gen

    devices = np.array(cpu_devices(4)).reshape(2, 2)
    explicit = Mesh(devices[:, ::-1], ("a", "b"), axis_types=(AxisType.Explicit, AxisType.Auto))
    meshes = [Mesh(devices, ("a", "b")), explicit, explicit.abstract_mesh,
              AbstractMesh((2, 3), ("x", "y")),
              AbstractMesh((2,), ("x",), axis_types=(AxisType.Explicit,)),
              AbstractMesh((2,), ("x",), axis_types=(AxisType.Auto,))]
    for mesh in meshes:
        g = _Gen(64)
        src = g.param(mesh, "mesh")
        assert not g.objects and src.startswith(f"jax.sharding.{type(mesh).__name__}("), src
        back = eval(src, g.namespace)  # noqa: S307
        assert type(back) is type(mesh) and back == mesh, src
        assert back.axis_types == mesh.axis_types and back.axis_names == mesh.axis_names
    assert "axis_types=(jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto)" \
        in _Gen(64).param(explicit, "mesh")


def test_linear_solve_and_prng_keys_are_written_with_public_functions():
    key = jax.random.key(3)

    def f(x):
        a = jnp.eye(3, dtype=np.float32) * 2.0 + x[:, None]
        return jnp.linalg.solve(a, x), jax.random.normal(key, (2,)) + x[0]

    code = assert_reproduces(f, np.array([0.5, -1.0, 2.0], np.float32))
    assert not code.objects, code.objects
    assert "lax.custom_linear_solve(" in code and "symmetric=" not in code
    assert "jax.random.wrap_key_data(np.array([0, 3], dtype=np.uint32), " \
           "impl='threefry2x32')" in code
    g = code.load()  # differentiable as the original (the solve's transpose kept)
    x = np.array([0.5, -1.0, 2.0], np.float32)
    assert_bitwise(_flat(jax.grad(lambda v: g(v)[0].sum())(x)),
                   _flat(jax.grad(lambda v: f(v)[0].sum())(x)))


def test_code_reading_objects_names_them_and_fails_clearly_without_them():
    scale = np.float32(3.0)
    code = ir.fn_to_python_code(
        lambda x: jax.pure_callback(lambda v: v * scale, jax.ShapeDtypeStruct((), np.float32), x),
        np.float32(2.0))
    (key,) = code.objects
    assert f"_OBJECTS_NEEDED = ({key!r},)" in code and f"#   {key!r}: function " in code
    with pytest.raises(NameError, match=f"missing from OBJECTS: {key}"):
        exec(str(code), {})
    assert float(code.load()(np.float32(2.0))) == 6.0


def test_code_without_objects_runs_in_a_fresh_process(tmp_path):
    import subprocess

    def f(a):
        p, l, u = jax.scipy.linalg.lu(a)
        return jnp.sort(l @ u, axis=0)

    a = np.array([[2.0, 1.0], [4.0, -3.0]], np.float32)
    code = ir.fn_to_python_code(f, a)
    assert not code.objects and "lax.linalg.lu(" in code and "_p.bind(" not in code
    script = tmp_path / "generated.py"
    script.write_text(str(code) + "\nimport sys, numpy\n"
                      "a = numpy.array([[2.0, 1.0], [4.0, -3.0]], numpy.float32)\n"
                      "sys.stdout.write(numpy.asarray(f(a)).tobytes().hex())\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == np.asarray(f(jnp.asarray(a))).tobytes().hex()


def test_module_level_names_never_clash_whatever_the_functions_are_called():
    k1, k2 = np.arange(3, dtype=np.float32), np.ones(3, np.float32) * 2

    def const(x):  # a jitted function named like the generated constants
        return x * jnp.asarray(k1)

    def f(x):
        return jax.jit(const)(x) + jnp.asarray(k2), jax.jit(const)(-x)

    j = jax.make_jaxpr(f)(np.ones(3, np.float32))
    code = ir.jaxpr_to_python_code(j)
    tree = ast.parse(str(code))
    top = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    top += [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Name)]
    assert len(top) == len(set(top)) and any(n.startswith("_const_") for n in top)
    assert_bitwise(_flat(code.load()(np.ones(3, np.float32))),
                   _flat(f(jnp.ones(3, np.float32))))


applied_p = core.Primitive("test_applied")
applied_p.def_impl(lambda x, *, fun: jax.extend.core.jaxpr_as_fun(fun)(x)[0])
applied_p.def_abstract_eval(lambda x, *, fun: x)
jax.interpreters.mlir.register_lowering(
    applied_p, jax.interpreters.mlir.lower_fun(
        lambda x, *, fun: jax.extend.core.jaxpr_as_fun(fun)(x)[0], multiple_results=False))


def test_a_jaxpr_in_the_params_of_a_bound_primitive_is_rebuilt_in_the_code():
    fun = jax.make_jaxpr(lambda v: jnp.sin(v) * 3.0 + 1.0)(np.float32(0.0))

    def f(x):
        return applied_p.bind(x, fun=fun)

    code = assert_reproduces(f, np.float32(0.75))
    assert not code.objects and "applied_p.bind(a, fun=_test_applied_fun_" in code
    # Built from its generated function, at its input types.
    assert "= jax.make_jaxpr(_test_applied_fun_1)(jax.ShapeDtypeStruct((), np.float32))" in code

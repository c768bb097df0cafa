"""Capture per-layer activations of a scan-over-layers model with `reap`,
then patch one layer's activation with `plant` + `rows` and watch the
output change.

Run: python examples/activation_patching.py
"""

import jax
import jax.numpy as jnp
import numpy as np

from taxpr import harvest as h

N_LAYERS, WIDTH = 4, 8


def init(key):
    ws = jax.random.normal(key, (N_LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH)
    return ws, jnp.zeros((N_LAYERS, WIDTH))


def model(params, x):
    ws, bs = params

    def layer(x, wb):
        w, b = wb
        a = jnp.tanh(w @ x + b)
        # Each layer's activation is sown; inside scan, "append" stacks them
        # along the layer axis.
        a = h.sow(a, tag="acts", name="act", mode="append")
        return a, None

    x, _ = jax.lax.scan(layer, x, (ws, bs))  # raw lax.scan over layers
    return x.sum()


def reference(params, x, patch=None):
    """The same model with a Python loop, optionally patching one layer."""
    ws, bs = params
    acts = []
    for i in range(N_LAYERS):
        x = np.tanh(np.asarray(ws[i]) @ x + np.asarray(bs[i]))
        if patch is not None and patch[0] == i:
            x = patch[1]
        acts.append(x)
    return x.sum(), np.stack(acts)


def main():
    params = init(jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, WIDTH)

    out, reaps = jax.jit(h.call_and_reap(model, tag="acts"))(params, x)
    acts = reaps["act"]
    ref_out, ref_acts = reference(params, np.asarray(x))
    assert acts.shape == (N_LAYERS, WIDTH)
    np.testing.assert_allclose(acts, ref_acts, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5)

    # Patch layer 1's activation: `h.rows({1: value})` replaces only row 1
    # of the "act" stack (the scan's iteration 1); the other layers keep the
    # activations the model computes, and the later layers recompute from
    # the patched one. The model itself is unchanged.
    plants = {"act": h.rows({1: jnp.ones(WIDTH)})}
    new_out = jax.jit(h.plant(model, tag="acts"))(plants, params, x)
    ref_new, _ = reference(params, np.asarray(x), patch=(1, np.ones(WIDTH)))
    np.testing.assert_allclose(new_out, ref_new, rtol=1e-5, atol=1e-6)
    assert abs(float(new_out) - float(out)) > 1e-3
    print(f"reaped activations: {acts.shape}, output {float(out):.4f}")
    print(f"after setting layer 1 to ones with plant: output {float(new_out):.4f} "
          f"(Python reference {float(ref_new):.4f})")


if __name__ == "__main__":
    # The checks compare float32 matmuls with NumPy: ask for full float32
    # precision (GPUs default to TF32 matmuls).
    with jax.default_matmul_precision("highest"):
        main()

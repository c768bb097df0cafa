import os

# 4 simulated CPU devices for shard_map tests; must precede importing jax.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402

jax.config.update("jax_enable_checks", True)
# Tests compare programs with eager/NumPy references at float32 tolerances:
# full float32 matmuls on every backend (GPUs default to TF32).
jax.config.update("jax_default_matmul_precision", "highest")

import os

# 4 simulated CPU devices for shard_map tests; must precede importing jax.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402

jax.config.update("jax_enable_checks", True)

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

import rocketkv_jax  # noqa: E402,F401  (sets its XLA:CPU flag before any backend starts)

jax.config.update("jax_default_matmul_precision", "highest")

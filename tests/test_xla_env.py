"""The suite compiles with tests/xla_env.py's FAST_COMPILE flags; the tests that inspect compiled
programs use `as_users_compile`, which must build the program of a process without those flags."""

import os
import re
import subprocess
import sys

from xla_env import as_users_compile

# Lowers a bf16 rocketkv decode step (donated cache) as `lowered`, with conftest's precision.
_LOWER = """
import jax, jax.numpy as jnp
jax.config.update("jax_default_matmul_precision", "highest")
import rocketkv_jax as rocketkv
plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, window_size=8), 4000, 16, 64)
kc = jnp.zeros((1, 4, plan.prompt_budget, 64), jnp.bfloat16)
cache = rocketkv.full_cache(kc, kc, plan.capacity, plan.chunk_size)
q, kn = jnp.zeros((1, 12, 64), jnp.bfloat16), jnp.zeros((1, 4, 1, 64), jnp.bfloat16)
step = jax.jit(rocketkv.decode_step, static_argnums=4, donate_argnums=3)
lowered = step.lower(q, kn, kn, cache, plan)
"""


def _hlo(text: str) -> str:
  """A compiled module's header and computations, without the source tables and metadata."""
  lines = text.strip().splitlines()
  body = next(i for i, line in enumerate(lines) if line.startswith(("%", "ENTRY")))
  return re.sub(r", metadata=\{[^}]*\}", "", "\n".join(lines[:1] + lines[body:]))


def test_as_users_compile_builds_what_a_process_without_the_test_flags_builds():
  scope = {}
  exec(_LOWER, scope)  # pylint: disable=exec-used
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  child = subprocess.run(
      [sys.executable, "-c", _LOWER + "print(lowered.compile().as_text())"],
      env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
  assert child.returncode == 0, child.stderr[-2000:]
  users = _hlo(child.stdout)
  assert _hlo(as_users_compile(scope["lowered"]).as_text()) == users
  assert _hlo(scope["lowered"].compile().as_text()) != users  # the test flags are in effect

"""The suite compiles with tests/xla_env.py's FAST_COMPILE flags; the tests that inspect compiled
programs use `as_users_compile`, which must build the program of a process without those flags.
`-n auto` sizes its workers by cores and memory (conftest)."""

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


def test_auto_workers_are_bounded_by_cores_and_memory(monkeypatch):
  import conftest

  def machine(cores, gib):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": gib * 2**30 // 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    return conftest.pytest_xdist_auto_num_workers(None)

  monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
  assert conftest.WORKER_GIB == 6
  assert machine(2, 24) == 2            # this project's CI machine: one worker per core
  assert machine(64, 24) == 4           # many cores, 24 GiB: 6 GiB per worker
  assert machine(8, 5) == 1             # never fewer than one
  monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
  assert machine(64, 512) == 3

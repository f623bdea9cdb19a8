"""XLA flags for the test processes and the child Pythons they start.

The suite's programs are tiny, so its time goes to XLA:CPU's compiles, not to running them.
FAST_COMPILE lowers LLVM's optimization level and uses XLA:CPU's older fusion code generator,
which compiles a tiny model's programs in about half the time (docs/cpu_performance.md has
the measurement). The second changes the compiled HLO, so the tests that inspect compiled programs
(copies, temporaries) compile them with `as_users_compile`, XLA's default options.
"""

from __future__ import annotations

import os

# flag: (the tests' value, XLA's default)
_FLAGS = {
    "xla_backend_optimization_level": (0, 3),
    "xla_llvm_disable_expensive_passes": (True, False),
    "xla_cpu_use_fusion_emitters": (False, True),
}
FAST_COMPILE = " ".join(f"--{k}={str(v).lower()}" for k, (v, _) in _FLAGS.items())
XLA_DEFAULTS = {k: d for k, (_, d) in _FLAGS.items()}


def with_fast_compile(flags: str) -> str:
  """`flags` (an XLA_FLAGS value) with FAST_COMPILE added, unless it sets one of them itself."""
  if any(k in flags for k in _FLAGS):
    return flags
  return f"{flags} {FAST_COMPILE}".strip()


def child_env(devices: int | None = None) -> dict[str, str]:
  """os.environ for a child Python: CPU only, FAST_COMPILE, and `devices` forced host devices
  (XLA's default of one when None); any XLA_FLAGS of this process are replaced."""
  flags = FAST_COMPILE
  if devices is not None:
    flags += f" --xla_force_host_platform_device_count={devices}"
  return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")


def as_users_compile(lowered):
  """`lowered.compile()` with XLA's default options: the program a user's process builds."""
  return lowered.compile(XLA_DEFAULTS)

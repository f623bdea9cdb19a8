"""The one XLA flag rocketkv-jax sets, at import time, before JAX starts its backend."""

from __future__ import annotations

import os

FLAG = "xla_cpu_copy_insertion_use_region_analysis"


def set_cpu_flags() -> None:
  """Asks XLA:CPU for region-analysis copy insertion (called by `import rocketkv_jax`).

  Without it, a jitted decode step that reads a donated cache and updates it in place makes
  XLA:CPU copy whole cache buffers every step (docs/cpu_performance.md). It only affects the CPU
  backend and only takes effect if no JAX computation ran before `import rocketkv_jax`. Opt out with
  ROCKETKV_NO_XLA_FLAGS=1; a value already in XLA_FLAGS is left alone.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if os.environ.get("ROCKETKV_NO_XLA_FLAGS") or FLAG in flags:
    return
  os.environ["XLA_FLAGS"] = f"{flags} --{FLAG}=true".strip()

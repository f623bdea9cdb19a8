"""Small helpers shared by the Pallas TPU (Mosaic) kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

NEG_INF = float("-inf")


def interpret_params(interpret: bool):
  """`pallas_call(interpret=...)` for a TPU kernel: TPU interpret mode (simulated HBM / VMEM,
  DMAs, semaphores, race checks) when asked, else compiled by Mosaic."""
  return pltpu.InterpretParams() if interpret else False


def safe_max(m):
  """Running max with -inf (no valid entry yet) replaced by 0, so exp(x - m) stays finite."""
  return jnp.where(m == NEG_INF, 0.0, m)

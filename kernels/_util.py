"""Small static helpers shared by the Pallas (Triton backend) kernels.

Input checks use the core's helpers (`rocketkv_jax._checks`): the same ValueErrors, raised
before tracing.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rocketkv_jax._checks import group_size, require, require_rank

# Triton needs power-of-two tensor sizes; its tensor-core dots need every dim >= 16.
MIN_DIM = 16
NEG_INF = float("-inf")


def check_decode_qkv(q, k, v) -> tuple[int, int, int, int]:
  """One-line ValueErrors unless q is [B, Hq, D] and k, v are [B, Hkv, C, D] with Hkv | Hq;
  returns (B, Hkv, C, D)."""
  require_rank("q", q, 3, "[B, Hq, D]")
  require_rank("k", k, 4, "[B, Hkv, C, D]")
  require(k.shape == v.shape, f"k and v must have the same shape, got {k.shape} and {v.shape}")
  b, hkv, c, d = k.shape
  require(q.shape[0] == b and q.shape[2] == d,
          f"q must have shape [B={b}, Hq, D={d}], got {q.shape}")
  group_size(q.shape[1], hkv, "q")
  return b, hkv, c, d


def next_pow2(n: int) -> int:
  """Smallest power of two >= n (n >= 1)."""
  return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def padded_dim(n: int) -> int:
  """A dot dimension padded to a power of two >= 16."""
  return max(MIN_DIM, next_pow2(n))


def compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
  """Triton compiler params (passing them selects the Triton backend when lowering for CUDA)."""
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def dot_precision(dtype) -> lax.Precision | None:
  """fp32 operands: IEEE fp32 (Triton would otherwise use TF32); bf16/fp16: native MMA."""
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def load_rows(ref, rows, block: int, ncols: int):
  """The rows `rows [R]` (-1: padding, loads 0) of program axis 2's column block of `ref
  [N, ncols]` (columns past ncols load 0): [R, block] in ref's dtype. Two broadcast index vectors
  (a row gather with a column slice has no interpret-mode rule)."""
  cols = pl.program_id(2) * block + jnp.arange(block)
  at = (jnp.maximum(rows, 0)[:, None], jnp.minimum(cols, ncols - 1)[None, :])
  return plgpu.load(ref.at[at], mask=(rows >= 0)[:, None] & (cols < ncols)[None, :], other=0)


def safe_max(m):
  """Running max with -inf (no valid entry yet) replaced by 0, so exp(x - m) stays finite."""
  return jnp.where(m == NEG_INF, 0.0, m)

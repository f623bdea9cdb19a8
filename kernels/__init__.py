"""Pallas GPU kernels for the RocketKV hot path (imported as rocketkv_jax.kernels).

Triton-backend Pallas (`jax.experimental.pallas.triton`); every kernel also runs in Pallas
interpret mode (`interpret=True`) on CPU, which is how the tests check them against the XLA
reference path.

- `approx_bounds_scores` / `approx_chunk_scores`: stage-2 approximate chunk scores
  (== select.approx_bounds_scores_xla / approx_chunk_scores_xla).
- `sparse_attention`: flash-decoding over gathered slots (== attend.sparse_attention_xla).
- `window_scores`: stage-1 SnapKV window scores (== evict.window_scores_xla).

Status: checked against the XLA path in interpret mode and lowered for CUDA on a CPU host (the
Triton IR each call embeds verifies); not yet compiled or timed on a GPU. Block sizes, split
counts and warps are static keyword arguments with untuned defaults; `benchmarks/kernels.py`
is the sweep to tune them. fp32 operands use IEEE fp32 dots (never TF32).
"""

from .approx_scores import approx_bounds_scores, approx_chunk_scores
from .sparse_attention import sparse_attention
from .window_scores import window_scores

__all__ = ["approx_bounds_scores", "approx_chunk_scores", "sparse_attention", "window_scores"]

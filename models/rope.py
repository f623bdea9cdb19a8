"""Rotary position embeddings (half-split / "rotate_half" convention, as in Hugging Face)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from rocketkv_jax.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig, layer: int = 0) -> np.ndarray:
  """`[Dh // 2]` float32 inverse frequencies of `layer`, with "linear" or "llama3" scaling.

  Computed on the host in float64 and rounded once to float32 (so it is a compile-time constant).
  A hybrid model's sliding layers have their own base (`ModelConfig.layer_rope`).
  """
  d = config.head_dim
  theta, s, freq_factors = config.layer_rope(layer)
  inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
  if s.rope_type == "linear":
    inv = inv / s.factor
  elif s.rope_type == "llama3":
    old = s.original_max_position_embeddings
    low_wavelen = old / s.low_freq_factor
    high_wavelen = old / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv = np.where(medium, smoothed, scaled)
  if freq_factors is not None:
    inv = inv / np.asarray(freq_factors, np.float64)
  return inv.astype(np.float32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, config: ModelConfig,
               layer: int = 0) -> jnp.ndarray:
  """Rotates `x` `[B, H, T, Dh]` by absolute `positions` `[B, T]` (int32) with `layer`'s RoPE.

  The angle is computed in float32 and the result cast back to `x.dtype`.
  """
  inv = jnp.asarray(inverse_frequencies(config, layer))
  angles = positions.astype(jnp.float32)[:, None, :, None] * inv  # [B, 1, T, Dh/2]
  cos = jnp.cos(angles).astype(x.dtype)
  sin = jnp.sin(angles).astype(x.dtype)
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

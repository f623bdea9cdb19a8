"""Rotary position embeddings (half-split / "rotate_half" convention, as in Hugging Face)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from rocketkv_jax.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig, layer: int = 0) -> np.ndarray:
  """`[Dh // 2]` float32 inverse frequencies of `layer`, with "linear", "llama3" or "yarn"
  scaling.

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
  elif s.rope_type == "yarn":
    inv = _yarn(inv, d, theta, s)
  if freq_factors is not None:
    inv = inv / np.asarray(freq_factors, np.float64)
  return inv.astype(np.float32)


def _yarn(inv: np.ndarray, d: int, theta: float, s) -> np.ndarray:
  """YaRN's "NTK-by-parts" frequencies (Peng et al. 2023, sec. 3.2): a frequency pair i that
  turns r_i = L / (2 pi / inv_i) times over the original context L keeps inv_i when
  r_i > beta_fast, becomes inv_i / factor when r_i < beta_slow, and is blended linearly in
  between. The blend runs over the pair index, between the (fractional) indices where r_i equals
  beta_fast and beta_slow, rounded outwards when `truncate` (as the paper's released code)."""
  length = s.original_max_position_embeddings

  def index_of(rotations):  # the i with L * inv_i / (2 pi) = rotations, inv_i = theta^(-2i/d)
    return d * math.log(length / (2 * math.pi * rotations)) / (2 * math.log(theta))

  lo, hi = index_of(s.beta_fast), index_of(s.beta_slow)
  if s.truncate:
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, d - 1)
  if hi == lo:
    hi += 1e-3
  # keep: 1 for pairs below lo (high frequencies: extrapolated), 0 above hi (interpolated)
  keep = 1.0 - np.clip((np.arange(d // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
  return inv / s.factor * (1.0 - keep) + inv * keep


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, config: ModelConfig,
               layer: int = 0) -> jnp.ndarray:
  """Rotates `x` `[B, H, T, Dh]` by absolute `positions` `[B, T]` (int32) with `layer`'s RoPE.

  The angle is computed in float32 and the result cast back to `x.dtype`. YaRN's attention
  temperature multiplies cos and sin (q and k alike, so the logits by its square).
  """
  inv = jnp.asarray(inverse_frequencies(config, layer))
  angles = positions.astype(jnp.float32)[:, None, :, None] * inv  # [B, 1, T, Dh/2]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  mscale = config.layer_rope(layer)[1].attention_scale
  if mscale != 1.0:
    cos, sin = cos * mscale, sin * mscale
  cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

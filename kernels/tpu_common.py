"""Small helpers shared by the Pallas TPU (Mosaic) kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

NEG_INF = float("-inf")


def interpret_params(interpret: bool):
  """`pallas_call(interpret=...)` for a TPU kernel: TPU interpret mode (simulated HBM / VMEM,
  DMAs, semaphores, race checks) when asked, else compiled by Mosaic."""
  return pltpu.InterpretParams() if interpret else False


def safe_max(m):
  """Running max with -inf (no valid entry yet) replaced by 0, so exp(x - m) stays finite."""
  return jnp.where(m == NEG_INF, 0.0, m)


def softmax_block(q, kb, vb, sel, scale: float, carry):
  """One block of online-softmax attention: q [G, D] against kb, vb [R, D] (float32) where
  sel [1, R] holds; carry (m [G, 1], l [G, 1], acc [G, D]) -> the updated carry."""
  m, l, acc = carry
  s = lax.dot_general(q, kb, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32) * scale  # [G, R]
  s = jnp.where(sel, s, NEG_INF)
  m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))  # [G, 1]
  m_use = safe_max(m_new)
  corr = jnp.exp(safe_max(m) - m_use)
  pr = jnp.exp(s - m_use)
  l = corr * l + jnp.sum(pr, axis=1, keepdims=True)
  acc = corr * acc + jnp.dot(pr, vb, precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
  return m_new, l, acc

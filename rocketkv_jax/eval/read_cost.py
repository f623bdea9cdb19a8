"""Bytes of KV state one decode step reads, per method: the x axis of accuracy-vs-cost curves.

Counted at the last step of a plan (every slot of `plan.capacity` filled), per KV head of one
compressed layer (`head_read_bytes`), and summed over a model's layers and KV heads
(`step_read_bytes`): a hybrid model's sliding layers read their window whatever the method
(docs/gemma3.md), a method's dense layers (`Method.dense_layers`) their whole cache. K/V rows
count `itemsize` bytes per value; codes, bounds' steps and running sums their own sizes.
"""

from __future__ import annotations

import math

import rocketkv_jax as rocketkv
from rocketkv_jax import methods as methods_lib

__all__ = ["head_read_bytes", "step_read_bytes"]


def head_read_bytes(plan, itemsize: int) -> int:
  """Bytes one decode step of `plan` reads per KV head in one of its compressed layers.

    full, snapkv, streamingllm  every slot's K and V row
    exact_topk, exact_topp      every slot's K row (exact scores) + the read slots' V rows
                                (exact_topp: counted at top_k = B, its mean read varies)
    sparq                       every slot's r dims of K + top_k K and V rows
    quest                       every page's min and max K rows + top_k K and V rows
    rocketkv (minmax)           one bound per r dim per chunk + top_k K and V rows
    rocketkv (rerank)           the bounds + M candidate K rows + top_k V rows
    rocketkv (lowrank)          page bases and coefficients + the decode window's K rows +
                                top_k K and V rows
    rocketkv (quant)            r dims of packed codes per slot + r fp32 steps + top_k K and V
                                rows (+ D fp32 of the value sum with `mean_value`)
  """
  d, c, k = plan.head_dim, plan.capacity, min(plan.top_k, plan.capacity)
  rows = 2 * k * d * itemsize
  method = plan.method
  if method in ("full", "snapkv", "streamingllm") or plan.top_k == 0:
    return 2 * c * d * itemsize
  if method in ("exact_topk", "exact_topk_heads", "exact_topp"):
    return (c + k) * d * itemsize
  if method == "sparq":
    return c * plan.r * itemsize + rows
  if method == "quest":
    return 2 * math.ceil(c / plan.chunk_size) * d * itemsize + rows
  s2 = plan.stage2
  if isinstance(s2, rocketkv.Quant):
    codes = plan.r * math.ceil(c * s2.bits / 8) + plan.r * 4 + s2.mean_value * d * 4
    return codes + rows
  if isinstance(s2, rocketkv.LowRank):
    w = min(plan.max_new_tokens, c)
    npg = max(1, math.ceil((c - w) / s2.page_size))
    return (npg * (s2.rank + 1) * d + npg * s2.page_size * s2.rank + w * d) * itemsize + rows
  bounds = math.ceil(c / plan.chunk_size) * plan.r * itemsize
  if isinstance(s2, rocketkv.Rerank):
    m = min(s2.candidates(plan.top_k), c)
    return bounds + (m + k) * d * itemsize
  return bounds + rows


def step_read_bytes(plan, model_config, itemsize: int) -> int:
  """Bytes one decode step of `plan` reads over every layer and KV head of a model (one batch
  row): compressed layers `head_read_bytes`, dense layers the K and V of all prompt + new
  tokens, sliding layers of a hybrid model the K and V of their window."""
  total = plan.prompt_len + plan.max_new_tokens
  dense = set(methods_lib.get(plan.method).dense_layers(plan))
  sliding = set(model_config.window_layers)
  out = 0
  for i in range(model_config.num_layers):
    if i in sliding:
      tokens = min(model_config.sliding_window, total)
      out += 2 * tokens * plan.head_dim * itemsize
    elif i in dense:
      out += 2 * total * plan.head_dim * itemsize
    else:
      out += head_read_bytes(plan, itemsize)
  return out * model_config.num_kv_heads

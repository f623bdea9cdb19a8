"""Exact top-k shared across heads: the oracle whose read follows the attention across KV heads.

Each KV head's exact attention mass (softmax per query head, summed over its group, so every
head's masses sum to G) competes in one top over heads x slots for the layer's Hkv * k reads:
a head whose attention is spread reads more rows, a peaked one fewer, and the rows read per
step are those of `exact_topk` at the same budget (the ceiling for adaptive reads:
results/adaptive_oracle).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from rocketkv_jax.cache import valid_slots
from rocketkv_jax.methods.exact_topk import ExactTopK
from rocketkv_jax.select import exact_slot_scores_xla, top_slots


@dataclasses.dataclass(frozen=True)
class ExactTopKHeads(ExactTopK):
  name = "exact_topk_heads"
  summary = ("oracle: exact scores; the KV heads of a layer share Hkv x B reads (one top over "
             "heads x slots)")

  def select(self, q, cache, plan, *, sliding_window=None, impl="auto"):
    b, h, c = cache.k.shape[0], cache.k.shape[1], cache.capacity
    total = h * min(plan.top_k, c)  # the layer's reads: exact_topk's, summed over heads
    per_head = min(total, c)  # the most one head can take
    valid = valid_slots(cache, sliding_window)
    scores = jnp.where(valid, exact_slot_scores_xla(q, cache.k, valid), -jnp.inf)
    idx = top_slots(scores, valid, 1, per_head)  # [B, Hkv, per_head]: each head's best
    cand = jnp.take_along_axis(scores, jnp.clip(idx, 0, c - 1), axis=2)
    cand = jnp.where(idx < c, cand, -jnp.inf)
    _, win = lax.top_k(cand.reshape(b, h * per_head), total)  # [B, total] over heads x slots
    keep = jnp.zeros((b, h * per_head), bool).at[jnp.arange(b)[:, None], win].set(True)
    keep = keep.reshape(b, h, per_head) & jnp.isfinite(cand)
    # Rows a head does not take point past the cache (distinct, >= C): `attend` masks them.
    return jnp.where(keep, idx, c + jnp.arange(per_head, dtype=idx.dtype)).astype(jnp.int32)

"""Quest: no eviction; per-page key min / max bounds pick the pages holding B tokens.

Each page of `page_size` slots is scored by the upper bound sum_d max(q_d kmin_d, q_d kmax_d);
the best pages' slots are read. As in the Quest paper, the first two layers stay dense (their
attention is too flat for page bounds; the cache already holds every token, so only the read
changes).
"""

from __future__ import annotations

import dataclasses

from rocketkv_jax.methods.base import Method, full_split
from rocketkv_jax.select import check_chunks, quest_bounds_scores_xla, top_chunk_slots

DENSE_LAYERS = (0, 1)


@dataclasses.dataclass(frozen=True)
class Quest(Method):
  name = "quest"
  summary = "no eviction; per-page (page_size) min/max bounds pick pages holding B tokens"
  dense = False

  def split(self, config, prompt_len, max_new_tokens, head_dim):
    return dict(full_split(prompt_len, max_new_tokens, head_dim),
                top_k=min(config.top_k or config.token_budget, prompt_len + max_new_tokens),
                chunk_size=config.chunk_size or config.page_size)

  def select(self, q, cache, plan, *, sliding_window=None, impl="auto"):
    check_chunks(cache, plan.chunk_size)
    chunk = quest_bounds_scores_xla(q, cache.bounds, cache.length, cache.chunk_size)
    return top_chunk_slots(chunk, cache, min(plan.top_k, cache.capacity), sliding_window)

  def dense_layers(self, plan):
    return DENSE_LAYERS

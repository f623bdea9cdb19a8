"""Exact top-k: an oracle that scores every cached token exactly and reads the best B.

Not a practical method (scoring reads the whole cache); it bounds what any B-token selection
can do.
"""

from __future__ import annotations

import dataclasses

from rocketkv_jax.cache import valid_slots
from rocketkv_jax.methods.base import Method, full_split
from rocketkv_jax.select import exact_slot_scores_xla, top_slots


@dataclasses.dataclass(frozen=True)
class ExactTopK(Method):
  name = "exact_topk"
  summary = "oracle: exact scores over the whole cache, attend to the top B tokens"
  dense = False

  def split(self, config, prompt_len, max_new_tokens, head_dim):
    # B tokens, at most the whole cache (budget.py: top_k <= capacity).
    return dict(full_split(prompt_len, max_new_tokens, head_dim),
                top_k=min(config.top_k or config.token_budget, prompt_len + max_new_tokens))

  def select(self, q, cache, plan, *, sliding_window=None, impl="auto"):
    k = min(plan.top_k, cache.capacity)
    valid = valid_slots(cache, sliding_window)
    return top_slots(exact_slot_scores_xla(q, cache.k, valid), valid, 1, k)

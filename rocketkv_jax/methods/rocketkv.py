"""RocketKV: stage 1 eviction to the planned capacity at prefill, then hybrid sparse attention.

Stage 1 (`evict`): SnapKV-style, the last `window_size` prompt queries score every earlier key
(max-pooled, kernel `kernel_size`); each KV head keeps the window and its top
`prompt_budget - window_size` keys. Stage 2 (every step): the kept keys are summarised per chunk
of `chunk_size` slots by element-wise min / max; the query's top-r dims score the chunks
(`select.approx_bounds_scores_xla`) and the `top_k` best slots are read exactly. The budget
split is the paper's (`budget.paper_split`).
"""

from __future__ import annotations

import dataclasses

from rocketkv_jax.budget import paper_split
from rocketkv_jax.evict import evict
from rocketkv_jax.methods.base import Method, require_half_budget, require_window_budget
from rocketkv_jax.methods.sparq import approx_select


@dataclasses.dataclass(frozen=True)
class RocketKV(Method):
  name = "rocketkv"
  summary = "stage 1 eviction to the planned capacity + hybrid sparse attention (top_k=B/2)"
  dense = False
  replan_per_turn = True

  def check_config(self, config):
    require_window_budget(config)
    require_half_budget(config)

  def split(self, config, prompt_len, max_new_tokens, head_dim):
    return paper_split(config, prompt_len, max_new_tokens, head_dim)

  def prefill(self, k, v, q_window, plan, *, lengths=None, impl="auto"):
    return evict(k, v, q_window, plan, lengths=lengths, impl=impl)

  def select(self, q, cache, plan, *, sliding_window=None, impl="auto"):
    return approx_select(q, cache, plan, sliding_window=sliding_window, impl=impl)

"""SparQ: no eviction; r = D*B/T query dims score every token approximately, the top B/2 are
read exactly. The same approximate score as RocketKV's stage 2 with one token per chunk."""

from __future__ import annotations

import dataclasses

from rocketkv_jax.methods.base import Method, full_split, require_half_budget
from rocketkv_jax.select import approx_select


@dataclasses.dataclass(frozen=True)
class SparQ(Method):
  name = "sparq"
  summary = "no eviction; r = D*B/T dims score every token, attend to the top B/2"
  dense = False
  picks_dims = True

  def check_config(self, config):
    require_half_budget(config)

  def split(self, config, prompt_len, max_new_tokens, head_dim):
    b, t = config.token_budget, prompt_len + max_new_tokens
    r = config.r or min(max(round(head_dim * b / t), 1), head_dim)
    # B // 2 exact reads; every token once they all fit in the budget (as budget.paper_split).
    top_k = config.top_k or (t if t <= b else max(b // 2, 1))
    return dict(full_split(prompt_len, max_new_tokens, head_dim), top_k=min(top_k, t),
                chunk_size=1, r=r)

  def select(self, q, cache, plan, *, sliding_window=None, impl="auto"):
    return approx_select(q, cache, plan, sliding_window=sliding_window, impl=impl)

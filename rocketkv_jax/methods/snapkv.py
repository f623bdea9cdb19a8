"""SnapKV: stage 1 only. The prompt is evicted to B tokens (window included) at prefill; decode
attends densely to them and to every generated token."""

from __future__ import annotations

import dataclasses

from rocketkv_jax.evict import evict
from rocketkv_jax.methods.base import Method, require_window_budget


@dataclasses.dataclass(frozen=True)
class SnapKV(Method):
  name = "snapkv"
  summary = ("stage 1 only: keep B prompt tokens (window included), dense attention over them"
             " plus the generated tokens")

  def check_config(self, config):
    require_window_budget(config)

  def split(self, config, prompt_len, max_new_tokens, head_dim):
    pb = config.prompt_budget or config.token_budget
    pb = min(max(pb, config.window_size), prompt_len)
    return dict(capacity=pb + max_new_tokens, prompt_budget=pb, top_k=0, chunk_size=0,
                r=head_dim)

  def prefill(self, k, v, q_window, plan, *, lengths=None, impl="auto", dense=False):
    del dense  # no dense layers
    return evict(k, v, q_window, plan, lengths=lengths, impl=impl)

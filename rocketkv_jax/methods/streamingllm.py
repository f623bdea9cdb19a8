"""StreamingLLM: the first `sink_size` tokens (attention sinks) and the most recent B - sink_size.

Prefill keeps the sinks and the recent prompt tokens; every step reads the sinks and the
latest tokens of that cache.
"""

from __future__ import annotations

import dataclasses

from rocketkv_jax._checks import require, require_int
from rocketkv_jax.evict import evict_streaming
from rocketkv_jax.methods.base import Method
from rocketkv_jax.select import streaming_slots


@dataclasses.dataclass(frozen=True)
class StreamingLLM(Method):
  name = "streamingllm"
  summary = "sink_size sink tokens + the most recent B - sink_size tokens"
  dense = False

  def check_config(self, config):
    require_int("sink_size", config.sink_size, 0)
    require(config.token_budget > config.sink_size,
            f"token_budget must be > sink_size={config.sink_size}, got {config.token_budget}")

  def split(self, config, prompt_len, max_new_tokens, head_dim):
    pb = config.prompt_budget or config.token_budget
    pb = min(max(pb, 1), prompt_len)
    return dict(capacity=pb + max_new_tokens, prompt_budget=pb,
                top_k=min(config.top_k or config.token_budget, pb + max_new_tokens), chunk_size=0,
                r=head_dim)

  def prefill(self, k, v, q_window, plan, *, lengths=None, impl="auto", dense=False):
    del dense  # no dense layers
    return evict_streaming(k, v, plan, lengths=lengths)

  def select(self, q, cache, plan, *, sliding_window=None, impl="auto"):
    return streaming_slots(cache, plan.sink_size, min(plan.top_k, cache.capacity))

"""RocketKV: stage 1 eviction to the planned capacity at prefill, then hybrid sparse attention.

Stage 1 (`evict`): SnapKV-style, the last `window_size` prompt queries score every earlier key
(max-pooled, kernel `kernel_size`); each KV head keeps the window and its top
`prompt_budget - window_size` keys. Stage 2 (every step): the kept keys are summarised per chunk
of `chunk_size` slots by element-wise min / max; the query's top-r dims score the chunks
(`select.approx_bounds_scores_xla`) and the `top_k` best slots are read exactly. The budget
split is the paper's (`budget.paper_split`).

Stage 2 has variants, `RocketConfig.stage2` (`STAGE2`), all owned here:
- "minmax": the paper's, above. The state is the `KVCache`.
- "rerank": the chunk scores shortlist `rerank_candidates` slots, each re-scored on its own key
  (stage2_rerank.py). The state is the `KVCache`; a decode step attends from the candidate K
  rows it already read.
- "lowrank": page-local low-rank key summaries score every slot (stage2_lowrank.py). The state
  is a `LowRankState` (the cache, no chunk summaries, plus its prompt-key summaries); `view`
  gives its `KVCache`.
- "quant": per-token low-bit key codes score every slot on the r dims (stage2_quant.py). The
  state is a `QuantState` (the cache, no chunk summaries, plus the codes); `view` gives its
  `KVCache`. `RocketConfig.mean_value` adds SparQ's mean-value fill to its attention.
  (stage2_state.py maps each variant to its state.)

`RocketConfig.skip_layers` = N (`Plan.skip_layers`): layers 0..N-1 are `dense_layers`. Their
prefill keeps every prompt token in a `KVCache` without summaries (`dense_layer_cache`, for every
stage-2 variant) and every decode step attends to all of it: an ablation that reads about
N / num_layers of the full cache per step on top of the sparse layers' read.
"""

from __future__ import annotations

import dataclasses
import math

from rocketkv_jax import fused_step, stage2_lowrank, stage2_quant, stage2_rerank, stage2_state
from rocketkv_jax._checks import require, require_int
from rocketkv_jax.attend import attend, attend_dense_before_append
from rocketkv_jax.budget import paper_split
from rocketkv_jax.cache import valid_slots
from rocketkv_jax.evict import evict
from rocketkv_jax.methods.base import (Method, checked_append, dense_layer_cache,
                                       require_half_budget, require_window_budget)
from rocketkv_jax.methods.sparq import approx_select
from rocketkv_jax.select import approx_scores, check_chunks
from rocketkv_jax.stage2_quant import BITS, equal_read_capacity

STAGE2 = ("minmax", "rerank", "lowrank", "quant")


@dataclasses.dataclass(frozen=True)
class RocketKV(Method):
  name = "rocketkv"
  summary = "stage 1 eviction to the planned capacity + hybrid sparse attention (top_k=B/2)"
  dense = False
  replan_per_turn = True
  stage2_variants = STAGE2
  accepts_skip_layers = True

  def check_config(self, config):
    require_window_budget(config)
    require_half_budget(config)
    rf = config.rerank_factor
    require(isinstance(rf, (int, float)) and not isinstance(rf, bool) and rf >= 1,
            f"rerank_factor must be a number >= 1, got {rf!r}")
    require_int("lowrank_page_size", config.lowrank_page_size, 1)
    require_int("lowrank_rank", config.lowrank_rank, 1, config.lowrank_page_size)
    require(config.quant_bits in BITS,
            f"quant_bits must be one of {list(BITS)}, got {config.quant_bits!r}")

  def split(self, config, prompt_len, max_new_tokens, head_dim):
    split = dict(paper_split(config, prompt_len, max_new_tokens, head_dim),
                 skip_layers=config.skip_layers)
    if config.stage2 == "rerank":
      top_k = split["top_k"]
      split.update(stage2="rerank",
                   rerank_candidates=max(top_k, math.ceil(config.rerank_factor * top_k)))
    elif config.stage2 == "lowrank":
      require(config.lowrank_rank <= head_dim,
              f"lowrank_rank must be in [1, head_dim={head_dim}], got {config.lowrank_rank}")
      # No chunk min/max summaries: the cache keeps none and `append` updates none.
      split.update(stage2="lowrank", chunk_size=0, lowrank_page_size=config.lowrank_page_size,
                   lowrank_rank=config.lowrank_rank)
    elif config.stage2 == "quant":  # per-token codes replace the chunk bounds; r as the paper's
      if config.quant_capacity == "equal_read" and split["prompt_budget"] < prompt_len:
        cap = equal_read_capacity(split["capacity"], split["chunk_size"], config.quant_bits)
        kept = min(cap, prompt_len + max_new_tokens) - max_new_tokens
        split.update(prompt_budget=kept, capacity=kept + max_new_tokens)
      split.update(stage2="quant", chunk_size=0, quant_bits=config.quant_bits,
                   mean_value=config.mean_value)
    return split

  def prefill(self, k, v, q_window, plan, *, lengths=None, impl="auto", dense=False):
    if dense:  # a skipped layer: every prompt token, no stage 1 and no stage-2 summaries
      return dense_layer_cache(k, v, plan, lengths)
    return stage2_state.attach(evict(k, v, q_window, plan, lengths=lengths, impl=impl), plan)

  def view(self, state):
    return stage2_state.unwrap(state)

  def select(self, q, state, plan, *, sliding_window=None, impl="auto"):
    return stage2_select(q, state, plan, sliding_window=sliding_window, impl=impl)

  def decode_step(self, q, k_new, v_new, state, plan, *, dense=False, sliding_window=None,
                  impl="auto"):
    # A dense layer reads no stage-2 summaries: its state is a plain KVCache for every variant.
    require(dense or type(state) is stage2_state.state_type(plan),
            f"a stage2={plan.stage2!r} plan needs the state its prefill built, got {type(state)}")
    cache = self.view(state)
    new = checked_append(q, k_new, v_new, cache)
    new_state = stage2_state.after_append(state, new)
    if dense:  # read before the write: see attend_dense_before_append
      return (attend_dense_before_append(q, cache, k_new, v_new, sliding_window=sliding_window),
              new_state)
    if plan.stage2 == "rerank":  # attends from the candidate K rows it read (stage2_rerank.py)
      return (stage2_rerank.decode_attend(q, new, plan, sliding_window=sliding_window,
                                          impl=impl), new_state)
    if plan.stage2 == "quant":  # two kernels on a GPU, but with the mean-value fill (fused_step.py)
      return (fused_step.quant_attend(q, new_state, plan, sliding_window=sliding_window,
                                      impl=impl), new_state)
    if plan.stage2 == "minmax":  # two kernels on a GPU (fused_step.py)
      return (fused_step.select_attend(q, new, plan, sliding_window=sliding_window, impl=impl),
              new_state)
    idx = stage2_select(q, new_state, plan, sliding_window=sliding_window, impl=impl)
    return attend(q, new, idx, sliding_window=sliding_window, impl=impl), new_state


  def dense_layers(self, plan):
    return tuple(range(plan.skip_layers))


def stage2_select(q, state, plan, *, sliding_window=None, impl="auto"):
  """RocketKV's stage 2 by `plan.stage2`: int32 `[B, Hkv, min(top_k, C)]` slots of the cache in
  `state` (a `KVCache`; a `LowRankState` for "lowrank", a `QuantState` for "quant")."""
  if plan.stage2 == "lowrank":
    return stage2_lowrank.select_lowrank(q, state, plan, sliding_window=sliding_window)
  if plan.stage2 == "quant":
    return stage2_quant.select_quant(q, state, plan, sliding_window=sliding_window, impl=impl)
  require(not isinstance(state, tuple(stage2_state.STATE_TYPES.values())),
          f"a stage2={plan.stage2!r} plan needs a KVCache, got a {type(state).__name__}")
  if plan.stage2 == "rerank":
    check_chunks(state, plan.chunk_size)
    chunk = approx_scores(q, state, plan.r, impl=impl)
    return stage2_rerank.select_rerank(q, state, plan, chunk, valid_slots(state, sliding_window),
                                       sliding_window)
  return approx_select(q, state, plan, sliding_window=sliding_window, impl=impl)

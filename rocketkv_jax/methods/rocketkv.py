"""RocketKV: stage 1 eviction to the planned capacity at prefill, then hybrid sparse attention.

Stage 1 (`evict`): SnapKV-style, the last `window_size` prompt queries score every earlier key
(max-pooled, kernel `kernel_size`); each KV head keeps the window and its top
`prompt_budget - window_size` keys. Stage 2 (every step): the kept keys are summarised per chunk
of `chunk_size` slots by element-wise min / max; the query's top-r dims score the chunks
(`select.approx_bounds_scores_xla`) and the `top_k` best slots are read exactly. The budget
split is the paper's (`budget.paper_split`).

Stage 2 has variants, `RocketConfig.stage2`: small frozen objects in `methods/stage2/` (one file
each, registered by name in `STAGE2`): `MinMax()` (the paper's, above), `Rerank(factor)`,
`LowRank(page_size, rank)`, `Quant(bits, capacity, mean_value)`. The variant changes the
paper's split (`Stage2.split`), builds its decode state around the stage-1 cache
(`Stage2.prefill`: the `KVCache` itself, or a struct with summaries beside it), keeps it current
after each append and scores each decode query; this method only calls it.

`RocketConfig.skip_layers` = N (`Plan.skip_layers`): layers 0..N-1 are `dense_layers`. Their
prefill keeps every prompt token in a `KVCache` without summaries (`dense_layer_cache`, for every
stage-2 variant) and every decode step attends to all of it: an ablation that reads about
N / num_layers of the full cache per step on top of the sparse layers' read.
"""

from __future__ import annotations

import dataclasses

from rocketkv_jax._checks import require
from rocketkv_jax.attend import attend_dense_before_append
from rocketkv_jax.budget import paper_split
from rocketkv_jax.evict import evict
from rocketkv_jax.methods import stage2 as stage2_lib
from rocketkv_jax.methods.base import (Method, checked_append, dense_layer_cache,
                                       require_half_budget, require_window_budget)

STAGE2 = tuple(stage2_lib.REGISTRY)


@dataclasses.dataclass(frozen=True)
class RocketKV(Method):
  name = "rocketkv"
  summary = "stage 1 eviction to the planned capacity + hybrid sparse attention (top_k=B/2)"
  dense = False
  replan_per_turn = True
  accepts_skip_layers = True
  picks_dims = True

  @property
  def stage2_variants(self):
    return tuple(stage2_lib.REGISTRY)  # every registered variant, also one registered later

  def check_config(self, config):
    require_window_budget(config)
    require_half_budget(config)
    config.stage2.check_config(config)

  def split(self, config, prompt_len, max_new_tokens, head_dim):
    split = dict(paper_split(config, prompt_len, max_new_tokens, head_dim),
                 skip_layers=config.skip_layers)
    return dict(config.stage2.split(split, prompt_len, max_new_tokens, head_dim),
                stage2=config.stage2)

  def prefill(self, k, v, q_window, plan, *, lengths=None, impl="auto", dense=False):
    if dense:  # a skipped layer: every prompt token, no stage 1 and no stage-2 summaries
      return dense_layer_cache(k, v, plan, lengths)
    return plan.stage2.prefill(evict(k, v, q_window, plan, lengths=lengths, impl=impl), plan)

  def view(self, state):
    return stage2_lib.cache_of(state)

  def select(self, q, state, plan, *, sliding_window=None, impl="auto"):
    return plan.stage2.select(q, state, plan, sliding_window=sliding_window, impl=impl)

  def decode_step(self, q, k_new, v_new, state, plan, *, dense=False, sliding_window=None,
                  impl="auto"):
    s2 = plan.stage2
    require(dense or type(state) is s2.state_type,
            f"a stage2={s2.name!r} plan needs the state its prefill built, got {type(state)}")
    cache = self.view(state)
    new = checked_append(q, k_new, v_new, cache)
    if dense:  # read before the write: see attend_dense_before_append
      return (attend_dense_before_append(q, cache, k_new, v_new, sliding_window=sliding_window,
                                         appended=new, impl=impl), new)
    new_state = s2.after_append(state, new)
    return s2.attend(q, new_state, plan, sliding_window=sliding_window, impl=impl), new_state

  def dense_layers(self, plan):
    return tuple(range(plan.skip_layers))

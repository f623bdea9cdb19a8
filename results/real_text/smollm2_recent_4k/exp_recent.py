"""Experiment (not library code): stage 2 of the quant variant always reads the most recent R
valid slots (R = the spec's sink_size, when not the default 4), the rest by the codes' scores."""
import sys
import jax.numpy as jnp
from rocketkv_jax.methods.stage2 import quant as Q
from rocketkv_jax.cache import valid_slots
from rocketkv_jax.ops import group_sum, masked_softmax
from rocketkv_jax.select import check_query, top_scored_slots

def _select(q, state, plan, sliding_window, impl):
  cache = state.cache
  c = cache.capacity
  k = min(plan.top_k, c)
  valid = valid_slots(cache, sliding_window)
  logits = Q.slot_logits(q, state, plan.r, group_dims=plan.group_dims, impl=impl)
  p = masked_softmax(logits, valid[:, :, None, :])
  s = group_sum(p)
  if plan.sink_size != 4:
    from_end = jnp.cumsum(valid[..., ::-1].astype(jnp.int32), -1)[..., ::-1]
    s = jnp.where(valid & (from_end <= plan.sink_size), 1e9, s)
  return top_scored_slots(s, valid, k, c), p

Q._select = _select
sys.path.insert(0, "examples")  # run from the repository root
import real_text
real_text.main(sys.argv[1:])

"""rocketkv-jax: RocketKV two-stage KV-cache compression as pure JAX functions.

    import rocketkv_jax as rocketkv
    plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=256), prompt_len, new, head_dim)
    cache = rocketkv.prefill(k, v, q_window, plan)            # stage 1 (per layer)
    out, cache = rocketkv.decode_step(q, k_new, v_new, cache, plan)   # stage 2 (per token)
"""

from rocketkv_jax.attend import attend
from rocketkv_jax.cache import (KVCache, append, cache_overflow, chunk_summaries, empty_cache,
                                extend, full_cache)
from rocketkv_jax.config import METHODS, Plan, RocketConfig, plan
from rocketkv_jax.decode import decode_step, prefill
from rocketkv_jax.evict import evict
from rocketkv_jax.multiturn import MTState, begin_turn
from rocketkv_jax.select import select

__all__ = [
    "KVCache", "METHODS", "MTState", "Plan", "RocketConfig", "append", "attend", "begin_turn",
    "cache_overflow", "chunk_summaries", "decode_step", "empty_cache", "evict", "extend",
    "full_cache", "plan", "prefill", "select",
]
from rocketkv_jax.generate import generate

"""rocketkv-jax: RocketKV two-stage KV-cache compression as pure JAX functions.

    import rocketkv_jax as rocketkv
    plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=256), prompt_len, new, head_dim)
    cache = rocketkv.prefill(k, v, q_window, plan)            # stage 1 (per layer)
    out, cache = rocketkv.decode_step(q, k_new, v_new, cache, plan)   # stage 2 (per token)
"""

import os as _os


def _set_xla_cpu_flags() -> None:
  """Asks XLA:CPU for region-analysis copy insertion (set before the backend starts).

  Without it, a jitted decode step that reads a donated cache and updates it in place makes
  XLA:CPU copy whole cache buffers every step (seen in the compiled HLO: 2-6 copies of the
  summaries; a 2-4x slower step at large budgets). It only affects the CPU backend and only takes
  effect if no JAX computation ran before `import rocketkv_jax`. Opt out with
  ROCKETKV_NO_XLA_FLAGS=1; a value already in XLA_FLAGS is left alone.
  """
  name = "xla_cpu_copy_insertion_use_region_analysis"
  flags = _os.environ.get("XLA_FLAGS", "")
  if _os.environ.get("ROCKETKV_NO_XLA_FLAGS") or name in flags:
    return
  _os.environ["XLA_FLAGS"] = f"{flags} --{name}=true".strip()


_set_xla_cpu_flags()

from rocketkv_jax.attend import attend  # noqa: E402
from rocketkv_jax.cache import (KVCache, append, cache_overflow, chunk_summaries, empty_cache,
                                extend, full_cache)
from rocketkv_jax.config import METHODS, STAGE2, Plan, RocketConfig, plan
from rocketkv_jax.decode import decode_step, decoding_cache, prefill
from rocketkv_jax.evict import evict
from rocketkv_jax.multiturn import MTState, begin_turn
from rocketkv_jax.select import select
from rocketkv_jax.stage2_lowrank import LowRankState

__all__ = [
    "KVCache", "LowRankState", "METHODS", "MTState", "Plan", "RocketConfig", "STAGE2", "append",
    "attend", "begin_turn", "cache_overflow", "chunk_summaries", "decode_step", "decoding_cache",
    "empty_cache", "evict", "extend", "full_cache", "generate", "plan", "prefill", "select",
]
from rocketkv_jax.generate import generate

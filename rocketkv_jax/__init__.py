"""rocketkv-jax: RocketKV two-stage KV-cache compression as pure JAX functions.

    import rocketkv_jax as rocketkv
    plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=256), prompt_len, new, head_dim)
    q_window = rocketkv.last_valid_window(q, lengths, plan.window_size)  # [B, Hq, W, D]
    cache = rocketkv.prefill(k, v, q_window, plan, lengths=lengths)      # stage 1 (per layer)
    out, cache = rocketkv.decode_step(q, k_new, v_new, cache, plan)   # stage 2 (per token)

Every state (`KVCache`, `QuantState`, `MTState`, ...) answers `length`, `seen`, `overflow` and
`nbytes` (`State`), whatever the method and stage-2 variant. `debug=True` on `prefill` /
`decode_step`, under `checked(fn)`, turns a NaN / Inf input or a cache overflow into an error.

The methods (`METHODS`) live in rocketkv_jax/methods/, one file each.
"""

from rocketkv_jax import xla_flags as _xla_flags

_xla_flags.set_cpu_flags()  # before anything below imports JAX

# Submodules first, then the names that shadow them (`select`, `generate` are both).
from rocketkv_jax.attend import attend  # noqa: E402
from rocketkv_jax.cache import (KVCache, State, append, cache_overflow,  # noqa: E402
                                chunk_summaries, empty_cache, extend, full_cache)
from rocketkv_jax.config import (GROUP_DIMS, METHODS, RECOMMENDED, STAGE2,  # noqa: E402
                                 WINDOW_REDUCE, Plan, RocketConfig, plan)
from rocketkv_jax.decode import (checked, decode_step, last_valid_window, prefill,  # noqa: E402
                                 select)
from rocketkv_jax.evict import evict  # noqa: E402
from rocketkv_jax.export import export_decode_step, export_function  # noqa: E402
from rocketkv_jax.multiturn import MTState, begin_turn  # noqa: E402
from rocketkv_jax.methods.stage2 import LowRank, MinMax, Quant, Rerank, Stage2  # noqa: E402
from rocketkv_jax.methods.stage2.lowrank import LowRankState  # noqa: E402
from rocketkv_jax.methods.stage2.quant import QuantState  # noqa: E402
from rocketkv_jax.runtime.generate import GenerationResult, generate  # noqa: E402
from rocketkv_jax.runtime.conversation import Conversation  # noqa: E402
from rocketkv_jax.runtime.teacher_forced import ContinuationScores, score_continuations  # noqa: E402
from rocketkv_jax.runtime import sampling  # noqa: E402  (rocketkv.sampling.TopK, ...)

__all__ = [
    "ContinuationScores", "Conversation", "GROUP_DIMS", "GenerationResult", "KVCache", "LowRank", "LowRankState",
    "METHODS", "MTState", "MinMax", "Plan", "Quant", "QuantState", "RECOMMENDED", "Rerank",
    "RocketConfig",
    "STAGE2", "Stage2", "State", "WINDOW_REDUCE", "append", "attend",
    "begin_turn", "cache_overflow", "checked", "chunk_summaries",
    "decode_step", "empty_cache", "evict", "export_decode_step", "export_function",
    "extend", "full_cache", "generate", "last_valid_window",
    "plan", "prefill",
    "sampling", "score_continuations", "select",
]

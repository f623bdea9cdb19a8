"""RocketKV's decode-time select + attend, fused on a GPU.

`select_attend(q, cache, plan)` = `MinMax.select` then `attend` (the paper's stage 2);
`quant_attend(q, state, plan)` = `methods/stage2/quant.decode_attend` (stage2="quant"). Under
`impl="auto"` on CUDA and `impl="pallas"` it runs the two kernels of
`kernels/fused_decode.py` (chunk scores; selection + attention) instead of the chain of small
ops around the two unfused kernels; `impl="xla"` and every other platform under "auto" run the
XLA chain. Caches the fused kernels do not take (a sliding window, a head dim that is not a
power of two >= 16; for "quant" also `mean_value`) run the unfused chain with the same `impl`.
"""

from __future__ import annotations

import jax

from rocketkv_jax import _impl
from rocketkv_jax.attend import attend
from rocketkv_jax.cache import KVCache
from rocketkv_jax.select import check_chunks, check_query


def _fusable(head_dim: int) -> bool:
  """The fused kernels hold whole K / V rows as Triton tensors: a power of two >= 16."""
  return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def select_attend(q: jax.Array, cache: KVCache, plan, *, sliding_window: int | None = None,
                  impl: str = "auto") -> jax.Array:
  """Attention of `q [B, Hq, D]` over the `plan.top_k` slots of `cache` (already holding the
  query's token) that RocketKV's approximate chunk scores pick. Returns [B, Hq, D] in q's
  dtype."""
  from rocketkv_jax.methods.stage2.minmax import MinMax  # MinMax.attend calls this module

  check_query(q, cache)
  check_chunks(cache, plan.chunk_size)
  _impl.check(impl)

  def chain(which):
    idx = MinMax().select(q, cache, plan, sliding_window=sliding_window, impl=which)
    return attend(q, cache, idx, sliding_window=sliding_window, impl=which)

  if impl == "xla" or sliding_window is not None or not _fusable(cache.k.shape[-1]):
    return chain(impl)

  def pallas(interpret):
    from rocketkv_jax.kernels import fused_decode  # imported on first use (Pallas is heavy)
    return fused_decode.fused_select_attend(
        q, cache.k, cache.v, cache.bounds, cache.length, chunk_size=cache.chunk_size, r=plan.r,
        top_k=min(plan.top_k, cache.capacity), group_dims=plan.group_dims, interpret=interpret)

  return _impl.dispatch(impl, lambda: chain("xla"), pallas)


def quant_attend(q: jax.Array, state, plan, *, sliding_window: int | None = None,
                 impl: str = "auto") -> jax.Array:
  """`quant.decode_attend(q, state, plan)` (state: the `QuantState` after the step's append), as
  two kernels where `impl` and the state allow. Returns [B, Hq, D] in q's dtype."""
  from rocketkv_jax.methods.stage2 import quant  # Quant.attend calls this module

  _impl.check(impl)

  def chain(which):
    return quant.decode_attend(q, state, plan, sliding_window=sliding_window, impl=which)

  cache = state.cache
  if (impl == "xla" or sliding_window is not None or plan.stage2.mean_value
      or not _fusable(cache.k.shape[-1])):
    return chain(impl)
  check_query(q, cache)

  def pallas(interpret):
    from rocketkv_jax.kernels import fused_decode  # imported on first use (Pallas is heavy)
    return fused_decode.fused_quant_attend(
        q, cache.k, cache.v, state.codes, state.step, cache.length, r=plan.r, bits=state.bits,
        top_k=min(plan.top_k, cache.capacity), group_dims=plan.group_dims, interpret=interpret)

  return _impl.dispatch(impl, lambda: chain("xla"), pallas)

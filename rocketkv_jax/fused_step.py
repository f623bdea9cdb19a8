"""RocketKV's decode-time select + attend, fused on a GPU: a building block of the stage-2
variants.

`select_attend(q, cache, plan, chain)` serves `MinMax.attend` (the paper's stage 2) and
`quant_attend(q, state, plan, chain)` serves `Quant.attend` (stage2="quant"); `chain(impl)` is
the variant's own unfused select-then-attend. Under `impl="auto"` or `"pallas"` on CUDA, and
`impl="interpret"`, they run the two kernels of `kernels/fused_decode.py` (chunk scores;
selection + attention) instead of the chain; on TPU the chain runs with the TPU kernels
(`_impl`); `impl="xla"` and every other platform under "auto" run the XLA chain.
Caches the fused kernels do not take (a sliding window, a head dim that is not a power of two
>= 16) run the chain with the same `impl`; so does a paged cache (the chain's paged kernels,
kernels/paged_*.py).
"""

from __future__ import annotations

from typing import Callable

import jax

from rocketkv_jax import _impl
from rocketkv_jax.cache import KVCache
from rocketkv_jax.select import check_chunks, check_query


def _fusable(head_dim: int) -> bool:
  """The fused kernels hold whole K / V rows as Triton tensors: a power of two >= 16."""
  return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def select_attend(q: jax.Array, cache: KVCache, plan, chain: Callable[[str], jax.Array], *,
                  sliding_window: int | None = None, impl: str = "auto") -> jax.Array:
  """Attention of `q [B, Hq, D]` over the `plan.top_k` slots of `cache` (already holding the
  query's token) that RocketKV's approximate chunk scores pick; `chain(impl)` computes the same
  unfused. Returns [B, Hq, D] in q's dtype."""
  check_query(q, cache)
  check_chunks(cache, plan.chunk_size)
  _impl.check(impl)
  if cache.paged:
    return chain(_impl.for_pages(impl))
  if impl == "xla" or sliding_window is not None or not _fusable(cache.k.shape[-1]):
    return chain(impl)

  def pallas(interpret):
    from rocketkv_jax.kernels import fused_decode  # imported on first use (Pallas is heavy)
    return fused_decode.fused_select_attend(
        q, cache.k, cache.v, cache.bounds, cache.length, chunk_size=cache.chunk_size, r=plan.r,
        top_k=min(plan.top_k, cache.capacity), group_dims=plan.group_dims, interpret=interpret)

  return _impl.dispatch(impl, lambda: chain("xla"), pallas,
                        tpu=lambda interpret: chain("interpret_tpu" if interpret else _impl.TPU))


def quant_attend(q: jax.Array, state, plan, chain: Callable[[str], jax.Array], *,
                 sliding_window: int | None = None, impl: str = "auto") -> jax.Array:
  """Attention of `q` over the `plan.top_k` slots the key codes of `state` (a `QuantState` after
  the step's append) pick; `chain(impl)` computes the same unfused. Returns [B, Hq, D] in q's
  dtype."""
  _impl.check(impl)
  cache = state.cache
  if cache.paged:
    return chain(_impl.for_pages(impl))
  if impl == "xla" or sliding_window is not None or not _fusable(cache.k.shape[-1]):
    return chain(impl)
  check_query(q, cache)

  def pallas(interpret):
    from rocketkv_jax.kernels import fused_decode  # imported on first use (Pallas is heavy)
    return fused_decode.fused_quant_attend(
        q, cache.k, cache.v, state.codes, state.step, cache.length, r=plan.r, bits=state.bits,
        top_k=min(plan.top_k, cache.capacity), group_dims=plan.group_dims, interpret=interpret)

  return _impl.dispatch(impl, lambda: chain("xla"), pallas,
                        tpu=lambda interpret: chain("interpret_tpu" if interpret else _impl.TPU))

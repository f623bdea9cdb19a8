"""Exact softmax attention of one decode query over selected cache slots (fp32 accumulation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax import lax

from rocketkv_jax import _impl, pages
from rocketkv_jax._checks import require, require_layout, require_rank
from rocketkv_jax.cache import KVCache, from_storage, valid_slots
from rocketkv_jax.ops import gather_rows, group_queries
from rocketkv_jax.select import check_query


def _softmax_combine(qg, k, v, valid, k_extra=None, v_extra=None):
  """qg [B, Hkv, G, D], k/v [B, Hkv, K, D], valid [B, Hkv, K] -> [B, Hkv, G, D] float32.

  `k_extra, v_extra [B, Hkv, 1, D]`: one more (always valid) key / value, attended together
  with the others without concatenating it into k / v.
  """
  scale = _scale(qg)
  extra = None if k_extra is None else _dot(k_extra, qg.astype(k_extra.dtype)) * scale
  return softmax_combine(_dot(k, qg.astype(k.dtype)) * scale, valid, v, extra, v_extra)


def _scale(qg):
  return 1.0 / jnp.sqrt(jnp.float32(qg.shape[-1]))


def _dot(k, q):
  """k [B, Hkv, K, D] x q [B, Hkv, G, D] -> [B, Hkv, G, K] float32, multiplied in [K, G] order
  (the layout XLA:CPU multiplies fastest)."""
  out = jnp.einsum("bhkd,bhgd->bhkg", k, q, preferred_element_type=jnp.float32)
  return jnp.swapaxes(out, -1, -2)


def _paged_softmax_combine(qg, cache: KVCache, valid, k_extra=None, v_extra=None):
  """`_softmax_combine` over every slot of a paged cache: qg [B, Hkv, G, D], valid
  [B, Hkv, NP * P] -> [B, Hkv, G, D] float32.

  Two exact ways, picked on the device: when no page holds valid slots of two sequences and the
  pool `[N, Hkv, P, D]` is small next to the pages the batch fills, every page of the pool is
  read in place against the query of the sequence that owns it (the queries move to the pages,
  not the pages to the queries); otherwise one page of each sequence at a time, gathered.
  """
  b, npg, n = qg.shape[0], cache.table.shape[-1], cache.k_raw.shape[0]
  p_size = cache.page_size
  live = valid.reshape(b, valid.shape[1], npg, p_size).any(axis=(1, 3))  # [B, NP]
  owner, single = pages.owners(cache.table, live, n)
  # Only the pages some sequence of the batch fills: short requests read less than C.
  used = jnp.minimum((jnp.max(cache.length) + p_size - 1) // p_size, npg)
  in_place = single & (n <= pages.POOL_READ_RATIO * used * b)
  args = (qg, cache, valid, live, owner, used, k_extra, v_extra)
  return lax.cond(in_place, _pool_order_combine, _page_loop_combine, *args)


def _pool_order_combine(qg, cache: KVCache, valid, live, owner, used, k_extra, v_extra):
  """Every page of the pool against its owner's query: logits `[N, Hkv, P, G]` read in place,
  then moved to the sequences' order through the table (G values a slot, not D)."""
  del used
  b, hkv, g, _ = qg.shape
  p_size, npg, n = cache.page_size, cache.table.shape[-1], cache.k_raw.shape[0]
  scale = _scale(qg)
  q_pool = qg.astype(cache.dtype)[owner]  # [N, Hkv, G, D]
  k_pool, v_pool = (from_storage(x, cache.dtype) for x in (cache.k_raw, cache.v_raw))
  # [N, Hkv, P, G]: the [K, G] order XLA:CPU multiplies fastest (`_dot`), moved after the gather
  lg = jnp.einsum("nhpd,nhgd->nhpg", k_pool, q_pool, preferred_element_type=jnp.float32)
  lg = jnp.transpose(lg[cache.table], (0, 2, 4, 1, 3))  # [B, Hkv, G, NP, P]
  logits = lg.reshape(b, hkv, g, npg * p_size) * scale
  extra = None if k_extra is None else _dot(k_extra, qg.astype(k_extra.dtype)) * scale
  target = jnp.where(live, cache.table, n)  # the live entries; n: dropped

  def pv(p):
    p = jnp.transpose(p.reshape(b, hkv, g, npg, p_size), (0, 3, 1, 2, 4))  # [B, NP, Hkv, G, P]
    p_pool = jnp.zeros((n, hkv, g, p_size), v_pool.dtype).at[target].set(
        p.astype(v_pool.dtype), mode="drop")
    out = jnp.einsum("nhgp,nhpd->nhgd", p_pool, v_pool, preferred_element_type=jnp.float32)
    out = jnp.where(live[:, :, None, None, None], out[cache.table], 0.0)  # [B, NP, Hkv, G, D]
    return jnp.sum(out, axis=1)

  return softmax_combine(logits, valid, None, extra, v_extra, pv=pv)


def _page_loop_combine(qg, cache: KVCache, valid, live, owner, used, k_extra, v_extra):
  """One page of each sequence at a time (a loop over the page-table columns that hold a valid
  slot of some sequence): no gather of the whole cache. The logits of every slot are the
  contiguous path's, then its softmax; the values are summed page by page."""
  del live, owner
  b, hkv, g, _ = qg.shape
  p_size, npg = cache.page_size, cache.table.shape[-1]
  page = lambda raw, j: from_storage(raw[cache.table[:, j]], cache.dtype)  # [B, Hkv, P, D]
  qc, scale = qg.astype(cache.dtype), _scale(qg)

  def logits_of(j, acc):
    return lax.dynamic_update_slice_in_dim(acc, _dot(page(cache.k_raw, j), qc) * scale,
                                           j * p_size, axis=3)

  logits = lax.fori_loop(0, used, logits_of, jnp.zeros((b, hkv, g, npg * p_size), jnp.float32))
  extra = None if k_extra is None else _dot(k_extra, qg.astype(k_extra.dtype)) * scale

  def pv(p):
    def add(j, acc):
      pj = lax.dynamic_slice_in_dim(p, j * p_size, p_size, axis=3)
      vj = page(cache.v_raw, j)
      return acc + jnp.einsum("bhgk,bhkd->bhgd", pj.astype(vj.dtype), vj,
                              preferred_element_type=jnp.float32)
    return lax.fori_loop(0, used, add, jnp.zeros((b, hkv, g, qg.shape[-1]), jnp.float32))

  return softmax_combine(logits, valid, None, extra, v_extra, pv=pv)


def softmax_combine(logits, valid, v, extra=None, v_extra=None, pv=None):
  """Softmax attention from its logits: the one softmax-and-values step of every decode attention.

  logits [B, Hkv, G, K] float32 (scaled), valid [B, Hkv, K], v [B, Hkv, K, D] -> [B, Hkv, G, D]
  float32. `extra [B, Hkv, G, 1]`, `v_extra [B, Hkv, 1, D]`: one more, always valid, logit and
  value. Masking as `ops.masked_softmax` (-inf; a row with nothing valid gives 0); the weights
  are normalised after the product with v (one pass over the unnormalised weights). `pv(p)`:
  that product, where v is None (a paged cache's).
  """
  logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
  mx = jnp.max(logits, axis=-1, keepdims=True)
  if extra is not None:
    mx = jnp.maximum(mx, extra)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  p = jnp.exp(logits - mx)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  if pv is None:
    out = jnp.einsum("bhgk,bhkd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  else:
    out = pv(p)
  if extra is not None:
    p_extra = jnp.exp(extra - mx)
    denom = denom + p_extra
    out = out + p_extra * v_extra[:, :, 0][:, :, None, :].astype(jnp.float32)
  return out / jnp.maximum(denom, 1e-30)


def sparse_attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, idx: jax.Array,
                         valid: jax.Array) -> jax.Array:
  """Attention over gathered rows.

  Args:
    q: [B, Hq, D]; k, v: [B, Hkv, C, D]; idx: [B, Hkv, K] int32 slots; valid: [B, Hkv, K] bool.
  Returns:
    [B, Hq, D] in q's dtype (accumulated in float32); zeros where no slot is valid.
  """
  # The gathered rows are converted to float32 as they are gathered (one fused op): the two
  # small products then run in f32, XLA:CPU's faster form (docs/cpu_performance.md), and the
  # probabilities stay in f32.
  return _attend_rows(q, gather_rows(k, idx), gather_rows(v, idx), valid)


def _attend_rows(q, k_sel, v_sel, valid):
  """q [B, Hq, D] over its KV heads' rows k_sel, v_sel [B, Hkv, K, D] (valid [B, Hkv, K])."""
  k_sel, v_sel = k_sel.astype(jnp.float32), v_sel.astype(jnp.float32)
  out = _softmax_combine(group_queries(q, k_sel.shape[1]).astype(jnp.float32), k_sel, v_sel,
                         valid)
  return out.reshape(q.shape).astype(q.dtype)


def paged_sparse_attention_xla(q: jax.Array, cache: KVCache, idx: jax.Array,
                               valid: jax.Array) -> jax.Array:
  """`sparse_attention_xla` on a paged cache: the rows `idx [B, Hkv, K]` (in range) read
  straight from their pages (no gather of the whole sequence)."""
  rows = lambda raw: from_storage(pages.gather_slots(raw, cache.table, idx, cache.page_size),
                                  cache.dtype)
  return _attend_rows(q, rows(cache.k_raw), rows(cache.v_raw), valid)


def dense_attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array) -> jax.Array:
  """Dense decode attention over every slot: q [B, Hq, D], k/v [B, Hkv, C, D], valid
  [B, Hkv, C] -> [B, Hq, D]. GQA without repeating K/V; fp32 accumulation."""
  out = _softmax_combine(group_queries(q, k.shape[1]), k, v, valid)
  return out.reshape(q.shape).astype(q.dtype)


def attend_dense_before_append(q: jax.Array, cache: KVCache, k_new: jax.Array,
                               v_new: jax.Array, *, sliding_window: int | None = None,
                               appended: KVCache | None = None, impl: str = "xla"
                               ) -> jax.Array:
  """Dense attention of the token about to be appended: over the valid slots of `cache` (as it
  is before `append(cache, k_new, v_new)`) plus the new token itself.

  Same numbers as `attend(q, append(cache, k_new, v_new))`, but it reads the cache before the
  append writes it, so a jitted step updates a donated cache in place (XLA:CPU otherwise copies
  every K/V buffer each step). Returns [B, Hq, D] in q's dtype.

  A paged cache given `appended` (the cache after that append) and a kernel `impl` reads
  `appended`'s every slot with the paged attention kernel on CUDA / TPU (one pass over each
  sequence's pages, through its table); the XLA path stays the read before the append.
  """
  if cache.paged and appended is not None and impl != "xla":
    return _impl.dispatch(
        _impl.for_pages(impl),
        lambda: attend_dense_before_append(q, cache, k_new, v_new,
                                           sliding_window=sliding_window),
        lambda interpret: _paged_dense_kernel(q, appended, sliding_window, False, interpret),
        tpu=lambda interpret: _paged_dense_kernel(q, appended, sliding_window, True, interpret))
  check_query(q, cache)
  c = cache.capacity
  slot = jnp.arange(c)
  valid = slot < cache.length[:, None]
  valid = valid & ~((cache.length[:, None] >= c) & (slot == c - 1))  # full: slot overwritten
  valid = jnp.broadcast_to(valid[:, None, :], cache.pos.shape)
  if sliding_window is not None:
    valid = valid & (cache.seen[:, None, None] - cache.pos < sliding_window)
  qg = group_queries(q, cache.k_raw.shape[1])
  if cache.paged:
    out = _paged_softmax_combine(qg, cache, valid, k_new, v_new)
  else:
    out = _softmax_combine(qg, cache.k, cache.v, valid, k_new, v_new)
  return out.reshape(q.shape).astype(q.dtype)


def _paged_dense_kernel(q, cache: KVCache, sliding_window, tpu: bool, interpret: bool):
  """Every slot of paged `cache`, `[B, Hkv, NP * P]`, through the paged sparse-attention
  kernel (`kernels.paged_sparse_attention`, or its TPU twin, which copies only the pages that
  hold a valid slot)."""
  from rocketkv_jax import kernels  # imported on first use (Pallas is a heavy import)
  b, hkv = cache.table.shape[0], cache.k_raw.shape[1]
  idx = jnp.broadcast_to(jnp.arange(cache.capacity, dtype=jnp.int32),
                         (b, hkv, cache.capacity))
  k_pages, v_pages = (from_storage(x, cache.dtype) for x in (cache.k_raw, cache.v_raw))
  fn = kernels.tpu_paged_sparse_attention if tpu else kernels.paged_sparse_attention
  return fn(q, k_pages, v_pages, cache.table, idx, valid_slots(cache, sliding_window),
            page_size=cache.page_size, interpret=interpret)


def attend(q: jax.Array, cache: KVCache, idx: jax.Array | None = None, *,
           sliding_window: int | None = None, impl: str = "auto") -> jax.Array:
  """Exact attention of `q [B, Hq, D]` over the slots `idx [B, Hkv, K]` of `cache`.

  Slots that are not valid (past `length`, or outside `sliding_window`) are masked, so `idx`
  may point anywhere (out-of-range entries are masked too); it must not repeat a valid slot.
  `idx=None` attends to every valid slot (dense).
  Returns [B, Hq, D] in q's dtype, softmax scale 1/sqrt(D), fp32 accumulation whatever the
  cache dtype.
  """
  check_query(q, cache)
  if idx is None and cache.paged:
    out = _paged_softmax_combine(group_queries(q, cache.k_raw.shape[1]), cache,
                                 valid_slots(cache, sliding_window))
    return out.reshape(q.shape).astype(q.dtype)
  if idx is None:
    return dense_attention_xla(q, cache.k, cache.v, valid_slots(cache, sliding_window))
  require_rank("idx", idx, 3, "[B, Hkv, K]")
  bh = tuple(cache.k.shape[:2])
  require_layout(idx.shape[:2] == bh or (idx.shape[0], idx.shape[2]) != bh, "idx", "[B, Hkv, K]",
                 idx.shape, "[B, K, Hkv]", "transpose with idx.transpose(0, 2, 1)")
  require(idx.shape[:2] == cache.k.shape[:2],
          f"idx must have shape [B, Hkv, K] with [B, Hkv]={cache.k.shape[:2]}, got {idx.shape}")
  require(jnp.issubdtype(idx.dtype, jnp.integer), f"idx must be integer, got {idx.dtype}")
  clipped = jnp.clip(idx, 0, cache.capacity - 1).astype(jnp.int32)
  if sliding_window is None:  # the valid slots are the prefix [0, length): no gather needed
    sel_valid = (idx >= 0) & (idx < cache.length[:, None, None])
  else:
    sel_valid = (jnp.take_along_axis(valid_slots(cache, sliding_window), clipped, axis=2)
                 & (idx >= 0) & (idx < cache.capacity))
  idx = clipped
  if cache.paged:  # the rows read through the page table (kernels/paged_sparse_attention.py)
    impl = _impl.for_pages(impl)
    k_pages, v_pages = (from_storage(x, cache.dtype) for x in (cache.k_raw, cache.v_raw))
    return _impl.dispatch(impl, lambda: paged_sparse_attention_xla(q, cache, idx, sel_valid),
                          "paged_sparse_attention", q, k_pages, v_pages, cache.table, idx,
                          sel_valid, page_size=cache.page_size,
                          tpu="tpu_paged_sparse_attention")
  return _impl.dispatch(impl, lambda: sparse_attention_xla(q, cache.k, cache.v, idx, sel_valid),
                        "sparse_attention", q, cache.k, cache.v, idx, sel_valid,
                        tpu="tpu_sparse_attention")

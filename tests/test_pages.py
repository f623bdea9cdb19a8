"""Paged caches (rocketkv_jax/pages.py, `KVCache.table`) against contiguous ones and NumPy.

A contiguous cache is written into pages in a scrambled order (`paged_pool`'s write); its
logical views, its appends and every stage-2 read must then give the contiguous cache's numbers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rocketkv_jax import pages
from rocketkv_jax.attend import attend, attend_dense_before_append
from rocketkv_jax.budget import Plan
from rocketkv_jax.cache import append, full_cache
from rocketkv_jax.methods.stage2 import quant
from rocketkv_jax.ops import coded_query, group_queries
from rocketkv_jax.runtime import paged_pool
from rocketkv_jax.select import approx_scores, paged_approx_scores_xla

B, H, D, C, P = 2, 2, 8, 40, 6


def test_logical_view_is_numpy_gather():
  rng = np.random.default_rng(0)
  buf = rng.normal(size=(7, H, P, D)).astype(np.float32)
  table = np.array([[3, 1, 6], [0, 2, 5]])
  want = np.stack([np.concatenate([buf[t] for t in row], axis=1) for row in table])
  np.testing.assert_array_equal(np.asarray(pages.logical(jnp.asarray(buf), jnp.asarray(table))),
                                want)
  idx = rng.integers(0, 3 * P, size=(B, H, 5))
  got = pages.gather_slots(jnp.asarray(buf), jnp.asarray(table), jnp.asarray(idx), P)
  np.testing.assert_array_equal(np.asarray(got),
                                np.take_along_axis(want, idx[..., None], axis=2))
  rows = rng.integers(0, P, size=(B, H, 2))
  got = pages.gather_cols(jnp.asarray(buf), jnp.asarray(table), jnp.asarray(rows))
  cols = np.stack([np.concatenate([buf[t] for t in row], axis=-1) for row in table])  # [B,H,P,NP*D]
  np.testing.assert_array_equal(np.asarray(got), np.take_along_axis(cols, rows[..., None], axis=2))


def _paged(cache, num_pages, seed=0):
  """`cache` (contiguous, batch B) in a pool of `num_pages` pages, rows in scrambled pages."""
  flat = getattr(cache, "cache", cache)
  p = P * 3 if flat.chunk_size == 3 else P
  npg = -(-flat.capacity // p)
  row = jax.tree.map(lambda x: x[:1], cache)
  pool = paged_pool._empty(row, B, num_pages, p, npg)
  ids = np.random.default_rng(seed).permutation(np.arange(1, num_pages))[:B * npg]
  for b in range(B):
    one = jax.tree.map(lambda x, b=b: x[b:b + 1], cache)
    pool = paged_pool._write(pool, one, b, jnp.asarray(ids[b * npg:(b + 1) * npg], jnp.int32))
  return pool


def _kv(seed=0, lengths=(23, 27)):
  rng = np.random.default_rng(seed)
  k = jnp.asarray(rng.normal(size=(B, H, 32, D)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(B, H, 32, D)), jnp.float32)
  return k, v, jnp.asarray(lengths, jnp.int32)


def _hand_paged(k_pages, v_pages, ids, lengths):
  """A paged full-KV cache over pages `k_pages, v_pages [N, H, P, D]` with table `ids [B, NP]`."""
  (b, npg), (n, _, p, _) = ids.shape, k_pages.shape
  cache = full_cache(jnp.zeros((b, H, npg * p, D)), jnp.zeros((b, H, npg * p, D)), npg * p, 0,
                     jnp.asarray(lengths, jnp.int32))
  return cache.replace(k_raw=jnp.asarray(k_pages, jnp.float32),
                       v_raw=jnp.asarray(v_pages, jnp.float32),
                       pos_raw=jnp.zeros((n, H, p), jnp.int32),
                       table=jnp.asarray(ids, jnp.int32), page_size=p)


def _paged_case(case, rng, npg, lengths):
  """A page table for `case`: pages of a 13-page pool (64 for "large_pool") in scrambled order;
  "shared_page": two sequences read one page; "stale_entries": entries past a sequence's length
  point at another's pages."""
  num_pages = {"large_pool": 64}.get(case, 13)
  ids = rng.permutation(np.arange(1, num_pages))[:len(lengths) * npg].reshape(len(lengths), npg)
  if case == "shared_page":
    ids[1, 0] = ids[0, 1]
  if case == "stale_entries":
    ids[1, 2:] = ids[0, :2]
  return num_pages, ids


@pytest.mark.parametrize("chunk_size", [0, 1, 3])
def test_appends_and_reads_match_contiguous(chunk_size):
  k, v, lengths = _kv()
  flat = full_cache(k, v, C, chunk_size, lengths)
  paged = _paged(flat, num_pages=16)
  assert paged.paged and paged.capacity >= C
  rng = np.random.default_rng(1)
  for _ in range(12):  # crosses page boundaries
    kn = jnp.asarray(rng.normal(size=(B, H, 1, D)), jnp.float32)
    vn = jnp.asarray(rng.normal(size=(B, H, 1, D)), jnp.float32)
    q = jnp.asarray(rng.normal(size=(B, 2 * H, D)), jnp.float32)
    np.testing.assert_allclose(attend_dense_before_append(q, paged, kn, vn),
                               attend_dense_before_append(q, flat, kn, vn), rtol=1e-6, atol=1e-6)
    flat, paged = append(flat, kn, vn), jax.jit(append)(paged, kn, vn)
  np.testing.assert_array_equal(paged.length, flat.length)
  np.testing.assert_array_equal(np.asarray(paged.k)[:, :, :C], np.asarray(flat.k))
  np.testing.assert_array_equal(np.asarray(paged.v)[:, :, :C], np.asarray(flat.v))
  if chunk_size:
    nc = flat.num_chunks
    np.testing.assert_array_equal(np.asarray(paged.bounds)[..., :nc], np.asarray(flat.bounds))
    q = jnp.asarray(rng.normal(size=(B, 2 * H, D)), jnp.float32)
    np.testing.assert_allclose(np.asarray(approx_scores(q, paged, 4))[..., :nc],
                               approx_scores(q, flat, 4), rtol=1e-6)
  idx = jnp.asarray(rng.integers(0, C, size=(B, H, 9)), jnp.int32)
  q = jnp.asarray(rng.normal(size=(B, 2 * H, D)), jnp.float32)
  np.testing.assert_allclose(attend(q, paged, idx), attend(q, flat, idx), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(attend(q, paged), attend(q, flat), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(attend(q, paged, idx, impl="interpret"), attend(q, flat, idx),
                             rtol=1e-6, atol=1e-6)  # the paged kernel (test_paged_kernels.py)


def test_quant_codes_in_pages_match_contiguous():
  k, v, lengths = _kv(2)
  plan = Plan(method="rocketkv", capacity=C, prompt_budget=32, top_k=8, chunk_size=0, r=4,
              window_size=4, kernel_size=1, sink_size=0, head_dim=D, prompt_len=32,
              max_new_tokens=8, token_budget=16, stage2=quant.Quant())
  flat = quant.build(full_cache(k, v, C, 0, lengths), plan)
  paged = _paged(flat, num_pages=16)
  rng = np.random.default_rng(3)
  for _ in range(8):
    kn = jnp.asarray(rng.normal(size=(B, H, 1, D)), jnp.float32)
    vn = jnp.asarray(rng.normal(size=(B, H, 1, D)), jnp.float32)
    flat = quant.append_codes(flat, append(flat.cache, kn, vn))
    paged = quant.append_codes(paged, append(paged.cache, kn, vn))
    q = jnp.asarray(rng.normal(size=(B, 2 * H, D)), jnp.float32)
    np.testing.assert_allclose(np.asarray(quant.slot_logits(q, paged, 4))[..., :C],
                               quant.slot_logits(q, flat, 4), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(quant.decode_attend(q, paged, plan),
                               quant.decode_attend(q, flat, plan), rtol=1e-6, atol=1e-6)


def _dense_f64(q, k, v, lengths):
  """NumPy float64 dense decode attention: q [B, Hq, D] over k, v [B, Hkv, C, D]'s first
  `lengths` slots."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, hq, d = q.shape
  hkv = k.shape[1]
  out = np.zeros((b, hq, d))
  for i in range(b):
    for h in range(hq):
      kh, vh = k[i, h // (hq // hkv), :lengths[i]], v[i, h // (hq // hkv), :lengths[i]]
      s = kh @ q[i, h] / np.sqrt(d)
      w = np.exp(s - s.max())
      out[i, h] = w @ vh / w.sum()
  return out


@pytest.mark.parametrize("case", ["pool_read_in_place", "large_pool", "shared_page",
                                  "stale_entries"])
def test_dense_attention_through_pages_is_numpy(case):
  """Dense attention of a paged cache is the NumPy attention of its logical slots, both when
  the pool is read in place against each page's owner (a small pool) and page by page (a pool
  much larger than the batch's pages, or a page two sequences read); table entries past a
  sequence's length may point at any page, another sequence's included."""
  rng = np.random.default_rng(7)
  npg, lengths = 4, np.array([20, 9, 13])  # P = 6: 4, 2 and 3 pages in use
  num_pages, ids = _paged_case(case, rng, npg, lengths)
  b = len(lengths)
  k_pages = rng.normal(size=(num_pages, H, P, D)).astype(np.float32)
  v_pages = rng.normal(size=(num_pages, H, P, D)).astype(np.float32)
  cache = _hand_paged(k_pages, v_pages, ids, lengths)
  logical_k = np.stack([np.concatenate([k_pages[t] for t in row], axis=1) for row in ids])
  logical_v = np.stack([np.concatenate([v_pages[t] for t in row], axis=1) for row in ids])
  q = rng.normal(size=(b, 2 * H, D)).astype(np.float32)
  want = _dense_f64(q, logical_k, logical_v, lengths)
  np.testing.assert_allclose(jax.jit(attend)(jnp.asarray(q), cache), want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("case", ["pool_read_in_place", "large_pool", "shared_page",
                                  "stale_entries"])
def test_quant_code_pages_read_is_numpy(case):
  """The 4-bit codes of a paged state scored on the query's r dims are the NumPy float64
  sums over those dims of each valid slot's code (slot i of a page: byte i % W of plane i // W),
  whether the pool is read in place or through the table."""
  rng = np.random.default_rng(11)
  npg, lengths, bits, r = 4, np.array([20, 9, 13]), 4, 3
  w = P // 2
  num_pages, ids = _paged_case(case, rng, npg, lengths)
  b = len(lengths)
  codes = rng.integers(0, 256, size=(num_pages, H, D, w), dtype=np.uint8)
  zeros = np.zeros((num_pages, H, P, D))
  cache = _hand_paged(zeros, zeros, ids, lengths)
  step = jnp.asarray(rng.uniform(0.5, 2.0, size=(b, H, D)), jnp.float32)
  state = quant.QuantState(cache=cache, codes=jnp.asarray(codes), lo=jnp.zeros((b, H, D)),
                           step=step, bits=bits)
  q = jnp.asarray(rng.normal(size=(b, 2 * H, D)), jnp.float32)
  got = np.asarray(jax.jit(quant.slot_logits_xla, static_argnums=2)(q, state, r))
  ridx, qs = (np.asarray(x, np.float64) for x in
              coded_query(group_queries(q, H).astype(jnp.float32), step, r))
  for i in range(b):
    for s in range(lengths[i]):
      page, at = ids[i, s // P], s % P
      code = (codes[page, :, :, at % w] >> (bits * (at // w))) & 15  # [H, D]
      for h in range(H):
        want = qs[i, h] @ code[h, ridx[i, h].astype(int)].astype(np.float64)  # [G]
        np.testing.assert_allclose(got[i, h, :, s], want, rtol=1e-5, atol=1e-5)


def test_pool_order_and_table_reads_are_bitwise_equal(monkeypatch):
  """The in-place pool read and the read through the table give the same bits, so a request's
  tokens do not depend on which one the batch around it picks (the engine's alone-or-among-
  others guarantee and its preemption replay)."""
  rng = np.random.default_rng(5)
  npg, lengths, p = 5, np.array([60, 33, 49]), 16
  num_pages, ids = 17, rng.permutation(np.arange(1, 17))[:15].reshape(3, npg)
  b = len(lengths)
  cache = _hand_paged(rng.normal(size=(num_pages, H, p, D)), rng.normal(size=(num_pages, H, p, D)),
                      ids, lengths)
  codes = jnp.asarray(rng.integers(0, 256, size=(num_pages, H, D, p // 2), dtype=np.uint8))
  state = quant.QuantState(cache=cache, codes=codes, lo=jnp.zeros((b, H, D)),
                           step=jnp.ones((b, H, D)), bits=4)
  summaries = cache.replace(  # chunks of 2 slots: kmin, kmax rows
      bounds_raw=jnp.asarray(rng.normal(size=(num_pages, H, 2 * D, p // 2)), jnp.float32),
      chunk_size=2)
  q = jnp.asarray(rng.normal(size=(b, 2 * H, D)), jnp.float32)
  outs = []
  for ratio in (100, 0):  # in place, then through the table
    monkeypatch.setattr(pages, "POOL_READ_RATIO", ratio)
    outs.append([np.asarray(x) for x in (
        jax.jit(attend)(q, cache),
        jax.jit(quant.slot_logits_xla, static_argnums=2)(q, state, 5),
        jax.jit(paged_approx_scores_xla, static_argnums=2)(q, summaries, 5))])
  for in_place, through_table in zip(*outs):
    np.testing.assert_array_equal(in_place, through_table)

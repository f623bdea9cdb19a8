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
from rocketkv_jax.runtime import paged_pool
from rocketkv_jax.select import approx_scores

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
                               quant.slot_logits(q, flat, 4), rtol=1e-6)
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
  num_pages = {"large_pool": 64}.get(case, 13)
  b = len(lengths)
  ids = rng.permutation(np.arange(1, num_pages))[:b * npg].reshape(b, npg)
  if case == "shared_page":
    ids[1, 0] = ids[0, 1]  # two sequences read one page
  if case == "stale_entries":
    ids[1, 2:] = ids[0, :2]  # past row 1's length: row 0's pages
  k_pages = rng.normal(size=(num_pages, H, P, D)).astype(np.float32)
  v_pages = rng.normal(size=(num_pages, H, P, D)).astype(np.float32)
  cache = full_cache(jnp.zeros((b, H, npg * P, D)), jnp.zeros((b, H, npg * P, D)), npg * P, 0,
                     jnp.asarray(lengths, jnp.int32))
  cache = cache.replace(k_raw=jnp.asarray(k_pages), v_raw=jnp.asarray(v_pages),
                        pos_raw=jnp.zeros((num_pages, H, P), jnp.int32),
                        table=jnp.asarray(ids, jnp.int32), page_size=P)
  logical_k = np.stack([np.concatenate([k_pages[t] for t in row], axis=1) for row in ids])
  logical_v = np.stack([np.concatenate([v_pages[t] for t in row], axis=1) for row in ids])
  q = rng.normal(size=(b, 2 * H, D)).astype(np.float32)
  want = _dense_f64(q, logical_k, logical_v, lengths)
  np.testing.assert_allclose(jax.jit(attend)(jnp.asarray(q), cache), want, rtol=2e-5, atol=2e-6)

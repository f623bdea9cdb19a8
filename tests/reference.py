"""Independent float64 NumPy references for the core (written from the paper, loop by loop)."""

from __future__ import annotations

import math

import numpy as np


def softmax(x: np.ndarray) -> np.ndarray:
  x = np.asarray(x, np.float64)
  if x.size == 0 or not np.isfinite(x).any():
    return np.zeros_like(x)
  e = np.exp(x - np.max(x[np.isfinite(x)]))
  e[~np.isfinite(x)] = 0.0
  return e / e.sum()


def plan_split(prompt, new, budget, d):
  """The budget split exactly as the paper writes it (rocketkv_jax/budget.py quotes it; no clamps)."""
  t = prompt + new
  cr = t / budget
  alpha = min(0.2 + 0.06 * math.log2(cr), 0.8)
  capacity = max(int(t / cr**alpha), min(2 * new, t))
  prompt_budget = capacity - new
  top_k = budget // 2
  cr2 = max(1, capacity / budget)
  chunk = min(math.floor(cr2), math.ceil(math.sqrt(cr2)))
  r = min(max(int(d * chunk / cr2), 1), d)  # truncated, as the original code does
  return capacity, prompt_budget, top_k, chunk, r


def window_scores(qw, k, length, reduce="sum"):
  """qw [Hq, W, D], k [Hkv, L, D] of one sequence -> [Hkv, L] window attention, summed (or the
  max, `reduce="max"`) over the window queries and the group's heads."""
  qw, k = np.asarray(qw, np.float64), np.asarray(k, np.float64)
  hq, w, d = qw.shape
  hkv, l, _ = k.shape
  g = hq // hkv
  out = np.zeros((hkv, l))
  for h in range(hq):
    for i in range(w):
      qpos = length - w + i
      n = min(qpos + 1, length)
      if n <= 0:
        continue
      logits = k[h // g, :n] @ qw[h, i] / math.sqrt(d)
      if reduce == "max":
        out[h // g, :n] = np.maximum(out[h // g, :n], softmax(logits))
      else:
        out[h // g, :n] += softmax(logits)
  return out


def pooled(scores, length, window, kernel):
  """[Hkv, L] -> pooled candidate scores (-inf off candidates)."""
  hkv, l = scores.shape
  ncand = max(length - window, 0)
  out = np.full((hkv, l), -np.inf)
  half = kernel // 2
  for h in range(hkv):
    for i in range(ncand):
      lo, hi = max(0, i - half), min(ncand, i + half + 1)
      out[h, i] = scores[h, lo:hi].max()
  return out


def chunk_bounds(k, length, chunk):
  """k [Hkv, C, D] -> kmin, kmax [Hkv, NC, D] over valid slots (zeros if none)."""
  hkv, c, d = k.shape
  nc = -(-c // chunk)
  kmin, kmax = np.zeros((hkv, nc, d)), np.zeros((hkv, nc, d))
  for j in range(nc):
    lo, hi = j * chunk, min((j + 1) * chunk, length, c)
    if hi > lo:
      kmin[:, j] = k[:, lo:hi].min(axis=1)
      kmax[:, j] = k[:, lo:hi].max(axis=1)
  return kmin, kmax


def dim_weights(qg, group_dims="sum"):
  """Per-dim weights of a group's queries qg [G, D] whose r largest are stage 2's dims: |q| summed
  over the heads, each head's |q| first divided by its sum over the dims with "normalized"."""
  a = np.abs(np.asarray(qg, np.float64))
  if group_dims == "normalized":
    a = a / a.sum(1, keepdims=True)
  return a.sum(0)


def approx_slot_scores(q, k, length, chunk, r, group_dims="sum"):
  """RocketKV stage-2 score of every slot: q [Hq, D], k [Hkv, C, D] -> [Hkv, C] (-inf invalid)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  hq, d = q.shape
  hkv, c, _ = k.shape
  g = hq // hkv
  kmin, kmax = chunk_bounds(k, length, chunk)
  nc = kmin.shape[1]
  nvalid = -(-length // chunk)
  out = np.full((hkv, c), -np.inf)
  for h in range(hkv):
    qg = q[h * g:(h + 1) * g]
    dims = np.argsort(-dim_weights(qg, group_dims), kind="stable")[:r]
    pos = qg.sum(0) > 0
    bound = np.where(pos[None, :], kmax[h], kmin[h])[:, dims]  # [NC, r]
    total = np.zeros(nc)
    for i in range(g):
      frac = np.abs(qg[i, dims]).sum() / np.abs(qg[i]).sum()
      scale = math.sqrt(d * (frac if frac > 0 else 1.0))  # a head zero on the dims: logits 0
      logits = bound @ qg[i, dims] / scale
      logits[nvalid:] = -np.inf
      total += softmax(logits)
    for s in range(min(length, c)):
      out[h, s] = total[s // chunk]
  return out


def quest_slot_scores(q, k, length, page):
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  hq, d = q.shape
  hkv, c, _ = k.shape
  g = hq // hkv
  kmin, kmax = chunk_bounds(k, length, page)
  nvalid = -(-length // page)
  out = np.full((hkv, c), -np.inf)
  for h in range(hkv):
    total = 0.0
    for i in range(g):
      qi = q[h * g + i]
      ub = np.maximum(kmin[h] * qi, kmax[h] * qi).sum(1) / math.sqrt(d)
      ub[nvalid:] = -np.inf
      total = total + softmax(ub)
    for s in range(min(length, c)):
      out[h, s] = total[s // page]
  return out


def exact_slot_scores(q, k, length):
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  hq, d = q.shape
  hkv, c, _ = k.shape
  g = hq // hkv
  out = np.full((hkv, c), -np.inf)
  for h in range(hkv):
    total = np.zeros(length)
    for i in range(g):
      total += softmax(k[h, :length] @ q[h * g + i] / math.sqrt(d))
    out[h, :length] = total
  return out


def attention(q, k, v, slots_per_head):
  """q [Hq, D], k/v [Hkv, C, D], slots_per_head: list of index arrays -> [Hq, D]."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  hq, d = q.shape
  hkv = k.shape[0]
  g = hq // hkv
  out = np.zeros((hq, d))
  for h in range(hq):
    s = np.asarray(slots_per_head[h // g], int)
    if len(s) == 0:
      continue
    p = softmax(k[h // g, s] @ q[h] / math.sqrt(d))
    out[h] = p @ v[h // g, s]
  return out

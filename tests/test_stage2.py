"""RocketConfig.stage2 = "rerank" / "lowrank" / "quant" against float64 NumPy references here.

The references follow the definitions (methods/stage2/rerank.py / lowrank.py / quant.py
docstrings) loop by
loop: per-token scores, selected sets on random data (checked exactly where the reference's
k-th and (k+1)-th scores are well apart, and by score mass always), decode steps end to end,
ragged batches, sliding windows, and that "minmax" is unchanged.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rocketkv
import reference as ref
from rocketkv_jax.eval import variants
from rocketkv_jax.methods import stage2 as stage2_lib
from rocketkv_jax.methods.stage2 import LowRank, MinMax, Quant, Rerank
from rocketkv_jax.methods.stage2.lowrank import slot_logits_xla
from rocketkv_jax.methods.stage2 import quant as quant_lib
from rocketkv_jax.methods.stage2.quant import build as quant_build
from rocketkv_jax.methods.stage2.rerank import candidate_scores_xla

D, HKV, G = 16, 2, 4
HQ = HKV * G


# --------------------------------------------------------------------------- references
def ref_rerank_scores(q, k, cand, ok, r):
  """q [Hq, D], k [Hkv, C, D], cand/ok [Hkv, M] -> [Hkv, M]: softmax over the valid candidates
  of q_r . k_r / sqrt(D * sum|q_r| / sum|q|) per query head, summed over the group."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  hq, d = q.shape
  hkv = k.shape[0]
  g = hq // hkv
  out = np.zeros(cand.shape)
  for h in range(hkv):
    qg = q[h * g:(h + 1) * g]
    dims = np.argsort(-np.abs(qg).sum(0), kind="stable")[:r]
    for i in range(g):
      scale = math.sqrt(d * np.abs(qg[i, dims]).sum() / np.abs(qg[i]).sum())
      logits = k[h, cand[h]][:, dims] @ qg[i, dims] / scale
      logits[~ok[h]] = -np.inf
      out[h] += ref.softmax(logits)
  return out


def ref_rerank_select(q, k, valid, chunk, r, m, top_k):
  """One sequence: the chunk scores' top m valid slots (ties to the lower slot), re-ranked.

  valid [Hkv, C] bool (prefix of `length` slots, optionally cut by a sliding window; the chunk
  bounds cover every slot < length). Returns (per head the selected slots, per head
  {slot: rerank score} of the candidates)."""
  length = int(valid.any(0).nonzero()[0].max()) + 1
  chunk_scores = ref.approx_slot_scores(q, k, length, chunk, r)
  sel, cand_scores = [], []
  for h in range(k.shape[0]):
    s = np.where(valid[h], chunk_scores[h], -np.inf)
    order = np.argsort(-s, kind="stable")
    cand = order[:m][np.isfinite(s[order[:m]])]
    sc = ref_rerank_scores(q[h * G:(h + 1) * G], k[h:h + 1], cand[None],
                           np.ones((1, len(cand)), bool), r)[0]
    best = np.argsort(-sc, kind="stable")[:top_k]
    sel.append(set(cand[best].tolist()))
    cand_scores.append(dict(zip(cand.tolist(), sc.tolist())))
  return sel, cand_scores


def ref_lowrank_logits(q, k, n_prompt, page, rank):
  """q [Hq, D], k [Hkv, C, D]: logits q . k_i / sqrt(D) with k_i of every prompt slot
  (i < n_prompt) replaced by mu_p + U_p U_p^T (k_i - mu_p), U_p the top-`rank` right singular
  vectors of its page's centred keys; exact q . k_i / sqrt(D) for the other slots.
  Returns [Hq, C]."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  hq, d = q.shape
  hkv, c, _ = k.shape
  g = hq // hkv
  kk = k.copy()
  for h in range(hkv):
    for lo in range(0, n_prompt, page):
      hi = min(lo + page, n_prompt)
      x = k[h, lo:hi]
      mu = x.mean(0)
      _, _, vt = np.linalg.svd(x - mu, full_matrices=False)
      u = vt[:rank]
      kk[h, lo:hi] = mu + (x - mu) @ u.T @ u
  return np.stack([kk[i // g] @ q[i] for i in range(hq)]) / math.sqrt(d)


def ref_lowrank_select(q, k, valid, n_prompt, page, rank, top_k):
  """One sequence: per KV head the top_k valid slots by the group sum of per-head softmaxes of
  `ref_lowrank_logits`. Returns (selected sets, scores [Hkv, C])."""
  logits = ref_lowrank_logits(q, k, n_prompt, page, rank)
  hkv, c = valid.shape
  scores = np.full((hkv, c), -np.inf)
  sel = []
  for h in range(hkv):
    tot = np.zeros(c)
    for i in range(G):
      tot += ref.softmax(np.where(valid[h], logits[h * G + i], -np.inf))
    scores[h] = np.where(valid[h], tot, -np.inf)
    sel.append(set(np.argsort(-scores[h], kind="stable")[:min(top_k, valid[h].sum())].tolist()))
  return sel, scores


def ref_quant_probs(q, k, valid, n_prompt, r, bits):
  """One sequence: per KV head and dim an affine grid over the prompt keys (slots < n_prompt),
  every slot's key rounded to it (clipped), then SparQ's r-dim score of the rounded keys:
  softmax per query head over the valid slots of q_r . k~_r / sqrt(D * sum|q_r| / sum|q|).
  Returns [Hq, C] (0 where not valid)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  hkv, c, d = k.shape
  levels = 2 ** bits - 1
  probs = np.zeros((hkv * G, c))
  for h in range(hkv):
    lo, hi = k[h, :n_prompt].min(0), k[h, :n_prompt].max(0)
    step = np.where(hi > lo, (hi - lo) / levels, 1.0)
    kq = lo + step * np.clip(np.round((k[h] - lo) / step), 0, levels)  # [C, D]
    qg = q[h * G:(h + 1) * G]
    dims = np.argsort(-np.abs(qg).sum(0), kind="stable")[:r]
    for i in range(G):
      scale = math.sqrt(d * np.abs(qg[i, dims]).sum() / np.abs(qg[i]).sum())
      probs[h * G + i] = np.nan_to_num(
          ref.softmax(np.where(valid[h], kq[:, dims] @ qg[i, dims] / scale, -np.inf)))
  return probs


def ref_quant_select(q, k, valid, n_prompt, r, bits, top_k):
  """`ref_quant_probs` summed over the group, top_k. Returns (selected sets, scores [Hkv, C])."""
  probs = ref_quant_probs(q, k, valid, n_prompt, r, bits)
  hkv, c = valid.shape
  scores = np.full((hkv, c), -np.inf)
  sel = []
  for h in range(hkv):
    scores[h] = np.where(valid[h], probs[h * G:(h + 1) * G].sum(0), -np.inf)
    sel.append(set(np.argsort(-scores[h], kind="stable")[:min(top_k, valid[h].sum())].tolist()))
  return sel, scores


def _separated(scores, n, rel=1e-3):
  """The n-th and (n+1)-th best finite scores are well apart (an exact set is well defined)."""
  s = np.sort(scores[np.isfinite(scores)])[::-1]
  return len(s) <= n or s[n - 1] - s[n] > rel * max(abs(s[n - 1]), 1e-12)


def _check_selection(idx, want_sets, scores_of, valid, top_k):
  """idx [Hkv, K] chosen; want_sets per head; scores_of(h) -> {slot: ref score}."""
  for h in range(idx.shape[0]):
    chosen = idx[h].tolist()
    assert len(set(chosen)) == len(chosen), "no slot twice"
    ok = [s for s in chosen if 0 <= s < valid.shape[1] and valid[h, s]]
    assert len(ok) == min(top_k, int(valid[h].sum()))
    sc = scores_of(h)
    np.testing.assert_allclose(sum(sc[s] for s in ok), sum(sc[s] for s in want_sets[h]),
                               rtol=1e-5, atol=1e-6)
    if _separated(np.array(list(sc.values())), len(want_sets[h])):
      assert set(ok) == want_sets[h]


def _valid(length, c, window):
  """[Hkv, C] bool: the slots a sequence of `length` prompt slots (slot = position) may read
  from its newest token, within `window` if given."""
  pos = np.arange(c)
  valid = pos < length
  if window is not None:
    valid = valid & (length - 1 - pos < window)
  return np.broadcast_to(valid, (HKV, c))


def _keys(seed, b, c, lengths):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((b, HKV, c, D)).astype(np.float32)
  k[..., 0] *= 4.0  # an outlier channel, as real keys have
  k += rng.standard_normal((b, HKV, 1, D)).astype(np.float32)  # a common offset
  for i, n in enumerate(lengths):
    k[i, :, n:] = 0.0
  return k


def _variant(name, **fields):
  """The variant `name` with the ones of `fields` it has (tests share one set of settings)."""
  cls = stage2_lib.REGISTRY[name]
  own = {f.name for f in dataclasses.fields(cls)}
  return cls(**{k: v for k, v in fields.items() if k in own})


# --------------------------------------------------------------------------- config / plan
def test_stage2_config_plan_and_errors():
  base = rocketkv.plan(rocketkv.RocketConfig(token_budget=64), 1000, 10, 64)
  assert base.stage2 == MinMax() and base.stage2.name == "minmax"
  rr = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, stage2=Rerank(factor=1.5)),
                     1000, 10, 64)
  assert (rr.stage2, rr.top_k, rr.stage2.candidates(rr.top_k)) == (Rerank(1.5), 32, 48)
  assert (rr.capacity, rr.chunk_size, rr.r) == (base.capacity, base.chunk_size, base.r)
  lr = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, stage2=LowRank(page_size=32, rank=4),
                                           method="rocketkv_mt"), 1000, 10, 64)
  assert (lr.stage2, lr.chunk_size) == (LowRank(page_size=32, rank=4), 0)
  qt = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, stage2=Quant(bits=2)), 1000, 10, 64)
  assert (qt.stage2.name, qt.chunk_size, qt.stage2.bits) == ("quant", 0, 2)
  assert (qt.capacity, qt.top_k, qt.r) == (base.capacity, base.top_k, base.r)
  mv = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, stage2=Quant(mean_value=True)),
                     1000, 10, 64)
  assert mv.stage2.mean_value and not qt.stage2.mean_value
  assert (mv.capacity, mv.top_k) == (qt.capacity, 32)
  # A name is that variant with its defaults; plans of either spelling are one static argument.
  assert rocketkv.RocketConfig(token_budget=64, stage2="quant").stage2 == Quant(4, "paper", False)
  assert rocketkv.plan(rocketkv.RocketConfig(token_budget=64, stage2="rerank"), 1000, 10, 64) \
      == rocketkv.plan(rocketkv.RocketConfig(token_budget=64, stage2=Rerank()), 1000, 10, 64)
  assert hash(Quant(bits=2)) == hash(Quant(bits=2)) and Quant(bits=2) != Quant(bits=4)
  with pytest.raises(ValueError, match=r"Quant.mean_value must be True or False, got 1"):
    Quant(mean_value=1)
  with pytest.raises(ValueError, match=r"Quant.bits must be one of \[1, 2, 4, 8\], got 3"):
    Quant(bits=3)
  with pytest.raises(ValueError, match=r"stage2 must be one of \['minmax', 'rerank', 'lowrank', "
                     r"'quant'\] or a Stage2 variant, got 'exact'"):
    rocketkv.RocketConfig(token_budget=64, stage2="exact")
  with pytest.raises(ValueError, match="needs method in"):
    rocketkv.RocketConfig(token_budget=64, method="quest", stage2=Rerank())
  with pytest.raises(ValueError, match=r"Rerank.factor must be a number >= 1, got 0.5"):
    Rerank(factor=0.5)
  with pytest.raises(ValueError, match=r"LowRank.rank must be an int \[1, 8\], got 9"):
    LowRank(page_size=8, rank=9)
  with pytest.raises(ValueError, match=r"LowRank.rank must be in \[1, head_dim=16\], got 20"):
    rocketkv.plan(rocketkv.RocketConfig(token_budget=64, stage2=LowRank(rank=20)), 1000, 10, 16)


def test_quant_equal_read_capacity():
  """`Quant(capacity="equal_read")`: the slots whose 4-bit codes on the paper's r dims cost what
  the paper's 16-bit bounds cost, computed here by hand; stage 1 then keeps a superset."""
  # The paper's 32K example: 1618 slots in ceil(1618 / 3) = 540 chunks, r = 60 (README).
  cfg = dict(token_budget=256)
  eq_read = Quant(capacity="equal_read")
  paper = rocketkv.plan(rocketkv.RocketConfig(**cfg, stage2=Quant()), 32668, 100, 128)
  eq = rocketkv.plan(rocketkv.RocketConfig(**cfg, stage2=eq_read), 32668, 100, 128)
  assert (paper.capacity, paper.r) == (1618, 60)
  bound_bits = 540 * 60 * 16  # one bound per dim per chunk
  code_bits = lambda c: 60 * c * 4 + 60 * 32  # codes + fp32 grid steps
  assert code_bits(2152) <= bound_bits < code_bits(2152 + 2)  # whole bytes: 2 slots per byte
  assert (eq.capacity, eq.prompt_budget, eq.r, eq.top_k) == (2152, 2052, 60, 128)
  # 8 bits cost more than the bounds: the paper's capacity (never fewer slots).
  eq8 = rocketkv.plan(rocketkv.RocketConfig(**cfg, stage2=Quant(bits=8, capacity="equal_read")),
                      32668, 100, 128)
  assert eq8.capacity == 1618
  # A prompt that fits is kept whole either way; the capacity never exceeds T.
  short = rocketkv.plan(rocketkv.RocketConfig(**cfg, stage2=eq_read), 200, 10, 64)
  assert (short.capacity, short.prompt_budget) == (210, 200)
  near = rocketkv.plan(rocketkv.RocketConfig(**cfg, stage2=eq_read), 2048, 24, 64)
  assert near.capacity <= 2048 + 24 and near.prompt_budget <= 2048
  # Stage 1's top-k is nested: the larger budget keeps every token the paper keeps.
  rng = np.random.default_rng(0)
  k, v = (jnp.asarray(rng.standard_normal((1, HKV, 600, D)), jnp.float32) for _ in range(2))
  qw = jnp.asarray(rng.standard_normal((1, HQ, 8, D)), jnp.float32)
  kw = dict(token_budget=64, window_size=8, kernel_size=3)
  plans = [rocketkv.plan(rocketkv.RocketConfig(**kw, stage2=Quant(capacity=c)), 600, 8, D)
           for c in ("paper", "equal_read")]
  assert plans[1].prompt_budget > plans[0].prompt_budget
  kept = [np.asarray(rocketkv.evict(k, v, qw, p).pos)[0, :, :p.prompt_budget] for p in plans]
  for h in range(HKV):
    assert set(kept[0][h]) < set(kept[1][h])
  with pytest.raises(ValueError, match=r"Quant.capacity must be one of \['paper', "
                     r"'equal_read'\], got 'more'"):
    Quant(capacity="more")
  with pytest.raises(ValueError, match="leave capacity and prompt_budget unset"):
    rocketkv.RocketConfig(**cfg, stage2=eq_read, capacity=3000)


def test_variant_specs():
  """The spec syntax of the committed results: a variant's fields as flat `<variant>_<field>`
  keys (Quant's `mean_value`), turned into the `RocketConfig.stage2` object."""
  assert variants.parse("rocketkv:stage2=rerank,rerank_factor=2") == (
      "rocketkv", {"stage2": "rerank", "rerank_factor": 2.0})
  cfg = variants.rocket_config("rocketkv_mt:stage2=lowrank,lowrank_rank=4", 256)
  assert (cfg.method, cfg.stage2) == ("rocketkv_mt", LowRank(page_size=128, rank=4))
  cfg = variants.rocket_config("rocketkv:stage2=quant,quant_bits=8", 256)
  assert cfg.stage2 == Quant(bits=8)
  with pytest.raises(ValueError, match="must be one of"):
    variants.parse("rocketkv:stage2=foo")
  cfg = variants.rocket_config("rocketkv:stage2=quant,quant_capacity=equal_read,quant_bits=2",
                               256)
  assert cfg.stage2 == Quant(bits=2, capacity="equal_read")
  with pytest.raises(ValueError, match=r"quant_capacity=x.*Quant.capacity must be one of "
                     r"\['paper'"):
    variants.parse("rocketkv:stage2=quant,quant_capacity=x")
  cfg = variants.rocket_config("rocketkv_mt:stage2=quant,mean_value=1", 256)
  assert (cfg.method, cfg.stage2) == ("rocketkv_mt", Quant(mean_value=True))
  assert not variants.rocket_config("rocketkv:stage2=quant,mean_value=0", 256).stage2.mean_value
  with pytest.raises(ValueError, match=r"mean_value='2' in .* must be 0 or 1"):
    variants.parse("rocketkv:stage2=quant,mean_value=2")
  with pytest.raises(ValueError, match=r"quant_bits=2 needs stage2='quant', got 'minmax'"):
    variants.parse("rocketkv:quant_bits=2")
  with pytest.raises(ValueError, match=r"mean_value=True needs stage2='quant', got 'rerank'"):
    variants.parse("rocketkv:stage2=rerank,mean_value=1")
  # Every spec the committed results name still parses to the variant it meant.
  assert variants.rocket_config("rocketkv:stage2=rerank,rerank_factor=4", 64).stage2 == Rerank(4)
  assert variants.rocket_config("rocketkv:stage2=lowrank", 64).stage2 == LowRank()
  assert variants.rocket_config(
      "rocketkv:stage2=quant,quant_capacity=equal_read,mean_value=1", 64).stage2 == Quant(
          capacity="equal_read", mean_value=True)


def test_minmax_unchanged():
  """The default stays the paper's: a plain KVCache with min/max summaries, same plan."""
  cfg = rocketkv.RocketConfig(token_budget=64, window_size=8)
  assert cfg.stage2 == MinMax()
  k = _keys(0, 2, 120, [120, 90])
  q = np.random.default_rng(1).standard_normal((2, HQ, 8, D)).astype(np.float32)
  plan = rocketkv.plan(cfg, 120, 4, D)
  state = rocketkv.prefill(jnp.asarray(k), jnp.asarray(k), jnp.asarray(q), plan,
                           lengths=jnp.array([120, 90]))
  assert type(state) is rocketkv.KVCache and state.chunk_size == plan.chunk_size > 0
  assert len(jax.tree_util.tree_leaves(state)) == 7  # k, v, bounds, pos, length, seen, overflow
  idx = np.asarray(rocketkv.select(jnp.asarray(q[:, :, -1]), state, plan))
  k_c = np.asarray(state.k)
  for b in range(2):
    n = int(state.length[b])
    scores = ref.approx_slot_scores(q[b, :, -1], k_c[b], n, plan.chunk_size, plan.r)
    for h in range(HKV):
      chosen = idx[b, h][idx[b, h] < n]
      want = np.sort(scores[h, :n])[::-1][:plan.top_k].sum()
      np.testing.assert_allclose(scores[h, chosen].sum(), want, rtol=1e-5)


# --------------------------------------------------------------------------- rerank
def test_rerank_candidate_scores_match_reference():
  b, c, m, r = 2, 50, 17, 5
  k = _keys(2, b, c, [c, c])
  rng = np.random.default_rng(3)
  q = rng.standard_normal((b, HQ, D)).astype(np.float32)
  cand = np.stack([np.stack([rng.permutation(c)[:m] for _ in range(HKV)]) for _ in range(b)])
  ok = rng.random((b, HKV, m)) < 0.8
  got = np.asarray(candidate_scores_xla(jnp.asarray(q), jnp.asarray(k),
                                        jnp.asarray(cand, jnp.int32), jnp.asarray(ok), r))
  for i in range(b):
    want = ref_rerank_scores(q[i], k[i], cand[i], ok[i], r)
    np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)
  assert np.all(got[~ok] == 0)


@pytest.mark.parametrize("seed,chunk,top_k,factor", [(0, 2, 8, 1.5), (1, 3, 7, 2.0),
                                                     (2, 1, 12, 1.5), (3, 4, 40, 1.5)])
def test_rerank_select_matches_reference(seed, chunk, top_k, factor):
  """Ragged batch (second sequence shorter; top_k 40 >= its valid candidates in one case)."""
  c, r = 64, 6
  lengths = [64, 37]
  k = _keys(seed, 2, c, lengths)
  q = np.random.default_rng(seed + 100).standard_normal((2, HQ, D)).astype(np.float32)
  cfg = rocketkv.RocketConfig(token_budget=64, window_size=1, chunk_size=chunk, r=r,
                              top_k=top_k, stage2=Rerank(factor=factor))
  plan = rocketkv.plan(cfg, c, 0, D)
  cache = rocketkv.full_cache(jnp.asarray(k), jnp.asarray(k), c, chunk, jnp.asarray(lengths))
  idx = np.asarray(rocketkv.select(jnp.asarray(q), cache, plan))
  assert idx.shape == (2, HKV, top_k) and idx.dtype == np.int32
  m = math.ceil(factor * top_k)
  for b in range(2):
    valid = np.broadcast_to(np.arange(c) < lengths[b], (HKV, c))
    want, cand_scores = ref_rerank_select(q[b], k[b], valid, chunk, r, m, top_k)
    _check_selection(idx[b], want, lambda h: cand_scores[h], valid, top_k)


def test_rerank_sliding_window():
  c, chunk, r, top_k, window = 80, 3, 6, 10, 30
  lengths = [80, 52]
  k = _keys(7, 2, c, lengths)
  q = np.random.default_rng(8).standard_normal((2, HQ, D)).astype(np.float32)
  cfg = rocketkv.RocketConfig(token_budget=64, window_size=1, chunk_size=chunk, r=r,
                              top_k=top_k, stage2="rerank")
  plan = rocketkv.plan(cfg, c, 0, D)
  cache = rocketkv.full_cache(jnp.asarray(k), jnp.asarray(k), c, chunk, jnp.asarray(lengths))
  idx = np.asarray(rocketkv.select(jnp.asarray(q), cache, plan, sliding_window=window))
  for b in range(2):
    pos = np.arange(c)
    valid = np.broadcast_to((pos < lengths[b]) & (lengths[b] - 1 - pos < window), (HKV, c))
    want, cand_scores = ref_rerank_select(q[b], k[b], valid, chunk, r, 15, top_k)
    _check_selection(idx[b], want, lambda h: cand_scores[h], valid, top_k)


# --------------------------------------------------------------------------- lowrank
def _lowrank_state(k, lengths, page, rank, top_k, new=0):
  c = k.shape[2]
  cfg = rocketkv.RocketConfig(token_budget=64, window_size=1, top_k=top_k,
                              stage2=LowRank(page_size=page, rank=rank), capacity=c)
  plan = rocketkv.plan(cfg, c - new, new, D)
  cache = rocketkv.full_cache(jnp.asarray(k), jnp.asarray(k), c, 0, jnp.asarray(lengths))
  from rocketkv_jax.methods.stage2.lowrank import build
  return build(cache, plan), plan


def test_lowrank_logits_match_reference():
  page, rank = 16, 4
  lengths = [60, 37]  # partial last pages
  k = _keys(11, 2, 64, lengths)
  state, plan = _lowrank_state(k, lengths, page, rank, 8)
  q = np.random.default_rng(12).standard_normal((2, HQ, D)).astype(np.float32)
  logits, _ = slot_logits_xla(jnp.asarray(q), state, 0)
  logits = np.asarray(logits).reshape(2, HQ, -1)
  for b in range(2):
    want = ref_lowrank_logits(q[b], k[b], lengths[b], page, rank)
    n = lengths[b]
    np.testing.assert_allclose(logits[b, :, :n], want[:, :n], rtol=1e-4, atol=1e-4)


def test_lowrank_full_rank_is_exact():
  """Rank = page size: every page is reproduced exactly, so the selection is exact top-k."""
  lengths = [64, 41]
  k = _keys(13, 2, 64, lengths)
  state, plan = _lowrank_state(k, lengths, 8, 8, 12)
  q = np.random.default_rng(14).standard_normal((2, HQ, D)).astype(np.float32)
  idx = np.asarray(rocketkv.select(jnp.asarray(q), state, plan))
  for b in range(2):
    exact = ref.exact_slot_scores(q[b], k[b], lengths[b])
    valid = np.broadcast_to(np.arange(64) < lengths[b], (HKV, 64))
    want = [set(np.argsort(-exact[h], kind="stable")[:12].tolist()) for h in range(HKV)]
    _check_selection(idx[b], want, lambda h: dict(enumerate(exact[h])), valid, 12)


@pytest.mark.parametrize("seed,page,rank,top_k,window", [(0, 16, 4, 10, None), (1, 8, 2, 25, None),
                                                         (2, 16, 3, 9, 30)])
def test_lowrank_select_matches_reference(seed, page, rank, top_k, window):
  c = 64
  lengths = [64, 45]
  k = _keys(seed + 20, 2, c, lengths)
  state, plan = _lowrank_state(k, lengths, page, rank, top_k)
  q = np.random.default_rng(seed + 30).standard_normal((2, HQ, D)).astype(np.float32)
  idx = np.asarray(rocketkv.select(jnp.asarray(q), state, plan, sliding_window=window))
  for b in range(2):
    valid = _valid(lengths[b], c, window)
    want, scores = ref_lowrank_select(q[b], k[b], valid, lengths[b], page, rank, top_k)
    _check_selection(idx[b], want, lambda h: dict(enumerate(scores[h])), valid, top_k)


# --------------------------------------------------------------------------- quant
@pytest.mark.parametrize("seed,bits,top_k,window", [(0, 4, 10, None), (1, 2, 25, None),
                                                    (2, 8, 9, 30), (3, 1, 12, None)])
def test_quant_select_matches_reference(seed, bits, top_k, window):
  """Ragged batch (an odd length: a partial last byte for bits < 8), GQA, sliding window."""
  c, r = 63, 5
  lengths = [63, 45]
  k = _keys(seed + 60, 2, c, lengths)
  cfg = rocketkv.RocketConfig(token_budget=64, window_size=1, top_k=top_k, r=r,
                              stage2=Quant(bits=bits), capacity=c)
  plan = rocketkv.plan(cfg, c, 0, D)
  cache = rocketkv.full_cache(jnp.asarray(k), jnp.asarray(k), c, 0, jnp.asarray(lengths))
  state = quant_build(cache, plan)
  assert state.codes.shape == (2, HKV, D, -(-c * bits // 8)) and state.codes.dtype == jnp.uint8
  q = np.random.default_rng(seed + 70).standard_normal((2, HQ, D)).astype(np.float32)
  idx = np.asarray(rocketkv.select(jnp.asarray(q), state, plan, sliding_window=window))
  for b in range(2):
    valid = _valid(lengths[b], c, window)
    want, scores = ref_quant_select(q[b], k[b], valid, lengths[b], r, bits, top_k)
    _check_selection(idx[b], want, lambda h: dict(enumerate(scores[h])), valid, top_k)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("fused_max", [0, 10 ** 6])
def test_quant_slot_logits_both_forms_match_reference(monkeypatch, bits, fused_max):
  """`slot_logits_xla` by plane products (FUSED_TERMS_MAX = 0) and by the fused unrolled sum:
  the softmax of each query head's logits over the valid slots is the float64 reference's."""
  monkeypatch.setattr(quant_lib, "FUSED_TERMS_MAX", fused_max)
  c, r, lengths = 63, 5, [63, 45]
  k = _keys(80 + bits, 2, c, lengths)
  cfg = rocketkv.RocketConfig(token_budget=64, window_size=1, top_k=8, r=r,
                              stage2=Quant(bits=bits), capacity=c)
  plan = rocketkv.plan(cfg, c, 0, D)
  cache = rocketkv.full_cache(jnp.asarray(k), jnp.asarray(k), c, 0, jnp.asarray(lengths))
  state = quant_build(cache, plan)
  q = np.random.default_rng(90 + bits).standard_normal((2, HQ, D)).astype(np.float32)
  logits = np.asarray(quant_lib.slot_logits_xla(jnp.asarray(q), state, r), np.float64)
  assert logits.shape == (2, HKV, G, c)
  for b in range(2):
    valid = _valid(lengths[b], c, None)
    want = ref_quant_probs(q[b], k[b], valid, lengths[b], r, bits)  # [Hq, C]
    got = np.where(np.repeat(valid, G, 0), logits[b].reshape(HQ, c), -np.inf)
    got = np.exp(got - got.max(-1, keepdims=True))
    np.testing.assert_allclose(got / got.sum(-1, keepdims=True), want, atol=2e-6)


def test_quant_8_bits_selects_what_exact_r_dim_scores_select():
  """With 8 bits the codes lose nothing the selection sees: the r-dim scores of the real keys
  (SparQ's, `chunk_size=1` minmax) pick the same slots where they are well apart."""
  c = 64
  lengths = [64, 50]
  k = _keys(80, 2, c, lengths)
  q = np.random.default_rng(81).standard_normal((2, HQ, D)).astype(np.float32)
  picks = {}
  for s2, extra in (("quant", dict(stage2=Quant(bits=8))), ("minmax", dict(chunk_size=1))):
    cfg = rocketkv.RocketConfig(token_budget=64, window_size=1, top_k=8, r=D, capacity=c,
                                **extra)
    plan = rocketkv.plan(cfg, c, 0, D)
    cache = rocketkv.full_cache(jnp.asarray(k), jnp.asarray(k), c, plan.chunk_size,
                                jnp.asarray(lengths))
    picks[s2] = np.sort(np.asarray(rocketkv.select(jnp.asarray(q), plan.stage2.prefill(cache, plan), plan)))
  for b in range(2):
    exact = ref.exact_slot_scores(q[b], k[b], lengths[b])
    for h in range(HKV):
      if _separated(exact[h][np.isfinite(exact[h])], 8, rel=0.05):
        np.testing.assert_array_equal(picks["quant"][b, h], picks["minmax"][b, h])


# --------------------------------------------------------------------------- decode end to end
_STEP = jax.jit(rocketkv.decode_step, static_argnums=4, static_argnames=("sliding_window",))


def _decode(plan, k, v, q, lengths, l, steps, sliding_window=None):
  """Prefill on each sequence's first lengths[b] tokens (right-padded to l), decode `steps`."""
  b = k.shape[0]
  w = plan.window_size
  qw = np.stack([q[i, :, lengths[i] - w:lengths[i]] for i in range(b)])
  kp = np.stack([np.where(np.arange(l)[:, None] < lengths[i], k[i, :, :l], 0) for i in range(b)])
  vp = np.stack([np.where(np.arange(l)[:, None] < lengths[i], v[i, :, :l], 0) for i in range(b)])
  state = rocketkv.prefill(jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(qw), plan,
                           lengths=jnp.asarray(lengths, jnp.int32))
  outs = []
  for t in range(steps):
    p = np.asarray(lengths) + t
    kn = np.stack([k[i, :, p[i]:p[i] + 1] for i in range(b)])
    vn = np.stack([v[i, :, p[i]:p[i] + 1] for i in range(b)])
    qn = np.stack([q[i, :, p[i]] for i in range(b)])
    out, state = _STEP(jnp.asarray(qn), jnp.asarray(kn), jnp.asarray(vn), state, plan,
                       sliding_window=sliding_window)
    outs.append(np.asarray(out))
  return np.stack(outs, 1), state


def _ref_decode(stage2, plan, k, v, q, n, steps, sliding_window=None):
  """One sequence, nothing evicted (prompt_budget >= prompt): per step the reference selection
  over the cache so far (slot = position), then exact attention over it. [steps, Hq, D]."""
  out = []
  for t in range(steps):
    p = n + t
    kk, vv = k[:, :p + 1], v[:, :p + 1]
    pos = np.arange(p + 1)
    valid = np.ones(p + 1, bool) if sliding_window is None else p - pos < sliding_window
    valid = np.broadcast_to(valid, (HKV, p + 1))
    if stage2 == "rerank":
      sel, _ = ref_rerank_select(q[:, p], kk, valid, plan.chunk_size, plan.r,
                                 plan.stage2.candidates(plan.top_k), plan.top_k)
    elif stage2 == "quant":
      sel, _ = ref_quant_select(q[:, p], kk, valid, n, plan.r, plan.stage2.bits, plan.top_k)
    else:
      sel, _ = ref_lowrank_select(q[:, p], kk, valid, n, plan.stage2.page_size,
                                  plan.stage2.rank, plan.top_k)
    att = ref.attention(q[:, p], kk, vv, [sorted(s) for s in sel])
    if stage2 == "quant" and plan.stage2.mean_value:  # SparQ's fill: alpha = the codes' mass
      probs = ref_quant_probs(q[:, p], kk, valid, n, plan.r, plan.stage2.bits)  # read, per head
      alpha = np.array([probs[h, sorted(sel[h // G])].sum() for h in range(HQ)])[:, None]
      v_mean = np.repeat(np.asarray(vv, np.float64).mean(1), G, axis=0)  # every kept slot
      att = alpha * att + (1 - alpha) * v_mean
    out.append(att)
  return np.stack(out)


@pytest.mark.parametrize("stage2,window,bits,mean_value", [
    ("rerank", None, 4, False), ("lowrank", None, 4, False), ("lowrank", 40, 4, False),
    ("rerank", 40, 4, False), ("quant", None, 4, False), ("quant", 40, 2, False),
    ("quant", None, 8, False), ("quant", None, 4, True), ("quant", 40, 4, True)])
def test_decode_steps_match_reference(stage2, window, bits, mean_value):
  """Ragged batch, GQA, `steps` decode steps, vs the reference of each sequence; and the batch
  gives each sequence what it gets alone. (quant: the decode tokens, scaled up, fall partly
  outside the prompt's grid; 5 steps fill an odd capacity, 77, so the last byte is partial;
  mean_value: SparQ's fill, alpha per query head, the mean over every kept slot.)"""
  l, steps = 72, 5
  lengths = [72, 53]
  rng = np.random.default_rng(40)
  k = rng.standard_normal((2, HKV, l + steps, D)).astype(np.float32)
  k[..., 0] *= 4.0
  v = rng.standard_normal((2, HKV, l + steps, D)).astype(np.float32)
  q = rng.standard_normal((2, HQ, l + steps, D)).astype(np.float32)
  for b, n in enumerate(lengths):
    k[b, :, n:] *= 1.5
  cfg = rocketkv.RocketConfig(token_budget=24, window_size=4, prompt_budget=l, chunk_size=3,
                              r=6, stage2=_variant(stage2, page_size=16, rank=4, bits=bits,
                                                   mean_value=mean_value))
  plan = rocketkv.plan(cfg, l, steps, D)
  assert plan.top_k == 12 and plan.prompt_budget == l and plan.capacity == l + steps
  got, state = _decode(plan, k, v, q, lengths, l, steps, window)
  assert type(state) is plan.stage2.state_type
  for b in range(2):
    want = _ref_decode(stage2, plan, k[b], v[b], q[b], lengths[b], steps, window)
    np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-4)
  alone, _ = _decode(plan, k[1:], v[1:], q[1:], lengths[1:], l, steps, window)
  np.testing.assert_allclose(alone[0], got[1], rtol=1e-6, atol=1e-6)


def test_mean_value_sum_follows_appends_and_overflow():
  """`QuantState.v_sum` is the sum of the valid slots' values after every append, also once a
  full sequence's appends replace its last slot (sequence 1 overflows, sequence 0 does not)."""
  l, steps = 40, 6
  lengths = [30, 40]
  rng = np.random.default_rng(7)
  k = rng.standard_normal((2, HKV, l + steps, D)).astype(np.float32)
  v = rng.standard_normal((2, HKV, l + steps, D)).astype(np.float32)
  q = rng.standard_normal((2, HQ, l + steps, D)).astype(np.float32)
  cfg = rocketkv.RocketConfig(token_budget=16, window_size=4, prompt_budget=l,
                              stage2=Quant(mean_value=True))
  plan = rocketkv.plan(cfg, l, 2, D)  # room for 2 new tokens: sequence 1 overflows at step 3
  _, state = _decode(plan, k, v, q, lengths, l, steps)
  assert np.asarray(rocketkv.cache_overflow(state)).tolist() == [False, True]
  cache = state.cache
  n = np.asarray(cache.length)
  want = [np.asarray(cache.v, np.float64)[b, :, :n[b]].sum(1) for b in range(2)]
  np.testing.assert_allclose(np.asarray(state.v_sum), np.stack(want), rtol=1e-5, atol=1e-5)
  assert n.tolist() == [36, 42]
  # the last slot of the full sequence holds the newest token's value
  np.testing.assert_array_equal(np.asarray(cache.v)[1, :, 41], v[1, :, 45])


@pytest.mark.parametrize("stage2,mean_value", [("lowrank", False), ("quant", False),
                                               ("quant", True)])
def test_multi_turn_keeps_its_summaries(stage2, mean_value):
  """rocketkv_mt + lowrank / quant: prefill and begin_turn both give the variant's state as the
  view, built on the re-evicted cache; decoding over it keeps every valid slot when top_k >= C
  (with the mean-value fill: alpha = 1, and the value sum is the new view's)."""
  l, t2, steps = 40, 12, 3
  rng = np.random.default_rng(50)
  k = rng.standard_normal((1, HKV, l + t2 + 2 * steps, D)).astype(np.float32)
  q = rng.standard_normal((1, HQ, l + t2 + 2 * steps, D)).astype(np.float32)
  cfg = rocketkv.RocketConfig(token_budget=512, window_size=4, method="rocketkv_mt",
                              prompt_budget=1000,
                              stage2=_variant(stage2, page_size=8, rank=2, mean_value=mean_value))
  plan = rocketkv.plan(cfg, l, steps, D)
  state = rocketkv.prefill(jnp.asarray(k[:, :, :l]), jnp.asarray(k[:, :, :l]),
                           jnp.asarray(q[:, :, l - 4:l]), plan)
  assert type(state.view) is plan.stage2.state_type
  n_view = lambda st: int((st.n_prompt if stage2 == "lowrank" else st.cache.length)[0])
  assert n_view(state.view) == l
  for t in range(steps):
    kn = jnp.asarray(k[:, :, l + t:l + t + 1])
    out, state = _STEP(jnp.asarray(q[:, :, l + t]), kn, kn, state, plan)
  s = l + steps
  plan2 = rocketkv.plan(cfg, s + t2, steps, D)
  state = rocketkv.begin_turn(state, jnp.asarray(k[:, :, s:s + t2]), jnp.asarray(k[:, :, s:s + t2]),
                              jnp.asarray(q[:, :, s + t2 - 4:s + t2]), plan2)
  assert type(state.view) is plan2.stage2.state_type and n_view(state.view) == s + t2
  if mean_value:
    np.testing.assert_allclose(np.asarray(state.view.v_sum[0]), k[0, :, :s + t2].sum(1),
                               rtol=1e-5, atol=1e-4)
  p = s + t2
  kn = jnp.asarray(k[:, :, p:p + 1])
  out, state = _STEP(jnp.asarray(q[:, :, p]), kn, kn, state, plan2)
  want = ref.attention(q[0, :, p], k[0, :, :p + 1], k[0, :, :p + 1], [np.arange(p + 1)] * HKV)
  np.testing.assert_allclose(np.asarray(out[0]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stage2", ["rerank", "lowrank", "quant"])
def test_generate_with_stage2_keeping_everything_equals_full(stage2):
  """Through `generate` (jitted while loop, donated state) on a Mistral sliding-window
  checkpoint: with a budget that keeps and selects every token, the full-KV tokens."""
  from model_fixtures import hf_checkpoint, random_tokens
  import rocketkv_jax.models as M

  path, _ = hf_checkpoint("mistral_sw")
  model = M.load(path)
  toks = random_tokens(2, 40, seed=5)
  prompts = [toks[0].tolist(), toks[1, :27].tolist()]
  full = rocketkv.generate(model, prompts, method="full", max_new_tokens=12, eos_token_ids=())
  cfg = rocketkv.RocketConfig(token_budget=256, stage2=stage2)
  res = rocketkv.generate(model, prompts, rocket_config=cfg, max_new_tokens=12, eos_token_ids=())
  assert res.tokens == full.tokens
  assert res.stats["plan"].stage2 == stage2_lib.get(stage2)

"""Stage 2 selection against the float64 reference. Tie-tolerant: the chosen slots must carry
the same reference score mass as the reference top-k (slots of one chunk share a score)."""

import numpy as np
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rocketkv_jax as rocketkv
import reference as ref


def _cache(seed, b, hkv, c, d, lengths, chunk, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((b, hkv, c, d)).astype(np.float32)
  k[:, :, :, 0] *= 4.0  # an outlier channel, as real keys have
  cache = rocketkv.full_cache(jnp.asarray(k, dtype), jnp.asarray(k, dtype), c, chunk,
                              jnp.asarray(lengths, jnp.int32))
  return cache, np.asarray(cache.k, np.float32)


def _check_mass(idx, scores, length, top_k):
  """idx [Hkv, K] chosen slots; scores [Hkv, C] reference (-inf invalid)."""
  for h in range(scores.shape[0]):
    chosen = np.asarray(idx[h])
    n = min(top_k, length)
    assert len(set(chosen.tolist())) == len(chosen), "no slot twice"
    valid_chosen = chosen[chosen < length]
    assert len(valid_chosen) == n, "every valid slot when top_k >= length, else only valid"
    want = np.sort(scores[h, :length])[::-1][:n].sum()
    got = scores[h, valid_chosen].sum()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@given(seed=st.integers(0, 10_000), g=st.sampled_from([1, 3, 4]), hkv=st.sampled_from([1, 2]),
       c=st.sampled_from([16, 41, 97]), chunk=st.sampled_from([1, 2, 3, 5]),
       r=st.sampled_from([1, 4, 11, 16]), top_k=st.sampled_from([1, 7, 32, 64]),
       short=st.integers(0, 7), group_dims=st.sampled_from(rocketkv.GROUP_DIMS))
@settings(max_examples=12, deadline=None)
def test_rocketkv_select_matches_reference(seed, g, hkv, c, chunk, r, top_k, short, group_dims):
  d, b = 16, 2
  lengths = [c, max(1, c - short * 7)]
  cache, k = _cache(seed, b, hkv, c, d, lengths, chunk)
  q = np.random.default_rng(seed + 1).standard_normal((b, g * hkv, d)).astype(np.float32)
  cfg = rocketkv.RocketConfig(token_budget=64, window_size=1, chunk_size=chunk, r=r,
                              top_k=top_k, group_dims=group_dims)
  plan = rocketkv.plan(cfg, c, 0, d)
  idx = rocketkv.select(jnp.asarray(q), cache, plan)
  assert idx.shape == (b, hkv, min(top_k, c)) and idx.dtype == jnp.int32
  for bi in range(b):
    scores = ref.approx_slot_scores(q[bi], k[bi], lengths[bi], chunk, r, group_dims)
    _check_mass(np.asarray(idx[bi]), scores, lengths[bi], min(top_k, c))


def _plan(method, c, d, **kw):
  p = rocketkv.plan(rocketkv.RocketConfig(token_budget=kw.pop("budget", 24), method=method,
                                          **kw), c, 0, d)
  return p


@pytest.mark.parametrize("method", ["quest", "exact_topk", "sparq"])
def test_baseline_select_matches_reference(method):
  b, hkv, g, c, d = 2, 2, 4, 96, 16
  lengths = [96, 50]
  plan = _plan(method, c, d, page_size=8)
  cache, k = _cache(7, b, hkv, c, d, lengths, plan.chunk_size)
  q = np.random.default_rng(8).standard_normal((b, g * hkv, d)).astype(np.float32)
  idx = rocketkv.select(jnp.asarray(q), cache, plan)
  for bi in range(b):
    if method == "quest":
      scores = ref.quest_slot_scores(q[bi], k[bi], lengths[bi], 8)
    elif method == "exact_topk":
      scores = ref.exact_slot_scores(q[bi], k[bi], lengths[bi])
    else:
      scores = ref.approx_slot_scores(q[bi], k[bi], lengths[bi], 1, plan.r)
    _check_mass(np.asarray(idx[bi]), scores, lengths[bi], plan.top_k)


def test_streaming_select_is_sinks_plus_recent():
  plan = _plan("streamingllm", 64, 8, budget=12, sink_size=4)
  cache, _ = _cache(0, 2, 1, 64, 8, [64, 9], plan.chunk_size)
  plan = plan.__class__(**{**plan.__dict__, "capacity": 64})
  idx = np.asarray(rocketkv.select(jnp.zeros((2, 2, 8)), cache, plan))
  np.testing.assert_array_equal(idx[0, 0], [0, 1, 2, 3] + list(range(56, 64)))
  np.testing.assert_array_equal(idx[1, 0], list(range(12)))


def test_top_k_at_least_length_selects_every_valid_slot():
  cache, _ = _cache(3, 1, 2, 40, 16, [17], 4)
  cfg = rocketkv.RocketConfig(token_budget=64, window_size=1, chunk_size=4, r=5, top_k=30)
  plan = rocketkv.plan(cfg, 40, 0, 16)
  idx = np.asarray(rocketkv.select(jnp.ones((1, 4, 16)), cache, plan))
  for h in range(2):
    assert set(range(17)) <= set(idx[0, h].tolist())


@pytest.mark.parametrize("impl", ["xla", "interpret", "interpret_tpu"])
def test_chunks_of_one_slot_keep_one_copy_of_the_keys(impl):
  """chunk_size 1 (SparQ; RocketKV's split at large budgets): `bounds` holds the keys once,
  dim-major ([B, Hkv, D, C], not kmin and kmax rows twice), kept so by `append`; the scores read
  from it equal those of the two-sided [2D, C] layout built from kmin = kmax = k, and Quest's
  bound on pages of one slot is q . k / sqrt(D) in float64."""
  b, hkv, c, d, g, r = 2, 2, 24, 16, 3, 5
  cache, k = _cache(7, b, hkv, c, d, [20, 9], 1)
  rng = np.random.default_rng(8)
  kn = jnp.asarray(rng.standard_normal((b, hkv, 1, d)), jnp.float32)
  cache = rocketkv.append(cache, kn, kn)
  k = np.asarray(cache.k, np.float64)
  assert cache.bounds.shape == (b, hkv, d, c)
  valid = np.arange(c)[None, :] < np.array([21, 10])[:, None]
  want = np.where(valid[:, None, None, :], np.swapaxes(k, 2, 3), 0.0)
  np.testing.assert_array_equal(np.asarray(cache.bounds, np.float64), want)
  np.testing.assert_array_equal(np.asarray(cache.kmin), np.asarray(cache.kmax))
  q = jnp.asarray(rng.standard_normal((b, g * hkv, d)), jnp.float32)
  from rocketkv_jax.select import approx_chunk_scores_xla, approx_scores, quest_bounds_scores_xla
  got = approx_scores(q, cache, r, impl=impl)
  two = approx_chunk_scores_xla(q, cache.kmin, cache.kmax, cache.length, 1, r)
  np.testing.assert_allclose(np.asarray(got), np.asarray(two), rtol=1e-6, atol=1e-7)
  quest = np.asarray(quest_bounds_scores_xla(q, cache.bounds, cache.length, 1))
  qn = np.asarray(q, np.float64).reshape(b, hkv, g, d)
  for bi, n in enumerate([21, 10]):
    logits = np.einsum("hgd,hcd->hgc", qn[bi], k[bi, :, :n]) / np.sqrt(d)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).sum(1)
    np.testing.assert_allclose(quest[bi, :, :n], p, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(quest[bi, :, n:], 0.0)


@pytest.mark.parametrize("budget,hkv", [(12, 3), (40, 3), (12, 1)])
def test_heads_shared_oracle_takes_the_best_mass_over_heads(budget, hkv):
  """exact_topk_heads: the layer's Hkv * top_k reads go to the largest exact masses over
  heads x valid slots (float64 reference), a head may take more or fewer than top_k, no slot
  twice, and the total is exact_topk's (Hkv = 1: the same read as exact_topk)."""
  b, g, c, d = 2, 2, 48, 16
  lengths = [48, 21]
  plan = _plan("exact_topk_heads", c, d, budget=budget)
  _, k = _cache(11, b, hkv, c, d, lengths, plan.chunk_size)
  k = k.copy()
  k[:, 0] *= 3.0  # head 0's attention peaked, the others' flat: the shares differ
  cache = rocketkv.full_cache(jnp.asarray(k), jnp.asarray(k), c, plan.chunk_size,
                              jnp.asarray(lengths, jnp.int32))
  q = np.random.default_rng(12).standard_normal((b, g * hkv, d)).astype(np.float32)
  idx = np.asarray(rocketkv.select(jnp.asarray(q), cache, plan))
  takes = []
  for bi in range(b):
    scores = ref.exact_slot_scores(q[bi], k[bi], lengths[bi])  # [Hkv, C], -inf past length
    total = min(hkv * plan.top_k, hkv * lengths[bi])
    want = np.sort(scores[np.isfinite(scores)])[::-1][:total].sum()
    got, n = 0.0, 0
    for h in range(hkv):
      row = idx[bi, h]
      assert len(set(row.tolist())) == len(row)
      mine = row[row < lengths[bi]]
      got += scores[h, mine].sum()
      n += len(mine)
      takes.append(len(mine))
    assert n == total
    np.testing.assert_allclose(got, want, rtol=1e-5)
  if hkv > 1 and budget == 12:
    assert len(set(takes)) > 1  # the read moved between heads
  if hkv == 1:
    same = np.asarray(rocketkv.select(jnp.asarray(q), cache, _plan("exact_topk", c, d,
                                                                    budget=budget)))
    for bi in range(b):
      a, e = idx[bi, 0], same[bi, 0]
      assert set(a[a < lengths[bi]].tolist()) == set(e[e < lengths[bi]].tolist())


@pytest.mark.parametrize("mass,hkv", [(0.5, 3), (0.9, 3), (0.99, 1), (1.0, 2)])
def test_mass_oracle_reads_the_fewest_rows_holding_the_mass(mass, hkv):
  """exact_topp: per head, the largest exact masses (float64 reference) until their sum
  reaches read_mass, and no fewer: the read varies per head, with no slot twice."""
  b, g, c, d = 2, 2, 48, 16
  lengths = [48, 21]
  plan = _plan("exact_topp", c, d, read_mass=mass)
  _, k = _cache(13, b, hkv, c, d, lengths, plan.chunk_size)
  k = k.copy()
  k[:, 0] *= 3.0  # head 0 peaked, the others flat: their reads differ
  cache = rocketkv.full_cache(jnp.asarray(k), jnp.asarray(k), c, plan.chunk_size,
                              jnp.asarray(lengths, jnp.int32))
  q = np.random.default_rng(14).standard_normal((b, g * hkv, d)).astype(np.float32)
  idx = np.asarray(rocketkv.select(jnp.asarray(q), cache, plan))
  assert idx.shape == (b, hkv, c)
  takes = []
  for bi in range(b):
    scores = ref.exact_slot_scores(q[bi], k[bi], lengths[bi]) / g  # [Hkv, C], sums to 1
    for h in range(hkv):
      row = idx[bi, h]
      assert len(set(row.tolist())) == len(row)
      mine = row[row < lengths[bi]]
      want = np.sort(scores[h, :lengths[bi]])[::-1]
      n = int(np.searchsorted(np.cumsum(want), mass - 1e-6)) + 1  # fewest holding the mass
      n = min(n, lengths[bi])
      assert abs(len(mine) - n) <= 1  # a float32 sum may cross the line one row apart
      np.testing.assert_allclose(scores[h, mine].sum(), want[:len(mine)].sum(), rtol=1e-5)
      assert scores[h, mine].sum() >= min(mass, 1.0) - 1e-5
      takes.append(len(mine))
  if hkv > 1 and mass < 1.0:
    assert len(set(takes)) > 1  # the read follows each head's attention


def test_mass_oracle_counts_its_reads():
  """exact_topp's state counts the rows each decode step read: the mean per head and step
  equals the selections' sizes (read back with `select` on the same states)."""
  b, hkv, g, c, d, new = 2, 2, 2, 40, 16, 3
  lengths = jnp.asarray([40, 17], jnp.int32)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=8, method="exact_topp",
                                             read_mass=0.8, window_size=4), c, new, d)
  rng = np.random.default_rng(5)
  k = jnp.asarray(rng.standard_normal((b, hkv, c, d)), jnp.float32)
  qw = jnp.asarray(rng.standard_normal((b, hkv * g, 4, d)), jnp.float32)
  state = rocketkv.prefill(k, k, qw, plan, lengths=lengths)
  want = np.zeros(b)
  for _ in range(new):
    q = jnp.asarray(rng.standard_normal((b, hkv * g, d)), jnp.float32)
    kn = jnp.asarray(rng.standard_normal((b, hkv, 1, d)), jnp.float32)
    method = rocketkv.methods.get("exact_topp")
    appended = state.replace(cache=rocketkv.append(state.cache, kn, kn))
    idx = np.asarray(rocketkv.select(q, appended, plan))
    want += (idx < plan.capacity).sum(-1).mean(-1)
    _, state = rocketkv.decode_step(q, kn, kn, state, plan)
  np.testing.assert_allclose(np.asarray(method.rows_read(state)), want / new, rtol=1e-6)
  assert np.all(want / new < np.asarray(lengths) + new)  # fewer than every row: it selected


def _two_heads_query(d=16):
  """One KV head, G = 2: head 0 loud on dims 0-7, head 1 ten times quieter and sharp on dims
  8-9. Summed |q| picks head 0's dims; normalized, head 1's two dims come first."""
  q = np.zeros((1, 2, d), np.float32)
  q[0, 0, :8] = 10.0 * np.array([1, -1, 1, -1, 1, -1, 1, -1])
  q[0, 1] = 0.05
  q[0, 1, 8:10] = [1.0, -1.0]
  return q


def test_group_dims_normalized_gives_a_quiet_head_its_dims():
  """The two rules pick different dims on the same query (so neither is a no-op), each as the
  float64 reference does; and the selection follows the reference under both."""
  from rocketkv_jax.ops import top_r_dims
  q = _two_heads_query()
  qg = jnp.asarray(q).reshape(1, 1, 2, -1)
  for rule, want in (("sum", set(range(2))), ("normalized", {8, 9})):
    ridx = np.asarray(top_r_dims(qg, 2, rule)[0])[0, 0]
    assert set(ridx.tolist()) == want
    np.testing.assert_array_equal(
        ridx, np.argsort(-ref.dim_weights(q[0], rule), kind="stable")[:2])
  c, d = 40, 16
  cache, k = _cache(3, 1, 1, c, d, [c], 2)
  for rule in rocketkv.GROUP_DIMS:
    plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=16, window_size=1, chunk_size=2, r=2,
                                               top_k=8, group_dims=rule), c, 0, d)
    idx = rocketkv.select(jnp.asarray(q), cache, plan)
    _check_mass(np.asarray(idx[0]), ref.approx_slot_scores(q[0], k[0], c, 2, 2, rule), c, 8)


def test_group_dims_reaches_the_plan_and_the_eval_specs():
  from rocketkv_jax.eval import variants
  for spec in ("rocketkv:group_dims=normalized", "sparq:group_dims=normalized",
               "rocketkv:stage2=quant,group_dims=normalized"):
    assert rocketkv.plan(variants.rocket_config(spec, 256), 4000, 24, 64).group_dims == \
        "normalized"
  assert rocketkv.plan(rocketkv.RocketConfig(token_budget=256), 4000, 24, 64).group_dims == "sum"
  with pytest.raises(ValueError,
                     match=r"^group_dims must be one of \['sum', 'normalized'\], got 'max'$"):
    rocketkv.RocketConfig(token_budget=256, group_dims="max")
  for kw in (dict(method="snapkv"), dict(stage2="lowrank")):
    with pytest.raises(ValueError, match=r"^group_dims='normalized' needs method in "
                                         r"\['rocketkv', 'rocketkv_mt', 'sparq'\]"):
      rocketkv.RocketConfig(token_budget=256, group_dims="normalized", **kw)
  with pytest.raises(ValueError, match=r"group_dims='mean' in .* must be one of"):
    variants.parse("rocketkv:group_dims=mean")

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rocketkv_jax as rocketkv
from rocketkv_jax import methods
from reference import plan_split


def test_paper_example():
  p = rocketkv.plan(rocketkv.RocketConfig(token_budget=256), 32668, 100, 128)
  # cr2 = 1618 / 256 = 6.3203; D * chunk / cr2 = 384 / 6.3203 = 60.76, truncated to 60.
  assert (p.capacity, p.prompt_budget, p.top_k, p.chunk_size, p.r) == (1618, 1518, 128, 3, 60)


@pytest.mark.parametrize("budget,capacity,r", [(128, 725, 33), (256, 1212, 40)])
def test_r_truncated_like_the_original(budget, capacity, r):
  # Prompt 4096 + 32 new, D 64: D * 3 / cr2 = 192 * B / capacity = 33.90 / 40.55; the original
  # code's int() gives 33 / 40 (rounding would give 34 / 41).
  p = rocketkv.plan(rocketkv.RocketConfig(token_budget=budget), 4096, 32, 64)
  assert (p.capacity, p.chunk_size, p.r) == (capacity, 3, r)


@pytest.mark.parametrize("prompt,new,budget,d", [
    (32668, 100, 256, 128), (131000, 72, 512, 128), (16000, 200, 1024, 64),
    (4000, 50, 128, 64), (8000, 500, 64, 64), (65536, 1, 4096, 128)])
def test_matches_formula_when_compressing(prompt, new, budget, d):
  p = rocketkv.plan(rocketkv.RocketConfig(token_budget=budget), prompt, new, d)
  assert (p.capacity, p.prompt_budget, p.top_k, p.chunk_size, p.r) == plan_split(
      prompt, new, budget, d)


def test_no_compression_keeps_everything():
  p = rocketkv.plan(rocketkv.RocketConfig(token_budget=4096), 1000, 20, 64)
  assert p.prompt_budget == 1000 and p.capacity == 1020
  # T = 1020 <= B: every slot is read (top_k = capacity, not B // 2 = 2048 > capacity).
  assert (p.chunk_size, p.r, p.top_k) == (1, 64, 1020)


def test_tiny():
  p = rocketkv.plan(rocketkv.RocketConfig(token_budget=32, window_size=4), 40, 2, 8)
  assert p.prompt_budget <= 40 and p.capacity == p.prompt_budget + 2
  assert 1 <= p.r <= 8 and p.chunk_size >= 1 and p.top_k == 16


def test_overrides():
  cfg = rocketkv.RocketConfig(token_budget=256, alpha=0.5, top_k=77, chunk_size=5, r=9)
  p = rocketkv.plan(cfg, 32668, 100, 128)
  t, cr = 32768, 32768 / 256
  assert p.capacity == max(int(t / cr**0.5), 200)
  assert (p.top_k, p.chunk_size, p.r) == (77, 5, 9)
  p2 = rocketkv.plan(dataclasses.replace(cfg, prompt_budget=900), 32668, 100, 128)
  assert (p2.prompt_budget, p2.capacity) == (900, 1000)


def test_config_hashable_and_static():
  a = rocketkv.RocketConfig(token_budget=256)
  b = rocketkv.RocketConfig(token_budget=256)
  assert hash(a) == hash(b) and a == b
  assert hash(rocketkv.plan(a, 1000, 10, 64)) == hash(rocketkv.plan(b, 1000, 10, 64))


def test_recommended_config():
  """`RocketConfig.recommended` is the README's configuration; fields override it, and an
  override that no longer fits raises the config's own error."""
  rec = rocketkv.RocketConfig.recommended(256)
  assert rec == rocketkv.RocketConfig(
      token_budget=256, method="rocketkv", stage2=rocketkv.Quant(capacity="equal_read"),
      window_reduce="max", group_dims="normalized")
  assert rec != rocketkv.RocketConfig(token_budget=256) and hash(rec) == hash(
      rocketkv.RocketConfig.recommended(256))
  p = rocketkv.plan(rec, 32668, 100, 128)
  assert (p.method, p.stage2.name, p.stage2.capacity, p.window_reduce, p.group_dims) == (
      "rocketkv", "quant", "equal_read", "max", "normalized")
  mt = rocketkv.RocketConfig.recommended(512, method="rocketkv_mt", window_size=16)
  assert (mt.method, mt.token_budget, mt.window_size, mt.group_dims) == (
      "rocketkv_mt", 512, 16, "normalized")
  with pytest.raises(ValueError, match=r"^stage2='quant' needs method in"):
    rocketkv.RocketConfig.recommended(256, method="snapkv")
  with pytest.raises(TypeError):
    rocketkv.RECOMMENDED["group_dims"] = "sum"  # read-only: a user cannot change it for all


@given(prompt=st.integers(64, 200_000), new=st.integers(0, 2000),
       budget=st.integers(32, 8192), d=st.sampled_from([64, 80, 128]))
@settings(max_examples=200, deadline=None)
def test_plan_invariants(prompt, new, budget, d):
  p = rocketkv.plan(rocketkv.RocketConfig(token_budget=budget), prompt, new, d)
  assert 32 <= p.prompt_budget <= prompt or p.prompt_budget == prompt
  assert p.capacity == p.prompt_budget + new
  assert p.capacity <= prompt + new
  assert 1 <= p.r <= d and p.chunk_size >= 1
  assert p.top_k == (budget // 2 if budget < prompt + new else p.capacity)
  cap, pb, _, chunk, r = plan_split(prompt, new, budget, d)
  if 32 <= pb <= prompt and cap <= prompt + new and budget < prompt + new:  # alpha >= 0.2
    assert (p.capacity, p.prompt_budget, p.chunk_size, p.r) == (cap, pb, chunk, r)


@pytest.mark.parametrize("method,budget,expect", [
    ("full", 64, dict(capacity=1010, prompt_budget=1000, top_k=0)),
    ("snapkv", 256, dict(capacity=266, prompt_budget=256, top_k=0)),
    ("streamingllm", 256, dict(capacity=266, prompt_budget=256, top_k=256)),
    ("quest", 256, dict(capacity=1010, chunk_size=16, top_k=256)),
    ("sparq", 256, dict(capacity=1010, chunk_size=1, top_k=128, r=16)),
    ("exact_topk", 256, dict(capacity=1010, top_k=256)),
])
def test_baseline_plans(method, budget, expect):
  p = rocketkv.plan(rocketkv.RocketConfig(token_budget=budget, method=method), 1000, 10, 64)
  for key, val in expect.items():
    assert getattr(p, key) == val, key


# The issue-41 measurements: with the paper's alpha unclamped (below 0 for B > ~10 T) a larger
# budget kept fewer tokens: 300-token prompt -> 281 kept at B=4096, 47 at B=100000.
@pytest.mark.parametrize("budget", [3000, 4096, 100_000])
def test_large_budget_keeps_everything(budget):
  p = rocketkv.plan(rocketkv.RocketConfig(token_budget=budget), 300, 0, 64)
  assert (p.prompt_budget, p.capacity, p.top_k) == (300, 300, 300)
  p = rocketkv.plan(rocketkv.RocketConfig(token_budget=budget), 106, 8, 16)
  assert (p.prompt_budget, p.capacity, p.top_k) == (106, 114, 114)


def _kept_read(method, p):
  """(tokens the cache holds after the last step, K/V tokens the last step reads)."""
  m = methods.get(method)
  kept = min(p.prompt_budget, p.prompt_len) + p.max_new_tokens
  return kept, m.tokens_read(p, min(p.prompt_budget, p.prompt_len), p.max_new_tokens)


METHOD_SPECS = sorted(rocketkv.METHODS) + ["rocketkv:rerank", "rocketkv:lowrank",
                                            "rocketkv:quant", "rocketkv_mt:quant"]


@given(prompt=st.integers(1, 5000), new=st.integers(0, 300), window=st.integers(1, 64),
       budgets=st.lists(st.integers(1, 12_000), min_size=2, max_size=6),
       d=st.sampled_from([8, 64, 128]))
@settings(max_examples=60, deadline=None)
def test_more_budget_never_keeps_or_reads_less(prompt, new, window, budgets, d):
  """Every method: kept and read are non-decreasing in B, equal T once B >= T; plans valid."""
  t = prompt + new
  budgets = sorted(set(budgets) | {t, t + 1, 10 * t + 7})
  for spec in METHOD_SPECS:
    method, _, stage2 = spec.partition(":")
    prev = (0, 0)
    for b in budgets:
      try:
        s2 = rocketkv.LowRank(rank=min(8, d)) if stage2 == "lowrank" else stage2 or "minmax"
        cfg = rocketkv.RocketConfig(token_budget=b, method=method, window_size=window,
                                    stage2=s2)
      except ValueError:  # B below the method's minimum (window, 2, sink): no plan at all
        assert b < max(window, 2, 5)
        continue
      p = rocketkv.plan(cfg, prompt, new, d)
      kept, read = _kept_read(method, p)
      assert p.capacity >= kept and 0 <= p.top_k <= p.capacity, (spec, b, p)
      assert p.chunk_size >= 1 or p.chunk_size == 0 and (
          method in ("full", "snapkv", "exact_topk", "exact_topk_heads", "exact_topp",
                     "streamingllm")
          or stage2 in ("lowrank", "quant")), (spec, b, p)
      assert 1 <= p.r <= d
      assert kept >= prev[0] and read >= prev[1], (spec, b, prev, (kept, read))
      if b >= t and method != "full":
        assert (kept, read) == (t, t), (spec, b, p)
      prev = (kept, read)

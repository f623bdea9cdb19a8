"""The engine's prefill in layer groups (`EngineConfig.prefill_layer_groups`) against
`rocketkv.generate`, and its scheduling: decode calls between a long prompt's group calls, a
cancel while prefilling, the bad values.

Reference: `generate` with `pad_to` = the engine's plan prompt length, one prompt at a time (as
tests/test_engine.py). Besides the fixtures' tiny Llama (2 layers) and Gemma 3 hybrid (3
layers: sliding, full, sliding), a 5-layer Llama of the same shapes (random weights) makes a
group boundary split a scanned run of like layers (layers 0-3 are one run: its parts are
joined along the layer axis).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax.models import llama
from rocketkv_jax.models.api import Model
from rocketkv_jax.runtime.engine import EngineConfig, SamplingParams
from model_fixtures import gemma3_checkpoint, hf_checkpoint
import test_engine
from test_engine import _reference

CONFIGS = {
    "full": rocketkv.RocketConfig(token_budget=64, method="full"),
    "rocketkv": rocketkv.RocketConfig(token_budget=64),
    "recommended": rocketkv.RocketConfig.recommended(64),
}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


_MODELS: dict = {}  # loaded once per module


@pytest.fixture(autouse=True, scope="module")
def _forget_models():
  yield
  _MODELS.clear()


def _model(name: str):
  if name not in _MODELS:
    if name == "gemma3":
      _MODELS[name] = rocketkv.models.load(gemma3_checkpoint()[0])
    elif name == "llama31":
      _MODELS[name] = rocketkv.models.load(hf_checkpoint("llama31")[0])
    else:  # "deep": 5 layers of the tiny Llama's shapes
      config = dataclasses.replace(_model("llama31").config, num_layers=5)
      params = llama.init_params(config, seed=1)
      # larger weights than init's 0.02 (as the fixtures'): less degenerate greedy choices
      _MODELS[name] = Model(config, jax.tree.map(lambda a: a * 4 if a.ndim == 2 else a, params))
  return _MODELS[name]


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 256, size=n).tolist() for n in lengths]


def _groups(eng, n: int) -> int:
  """Layer groups of an n-token prompt's prefill: G x its bucket's share of the longest
  bucket, rounded up, at least 1."""
  bucket, g = min(b for b in eng.buckets if b >= n), eng.config.prefill_layer_groups
  return max(1, min(g, math.ceil(g * bucket / eng.buckets[-1])))


def _engine(model, rc, groups, **kw):
  return test_engine._engine(model, rc, **{**dict(max_num_seqs=3, min_bucket=128,
                                                  prefill_layer_groups=groups), **kw})


@pytest.mark.parametrize("model_name,name,page_size,groups", [
    ("deep", "rocketkv", None, 2),
    ("deep", "recommended", 16, 5),
    ("deep", "full", None, 3),
    ("gemma3", "recommended", 16, 2),
    ("gemma3", "rocketkv", None, 3),
])
def test_layer_groups_equal_generate(model_name, name, page_size, groups):
  """Requests prefilled in layer groups (one batch joining, others waiting) decode
  `generate`'s greedy tokens; the programs are G per bucket used, not per request."""
  model, rc = _model(model_name), CONFIGS[name]
  kw = dict(max_model_len=200, max_new_tokens=40) if model_name == "gemma3" else {}
  eng = _engine(model, rc, groups, page_size=page_size, max_num_seqs=2, **kw)
  assert len(eng.layer_bounds) == groups + 1
  prompts = _prompts((30, 150, 90, 7))  # 4 requests, 2 slots: two wait, then join
  outs = eng.generate(prompts, GREEDY)
  for p, o in zip(prompts, outs):
    assert o.token_ids == _reference(model, eng, rc, p, GREEDY.max_tokens), (name, len(p))
  # a prompt of a one-group bucket is admitted in one call (not counted as groups)
  assert eng._counters["prefill_groups"] == sum(
      _groups(eng, len(p)) for p in prompts if _groups(eng, len(p)) > 1)
  extra = len(eng.batches) + 3 if eng.paged else 2  # decode(s), init (+ release, move)
  assert eng.num_programs <= sum(_groups(eng, b) for b in eng.buckets) + extra
  assert eng.stats().num_prefilling == 0 and eng.stats().kv_cache_usage == 0.0


def test_long_prompt_interleaves_with_decoding_and_cancel_frees_its_pages():
  """A long prompt arriving while two requests decode: each of its 3 group calls is followed by
  a decode call of the running ones (counted, not timed), and every token is `generate`'s;
  `warmup` compiled every program used. A request cancelled while prefilling gives its pages
  back: the pool is empty again."""
  model, rc = _model("deep"), CONFIGS["rocketkv"]
  eng = _engine(model, rc, 3, page_size=16)
  eng.warmup()  # compiles the group programs from their inputs' shapes: none compiles later
  programs = eng.num_programs
  assert eng.buckets == (128, 256)  # 2 groups for the short bucket, 3 for the long one
  assert programs == 2 + 3 + len(eng.batches) + 3
  events = []
  decode, group = eng._decode, eng._prefill_group

  def logged_decode():
    events.append(("decode", eng.stats().num_running))
    decode()

  def logged_group(p):
    events.append(("group", p.req.id, p.group))
    group(p)

  eng._decode, eng._prefill_group = logged_decode, logged_group
  short, long = _prompts((20, 40), seed=1), _prompts((230,), seed=2)[0]
  many = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
  handles = [eng.add_request(p, many) for p in short]
  while eng.stats().num_running < 2:
    eng.step()
  eng.step()
  events.clear()
  h = eng.add_request(long, GREEDY, request_id="long")
  eng.step()
  st = eng.stats()
  assert (st.num_prefilling, st.num_running, st.num_waiting) == (1, 2, 0)
  held = sum(map(len, eng._slot_pages)) + eng.pages_needed(len(long), GREEDY.max_tokens)
  assert st.kv_cache_usage == pytest.approx(held / (eng.num_pages - 1))  # its pages count
  while eng.stats().num_prefilling:
    eng.step()
  assert events == [("group", "long", 0), ("decode", 2), ("group", "long", 1), ("decode", 2),
                    ("group", "long", 2), ("decode", 3)]
  while eng.has_work():
    eng.step()
  for p, x in zip(short, handles):
    assert x.result().token_ids == _reference(model, eng, rc, p, many.max_tokens)
  assert h.result().token_ids == _reference(model, eng, rc, long, GREEDY.max_tokens)
  assert eng.num_programs == programs

  # cancelled while prefilling (after its first group): the pages come back, nothing runs
  eng.step()  # releases the ended requests' pages
  assert sorted(eng._free_pages) == list(range(1, eng.num_pages))
  h = eng.add_request(long, GREEDY)
  eng.step()
  assert eng.stats().num_prefilling == 1 and len(eng._free_pages) < eng.num_pages - 1
  h.cancel()
  eng.step()
  assert h.result().finish_reason == "abort" and not eng.has_work()
  st = eng.stats()
  assert (st.num_prefilling, st.num_running, st.kv_cache_usage) == (0, 0, 0.0)
  assert sorted(eng._free_pages) == list(range(1, eng.num_pages))


@pytest.mark.parametrize("groups,bounds", [
    (5, {128: (0, 1, 3, 5), 256: (0, 1, 2, 3, 4, 5)}),
    (2, {128: (0, 5), 256: (0, 2, 5)}),
])
def test_shorter_buckets_take_fewer_groups(groups, bounds):
  """G groups for the longest bucket, ceil(G x 128 / 256) for the half-length one (one group:
  admitted in one call), sizes differing by at most one; warmup compiles those only."""
  eng = _engine(_model("deep"), CONFIGS["rocketkv"], groups)
  assert eng.bucket_bounds == bounds and eng.layer_bounds == bounds[256]
  eng.warmup()
  assert eng.num_programs == sum(len(b) - 1 for b in bounds.values()) + 2  # + init, decode


def test_layer_groups_bad_values():
  rc = CONFIGS["rocketkv"]
  for bad in (0, -1, 1.5, True, None):
    with pytest.raises(ValueError, match=r"prefill_layer_groups must be an int in \[1, the "
                                         r"model's layers\], got"):
      EngineConfig(rc, prefill_layer_groups=bad)
  with pytest.raises(ValueError, match=r"prefill_layer_groups must be in \[1, 2\] \(at most the "
                                       r"model's 2 layers\), got 3"):
    _engine(_model("llama31"), rc, 3)

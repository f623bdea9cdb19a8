"""The serving engine (rocketkv_jax/runtime/engine.py) against `rocketkv.generate` and itself.

Reference: `generate` with `pad_to` = the engine's plan prompt length and the same
`max_new_tokens`, one prompt at a time (the engine plans once for every request, as
`generate` does for a nominal length).
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax.runtime import engine_programs
from rocketkv_jax.runtime.engine import (Engine, EngineClosed, EngineConfig, QueueFull,
                                         SamplingParams, decode_batches)
from rocketkv_jax.runtime.requests import Request
import method_specs
from model_fixtures import gemma3_checkpoint, hf_checkpoint, run_on_host_devices

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LENGTHS = (5, 40, 100, 200, 256, 17)


def _prompts(lengths=LENGTHS, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 256, size=n).tolist() for n in lengths]


def _model(name="llama31"):
  path = gemma3_checkpoint()[0] if name == "gemma3" else hf_checkpoint(name)[0]
  return rocketkv.models.load(path)


def _engine(model, rc, **kw):
  cfg = dict(max_model_len=320, max_new_tokens=64, max_num_seqs=4, min_bucket=32)
  cfg.update(kw)
  return Engine(model, EngineConfig(rc, **cfg))


def _reference(model, eng, rc, prompt, n):
  out = rocketkv.generate(model, [prompt], rocket_config=rc, max_new_tokens=eng.plan.max_new_tokens,
                          pad_to=eng.plan.prompt_len, eos_token_ids=())
  return out.tokens[0][:n]


CONFIGS = {
    "full": rocketkv.RocketConfig(token_budget=64, method="full"),
    "rocketkv": rocketkv.RocketConfig(token_budget=64),
    "recommended": rocketkv.RocketConfig.recommended(64),
    "snapkv": rocketkv.RocketConfig(token_budget=64, method="snapkv"),
}


@pytest.mark.parametrize("name", ["full", "rocketkv", "recommended"])
def test_batched_greedy_equals_generate_and_alone(name):
  model, rc = _model(), CONFIGS[name]
  eng = _engine(model, rc)
  prompts = _prompts()
  outs = eng.generate(prompts, GREEDY)  # 6 requests over 4 slots: two wait, then join
  for p, o in zip(prompts, outs):
    assert o.token_ids == _reference(model, eng, rc, p, GREEDY.max_tokens)
    assert o.finish_reason == "length" and o.completion_tokens == GREEDY.max_tokens
  alone = [eng.generate([p], GREEDY)[0].token_ids for p in prompts[:2]]
  assert alone == [o.token_ids for o in outs[:2]]
  # one admit program per bucket used, the init and the decode program: nothing per length
  assert eng.num_programs <= len(eng.buckets) + 2
  assert eng.stats().num_running == 0 and eng.stats().kv_cache_usage == 0.0


def test_gemma3_hybrid_layers_in_slots():
  model, rc = _model("gemma3"), CONFIGS["rocketkv"]
  eng = _engine(model, rc, max_model_len=200, max_new_tokens=40, max_num_seqs=2)
  assert eng.buckets[0] >= model.config.sliding_window or eng.buckets == (eng.plan.prompt_len,)
  prompts = _prompts((7, 90, 150))
  outs = eng.generate(prompts, GREEDY)
  for p, o in zip(prompts, outs):
    assert o.token_ids == _reference(model, eng, rc, p, GREEDY.max_tokens)


def test_steps_per_call_changes_no_token():
  model, rc = _model(), CONFIGS["rocketkv"]
  prompts = _prompts((30, 120, 9))
  one = _engine(model, rc, max_num_seqs=2).generate(prompts, GREEDY)
  four = _engine(model, rc, max_num_seqs=2, steps_per_call=4).generate(prompts, GREEDY)
  assert [o.token_ids for o in one] == [o.token_ids for o in four]


def test_pool_size_sets_the_slots_and_compression_fits_more():
  model = _model()
  full = _engine(model, CONFIGS["full"], max_num_seqs=64)
  snap = _engine(model, CONFIGS["snapkv"], max_num_seqs=64)
  leaves = jax.tree.leaves(jax.eval_shape(lambda s: s, full.state))
  assert full.slot_bytes * full.num_slots == sum(x.size * x.dtype.itemsize for x in leaves)
  mb = 3 * full.slot_bytes / 2**20
  assert _engine(model, CONFIGS["full"], max_num_seqs=64, kv_cache_mb=mb).num_slots == 3
  n = _engine(model, CONFIGS["snapkv"], max_num_seqs=64, kv_cache_mb=mb).num_slots
  assert n == int(3 * full.slot_bytes // snap.slot_bytes) and n > 3
  with pytest.raises(ValueError, match="kv_cache_mb must hold one request"):
    _engine(model, CONFIGS["full"], kv_cache_mb=full.slot_bytes / 2**21)


def test_requests_that_can_never_run_are_value_errors():
  eng = _engine(_model(), CONFIGS["rocketkv"])
  with pytest.raises(ValueError, match="at most 256 are accepted"):
    eng.add_request([5] * 257, GREEDY)
  with pytest.raises(ValueError, match="max_model_len 320"):
    eng.add_request([5] * 250, SamplingParams(max_tokens=71))
  with pytest.raises(ValueError, match=r"max_tokens must be <= \d+ for a prompt"):
    eng.add_request([5] * 250, SamplingParams(max_tokens=eng.plan.capacity - eng.plan.prompt_budget + 1))
  with pytest.raises(ValueError, match="ints in"):
    eng.add_request([5, 300], GREEDY)
  with pytest.raises(ValueError, match="at least one token"):
    eng.add_request([], GREEDY)
  for bad in (dict(max_tokens=0), dict(temperature=float("nan")), dict(temperature=-1.0),
              dict(top_p=0.0), dict(seed=-1), dict(stop=("",))):
    with pytest.raises(ValueError):
      SamplingParams(**bad)
  with pytest.raises(ValueError, match="max_new_tokens must be < max_model_len"):
    EngineConfig(CONFIGS["full"], max_model_len=64, max_new_tokens=64)


def test_queue_is_bounded_cancel_frees_the_slot_and_shutdown_aborts():
  eng = _engine(_model(), CONFIGS["snapkv"], max_num_seqs=2, max_waiting=3)
  long = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
  handles = [eng.add_request(p, long) for p in _prompts((10, 20, 30))]
  with pytest.raises(QueueFull):
    eng.add_request([4, 5], long)
  eng.step()  # two admitted, one waits
  assert eng.stats().num_running == 2 and eng.stats().num_waiting == 1
  assert 0 < eng.stats().kv_cache_usage <= 1
  handles[0].cancel()
  handles[2].cancel()
  eng.step()
  assert eng.stats().num_running == 1 and eng.stats().num_waiting == 0
  assert handles[0].result().finish_reason == "abort"
  assert handles[2].result().finish_reason == "abort"
  eng.start()
  eng.shutdown(timeout=0.0)
  assert handles[1].result().finish_reason in ("abort", "length")
  assert eng.stats().num_running == 0 and eng.stats().kv_cache_usage == 0.0
  with pytest.raises(EngineClosed):
    eng.add_request([4, 5], long)


def test_threaded_engine_serves_concurrent_clients():
  model, rc = _model(), CONFIGS["rocketkv"]
  eng = _engine(model, rc, max_num_seqs=3, steps_per_call=2)
  prompts = _prompts((12, 60, 33, 130, 8, 77, 250, 41))
  alone = eng.generate(prompts, GREEDY)
  eng.start()
  results = [None] * len(prompts)

  def client(i):
    results[i] = eng.add_request(prompts[i], GREEDY).result()

  threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  eng.shutdown()
  assert [r.token_ids for r in results] == [a.token_ids for a in alone]


def test_sampling_is_seeded_per_request_and_min_tokens_bans_eos():
  model = _model()
  eng = _engine(model, CONFIGS["full"])
  p = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
  a, b = eng.generate([[5, 6, 7]] * 2, p)  # two slots, same seed: the same draw
  c = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=10, temperature=1.0, seed=8,
                                                ignore_eos=True))[0]
  assert a.token_ids == b.token_ids != c.token_ids
  narrow = SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True)
  assert eng.generate([[5, 6, 7]], narrow)[0].token_ids == eng.generate([[5, 6, 7]],
                                                                         GREEDY)[0].token_ids[:10]
  # min_tokens: the first token's logits without the ban pick EOS for this row
  logits = np.zeros((2, 8), np.float32)
  logits[:, 2] = 5.0
  ban = engine_programs._ban(np.array([2], np.int32), np.array([0, 3]), np.array([1, 1]), 8)
  got = engine_programs.sample_rows(logits, np.zeros(2, np.float32), np.ones(2, np.float32),
                                    np.zeros((2, 2), np.uint32), ban)
  assert got.tolist()[1] == 2 and got.tolist()[0] != 2


def test_top_p_sampling_matches_its_definition():
  # rows: nucleus of mass >= top_p; here the two top tokens hold 0.9 of the mass
  probs = np.array([0.6, 0.3, 0.05, 0.05])
  logits = np.log(probs)[None].repeat(2000, 0).astype(np.float32)
  keys = jax.vmap(jax.random.PRNGKey)(np.arange(2000))
  got = np.asarray(engine_programs.sample_rows(
      logits, np.ones(2000, np.float32), np.full(2000, 0.85, np.float32), keys,
      np.zeros((2000, 4), bool)))
  assert set(got.tolist()) == {0, 1}
  assert abs((got == 0).mean() - 0.6 / 0.9) < 0.05


class _Chars:
  """A detokenizer: token t is chr(t)."""

  def __call__(self, ids):
    return "".join(chr(t) for t in ids)


def test_request_stop_strings_eos_and_streamed_text():
  p = SamplingParams(max_tokens=20, stop=("END",), temperature=0.0)
  r = Request("r", [1], p, _Chars(), eos_ids=[0])
  r.add_tokens([ord(c) for c in "abE"])
  r.add_tokens([ord(c) for c in "Nx"])   # "EN" might start "END": held back
  r.add_tokens([ord(c) for c in "yEND!"])
  outs = []
  while not r.queue.empty():
    outs.append(r.queue.get())
  assert [o.text for o in outs] == ["ab", "ENx", "y"]
  assert outs[-1].finished and outs[-1].finish_reason == "stop"
  r = Request("e", [1], SamplingParams(max_tokens=5, min_tokens=2), _Chars(), eos_ids=[0])
  r.add_tokens([65, 0, 66, 0, 67])  # EOS before min_tokens is kept as a token, then stops
  assert r.generated == [65, 0, 66] and r.finish_reason == "stop"
  r = Request("l", [1], SamplingParams(max_tokens=2, ignore_eos=True), _Chars(), eos_ids=[0])
  r.add_tokens([0, 0, 0])
  assert r.generated == [0, 0] and r.finish_reason == "length"


def test_prefill_tokens_per_step_interleaves_admissions_with_decoding():
  model, rc = _model(), CONFIGS["snapkv"]
  prompts = _prompts((100, 100, 100, 30))
  eng = _engine(model, rc, prefill_tokens_per_step=150)
  handles = [eng.add_request(p, GREEDY) for p in prompts]
  running = []
  while eng.has_work():
    eng.step()
    running.append(eng.stats().num_running)
  # two 100-token prompts reach 150 tokens: one step admits 2, the next the other 2
  assert running[:2] == [2, 4]
  alone = _engine(model, rc).generate(prompts, GREEDY)
  assert [h.result().token_ids for h in handles] == [o.token_ids for o in alone]
  with pytest.raises(ValueError, match="prefill_tokens_per_step"):
    EngineConfig(rc, prefill_tokens_per_step=0)


# ---------------------------------------------------------------- the paged pool
@pytest.mark.parametrize("name", ["full", "snapkv", "rocketkv", "recommended"])
def test_paged_pool_equals_generate(name):
  """Pages of 16 tokens shared by 4 slots: every request's greedy tokens are `generate`'s, and
  every page is free again once they end."""
  model, rc = _model(), CONFIGS[name]
  eng = _engine(model, rc, page_size=16)
  assert eng.paged and eng.num_pages == 4 * eng.pages_per_seq + 1
  assert eng.pages_per_seq * eng.page_size >= eng.plan.capacity
  prompts = _prompts()
  outs = eng.generate(prompts, GREEDY)
  for p, o in zip(prompts, outs):
    assert o.token_ids == _reference(model, eng, rc, p, GREEDY.max_tokens)
  assert eng.stats().kv_cache_usage == 0.0
  eng.step()  # releases the last slots' pages
  assert sorted(eng._free_pages) == list(range(1, eng.num_pages))
  assert eng.num_programs <= len(eng.buckets) + len(eng.batches) + 3  # + release, move


@pytest.mark.parametrize("name", ["rocketkv", "recommended"])
def test_paged_busy_slots_move_first(name):
  """Requests ending at different steps leave holes that the last busy slots move into; each
  decode call then runs only the first slots. Every request still gets `generate`'s tokens."""
  model, rc = _model(), CONFIGS[name]
  eng = _engine(model, rc, page_size=16, max_num_seqs=4)
  prompts = _prompts((30, 60, 90, 120, 150, 45), seed=3)
  limits = (2, 14, 4, 9, 3, 6)
  handles = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
             for p, n in zip(prompts, limits)]
  rows = []
  while eng.has_work():
    eng.step()
    rows.append(eng._decode_rows())
  assert eng._counters["moves"] > 0 and min(rows) < eng.num_slots
  for p, n, h in zip(prompts, limits, handles):
    assert h.result().token_ids == _reference(model, eng, rc, p, n)


def test_paged_gemma3_hybrid_layers():
  """Gemma 3's sliding layers keep per-slot window caches beside the global layers' pages (and
  move with their request)."""
  model, rc = _model("gemma3"), CONFIGS["recommended"]
  eng = _engine(model, rc, max_model_len=200, max_new_tokens=40, max_num_seqs=2, page_size=16)
  assert any(eng.sliding_groups) and not all(eng.sliding_groups)
  prompts, limits = _prompts((7, 90, 150)), (3, 12, 6)
  handles = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
             for p, n in zip(prompts, limits)]
  while eng.has_work():
    eng.step()
  assert eng._counters["moves"] > 0
  for p, n, h in zip(prompts, limits, handles):
    assert h.result().token_ids == _reference(model, eng, rc, p, n)


def test_paged_admission_waits_for_pages():
  """A pool of one long request's pages: two long requests run one after the other, short
  ones share it; all answers are `generate`'s, and the pool never hands out a page twice."""
  model, rc = _model(), CONFIGS["full"]
  probe = _engine(model, rc, page_size=16)
  mb = (probe.slot_fixed_bytes * 4 + probe.page_bytes * (probe.pages_per_seq + 1)) / 2**20
  eng = _engine(model, rc, page_size=16, kv_cache_mb=mb)
  assert eng.num_pages - 1 == eng.pages_per_seq
  long_p, short_p = _prompts((200, 220), seed=1), _prompts((20, 30, 40), seed=2)
  params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
  assert all(eng.pages_needed(len(p), 12) > eng.pages_per_seq // 2 for p in long_p)
  assert sum(eng.pages_needed(len(p), 12) for p in short_p) <= eng.pages_per_seq
  handles = [eng.add_request(p, params) for p in long_p + short_p]
  running = []
  while eng.has_work():
    eng.step()
    running.append(eng.stats().num_running)
    held = [p for pages in eng._slot_pages for p in pages]
    assert len(held) == len(set(held)) and not set(held) & set(eng._free_pages)
  assert max(running) == 3  # the three short ones together; the long ones alone
  for p, h in zip(long_p + short_p, handles):
    assert h.result().token_ids == _reference(model, eng, rc, p, 12)


def test_paged_admission_checks_what_stage1_kept():
  """A state that keeps more tokens than the pages taken for it (a method whose kept-token bound
  is wrong) ends its request with an error instead of reading the scratch page; the pool
  stays consistent and the next request is exact."""
  model, rc = _model(), CONFIGS["snapkv"]
  eng = _engine(model, rc, page_size=16)
  bound = eng._kept
  eng._kept = lambda n: 1  # pylint: disable=protected-access
  params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
  bad = eng.generate(_prompts((100,)), params)[0]
  assert bad.finish_reason == "error" and "internal error" in bad.error
  eng._kept = bound
  p = _prompts((90,), seed=5)[0]
  assert eng.generate([p], params)[0].token_ids == _reference(model, eng, rc, p, 4)
  eng.step()
  assert sorted(eng._free_pages) == list(range(1, eng.num_pages))


def test_paged_config_errors():
  model = _model()
  with pytest.raises(ValueError, match="page_size must be None or an int >= 1"):
    EngineConfig(CONFIGS["full"], page_size=0)
  with pytest.raises(ValueError, match="impl must be 'auto' or 'xla' with page_size"):
    EngineConfig(CONFIGS["full"], page_size=16, impl="pallas")
  with pytest.raises(ValueError, match="kv_cache_mb must hold the 4 slots"):
    _engine(model, CONFIGS["full"], page_size=16, kv_cache_mb=0.01)


def _spec_config(spec):
  name, _, extra = spec.partition(":")
  kw = dict(token_budget=64, method=name, window_size=8, sink_size=2, page_size=8)
  if extra == "skip_layers":
    kw["skip_layers"] = 2
  elif extra:
    kw["stage2"] = method_specs.stage2_of(extra)
  return rocketkv.RocketConfig(**kw)


NOT_PAGED = {"exact_topp", "rocketkv:lowrank", "rocketkv:skip_layers"}  # + rocketkv_mt


@pytest.mark.parametrize("spec", method_specs.SPECS)
def test_every_method_in_pages(spec):
  """Every method and stage-2 variant in a paged pool: `generate`'s greedy tokens, or (a state
  the pages do not hold) a one-line ValueError before anything runs."""
  model, rc = _model(), _spec_config(spec)
  if spec in NOT_PAGED or spec.startswith("rocketkv_mt"):
    with pytest.raises(ValueError, match="page_size needs (a method whose decode state is a "
                                         "KVCache or a QuantState|every layer's cache of the)"):
      _engine(model, rc, page_size=16, min_bucket=128)
    return
  eng = _engine(model, rc, page_size=16, min_bucket=128, max_num_seqs=2)
  prompts = _prompts((40, 200))
  params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
  for p, o in zip(prompts, eng.generate(prompts, params)):
    assert o.token_ids == _reference(model, eng, rc, p, 6), spec


_TP_SCRIPT = """
    from rocketkv_jax.runtime.engine import Engine, EngineConfig, SamplingParams
    path = {path!r}
    single = M.load(path)
    tp = M.load(path, mesh=sharding.make_mesh(2))
    prompts = [random_tokens(1, n, seed=n)[0].tolist() for n in (48, 33, 70)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for page in (None, 16):
      for rc in (rocketkv.RocketConfig(token_budget=32, method="full"),
                 rocketkv.RocketConfig.recommended(32)):
        cfg = EngineConfig(rc, max_model_len=160, max_new_tokens=32, max_num_seqs=2,
                           min_bucket=64, page_size=page)
        want = [o.token_ids for o in Engine(single, cfg).generate(prompts, params)]
        eng = Engine(tp, cfg)
        got = [o.token_ids for o in eng.generate(prompts, params)]
        assert got == want, (page, rc.method, got, want)
        k = eng.state.groups[0].cache.k_raw if hasattr(eng.state.groups[0], "cache") else (
            eng.state.groups[0].k_raw)
        assert k.sharding.spec[2 if k.ndim == 5 else 1] == "tp", k.sharding  # KV heads split
    print("TP-OK")
"""


def test_tensor_parallel_engine_matches_one_device():
  """The engine on a 2-device "tp" mesh (forced CPU host devices, in a child process), slots
  and pages: the KV heads split over the devices, the tokens of one device."""
  path, _ = hf_checkpoint("llama_tp")
  out = run_on_host_devices(_TP_SCRIPT.format(path=path), devices=2)
  assert out.returncode == 0 and "TP-OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.parametrize("slots, want", [
    (1, (1,)), (3, (1, 2, 3)), (8, (1, 2, 4, 8)), (9, (1, 2, 4, 8, 9)),
    (64, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)),
    (70, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 70))])
def test_decode_batches_pad_fewer_than_8_rows(slots, want):
  got = decode_batches(slots)
  assert got == want
  for busy in range(5, slots + 1):  # past 4 busy slots, under 8 idle rows
    assert 0 <= min(b for b in got if b >= busy) - busy < 8

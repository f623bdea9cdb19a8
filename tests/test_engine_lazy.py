"""Lazy page allocation with preemption (`EngineConfig(page_allocation="lazy")`) against
reserved pages and `rocketkv.generate`.

A pool too small for every request's worst case at once: lazily paged requests run more at
once, the pool runs dry mid-decode, the most recently admitted request is preempted and later
recomputed from its prompt, and its output is still exactly its alone result (greedy, or seeded
sampling), streamed once, stop strings and counters as if it had run through. Reference:
`generate` with `pad_to` = the engine's plan prompt length (tests/test_engine.py's helpers).
"""

from __future__ import annotations

import threading
import types

import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax.runtime.engine import EngineConfig, EngineStats, SamplingParams
from rocketkv_jax.runtime.requests import Request
from model_fixtures import gemma3_checkpoint, hf_checkpoint
from test_engine import CONFIGS, _engine, _prompts, _reference

PAGE = 16
LONG = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
LENGTHS = (20, 30, 12, 25, 8, 31)  # one length bucket: few programs to compile

_MODELS: dict = {}  # loaded once per module


@pytest.fixture(autouse=True, scope="module")
def _forget_models():
  yield
  _MODELS.clear()


def _model(name="llama31"):
  if name not in _MODELS:
    path = gemma3_checkpoint()[0] if name == "gemma3" else hf_checkpoint(name)[0]
    _MODELS[name] = rocketkv.models.load(path)
  return _MODELS[name]


def _tight(model, rc, allocation, pages=None, **kw):
  """An engine whose pool holds `pages` pages (default: one request of the plan's capacity,
  the least the engine accepts), less than every request's worst case at once."""
  probe = _engine(model, rc, page_size=PAGE, **kw)
  pages = pages or probe.pages_per_seq
  mb = (probe.slot_fixed_bytes * probe.num_slots + probe.page_bytes * (pages + 1)) / 2**20
  eng = _engine(model, rc, page_size=PAGE, kv_cache_mb=mb, page_allocation=allocation, **kw)
  assert eng.num_pages - 1 == pages
  return eng


def _spy_preemptions(eng):
  """[(request id, tokens it had generated)] of every preemption, as they happen."""
  log = []
  preempt = eng._preempt  # pylint: disable=protected-access

  def spy(req):
    log.append((req.id, len(req.generated)))
    preempt(req)

  eng._preempt = spy
  return log


def _check_pool(eng):
  """No page is held twice or held and free; usage is the held pages over the pool's."""
  held = [p for pages in eng._slot_pages for p in pages] + [
      p for pre in eng._prefilling for p in pre.pages]
  assert len(held) == len(set(held)) and not set(held) & set(eng._free_pages)
  assert eng.stats().kv_cache_usage == pytest.approx(len(held) / (eng.num_pages - 1))


def _drain(eng):
  """Steps until no request is left; returns the running count after each step."""
  running = []
  while eng.has_work():
    eng.step()
    running.append(eng.stats().num_running)
    _check_pool(eng)
  return running


def _assert_empty(eng):
  eng.step()  # the last requests' pages come back at the next step
  assert sorted(eng._free_pages) == list(range(1, eng.num_pages))
  st = eng.stats()
  assert st.kv_cache_usage == 0.0 and st.num_running == st.num_waiting == 0


@pytest.mark.parametrize("name,kw", [
    ("full", {}),
    ("rocketkv", {"prefill_layer_groups": 2, "min_bucket": 256}),  # one bucket: 2 groups each
    ("recommended", {"steps_per_call": 3}),
])
def test_lazy_runs_more_at_once_and_preempted_requests_stay_exact(name, kw):
  """(a) more requests run at once than with reserved pages, (b) every request's greedy tokens
  are its alone result, those of the preempted ones included, and the counters count each
  token once; the pool is empty at the end."""
  model, rc = _model(), CONFIGS[name]
  prompts = _prompts(LENGTHS, seed=4)
  runs = {}
  for allocation in ("reserve", "lazy"):
    eng = _tight(model, rc, allocation, **kw)
    assert sum(eng.pages_needed(len(p), LONG.max_tokens) for p in prompts[:4]) > (
        eng.num_pages - 1)
    log = _spy_preemptions(eng)
    handles = [eng.add_request(p, LONG) for p in prompts]
    running = _drain(eng)
    runs[allocation] = (eng, log, running, [h.result() for h in handles])
    _assert_empty(eng)
  (lazy, log, lazy_running, outs), (_, none, reserve_running, reserved) = (runs["lazy"],
                                                                           runs["reserve"])
  assert not none and reserve_running and max(lazy_running) > max(reserve_running)
  assert log and lazy.stats().num_preemptions == len(log) > 0
  assert lazy.stats().recomputed_tokens_total == sum(n for _, n in log) > 0
  for p, o, r in zip(prompts, outs, reserved):
    want = _reference(model, lazy, rc, p, LONG.max_tokens)
    assert o.token_ids == want == r.token_ids, (name, len(p))
    assert o.finish_reason == "length" and o.completion_tokens == LONG.max_tokens
  st = lazy.stats()
  assert st.generation_tokens_total == len(prompts) * LONG.max_tokens
  assert st.requests_finished_total == len(prompts)
  assert st.prompt_tokens_total == sum(map(len, prompts))


def test_a_prefilling_request_is_preempted_first():
  """In layer groups a request admitted (its pages taken) but still prefilling is the latest
  admitted: it is the first preempted, and recomputed exactly. Requests arrive while others
  decode, and admission keeps no watermark, so that the pool runs dry during a prefill."""
  model, rc = _model(), CONFIGS["rocketkv"]
  prompts = _prompts((20, 30, 12, 25, 8, 31, 15, 27), seed=4)
  eng = _tight(model, rc, "lazy", prefill_layer_groups=2, min_bucket=256)  # 2 groups each
  eng._watermark = lambda: 0
  kinds = []
  preempt = eng._preempt

  def spy(req):
    kinds.append("prefilling" if any(p.req is req for p in eng._prefilling) else "running")
    preempt(req)

  eng._preempt = spy
  handles, steps = [], 0
  while len(handles) < len(prompts) or eng.has_work():
    if len(handles) < len(prompts) and steps % 3 == 0:
      handles.append(eng.add_request(prompts[len(handles)], LONG))
    eng.step()
    _check_pool(eng)
    steps += 1
  assert "prefilling" in kinds
  for p, h in zip(prompts, handles):
    assert h.result().token_ids == _reference(model, eng, rc, p, LONG.max_tokens)
  _assert_empty(eng)


def test_seeded_sampling_is_the_same_with_and_without_preemption():
  """(c) temperature > 0, a seed per request, two steps per call (a replay ends inside a
  call): the tokens of a roomy pool's run, preempted or not."""
  model, rc = _model(), CONFIGS["full"]
  prompts = _prompts(LENGTHS, seed=7)
  params = [SamplingParams(max_tokens=60, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
            for i in range(len(prompts))]
  roomy = _engine(model, rc, page_size=PAGE, steps_per_call=2, page_allocation="lazy")
  want = [roomy.add_request(p, q) for p, q in zip(prompts, params)]
  _drain(roomy)
  assert roomy.stats().num_preemptions == 0
  eng = _tight(model, rc, "lazy", steps_per_call=2)
  log = _spy_preemptions(eng)
  got = [eng.add_request(p, q) for p, q in zip(prompts, params)]
  _drain(eng)
  assert log and any(n > 0 for _, n in log)
  want = [h.result().token_ids for h in want]
  assert [h.result().token_ids for h in got] == want
  assert want[0] != _reference(model, eng, rc, prompts[0], 60)  # it did sample
  _assert_empty(eng)


def _chars(ids):
  """A detokenizer: one distinct character per token id."""
  return "".join(chr(0x4E00 + int(t)) for t in ids)


def test_streaming_never_repeats_and_stop_strings_work_after_a_replay():
  """(d) A preempted request's stream holds each token once, and a stop string it reaches after
  its replay ends it there (the text before it, finish_reason "stop")."""
  model, rc = _model(), CONFIGS["full"]
  prompts = _prompts((60, 50, 40, 55, 45, 35), seed=4)  # a preemption comes early
  first = _tight(model, rc, "lazy")
  log = _spy_preemptions(first)
  ids = [first.add_request(p, LONG).request_id for p in prompts]
  _drain(first)

  def stop_after(rid, done):
    """A two-token stop string first seen after the tokens it had sent when preempted."""
    ref = _reference(model, first, rc, prompts[ids.index(rid)], LONG.max_tokens)
    return next((i for i in range(done + 1, len(ref) - 1)
                 if _chars(ref[i:i + 2]) not in _chars(ref[:i + 1])), None), ref

  rid, done, s, ref = next((rid, done, *stop_after(rid, done)) for rid, done in log
                           if done > 0 and stop_after(rid, done)[0] is not None)
  k = ids.index(rid)
  eng = _tight(model, rc, "lazy")
  eng.tokenizer = types.SimpleNamespace(decode=_chars)
  log = _spy_preemptions(eng)
  events = {i: [] for i in range(len(prompts))}
  for i, p in enumerate(prompts):
    params = LONG if i != k else SamplingParams(max_tokens=60, temperature=0.0,
                                                ignore_eos=True, stop=(_chars(ref[s:s + 2]),))
    eng.add_request(p, params, on_output=events[i].append)
  _drain(eng)
  assert (rid, done) in log  # the same preemption as without the stop string
  for i, p in enumerate(prompts):
    streamed = [t for e in events[i] for t in e.token_ids]
    last = events[i][-1]
    assert last.finished and sum(e.finished for e in events[i]) == 1
    counts = [e.completion_tokens for e in events[i]]
    assert counts == sorted(counts) and last.completion_tokens == len(streamed)
    want = ref[:s + 2] if i == k else _reference(model, eng, rc, p, LONG.max_tokens)
    assert streamed == want
    text = "".join(e.text for e in events[i])
    assert text == _chars(want[:s] if i == k else want)
    assert last.finish_reason == ("stop" if i == k else "length")
  _assert_empty(eng)


def test_cancel_during_replay_frees_every_page():
  """(e) A request cancelled while it regenerates its tokens after a preemption ends with
  "abort", having streamed each token once; every page is free afterwards."""
  model, rc = _model(), CONFIGS["full"]
  prompts = _prompts(LENGTHS, seed=4)
  eng = _tight(model, rc, "lazy")
  log = _spy_preemptions(eng)
  handles = [eng.add_request(p, LONG) for p in prompts]
  victim = None
  while eng.has_work():
    eng.step()
    _check_pool(eng)
    if victim is None:
      for rid, n in log:
        req = eng._requests.get(rid)
        if n > 3 and req is not None and req in eng._slots and req.replaying:
          victim = rid
          eng.abort(rid)
          break
  assert victim is not None
  k = [h.request_id for h in handles].index(victim)
  events = list(handles[k])
  assert events[-1].finish_reason == "abort"
  streamed = [t for e in events for t in e.token_ids]
  assert streamed == _reference(model, eng, rc, prompts[k], LONG.max_tokens)[:len(streamed)]
  assert len(streamed) == events[-1].completion_tokens
  for i, h in enumerate(handles):
    if i != k:
      assert h.result().token_ids == _reference(model, eng, rc, prompts[i], LONG.max_tokens)
  _assert_empty(eng)


def test_threaded_lazy_engine_serves_concurrent_clients():
  """The engine's own thread (as the server runs it) with clients on theirs: preemptions, and
  every answer its alone result."""
  model, rc = _model(), CONFIGS["full"]
  prompts = _prompts(LENGTHS, seed=4)
  eng = _tight(model, rc, "lazy")
  results = [None] * len(prompts)
  queued = threading.Barrier(len(prompts) + 1)  # all queued before the loop starts: it preempts

  def client(i):
    handle = eng.add_request(prompts[i], LONG)
    queued.wait()
    results[i] = handle.result()

  threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
  for t in threads:
    t.start()
  queued.wait()
  eng.start()
  for t in threads:
    t.join(120)
  eng.shutdown()
  assert eng.stats().num_preemptions > 0
  for p, r in zip(prompts, results):
    assert r.token_ids == _reference(model, eng, rc, p, LONG.max_tokens)


def test_paged_gemma3_hybrid_lazy():
  """(g) Gemma 3's sliding layers (per-slot window caches) beside lazily paged global layers:
  two long requests run together where reserved pages run one, one is preempted, both exact."""
  model, rc = _model("gemma3"), CONFIGS["recommended"]
  kw = dict(max_model_len=200, max_new_tokens=40, max_num_seqs=2)
  prompts = _prompts((70, 75, 65), seed=2)
  params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
  running = {}
  for allocation in ("reserve", "lazy"):
    eng = _tight(model, rc, allocation, **kw)
    assert any(eng.sliding_groups) and not all(eng.sliding_groups)
    log = _spy_preemptions(eng)
    handles = [eng.add_request(p, params) for p in prompts]
    running[allocation] = max(_drain(eng))
    for p, h in zip(prompts, handles):
      assert h.result().token_ids == _reference(model, eng, rc, p, 40), allocation
    _assert_empty(eng)
  assert log and running["lazy"] > running["reserve"]


def test_replay_checks_the_regenerated_tokens():
  """`Request` after a preemption: regenerated tokens are not emitted again; a token that
  differs from the one sent ends the request with an error, streaming nothing of it."""
  p = SamplingParams(max_tokens=6, temperature=0.0)
  r = Request("r", [1], p, _chars, eos_ids=[0])
  r.add_tokens([5, 6, 7])
  r.preempt()
  assert r.replaying
  r.add_tokens([5])
  r.add_tokens([6, 7, 8])
  r.add_tokens([9])
  outs = []
  while not r.queue.empty():
    outs.append(r.queue.get())
  assert [o.token_ids for o in outs] == [[5, 6, 7], [8], [9]]
  assert [o.completion_tokens for o in outs] == [3, 4, 5] and not r.replaying
  r.preempt()
  r.add_tokens([5, 6, 3])  # the third differs from the 7 sent
  out = r.queue.get()
  assert r.queue.empty() and out.finished and out.finish_reason == "error"
  assert out.token_ids == [] and out.text == "" and "preemption" in out.error
  assert r.generated == [5, 6, 7, 8, 9]


def test_page_allocation_values_flag_and_metric():
  """(f) A bad value is a one-line ValueError; "lazy" without pages changes nothing; the
  server's flag; the preemption counter on /metrics."""
  for bad in ("eager", "", None, "LAZY"):
    with pytest.raises(ValueError, match="page_allocation must be 'reserve' or 'lazy'"):
      EngineConfig(CONFIGS["full"], page_allocation=bad)
  eng = _engine(_model(), CONFIGS["snapkv"], page_allocation="lazy")
  assert not eng.paged and not eng.lazy
  assert eng.generate(_prompts((20,)), SamplingParams(max_tokens=3, temperature=0.0))
  main = pytest.importorskip("rocketkv_jax.serve.__main__")
  assert main.parser().parse_args([]).page_allocation == "reserve"
  assert main.parser().parse_args(["--page-allocation", "lazy"]).page_allocation == "lazy"
  with pytest.raises(main.UsageError, match="--page-allocation"):
    main.parser().parse_args(["--page-allocation", "eager"])
  metrics = pytest.importorskip("rocketkv_jax.serve.metrics")
  stats = EngineStats(1, 0, 4, 0.5, 100, 10, 20, 3, 1.0, 2.0, num_preemptions=3,
                      recomputed_tokens_total=41)
  text = metrics.Metrics(types.SimpleNamespace(stats=lambda: stats)).render().decode()
  assert "rocketkv:num_preemptions_total 3.0" in text
  assert "rocketkv:recomputed_tokens_total 41.0" in text


def test_lazy_admission_and_growth():
  """A lazily paged request takes its kept prompt's pages + those of its first call, then a
  page as its tokens reach it; admission keeps a call's worth of pages per admitted request."""
  model, rc = _model(), CONFIGS["full"]
  eng = _engine(model, rc, page_size=PAGE, page_allocation="lazy", max_num_seqs=2)
  assert eng._admission_pages(20, 60) == 2 and eng.pages_needed(20, 60) == 5
  assert eng._admission_pages(40, 2) == eng.pages_needed(40, 2) == 3
  h = eng.add_request(_prompts((20,))[0], LONG)
  held = []
  while eng.has_work():
    eng.step()
    held.append(sum(map(len, eng._slot_pages)))
  # 20 prompt rows + the tokens appended so far: a new page at rows 32, 48, 64
  assert held[0] == 2 and held[:-1] == sorted(held[:-1]) and max(held) == 5 and held[-1] == 0
  assert held.index(3) == 12 and held.index(4) == 28
  assert h.result().token_ids == _reference(model, eng, rc, _prompts((20,))[0], 60)
  _assert_empty(eng)

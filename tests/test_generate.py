"""`rocketkv.generate`: greedy parity with transformers' `generate`, every KV method, sampling,
EOS, streaming, no recompilation, and the real SmolLM2 end to end."""

import dataclasses

import pytest
import torch

import jax.numpy as jnp
import numpy as np

import rocketkv_jax as rocketkv
import rocketkv_jax.models as M
from rocketkv_jax import methods
from rocketkv_jax.runtime import sampling
from model_fixtures import (PARITY_VARIANTS, hf_checkpoint, random_tokens, smollm2_ours,
                            smollm2_transformers)


def _hf_greedy(ref_model, prompt, n):
  ref_model.generation_config.eos_token_id = None
  with torch.no_grad():
    out = ref_model.generate(torch.tensor([prompt], dtype=torch.long), max_new_tokens=n,
                             do_sample=False, pad_token_id=0, attention_mask=None)
  return out[0, len(prompt):].tolist()


def _prompts():
  toks = random_tokens(2, 40, seed=5)
  return [toks[0].tolist(), toks[1, :27].tolist()]  # right padding: 40 and 27 tokens


@pytest.mark.parametrize("name", PARITY_VARIANTS)
def test_greedy_full_kv_matches_transformers_generate(name):
  path, ref_model = hf_checkpoint(name)
  model = M.load(path)
  prompts = _prompts()
  res = rocketkv.generate(model, prompts, method="full", max_new_tokens=32, eos_token_ids=())
  for prompt, got in zip(prompts, res.tokens):
    assert got == _hf_greedy(ref_model, prompt, 32)
  assert res.stats["new_tokens"] == [32, 32]
  # full KV keeps each row's own prompt (40 and 27 tokens), not the longest row's
  st = res.stats
  assert st["kv_tokens_kept_per_row"] == [40, 27] and st["kv_tokens_kept"] == round(33.5)
  assert st["kv_tokens_full_per_row"] == st["kv_tokens_read_per_row"] == [72, 59]
  assert st["compression_ratio_per_row"] == [1.0, 1.0] and st["compression_ratio"] == 1.0


def test_rocketkv_without_compression_matches_transformers_sliding_window():
  """Mistral v0.1 (window 12) through RocketKV's full pipeline (stage 1 + top-k) with a budget
  large enough to keep and select everything: exactly transformers' tokens."""
  path, ref_model = hf_checkpoint("mistral_sw")
  model = M.load(path)
  prompts = _prompts()
  res = rocketkv.generate(model, prompts, method="rocketkv", token_budget=256,
                          max_new_tokens=16, eos_token_ids=())
  for prompt, got in zip(prompts, res.tokens):
    assert got == _hf_greedy(ref_model, prompt, 16)


def test_bf16_generation_keeps_a_bf16_cache():
  path, _ = hf_checkpoint("mistral_sw")
  kw = dict(method="rocketkv", token_budget=256, max_new_tokens=16, eos_token_ids=())
  fp32 = rocketkv.generate(M.load(path), _prompts(), **kw)  # compiled by the test above
  bf16 = rocketkv.generate(M.load(path, dtype=jnp.bfloat16), _prompts(), **kw)
  assert bf16.stats["new_tokens"] == [16, 16]
  assert bf16.stats["kv_cache_bytes"] < 0.6 * fp32.stats["kv_cache_bytes"]
  assert [t[0] for t in bf16.tokens] == [t[0] for t in fp32.tokens]


@pytest.mark.parametrize("method", [m for m in rocketkv.METHODS if m != "full"])
def test_every_method_generates(method):
  """Every baseline and both RocketKV variants by name ("full" is covered by the parity tests)."""
  path, _ = hf_checkpoint("llama31")
  model = M.load(path)
  prompts = _prompts()
  res = rocketkv.generate(model, prompts, method=method, token_budget=32, max_new_tokens=6,
                          eos_token_ids=())
  assert res.stats["new_tokens"] == [6, 6]
  assert all(0 <= t < 256 for row in res.tokens for t in row)
  st = res.stats
  assert st["method"] == method and st["kv_tokens_kept"] <= st["capacity"]
  if method in ("snapkv", "rocketkv", "streamingllm"):
    assert st["kv_tokens_kept"] < 40  # stage 1 evicted prompt tokens
  dense = set(methods.get(method).dense_layers(st["plan"]))
  if dense >= set(range(model.config.num_layers)):  # quest on 2 layers: both dense, all read
    assert st["kv_tokens_read_per_row"] == [40 + 6, 27 + 6] and st["compression_ratio"] == 1.0
  elif methods.get(method).reads_by_mass:  # the rows its state counted: fewer than all
    assert 1 <= st["kv_tokens_read"] < st["kv_tokens_full"] and st["compression_ratio"] > 1.0
  else:
    assert st["compression_ratio"] > 1.0


def test_sampling_is_seeded_and_top_p_limits_to_greedy():
  path, _ = hf_checkpoint("llama31")
  model = M.load(path)
  prompt = _prompts()  # same shapes as the parity test: its compiled programs are reused
  kw = dict(method="full", max_new_tokens=32, eos_token_ids=())
  a = rocketkv.generate(model, prompt, temperature=1.0, top_p=0.95, seed=1, **kw).tokens
  b = rocketkv.generate(model, prompt, temperature=1.0, top_p=0.95, seed=1, **kw).tokens
  c = rocketkv.generate(model, prompt, temperature=1.0, top_p=0.95, seed=2, **kw).tokens
  greedy = rocketkv.generate(model, prompt, **kw).tokens
  nucleus1 = rocketkv.generate(model, prompt, temperature=1.0, top_p=1e-6, seed=3, **kw).tokens
  assert a == b and a != c
  assert nucleus1 == greedy
  # a strategy object: TopK(k=1) is greedy; k=4 is seeded and samples
  top1 = rocketkv.generate(model, prompt, sampler=sampling.TopK(temperature=1.0, k=1), seed=4,
                           **kw).tokens
  top4 = [rocketkv.generate(model, prompt, sampler=sampling.TopK(temperature=1.0, k=4), seed=s,
                            **kw).tokens for s in (1, 1, 2)]
  assert top1 == greedy
  assert top4[0] == top4[1] and top4[0] != top4[2] and top4[0] != greedy
  # plain functions: argmax is greedy; argmin is not
  def pick(fn):
    return rocketkv.generate(model, prompt, sampler=lambda logits, key: fn(
        logits, axis=-1).astype(jnp.int32), **kw).tokens
  assert pick(jnp.argmax) == greedy and pick(jnp.argmin) != greedy


def test_eos_stops_early_and_streaming_sees_every_token():
  path, _ = hf_checkpoint("llama31")
  model = M.load(path)
  prompts = _prompts()
  greedy = rocketkv.generate(model, prompts, method="full", max_new_tokens=32,
                             eos_token_ids=()).tokens
  eos = greedy[0][3]
  seen = []
  res = rocketkv.generate(model, prompts, method="full", max_new_tokens=32, eos_token_ids=[eos],
                          stream=lambda step, toks, done: seen.append((step, toks.tolist())))
  assert res.tokens[0] == greedy[0][:greedy[0].index(eos)]
  want1 = greedy[1][:greedy[1].index(eos)] if eos in greedy[1] else greedy[1]
  assert res.tokens[1] == want1
  steps = [s for s, _ in seen]
  assert steps == list(range(len(steps)))
  streamed0 = [t[0] for _, t in seen]
  assert streamed0[:len(res.tokens[0])] == res.tokens[0]


def test_second_call_does_not_recompile():
  path, _ = hf_checkpoint("llama31")
  model = M.load(path)
  prompts = _prompts()  # same call as test_every_method_generates[rocketkv]
  kw = dict(method="rocketkv", token_budget=32, max_new_tokens=6, eos_token_ids=())
  first = rocketkv.generate(model, prompts, **kw)
  again = rocketkv.generate(model, prompts, **kw)
  assert again.stats["compile_s"] == 0.0 and again.tokens == first.tokens


def test_pad_to_plans_for_the_padded_length_and_padding_changes_no_tokens():
  """pad_to=64 plans the split for 64-token prompts; the same split given as explicit overrides
  to an unpadded call gives the same tokens, and other lengths under 64 reuse the programs."""
  path, _ = hf_checkpoint("llama31")
  model = M.load(path)
  prompts = _prompts()  # 40 and 27 tokens
  cfg = rocketkv.RocketConfig(token_budget=16, window_size=8)
  kw = dict(rocket_config=cfg, max_new_tokens=6, eos_token_ids=())
  padded = rocketkv.generate(model, prompts, pad_to=64, **kw)
  plan = padded.stats["plan"]
  d = model.config.head_dim
  assert plan == rocketkv.plan(cfg, 64, 6, d)
  assert plan != rocketkv.plan(cfg, 40, 6, d)
  assert 27 < plan.prompt_budget < 40  # the 40-token prompt loses tokens to stage 1
  assert padded.stats["kv_tokens_full_per_row"] == [40 + 6, 27 + 6]  # the real prompt tokens
  same_split = dataclasses.replace(
      cfg, capacity=plan.capacity, prompt_budget=plan.prompt_budget, top_k=plan.top_k,
      chunk_size=plan.chunk_size, r=plan.r)
  assert dataclasses.replace(rocketkv.plan(same_split, 40, 6, d), prompt_len=64) == plan
  unpadded = rocketkv.generate(model, prompts, **dict(kw, rocket_config=same_split))
  assert padded.tokens == unpadded.tokens
  shorter = rocketkv.generate(model, [p[:33] for p in prompts], pad_to=64, **kw)
  assert shorter.stats["compile_s"] == 0.0 and shorter.stats["plan"] == plan
  floor = rocketkv.generate(model, prompts, pad_to=8, **kw)  # a floor: plans for 40
  assert floor.stats["plan"] == rocketkv.plan(cfg, 40, 6, d)
  with pytest.raises(ValueError, match="pad_to must be None or an int >= 1"):
    rocketkv.generate(model, prompts, pad_to=0, **kw)


def test_bad_arguments_raise_value_errors():
  path, _ = hf_checkpoint("llama31")
  model = M.load(path)
  with pytest.raises(ValueError, match="method must be one of"):
    rocketkv.generate(model, [[5, 6]], method="h2o")
  with pytest.raises(ValueError, match="max_new_tokens"):
    rocketkv.generate(model, [[5, 6]], max_new_tokens=0)
  with pytest.raises(ValueError, match="top_p"):
    rocketkv.generate(model, [[5, 6]], temperature=1.0, top_p=0.0)
  with pytest.raises(ValueError, match="tokenizer"):
    rocketkv.generate(model, "text needs a tokenizer")
  with pytest.raises(ValueError, match="^sampler: pass a sampling strategy or temperature"):
    rocketkv.generate(model, [[5, 6]], temperature=1.0, sampler=sampling.Greedy())
  with pytest.raises(ValueError, match="^sampler must be a strategy"):
    rocketkv.generate(model, [[5, 6]], sampler=0.7)
  bad = [  # each a one-line ValueError naming the argument, before the model is touched
      (dict(prompts=[[1, 5, 300]]), r"token ids must be in \[0, vocab_size=256\), got \[300\]"),
      (dict(prompts=[[1, -5, 3]]), r"token ids must be in \[0, vocab_size=256\), got \[-5\]"),
      (dict(prompts=[[1.5, 2.0]]), "token ids must be integers, got dtype float64"),
      (dict(prompts=np.zeros((1, 2, 3), np.int32)), r"must be \[L\] .* or \[B, L\]"),
      (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
      (dict(temperature="hot"), "temperature must be a finite number"),
      (dict(max_new_tokens="4"), "max_new_tokens must be an int >= 1, got '4'"),
      (dict(max_new_tokens=True), "max_new_tokens must be an int >= 1, got True"),
      (dict(seed=2**40), r"seed must be an int in \[0, 2\*\*32\)"),
      (dict(seed="a"), "seed must be an int"),
      (dict(eos_token_ids=2), "eos_token_ids must be None or a sequence of token ids"),
      (dict(rocket_config={"token_budget": 8}), "rocket_config must be None or a rocketkv"),
  ]
  for kwargs, match in bad:
    kwargs = {"prompts": [[5, 6]], **kwargs}
    with pytest.raises(ValueError, match=match) as e:
      rocketkv.generate(model, kwargs.pop("prompts"), **kwargs)
    assert "\n" not in str(e.value), kwargs


def test_logits_and_score_continuations_check_token_ids():
  """An int64 id past int32 was wrapped by the cast (2**32 + 5 scored as 5); an id past the
  vocabulary gave a NaN log-prob, -1 scored as the last id."""
  path, _ = hf_checkpoint("llama31")
  model = M.load(path)
  with pytest.raises(ValueError, match=r"token ids must be in \[0, 256\)"):
    model.logits(np.array([[2**32 + 5, 7]], np.int64))
  with pytest.raises(ValueError, match=r"rows of equal length"):
    model.logits([[1, 2, 3], [4]])
  with pytest.raises(ValueError, match="token_ids must be integers"):
    model.logits([[1.5, 2.0]])
  for bad, match in [([[256, 5]], r"continuations: token ids must be in \[0, vocab_size=256\)"),
                     ([[-1, 5]], r"continuations: token ids must be in"),
                     ([[3.9]], "continuations: token ids must be integers")]:
    with pytest.raises(ValueError, match=match):
      rocketkv.score_continuations(model, [[1, 2, 3]], bad)
  a = rocketkv.score_continuations(model, np.array([[1, 2, 3], [4, 5, 6]]), [[7, 8], [9]])
  b = rocketkv.score_continuations(model, [[1, 2, 3], [4, 5, 6]], [[7, 8], [9]])
  assert [list(x) for x in a.logprobs] == [list(x) for x in b.logprobs]


def test_a_2d_array_is_one_prompt_per_row():
  """A `[B, L]` array of ids is B prompts (it was once read as one prompt of B * L tokens),
  a `[L]` array one prompt; numpy integer arguments are ints."""
  path, _ = hf_checkpoint("llama31")
  model = M.load(path)
  toks = random_tokens(2, 12, seed=4)
  kw = dict(method="full", max_new_tokens=3, eos_token_ids=())
  rows = rocketkv.generate(model, [toks[0].tolist(), toks[1].tolist()], **kw)
  arr = rocketkv.generate(model, np.asarray(toks), **{**kw, "max_new_tokens": np.int64(3)})
  assert arr.tokens == rows.tokens and arr.stats["prompt_lengths"] == [12, 12]
  one = rocketkv.generate(model, jnp.asarray(toks[1]), **kw)
  assert one.tokens == rows.tokens[1:]


def test_smollm2_string_prompt_full_kv_matches_transformers():
  """The real model end to end: chat-templated string in, text out, same greedy tokens as
  transformers' GGUF load."""
  model = smollm2_ours()
  tok_ref, ref_model = smollm2_transformers()
  question = "What is the capital of France? Answer in one word."
  res = rocketkv.generate(model, question, method="full", max_new_tokens=8, chat=True)
  text = tok_ref.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                     add_generation_prompt=True)
  ids = tok_ref(text).input_ids
  with torch.no_grad():
    ref = ref_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
  ref = ref[0, len(ids):].tolist()
  if 2 in ref:
    ref = ref[:ref.index(2)]
  assert res.tokens[0] == ref
  assert "Paris" in res.text[0]


def test_full_cache_raises_on_the_host(monkeypatch):
  """A plan whose cache is 3 slots too small: the core drops the writes, generate raises."""
  import dataclasses

  path, _ = hf_checkpoint("llama31")
  model = M.load(path)
  real_plan = rocketkv.plan

  def short_plan(*args, **kwargs):
    p = real_plan(*args, **kwargs)
    return dataclasses.replace(p, capacity=p.capacity - 3, chunk_size=p.capacity - 3)

  import sys
  monkeypatch.setattr(sys.modules["rocketkv_jax.runtime.generate"], "make_plan", short_plan)
  with pytest.raises(RuntimeError, match="KV cache overflow"):
    rocketkv.generate(model, _prompts(), method="streamingllm", token_budget=32,
                      max_new_tokens=6, eos_token_ids=())


def test_program_cache_keeps_the_most_recent_programs():
  """`ProgramCache(max_programs=2)`: a third program drops the least recently used one, which
  then compiles again; a program used in between stays."""
  import numpy as np

  from rocketkv_jax.runtime.generate import ProgramCache

  cache = ProgramCache(max_programs=2)
  fn = lambda x, *, scale: x * scale  # noqa: E731
  args = {n: (jnp.arange(n, dtype=jnp.float32),) for n in (2, 3, 4)}
  exe2, t = cache.get("f", fn, dict(scale=2.0), (), args[2])
  assert t > 0 and np.asarray(exe2(*args[2])).tolist() == [0.0, 2.0]
  assert cache.get("f", fn, dict(scale=2.0), (), args[3])[1] > 0
  assert cache.get("f", fn, dict(scale=2.0), (), args[2])[1] == 0.0  # 2 is now the most recent
  assert cache.get("f", fn, dict(scale=2.0), (), args[4])[1] > 0  # drops 3
  assert len(cache) == 2
  assert cache.get("f", fn, dict(scale=2.0), (), args[2])[1] == 0.0
  assert cache.get("f", fn, dict(scale=2.0), (), args[3])[1] > 0
  assert cache.get("f", fn, dict(scale=3.0), (), args[3])[1] > 0  # a static argument is a key
  with pytest.raises(ValueError, match="max_programs must be an int >= 2"):
    ProgramCache(max_programs=1)


def test_stream_callbacks_are_per_call():
  """One compiled streaming program serves calls with different callbacks: each call's tokens
  reach its own callback only, and none stays registered after the call."""
  from rocketkv_jax.runtime.generate import ProgramCache

  path, _ = hf_checkpoint("llama31")
  model = M.load(path)
  programs = ProgramCache()
  kw = dict(method="full", max_new_tokens=4, eos_token_ids=(), programs=programs)
  seen_a, seen_b = [], []
  a = rocketkv.generate(model, _prompts(), stream=lambda s, t, d: seen_a.append(t.tolist()), **kw)
  b = rocketkv.generate(model, _prompts()[::-1],
                        stream=lambda s, t, d: seen_b.append(t.tolist()), **kw)
  assert b.stats["compile_s"] == 0.0 and len(programs) == 2
  assert [list(r) for r in zip(*seen_a)] == a.tokens
  assert [list(r) for r in zip(*seen_b)] == b.tokens == a.tokens[::-1]
  assert not programs.stream_sink._callbacks  # pylint: disable=protected-access

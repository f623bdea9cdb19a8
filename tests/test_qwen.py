"""Qwen 3 and Qwen 2.5 against transformers' Qwen3ForCausalLM / Qwen2ForCausalLM on tiny random
checkpoints (`model_fixtures.QWEN_KINDS`: q / k norms and an explicit head_dim, q / k / v
biases, tied and untied embeddings, YaRN past its original context, a sliding-window layer),
loaded from the HF directory and from a GGUF file written here; every KV method and the eval
runner on a tiny Qwen 3; corrupt (NaN / Inf) weights."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
import torch

import rocketkv_jax as rocketkv
import rocketkv_jax.models as M
from rocketkv_jax.eval.runner import Runner
from rocketkv_jax.models.config import ModelConfig, RopeScaling
from model_fixtures import (PARAGRAPHS, QWEN_KINDS, qwen_checkpoint, qwen_tokenizer,
                            random_tokens, write_qwen_gguf)

VOCAB = 272


def _prompts():
  """A ragged batch past the YaRN kinds' original context of 32: 50 and 37 tokens."""
  toks = random_tokens(2, 50, seed=5, vocab=VOCAB)
  return [toks[0].tolist(), toks[1, :37].tolist()]


def _hf_greedy(ref_model, prompt, n):
  ref_model.generation_config.eos_token_id = None
  with torch.no_grad():
    out = ref_model.generate(torch.tensor([prompt], dtype=torch.long), max_new_tokens=n,
                             do_sample=False, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def _hf_logits(ref_model, tokens):
  with torch.no_grad():
    return ref_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("kind", sorted(QWEN_KINDS))
def test_logits_match_transformers(kind):
  path, ref = qwen_checkpoint(kind)
  model = M.load(path)
  config = model.config
  assert config.architecture == QWEN_KINDS[kind][0]
  assert config.tie_word_embeddings == ref.config.tie_word_embeddings
  assert ("lm_head" in model.params) != config.tie_word_embeddings
  tokens = random_tokens(2, 60, seed=1, vocab=VOCAB)
  ours = np.asarray(model.logits(tokens, block_size=16))
  np.testing.assert_allclose(ours, _hf_logits(ref, tokens), atol=1e-4, rtol=0)
  # what each kind exercises changes the logits (so the parity above covers it)
  if kind.endswith("_yarn"):
    assert config.rope_scaling.rope_type == "yarn" and config.rope_scaling.attention_scale > 1
    changed = dataclasses.replace(config, rope_scaling=RopeScaling())
  elif kind == "qwen2_sw":
    assert config.window_layers == (1,) and config.sliding_window == 8
    changed = dataclasses.replace(config, sliding_window=64)
  elif config.qkv_bias:
    assert config.architecture == "qwen2"
    changed = None
    params = dict(model.params, layers=[dict(lp, bk=lp["bk"] * 0) for lp in model.params["layers"]])
    other = np.asarray(M.Model(config, params).logits(tokens, block_size=16))
  else:
    assert config.qk_norm and config.head_dim == 32 != config.hidden_size // config.num_heads
    changed = None
    params = dict(model.params,
                  layers=[dict(lp, q_norm=lp["q_norm"] * 0 + 1) for lp in model.params["layers"]])
    other = np.asarray(M.Model(config, params).logits(tokens, block_size=16))
  if changed is not None:
    other = np.asarray(M.Model(changed, model.params).logits(tokens, block_size=16))
  assert np.abs(other[:, 40:] - ours[:, 40:]).max() > 1e-2


@pytest.mark.parametrize("kind,method", [(k, "full") for k in sorted(QWEN_KINDS)]
                         + [("qwen3_yarn", "rocketkv"), ("qwen2_sw", "rocketkv")])
def test_greedy_generate_matches_transformers(kind, method):
  """Full KV, and RocketKV with a budget that keeps and selects every token: transformers'
  greedy tokens, 24 of them, past a ragged batch of prompts (50 and 37 tokens)."""
  path, ref = qwen_checkpoint(kind)
  model = M.load(path)
  prompts = _prompts()
  res = rocketkv.generate(model, prompts, method=method, token_budget=256, max_new_tokens=24,
                          eos_token_ids=())
  for prompt, got in zip(prompts, res.tokens):
    assert got == _hf_greedy(ref, prompt, 24)


def test_tokenizer_matches_transformers(tmp_path):
  """The HF directory's tokenizer.json and the GGUF's "gpt2" / "qwen2" vocabulary both encode as
  transformers' Qwen2Tokenizer (digits one by one, NFC, special tokens whole)."""
  want = qwen_tokenizer()
  path, _ = qwen_checkpoint("qwen3")
  from_dir = M.load_config(path)[1]
  from_gguf = M.load_config(write_qwen_gguf("qwen3", str(tmp_path / "q.gguf")))[1]
  texts = PARAGRAPHS + ["1969 and 2025: caf\u0065\u0301 <|im_end|>\n"]
  for text in texts:
    ids = want.encode(text)
    assert from_dir.encode(text) == ids
    assert from_gguf.encode(text) == ids
    assert from_gguf.decode(ids) == want.decode(ids, skip_special_tokens=True)
  assert want.encode("1969") == from_gguf.encode("1969") and len(want.encode("1969")) == 4
  assert from_gguf.eos_token_ids == (264,) and not from_gguf.add_bos


@pytest.mark.parametrize("kind", ["qwen3_yarn", "qwen2"])
def test_gguf_matches_transformers(kind, tmp_path):
  """A GGUF written as llama.cpp's converter lays out Qwen loads to transformers' logits and
  greedy tokens; its config is the HF directory's but for the sliding-window fields GGUF lacks."""
  path, ref = qwen_checkpoint(kind)
  gguf_path = write_qwen_gguf(kind, str(tmp_path / f"{kind}.gguf"))
  model = M.load(gguf_path)
  hf = M.load_config(path)[0]
  assert model.config.rms_norm_eps == pytest.approx(hf.rms_norm_eps)  # a float32 in GGUF
  assert model.config == dataclasses.replace(hf, rms_norm_eps=model.config.rms_norm_eps)
  tokens = random_tokens(2, 60, seed=3, vocab=VOCAB)
  np.testing.assert_allclose(np.asarray(model.logits(tokens, block_size=16)),
                             _hf_logits(ref, tokens), atol=1e-4, rtol=0)
  prompts = _prompts()
  res = rocketkv.generate(model, prompts, method="full", max_new_tokens=12, eos_token_ids=())
  for prompt, got in zip(prompts, res.tokens):
    assert got == _hf_greedy(ref, prompt, 12)


def test_every_method_runs_in_generate_and_the_eval_runner():
  """Every registered method generates on a tiny Qwen 3 (`generate`) and decodes from one prompt
  pass of the eval runner; RocketKV's tokens agree between the two."""
  path, _ = qwen_checkpoint("qwen3_yarn")
  model = M.load(path)
  prompts = _prompts()
  for method in rocketkv.METHODS:
    res = rocketkv.generate(model, prompts, method=method, token_budget=32, max_new_tokens=5,
                            eos_token_ids=())  # 32: the default window fits the budget
    assert [len(row) for row in res.tokens] == [5, 5], method
  tokens = np.zeros((2, 50), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  runner = Runner(model, window_size=4, eos_token_ids=(), quest_page_size=4)
  pp = runner.prompt_pass(tokens, np.array([50, 37], np.int32))
  outs = {}
  for method in rocketkv.METHODS:
    outs[method] = runner.decode(pp, method, 16, 5)[0]
    assert [len(row) for row in outs[method]] == [5, 5], method
  res = rocketkv.generate(model, prompts, rocket_config=runner.rocket_config("rocketkv", 16),
                          max_new_tokens=5, eos_token_ids=(), pad_to=50)
  assert res.tokens == outs["rocketkv"]
  assert outs["full"] == [_hf_greedy(qwen_checkpoint("qwen3_yarn")[1], p, 5) for p in prompts]


def _hf_config(kind, **changes):
  path, _ = qwen_checkpoint(kind)
  with open(os.path.join(path, "config.json")) as f:
    return dict(json.load(f), **changes)


def test_config_forms_and_errors(tmp_path):
  base = _hf_config("qwen2_yarn")
  # the classic spelling (rope_theta + rope_scaling, "type"), as released Qwen 2.5 configs
  classic = dict(base, rope_theta=10000.0,
                 rope_scaling={"type": "yarn", "factor": 4.0,
                               "original_max_position_embeddings": 32})
  classic.pop("rope_parameters")
  assert ModelConfig.from_hf(classic) == ModelConfig.from_hf(base)
  # sliding windows: none unless use_sliding_window; every layer sliding is Mistral v0.1's form
  sw = _hf_config("qwen2_sw")
  sw.pop("layer_types", None)
  assert ModelConfig.from_hf(dict(sw, use_sliding_window=False)).sliding_window is None
  assert ModelConfig.from_hf(dict(sw, max_window_layers=2)).sliding_window is None
  every = ModelConfig.from_hf(dict(sw, max_window_layers=0))
  assert every.sliding_window == 8 and every.layer_types is None
  assert ModelConfig.from_hf(sw).layer_types == ("full_attention", "sliding_attention")
  with pytest.raises(ValueError, match="attention_bias = True is not supported for qwen3"):
    ModelConfig.from_hf(_hf_config("qwen3", attention_bias=True))
  with pytest.raises(ValueError, match="mscale"):
    ModelConfig.from_hf(dict(classic, rope_scaling=dict(classic["rope_scaling"], mscale=1.0,
                                                        mscale_all_dim=1.0)))
  # a MoE Qwen 3: a CheckpointError naming config.json and the supported families
  path, _ = qwen_checkpoint("qwen3")
  moe = str(tmp_path / "moe")
  shutil.copytree(path, moe)
  with open(os.path.join(moe, "config.json"), "w") as f:
    json.dump(_hf_config("qwen3", model_type="qwen3_moe"), f)
  with pytest.raises(M.CheckpointError, match=r"model_type 'qwen3_moe' is not supported; "
                     r"allowed: \('llama', 'mistral', 'gemma3', 'qwen2', 'qwen3'\)"):
    M.load(moe)


def test_yarn_frequencies_match_transformers():
  """YaRN's inverse frequencies and attention factor against transformers' rope init, for a
  few (factor, original context, betas) including an untruncated ramp and a given factor."""
  import transformers
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  from rocketkv_jax.models.rope import inverse_frequencies

  cases = [dict(factor=4.0, original_max_position_embeddings=32),
           dict(factor=8.0, original_max_position_embeddings=4096, beta_fast=16, beta_slow=2),
           dict(factor=4.0, original_max_position_embeddings=32768, truncate=False),
           dict(factor=2.0, original_max_position_embeddings=64, attention_factor=1.3)]
  for case in cases:
    params = dict(case, rope_type="yarn", rope_theta=1e6)
    cfg = transformers.Qwen3Config(head_dim=128, max_position_embeddings=131072,
                                   rope_parameters=dict(params))
    want_inv, want_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours = ModelConfig.from_hf(dict(cfg.to_dict(), rope_parameters=params))
    np.testing.assert_allclose(inverse_frequencies(ours), want_inv.numpy(), rtol=1e-6)
    assert ours.rope_scaling.attention_scale == pytest.approx(want_scale, rel=1e-9)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_gguf_with_non_finite_weights_names_the_tensor(value, tmp_path):
  """A GGUF tensor holding NaN or Inf is a CheckpointError naming the file and the tensor."""
  import gguf

  src = write_qwen_gguf("qwen3", str(tmp_path / "ok.gguf"))
  reader = gguf.GGUFReader(src, "r+")
  tensor = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
  tensor.data.reshape(-1)[7] = value  # memory-mapped: written to the file
  del reader
  with pytest.raises(M.CheckpointError) as info:
    M.load(src)
  msg = str(info.value)
  assert msg.startswith(repr(src) + ": ") and "'blk.1.ffn_up.weight' holds NaN or Inf" in msg


def test_bf16_checkpoint_loads_and_its_non_finite_weights_are_caught(tmp_path):
  """A bfloat16 safetensors checkpoint (how Qwen ships) loads to the logits of its rounded
  weights; an Inf in one of its tensors is a CheckpointError naming the tensor."""
  from safetensors.torch import load_file, save_file

  path, ref = qwen_checkpoint("qwen2")
  bf16 = str(tmp_path / "bf16")
  shutil.copytree(path, bf16)
  st = os.path.join(bf16, "model.safetensors")
  tensors = {k: v.to(torch.bfloat16) for k, v in load_file(st).items()}
  save_file(tensors, st, metadata={"format": "pt"})
  tokens = random_tokens(1, 40, seed=2, vocab=VOCAB)
  rounded = type(ref)(ref.config).eval()
  rounded.load_state_dict({k: v.float() for k, v in tensors.items()})
  np.testing.assert_allclose(np.asarray(M.load(bf16).logits(tokens, block_size=16)),
                             _hf_logits(rounded, tokens), atol=1e-4, rtol=0)
  tensors["model.layers.0.self_attn.v_proj.bias"][3] = float("inf")
  save_file(tensors, st, metadata={"format": "pt"})
  with pytest.raises(M.CheckpointError, match="'model.layers.0.self_attn.v_proj.bias' holds NaN "
                     "or Inf"):
    M.load(bf16)

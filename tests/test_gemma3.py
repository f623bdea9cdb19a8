"""Gemma 3 against transformers' Gemma3ForCausalLM on a tiny random checkpoint
(`model_fixtures.GEMMA3_TINY`: sliding, full, sliding layers, window 8 < the prompts, GQA 2:1),
and its hybrid layers: bounded sliding-layer caches, the KV method on the full layer only."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import rocketkv_jax as rocketkv
import rocketkv_jax.models as M
from rocketkv_jax.eval.runner import Runner
from rocketkv_jax.models import llama
from rocketkv_jax.models.config import ModelConfig
from model_fixtures import GEMMA3_TINY, gemma3_checkpoint, random_tokens


def _prompts():
  toks = random_tokens(2, 40, seed=5)
  return [toks[0].tolist(), toks[1, :27].tolist()]  # right padding: 40 and 27 tokens


def _hf_greedy(ref_model, prompt, n):
  ref_model.generation_config.eos_token_id = None
  with torch.no_grad():
    out = ref_model.generate(torch.tensor([prompt], dtype=torch.long), max_new_tokens=n,
                             do_sample=False, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def test_logits_match_transformers():
  path, ref = gemma3_checkpoint()
  model = M.load(path)
  assert model.config.window_layers == (0, 2) and model.config.layer_window(1) is None
  tokens = random_tokens(2, 40, seed=1)
  ours = np.asarray(model.logits(tokens, block_size=16))
  with torch.no_grad():
    want = ref(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(ours, want, atol=1e-4, rtol=0)
  # the window matters past 8 tokens (so the parity above covers it)
  wide = dataclasses.replace(model.config, sliding_window=64)
  other = np.asarray(M.Model(wide, model.params).logits(tokens, block_size=16))
  assert np.abs(other[:, 20:] - ours[:, 20:]).max() > 1e-2


@pytest.mark.parametrize("method,budget", [("full", 256), ("rocketkv", 256)])
def test_greedy_generate_matches_transformers(method, budget):
  """Full KV, and RocketKV with a budget that keeps and selects every token: transformers'
  tokens, 24 of them (three windows' worth) past prompts of 40 and 27."""
  path, ref = gemma3_checkpoint()
  model = M.load(path)
  prompts = _prompts()
  res = rocketkv.generate(model, prompts, method=method, token_budget=budget, max_new_tokens=24,
                          eos_token_ids=())
  for prompt, got in zip(prompts, res.tokens):
    assert got == _hf_greedy(ref, prompt, 24)


def test_sliding_layer_cache_does_not_grow_with_the_prompt():
  """A sliding layer's state is window + new tokens whatever the prompt length; the full
  layer's follows the method's plan."""
  path, _ = gemma3_checkpoint()
  model = M.load(path)
  sizes = {}
  for length in (24, 96):
    tokens = jnp.asarray(random_tokens(1, length, seed=2))
    plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=512, method="full"), length, 6,
                         model.config.head_dim)
    _, cache = llama.prefill(model.params, tokens, jnp.asarray([length], jnp.int32),
                             config=model.config, plan=plan)
    sizes[length] = [c.capacity for c in cache]
  assert sizes[24][0] == sizes[96][0] == sizes[24][2] == sizes[96][2] == 8 + 6
  assert sizes[24][1] == 24 + 6 and sizes[96][1] == 96 + 6
  res = rocketkv.generate(model, [random_tokens(1, 96, seed=2)[0].tolist()], method="full",
                          max_new_tokens=6, eos_token_ids=())
  per_token = model.config.num_kv_heads * model.config.head_dim * 2 * 4  # K and V, fp32
  assert res.stats["kv_cache_bytes"] >= per_token * (2 * (8 + 6) + 96 + 6)
  assert res.stats["kv_cache_bytes"] < per_token * 3 * (96 + 6)


def test_every_method_runs_in_the_eval_runner_and_generate_agrees():
  """Every registered method decodes from one prompt pass of the eval runner; RocketKV's tokens
  are `generate`'s, whose per-layer stats show the sliding layers' bounded caches and stage 1
  on the full layer only."""
  path, _ = gemma3_checkpoint()
  model = M.load(path)
  prompts = _prompts()
  tokens = np.zeros((2, 40), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  runner = Runner(model, window_size=4, eos_token_ids=(), quest_page_size=4)
  pp = runner.prompt_pass(tokens, np.array([40, 27], np.int32))
  outs = {}
  for method in rocketkv.METHODS:
    outs[method] = runner.decode(pp, method, 16, 5)[0]
    assert [len(row) for row in outs[method]] == [5, 5], method
  res = rocketkv.generate(model, prompts, rocket_config=runner.rocket_config("rocketkv", 16),
                          max_new_tokens=5, eos_token_ids=(), pad_to=40)
  assert res.tokens == outs["rocketkv"]
  st = res.stats
  kept, read = st["kv_tokens_kept_per_layer"], st["kv_tokens_read_per_layer"]
  assert kept[0] == kept[2] == 8 and read[0] == read[2] == 8  # min(window, prompt)
  assert kept[1] <= st["plan"].prompt_budget < 40 and read[1] == st["plan"].top_k


def test_config_forms_and_errors():
  base = dict(GEMMA3_TINY, model_type="gemma3_text")
  text = ModelConfig.from_hf(base)
  multimodal = ModelConfig.from_hf({"model_type": "gemma3", "text_config": base})
  assert multimodal == text
  classic = dict(base, rope_theta=1e6, rope_local_base_freq=1e4,
                 rope_scaling={"rope_type": "linear", "factor": 2.0})
  classic.pop("rope_parameters")
  assert ModelConfig.from_hf(classic) == text
  pattern = dict(base, num_hidden_layers=12, sliding_window_pattern=6)
  pattern.pop("layer_types")
  assert ModelConfig.from_hf(pattern).window_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
  with pytest.raises(ValueError, match="attn_logit_softcapping"):
    ModelConfig.from_hf(dict(base, attn_logit_softcapping=50.0))
  with pytest.raises(ValueError, match="layer_types"):
    dataclasses.replace(text, layer_types=("full_attention",))


def test_nnx_module_split_state_drives_the_jitted_programs():
  """`models.nnx_model.CausalLM`: its logits are the port's, and the state from `nnx.split`
  drives jitted prefill + decode steps to the tokens of `generate`."""
  import jax
  from flax import nnx

  from rocketkv_jax.models.nnx_model import CausalLM, params_from_state

  path, _ = gemma3_checkpoint()
  model = M.load(path)
  module = model.module
  assert isinstance(module, CausalLM)
  tokens = random_tokens(1, 24, seed=6)
  np.testing.assert_allclose(np.asarray(module(jnp.asarray(tokens), block_size=16)),
                             np.asarray(model.logits(tokens, block_size=16)), atol=1e-6)
  graphdef, state = nnx.split(module)
  config = nnx.merge(graphdef, state).config
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=16, method="rocketkv", window_size=4),
                       24, 6, config.head_dim)
  prefill = jax.jit(lambda s, t, n: llama.prefill(params_from_state(s), t, n, config=config,
                                                  plan=plan))
  step = jax.jit(lambda s, c, t, p: llama.decode_step(params_from_state(s), c, t, p,
                                                      config=config, plan=plan))
  lengths = jnp.asarray([24], jnp.int32)
  logits, cache = prefill(state, jnp.asarray(tokens), lengths)
  out = [int(jnp.argmax(logits[0]))]
  for t in range(5):
    logits, cache = step(state, cache, jnp.asarray(out[-1:], jnp.int32), lengths + t)
    out.append(int(jnp.argmax(logits[0])))
  want = rocketkv.generate(
      model, [tokens[0].tolist()], max_new_tokens=6, eos_token_ids=(),
      rocket_config=rocketkv.RocketConfig(token_budget=16, method="rocketkv", window_size=4))
  assert out == want.tokens[0]
  # the bare module runs through the same loops (prompts as ids), and replacing its weights
  # through the split state changes what they compute: the loops read the module's arrays
  via_module = rocketkv.generate(
      module, [tokens[0].tolist()], max_new_tokens=6, eos_token_ids=(),
      rocket_config=rocketkv.RocketConfig(token_budget=16, method="rocketkv", window_size=4))
  assert via_module.tokens == want.tokens
  zeroed = jax.tree.map(jnp.zeros_like, state)
  nnx.update(module, zeroed)
  assert float(jnp.abs(M.Model(module=module).params["embed"]).max()) == 0.0

"""The eval runner's two programs per (method, budget): the decode program and the teacher-forced
gold-score program each build the method's cache from the prompt K/V (`runner._build_stack`) the
way the per-layer `rocketkv.prefill` does, and each holds one cache of temporaries, not the 1.6 to
2.5 caches of the earlier layout (issue #16 item 2)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax.eval import runner as runner_lib
from rocketkv_jax.models import llama
from rocketkv_jax.models.config import ModelConfig
from method_specs import SPECS, spec_plan
from xla_env import as_users_compile

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=5,
                  num_heads=4, num_kv_heads=2, head_dim=16)
W, NEW = 4, 4


def _plan(spec, length, config=CFG, page_size=4):
  return spec_plan(spec, length, NEW, config.head_dim, window=W, page_size=page_size)


def _prompt(batch, length, seed=0):
  rng = np.random.default_rng(seed)
  n, h, hq, d = CFG.num_layers, CFG.num_kv_heads, CFG.num_heads, CFG.head_dim
  k, v = (jnp.asarray(rng.standard_normal((n, batch, h, length, d)), jnp.float32)
          for _ in range(2))
  qw = jnp.asarray(rng.standard_normal((n, batch, hq, W, d)), jnp.float32)
  lengths = jnp.asarray(rng.integers(length // 2, length + 1, batch), jnp.int32)
  return k, v, qw, lengths


def _smol_program_shapes():
  """20 layers and SmolLM2's head dim, so that per-layer and per-slot buffers weigh about what
  they weigh there: (config, abstract params, batch 2, length 512)."""
  cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=20,
                    num_heads=4, num_kv_heads=2, head_dim=64)
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                        llama.init_params(cfg, seed=0))
  return cfg, params, 2, 512


@pytest.mark.parametrize("spec", SPECS)
def test_build_stack_equals_per_layer_prefill(spec):
  """Each run of like layers scanned over its own layers (dense layers alone) gives the states
  of `rocketkv.prefill` on each layer, stacked: every leaf bit-identical."""
  k, v, qw, lengths = _prompt(batch=2, length=40)
  plan = _plan(spec, 40)
  want = llama.stack_cache(tuple(rocketkv.prefill(k[i], v[i], qw[i], plan, lengths=lengths,
                                                  layer=i) for i in range(CFG.num_layers)), plan)
  build = jax.jit(runner_lib._build_stack, static_argnums=4)
  got = as_users_compile(build.lower(k, v, qw, lengths, plan))(k, v, qw, lengths)
  assert got.spans == want.spans
  assert jax.tree.structure(got) == jax.tree.structure(want)
  # lowrank's SVD rounds differently inside a scan than on its own (~5e-7): close, not equal.
  tol = dict(rtol=1e-5, atol=1e-6) if "lowrank" in spec else dict(rtol=0, atol=0)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)


@pytest.mark.parametrize("spec", ["full", "quest"])
def test_each_program_holds_one_cache_of_temporaries(spec):
  """XLA's temporaries per call of each program, against the bytes of one full-KV cache of the
  batch (K and V of every layer, prompt + new slots). The earlier layout (one program holding
  both loops; one scan over all layers, then slices of the stack) keeps 2.5 caches for full KV
  and for Quest at this config (SmolLM2 at 8K x 10: 2.5 and 1.6). Each program now holds at
  most 1.15: the built cache, its summaries (Quest's pages of 16) and a layer's buffers. 20
  layers and SmolLM2's head dim, so that per-layer and per-slot buffers weigh about what they
  weigh there."""
  cfg, params, batch, length = _smol_program_shapes()
  sds = jax.ShapeDtypeStruct
  n, h, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  k = sds((n, batch, h, length, d), jnp.float32)
  qw = sds((n, batch, cfg.num_heads, W, d), jnp.float32)
  vec = sds((batch,), jnp.int32)
  plan = _plan(spec, length, cfg, page_size=16)
  cache_bytes = 2 * n * batch * h * (length + NEW) * d * 4
  decode = jax.jit(functools.partial(runner_lib._method_decode_impl, config=cfg, plan=plan,
                                     max_new_tokens=NEW, keep_cache=False))
  gold = jax.jit(functools.partial(runner_lib._gold_scores_impl, config=cfg, plan=plan))
  eos = sds((1,), jnp.int32)
  for fn, args in ((decode, (params, k, k, qw, vec, vec, eos)),
                   (gold, (params, k, k, qw, vec, sds((batch, cfg.vocab_size), jnp.float32),
                           sds((batch, NEW), jnp.int32)))):
    temp = as_users_compile(fn.lower(*args)).memory_analysis().temp_size_in_bytes
    assert temp <= 1.15 * cache_bytes, (temp / cache_bytes)


@pytest.mark.parametrize("spec,most", [("full", 0.1), ("quest", 0.2), ("sparq", 0.6)])
def test_full_prompt_methods_decode_in_the_prompt_buffers(spec, most):
  """With prompt K/V that have the plan's capacity, the programs of the methods whose cache is
  the whole prompt build it over the donated K/V (`runner._full_stack`): XLA's temporaries drop
  from one cache to what the method keeps besides K/V (SparQ: its dim-major key copy, half a
  cache; Quest: its pages of 16, about 0.15), and the K/V come back as an output aliasing the
  argument."""
  cfg, params, batch, length = _smol_program_shapes()
  sds = jax.ShapeDtypeStruct
  n, h, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  plan = _plan(spec, length, cfg, page_size=16)
  assert runner_lib.keeps_prompt_in_place(plan, length + NEW)
  k = sds((n, batch, h, length + NEW, d), jnp.float32)
  qw = sds((n, batch, cfg.num_heads, W, d), jnp.float32)
  vec = sds((batch,), jnp.int32)
  cache_bytes = 2 * n * batch * h * (length + NEW) * d * 4
  decode = jax.jit(functools.partial(runner_lib._method_decode_impl, config=cfg, plan=plan,
                                     max_new_tokens=NEW, keep_cache=False, in_place=True),
                   donate_argnums=(1, 2))
  gold = jax.jit(functools.partial(runner_lib._gold_scores_impl, config=cfg, plan=plan,
                                   in_place=True), donate_argnums=(1, 2))
  for fn, args in ((decode, (params, k, k, qw, vec, vec, sds((1,), jnp.int32))),
                   (gold, (params, k, k, qw, vec, sds((batch, cfg.vocab_size), jnp.float32),
                           sds((batch, NEW), jnp.int32)))):
    mem = as_users_compile(fn.lower(*args)).memory_analysis()
    assert mem.temp_size_in_bytes <= most * cache_bytes, mem.temp_size_in_bytes / cache_bytes
    assert mem.alias_size_in_bytes == cache_bytes


def test_decoding_in_the_prompt_buffers_changes_no_record():
  """A ragged batch through every method, the full-prompt ones decoding in the prompt pass's
  buffers (`prompt_pass(capacity=L + new)`, as the sweep runs) and interleaved with the
  evicting ones, which read those buffers after them: the tokens and teacher-forced gold scores
  of a pass without room (every program on its own copy), bit for bit; the prompt's slots are
  handed back unchanged."""
  from eval_fixtures import tiny_model

  model = tiny_model()
  runner = runner_lib.Runner(model, eos_token_ids=(), window_size=8, quest_page_size=4)
  rng = np.random.default_rng(5)
  lengths = np.array([48, 35, 21], np.int32)
  tokens = np.zeros((3, 48), np.int32)
  for i, n in enumerate(lengths):
    tokens[i, :n] = rng.integers(3, 256, size=n)
  new = 6
  gold = rng.integers(3, 256, size=(3, new)).astype(np.int32)
  plain = runner.prompt_pass(tokens, lengths)
  room = runner.prompt_pass(tokens, lengths, capacity=48 + new)
  assert room.padded_len == plain.padded_len == 48 and room.capacity == 48 + new
  specs = ["full", "rocketkv", "quest", "snapkv", "sparq", "streamingllm", "exact_topk",
           "rocketkv:stage2=quant"]
  in_place = 0
  for spec in specs:
    want = runner.decode(plain, spec, 16, new, gold=gold)
    want_forced = runner.last_forced
    before = room.k
    got = runner.decode(room, spec, 16, new, gold=gold)
    in_place += before.is_deleted()  # donated: its buffer now backs room.k
    np.testing.assert_array_equal(got[1], want[1])
    for a, b in zip(runner.last_forced, want_forced):
      np.testing.assert_array_equal(a, b)
  assert in_place == 4  # full, quest, sparq, exact_topk
  valid = np.arange(48)[None, None, :] < lengths[:, None, None]
  for a, b in ((room.k, plain.k), (room.v, plain.v)):
    a, b = np.asarray(a)[..., :48, :], np.asarray(b)
    np.testing.assert_array_equal(np.where(valid[None, :, :, :, None], a, 0),
                                  np.where(valid[None, :, :, :, None], b, 0))

"""Model parity against transformers (PyTorch CPU) on tiny random checkpoints.

Reference: each checkpoint is a transformers model written with `save_pretrained`
(see `model_fixtures.VARIANTS`): Llama 3.1 (llama3 RoPE scaling, GQA 4:1, untied), Llama 2 /
LongChat (linear scaling, tied), Mistral v0.1 (sliding window 12 < sequence length).
"""

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

import rocketkv_jax.models as M
from rocketkv_jax.models import attention, llama
from rocketkv_jax.models.config import ModelConfig
from model_fixtures import PARITY_VARIANTS, hf_checkpoint, random_tokens
from xla_env import as_users_compile


def _torch_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("name", PARITY_VARIANTS)
def test_fp32_logits_match_transformers(name):
  path, ref_model = hf_checkpoint(name)
  model = M.load(path)
  tokens = random_tokens(2, 48, seed=1)
  ours = np.asarray(model.logits(tokens, block_size=16))  # 3 query blocks: skipping exercised
  ref = _torch_logits(ref_model, tokens)
  assert ours.shape == ref.shape == (2, 48, 256)
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_mistral_window_is_honoured():
  """Sanity: the sliding window changes late logits (so the parity above is meaningful)."""
  path, _ = hf_checkpoint("mistral_sw")
  model = M.load(path)
  tokens = random_tokens(1, 48, seed=2)
  with_w = np.asarray(model.logits(tokens))
  import dataclasses
  no_w = np.asarray(M.Model(dataclasses.replace(model.config, sliding_window=None),
                            model.params).logits(tokens))
  np.testing.assert_allclose(with_w[:, :12], no_w[:, :12], atol=1e-5)
  assert np.abs(with_w[:, 20:] - no_w[:, 20:]).max() > 1e-2


def test_bf16_logits_close_to_fp32():
  path, ref_model = hf_checkpoint("llama31")
  model = M.load(path, dtype=jnp.bfloat16)
  assert model.params["layers"][0]["wq"].dtype == jnp.bfloat16
  tokens = random_tokens(1, 32, seed=3)
  ours = np.asarray(model.logits(tokens))
  ref = _torch_logits(ref_model, tokens)
  assert np.abs(ours - ref).max() < 0.1 * np.abs(ref).max()


@pytest.mark.parametrize("length,block,window", [
    (37, 8, None), (37, 8, 5), (64, 16, 16), (64, 16, 20), (10, 64, None)])
def test_blockwise_attention_matches_dense(length, block, window):
  rng = np.random.default_rng(length + block)
  q = jnp.asarray(rng.normal(size=(2, 6, length, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(2, 2, length, 8)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(2, 2, length, 8)), jnp.float32)
  got = attention.blockwise_causal_attention(q, k, v, sliding_window=window, block_size=block)
  want = attention.reference_attention(q, k, v, sliding_window=window)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_prefill_never_builds_a_length_squared_tensor():
  """The jaxpr of an 8K-token attention holds nothing of size >= L*L (only block tiles)."""
  length = 8192
  q = jax.ShapeDtypeStruct((1, 9, length, 64), jnp.float32)
  k = jax.ShapeDtypeStruct((1, 3, length, 64), jnp.float32)
  jaxpr = jax.make_jaxpr(lambda q, k, v: attention.blockwise_causal_attention(q, k, v))(q, k, k)
  biggest = 0

  from jax.extend.core import jaxprs_in_params

  def walk(jp):
    nonlocal biggest
    for eqn in jp.eqns:
      for var in eqn.outvars:
        biggest = max(biggest, int(np.prod(getattr(var.aval, "shape", ()) or (1,))))
      for sub in jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  assert biggest < length * length
  assert biggest <= 9 * length * 64  # never more than a q-sized tensor


def test_config_from_rope_parameters_form():
  base = dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
  old = ModelConfig.from_hf(dict(base, rope_theta=500000.0, rope_scaling=dict(
      rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_position_embeddings=8192)))
  new = ModelConfig.from_hf(dict(base, rope_parameters=dict(
      rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
      high_freq_factor=4.0, original_max_position_embeddings=8192)))
  assert old == new and old.rope_scaling.rope_type == "llama3" and old.head_dim == 16
  lin = ModelConfig.from_hf(dict(base, rope_scaling=dict(type="linear", factor=8.0)))
  assert lin.rope_scaling.rope_type == "linear" and lin.rope_scaling.factor == 8.0


def test_config_errors_name_the_problem():
  base = dict(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4)
  with pytest.raises(ValueError, match="model_type 'gpt2'"):
    ModelConfig.from_hf(dict(base, model_type="gpt2"))
  with pytest.raises(ValueError, match="rope type 'dynamic'"):
    ModelConfig.from_hf(dict(base, rope_scaling=dict(rope_type="dynamic", factor=2.0)))
  with pytest.raises(ValueError, match="num_kv_heads"):
    ModelConfig.from_hf(dict(base, num_key_value_heads=3))


def test_init_params_match_param_shapes():
  cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=4)
  params = llama.init_params(cfg)
  shapes = jax.tree.map(lambda x: x.shape, params)
  assert shapes == jax.tree.map(tuple, llama.param_shapes(cfg),
                                is_leaf=lambda x: isinstance(x, tuple))
  logits = llama.forward(params, jnp.zeros((1, 5), jnp.int32), config=cfg)
  assert logits.shape == (1, 5, 32)


@pytest.mark.parametrize("name", PARITY_VARIANTS)
def test_prefill_logits_and_cache_match_transformers_on_ragged_batch(name):
  """`llama.prefill` (whose last layer attends from the last valid token only) gives each
  sequence of a right-padded batch the logits transformers gives it alone, and its full-KV
  cache holds transformers' keys and values."""
  import rocketkv_jax as rocketkv

  path, ref_model = hf_checkpoint(name)
  model = M.load(path)
  tokens = random_tokens(2, 40, seed=4)
  lengths = np.array([40, 27], np.int32)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, method="full", window_size=8),
                       40, 4, model.config.head_dim)
  logits, cache = llama.prefill(model.params, jnp.asarray(tokens), jnp.asarray(lengths),
                                config=model.config, plan=plan, block_size=16)
  assert len(cache) == model.config.num_layers
  for b, n in enumerate(lengths):
    with torch.no_grad():
      out = ref_model(torch.tensor(tokens[b:b + 1, :n], dtype=torch.long), use_cache=True)
    np.testing.assert_allclose(np.asarray(logits[b]), out.logits[0, -1].numpy(), atol=1e-4)
    for i in (0, model.config.num_layers - 1):  # a scanned layer and the special last one
      ref_k = out.past_key_values.layers[i].keys[0].numpy()  # [Hkv, n, Dh]
      ref_v = out.past_key_values.layers[i].values[0].numpy()
      m = ref_k.shape[1]  # all n tokens; Mistral's sliding-window cache keeps only the last ones
      np.testing.assert_allclose(np.asarray(cache[i].k[b, :, n - m:n]), ref_k, atol=1e-4)
      np.testing.assert_allclose(np.asarray(cache[i].v[b, :, n - m:n]), ref_v, atol=1e-4)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_prefill_matches_forward_for_shallow_models(num_layers):
  """Depth 1 (no scanned layer at all) and 2: prefill's last-token logits equal `forward`'s."""
  import rocketkv_jax as rocketkv

  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=num_layers,
                    num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=10)
  params = llama.init_params(cfg, seed=num_layers)
  tokens = jnp.asarray(random_tokens(2, 24, seed=5, vocab=64))
  lengths = jnp.array([24, 13], jnp.int32)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, method="full", window_size=4),
                       24, 4, 8)
  got, _ = llama.prefill(params, tokens, lengths, config=cfg, plan=plan, block_size=8)
  full = llama.forward(params, tokens, config=cfg, block_size=8)  # [B, T, V]
  want = jnp.take_along_axis(full, (lengths - 1)[:, None, None], axis=1)[:, 0]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize("native", ["0", "1"])
def test_bf16_prefill_and_decode_close_to_fp32(native, monkeypatch):
  """bf16 parameters through prefill and decode (bf16 K/V cache) vs the same bf16-rounded
  weights in fp32. native=0: fp32 compute with a bf16 cache (CPUs without bf16 dots);
  native=1: compute in bf16 (what CPUs with AVX512-BF16/AMX and GPUs run).

  Tolerance: bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.002). With fp32 compute
  only the cached K/V are rounded, once each: measured max error ~0.2% of the largest logit,
  asserted < 1%. In bf16 compute every activation is rounded at each of ~10 ops per layer:
  measured ~0.7%, asserted < 5%. A wrong dtype path (e.g. K/V stored unrounded-then-misread, or
  fp32 compute not taken) breaks the first bound by orders of magnitude.
  """
  import rocketkv_jax as rocketkv
  from rocketkv_jax.models import precision

  monkeypatch.setenv("ROCKETKV_NATIVE_BF16", native)
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8)
  p16 = jax.tree.map(lambda a: (a * 5).astype(jnp.bfloat16) if a.ndim == 2 else
                     a.astype(jnp.bfloat16), llama.init_params(cfg, seed=7))
  p32 = jax.tree.map(lambda a: a.astype(jnp.float32), p16)
  assert precision.compute_dtype(jnp.bfloat16) == (jnp.float32 if native == "0" else
                                                   jnp.bfloat16)
  tokens = jnp.asarray(random_tokens(2, 24, seed=8, vocab=64))
  lengths = jnp.array([24, 17], jnp.int32)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, method="full", window_size=4),
                       24, 4, 8)

  def run(params):
    logits, cache = llama.prefill(params, tokens, lengths, config=cfg, plan=plan, block_size=8)
    out = [logits]
    for t in range(3):  # the same fed tokens for both runs
      tok = tokens[:, t]
      logits, cache = llama.decode_step(params, cache, tok, lengths + t, config=cfg, plan=plan)
      out.append(logits)
    return np.stack([np.asarray(x) for x in out]), cache

  got, cache = run(p16)
  want, _ = run(p32)
  assert cache[0].k.dtype == jnp.bfloat16
  err = np.abs(got - want).max() / np.abs(want).max()
  print(f"native={native}: max error {err:.4f} of max |logit| {np.abs(want).max():.2f}")
  assert err < (0.01 if native == "0" else 0.05)


def test_native_bf16_cpu_reads_the_cpuinfo_flags(tmp_path, monkeypatch):
  from rocketkv_jax.models import precision

  monkeypatch.delenv("ROCKETKV_NATIVE_BF16", raising=False)
  amx = tmp_path / "amx"
  amx.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n\n"
                 "processor\t: 1\nflags\t\t: fpu\n")
  avx2 = tmp_path / "avx2"
  avx2.write_text("processor\t: 0\nflags\t\t: fpu avx avx2 fma\n")
  monkeypatch.setattr(precision, "_native_bf16_dot", lambda: True)
  assert precision.native_bf16_cpu(str(amx))
  assert not precision.native_bf16_cpu(str(avx2))
  assert not precision.native_bf16_cpu(str(tmp_path / "missing"))
  # the flags alone are not enough: XLA must also compile bf16 dots natively
  monkeypatch.setattr(precision, "_native_bf16_dot", lambda: False)
  assert not precision.native_bf16_cpu(str(amx))
  monkeypatch.setenv("ROCKETKV_NATIVE_BF16", "1")
  assert precision.native_bf16_cpu(str(avx2))


def test_bf16_dot_probe_reads_the_compiled_hlo():
  """jaxlib 0.10.2 on an AVX512-BF16 CPU without AMX converts a bf16 dot's operands to fp32 (the
  form below, trimmed from its compiled HLO): not native. A dot that stays bf16 is."""
  from rocketkv_jax.models import precision

  converted = """
  %wrapped_convert = f32[64,64]{1,0} fusion(%a.1), kind=kLoop, calls=%wrapped_convert_computation
  %ynn_fusion = f32[64,64]{1,0} fusion(%wrapped_convert, %wrapped_convert.1), kind=kCustom
  ROOT %wrapped_convert.2 = bf16[64,64]{1,0} fusion(%ynn_fusion), kind=kLoop"""
  native = """
  ROOT %dot.0 = bf16[64,64]{1,0} dot(bf16[64,64]{1,0} %a, bf16[64,64]{1,0} %b)"""
  assert not precision.bf16_dot_hlo_is_native(converted)
  assert precision.bf16_dot_hlo_is_native(native)
  precision._native_bf16_dot()  # the probe itself compiles on the CPU backend without raising


def test_full_kv_keeps_each_layer_apart_and_its_prompt_pass_stays_small():
  """Full KV's decode reads every slot of every layer, so `prefill(stacked=True)` hands each
  layer's cache over as its own buffer (a scanned step over a stack copies the layer's K/V out
  of it every step), from a prompt pass that runs those layers unrolled. Its temporaries must
  not grow with depth: no per-layer buffer may be made ahead of its layer (a batch loop in
  `blockwise_causal_attention` that starts a fresh output buffer did that: XLA scheduled every
  layer's zero-filled output at the program's start)."""
  import rocketkv_jax as rocketkv

  def cfg(n):
    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=n,
                       num_heads=4, num_kv_heads=2, head_dim=8)

  tokens, lengths = jnp.zeros((4, 1024), jnp.int32), jnp.array([1024, 900, 512, 7], jnp.int32)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, method="full"), 1024, 4, 8)
  params = llama.init_params(cfg(4), seed=0)
  _, stack = llama.prefill(params, tokens[:, :64], jnp.minimum(lengths, 64), config=cfg(4),
                           plan=rocketkv.plan(rocketkv.RocketConfig(64, method="full"), 64, 4, 8),
                           stacked=True)
  assert stack.spans == ((0, 1), (1, 2), (2, 3), (3, 4))
  assert all(g.k.shape == (4, 2, 68, 8) for g in stack.groups)

  def temps(n):
    fn = jax.jit(lambda p, t, ln: llama.prefill(p, t, ln, config=cfg(n), plan=plan,
                                                stacked=True))
    mem = as_users_compile(fn.lower(llama.init_params(cfg(n)), tokens, lengths)).memory_analysis()
    return mem.temp_size_in_bytes

  attn_out = 4 * 4 * 1024 * 8 * 4  # one layer's attention output [B, Hq, L, Dh] fp32
  shallow, deep = temps(4), temps(8)
  assert deep <= shallow + attn_out, (shallow, deep)

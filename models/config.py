"""Static model configuration: a frozen, hashable dataclass passed to jit as a static argument.

One `ModelConfig` describes every supported checkpoint family:

* Llama 2 / 3 / 3.1 / 3.2 and SmolLM2 (`architecture="llama"`),
* Mistral v0.1 (`architecture="mistral"`, `sliding_window=4096`) and v0.2 / v0.3
  (`sliding_window=None`),
* Gemma 3 text (`architecture="gemma3"`): a hybrid of sliding-window and full layers
  (`layer_types`), see docs/gemma3.md,
* Qwen 2 / 2.5 (`architecture="qwen2"`: q, k, v projection biases) and Qwen 3 dense
  (`architecture="qwen3"`: per-head RMSNorm of q and k), docs/models.md.

RoPE scaling is a separate frozen `RopeScaling` (type `"default"`, `"linear"`, `"llama3"` or
`"yarn"`).
Both Hugging Face config spellings are accepted: the classic `rope_theta` + `rope_scaling`
and the newer `rope_parameters` dict (transformers >= 5).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "gemma3", "qwen2", "qwen3")
LAYER_TYPES = ("sliding_attention", "full_attention")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling.

  Attributes:
    rope_type: "default" (none), "linear" (positions divided by `factor`, e.g.
      LongChat-7B-v1.5-32k), "llama3" (Llama 3.1's band-wise wavelength scaling) or "yarn"
      (YaRN, Peng et al. 2023: Qwen 2.5 / Qwen 3 long context).
    factor: scale factor (1.0 for "default").
    low_freq_factor, high_freq_factor: "llama3" only.
    original_max_position_embeddings: the pre-training context ("llama3", "yarn").
    beta_fast, beta_slow: "yarn": frequencies turning more than beta_fast times over the
      original context keep their value, fewer than beta_slow times are divided by `factor`,
      a linear ramp between.
    attention_factor: "yarn": cos and sin are multiplied by it (so attention logits by its
      square); None means the paper's 0.1 * ln(factor) + 1.
    truncate: "yarn": round the ramp's ends to whole dimensions (floor / ceil).
  """

  rope_type: str = "default"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  truncate: bool = True

  def __post_init__(self):
    if self.rope_type not in SUPPORTED_ROPE_TYPES:
      raise ValueError(
          f"rope_scaling type {self.rope_type!r} is not supported; "
          f"allowed: {SUPPORTED_ROPE_TYPES}")
    if self.factor <= 0:
      raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")

  @property
  def attention_scale(self) -> float:
    """What cos and sin are multiplied by: YaRN's attention temperature, else 1."""
    if self.rope_type != "yarn":
      return 1.0
    if self.attention_factor is not None:
      return float(self.attention_factor)
    return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer hyper-parameters (all static).

  Attributes:
    vocab_size: V.
    hidden_size: model width D.
    intermediate_size: SwiGLU width F.
    num_layers: number of decoder blocks.
    num_heads: query heads Hq.
    num_kv_heads: key/value heads Hkv (GQA group G = Hq // Hkv; query head h uses KV head h // G).
    head_dim: per-head width Dh.
    rms_norm_eps: RMSNorm epsilon.
    rope_theta: RoPE base.
    rope_scaling: `RopeScaling`.
    max_position_embeddings: the context length; longer prompts are rejected.
    tie_word_embeddings: the LM head reuses the embedding matrix.
    sliding_window: Mistral v0.1 attention window (a query at position i sees keys j with
      i - j < sliding_window), or None for full causal attention.
    architecture: one of SUPPORTED_ARCHITECTURES.
    bos_token_id, eos_token_ids: special ids (eos may be several, as in Llama 3).
    rope_freq_factors: optional per-frequency divisors `[Dh // 2]` (llama.cpp's `rope_freqs`
      tensor, how GGUF files store Llama 3.1 scaling); applied on top of `rope_scaling`.
    layer_types: None (every layer alike: `sliding_window` applies to all, Mistral v0.1), or
      one of LAYER_TYPES per layer (Gemma 3's hybrid): only "sliding_attention" layers use
      `sliding_window`, and they keep a bounded cache instead of the KV method's (docs/gemma3.md).
    rope_local_theta: RoPE base of the sliding layers of a hybrid model (unscaled), or None.
    query_pre_attn_scalar: softmax scale is query_pre_attn_scalar ** -0.5 (None: head_dim).
    final_logit_softcap: logits = c * tanh(logits / c), or None.
  Gemma 3 (`architecture="gemma3"`) also means: embeddings scaled by sqrt(D), RMSNorm of q
  and k per head, norms after attention and MLP too, tanh-GELU GeGLU. Its norm weights are
  held as the multiplier 1 + w (llama.cpp's GGUF convention; the HF loader adds the 1).
  Qwen 3 (`"qwen3"`) is Llama's block with the per-head RMSNorm of q and k (weights held as
  they are: x * w); Qwen 2 / 2.5 (`"qwen2"`) is Llama's block with q, k, v projection biases.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling = RopeScaling()
  max_position_embeddings: int = 4096
  tie_word_embeddings: bool = False
  sliding_window: int | None = None
  architecture: str = "llama"
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  rope_freq_factors: tuple[float, ...] | None = None
  layer_types: tuple[str, ...] | None = None
  rope_local_theta: float | None = None
  query_pre_attn_scalar: float | None = None
  final_logit_softcap: float | None = None

  def __post_init__(self):
    if self.architecture not in SUPPORTED_ARCHITECTURES:
      raise ValueError(
          f"architecture {self.architecture!r} is not supported; allowed: {SUPPORTED_ARCHITECTURES}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f"sliding_window must be None or >= 1, got {self.sliding_window}")
    if self.layer_types is not None:
      if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
        raise ValueError(f"layer_types must hold one of {LAYER_TYPES} per layer "
                         f"({self.num_layers}), got {self.layer_types}")
      if self.sliding_window is None and "sliding_attention" in self.layer_types:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is None")

  @property
  def gemma(self) -> bool:
    """Gemma's block: scaled embeddings, q/k norms, post-norms, GeGLU (see the docstring)."""
    return self.architecture == "gemma3"

  @property
  def qk_norm(self) -> bool:
    """Per-head RMSNorm of q and k before RoPE (Gemma 3, Qwen 3): `q_norm`, `k_norm` weights."""
    return self.architecture in ("gemma3", "qwen3")

  @property
  def qkv_bias(self) -> bool:
    """q, k, v projections with biases `bq`, `bk`, `bv` (Qwen 2 / 2.5; o_proj has none)."""
    return self.architecture == "qwen2"

  def layer_window(self, i: int) -> int | None:
    """Layer i's attention window: `sliding_window` on its sliding layers, else None."""
    if self.layer_types is None or self.layer_types[i] == "sliding_attention":
      return self.sliding_window
    return None

  @property
  def window_layers(self) -> tuple[int, ...]:
    """The sliding layers of a hybrid model (`layer_types`): their decode state is a cache of
    the last `sliding_window` prompt tokens + the new ones, not the KV method's. (Mistral
    v0.1, all layers sliding, has none: the KV method runs on every layer.)"""
    if self.layer_types is None:
      return ()
    return tuple(i for i, t in enumerate(self.layer_types) if t == "sliding_attention")

  def layer_rope(self, i: int) -> tuple[float, "RopeScaling", tuple | None]:
    """(base, scaling, freq factors) of layer i's RoPE: a hybrid's sliding layers use
    `rope_local_theta` unscaled, every other layer `rope_theta` + `rope_scaling`."""
    if i in self.window_layers and self.rope_local_theta is not None:
      return self.rope_local_theta, RopeScaling(), None
    return self.rope_theta, self.rope_scaling, self.rope_freq_factors

  @property
  def query_scale(self) -> float:
    """The softmax scale of the attention logits."""
    return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

  @property
  def num_groups(self) -> int:
    """GQA group size G = Hq // Hkv."""
    return self.num_heads // self.num_kv_heads

  @classmethod
  def from_hf(cls, hf: Mapping[str, Any]) -> "ModelConfig":
    """Builds a config from a Hugging Face `config.json` dict.

    Raises:
      ValueError: unsupported `model_type`, rope type, bias layers or activation.
    """
    model_type = hf.get("model_type", "llama")
    if model_type == "gemma3":  # the multimodal config: its text model
      hf = dict(hf.get("text_config") or {}, model_type="gemma3_text")
      model_type = "gemma3_text"
    if model_type == "gemma3_text":
      return _gemma3_from_hf(hf)
    if model_type in ("qwen2", "qwen3"):
      return _qwen_from_hf(hf, model_type)
    if model_type not in SUPPORTED_ARCHITECTURES:
      raise ValueError(
          f"config.json model_type {model_type!r} is not supported; allowed: "
          f"{SUPPORTED_ARCHITECTURES}")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
      raise ValueError("attention_bias / mlp_bias = True is not supported (Llama/Mistral have none)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
      raise ValueError(f"hidden_act {act!r} is not supported; allowed: ('silu',)")
    hidden = hf["hidden_size"]
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    rope_theta, rope = _rope_from_hf(hf)
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    window = hf.get("sliding_window") if model_type == "mistral" else None
    if model_type == "mistral" and window is not None and not hf.get("use_sliding_window", True):
      window = None
    return cls(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=rope,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=window,
        architecture=model_type,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _gemma3_from_hf(hf: Mapping[str, Any]) -> "ModelConfig":
  """A `gemma3_text` config (transformers' defaults where a key is absent)."""
  if hf.get("attention_bias"):
    raise ValueError("attention_bias = True is not supported (Gemma 3 has none)")
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
  if act != "gelu_pytorch_tanh":
    raise ValueError(f"hidden_activation {act!r} is not supported; allowed: ('gelu_pytorch_tanh',)")
  if hf.get("attn_logit_softcapping") is not None:
    raise ValueError("attn_logit_softcapping is not supported (None in Gemma 3)")
  if hf.get("use_bidirectional_attention"):
    raise ValueError("use_bidirectional_attention = True is not supported (a decoder is causal)")
  n = hf.get("num_hidden_layers", 26)
  types = hf.get("layer_types")
  if types is None:
    pattern = hf.get("sliding_window_pattern", 6)
    types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
  params = hf.get("rope_parameters") or {}
  full = dict(params.get("full_attention") or {})
  local = dict(params.get("sliding_attention") or {})
  if not params:  # the classic spelling
    full = dict(hf.get("rope_scaling") or {}, rope_theta=hf.get("rope_theta", 1e6))
    local = {"rope_theta": hf.get("rope_local_base_freq", 1e4)}
  if local.get("rope_type", local.get("type", "default")) != "default":
    raise ValueError("rope scaling on sliding layers is not supported (Gemma 3 has none)")
  theta, rope = _rope_from_hf({"rope_parameters": {"rope_theta": 1e6, **full}})
  eos = hf.get("eos_token_id", 1)
  heads = hf.get("num_attention_heads", 8)
  return ModelConfig(
      vocab_size=hf.get("vocab_size", 262208),
      hidden_size=hf.get("hidden_size", 2304),
      intermediate_size=hf.get("intermediate_size", 9216),
      num_layers=n,
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim", 256),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      rope_theta=float(theta),
      rope_scaling=rope,
      max_position_embeddings=hf.get("max_position_embeddings", 131072),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
      sliding_window=hf.get("sliding_window", 4096),
      architecture="gemma3",
      bos_token_id=hf.get("bos_token_id", 2),
      eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,)),
      layer_types=tuple(types),
      rope_local_theta=float(local.get("rope_theta", 1e4)),
      query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
      final_logit_softcap=hf.get("final_logit_softcapping"),
  )


def _qwen_from_hf(hf: Mapping[str, Any], model_type: str) -> "ModelConfig":
  """A dense text `qwen2` (Qwen 2 / 2.5) or `qwen3` config (transformers' defaults where a key
  is absent). With `use_sliding_window`, layers from `max_window_layers` on (or as
  `layer_types` says) are sliding ones and keep a bounded window cache, as Gemma 3's."""
  if model_type == "qwen3" and hf.get("attention_bias"):
    raise ValueError("attention_bias = True is not supported for qwen3 (released Qwen 3 has none)")
  if hf.get("mlp_bias"):
    raise ValueError("mlp_bias = True is not supported (Qwen has none)")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"hidden_act {act!r} is not supported; allowed: ('silu',)")
  n = hf["num_hidden_layers"]
  hidden = hf["hidden_size"]
  heads = hf["num_attention_heads"]
  max_pos = hf.get("max_position_embeddings", 32768)
  window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
  types = None
  if window is not None:
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(n)]
    types = tuple(types)
    if "sliding_attention" not in types:
      window, types = None, None
    elif "full_attention" not in types:  # every layer sliding: Mistral v0.1's form
      types = None
  rope_theta, rope = _rope_from_hf(hf)
  eos = hf.get("eos_token_id")
  return ModelConfig(
      vocab_size=hf["vocab_size"],
      hidden_size=hidden,
      intermediate_size=hf["intermediate_size"],
      num_layers=n,
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hidden // heads,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      rope_theta=float(rope_theta),
      rope_scaling=rope,
      max_position_embeddings=max_pos,
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      sliding_window=window,
      architecture=model_type,
      bos_token_id=hf.get("bos_token_id"),
      eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,)),
      layer_types=types,
  )


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, RopeScaling]:
  """(rope_theta, RopeScaling) from either `rope_parameters` or `rope_theta` + `rope_scaling`."""
  params = hf.get("rope_parameters")
  if params:
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = params
  else:
    theta = hf.get("rope_theta", 10000.0)
    scaling = hf.get("rope_scaling") or {}
  rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
  if rope_type not in SUPPORTED_ROPE_TYPES:
    raise ValueError(
        f"rope type {rope_type!r} is not supported; allowed: {SUPPORTED_ROPE_TYPES}")
  if rope_type == "default":
    return theta, RopeScaling()
  if rope_type == "yarn":
    return theta, _yarn_from_hf(hf, scaling)
  kwargs = dict(rope_type=rope_type, factor=float(scaling["factor"]))
  if rope_type == "llama3":
    kwargs.update(
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )
  return theta, RopeScaling(**kwargs)


def _yarn_from_hf(hf: Mapping[str, Any], scaling: Mapping[str, Any]) -> RopeScaling:
  """YaRN's `RopeScaling` from a config's scaling dict (the pre-training context defaults to
  max_position_embeddings, the factor to their ratio, the betas to 32 and 1)."""
  if scaling.get("mscale") and scaling.get("mscale_all_dim"):
    raise ValueError("yarn mscale / mscale_all_dim (DeepSeek's form) is not supported; "
                     "allowed: factor, original_max_position_embeddings, beta_fast, beta_slow, "
                     "attention_factor, truncate")
  max_pos = hf.get("max_position_embeddings", 4096)
  original = (hf.get("original_max_position_embeddings")
              or scaling.get("original_max_position_embeddings") or max_pos)
  factor = scaling.get("factor")
  factor = max_pos / original if factor is None else factor
  attention = scaling.get("attention_factor")
  return RopeScaling(
      rope_type="yarn", factor=float(factor), original_max_position_embeddings=int(original),
      beta_fast=float(scaling.get("beta_fast") or 32.0),
      beta_slow=float(scaling.get("beta_slow") or 1.0),
      attention_factor=None if attention is None else float(attention),
      truncate=bool(scaling.get("truncate", True)))

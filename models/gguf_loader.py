"""Loading llama.cpp GGUF files (architecture "llama": Llama 2/3, SmolLM2, Mistral; "gemma3";
"qwen2": Qwen 2 / 2.5; "qwen3": Qwen 3 dense).

The `gguf` package memory-maps the file and dequantises one tensor at a time (any of its
quantisation types: Q4_0/Q4_1/Q8_0/K-quants/F16/...), so reads are lazy and per tensor.
llama.cpp's converter permutes the rows of `attn_q` / `attn_k` from Hugging Face's half-split
RoPE layout to the interleaved one; `unpermute_rope_rows` undoes it. Llama 3.1 scaling, which
GGUF stores as a `rope_freqs` tensor of per-frequency divisors, becomes
`ModelConfig.rope_freq_factors`. GGUF has no sliding-window field for the llama architecture,
so Mistral v0.1 GGUFs load without the window (as llama.cpp runs them).

Gemma 3 (`gemma3`): llama.cpp's converter stores every norm weight as 1 + w (its RMSNorm is a
plain x * weight) -- how our params hold them too, so they load as they are (transformers' GGUF
loader subtracts the 1 again); q / k rows are not permuted (NeoX RoPE). GGUF has no layer
pattern, RoPE local base or query scale: llama.cpp's own values are used (every 6th layer full,
local base 10000, query scale key_length ** -0.5, the 27B's hidden / heads).

Qwen (`qwen2`, `qwen3`): q / k rows are not permuted (NeoX RoPE); Qwen 2's q, k, v biases are
`attn_{q,k,v}.bias`, Qwen 3's per-head norms `attn_{q,k}_norm` (plain x * w). YaRN is
`rope.scaling.type = "yarn"` with `rope.scaling.factor` and `original_context_length`. GGUF has
no sliding-window field for them: they load with full attention on every layer (as llama.cpp
runs them; released Qwen configs have `use_sliding_window = false`).
"""

from __future__ import annotations

import os
import struct
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from rocketkv_jax.models.config import ModelConfig, RopeScaling
from rocketkv_jax.models.errors import CheckpointError, cause, check_finite
from rocketkv_jax.models.llama import param_shapes
from rocketkv_jax.models.sharding import global_array

_LAYER_MAP = {
    "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
    "wo": "attn_output", "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up",
    "w_down": "ffn_down",
}
_GEMMA_LAYER_MAP = dict(_LAYER_MAP, q_norm="attn_q_norm", k_norm="attn_k_norm",
                        post_attn_norm="post_attention_norm", post_mlp_norm="post_ffw_norm")
_QWEN3_LAYER_MAP = dict(_LAYER_MAP, q_norm="attn_q_norm", k_norm="attn_k_norm")
_QWEN2_LAYER_MAP = dict(_LAYER_MAP, bq="attn_q", bk="attn_k", bv="attn_v")  # .bias, not .weight
_LAYER_MAPS = {"gemma3": _GEMMA_LAYER_MAP, "qwen3": _QWEN3_LAYER_MAP, "qwen2": _QWEN2_LAYER_MAP}
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "gemma3", "qwen2", "qwen3")


GGUF_MAGIC = b"GGUF"


def check_magic(path: str) -> None:
  """Raises a CheckpointError naming `path` unless it starts with the GGUF magic bytes."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file {path!r} does not exist")
  with open(path, "rb") as f:
    magic = f.read(len(GGUF_MAGIC))
  if magic != GGUF_MAGIC:
    raise CheckpointError(path, f"expected a GGUF file (the magic bytes {GGUF_MAGIC!r} at its "
                          f"start), found {magic!r}")


class GGUFTensor(NamedTuple):
  """One tensor of a `GGUFFile`: `data` is its bytes (uint8 `[rows, row bytes]`, memory-mapped),
  `shape` GGUF's dims (innermost first), `tensor_type` a `gguf.GGMLQuantizationType`."""
  name: str
  shape: np.ndarray
  tensor_type: Any
  data: np.ndarray


class GGUFFile(NamedTuple):
  """A parsed GGUF file: `metadata` (key -> str / number / list) and its `tensors`."""
  path: str
  metadata: dict
  tensors: list


# GGUF value types -> struct formats (8: string, 9: array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}


def _parse(path: str) -> GGUFFile:
  """Reads the header of a little-endian GGUF v2 / v3 file; tensor data stay memory-mapped.
  (Our own parser: `gguf.GGUFReader` builds a view per array element, slow for a large
  vocabulary: docs/gemma3.md.)"""
  import gguf

  mm = np.memmap(path, dtype=np.uint8, mode="r")
  buf = memoryview(mm)
  at = 0

  def take(fmt):
    nonlocal at
    out = struct.unpack_from("<" + fmt, buf, at)
    at += struct.calcsize("<" + fmt)
    return out[0] if len(out) == 1 else out

  def string():
    nonlocal at
    n = take("Q")
    at += n
    return bytes(buf[at - n:at]).decode("utf-8", errors="replace")

  def value(vtype):
    nonlocal at
    if vtype == 8:
      return string()
    if vtype == 9:
      etype, count = take("I"), take("Q")
      if etype in _SCALAR:  # numeric arrays in one read
        dt = np.dtype("<" + _SCALAR[etype])
        out = np.frombuffer(buf, dt, count, at).tolist()
        at += dt.itemsize * count
        return out
      return [value(etype) for _ in range(count)]
    return take(_SCALAR[vtype])

  _, version, n_tensors, n_kv = take("4s"), take("I"), take("Q"), take("Q")
  if version not in (2, 3):
    raise ValueError(f"GGUF version {version} is not supported; allowed: (2, 3)")
  meta = {}
  for _ in range(n_kv):
    key = string()
    meta[key] = value(take("I"))
  infos = []
  for _ in range(n_tensors):
    name = string()
    dims = [take("Q") for _ in range(take("I"))]
    infos.append((name, dims, gguf.GGMLQuantizationType(take("I")), take("Q")))
  align = meta.get("general.alignment", 32)
  start = -(-at // align) * align
  tensors = []
  for name, dims, qtype, offset in infos:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    row_bytes = dims[0] // block * size
    rows = int(np.prod(dims[1:], dtype=np.int64))
    data = mm[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
    tensors.append(GGUFTensor(name, np.array(dims), qtype, data))
  return GGUFFile(path, meta, tensors)


def open_gguf(path: str) -> GGUFFile:
  """The file's metadata and memory-mapped tensors (`GGUFFile`).

  Raises:
    FileNotFoundError: no such file. CheckpointError (naming the file): not a readable GGUF
      file.
  """
  check_magic(path)
  try:
    return _parse(path)
  except Exception as e:  # pylint: disable=broad-except  # truncated / corrupt: any error type
    raise CheckpointError(path, f"expected a GGUF file, cannot read it (truncated or corrupt?): "
                          f"{cause(e)}") from e


def read_metadata(reader: GGUFFile) -> dict[str, Any]:
  return dict(reader.metadata)


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any]) -> ModelConfig:
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED_GGUF_ARCHITECTURES:
    raise ValueError(
        f"GGUF architecture {arch!r} is not supported; allowed: {SUPPORTED_GGUF_ARCHITECTURES} "
        "(llama.cpp stores Llama, SmolLM2 and Mistral as 'llama')")
  p = lambda k, d=None: meta.get(f"{arch}.{k}", d)
  hidden = p("embedding_length")
  heads = p("attention.head_count")
  head_dim = p("attention.key_length") or hidden // heads
  rope_type = p("rope.scaling.type", "none")
  if rope_type in ("none", None):
    scaling = RopeScaling()
  elif rope_type == "linear":
    scaling = RopeScaling(rope_type="linear", factor=float(p("rope.scaling.factor")))
  elif rope_type == "yarn":
    for key in ("rope.scaling.attn_factor", "rope.scaling.yarn_attn_factor",
                "rope.scaling.yarn_log_multiplier"):
      if p(key) not in (None, 1.0, 0.0):
        raise ValueError(f"GGUF {arch}.{key} = {p(key)} is not supported; allowed: absent or 1")
    scaling = RopeScaling(
        rope_type="yarn", factor=float(p("rope.scaling.factor")),
        original_max_position_embeddings=int(p("rope.scaling.original_context_length")),
        beta_fast=float(p("rope.scaling.yarn_beta_fast") or 32.0),
        beta_slow=float(p("rope.scaling.yarn_beta_slow") or 1.0))
  else:
    raise ValueError(
        f"GGUF rope scaling type {rope_type!r} is not supported; allowed: ('none', 'linear', "
        "'yarn') and Llama 3.1's rope_freqs tensor")
  factors = None
  if "rope_freqs.weight" in tensors:
    factors = tuple(float(x) for x in _dequantize(tensors["rope_freqs.weight"]).reshape(-1))
  vocab = p("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
  eos = meta.get("tokenizer.ggml.eos_token_id")
  gemma = {}
  if arch == "gemma3":
    n = p("block_count")
    pattern = p("attention.sliding_window_pattern", 6)  # an int, or one bool per layer
    sliding = (list(pattern) if isinstance(pattern, list)
               else [bool((i + 1) % pattern) for i in range(n)])
    gemma = dict(
        architecture="gemma3", sliding_window=p("attention.sliding_window"),
        layer_types=tuple("sliding_attention" if x else "full_attention" for x in sliding),
        rope_local_theta=10000.0,
        # llama.cpp: key_length ** -0.5, but hidden / heads for the 27B (62 layers)
        query_pre_attn_scalar=float(hidden // heads if n == 62 else head_dim),
        final_logit_softcap=p("final_logit_softcapping"))
    if p("attn_logit_softcapping") is not None:
      raise ValueError("GGUF gemma3 attn_logit_softcapping is not supported (None in Gemma 3)")
  return ModelConfig(
      vocab_size=vocab,
      hidden_size=hidden,
      intermediate_size=p("feed_forward_length"),
      num_layers=p("block_count"),
      num_heads=heads,
      num_kv_heads=p("attention.head_count_kv") or heads,
      head_dim=head_dim,
      rms_norm_eps=float(p("attention.layer_norm_rms_epsilon", 1e-5)),
      rope_theta=float(p("rope.freq_base", 10000.0)),
      rope_scaling=scaling,
      max_position_embeddings=p("context_length", 4096),
      tie_word_embeddings="output.weight" not in tensors,
      bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_token_ids=() if eos is None else (eos,),
      rope_freq_factors=factors,
      **(gemma or dict(architecture=arch)),
  )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute`: `[n_heads * Dh, D_in]` interleaved -> half-split rows."""
  rows = w.shape[0]
  return (w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


def _dequantize(t) -> np.ndarray:
  """One tensor as float32 numpy in GGUF row-major layout (`[out, in]` for matrices)."""
  import gguf

  data = gguf.quants.dequantize(t.data, t.tensor_type)
  shape = tuple(int(s) for s in reversed(t.shape.tolist()))
  return np.asarray(data, np.float32).reshape(shape)


def load_gguf_params(reader, config: ModelConfig, dtype=jnp.float32, shardings=None):
  """Dequantises every tensor into our parameter pytree (see `llama.param_shapes`).

  Args:
    reader: from `open_gguf`.
    config: from `config_from_gguf`.
    dtype: parameter dtype.
    shardings: optional pytree of `NamedSharding`; each process places only its own devices'
      slices (`sharding.global_array`). GGUF quantisation blocks do not line up with shards,
      so each process's host dequantises whole tensors, one at a time.

  Raises:
    CheckpointError (naming the file): a missing, unreadable or misshapen tensor, or one
      holding NaN / Inf.
  """
  tensors = {t.name: t for t in reader.tensors}
  shapes = param_shapes(config)
  path = reader.path

  def get(name, want, transpose, heads=None):
    if name not in tensors:
      raise CheckpointError(path, f"expected the tensor {name!r}, which is not there")
    try:
      w = _dequantize(tensors[name])
    except Exception as e:  # pylint: disable=broad-except  # truncated data, unknown quant type
      raise CheckpointError(path, f"cannot read the tensor {name!r} (truncated or corrupt?): "
                            f"{cause(e)}") from e
    check_finite(w, name, path)
    if heads is not None:
      w = unpermute_rope_rows(w, heads)
    if transpose:
      w = w.T
    if w.shape != tuple(want):
      raise CheckpointError(
          path, f"shape mismatch between GGUF metadata and weights: expected {name!r} of shape "
          f"{tuple(want)} (from the metadata, after transpose), found {w.shape}")
    return w.astype(np.dtype(dtype), copy=False)

  def place(x, sh):
    return jnp.asarray(x) if sh is None else global_array(x, sh)

  sh = shardings or {}
  params: dict[str, Any] = {
      "embed": place(get("token_embd.weight", shapes["embed"], False), sh.get("embed")),
      "final_norm": place(get("output_norm.weight", shapes["final_norm"], False),
                          sh.get("final_norm")),
  }
  if "lm_head" in shapes:
    params["lm_head"] = place(get("output.weight", shapes["lm_head"], True), sh.get("lm_head"))
  params["layers"] = []
  for i in range(config.num_layers):
    layer = {}
    for key, gname in _LAYER_MAPS.get(config.architecture, _LAYER_MAP).items():
      # llama.cpp interleaves the q / k rows of the llama architecture only
      permuted = config.architecture == "llama"
      heads = {"wq": config.num_heads, "wk": config.num_kv_heads}.get(key) if permuted else None
      bias = key in ("bq", "bk", "bv")
      transpose = not (key.endswith("norm") or bias)
      w = get(f"blk.{i}.{gname}.{'bias' if bias else 'weight'}", shapes["layers"][i][key],
              transpose, heads)
      layer[key] = place(w, sh["layers"][i][key] if sh else None)
    params["layers"].append(layer)
  return params

"""Loading llama.cpp GGUF files (Llama-architecture: Llama 2/3, SmolLM2, Mistral).

The `gguf` package memory-maps the file and dequantises one tensor at a time (any of its
quantisation types: Q4_0/Q4_1/Q8_0/K-quants/F16/...), so reads are lazy and per tensor.
llama.cpp's converter permutes the rows of `attn_q` / `attn_k` from Hugging Face's half-split
RoPE layout to the interleaved one; `unpermute_rope_rows` undoes it. Llama 3.1 scaling, which
GGUF stores as a `rope_freqs` tensor of per-frequency divisors, becomes
`ModelConfig.rope_freq_factors`. GGUF has no sliding-window field for the llama architecture,
so Mistral v0.1 GGUFs load without the window (as llama.cpp runs them).
"""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from rocketkv_jax.models.config import ModelConfig, RopeScaling
from rocketkv_jax.models.errors import CheckpointError, cause
from rocketkv_jax.models.llama import param_shapes
from rocketkv_jax.models.sharding import global_array

_LAYER_MAP = {
    "attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v",
    "wo": "attn_output", "mlp_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up",
    "w_down": "ffn_down",
}


def _field_value(field) -> Any:
  """Decodes one GGUF metadata field to a Python value (str, number, or list)."""
  import gguf

  types = field.types
  if not types:
    return None
  if types[0] == gguf.GGUFValueType.ARRAY:
    if types[-1] == gguf.GGUFValueType.STRING:
      return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
    return [field.parts[i].tolist()[0] for i in field.data]
  if types[0] == gguf.GGUFValueType.STRING:
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
  return field.parts[field.data[0]].tolist()[0]


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


def open_gguf(path: str):
  """A `gguf.GGUFReader` (memory-mapped).

  Raises:
    FileNotFoundError: no such file. CheckpointError (naming the file): not a readable GGUF
      file.
  """
  check_magic(path)
  import gguf

  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # pylint: disable=broad-except  # truncated / corrupt: any error type
    raise CheckpointError(path, f"expected a GGUF file, cannot read it (truncated or corrupt?): "
                          f"{cause(e)}") from e


def read_metadata(reader) -> dict[str, Any]:
  return {k: _field_value(f) for k, f in reader.fields.items()}


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any]) -> ModelConfig:
  arch = meta.get("general.architecture")
  if arch != "llama":
    raise ValueError(
        f"GGUF architecture {arch!r} is not supported; allowed: ('llama',) "
        "(llama.cpp stores Llama, SmolLM2 and Mistral as 'llama')")
  p = lambda k, d=None: meta.get(f"llama.{k}", d)
  hidden = p("embedding_length")
  heads = p("attention.head_count")
  head_dim = p("attention.key_length") or hidden // heads
  rope_type = p("rope.scaling.type", "none")
  if rope_type in ("none", None):
    scaling = RopeScaling()
  elif rope_type == "linear":
    scaling = RopeScaling(rope_type="linear", factor=float(p("rope.scaling.factor")))
  else:
    raise ValueError(
        f"GGUF rope scaling type {rope_type!r} is not supported; allowed: ('none', 'linear') "
        "and Llama 3.1's rope_freqs tensor")
  factors = None
  if "rope_freqs.weight" in tensors:
    factors = tuple(float(x) for x in np.asarray(tensors["rope_freqs.weight"].data).reshape(-1))
  vocab = p("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
  eos = meta.get("tokenizer.ggml.eos_token_id")
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
      architecture="llama",
      bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
      eos_token_ids=() if eos is None else (eos,),
      rope_freq_factors=factors,
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
    CheckpointError (naming the file): a missing, unreadable or misshapen tensor.
  """
  tensors = {t.name: t for t in reader.tensors}
  shapes = param_shapes(config)
  path = str(getattr(reader.data, "filename", None) or "<GGUF file>")

  def get(name, want, transpose, heads=None):
    if name not in tensors:
      raise CheckpointError(path, f"expected the tensor {name!r}, which is not there")
    try:
      w = _dequantize(tensors[name])
    except Exception as e:  # pylint: disable=broad-except  # truncated data, unknown quant type
      raise CheckpointError(path, f"cannot read the tensor {name!r} (truncated or corrupt?): "
                            f"{cause(e)}") from e
    if heads is not None:
      w = unpermute_rope_rows(w, heads)
    if transpose:
      w = w.T
    if w.shape != tuple(want):
      raise CheckpointError(
          path, f"shape mismatch between GGUF metadata and weights: expected {name!r} of shape "
          f"{tuple(want)} (from the metadata, after transpose), found {w.shape}")
    return w.astype(np.dtype(dtype))

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
    for key, gname in _LAYER_MAP.items():
      heads = {"wq": config.num_heads, "wk": config.num_kv_heads}.get(key)
      transpose = key not in ("attn_norm", "mlp_norm")
      w = get(f"blk.{i}.{gname}.weight", shapes["layers"][i][key], transpose, heads)
      layer[key] = place(w, sh["layers"][i][key] if sh else None)
    params["layers"].append(layer)
  return params

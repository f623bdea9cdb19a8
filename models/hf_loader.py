"""Loading a Hugging Face checkpoint directory (config.json + safetensors, single or sharded).

Reads are lazy and per tensor (`safetensors.safe_open(...).get_slice`): nothing but the
requested slice of one tensor is in host memory at a time beyond the assembled output. With a
`mesh`, every parameter is built with `jax.make_array_from_callback`, so each device reads
only the rows/columns of its own shard straight from the file.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from rocketkv_jax.models.config import ModelConfig
from rocketkv_jax.models.errors import CheckpointError, cause, check_finite
from rocketkv_jax.models.llama import param_shapes

# our name -> (HF name template, transpose?); "{i}" is the layer index.
_LAYER_MAP = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", False),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", True),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", True),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", True),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", True),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", True),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", True),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", True),
}
# Gemma 3: its norms around attention and MLP, and per-head q / k norms.
_GEMMA_LAYER_MAP = dict(
    _LAYER_MAP,
    mlp_norm=("model.layers.{i}.pre_feedforward_layernorm.weight", False),
    post_attn_norm=("model.layers.{i}.post_attention_layernorm.weight", False),
    post_mlp_norm=("model.layers.{i}.post_feedforward_layernorm.weight", False),
    q_norm=("model.layers.{i}.self_attn.q_norm.weight", False),
    k_norm=("model.layers.{i}.self_attn.k_norm.weight", False),
)
# Qwen 3: per-head q / k norms (plain x * w); Qwen 2 / 2.5: q, k, v projection biases.
_QWEN3_LAYER_MAP = dict(_LAYER_MAP, q_norm=_GEMMA_LAYER_MAP["q_norm"],
                        k_norm=_GEMMA_LAYER_MAP["k_norm"])
_QWEN2_LAYER_MAP = dict(
    _LAYER_MAP,
    bq=("model.layers.{i}.self_attn.q_proj.bias", False),
    bk=("model.layers.{i}.self_attn.k_proj.bias", False),
    bv=("model.layers.{i}.self_attn.v_proj.bias", False),
)
_LAYER_MAPS = {"gemma3": _GEMMA_LAYER_MAP, "qwen3": _QWEN3_LAYER_MAP, "qwen2": _QWEN2_LAYER_MAP}
# where a multimodal Gemma 3 checkpoint keeps its text model's "model." tensors
_TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.")
_TOP_MAP = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def read_hf_config(path: str) -> tuple[ModelConfig, dict]:
  """(ModelConfig, raw config dict) from `<path>/config.json`.

  Raises:
    FileNotFoundError: no config.json. CheckpointError (naming config.json): not JSON, a missing
      or mistyped field, or an unsupported model.
  """
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(
        f"no config.json in {path!r}: a Hugging Face checkpoint directory needs config.json and "
        "model.safetensors (or model.safetensors.index.json + shards)")
  try:
    with open(cfg_path, encoding="utf-8") as f:
      raw = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(cfg_path, f"expected a JSON object (a Hugging Face config), got "
                          f"invalid JSON: {e}") from e
  if not isinstance(raw, dict):
    raise CheckpointError(cfg_path, f"expected a JSON object (a Hugging Face config), got a "
                          f"{type(raw).__name__}")
  try:
    return ModelConfig.from_hf(raw), raw
  except KeyError as e:
    raise CheckpointError(cfg_path, f"expected the field {e.args[0]!r} (a Llama / Mistral "
                          "config.json has hidden_size, intermediate_size, num_hidden_layers, "
                          "num_attention_heads, vocab_size)") from e
  except (TypeError, ValueError) as e:
    raise CheckpointError(cfg_path, str(e) if isinstance(e, ValueError)
                          else f"a field has the wrong type: {cause(e)}") from e


def _open(fn: str):
  """`safe_open(fn)`; a truncated or corrupt file raises CheckpointError naming it."""
  try:
    return safe_open(fn, framework="numpy")
  except Exception as e:  # pylint: disable=broad-except  # SafetensorError, OSError, ...
    raise CheckpointError(fn, f"expected a safetensors file, cannot read it (truncated or "
                          f"corrupt?): {cause(e)}") from e


def _weight_index(path: str) -> tuple[dict[str, str], str]:
  """(tensor name -> safetensors file, the file that lists them: the index json or the single
  safetensors file)."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    try:
      with open(index, encoding="utf-8") as f:
        wmap = json.load(f)["weight_map"]
      return {k: os.path.join(path, v) for k, v in wmap.items()}, index
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise CheckpointError(index, 'expected JSON with a "weight_map" of tensor name -> '
                            f"shard file: {cause(e)}") from e
  single = os.path.join(path, "model.safetensors")
  if not os.path.isfile(single):
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {path!r} "
        "(.bin / .pth checkpoints are not supported; re-save with safe_serialization=True)")
  with _open(single) as f:
    return {k: single for k in f.keys()}, single


class _Reader:
  """Keeps safetensors files open and serves (optionally transposed) slices."""

  def __init__(self, index: dict[str, str], source: str):
    self._index = index
    self._source = source  # the index json or the single file: named when a tensor is missing
    self._files: dict[str, Any] = {}

  def file(self, name: str) -> str:
    if name not in self._index:
      raise CheckpointError(self._source, f"expected the tensor {name!r}, which is not there")
    return self._index[name]

  def _slice(self, name: str):
    fn = self.file(name)
    if fn not in self._files:
      if not os.path.isfile(fn):
        raise FileNotFoundError(f"checkpoint shard {fn!r} (listed in {self._source!r}) does not "
                                "exist")
      self._files[fn] = _open(fn)
    try:
      return self._files[fn].get_slice(name)
    except Exception as e:  # pylint: disable=broad-except  # an index naming the wrong shard
      raise CheckpointError(fn, f"expected the tensor {name!r} (listed in {self._source!r}): "
                            f"{cause(e)}") from e

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._slice(name).get_shape())

  def read(self, name: str, transpose: bool, index: tuple[slice, ...]) -> np.ndarray:
    """Slice `index` of the tensor as laid out in *our* convention ([in, out] if transposed).
    A slice holding NaN or Inf raises CheckpointError (each slice is read once at load)."""
    sl = self._slice(name)
    try:
      if transpose:
        out = np.asarray(sl[index[1], index[0]]).T
      else:
        out = np.asarray(sl[index] if index else sl[:])
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(self.file(name), f"cannot read the tensor {name!r} (truncated or "
                            f"corrupt?): {cause(e)}") from e
    check_finite(out, name, self.file(name))
    return out



def load_hf_params(path: str, config: ModelConfig, dtype=jnp.float32,
                   shardings=None) -> dict[str, Any]:
  """Reads all parameters of a safetensors checkpoint of any supported family.

  Args:
    path: the checkpoint directory.
    config: its `ModelConfig` (shapes are checked against it).
    dtype: parameter dtype (jnp.float32 or jnp.bfloat16).
    shardings: optional pytree of `jax.sharding.NamedSharding` matching the params (see
      `rocketkv_jax.models.sharding.param_shardings`); each device then reads only its shard.

  Raises:
    FileNotFoundError: missing weights file. CheckpointError (naming the file): a corrupt or
      truncated file, a missing tensor, a shape mismatch or a tensor holding NaN / Inf.
  """
  index, source = _weight_index(path)
  # "model." names of the text model (a multimodal Gemma 3 keeps it under another prefix)
  prefix = next((p for p in _TEXT_PREFIXES if p + "embed_tokens.weight" in index), "model.")
  index = {("model." + k[len(prefix):] if k.startswith(prefix) else k): f
           for k, f in index.items()}
  reader = _Reader(index, source)
  shapes = param_shapes(config)
  layer_map = _LAYER_MAPS.get(config.architecture, _LAYER_MAP)
  if config.tie_word_embeddings:
    shapes.pop("lm_head", None)

  def check(name, transpose, want):
    got = reader.shape(name)
    want_hf = (want[1], want[0]) if transpose else want
    if got != tuple(want_hf):
      raise CheckpointError(
          reader.file(name), f"shape mismatch between config.json and weights: expected "
          f"{name!r} of shape {tuple(want_hf)} (from config.json), found {got}")

  def build(shape, sharding, fetch, key=""):
    """fetch(index tuple of slices over `shape`) -> np.ndarray."""
    if config.gemma and key.endswith("norm"):  # Gemma's x * (1 + w): held as 1 + w
      fetch = lambda idx, f=fetch: f(idx).astype(np.float32) + 1.0
    if sharding is None:
      full = tuple(slice(0, s) for s in shape)
      return jnp.asarray(fetch(full).astype(np.dtype(dtype)))
    return jax.make_array_from_callback(
        shape, sharding, lambda idx: fetch(_norm(idx, shape)).astype(np.dtype(dtype)))

  params: dict[str, Any] = {}
  for key in ("embed", "final_norm", "lm_head"):
    if key not in shapes:
      continue
    name, tr = _TOP_MAP[key]
    check(name, tr, shapes[key])
    sh = None if shardings is None else shardings[key]
    params[key] = build(shapes[key], sh, lambda idx, n=name, t=tr: reader.read(n, t, idx), key)

  params["layers"] = []
  for i in range(config.num_layers):
    layer = {}
    for key, (tmpl, tr) in layer_map.items():
      name = tmpl.format(i=i)
      shape = shapes["layers"][i][key]
      check(name, tr, shape)
      sh = None if shardings is None else shardings["layers"][i][key]
      layer[key] = build(shape, sh, lambda idx, n=name, t=tr: reader.read(n, t, idx), key)
    params["layers"].append(layer)
  return params


def _norm(idx, shape) -> tuple[slice, ...]:
  """Normalises a callback index (slices with None bounds) to explicit slices."""
  return tuple(slice(*s.indices(n)[:2]) for s, n in zip(idx, shape))

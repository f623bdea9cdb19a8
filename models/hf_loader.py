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
# where a multimodal Gemma 3 checkpoint keeps its text model's "model." tensors
_TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.")
_TOP_MAP = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}


def read_hf_config(path: str) -> tuple[ModelConfig, dict]:
  """(ModelConfig, raw config dict) from `<path>/config.json`."""
  cfg_path = os.path.join(path, "config.json")
  if not os.path.isfile(cfg_path):
    raise FileNotFoundError(
        f"no config.json in {path!r}: a Hugging Face checkpoint directory needs config.json and "
        "model.safetensors (or model.safetensors.index.json + shards)")
  try:
    with open(cfg_path) as f:
      raw = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{cfg_path!r} is not valid JSON: {e}") from e
  return ModelConfig.from_hf(raw), raw


def _weight_index(path: str) -> dict[str, str]:
  """tensor name -> safetensors file, from the index json or the single file."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.isfile(index):
    with open(index) as f:
      wmap = json.load(f)["weight_map"]
    return {k: os.path.join(path, v) for k, v in wmap.items()}
  single = os.path.join(path, "model.safetensors")
  if not os.path.isfile(single):
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {path!r} "
        "(.bin / .pth checkpoints are not supported; re-save with safe_serialization=True)")
  with safe_open(single, framework="numpy") as f:
    return {k: single for k in f.keys()}


class _Reader:
  """Keeps safetensors files open and serves (optionally transposed) slices."""

  def __init__(self, index: dict[str, str]):
    self._index = index
    self._files: dict[str, Any] = {}

  def _handle(self, name: str):
    if name not in self._index:
      raise ValueError(f"tensor {name!r} missing from the checkpoint")
    fn = self._index[name]
    if fn not in self._files:
      if not os.path.isfile(fn):
        raise FileNotFoundError(f"checkpoint shard {fn!r} (listed in the index) does not exist")
      self._files[fn] = safe_open(fn, framework="numpy")
    return self._files[fn]

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._handle(name).get_slice(name).get_shape())

  def read(self, name: str, transpose: bool, index: tuple[slice, ...]) -> np.ndarray:
    """Slice `index` of the tensor as laid out in *our* convention ([in, out] if transposed)."""
    sl = self._handle(name).get_slice(name)
    if transpose:
      return np.asarray(sl[index[1], index[0]]).T
    return np.asarray(sl[index] if index else sl[:])


def load_hf_params(path: str, config: ModelConfig, dtype=jnp.float32,
                   shardings=None) -> dict[str, Any]:
  """Reads all parameters of a Llama / Mistral safetensors checkpoint.

  Args:
    path: the checkpoint directory.
    config: its `ModelConfig` (shapes are checked against it).
    dtype: parameter dtype (jnp.float32 or jnp.bfloat16).
    shardings: optional pytree of `jax.sharding.NamedSharding` matching the params (see
      `rocketkv_jax.models.sharding.param_shardings`); each device then reads only its shard.

  Raises:
    FileNotFoundError: missing weights file. ValueError: missing tensor or shape mismatch.
  """
  index = _weight_index(path)
  # "model." names of the text model (a multimodal Gemma 3 keeps it under another prefix)
  prefix = next((p for p in _TEXT_PREFIXES if p + "embed_tokens.weight" in index), "model.")
  index = {("model." + k[len(prefix):] if k.startswith(prefix) else k): f
           for k, f in index.items()}
  reader = _Reader(index)
  shapes = param_shapes(config)
  layer_map = _GEMMA_LAYER_MAP if config.gemma else _LAYER_MAP
  if config.tie_word_embeddings:
    shapes.pop("lm_head", None)

  def check(name, transpose, want):
    got = reader.shape(name)
    want_hf = (want[1], want[0]) if transpose else want
    if got != tuple(want_hf):
      raise ValueError(
          f"shape mismatch between config.json and weights: {name!r} has shape {got}, "
          f"config implies {tuple(want_hf)}")

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

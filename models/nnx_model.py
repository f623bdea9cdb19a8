"""`CausalLM`: the Llama / Mistral / Gemma 3 decoder as a Flax NNX module (issue #38 item 4, a
first step).

The module holds the weights as `nnx.Param`s with `llama.param_shapes`' names and the static
`ModelConfig`; its math is `models/llama.py`'s pure functions, which it calls over
`params()`, the parameter pytree view of its own arrays (no copy). A jitted program takes the
state from `nnx.split` and rebuilds that pytree inside the trace (`params_from_state`):

    module = CausalLM.from_model(rocketkv.models.load(path))
    graphdef, state = nnx.split(module)
    step = jax.jit(lambda state, cache, tok, pos: llama.decode_step(
        params_from_state(state), cache, tok, pos, config=module.config, plan=plan))

`rocketkv.generate` and the eval runner still take a `Model` (its params are the same pytree);
driving their loops from the split state is the rest of that item.
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
    self.layers = nnx.List([DecoderLayer(lp) for lp in params["layers"]])

  @classmethod
  def from_model(cls, model) -> "CausalLM":
    """From a loaded `rocketkv.models.Model` (its arrays, not copies)."""
    return cls(model.config, model.params)

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
  layers = pure["layers"]
  out = dict(pure, layers=[layers[i] for i in sorted(layers, key=int)])
  return out

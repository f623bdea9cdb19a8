"""Tensor parallelism over attention heads on a `tp` mesh axis (`jax.sharding`, GSPMD).

Q/K/V projections are split by output columns (so by heads: KV head h and its G query heads
land on the same device, because Hq columns are ordered by KV head), the output projection by
input rows, the SwiGLU by the intermediate dimension; embeddings and norms are replicated.
The KV cache then follows the K/V activations (sharded on its head axis) by sharding
propagation, and each decode step needs one all-reduce after `wo` and one after `w_down`.
`num_kv_heads` must be divisible by the `tp` size.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from rocketkv_jax.models.config import ModelConfig


def make_mesh(tp: int | None = None) -> Mesh:
  """A 1-D ("tp",) mesh over the first `tp` devices (default: all)."""
  devices = jax.devices()
  tp = tp or len(devices)
  if not 1 <= tp <= len(devices):
    raise ValueError(f"tp must be in [1, {len(devices)}] (available devices), got {tp}")
  return Mesh(np.array(devices[:tp]), ("tp",))


def param_shardings(config: ModelConfig, mesh: Mesh):
  """NamedSharding pytree matching `llama.param_shapes(config)`."""
  tp = mesh.shape["tp"]
  if config.num_kv_heads % tp:
    raise ValueError(
        f"num_kv_heads ({config.num_kv_heads}) must be divisible by the tp mesh size ({tp})")
  ns = lambda *spec: NamedSharding(mesh, P(*spec))
  layer = {
      "attn_norm": ns(), "mlp_norm": ns(),
      "wq": ns(None, "tp"), "wk": ns(None, "tp"), "wv": ns(None, "tp"), "wo": ns("tp", None),
      "w_gate": ns(None, "tp"), "w_up": ns(None, "tp"), "w_down": ns("tp", None),
  }
  out = {"embed": ns(), "final_norm": ns(),
         "layers": [dict(layer) for _ in range(config.num_layers)]}
  if not config.tie_word_embeddings:
    out["lm_head"] = ns()
  return out


def shard_params(params, config: ModelConfig, mesh: Mesh):
  """Places an existing parameter pytree on `mesh`."""
  return jax.device_put(params, param_shardings(config, mesh))

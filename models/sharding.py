"""Sharding over a ("dp", "tp") mesh: batch over `dp`, attention heads over `tp` (GSPMD).

Q/K/V projections are split by output columns (so by heads: KV head h and its G query heads
land on the same device, because Hq columns are ordered by KV head), the output projection by
input rows, the SwiGLU by the intermediate dimension; embeddings and norms are replicated.
Parameters are replicated over `dp`. The KV cache then follows the K/V activations (batch on
`dp`, head axis on `tp`) by sharding propagation, and each decode step needs one all-reduce over
`tp` after `wo` and one after `w_down`; `dp` needs no communication but the loop's "all done"
test. `num_kv_heads` must be divisible by the `tp` size.

The mesh may span several processes (`jax.distributed`, see `models/distributed.py`): every
array here is then a global `jax.Array`, built on each process from that process's own shards
(`global_array`), and every process runs the same program (SPMD).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

from rocketkv_jax.models.config import ModelConfig


def make_mesh(tp: int | None = None, dp: int = 1) -> Mesh:
  """A ("dp", "tp") mesh over `dp * tp` devices (default: `tp` = all devices / dp).

  Devices are ordered by (process, id), so a `tp` group stays inside one process (one host)
  whenever `tp` divides the devices per process: `tp`'s per-step all-reduces stay local and
  only the batch is split across hosts. With several processes the mesh must span every
  device (each process runs the same program on its own devices).

  Raises:
    ValueError (before anything is traced): dp or tp < 1, or dp * tp not a valid device count.
  """
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  n = len(devices)
  if not isinstance(dp, int) or dp < 1:
    raise ValueError(f"dp must be an int >= 1, got {dp!r}")
  if tp is None:
    if n % dp:
      raise ValueError(f"dp ({dp}) must divide the number of devices ({n})")
    tp = n // dp
  if not isinstance(tp, int) or tp < 1:
    raise ValueError(f"tp must be an int >= 1, got {tp!r}")
  if jax.process_count() > 1 and dp * tp != n:
    raise ValueError(f"mesh dp x tp = {dp} x {tp} = {dp * tp} must equal the number of devices "
                     f"({n}, over {jax.process_count()} processes)")
  if dp * tp > n:
    raise ValueError(f"mesh dp x tp = {dp} x {tp} = {dp * tp} needs more devices than the "
                     f"{n} available")
  return Mesh(np.array(devices[:dp * tp]).reshape(dp, tp), ("dp", "tp"))


def axis_size(mesh: Mesh, name: str) -> int:
  """The size of mesh axis `name`, 1 when the mesh has no such axis."""
  return dict(mesh.shape).get(name, 1)


def check_mesh(config: ModelConfig, mesh: Mesh) -> None:
  """ValueError unless `mesh` has a "tp" axis dividing `num_kv_heads` (and only dp / tp axes)."""
  extra = set(mesh.axis_names) - {"dp", "tp"}
  if "tp" not in mesh.axis_names or extra:
    raise ValueError(f"mesh axes must be ('tp',) or ('dp', 'tp'), got {tuple(mesh.axis_names)}")
  tp = axis_size(mesh, "tp")
  if config.num_kv_heads % tp:
    raise ValueError(
        f"num_kv_heads ({config.num_kv_heads}) must be divisible by the tp mesh size ({tp})")


def param_shardings(config: ModelConfig, mesh: Mesh):
  """NamedSharding pytree matching `llama.param_shapes(config)` (replicated over "dp")."""
  check_mesh(config, mesh)
  ns = lambda *spec: NamedSharding(mesh, P(*spec))
  layer = {
      "attn_norm": ns(), "mlp_norm": ns(),
      "wq": ns(None, "tp"), "wk": ns(None, "tp"), "wv": ns(None, "tp"), "wo": ns("tp", None),
      "w_gate": ns(None, "tp"), "w_up": ns(None, "tp"), "w_down": ns("tp", None),
  }
  if config.qk_norm:
    layer.update(q_norm=ns(), k_norm=ns())
  if config.gemma:
    layer.update(post_attn_norm=ns(), post_mlp_norm=ns())
  if config.qkv_bias:  # split as their projections' output columns
    layer.update(bq=ns("tp"), bk=ns("tp"), bv=ns("tp"))
  out = {"embed": ns(), "final_norm": ns(),
         "layers": [dict(layer) for _ in range(config.num_layers)]}
  if not config.tie_word_embeddings:
    out["lm_head"] = ns()
  return out


def shard_params(params, config: ModelConfig, mesh: Mesh):
  """Places an existing (host or single-device) parameter pytree on `mesh`, each process
  keeping only its own shards."""
  return jax.tree.map(lambda x, s: global_array(np.asarray(x), s), params,
                      param_shardings(config, mesh))


def mesh_of(params) -> Mesh | None:
  """The mesh the parameters live on (their embedding's `NamedSharding`), else None."""
  leaf = params["embed"] if isinstance(params, dict) and "embed" in params else (
      jax.tree_util.tree_leaves(params)[0])
  sharding = getattr(leaf, "sharding", None)
  return sharding.mesh if isinstance(sharding, NamedSharding) else None


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Leading (batch) axis over "dp" (replicated if the mesh has none), the rest replicated."""
  return NamedSharding(mesh, P("dp" if "dp" in mesh.axis_names else None, *[None] * (ndim - 1)))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def global_array(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A global `jax.Array` from a host value that every process holds in full (SPMD):
  each process places only the slices of its own devices (no full copy is put and resharded)."""
  host = np.asarray(host)
  return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

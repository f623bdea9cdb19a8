"""Multi-process start-up: JAX's own distributed runtime (`jax.distributed`), CPU included.

Every process runs the same program (SPMD, multi-controller): it calls `initialize` first,
then builds the same mesh (`sharding.make_mesh(tp, dp)`), loads the model on it
(`models.load(path, mesh=mesh)`: each process reads only its own devices' shards) and calls
`rocketkv.generate` with the same prompts; every process gets every sequence's tokens.

    from rocketkv_jax.models import distributed, sharding
    distributed.initialize("10.0.0.1:1234", num_processes=2, process_id=RANK)
    mesh = sharding.make_mesh(tp=2, dp=2)     # 2 processes x 2 devices
    model = rocketkv.models.load(path, mesh=mesh)

On CPU the cross-process collectives are gloo's (`jax_cpu_collectives_implementation`); GPUs
use NCCL as usual.
"""

from __future__ import annotations

import jax


def check_args(coordinator: str, num_processes: int, process_id: int) -> tuple[str, int]:
  """(host, port) of a "HOST:PORT" coordinator; ValueError (one line) for bad arguments."""
  host, sep, port = str(coordinator).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"coordinator must be HOST:PORT with a port in [1, 65535], got "
                     f"{coordinator!r}")
  if not isinstance(num_processes, int) or num_processes < 1:
    raise ValueError(f"num_processes must be an int >= 1, got {num_processes!r}")
  if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes - 1}] (num_processes "
                     f"{num_processes}), got {process_id!r}")
  return host, int(port)


def initialize(coordinator: str, num_processes: int, process_id: int, **kwargs) -> None:
  """Joins this process to the others (blocks until all `num_processes` have joined).

  Must run before any JAX computation. Process 0 hosts the coordinator service on
  `coordinator`'s port; every process passes the same `coordinator` and `num_processes` and
  its own `process_id`. `kwargs` go to `jax.distributed.initialize` (e.g.
  `initialization_timeout`, `heartbeat_timeout_seconds`).
  """
  check_args(coordinator, num_processes, process_id)
  # gloo for cross-process collectives on the CPU backend (no effect on GPU / TPU backends).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator, num_processes, process_id, **kwargs)

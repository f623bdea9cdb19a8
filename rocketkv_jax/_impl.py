"""Chooses the implementation behind each hot-path function: `impl="auto" | "xla" | "pallas"`.

`auto` picks the Pallas kernels on a GPU backend and the pure-jnp (XLA) path elsewhere.
Forcing `pallas` off-GPU runs the kernels with `interpret=True` (that is how tests check them).
"""

from __future__ import annotations

import jax

from rocketkv_jax._checks import require

IMPLS = ("auto", "xla", "pallas")


def resolve(impl: str) -> tuple[str, bool]:
  """Returns (implementation, interpret) for `impl`."""
  require(impl in IMPLS, f"impl must be one of {IMPLS}, got {impl!r}")
  on_gpu = jax.default_backend() == "gpu"
  if impl == "auto":
    return ("pallas" if on_gpu else "xla"), False
  return impl, (impl == "pallas" and not on_gpu)

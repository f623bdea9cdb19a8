"""Input validation shared by the public functions: clear ValueErrors, raised before tracing.

Shapes and dtypes are static under `jax.jit`, so every check here runs at trace time on Python
values and never on traced data.
"""

from __future__ import annotations

from typing import Any


def require(cond: bool, msg: str) -> None:
  """Raises `ValueError(msg)` unless `cond`."""
  if not cond:
    raise ValueError(msg)


def require_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
  """`value` must be a Python int in [lo, hi] (hi=None: unbounded)."""
  ok = isinstance(value, int) and not isinstance(value, bool)
  ok = ok and value >= lo and (hi is None or value <= hi)
  rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
  require(ok, f"{name} must be an int {rng}, got {value!r}")


def require_rank(name: str, x: Any, rank: int, layout: str) -> None:
  require(getattr(x, "ndim", None) == rank,
          f"{name} must have shape {layout} (rank {rank}), got shape {getattr(x, 'shape', None)}")


def require_float(name: str, x: Any) -> None:
  import jax.numpy as jnp
  require(jnp.issubdtype(x.dtype, jnp.floating),
          f"{name} must be a floating array, got dtype {x.dtype}")


def require_int_array(name: str, x: Any) -> None:
  """`x` must have an integer dtype (token counts such as `lengths`; a float would truncate)."""
  import numpy as np
  dtype = np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype
  require(np.issubdtype(dtype, np.integer),
          f"{name} must be an integer array (token counts), got dtype {dtype}")


def check_lengths(lengths: Any, batch: int, length: int) -> None:
  """`lengths` must be `[B]` integers; when concrete (not traced), each in [1, L].

  A traced `lengths` (inside `jax.jit`) cannot be read without a host sync, so its values are
  not checked here: `rocketkv.prefill` clamps them to [1, L] instead (documented there)."""
  import jax
  import numpy as np
  if not hasattr(lengths, "shape"):  # a list or tuple: as the array it becomes
    lengths = np.asarray(lengths)
  require(getattr(lengths, "shape", None) == (batch,),
          f"lengths must have shape [B]={(batch,)}, got {getattr(lengths, 'shape', None)}")
  require_int_array("lengths", lengths)
  if isinstance(lengths, jax.core.Tracer):
    return
  vals = np.asarray(lengths)
  require(bool(((vals >= 1) & (vals <= length)).all()),
          f"lengths must be in [1, L={length}], got {vals.tolist()}")


def group_size(num_q_heads: int, num_kv_heads: int, q_name: str = "q") -> int:
  """G = Hq // Hkv; Hq must be a positive multiple of Hkv."""
  require(num_kv_heads > 0 and num_q_heads % num_kv_heads == 0 and num_q_heads > 0,
          f"{q_name} heads Hq={num_q_heads} must be a positive multiple of the KV heads "
          f"Hkv={num_kv_heads}")
  return num_q_heads // num_kv_heads


def require_layout(cond: bool, name: str, want: str, shape: Any, looks_like: str,
                   fix: str) -> None:
  """ValueError naming the expected layout when `cond` fails on an array whose shape reads as
  another common layout: "k must be [B, Hkv, L, D]; got shape (1, 256, 4, 16): it looks like
  [B, L, Hkv, D], transpose with k.transpose(0, 2, 1, 3)"."""
  require(cond, f"{name} must be {want}; got shape {tuple(shape)}: it looks like {looks_like}, "
          f"{fix}")


def divides(d: int, n: int) -> bool:
  """Whether n is a positive multiple of d (False for d or n <= 0)."""
  return d > 0 and n > 0 and n % d == 0

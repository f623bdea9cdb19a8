"""Sampling strategies: small frozen pytrees mapping logits `[B, V]` to token ids `[B]`.

The class is static (part of a compiled program's signature), the numbers are traced: a new
temperature or top-p reuses the compiled program (a new `TopK.k` compiles one).
`generate(..., sampler=...)` takes any of these, a pytree of one's own
`fn(logits [B, V], key) -> ids [B] int32` with array leaves, or a plain function (`as_strategy`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


def _concrete(x) -> float | None:
  """`x` as a float when it is a concrete scalar (a number, a NumPy or an un-traced jax
  scalar); None while traced or when it is not a scalar (then nothing is checked)."""
  if isinstance(x, jax.core.Tracer) or isinstance(x, bool):
    return None
  if isinstance(x, (int, float, np.integer, np.floating)):
    return float(x)
  if isinstance(x, (np.ndarray, jax.Array)) and x.shape == () and jnp.issubdtype(x.dtype,
                                                                                  jnp.floating):
    return float(x)
  return None


def _check_temperature(cls: str, t) -> None:
  v = _concrete(t)
  if v is not None and not (np.isfinite(v) and v > 0):
    raise ValueError(f"{cls}.temperature must be a finite number > 0, got {v}")


@struct.dataclass
class Greedy:
  """argmax; the key is ignored."""

  def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
    del key
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@struct.dataclass
class TopP:
  """softmax(logits / temperature) restricted to the smallest nucleus of mass >= top_p.

  Attributes:
    temperature: [] float32, > 0.
    top_p: [] float32 in (0, 1].
  """

  temperature: jax.Array
  top_p: jax.Array

  def __post_init__(self):  # concrete values only: a traced one is not read
    _check_temperature("TopP", self.temperature)
    v = _concrete(self.top_p)
    if v is not None and not 0.0 < v <= 1.0:  # (NaN fails this too)
      raise ValueError(f"TopP.top_p must be in (0, 1], got {v}")

  def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
    logits = logits / jnp.maximum(self.temperature, 1e-6)
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (always at least the top token)
    keep = (cum - probs) < self.top_p
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@struct.dataclass
class TopK:
  """softmax(logits / temperature) over each row's k largest logits.

  Attributes:
    temperature: [] float32, > 0.
    k: static int >= 1 (a new k compiles a new program); above the vocabulary it keeps it all.
  """

  temperature: jax.Array
  k: int = struct.field(pytree_node=False, default=40)

  def __post_init__(self):
    if isinstance(self.k, np.integer):
      object.__setattr__(self, "k", int(self.k))
    if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
      raise ValueError(f"TopK.k must be an int >= 1, got {self.k!r}")
    _check_temperature("TopK", self.temperature)

  def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
    logits = logits / jnp.maximum(self.temperature, 1e-6)
    top, ids = jax.lax.top_k(logits, min(self.k, logits.shape[-1]))  # [B, k]
    pick = jax.random.categorical(key, top, axis=-1)                   # [B]
    return jnp.take_along_axis(ids, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


@struct.dataclass
class Function:
  """A plain function `fn(logits [B, V], key) -> ids [B]` as a strategy: static, so each new
  function object compiles a new program."""

  fn: Callable[[jax.Array, jax.Array], jax.Array] = struct.field(pytree_node=False)

  def __call__(self, logits: jax.Array, key: jax.Array) -> jax.Array:
    return self.fn(logits, key)


def as_strategy(obj) -> Any:
  """`obj` with its numbers as arrays, a plain function wrapped in `Function`; ValueError for
  anything else (a strategy's leaves must be numbers or arrays)."""
  if not callable(obj):
    raise ValueError(f"sampler must be a strategy fn(logits [B, V], key) -> ids [B] such as "
                     f"rocketkv.sampling.TopK, got {obj!r}")
  leaves = jax.tree.leaves(obj)
  if len(leaves) == 1 and leaves[0] is obj:  # not a pytree: a plain function
    return Function(obj)
  numeric = (int, float, np.ndarray, np.generic, jax.Array)
  if not all(isinstance(x, numeric) and not isinstance(x, bool) for x in leaves):
    raise ValueError(f"sampler {obj!r}: a strategy's pytree leaves must be numbers or arrays "
                     f"(its other fields static, as flax.struct.field(pytree_node=False))")
  return jax.tree.map(jnp.asarray, obj)


def sampler(temperature: float, top_p: float, top_k: int = 0) -> Greedy | TopP | TopK:
  """`Greedy()` for temperature 0, else `TopK` when top_k > 0 (top_p must then be 1), else
  `TopP`."""
  if temperature == 0.0:
    return Greedy()
  if top_k:
    if top_p != 1.0:
      raise ValueError(f"top_k goes without top_p < 1, got top_k={top_k}, top_p={top_p}")
    return TopK(temperature=temperature, k=top_k)  # generate's as_strategy makes it an array
  return TopP(temperature=jnp.float32(temperature), top_p=jnp.float32(top_p))

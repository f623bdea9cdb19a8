"""Exact top-p: the oracle whose read follows the attention across heads, layers and steps.

Each KV head reads the fewest rows that hold `read_mass` (p) of its exact attention mass (the
softmax of each query head, averaged over its group), so a peaked head reads a few rows and a
diffuse one many; nothing fixes the rows per head, layer or step. The state counts the rows
read (`rows_read`), so a sweep can put the oracle next to `exact_topk` at the same mean read
(the ceiling for adaptive reads: results/adaptive_oracle).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from rocketkv_jax._checks import require
from rocketkv_jax.attend import attend
from rocketkv_jax.cache import CacheState, KVCache, valid_slots
from rocketkv_jax.methods.base import Method, checked_append, full_split
from rocketkv_jax.select import exact_slot_scores_xla

DEFAULT_MASS = 0.9


@struct.dataclass
class TopPState(CacheState):
  """One layer's decode state: the whole cache and what the decode steps read from it.

  Attributes:
    cache: the `KVCache` (every prompt token).
    rows: [B] float32 rows read, summed over decode steps, averaged over KV heads.
    steps: [B] float32 decode steps taken.
  """

  cache: KVCache
  rows: jax.Array
  steps: jax.Array


def top_mass_slots(mass: jax.Array, p: float) -> jax.Array:
  """mass `[B, Hkv, C]` (>= 0, each head's valid slots summing to 1; 0 elsewhere) -> int32
  `[B, Hkv, C]`: per head the fewest slots holding mass >= p, largest first (ties to the lower
  slot), then distinct slots >= C (not read: `attend` masks them)."""
  c = mass.shape[-1]
  order = jnp.argsort(-mass, axis=-1, stable=True)
  sorted_mass = jnp.take_along_axis(mass, order, axis=-1)
  before = jnp.cumsum(sorted_mass, axis=-1) - sorted_mass  # mass of the slots ahead of it
  take = (before < p) & (sorted_mass > 0)
  return jnp.where(take, order, c + jnp.arange(c)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class ExactTopP(Method):
  name = "exact_topp"
  summary = ("oracle: exact scores; each KV head reads the fewest rows holding read_mass of "
             "its attention (B unused; rows read are counted)")
  dense = False
  uses_budget = False
  reads_by_mass = True
  takes_turns = False  # its read counters are per decode, not per conversation

  def check_config(self, config) -> None:
    p = config.read_mass
    require(p is None or (isinstance(p, (int, float)) and not isinstance(p, bool)
                          and 0.0 < p <= 1.0),
            f"read_mass must be a float in (0, 1], got {p!r}")

  def split(self, config, prompt_len, max_new_tokens, head_dim):
    # Every token kept; top_k = the whole cache: the most one head may read.
    s = full_split(prompt_len, max_new_tokens, head_dim)
    mass = DEFAULT_MASS if config.read_mass is None else float(config.read_mass)
    return dict(s, top_k=s["capacity"], read_mass=mass)

  def prefill(self, k, v, q_window, plan, *, lengths=None, impl="auto", dense=False):
    cache = super().prefill(k, v, q_window, plan, lengths=lengths, impl=impl, dense=dense)
    zeros = jnp.zeros((k.shape[0],), jnp.float32)
    return TopPState(cache=cache, rows=zeros, steps=zeros)

  def view(self, state) -> KVCache:
    return state.cache

  def select(self, q, state, plan, *, sliding_window=None, impl="auto"):
    cache = state if isinstance(state, KVCache) else self.view(state)
    valid = valid_slots(cache, sliding_window)
    g = q.shape[1] // cache.k.shape[1]
    mass = exact_slot_scores_xla(q, cache.k, valid) / g  # [B, Hkv, C], each head's sums to 1
    return top_mass_slots(jnp.where(valid, mass, 0.0), plan.read_mass)

  def decode_step(self, q, k_new, v_new, state, plan, *, dense=False, sliding_window=None,
                  impl="auto"):
    state = state.replace(cache=checked_append(q, k_new, v_new, state.cache))
    idx = self.select(q, state, plan, sliding_window=sliding_window, impl=impl)
    out = attend(q, state.cache, idx, sliding_window=sliding_window, impl=impl)
    read = jnp.mean(jnp.sum(idx < state.cache.capacity, axis=-1), axis=-1)  # [B]
    return out, state.replace(rows=state.rows + read, steps=state.steps + 1.0)

  def rows_read(self, state) -> jax.Array:
    """[..., B] mean rows read per KV head and decode step (0 before any step)."""
    return state.rows / jnp.maximum(state.steps, 1.0)

"""`LowRank(page_size=128, rank=8)`: page-local low-rank key summaries, per-token scores.

At prefill, per page of kept prompt slots and KV head: the page mean, its top-R centred key
directions and per-slot coefficients; each prompt slot is scored from them, decode-time tokens
exactly. Design and measurements: docs/stage2_variants.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from rocketkv_jax._checks import require, require_int
from rocketkv_jax.cache import CacheState, KVCache, valid_slots
from rocketkv_jax.budget import Plan
from rocketkv_jax.methods.stage2.base import Stage2
from rocketkv_jax.ops import group_softmax_sum
from rocketkv_jax.select import check_query, top_scored_slots


@struct.dataclass
class LowRankState(CacheState):
  """One layer's decode state for `stage2="lowrank"`: the cache plus its prompt-key summaries.

  Attributes:
    cache: the `KVCache` (no min/max summaries: its chunk_size is 0).
    basis: [B, Hkv, NP, R + 1, D] per page, its mean (row 0) and R orthonormal directions.
    coef: [B, Hkv, NP * P, R] per slot, its coordinates in its page's basis (0 past the prompt).
    n_prompt: [B] int32 prompt slots (slots [0, n_prompt) are factorised; later ones are exact).
    page_size: static P.
  """

  cache: KVCache
  basis: jax.Array
  coef: jax.Array
  n_prompt: jax.Array
  page_size: int = struct.field(pytree_node=False, default=128)

  @property
  def rank(self) -> int:
    return self.coef.shape[-1]

  @property
  def num_pages(self) -> int:
    return self.basis.shape[2]


@dataclasses.dataclass(frozen=True)
class LowRank(Stage2):
  """Attributes:
    page_size: P, slots per page of summaries (>= 1).
    rank: R, directions per page (1 <= R <= P; R <= head_dim, checked by the split).
  """

  name = "lowrank"
  state_type = LowRankState
  picks_dims = False
  page_size: int = 128
  rank: int = 8

  def __post_init__(self):
    require_int("LowRank.page_size", self.page_size, 1)
    require_int("LowRank.rank", self.rank, 1, self.page_size)

  def split(self, split, prompt_len, max_new_tokens, head_dim):
    require(self.rank <= head_dim,
            f"LowRank.rank must be in [1, head_dim={head_dim}], got {self.rank}")
    # No chunk min/max summaries: the cache keeps none and `append` updates none.
    return dict(split, chunk_size=0)

  def prefill(self, cache, plan):
    return build(cache, plan)

  def after_append(self, state, new):
    return state.replace(cache=new)  # the prompt summaries never change; new slots are exact

  def select(self, q, state, plan, *, sliding_window=None, impl="auto"):
    del impl  # XLA only
    return select_lowrank(q, state, plan, sliding_window=sliding_window)


def _window(plan: Plan, capacity: int) -> int:
  """W: slots after the prompt scored exactly (the tokens a plan's decode steps append)."""
  return min(plan.max_new_tokens, capacity)


def page_summaries(k: jax.Array, n_prompt: jax.Array, page_size: int, rank: int,
                   num_pages: int):
  """Per-page mean, top-`rank` directions and per-slot coefficients of the first slots' keys.

  Args:
    k: [B, H, C, D] keys.
    n_prompt: [B] slots to summarise (slots [0, n_prompt)); the others get zero coefficients.
    page_size, rank: P and R (R <= min(P, D)).
    num_pages: NP, pages over slots [0, NP * P) (padded with zeros past C).
  Returns:
    (basis [B, H, NP, R + 1, D], coef [B, H, NP * P, R]), float32.
  """
  b, h, c, d = k.shape
  n = num_pages * page_size
  k = k[:, :, :min(n, c)].astype(jnp.float32)
  k = jnp.pad(k, ((0, 0), (0, 0), (0, n - k.shape[2]), (0, 0)))
  kp = k.reshape(b, h, num_pages, page_size, d)
  valid = (jnp.arange(n) < n_prompt[:, None]).reshape(b, 1, num_pages, page_size, 1)
  cnt = jnp.sum(valid, axis=3).astype(jnp.float32)  # [B, 1, NP, 1]
  mu = jnp.sum(jnp.where(valid, kp, 0.0), axis=3) / jnp.maximum(cnt, 1.0)  # [B, H, NP, D]
  xc = jnp.where(valid, kp - mu[:, :, :, None, :], 0.0)  # [B, H, NP, P, D]
  _, _, vt = jnp.linalg.svd(xc, full_matrices=False)  # vt [B, H, NP, min(P, D), D]
  u = vt[..., :rank, :]  # [B, H, NP, R, D]
  coef = jnp.einsum("bhpsd,bhprd->bhpsr", xc, u, precision=lax.Precision.HIGHEST)
  basis = jnp.concatenate([mu[:, :, :, None, :], u], axis=3)
  return basis, coef.reshape(b, h, n, rank)


def build(cache: KVCache, plan: Plan) -> LowRankState:
  """The lowrank state of a freshly prefilled cache: its `length` valid slots are the prompt."""
  require(isinstance(plan.stage2, LowRank), f"plan.stage2 must be a LowRank, got {plan.stage2!r}")
  c = cache.capacity
  p, r = plan.stage2.page_size, plan.stage2.rank
  num_pages = max(1, -(-(c - _window(plan, c)) // p))
  basis, coef = page_summaries(cache.k, cache.length, p, r, num_pages)
  return LowRankState(cache=cache, basis=basis.astype(cache.dtype),
                      coef=coef.astype(cache.dtype),
                      n_prompt=jnp.array(cache.length, jnp.int32, copy=True), page_size=p)


def slot_logits_xla(q: jax.Array, state: LowRankState, window: int):
  """Approximate logits of the prompt slots and exact logits of the decode window.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    state: the lowrank state.
    window: W, slots from n_prompt on scored exactly.
  Returns:
    (logits [B, Hkv, G, NP * P + W] float32 already scaled by 1 / sqrt(D): prompt slots
     [0, NP * P) first, then the window; win_slots [B, W] int32 the window's slots).
  """
  cache = state.cache
  b, hq, d = q.shape
  hkv, c = cache.k.shape[1], cache.capacity
  g = hq // hkv
  qg = q.reshape(b, hkv, g, d).astype(jnp.float32) * lax.rsqrt(jnp.float32(d))
  np_, p = state.num_pages, state.page_size
  basis = state.basis.reshape(b, hkv, np_ * (state.rank + 1), d).astype(jnp.float32)
  qb = jnp.einsum("bhgd,bhkd->bhgk", qg, basis).reshape(b, hkv, g, np_, state.rank + 1)
  coef = state.coef.astype(jnp.float32).reshape(b, hkv, np_, p, state.rank)
  approx = qb[..., :1] + jnp.einsum("bhgpr,bhpsr->bhgps", qb[..., 1:], coef)  # [B,Hkv,G,NP,P]
  approx = approx.reshape(b, hkv, g, np_ * p)
  start = jnp.clip(state.n_prompt, 0, c - window)
  win_slots = (start[:, None] + jnp.arange(window)).astype(jnp.int32)  # [B, W]
  if window == 0:
    return approx, win_slots
  k_win = jnp.take_along_axis(cache.k, win_slots[:, None, :, None], axis=2)  # [B, Hkv, W, D]
  exact = jnp.einsum("bhgd,bhwd->bhgw", qg, k_win.astype(jnp.float32))
  return jnp.concatenate([approx, exact], axis=-1), win_slots


def select_lowrank(q: jax.Array, state: LowRankState, plan: Plan, *,
                   sliding_window: int | None = None) -> jax.Array:
  """The `top_k` slots per KV head from the lowrank scores; contract as `rocketkv.select`.

  Returns:
    int32 [B, Hkv, min(top_k, C)], no slot twice; when fewer slots are valid, every valid slot
    and distinct invalid slots (>= C, which `attend` masks).
  """
  require(isinstance(state, LowRankState),
          f"a 'lowrank' plan needs a LowRankState (from rocketkv.prefill), got {type(state)}")
  cache = state.cache
  check_query(q, cache)
  c = cache.capacity
  k = min(plan.top_k, c)
  w = _window(plan, c)
  n = state.num_pages * state.page_size
  logits, win_slots = slot_logits_xla(q, state, w)
  valid = valid_slots(cache, sliding_window)  # [B, Hkv, C]
  prompt_ok = jnp.pad(valid[..., :min(n, c)], ((0, 0), (0, 0), (0, max(n - c, 0))))
  prompt_ok = prompt_ok & (jnp.arange(n) < state.n_prompt[:, None, None])
  win_slots = jnp.broadcast_to(win_slots[:, None, :], valid.shape[:2] + (w,))  # [B, Hkv, W]
  win_ok = jnp.take_along_axis(valid, win_slots, axis=-1)
  win_ok = win_ok & (win_slots >= state.n_prompt[:, None, None])
  ok = jnp.concatenate([prompt_ok, win_ok], axis=-1)  # [B, Hkv, NP * P + W]
  scores = group_softmax_sum(logits, ok)

  def slot_of(best):  # entries [0, n) are prompt slots, the rest the window's
    if not w:
      return best
    from_win = jnp.take_along_axis(win_slots, jnp.clip(best - n, 0, w - 1), axis=-1)
    return jnp.where(best < n, best, from_win)

  return top_scored_slots(scores, ok, k, c, slot_of)

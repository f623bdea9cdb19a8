"""`Quant(bits=4, capacity="paper", mean_value=False)`: per-token low-bit key codes, read on
the query's r dims.

Keys are coded on a per-channel affine grid fixed at prefill, stored dim-major and packed; each
slot is scored on its own codes over the query's r dims, then exact attention on `top_k` slots.
Also the "equal_read" capacity and the mean-value fill. Design and measurements:
docs/stage2_variants.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from rocketkv_jax import _impl, fused_step, pages
from rocketkv_jax._checks import require
from rocketkv_jax.budget import Plan
from rocketkv_jax.cache import CacheState, KVCache, from_storage, valid_slots, write_rows
from rocketkv_jax.attend import attend
from rocketkv_jax.methods.stage2.base import Stage2
from rocketkv_jax.ops import CODE_BITS, coded_query, group_queries, group_sum, masked_softmax
from rocketkv_jax.select import check_query, top_scored_slots

BITS = CODE_BITS  # in ops: the kernel checks them too
CAPACITY = ("paper", "equal_read")
BOUND_BITS = 16  # the paper's bounds are read as 16-bit values (bf16 / fp16 caches)


@struct.dataclass
class QuantState(CacheState):
  """One layer's decode state for `stage2="quant"`: the cache plus its per-token key codes.

  Attributes:
    cache: the `KVCache` (no min/max summaries: its chunk_size is 0).
    codes: [B, Hkv, D, ceil(C / per)] uint8 packed codes, dim-major (module doc); with a
      paged cache, pages [N, Hkv, D, P / per] of the cache's table, each page packed alone.
    lo: [B, Hkv, D] float32 per-channel grid origin.
    step: [B, Hkv, D] float32 per-channel grid step (> 0).
    v_sum: [B, Hkv, D] float32 sum of the valid slots' values (`Quant.mean_value`), or
      None where the plan does not fill with the mean value.
    bits: static bits per code (one of `BITS`).
  """

  cache: KVCache
  codes: jax.Array
  lo: jax.Array
  step: jax.Array
  v_sum: jax.Array | None = None
  bits: int = struct.field(pytree_node=False, default=4)

  @property
  def per_byte(self) -> int:
    return 8 // self.bits


@dataclasses.dataclass(frozen=True)
class Quant(Stage2):
  """Attributes:
    bits: bits per key code, one of `BITS`.
    capacity: "paper" (the paper's split) or "equal_read" (stage 1 keeps as many slots as make
      the codes' read per step equal the paper's bounds' read at this budget,
      `equal_read_capacity`; the same top_k and r).
    mean_value: SparQ's mean-value fill: each step's output is `alpha * attention over top_k +
      (1 - alpha) * mean value of the kept slots`, alpha the mass the codes' softmax puts on the
      slots read. False (the paper): the top_k rows are renormalised as if the unread slots had
      no weight.
  """

  name = "quant"
  state_type = QuantState
  key_overrides = {"mean_value": "mean_value"}  # as records spell it (docs/stage2_variants.md)
  bits: int = 4
  capacity: str = "paper"
  mean_value: bool = False

  def __post_init__(self):
    require(self.bits in BITS and not isinstance(self.bits, bool),
            f"Quant.bits must be one of {list(BITS)}, got {self.bits!r}")
    require(self.capacity in CAPACITY,
            f"Quant.capacity must be one of {list(CAPACITY)}, got {self.capacity!r}")
    require(isinstance(self.mean_value, bool),
            f"Quant.mean_value must be True or False, got {self.mean_value!r}")

  def check_config(self, config):
    require(self.capacity != "equal_read" or (config.capacity is None
                                              and config.prompt_budget is None),
            "Quant(capacity='equal_read') sets the capacity: leave capacity and prompt_budget "
            "unset")

  def split(self, split, prompt_len, max_new_tokens, head_dim):
    split = dict(split)
    if self.capacity == "equal_read" and split["prompt_budget"] < prompt_len:
      cap = equal_read_capacity(split["capacity"], split["chunk_size"], self.bits)
      kept = min(cap, prompt_len + max_new_tokens) - max_new_tokens
      split.update(prompt_budget=kept, capacity=kept + max_new_tokens)
    # Per-token codes replace the chunk bounds (no chunk summaries); r as the paper's.
    return dict(split, chunk_size=0)

  def prefill(self, cache, plan):
    return build(cache, plan)

  def after_append(self, state, new):
    return append_codes(state, new)

  def select(self, q, state, plan, *, sliding_window=None, impl="auto"):
    return select_quant(q, state, plan, sliding_window=sliding_window, impl=impl)

  def attend(self, q, state, plan, *, sliding_window=None, impl="auto"):
    # `decode_attend`, as two kernels on a GPU where the state allows (fused_step.py); the
    # kernels have no mean-value fill.
    def chain(which):
      return decode_attend(q, state, plan, sliding_window=sliding_window, impl=which)

    if self.mean_value:
      return chain(impl)
    return fused_step.quant_attend(q, state, plan, chain, sliding_window=sliding_window,
                                   impl=impl)


def equal_read_capacity(capacity: int, chunk_size: int, bits: int) -> int:
  """The most slots whose codes cost no more to read than the paper's bounds.

  The paper's stage 2 reads one bound per dim per chunk on r dims: NC * r * 16 bits, NC =
  ceil(capacity / chunk_size). The codes of C slots cost r * C * bits plus r fp32 grid steps.
  On the same r dims r cancels: C = 16 * (NC - 2) / bits (the - 2 pays for the steps), rounded
  down to whole bytes of codes, and never fewer slots than the paper keeps.

  Example (32K prompt, B = 256, D = 128, 4 bits): the paper keeps 1618 slots in 540 chunks of 3
  and reads r = 60 dims; the codes can cover 2152 slots for the same bytes.
  """
  nc = -(-capacity // chunk_size)
  per = 8 // bits
  return max(capacity, BOUND_BITS * (nc - 2) // bits // per * per)


def quantize(k: jax.Array, lo: jax.Array, step: jax.Array, bits: int) -> jax.Array:
  """k [B, H, N, D], lo / step [B, H, D] -> int32 codes [B, H, N, D] in [0, 2^bits - 1]."""
  x = (k.astype(jnp.float32) - lo[:, :, None, :]) / step[:, :, None, :]
  return jnp.clip(jnp.round(x), 0, 2 ** bits - 1).astype(jnp.int32)


def pack(codes: jax.Array, bits: int) -> jax.Array:
  """int codes [B, H, N, D] (N a multiple of per = 8 / bits) -> uint8 [B, H, D, Nb], Nb = N / per:
  slot i in byte i % Nb, at bit (i // Nb) * bits (module doc)."""
  b, h, n, d = codes.shape
  per = 8 // bits
  c = codes.reshape(b, h, per, n // per, d)
  byte = sum(c[:, :, j] << (j * bits) for j in range(per))  # [B, H, Nb, D]
  return jnp.swapaxes(byte, 2, 3).astype(jnp.uint8)


def planes(rows: jax.Array, bits: int) -> list[jax.Array]:
  """uint8 [..., Nb] packed rows -> per float32 [..., Nb] code planes: plane j holds slots
  [j * Nb, (j + 1) * Nb)."""
  x = rows.astype(jnp.int32)
  return [((x >> (j * bits)) & (2 ** bits - 1)).astype(jnp.float32) for j in range(8 // bits)]


def channel_grid(k: jax.Array, valid: jax.Array, bits: int):
  """Per-channel grid of the valid keys.

  Args:
    k: [B, H, C, D] keys.
    valid: [B, H, C] bool.
    bits: code width.
  Returns:
    (lo, step), each [B, H, D] float32; a channel with no spread (or no valid key) gets step 1.
  """
  kf = k.astype(jnp.float32)
  ok = valid[..., None]
  lo = jnp.min(jnp.where(ok, kf, jnp.inf), axis=2)
  hi = jnp.max(jnp.where(ok, kf, -jnp.inf), axis=2)
  lo = jnp.where(jnp.isfinite(lo), lo, 0.0)
  spread = jnp.where(jnp.isfinite(hi), hi - lo, 0.0)
  step = jnp.where(spread > 0, spread / (2 ** bits - 1), 1.0)
  return lo, step


def _coded(k: jax.Array, valid: jax.Array, lo, step, bits: int) -> jax.Array:
  """Codes of `k [B, H, N, D]` with 0 where not `valid [B, H, N]`."""
  return jnp.where(valid[..., None], quantize(k, lo, step, bits), 0)


def build(cache: KVCache, plan: Plan) -> QuantState:
  """The quant state of a freshly prefilled cache: the grid of its valid slots, every slot coded."""
  require(isinstance(plan.stage2, Quant), f"plan.stage2 must be a Quant, got {plan.stage2!r}")
  bits = plan.stage2.bits
  per = 8 // bits
  c = cache.capacity
  valid = valid_slots(cache)
  lo, step = channel_grid(cache.k, valid, bits)
  codes = _coded(cache.k, valid, lo, step, bits)
  pad = -c % per
  codes = jnp.pad(codes, ((0, 0), (0, 0), (0, pad), (0, 0)))
  v_sum = None
  if plan.stage2.mean_value:
    v_sum = jnp.sum(jnp.where(valid[..., None], cache.v.astype(jnp.float32), 0.0), axis=2)
  return QuantState(cache=cache, codes=pack(codes, bits), lo=lo, step=step, v_sum=v_sum,
                    bits=bits)


def append_codes(state: QuantState, new: KVCache) -> QuantState:
  """The state after `new = cache.append(state.cache, ...)`: the byte holding the new slot
  re-coded from `new`'s keys (slots after the new one code 0)."""
  bits, per = state.bits, state.per_byte
  c = new.capacity
  slot = jnp.minimum(state.cache.length, c - 1)  # where append wrote (the last slot when full)
  nb = state.codes.shape[3]
  if new.paged:  # the byte of the slot's page (codes packed per page)
    page, at = pages.locate(new.table, slot, new.page_size)
  else:
    page, at = None, slot
  byte = at % nb
  group = (slot - at + byte)[:, None] + jnp.arange(per) * nb  # [B, per] slots of that byte
  idx = jnp.minimum(group, c - 1)[:, None, :]  # [B, 1, per]
  if new.paged:
    idx = jnp.broadcast_to(idx, (idx.shape[0], state.codes.shape[1], per))
    rows = from_storage(pages.gather_slots(new.k_raw, new.table, idx, new.page_size), new.dtype)
  else:
    rows = jnp.take_along_axis(new.k, idx[..., None], axis=2)  # [B, Hkv, per, D]
  ok = ((group <= slot[:, None]) & (group < c))[:, None, :]
  col = pack(_coded(rows, jnp.broadcast_to(ok, rows.shape[:3]), state.lo, state.step, bits),
             bits)[..., 0]  # [B, Hkv, D]
  v_sum = state.v_sum
  if v_sum is not None:  # + the new row; a full sequence's append replaced its last row
    at = slot[:, None, None, None]
    gone = jnp.take_along_axis(state.cache.v, at, axis=2)[:, :, 0].astype(jnp.float32)
    came = jnp.take_along_axis(new.v, at, axis=2)[:, :, 0].astype(jnp.float32)
    full = (state.cache.length >= c)[:, None, None]
    v_sum = v_sum + came - jnp.where(full, gone, 0.0)
  return state.replace(cache=new, codes=write_rows(state.codes, col, byte, axis=3, at0=page),
                       v_sum=v_sum)


# Above this many multiply-adds per logit (r dims x code planes) `slot_logits_xla` multiplies
# unpacked planes instead of fusing the unpack into one unrolled sum (compile time and code
# size); 8-bit codes (one plane, nothing to unpack) always take the products (docs/roofline.md).
FUSED_TERMS_MAX = 128


def slot_logits_xla(q: jax.Array, state: QuantState, r: int,
                    group_dims: str = "sum") -> jax.Array:
  """Approximate logits of every slot, up to a per-query-head constant.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    state: the quant state.
    r: dims read (stage 2's r).
    group_dims: as in `coded_query`.
  Returns:
    [B, Hkv, G, C] float32: sum over the r dims of q_d * scale * step_d * code_id.
  """
  cache = state.cache
  hkv, c = cache.k_raw.shape[1], cache.capacity
  ridx, qs = coded_query(group_queries(q, hkv).astype(jnp.float32), state.step, r, group_dims)
  fused = 2 <= state.per_byte and r * state.per_byte <= FUSED_TERMS_MAX
  logits_of = _fused_logits if fused else _plane_products
  if cache.paged:
    return _paged_slot_logits(qs, ridx, state, logits_of)
  rows = jnp.take_along_axis(state.codes, ridx[..., None], axis=2)  # [B, Hkv, r, Nb] uint8
  return jnp.concatenate(logits_of(qs, rows, state.bits), axis=-1)[..., :c]


def _paged_slot_logits(qs, ridx, state: QuantState, logits_of):
  """`slot_logits_xla` of a paged state: qs [B, Hkv, G, r], ridx [B, Hkv, r] -> [B, Hkv, G,
  NP * P], every page of the pool scored with its owner's dims and query, or the r rows
  gathered through the table (`pages.pool_or_table`)."""
  cache, bits = state.cache, state.bits
  npg = cache.table.shape[-1]

  def in_place(owner):  # a page's planes in turn are its slots in order (slot i: plane i // Nbp)
    rows = jnp.take_along_axis(state.codes, ridx[owner][..., None], axis=2)  # [N, Hkv, r, Nbp]
    return pages.in_table_order(jnp.concatenate(logits_of(qs[owner], rows, bits), axis=-1),
                                cache.table)

  def through_table():  # [B, Hkv, r, NP * Nbp]: each page's bytes in turn
    logits = logits_of(qs, pages.gather_cols(state.codes, cache.table, ridx), bits)
    per_page = [x.reshape(*x.shape[:-1], npg, -1) for x in logits]  # [B, Hkv, G, NP, Nbp]
    return jnp.stack(per_page, axis=-2).reshape(*logits[0].shape[:-1], -1)

  return pages.pool_or_table(cache.table, cache.length, cache.page_size, state.codes.shape[0],
                             in_place, through_table)


def _plane_products(qs: jax.Array, rows: jax.Array, bits: int) -> list[jax.Array]:
  """qs [B, Hkv, G, r], rows [B, Hkv, r, Nb] uint8 -> per [B, Hkv, G, Nb]: one batched
  [G, r] x [r, Nb] product per code plane, on the planes unpacked to float32."""
  return [jnp.einsum("bhgr,bhrc->bhgc", qs, p) for p in planes(rows, bits)]


def _fused_logits(qs: jax.Array, rows: jax.Array, bits: int) -> list[jax.Array]:
  """`_plane_products` as one unrolled multiply-add over the r dims per plane, the unpack fused
  in: XLA:CPU runs the batched products above as many tiny GEMMs and writes the float32 planes
  out first (8x the codes' bytes); this reads the codes once (docs/roofline.md). The unpack is
  `planes`', applied to each r row as it is read."""
  x = rows.astype(jnp.int32)[:, :, None]  # [B, Hkv, 1, r, Nb]
  mask = 2 ** bits - 1
  return [sum(qs[:, :, :, i, None] * ((x[:, :, :, i] >> (j * bits)) & mask).astype(jnp.float32)
              for i in range(qs.shape[-1]))
          for j in range(8 // bits)]


def slot_logits(q: jax.Array, state: QuantState, r: int, *, group_dims: str = "sum",
                impl: str = "auto") -> jax.Array:
  """`slot_logits_xla`, or a Pallas kernel as `impl` picks: `kernels.quant_slot_logits` on a
  GPU, `kernels.tpu_quant_slot_logits` on TPU (their `paged_*` forms for a paged state)."""
  if state.cache.paged:  # the code pages read through the table (kernels/paged_quant_scores.py)
    impl = _impl.for_pages(impl)
    return _impl.dispatch(impl, lambda: slot_logits_xla(q, state, r, group_dims),
                          "paged_quant_slot_logits", q, state.codes, state.step,
                          state.cache.table, r=r, bits=state.bits, group_dims=group_dims,
                          tpu="tpu_paged_quant_slot_logits")
  return _impl.dispatch(impl, lambda: slot_logits_xla(q, state, r, group_dims),
                        "quant_slot_logits", q, state.codes, state.step, r=r, bits=state.bits,
                        capacity=state.cache.capacity, group_dims=group_dims,
                        tpu="tpu_quant_slot_logits")


def select_quant(q: jax.Array, state: QuantState, plan: Plan, *,
                 sliding_window: int | None = None, impl: str = "auto") -> jax.Array:
  """The `top_k` slots per KV head from the coded keys' scores; contract as `rocketkv.select`
  (the logits from the kernel or XLA, `impl`; softmax, group sum and `top_k` in XLA).

  Returns:
    int32 [B, Hkv, min(top_k, C)], no slot twice; when fewer slots are valid, every valid slot
    and distinct invalid slots (>= C, which `attend` masks).
  """
  return _select(q, state, plan, sliding_window, impl)[0]


def _select(q, state, plan, sliding_window, impl):
  """(slots [B, Hkv, K] as `select_quant`, per-head softmax [B, Hkv, G, C] over the valid
  slots)."""
  require(isinstance(state, QuantState),
          f"a 'quant' plan needs a QuantState (from rocketkv.prefill), got {type(state)}")
  cache = state.cache
  check_query(q, cache)
  c = cache.capacity
  k = min(plan.top_k, c)
  valid = valid_slots(cache, sliding_window)  # [B, Hkv, C]
  logits = slot_logits(q, state, plan.r, group_dims=plan.group_dims, impl=impl)
  p = masked_softmax(logits, valid[:, :, None, :])
  return top_scored_slots(group_sum(p), valid, k, c), p


def decode_attend(q: jax.Array, state: QuantState, plan: Plan, *,
                  sliding_window: int | None = None, impl: str = "auto") -> jax.Array:
  """One step's attention over a quant state (after its append): exact attention over the
  `top_k` slots the codes pick and, with `Quant.mean_value`, the mean-value fill (module doc).

  Returns:
    [B, Hq, D] in q's dtype.
  """
  idx, p = _select(q, state, plan, sliding_window, impl)
  out = attend(q, state.cache, idx, sliding_window=sliding_window, impl=impl)
  if not plan.stage2.mean_value:
    return out
  require(state.v_sum is not None, "a mean_value plan needs the QuantState its prefill built")
  b, hkv, g, c = p.shape
  picked = jnp.take_along_axis(p, jnp.minimum(idx, c - 1)[:, :, None, :], axis=-1)
  alpha = jnp.sum(jnp.where((idx < c)[:, :, None, :], picked, 0.0), axis=-1)  # [B, Hkv, G]
  v_mean = state.v_sum / jnp.maximum(state.cache.length, 1)[:, None, None].astype(jnp.float32)
  alpha = alpha.reshape(b, hkv * g, 1)
  v_mean = jnp.repeat(v_mean, g, axis=1)  # [B, Hq, D], query head h -> KV head h // G
  return (alpha * out.astype(jnp.float32) + (1.0 - alpha) * v_mean).astype(out.dtype)

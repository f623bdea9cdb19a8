"""The serving engine's paged KV pool: the batch state of `S` slots whose caches share pages.

    pool = empty_pool(row, S, N, P, NP, sliding)          # N pages of P tokens, NP per slot
    pool = write_request(pool, row, slot, page_ids, sliding)  # a prefilled request moves in
    pool = release(pool, free, sliding)                   # freed slots' tables -> scratch
    pool = set_tables(pool, rows, mask, sliding)          # new tables of the slots in mask
    pool = move_row(pool, src, dst, sliding)              # a request changes slot
    sub = take_rows(pool, R, sliding); pool = put_rows(pool, sub, sliding)  # slots [0, R)

Per layer, K, V, their positions and what the method keeps beside them (chunk summaries,
Quant's 4-bit codes) live in pages `[N, Hkv, P, ...]` shared by every slot (`cache.KVCache`
with a `table`); each slot has a page table `[S, NP]` and its own per-sequence fields
(`length`, `seen`, Quant's per-channel grid). Page 0 is the scratch page: a free slot's table
points only there, so the garbage an idle slot decodes never lands in a page another request
owns. A hybrid model's sliding layers keep their small per-slot window caches (no pages);
`sliding` flags those groups of the `LayerStack`.

`row` is one request's state as `llama.prefill(..., stacked=True)` makes it (a `LayerStack`
of batch 1, contiguous caches of the plan's capacity); `write_request` copies its rows into
the pages `page_ids [NP]` (entries past the ones it was given hold N: not written) and points
the slot's table at them. The states a paged pool holds: `KVCache` (full, snapkv, rocketkv's
"minmax" and "rerank", ...) and `QuantState` (stage2="quant", `RocketConfig.recommended`);
`check_pageable` names the others.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from rocketkv_jax import pages
from rocketkv_jax.cache import KVCache, valid_slots
from rocketkv_jax.methods.stage2 import quant
from rocketkv_jax.models import llama

SCRATCH = 0  # the page id every free slot's table holds


def page_tokens(plan, page_size: int) -> int:
  """Slots per page: `page_size` rounded up to a multiple of the plan's chunk size and of
  Quant's codes per byte (a page then holds whole chunks and whole code bytes)."""
  unit = max(plan.chunk_size, 1)
  if isinstance(plan.stage2, quant.Quant) and plan.method == "rocketkv":
    unit = math.lcm(unit, 8 // plan.stage2.bits)
  return -(-page_size // unit) * unit


def _is_state(x) -> bool:
  return isinstance(x, (KVCache, quant.QuantState))


def check_pageable(row: llama.LayerStack, sliding_groups: tuple[bool, ...], plan) -> None:
  """ValueError unless every paged group's state is a `KVCache` or a `QuantState` of the plan's
  capacity (one page table serves every layer, and a request's pages count its kept tokens)."""
  caps = {plan.capacity}
  for slide, g in zip(sliding_groups, row.groups):
    if slide:
      continue
    if not _is_state(g):
      raise ValueError(f"page_size needs a method whose decode state is a KVCache or a "
                       f"QuantState (full, snapkv, rocketkv with stage2 minmax / rerank / quant, "
                       f"...), got a {type(g).__name__}: use page_size=None")
    caps.add(getattr(g, "cache", g).k_raw.shape[-2])
  if len(caps) > 1:
    raise ValueError(f"page_size needs every layer's cache of the plan's capacity "
                     f"{plan.capacity}, got {sorted(caps)} (skip_layers' dense layers hold the "
                     f"whole prompt): use page_size=None")


# ------------------------------------------------------------------ one layer
def _empty_cache(row: KVCache, slots: int, num_pages: int, p: int, npg: int) -> KVCache:
  h, d = row.k_raw.shape[1], row.k_raw.shape[3]
  cs = row.chunk_size
  width = p // cs if cs > 0 else 0
  rows = row.bounds_raw.shape[2]
  tile = lambda x: jnp.repeat(x, slots, axis=0)
  return KVCache(
      k_raw=jnp.zeros((num_pages, h, p, d), row.k_raw.dtype),
      v_raw=jnp.zeros((num_pages, h, p, d), row.v_raw.dtype),
      bounds_raw=jnp.zeros((num_pages, h, rows, width), row.bounds_raw.dtype),
      pos_raw=jnp.full((num_pages, h, p), -1, jnp.int32),
      length=tile(row.length), seen=tile(row.seen), overflow=tile(row.overflow),
      table=jnp.full((slots, npg), SCRATCH, jnp.int32), chunk_size=cs,
      dtype_name=row.dtype_name, method=row.method, page_size=p)


def _write_cache(pool: KVCache, row: KVCache, slot, page_ids) -> KVCache:
  p, npg = pool.page_size, pool.table.shape[-1]
  put = lambda buf, x: buf.at[page_ids].set(x.astype(buf.dtype), mode="drop")
  k_raw = put(pool.k_raw, pages.to_pages(row.k_raw[0], p, npg))
  v_raw = put(pool.v_raw, pages.to_pages(row.v_raw[0], p, npg))
  bounds_raw = pool.bounds_raw
  if row.chunk_size > 0:
    bounds_raw = put(bounds_raw, pages.cols_to_pages(row.bounds_raw[0], p // row.chunk_size,
                                                     npg))
  pos = pages.to_pages(row.pos_raw[0][..., None], p, npg, fill=-1)[..., 0]  # [NP, H, P]
  at = lambda buf, x: lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), slot, 0)
  table = jnp.where(page_ids < pool.k_raw.shape[0], page_ids, SCRATCH).astype(jnp.int32)
  return pool.replace(k_raw=k_raw, v_raw=v_raw, bounds_raw=bounds_raw,
                      pos_raw=put(pool.pos_raw, pos),
                      length=at(pool.length, row.length), seen=at(pool.seen, row.seen),
                      overflow=at(pool.overflow, row.overflow),
                      table=at(pool.table, table[None]))


def _empty(row, slots, num_pages, p, npg):
  if isinstance(row, KVCache):
    return _empty_cache(row, slots, num_pages, p, npg)
  cache = _empty_cache(row.cache, slots, num_pages, p, npg)
  tile = lambda x: None if x is None else jnp.repeat(x, slots, axis=0)
  codes = jnp.zeros((num_pages, row.codes.shape[1], row.codes.shape[2], p // row.per_byte),
                    row.codes.dtype)
  return row.replace(cache=cache, codes=codes, lo=tile(row.lo), step=tile(row.step),
                     v_sum=tile(row.v_sum))


def _write(pool, row, slot, page_ids):
  if isinstance(row, KVCache):
    return _write_cache(pool, row, slot, page_ids)
  cache = _write_cache(pool.cache, row.cache, slot, page_ids)
  # The codes packed per page (quant.pack's layout within each page), from the row's keys on
  # the row's grid: the same codes as the row's own.
  src = row.cache
  p, npg = cache.page_size, cache.table.shape[-1]
  codes = jnp.where(valid_slots(src)[..., None],
                    quant.quantize(src.k, row.lo, row.step, row.bits), 0)[0]  # [H, C, D]
  codes = quant.pack(pages.to_pages(codes, p, npg), row.bits)  # [NP, H, D, P / per]
  at = lambda buf, x: (None if buf is None else
                       lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), slot, 0))
  return pool.replace(cache=cache,
                      codes=pool.codes.at[page_ids].set(codes, mode="drop"),
                      lo=at(pool.lo, row.lo), step=at(pool.step, row.step),
                      v_sum=at(pool.v_sum, row.v_sum))


def _set_table(pool, rows, mask):
  cache = pool if isinstance(pool, KVCache) else pool.cache
  table = jnp.where(mask[:, None], rows, cache.table).astype(cache.table.dtype)
  cache = cache.replace(table=table)
  return cache if isinstance(pool, KVCache) else pool.replace(cache=cache)


# ------------------------------------------------------------------ the batch state
def _groups(state: llama.LayerStack):
  return [(hi - lo > 1, g) for (lo, hi), g in zip(state.spans, state.groups)]


def empty_pool(row: llama.LayerStack, slots: int, num_pages: int, page_size: int,
               pages_per_seq: int, sliding_groups: tuple[bool, ...]) -> llama.LayerStack:
  """The pool state: `num_pages` zero pages per paged layer, every slot's table on the scratch
  page and its per-sequence fields those of `row`; sliding groups tiled per slot."""
  out = []
  for slide, (stacked, g) in zip(sliding_groups, _groups(row)):
    if slide:
      axis = 1 if stacked else 0
      out.append(jax.tree.map(lambda a, axis=axis: jnp.repeat(a, slots, axis=axis), g))
      continue
    fn = lambda g: _empty(g, slots, num_pages, page_size, pages_per_seq)
    out.append(jax.vmap(fn)(g) if stacked else fn(g))
  return row.replace(groups=tuple(out))


def kept_tokens(row: llama.LayerStack, sliding_groups: tuple[bool, ...]) -> jax.Array:
  """The most tokens a paged layer of the one-request state `row` holds (a scalar)."""
  lengths = [getattr(g, "cache", g).length for slide, g in zip(sliding_groups, row.groups)
             if not slide]
  return jnp.max(jnp.stack([jnp.max(x) for x in lengths]))


def write_request(pool: llama.LayerStack, row: llama.LayerStack, slot: jax.Array,
                  page_ids: jax.Array, sliding_groups: tuple[bool, ...]) -> llama.LayerStack:
  """`pool` with request `row` in slot `slot`: its caches' rows in pages `page_ids [NP]`
  (ids >= N: none), its per-sequence fields at `slot`."""
  out = []
  for slide, (stacked, g), r in zip(sliding_groups, _groups(pool), row.groups):
    if slide:
      axis = 1 if stacked else 0
      out.append(jax.tree.map(
          lambda a, b, axis=axis: lax.dynamic_update_index_in_dim(a, b.astype(a.dtype), slot,
                                                                  axis), g, r))
      continue
    fn = lambda g, r: _write(g, r, slot, page_ids)
    out.append(jax.vmap(fn)(g, r) if stacked else fn(g, r))
  return pool.replace(groups=tuple(out))


def release(pool: llama.LayerStack, free: jax.Array,
            sliding_groups: tuple[bool, ...]) -> llama.LayerStack:
  """The slots where `free [S]` holds point at the scratch page only (their pages may be
  given to other requests)."""
  return set_tables(pool, jnp.full((1, 1), SCRATCH, jnp.int32), free, sliding_groups)


def set_tables(pool: llama.LayerStack, rows: jax.Array, mask: jax.Array,
               sliding_groups: tuple[bool, ...]) -> llama.LayerStack:
  """The slots where `mask [S]` holds get the page table `rows [S, NP]` (broadcast) in every
  paged layer: pages given to a request as it grows, or taken back (SCRATCH)."""
  out = []
  for slide, (stacked, g) in zip(sliding_groups, _groups(pool)):
    if slide:
      out.append(g)
      continue
    fn = lambda g: _set_table(g, rows, mask)
    out.append(jax.vmap(fn)(g) if stacked else fn(g))
  return pool.replace(groups=tuple(out))


# ------------------------------------------------------------------ the busy rows
def _slot_leaves(g, fn, other=None):
  """`g` with `fn(leaf[, other's leaf])` applied to its per-slot leaves (not the pages)."""
  f = (lambda name, x=g: fn(getattr(x, name))) if other is None else (
      lambda name, x=g, y=other: fn(getattr(x, name), getattr(y, name)))
  if isinstance(g, KVCache):
    new = {n: f(n) for n in ("length", "seen", "overflow", "table")}
    if other is not None:  # the pages as the other state has them
      new.update(k_raw=other.k_raw, v_raw=other.v_raw, bounds_raw=other.bounds_raw,
                 pos_raw=other.pos_raw)
    return g.replace(**new)
  cache = _slot_leaves(g.cache, fn, None if other is None else other.cache)
  new = {n: f(n) for n in ("lo", "step") + (("v_sum",) if g.v_sum is not None else ())}
  if other is not None:
    new["codes"] = other.codes
  return g.replace(cache=cache, **new)


def _map_groups(state, sliding_groups, fn, other=None):
  """fn(leaf[, other leaf], axis) over every per-slot leaf of `state` (axis: its slot axis)."""
  out = []
  others = [None] * len(state.groups) if other is None else other.groups
  for slide, (stacked, g), o in zip(sliding_groups, _groups(state), others):
    axis = 1 if stacked else 0
    f = lambda *xs, axis=axis: fn(*xs, axis)
    if slide:
      out.append(jax.tree.map(f, g) if o is None else jax.tree.map(f, g, o))
    else:
      out.append(_slot_leaves(g, f, o))
  return state.replace(groups=tuple(out))


def take_rows(state: llama.LayerStack, rows: int, sliding_groups) -> llama.LayerStack:
  """The state of slots [0, rows) (the pages shared, as they are)."""
  return _map_groups(state, sliding_groups,
                     lambda x, axis: lax.slice_in_dim(x, 0, rows, axis=axis))


def put_rows(state: llama.LayerStack, sub: llama.LayerStack, sliding_groups) -> llama.LayerStack:
  """`state` with slots [0, rows) and the pages from `sub` (a `take_rows` state, updated)."""
  return _map_groups(state, sliding_groups,
                     lambda x, y, axis: lax.dynamic_update_slice_in_dim(x, y.astype(x.dtype), 0,
                                                                        axis), sub)


def move_row(state: llama.LayerStack, src: jax.Array, dst: jax.Array,
             sliding_groups) -> llama.LayerStack:
  """Slot `src`'s per-slot fields (page table included) copied into slot `dst`: the request
  moves, its pages stay where they are."""
  def move(x, axis):
    row = lax.dynamic_index_in_dim(x, src, axis, keepdims=True)
    return lax.dynamic_update_slice_in_dim(x, row, dst, axis)
  return _map_groups(state, sliding_groups, move)

"""Paged storage: a pool of fixed-size pages and the page tables that map a sequence onto them.

A paged buffer holds `[N, H, P, X]`: N pages of P slots (pages on the leading axis, the unit a
TPU kernel would DMA), and a sequence b's logical slot s lives at page `table[b, s // P]`,
offset `s % P`, `table [B, NP]` int32 (NP = pages per sequence, so its logical capacity is
NP * P). Summary buffers keep their own layout per page, `[N, H, R, W]` with W columns per page
(chunk summaries: W = P / chunk; packed key codes: W = P / codes per byte).

These are the index rules only (no cache semantics): `KVCache` (cache.py) stores K / V and the
chunk summaries in pages when it has a table, and the stage-2 variants read through them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def locate(table: jax.Array, slot: jax.Array, page_size: int):
  """(page [B], offset [B]) of logical slot `slot [B]` of each sequence; `table [B, NP]`."""
  b = table.shape[0]
  p = jnp.clip(slot // page_size, 0, table.shape[1] - 1)
  return table[jnp.arange(b), p], slot - p * page_size


def logical(buf: jax.Array, table: jax.Array) -> jax.Array:
  """The sequences' slots in order: `buf [N, H, P, X]` -> `[B, H, NP * P, X]` (a gather)."""
  g = buf[table]  # [B, NP, H, P, X]
  b, npg, h, p, x = g.shape
  return jnp.swapaxes(g, 1, 2).reshape(b, h, npg * p, x)


def logical_cols(buf: jax.Array, table: jax.Array) -> jax.Array:
  """Per-page columns in order: `buf [N, H, R, W]` -> `[B, H, R, NP * W]` (a gather)."""
  g = buf[table]  # [B, NP, H, R, W]
  b, npg, h, r, w = g.shape
  return jnp.transpose(g, (0, 2, 3, 1, 4)).reshape(b, h, r, npg * w)


def gather_slots(buf: jax.Array, table: jax.Array, idx: jax.Array, page_size: int) -> jax.Array:
  """Rows `idx [B, H, K]` (logical slots, in range) of `buf [N, H, P, X]` -> `[B, H, K, X]`:
  one gather that reads only those rows."""
  page = jnp.take_along_axis(table[:, None, :], idx // page_size, axis=2)  # [B, H, K]
  h = jnp.arange(buf.shape[1])[None, :, None]
  return buf[page, h, idx % page_size]


def gather_cols(buf: jax.Array, table: jax.Array, rows: jax.Array) -> jax.Array:
  """Rows `rows [B, H, r]` of every page of each sequence: `buf [N, H, R, W]` ->
  `[B, H, r, NP * W]` in logical column order (reads only those rows)."""
  b, h, r = rows.shape
  page = table[:, None, None, :]  # [B, 1, 1, NP]
  g = buf[page, jnp.arange(h)[None, :, None, None], rows[..., None]]  # [B, H, r, NP, W]
  return g.reshape(b, h, r, -1)


# A read in pool order takes each page's rows in place; the same rows gathered through the table
# are copied element by element first, about twice the time per byte on XLA:CPU. So a paged
# read goes in pool order while the pool holds at most this many times the pages it would gather
# (docs/serving.md, "Design").
POOL_READ_RATIO = 2


def owners(table: jax.Array, live: jax.Array, num_pages: int):
  """Which sequence reads each page: `table [B, NP]`, `live [B, NP]` (the entries that hold a
  valid slot) -> (owner [N] int32, the row of each page's live entry, 0 where none; single, a
  bool scalar: no page is a live entry of two rows or twice of one). A read in pool order (every
  page against its owner's query, no page copied) is exact when `single` holds."""
  b = table.shape[0]
  target = jnp.where(live, table, num_pages)  # num_pages: dropped
  refs = jnp.zeros((num_pages,), jnp.int32).at[target].add(1, mode="drop")
  rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], table.shape)
  owner = jnp.zeros((num_pages,), jnp.int32).at[target].set(rows, mode="drop")
  return owner, jnp.max(refs) <= 1


def pool_or_table(table: jax.Array, length: jax.Array, page_size: int, num_pages: int,
                  in_place, through_table):
  """A paged read done the cheaper exact way: `in_place(owner [N])` (pool order, `owners`) when
  no page is in two sequences' first `length [B]` slots and the pool is at most
  `POOL_READ_RATIO` times the table's pages, else `through_table()` (picked on the device)."""
  b, npg = table.shape
  if num_pages > POOL_READ_RATIO * b * npg:
    return through_table()
  live = jnp.arange(npg)[None, :] * page_size < length[:, None]  # [B, NP]
  owner, single = owners(table, live, num_pages)
  return jax.lax.cond(single, lambda: in_place(owner), through_table)


def in_table_order(x: jax.Array, table: jax.Array) -> jax.Array:
  """Per-page values in pool order `x [N, H, G, P]` -> each sequence's in slot order
  `[B, H, G, NP * P]` (a gather of G values per slot)."""
  g = jnp.transpose(x[table], (0, 2, 3, 1, 4))  # [B, H, G, NP, P]
  return g.reshape(*g.shape[:3], -1)


def to_pages(x: jax.Array, page_size: int, num_pages: int, fill=0) -> jax.Array:
  """One sequence's slots `x [H, C, X]` -> its pages `[num_pages, H, P, X]` (slots past C
  padded with `fill`)."""
  h, c, rest = x.shape[0], x.shape[1], x.shape[2:]
  pad = num_pages * page_size - c
  x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * len(rest), constant_values=fill)
  return jnp.swapaxes(x.reshape(h, num_pages, page_size, *rest), 0, 1)


def cols_to_pages(x: jax.Array, cols_per_page: int, num_pages: int) -> jax.Array:
  """One sequence's columns `x [H, R, W']` -> `[num_pages, H, R, W]`, zero-padded."""
  h, r, w = x.shape
  x = jnp.pad(x, ((0, 0), (0, 0), (0, num_pages * cols_per_page - w)))
  return jnp.moveaxis(x.reshape(h, r, num_pages, cols_per_page), 2, 0)

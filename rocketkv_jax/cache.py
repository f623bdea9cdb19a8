"""`KVCache`: the immutable, fixed-capacity KV-cache pytree, and the functions that write it.

Layout: `k, v [B, Hkv, C, D]` hold keys (post-RoPE) and values in slot order; each KV head has
its own slots (stage 1 keeps different tokens per head) but every head of a sequence holds the
same number of valid slots, `length[b]`. Slots `>= length[b]` are padding (zeros).

`kmin, kmax [B, Hkv, NC, D]` (NC = ceil(C / chunk_size)) are the element-wise min / max of the
valid keys of each chunk of `chunk_size` consecutive slots; a chunk without valid slots holds
zeros (never +-inf, so a product with a zero query stays finite). They are stored together,
dim-major: `bounds [B, Hkv, 2D, NC]`, rows `d` = kmin[..., d] and `D + d` = kmax[..., d], so that
stage 2 reads just the r rows it needs (one contiguous gather; see `select`). With
`chunk_size == 1` every chunk is one slot and kmin = kmax = its key, so `bounds [B, Hkv, D, C]`
holds that one copy (row d = k[..., d], the keys dim-major; `two_sided` tells them apart): SparQ's
cache, and RocketKV's where the split gives chunks of 1, hold 1.5 caches of K/V instead of 2.

Full cache behaviour (documented contract): `append` on a full sequence never writes out of
bounds: the newest token replaces the one in the last slot (its chunk's min/max stay a valid
bound), `length` stays at capacity and `overflow[b]` is set; read it with `cache_overflow`.
`generate` turns it into an error on the host. (Overwriting rather than dropping keeps the write
a plain in-place dynamic-update-slice, which XLA never turns into a whole-cache copy.)

Storage: on the CPU backend, 16-bit float caches (bf16, f16) are stored as their uint16 bit
patterns (`k_raw` etc.) and read through the `k, v, bounds, kmin, kmax` properties, which bitcast
back (inside a jit the bitcast fuses into the gather that reads it). XLA:CPU computes a bf16
dynamic-update-slice in f32 (convert the whole buffer, update, convert back), so a bf16 buffer
costs a full pass per appended token; on the bit pattern the append is an in-place row write.
Other dtypes, and every dtype on GPU, are stored as they are (`STORE_16BIT_AS_BITS` overrides).

Paged: a cache with a `table` keeps K, V and the summaries in a pool of pages shared by the
sequences (`pages.py`: `k_raw [N, Hkv, P, D]`, slot s of sequence b at page `table[b, s // P]`);
`pos` and the counters stay per sequence. `append` writes its row into the page; the properties
`k, v, bounds` gather the sequence's pages into the layout above, and the hot reads (stage 2's
rows, attention's selected slots) go through the table directly. The serving engine builds
paged caches (runtime/paged_pool.py); everything else makes contiguous ones.
"""

from __future__ import annotations

import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from rocketkv_jax import layer_scan, pages
from rocketkv_jax._checks import require, require_int_array, require_layout, require_rank
from rocketkv_jax.ops import bounds_of, two_sided  # in ops: the kernels read them too


# Whether 16-bit float caches are stored as uint16 bits: None = on the CPU backend only (GPU
# updates bf16 in place natively, and its Pallas kernels take the arrays as they are).
STORE_16BIT_AS_BITS: bool | None = None


def _stored_as_bits(dtype) -> bool:
  dtype = jnp.dtype(dtype)
  policy = STORE_16BIT_AS_BITS
  if policy is None:
    policy = jax.default_backend() == "cpu"
  return bool(policy) and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2


def to_storage(x: jax.Array) -> jax.Array:
  """The array as a cache stores it: 16-bit floats as uint16 bits, anything else unchanged."""
  return lax.bitcast_convert_type(x, jnp.uint16) if _stored_as_bits(x.dtype) else x


def _storage_like(x: jax.Array, buf: jax.Array) -> jax.Array:
  """x (in the cache's logical dtype) in the storage dtype of `buf`."""
  if buf.dtype == jnp.uint16 and jnp.issubdtype(x.dtype, jnp.floating):  # bit storage
    return lax.bitcast_convert_type(x, jnp.uint16)
  return x.astype(buf.dtype)


def from_storage(x: jax.Array, dtype) -> jax.Array:
  """Inverse of `to_storage` for a cache of logical dtype `dtype`."""
  dtype = jnp.dtype(dtype)
  return lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


@struct.dataclass
class KVCache:
  """One layer's KV cache.

  Read the keys and values through the properties (logical dtype); the `*_raw` leaves are the
  storage (see the module doc).

  Properties:
    k, v: [B, Hkv, C, D] keys (post-RoPE) and values, in `dtype`.
    kmin, kmax: [B, Hkv, NC, D] per-chunk min / max of the valid keys, in `dtype`.
    bounds: [B, Hkv, 2D, NC] both, dim-major (kmin rows, then kmax rows), in `dtype`; with
      chunk_size 1, [B, Hkv, D, C] (kmin = kmax = the keys; module doc).
    pos: [B, Hkv, C] int32 absolute token position held by each slot (-1: empty).
  Attributes:
    k_raw, v_raw, bounds_raw: storage of k, v, bounds (uint16 bits for 16-bit floats).
    pos_raw: storage of `pos`, the [B, Hkv, C] int32 absolute token position held by each slot
      (-1: empty); pages [N, Hkv, P] when paged.
    length: [B] int32 valid slots per sequence.
    seen: [B] int32 tokens seen so far (= absolute position of the next token).
    overflow: [B] bool, True once an append found the sequence full.
    table: None for a contiguous cache; for a paged one (the serving engine's pool, module doc
      "Paged"), [B, NP] int32 page ids: `k_raw, v_raw` are then pages [N, Hkv, P, D],
      `pos_raw` [N, Hkv, P], `bounds_raw` [N, Hkv, 2D | D, P / chunk_size], and the
      properties read through the table.
    chunk_size: static, slots per summary chunk (0: no summaries are kept).
    dtype_name: static, the logical dtype of k, v and the bounds.
    method: static, the method whose `rocketkv.prefill` made it ("" when built directly):
      `decode_step` / `select` refuse a plan of another method.
  """

  k_raw: jax.Array
  v_raw: jax.Array
  bounds_raw: jax.Array
  pos_raw: jax.Array
  length: jax.Array
  seen: jax.Array
  overflow: jax.Array
  table: jax.Array | None = None
  chunk_size: int = struct.field(pytree_node=False, default=1)
  dtype_name: str = struct.field(pytree_node=False, default="float32")
  method: str = struct.field(pytree_node=False, default="")
  page_size: int = struct.field(pytree_node=False, default=0)  # P of a paged cache

  @property
  def dtype(self):
    return jnp.dtype(self.dtype_name)

  @property
  def paged(self) -> bool:
    return self.table is not None

  @property
  def k(self) -> jax.Array:
    return from_storage(self._slots(self.k_raw), self.dtype)

  @property
  def v(self) -> jax.Array:
    return from_storage(self._slots(self.v_raw), self.dtype)

  @property
  def bounds(self) -> jax.Array:
    raw = self.bounds_raw
    return from_storage(pages.logical_cols(raw, self.table) if self.paged else raw, self.dtype)

  @property
  def pos(self) -> jax.Array:
    if self.paged:
      return pages.logical(self.pos_raw[..., None], self.table)[..., 0]
    return self.pos_raw

  def _slots(self, raw: jax.Array) -> jax.Array:
    """[B, Hkv, C, D] storage in slot order (a gather of the pages when paged)."""
    return pages.logical(raw, self.table) if self.paged else raw

  @property
  def kmin(self) -> jax.Array:
    return jnp.swapaxes(self.bounds[:, :, :self.k_raw.shape[3]], 2, 3)

  @property
  def kmax(self) -> jax.Array:
    d = self.k_raw.shape[3]
    return jnp.swapaxes(self.bounds[:, :, d:] if two_sided(self.bounds_raw, d) else self.bounds,
                        2, 3)

  @property
  def capacity(self) -> int:
    if self.paged:
      return self.table.shape[-1] * self.page_size
    return self.k_raw.shape[2]

  @property
  def num_chunks(self) -> int:
    if self.paged:
      return self.table.shape[-1] * self.bounds_raw.shape[-1]
    return self.bounds_raw.shape[3]

  @property
  def nbytes(self) -> int:
    """Bytes of device memory the cache holds (every array in it; a Python int)."""
    return state_nbytes(self)


def state_nbytes(state) -> int:
  """Bytes of every array in the pytree `state`, from shapes and dtypes (no device read, so
  also on traced or abstract states)."""
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(state) if hasattr(x, "shape"))


@typing.runtime_checkable
class State(typing.Protocol):
  """What every decode state answers, whatever the method and stage-2 variant: a `KVCache`,
  `QuantState`, `LowRankState`, `MTState`, ... (a stacked state, `[..., B]` instead of `[B]`).

  Attributes:
    length: [B] int32 valid tokens per row in the cache that attention reads.
    seen: [B] int32 tokens seen so far (= absolute position of the next token).
    overflow: [B] bool, True once an append found a cache of the state full.
    nbytes: bytes of device memory the state holds (every array in it; a Python int).
  """

  @property
  def length(self) -> jax.Array: ...

  @property
  def seen(self) -> jax.Array: ...

  @property
  def overflow(self) -> jax.Array: ...

  @property
  def nbytes(self) -> int: ...


class CacheState:
  """Mixin for a state that wraps one `KVCache` in its `cache` field: answers `State`'s
  questions from it (`nbytes` counts the whole state, summaries included)."""

  @property
  def length(self) -> jax.Array:
    return self.cache.length

  @property
  def seen(self) -> jax.Array:
    return self.cache.seen

  @property
  def overflow(self) -> jax.Array:
    return self.cache.overflow

  @property
  def nbytes(self) -> int:
    return state_nbytes(self)


def chunk_summaries(k: jax.Array, length: jax.Array, chunk_size: int):
  """Min / max of the valid keys of each chunk.

  Args:
    k: [B, H, C, D] keys.
    length: [B] valid slots.
    chunk_size: slots per chunk.
  Returns:
    (kmin, kmax), each [B, H, ceil(C / chunk_size), D], zeros for chunks with no valid slot.
    chunk_size 0 means "no summaries" (methods that never read them): [B, H, 0, D].
  """
  b, h, c, d = k.shape
  if chunk_size == 0:
    empty = jnp.zeros((b, h, 0, d), k.dtype)
    return empty, empty
  nc = -(-c // chunk_size)
  pad = nc * chunk_size - c
  kp = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(b, h, nc, chunk_size, d)
  valid = (jnp.arange(nc * chunk_size) < length[:, None]).reshape(b, 1, nc, chunk_size, 1)
  big = jnp.asarray(jnp.finfo(k.dtype).max, k.dtype)
  kmin = jnp.min(jnp.where(valid, kp, big), axis=3)
  kmax = jnp.max(jnp.where(valid, kp, -big), axis=3)
  any_valid = jnp.any(valid, axis=3)
  zero = jnp.zeros((), k.dtype)
  return jnp.where(any_valid, kmin, zero), jnp.where(any_valid, kmax, zero)


def summary_bounds(kmin: jax.Array, kmax: jax.Array, chunk_size: int) -> jax.Array:
  """The cache's stored summaries: `bounds_of(kmin, kmax)`, or with chunk_size 1 (kmin = kmax)
  the one copy `[B, H, D, C]` (module doc)."""
  return jnp.swapaxes(kmin, 2, 3) if chunk_size == 1 else bounds_of(kmin, kmax)


def from_kept(k: jax.Array, v: jax.Array, pos: jax.Array, length: jax.Array,
              seen: jax.Array, capacity: int, chunk_size: int) -> KVCache:
  """Builds a cache from the kept rows `k, v [B, Hkv, N, D]` (valid ones first), N <= capacity.

  Rows at or past `length[b]` are zeroed, `pos` set to -1 there; summaries are computed.
  """
  b, h, n, d = k.shape
  require(n <= capacity, f"kept rows N={n} must be <= capacity={capacity}")
  valid = jnp.arange(capacity) < length[:, None]  # [B, C]
  padw = ((0, 0), (0, 0), (0, capacity - n), (0, 0))
  k = jnp.where(valid[:, None, :, None], jnp.pad(k, padw), jnp.zeros((), k.dtype))
  v = jnp.where(valid[:, None, :, None], jnp.pad(v, padw), jnp.zeros((), v.dtype))
  pos = jnp.pad(pos.astype(jnp.int32), ((0, 0), (0, 0), (0, capacity - n)))
  pos = jnp.where(valid[:, None, :], pos, -1)
  kmin, kmax = chunk_summaries(k, length, chunk_size)
  return KVCache(k_raw=to_storage(k), v_raw=to_storage(v),
                 bounds_raw=to_storage(summary_bounds(kmin, kmax, chunk_size)), pos_raw=pos,
                 # Distinct buffers, so that a donated cache never donates one buffer twice.
                 length=jnp.array(length, jnp.int32, copy=True),
                 seen=jnp.array(seen, jnp.int32, copy=True),
                 overflow=jnp.zeros((b,), bool), chunk_size=chunk_size,
                 dtype_name=jnp.dtype(k.dtype).name)


def full_cache(k: jax.Array, v: jax.Array, capacity: int, chunk_size: int,
               lengths: jax.Array | None = None) -> KVCache:
  """A cache holding every prompt token of `k, v [B, Hkv, L, D]` (slot i = position i);
  `lengths [B]` valid tokens per row, in [0, L] (None: all L)."""
  require_rank("k", k, 4, "[B, Hkv, L, D]")
  require(getattr(v, "shape", None) == k.shape,
          f"k and v must have the same shape, got {k.shape} and {getattr(v, 'shape', None)}")
  b, h, n, _ = k.shape
  if lengths is not None:
    _check_cache_lengths(lengths, k.shape)
  lengths = jnp.full((b,), n, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, h, n))
  return from_kept(k, v, pos, lengths, lengths, capacity, chunk_size)


def _check_cache_lengths(lengths, shape) -> None:
  """`lengths` must be `[B]` integers in [0, L] (values checked when concrete); a value past L
  that fits axis 1 names the [B, L, Hkv, D] layout."""
  b, _, n, _ = shape
  lengths = lengths if hasattr(lengths, "shape") else np.asarray(lengths)
  require(lengths.shape == (b,), f"lengths must have shape [B]={(b,)}, got {lengths.shape}")
  require_int_array("lengths", lengths)
  if isinstance(lengths, jax.core.Tracer):
    return
  top = int(np.max(lengths, initial=0))
  require_layout(top <= n or top > shape[1], "k", "[B, Hkv, L, D]", shape, "[B, L, Hkv, D]",
                 f"lengths reach {top} > L={n}: transpose with k.transpose(0, 2, 1, 3) (and v)")
  require(top <= n and int(np.min(lengths, initial=0)) >= 0,
          f"lengths must be in [0, L={n}], got {np.asarray(lengths).tolist()}")


def empty_cache(batch: int, num_kv_heads: int, capacity: int, head_dim: int, dtype,
                chunk_size: int = 1) -> KVCache:
  """An empty cache with room for `capacity` tokens."""
  z = jnp.zeros((batch, num_kv_heads, 0, head_dim), dtype)
  return full_cache(z, z, capacity, chunk_size, jnp.zeros((batch,), jnp.int32))


def _check_new(cache: KVCache, k_new: jax.Array, v_new: jax.Array) -> None:
  require(isinstance(cache, KVCache), f"cache must be a KVCache, got {type(cache).__name__} "
          f"(a method's state: rocketkv.decode_step appends to it)")
  _, h, _, d = cache.k_raw.shape
  b = cache.length.shape[0]
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    shape = tuple(getattr(x, "shape", ()))
    require_layout(shape != (b, h, d), name, "[B, Hkv, 1, D]", shape, "[B, Hkv, D]",
                   f"add the token axis with {name}[:, :, None]")
    require_layout(h == 1 or shape != (b, 1, h, d), name, "[B, Hkv, 1, D]", shape,
                   "[B, 1, Hkv, D]", f"transpose with {name}.transpose(0, 2, 1, 3)")
    require_rank(name, x, 4, "[B, Hkv, 1, D]")
    require(x.shape == (b, h, 1, d),
            f"{name} must have shape [B, Hkv, 1, D] = {(b, h, 1, d)}, got {x.shape}")
    require(x.dtype == cache.dtype,
            f"{name} dtype {x.dtype} must match the cache dtype {cache.dtype}")


def write_rows(buf: jax.Array, rows: jax.Array, index: jax.Array, axis: int = 2,
               at0: jax.Array | None = None) -> jax.Array:
  """Writes `rows` [B, H, ...] (buf's shape without `axis`) at position index[b] of `axis` of
  sequence b: buf[b, :, index[b]] = rows[b] for axis 2; index clamped to the axis' size - 1.
  `at0 [B]`: the entry of buf's leading axis sequence b writes (a page id; default b).
  `buf` is a storage array (`to_storage`); `rows` are converted to its storage.

  One dynamic-update-slice per sequence (B is static and small) and no read of `buf`, so XLA
  updates a donated buffer in place; a scatter, or a read of the old row, makes XLA:CPU copy the
  whole cache every step. Batches above 16 sequences use one scatter instead (compile size).
  Inside `layer_scan.scan_layers` the rows go into the stacked buffer (see there).
  """
  rows = jnp.expand_dims(_storage_like(rows, buf), axis)
  index = jnp.clip(index, 0, buf.shape[axis] - 1)
  nb = rows.shape[0]
  at0 = jnp.arange(nb) if at0 is None else at0

  def write(target, lead):
    if nb > 16:
      # buf[at0, :, ..., index]: the advanced indices are split by slices, so the indexed view
      # is [B, <the other dims in order>] = rows without `axis`.
      at = lead + (at0,) + (slice(None),) * (axis - 1) + (index,)
      return target.at[at].set(jnp.squeeze(rows, axis))
    for b in range(nb):
      start = [0] * buf.ndim
      start[0], start[axis] = at0[b], index[b]
      update = rows[b:b + 1][(None,) * len(lead)]  # [1, ...] (one more 1 per lead index)
      target = lax.dynamic_update_slice(target, update, list(lead) + start)
    return target

  return layer_scan.write_rows(buf, write)


def append(cache: KVCache, k_new: jax.Array, v_new: jax.Array) -> KVCache:
  """Writes one token per sequence at slot `length[b]` and updates that chunk's min / max.

  Args:
    cache: the cache.
    k_new, v_new: [B, Hkv, 1, D] the new token's key (post-RoPE) and value.
  Returns:
    The new cache. A full sequence overwrites its last slot and sets `overflow[b]` (see module
    doc).
  """
  _check_new(cache, k_new, v_new)
  c, cs = cache.capacity, cache.chunk_size
  ok = cache.length < c
  slot = jnp.minimum(cache.length, c - 1)  # full: the newest token takes the last slot
  kn, vn = k_new[:, :, 0], v_new[:, :, 0]  # [B, Hkv, D]
  if cache.paged:  # the row goes to offset `at` of page `page` (module doc "Paged")
    span = cache.page_size
    page, at = pages.locate(cache.table, slot, span)
  else:
    span, page, at = c, None, slot
  k_raw = write_rows(cache.k_raw, kn, at, at0=page)
  bounds_raw = cache.bounds_raw
  if cs > 0:
    # The chunk's min / max recomputed from its (at most chunk_size) rows of the updated keys:
    # no read of the bounds before their write, so XLA updates them in place too.
    ci = at // cs
    width = min(cs, span)
    start = jnp.minimum(ci * cs, span - width)
    if page is None:
      rows = [lax.dynamic_slice_in_dim(k_raw[b], start[b], width, axis=1)
              for b in range(k_raw.shape[0])]
    else:
      h, d = k_raw.shape[1], k_raw.shape[3]
      rows = [lax.dynamic_slice(k_raw, (page[b], 0, start[b], 0), (1, h, width, d))[0]
              for b in range(kn.shape[0])]
    rows = from_storage(jnp.stack(rows), cache.dtype)  # [B, Hkv, w, D]
    j = start[:, None] + jnp.arange(width)
    in_chunk = ((j >= ci[:, None] * cs) & (j <= at[:, None]))[:, None, :, None]
    big = jnp.asarray(jnp.finfo(cache.dtype).max, cache.dtype)
    col = jnp.min(jnp.where(in_chunk, rows, big), axis=2)
    if cs > 1:  # chunk_size 1 keeps one copy (module doc)
      col = jnp.concatenate([col, jnp.max(jnp.where(in_chunk, rows, -big), axis=2)], axis=-1)
    # column ci of [B, Hkv, 2D | D, NC] (of the page's [N, Hkv, 2D | D, P / cs])
    bounds_raw = write_rows(bounds_raw, col, ci, axis=3, at0=page)
  seen = jnp.broadcast_to(cache.seen[:, None], (kn.shape[0], kn.shape[1]))
  return cache.replace(k_raw=k_raw, v_raw=write_rows(cache.v_raw, vn, at, at0=page),
                       bounds_raw=bounds_raw,
                       pos_raw=write_rows(cache.pos_raw, seen, at, at0=page),
                       length=cache.length + ok.astype(jnp.int32), seen=cache.seen + 1,
                       overflow=cache.overflow | ~ok)


def extend(cache: KVCache, k: jax.Array, v: jax.Array,
           lengths: jax.Array | None = None) -> KVCache:
  """Appends a block of tokens `k, v [B, Hkv, T, D]`, `lengths[b]` of them valid, and rebuilds
  the summaries. Used between turns (not on the per-token hot path). Overflowing tokens are
  dropped and flag `overflow[b]`."""
  require(not cache.paged, "extend needs a contiguous cache, got a paged one")
  b, h, t, d = k.shape
  require(k.shape == v.shape and k.shape[:2] == cache.k.shape[:2] and d == cache.k.shape[3],
          f"k, v must have shape [B, Hkv, T, D] matching the cache {cache.k.shape}, "
          f"got {k.shape} and {v.shape}")
  require(k.dtype == cache.dtype and v.dtype == cache.dtype,
          f"k, v dtype must match the cache dtype {cache.dtype}")
  if lengths is not None:
    require_int_array("lengths", lengths)
  c = cache.capacity
  lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
  i = jnp.arange(t)
  slot = cache.length[:, None] + i  # [B, T]
  ok = (i < lengths[:, None]) & (slot < c)
  slot_w = jnp.where(ok, slot, c)
  bi = jnp.arange(b)[:, None]
  kk = cache.k_raw.at[bi, :, slot_w].set(_storage_like(jnp.moveaxis(k, 2, 1), cache.k_raw),
                                         mode="drop")
  vv = cache.v_raw.at[bi, :, slot_w].set(_storage_like(jnp.moveaxis(v, 2, 1), cache.v_raw),
                                         mode="drop")
  newpos = jnp.broadcast_to((cache.seen[:, None] + i)[:, :, None], (b, t, h))
  pos = cache.pos.at[bi, :, slot_w].set(newpos, mode="drop")
  written = jnp.sum(ok, axis=1).astype(jnp.int32)
  length = cache.length + written
  kmin, kmax = chunk_summaries(from_storage(kk, cache.dtype), length, cache.chunk_size)
  return cache.replace(k_raw=kk, v_raw=vv,
                       bounds_raw=_storage_like(summary_bounds(kmin, kmax, cache.chunk_size),
                                                cache.bounds_raw),
                       pos_raw=pos, length=length,
                       seen=cache.seen + lengths,
                       overflow=cache.overflow | (written < lengths))


def grow(cache: KVCache, capacity: int, chunk_size: int | None = None) -> KVCache:
  """The same cache with `capacity` slots (>= its current capacity)."""
  require(not cache.paged, "grow needs a contiguous cache, got a paged one")
  require(capacity >= cache.capacity,
          f"capacity must be >= the current capacity {cache.capacity}, got {capacity}")
  chunk_size = cache.chunk_size if chunk_size is None else chunk_size
  out = from_kept(cache.k, cache.v, cache.pos, cache.length, cache.seen, capacity, chunk_size)
  return out.replace(overflow=cache.overflow)


def valid_slots(cache: KVCache, sliding_window: int | None = None) -> jax.Array:
  """[B, Hkv, C] bool: slot holds a token the newest token may attend to.

  With `sliding_window` (Mistral v0.1) the newest token at position p = seen - 1 sees a key at
  position j only when p - j < sliding_window.
  """
  c = cache.capacity
  valid = (jnp.arange(c) < cache.length[:, None])[:, None, :]
  if sliding_window is not None:
    newest = (cache.seen - 1)[:, None, None]
    valid = valid & (newest - cache.pos < sliding_window)
  return jnp.broadcast_to(valid, cache.pos.shape)


def cache_overflow(state) -> jax.Array:
  """[B] bool: True where an append found the cache full (any cache inside `state`)."""
  caches = [x for x in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, KVCache))
            if isinstance(x, KVCache)]
  require(len(caches) > 0, "state must contain a KVCache")
  # stacked states (`layer_scan`, `llama.LayerStack`) hold [..., B] flags
  flags = [jnp.any(c.overflow, axis=tuple(range(c.overflow.ndim - 1))) for c in caches]
  out = flags[0]
  for f in flags[1:]:
    out = out | f
  return out

"""Fused stage 2: RocketKV's select + attend for one decode query in two kernels per layer.

The unfused path runs a chain of small ops per layer and step (group the query, top-r dims,
row indices, pad, chunk-logit kernel, masked softmax, group sum, chunk top-k, candidate
partition and scatter, clip / mask / encode the slots, attention kernel, split-K merge): on a
GPU its cost is launches, not bytes (docs/gpu.md). Here it is two kernels, grid (batch, KV head):

1. `rocketkv_fused_chunk_scores`: the top-r dims by |q| summed over the group (as ranks: dim d
   is kept when fewer than r dims come before it, ties to the lower dim, as `lax.top_k`), each
   dim's bound row (kmax where the group-summed q > 0, else kmin), SparQ's scale, the chunk
   logits from just those r rows of `bounds`, the masked softmax per query head and the group
   sum: two passes over the chunks (running max / sum, then the scores; the second reads the
   same r rows again, from L2). Writes `scores [B, Hkv, NCp]` fp32 (4 bytes per chunk).
2. `rocketkv_fused_select_attend`: the selection of `select.top_slots` without a sort: the first
   `top_k` valid slots in (score desc, chunk asc, slot asc) order are the valid slots of the
   chunks whose score bits exceed a threshold t*, then of the chunks scoring exactly t* below a
   chunk index i*, then the first `partial` valid slots of chunk i*. t* and i* come from two
   bisections over the scores (scores are >= 0, so their int32 bit patterns order like the
   floats), each step a count of valid slots. Then one pass over the chunks in blocks: for each
   slot offset j < chunk_size, the selected slots' K / V rows are loaded with a row mask
   (unselected rows issue no memory reads), and an online softmax accumulates the G query heads
   (repeated to the 16 rows of a tensor-core dot). Writes the output rows [G, D] of its KV head
   straight into `[B, Hq, D]`.

`stage2="quant"` swaps kernel 1 for `rocketkv_fused_quant_scores` (every slot scored from its
packed key codes, `methods/stage2/quant.slot_logits_xla`, then the same softmax and group sum)
and runs kernel 2 with chunks of one slot (`fused_quant_attend`).

Only prefix-valid caches (no sliding window) take this path; `rocketkv_jax.fused_step` decides.
The kernels equal the XLA path: `select.approx_bounds_scores_xla` + `select.top_slots` (or
`methods/stage2/quant.select_quant`) + `attend.sparse_attention_xla`, the same slots
(tests/test_fused_decode.py). The expected H200 floor is in docs/gpu.md.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from rocketkv_jax._checks import require, require_rank

from ._util import (NEG_INF, cdiv, check_decode_qkv, compiler_params, dot_precision, next_pow2,
                    padded_dim, safe_max)

_INF_BITS = 0x7F800000  # int32 bits of +inf: every finite score >= 0 has bits below it


def _rows(ref, rows, start, block: int, ncols: int):
  """Rows `rows [R]` (-1: not loaded) of columns [start, start + block) of `ref [N, ncols]`
  (columns past ncols load 0): [R, block] in ref's dtype."""
  cols = start + jnp.arange(block)
  at = (jnp.maximum(rows, 0)[:, None], jnp.minimum(cols, ncols - 1)[None, :])
  return plgpu.load(ref.at[at], mask=(rows >= 0)[:, None] & (cols < ncols)[None, :], other=0)


def _top_r(q_ref, d: int, r: int, group: int, group_dims: str):
  """This KV head's G query rows (f32 [D] each), the top-r dims mask [D] (by `ops.dim_weights`:
  |q| summed over the group, each head's first divided by its sum with "normalized"; ties to
  the lower dim, as `lax.top_k`), and each row on those dims times SparQ's scale
  1 / sqrt(D * sum|q_r| / sum|q|) (`ops.approx_scale`)."""
  h = pl.program_id(1)
  qs = [q_ref[h * group + g, :].astype(jnp.float32) for g in range(group)]  # G x [D]
  ws = [jnp.abs(x) for x in qs]
  if group_dims == "normalized":
    ws = [w / jnp.maximum(jnp.sum(w), 1e-30) for w in ws]
  a = functools.reduce(jnp.add, ws)  # [D] the dims' weights
  dim = jnp.arange(d)
  before = (a[None, :] > a[:, None]) | ((a[None, :] == a[:, None]) & (dim[None, :] < dim[:, None]))
  keep = jnp.sum(before.astype(jnp.int32), axis=1) < r  # [D]: one of the top-r dims
  qr = []
  for x in qs:
    kx = jnp.where(keep, x, 0.0)
    frac = jnp.sum(jnp.abs(kx)) / jnp.maximum(jnp.sum(jnp.abs(x)), 1e-30)
    qr.append(kx * lax.rsqrt(jnp.float32(d) * jnp.where(frac > 0, frac, 1.0)))
  return qs, keep, qr


def _softmax_stats(carry, logits):
  """Running (max, sum of exp) per query head updated with one block of logits per head."""
  out = []
  for (m, l), x in zip(carry, logits):
    m_new = jnp.maximum(m, jnp.max(x))
    out.append((m_new, l * jnp.exp(m - safe_max(m_new)) + jnp.sum(jnp.exp(x - safe_max(m_new)))))
  return tuple(out)


def _group_prob(logits, stats):
  """sum over the group of softmax probabilities, from the logits and the final stats."""
  return functools.reduce(jnp.add, [jnp.exp(x - safe_max(m)) / jnp.maximum(l, 1e-30)
                                    for x, (m, l) in zip(logits, stats)])


def _scores_kernel(len_ref, q_ref, b_ref, s_ref, *, d: int, r: int, group: int,
                   chunk_size: int, num_chunks: int, block_c: int, num_blocks: int,
                   two_sided: bool, group_dims: str):
  """len [1] int32; q [Hq, D] (this sequence's queries); bounds [2D or D, NC] (this KV head)
  -> s [NCp] f32 group-summed softmax scores of the chunks, 0 for chunks with no valid slot."""
  length = len_ref[0]
  qs, keep, qr = _top_r(q_ref, d, r, group, group_dims)
  dim = jnp.arange(d)
  rows = dim
  if two_sided:  # kmax row (D + d) where the group-summed q_d > 0
    rows = dim + d * (functools.reduce(jnp.add, qs) > 0).astype(jnp.int32)
  rows = jnp.where(keep, rows, -1)

  def logits(i):
    tile = _rows(b_ref, rows, i * block_c, block_c, num_chunks).astype(jnp.float32)  # [D, bc]
    c = i * block_c + jnp.arange(block_c)
    ok = (c * chunk_size < length) & (c < num_chunks)
    return ok, [jnp.where(ok, jnp.sum(tile * x[:, None], axis=0), NEG_INF) for x in qr]

  init = tuple((jnp.float32(NEG_INF), jnp.float32(0.0)) for _ in range(group))
  stats = lax.fori_loop(0, num_blocks, lambda i, st: _softmax_stats(st, logits(i)[1]), init)

  def write(i, _):
    ok, lg = logits(i)
    s_ref[pl.ds(i * block_c, block_c)] = jnp.where(ok, _group_prob(lg, stats), 0.0)
    return 0

  lax.fori_loop(0, num_blocks, write, 0)


def _quant_scores_kernel(len_ref, q_ref, step_ref, codes_ref, s_ref, *, d: int, r: int,
                         group: int, bits: int, num_bytes: int, block_n: int, num_blocks: int,
                         group_dims: str):
  """`stage2="quant"`'s kernel 1. len [1]; q [Hq, D]; step [D] f32 grid steps; codes [D, Nb]
  uint8 (slot i: byte i % Nb, bits (i // Nb) * bits) -> s [Cp] f32 group-summed softmax of the
  slots' logits (`methods/stage2/quant.slot_logits_xla`), 0 for invalid slots, in slot order."""
  length = len_ref[0]
  _, keep, qr = _top_r(q_ref, d, r, group, group_dims)
  step = step_ref[...].astype(jnp.float32)
  qr = [x * step for x in qr]
  rows = jnp.where(keep, jnp.arange(d), -1)
  per, mask = 8 // bits, 2 ** bits - 1

  def logits(i):  # per plane j: (slots ok [block_n], G x logits [block_n])
    tile = _rows(codes_ref, rows, i * block_n, block_n, num_bytes).astype(jnp.int32)
    col = i * block_n + jnp.arange(block_n)
    out = []
    for j in range(per):
      plane = ((tile >> (j * bits)) & mask).astype(jnp.float32)  # [D, block_n]
      ok = (col < num_bytes) & (j * num_bytes + col < length)
      out.append((ok, [jnp.where(ok, jnp.sum(plane * x[:, None], axis=0), NEG_INF)
                       for x in qr]))
    return out

  def stats(i, st):
    for _, lg in logits(i):
      st = _softmax_stats(st, lg)
    return st

  init = tuple((jnp.float32(NEG_INF), jnp.float32(0.0)) for _ in range(group))
  st = lax.fori_loop(0, num_blocks, stats, init)

  def write(i, _):
    col = i * block_n + jnp.arange(block_n)
    for j, (ok, lg) in enumerate(logits(i)):
      plgpu.store(s_ref.at[pl.ds(j * num_bytes + i * block_n, block_n)],
                  jnp.where(ok, _group_prob(lg, st), 0.0), mask=col < num_bytes)
    return 0

  lax.fori_loop(0, num_blocks, write, 0)


def _select_attend_kernel(len_ref, s_ref, q_ref, k_ref, v_ref, *out_refs, top_k: int,
                          chunk_size: int, num_chunks: int, block_s: int, num_scan: int,
                          block_a: int, group: int, scale: float, qk_precision, pv_precision):
  """len [1]; s [NCp] chunk scores; q [Hq, Dp]; k, v [C, Dp] (this KV head's cache)
  -> o [Hq, Dp] (rows of this KV head's group written); optionally n [NCp] int32 slots taken
  per chunk (tests)."""
  o_ref = out_refs[0]
  length = len_ref[0]
  h = pl.program_id(1)
  cs = chunk_size

  def valid_in(c):  # valid slots of chunks c (prefix-valid cache)
    return jnp.where(c < num_chunks, jnp.clip(length - c * cs, 0, cs), 0)

  def scores(i, block):
    c = i * block + jnp.arange(block)
    return c, lax.bitcast_convert_type(s_ref[pl.ds(i * block, block)], jnp.int32)

  if num_scan == 1:  # all NCp scores held in registers: each count below is register work
    c_all, bits_all = scores(0, block_s)
    vc_all = valid_in(c_all)

    def count(pred):  # valid slots of the chunks where pred(c, bits)
      return jnp.sum(jnp.where(pred(c_all, bits_all), vc_all, 0))
  else:
    def count(pred):
      def body(i, acc):
        c, bits = scores(i, block_s)
        return acc + jnp.sum(jnp.where(pred(c, bits), valid_in(c), 0))
      return lax.fori_loop(0, num_scan, body, jnp.int32(0))

  def bisect_t(_, lohi):  # smallest t with count(bits > t) <= top_k
    lo, hi = lohi
    mid = lo + (hi - lo) // 2
    fits = count(lambda c, bits: bits > mid) <= top_k
    return jnp.where(fits, lo, mid + 1), jnp.where(fits, mid, hi)

  t, _ = lax.fori_loop(0, 32, bisect_t, (jnp.int32(-1), jnp.int32(_INF_BITS)))
  full = count(lambda c, bits: bits > t)

  def before(i):  # slots taken before chunk i of the tie group
    return full + count(lambda c, bits: (bits == t) & (c < i))

  def bisect_i(_, lohi):  # largest i in [0, NC] with before(i) <= top_k
    lo, hi = lohi
    mid = (lo + hi + 1) // 2
    fits = before(mid) <= top_k
    return jnp.where(fits, mid, lo), jnp.where(fits, hi, mid - 1)

  steps = max(1, (num_chunks + 1).bit_length())
  i_star, _ = lax.fori_loop(0, steps, bisect_i, (jnp.int32(0), jnp.int32(num_chunks)))
  partial = top_k - before(i_star)

  # [Gp, D]: the group's G query rows repeated to fill the 16-row tile; each output row is then
  # written by every copy with the same value (no masked store: interpret mode's masked scatter
  # would let a padding row's old value win over a real row)
  heads = (h * group + jnp.arange(padded_dim(group)) % group)[:, None]
  dp = q_ref.shape[1]
  cols = jnp.arange(dp)[None, :]
  q = plgpu.load(q_ref.at[heads, cols])

  def attend(i, carry):
    o, m, l = carry
    c, bits = scores(i, block_a)
    vc = valid_in(c)
    taken = jnp.where((bits > t) | ((bits == t) & (c < i_star)), vc,
                      jnp.where((bits == t) & (c == i_star), partial, 0))
    if len(out_refs) > 1:
      out_refs[1][pl.ds(i * block_a, block_a)] = taken
    for j in range(cs):  # static: slot j of each chunk of the block
      sel = j < taken
      slot = jnp.where(sel, c * cs + j, 0)[:, None]
      kb = plgpu.load(k_ref.at[slot, cols], mask=sel[:, None], other=0).astype(q.dtype)
      vb = plgpu.load(v_ref.at[slot, cols], mask=sel[:, None], other=0)
      s = plgpu.dot(q, kb, trans_b=True, precision=qk_precision) * scale  # [Gp, block_a]
      s = jnp.where(sel[None, :], s, NEG_INF)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      corr = jnp.exp(m - safe_max(m_new))
      p = jnp.exp(s - safe_max(m_new)[:, None])
      l = corr * l + jnp.sum(p, axis=1)
      o = corr[:, None] * o + plgpu.dot(p.astype(vb.dtype), vb, precision=pv_precision)
      m = m_new
    return o, m, l

  gp = q.shape[0]
  o, _, l = lax.fori_loop(
      0, cdiv(num_chunks, block_a), attend,
      (jnp.zeros((gp, dp), jnp.float32), jnp.full((gp,), NEG_INF, jnp.float32),
       jnp.zeros((gp,), jnp.float32)))
  out = (o / jnp.maximum(l, 1e-30)[:, None]).astype(o_ref.dtype)
  plgpu.store(o_ref.at[heads, cols], out)


def supported(d: int) -> bool:
  """Head dims the fused kernels take: a power of two >= 16 (whole rows are Triton tensors)."""
  return d == padded_dim(d)


def _check(q, k, v, bounds, length, chunk_size, r, top_k):
  b, hkv, c, d = check_decode_qkv(q, k, v)
  require(supported(d), f"fused decode needs a head dim that is a power of two >= 16, got {d}")
  require(isinstance(chunk_size, int) and chunk_size >= 1,
          f"chunk_size must be an int >= 1, got {chunk_size!r}")
  nc = cdiv(c, chunk_size)
  require(bounds.shape[:2] == (b, hkv) and bounds.shape[2] in (d, 2 * d)
          and bounds.shape[3] == nc,
          f"bounds must have shape [B={b}, Hkv={hkv}, 2D or D, NC={nc}], got {bounds.shape}")
  require(getattr(length, "shape", None) == (b,),
          f"length must have shape [B]={(b,)}, got {getattr(length, 'shape', None)}")
  require(isinstance(r, int) and 1 <= r <= d, f"r must be an int in [1, D={d}], got {r!r}")
  require(isinstance(top_k, int) and 1 <= top_k <= c,
          f"top_k must be an int in [1, C={c}], got {top_k!r}")


def _specs(hq: int, d: int, ncp: int):
  """BlockSpecs over grid (batch, KV head): lengths [B, 1], q / out [B, Hq, D] (one sequence's
  rows; each program reads and writes its group's), scores [B, Hkv, NCp]."""
  return (pl.BlockSpec((None, 1), lambda i, j: (i, 0)),
          pl.BlockSpec((None, hq, d), lambda i, j: (i, 0, 0)),
          pl.BlockSpec((None, None, ncp), lambda i, j: (i, j, 0)))


def _chunk_scores(q, bounds, lens, *, chunk_size, r, group_dims, block_c, interpret, params):
  """Kernel 1: q [B, Hq, D], bounds [B, Hkv, 2D or D, NC], lens [B, 1] -> [B, Hkv, NCp] f32."""
  b, hq, d = q.shape
  hkv, rows, nc = bounds.shape[1:]
  ncp = max(block_c, next_pow2(nc))
  lspec, qspec, sspec = _specs(hq, d, ncp)
  return pl.pallas_call(
      functools.partial(_scores_kernel, d=d, r=r, group=hq // hkv, chunk_size=chunk_size,
                        num_chunks=nc, block_c=block_c, num_blocks=cdiv(nc, block_c),
                        two_sided=rows == 2 * d, group_dims=group_dims),
      grid=(b, hkv),
      in_specs=[lspec, qspec, pl.BlockSpec((None, None, rows, nc), lambda i, j: (i, j, 0, 0))],
      out_specs=sspec, out_shape=jax.ShapeDtypeStruct((b, hkv, ncp), jnp.float32),
      compiler_params=params, interpret=interpret, name="rocketkv_fused_chunk_scores",
  )(lens, q, bounds)


@functools.partial(jax.jit, static_argnames=("chunk_size", "r", "top_k", "group_dims",
                                             "interpret", "block_c", "block_a", "block_s",
                                             "return_taken", "num_warps", "num_stages"))
def fused_select_attend(q: jax.Array, k: jax.Array, v: jax.Array, bounds: jax.Array,
                        length: jax.Array, *, chunk_size: int, r: int, top_k: int,
                        group_dims: str = "sum", interpret: bool = False, block_c: int = 64,
                        block_a: int = 128,
                        block_s: int = 8192,
                        return_taken: bool = False, num_warps: int = 4, num_stages: int = 2):
  """RocketKV's stage 2 and attention for one decode query: two kernels.

  Args:
    q: [B, Hq, D] decode query (post-RoPE).
    k, v: [B, Hkv, C, D] the cache (bf16 or fp32), already holding the query's own token.
    bounds: [B, Hkv, 2D, NC] chunk min rows then max rows (`KVCache.bounds`), or with
      chunk_size 1 the keys' one copy [B, Hkv, D, C]; NC = ceil(C / chunk_size).
    length: [B] int32 valid slots (slots [0, length) are valid).
    chunk_size, r, top_k, group_dims: the plan's (top_k <= C).
    interpret: Pallas interpret mode (CPU testing).
    block_c: chunks per block of the scoring kernel; block_a: chunks per block of the
      attention loop; block_s: chunk scores held in registers by the selection (8192 fp32 over
      4 warps: 64 registers a thread); more are re-read from L2 in blocks of block_s on every
      bisection step. Powers of two >= 16.
    return_taken: also return the slots taken per chunk, [B, Hkv, NC] int32 (tests).
    num_warps, num_stages: Triton launch parameters.
  Returns:
    [B, Hq, D] in q's dtype: `attend(q, cache, top_slots(approx scores))`; zeros for a sequence
    with no valid slot. With `return_taken`, (out, taken).
  """
  _check(q, k, v, bounds, length, chunk_size, r, top_k)
  for name, blk in (("block_c", block_c), ("block_a", block_a), ("block_s", block_s)):
    require(blk >= 16 and blk == next_pow2(blk), f"{name} must be a power of two >= 16, got {blk}")
  b = q.shape[0]
  nc = bounds.shape[3]
  bc = max(16, min(block_c, next_pow2(nc)))
  lens = length.astype(jnp.int32).reshape(b, 1)
  params = compiler_params(num_warps, num_stages)
  # [B, Hkv, NCp] float32, NCp = a power of two >= NC (the tail counts 0 slots)
  scores = _chunk_scores(q, bounds, lens, chunk_size=chunk_size, r=r, group_dims=group_dims,
                         block_c=bc, interpret=interpret, params=params)
  return _attend(lens, scores, q, k, v, top_k=top_k, chunk_size=chunk_size, num_chunks=nc,
                 block_a=block_a, block_s=block_s, return_taken=return_taken, interpret=interpret,
                 params=params)


def _attend(lens, scores, q, k, v, *, top_k, chunk_size, num_chunks, block_a, block_s,
            return_taken, interpret, params):
  """Kernel 2 over kernel 1's scores [B, Hkv, NCp] (NCp a power of two >= num_chunks)."""
  b, hq, d = q.shape
  hkv, c = k.shape[1], k.shape[2]
  ncp = scores.shape[2]
  ba = max(16, min(block_a, ncp))
  bs = min(ncp, block_s)
  lspec, qspec, sspec = _specs(hq, d, ncp)
  cdt = jnp.promote_types(q.dtype, k.dtype)
  kv_spec = pl.BlockSpec((None, None, c, d), lambda i, j: (i, j, 0, 0))
  out_shape = [jax.ShapeDtypeStruct((b, hq, d), q.dtype)]
  out_specs = [qspec]
  if return_taken:
    out_shape.append(jax.ShapeDtypeStruct((b, hkv, ncp), jnp.int32))
    out_specs.append(sspec)
  outs = pl.pallas_call(
      functools.partial(_select_attend_kernel, top_k=top_k, chunk_size=chunk_size,
                        num_chunks=num_chunks, block_s=bs, num_scan=ncp // bs, block_a=ba,
                        group=hq // hkv, scale=1.0 / math.sqrt(d),
                        qk_precision=dot_precision(cdt), pv_precision=dot_precision(v.dtype)),
      grid=(b, hkv), in_specs=[lspec, sspec, qspec, kv_spec, kv_spec],
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=params, interpret=interpret, name="rocketkv_fused_select_attend",
  )(lens, scores, q.astype(cdt), k, v)
  if return_taken:
    return outs[0], outs[1][..., :num_chunks]
  return outs[0]


@functools.partial(jax.jit, static_argnames=("r", "bits", "top_k", "group_dims", "interpret",
                                             "block_n", "block_a", "block_s", "return_taken",
                                             "num_warps", "num_stages"))
def fused_quant_attend(q: jax.Array, k: jax.Array, v: jax.Array, codes: jax.Array,
                       step: jax.Array, length: jax.Array, *, r: int, bits: int, top_k: int,
                       group_dims: str = "sum", interpret: bool = False, block_n: int = 64,
                       block_a: int = 128,
                       block_s: int = 8192, return_taken: bool = False, num_warps: int = 4,
                       num_stages: int = 2):
  """`stage2="quant"`'s select + attend (no mean-value fill) in two kernels: the slots' scores
  from their key codes (kernel 1 for codes), then kernel 2 with chunks of one slot.

  Args:
    q: [B, Hq, D]; k, v: [B, Hkv, C, D] the cache; codes: [B, Hkv, D, Nb] uint8 and step:
      [B, Hkv, D] float32 (`QuantState.codes`, `.step`); length: [B] valid slots.
    r, bits, top_k, group_dims: the plan's r and group_dims, the codes' bits, min(top_k, C).
    block_n: code bytes per block of kernel 1; the rest as `fused_select_attend`.
  Returns:
    [B, Hq, D] in q's dtype: `attend(q, cache, select_quant(...))`; with `return_taken`, also
    [B, Hkv, C] int32, 1 where a slot was taken.
  """
  require_rank("codes", codes, 4, "[B, Hkv, D, Nb]")
  b, hq, d = q.shape
  hkv, c = k.shape[1], k.shape[2]
  nb = codes.shape[3]
  per = 8 // bits
  require(bits in (1, 2, 4, 8) and codes.dtype == jnp.uint8 and codes.shape[:3] == (b, hkv, d)
          and c <= nb * per and step.shape == (b, hkv, d),
          f"codes [B, Hkv, D, Nb] uint8 of {bits}-bit codes for C={c} slots and step [B, Hkv, D] "
          f"disagree with q {q.shape}: codes {codes.shape} {codes.dtype}, step {step.shape}")
  _check(q, k, v, jax.ShapeDtypeStruct((b, hkv, d, c), jnp.int8), length, 1, r, top_k)
  bn = max(16, min(block_n, next_pow2(nb)))
  ncp = next_pow2(per * nb + bn)  # plane j's slots start at j * Nb; room for the last block
  lens = length.astype(jnp.int32).reshape(b, 1)
  params = compiler_params(num_warps, num_stages)
  lspec, qspec, sspec = _specs(hq, d, ncp)
  scores = pl.pallas_call(
      functools.partial(_quant_scores_kernel, d=d, r=r, group=hq // hkv, bits=bits,
                        num_bytes=nb, block_n=bn, num_blocks=cdiv(nb, bn), group_dims=group_dims),
      grid=(b, hkv),
      in_specs=[lspec, qspec, pl.BlockSpec((None, None, d), lambda i, j: (i, j, 0)),
                pl.BlockSpec((None, None, d, nb), lambda i, j: (i, j, 0, 0))],
      out_specs=sspec, out_shape=jax.ShapeDtypeStruct((b, hkv, ncp), jnp.float32),
      compiler_params=params, interpret=interpret, name="rocketkv_fused_quant_scores",
  )(lens, q, step, codes)
  return _attend(lens, scores, q, k, v, top_k=top_k, chunk_size=1, num_chunks=c,
                 block_a=block_a, block_s=block_s, return_taken=return_taken,
                 interpret=interpret, params=params)

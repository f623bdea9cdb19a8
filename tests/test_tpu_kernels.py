"""Pallas TPU (Mosaic) kernels (kernels/tpu_*.py) against the XLA path, on this CPU.

- in Pallas TPU interpret mode (simulated HBM / VMEM, DMAs and semaphores) the page-DMA sparse
  attention equals `sparse_attention_xla` within fp32 rounding, and the chunk scores equal
  `approx_bounds_scores_xla` to fp32 rounding with the same selected slots: GQA groups 1/3/4/8,
  head dims 64/128/256, bf16 / fp32, ragged lengths, a row with nothing valid, a capacity off the
  page multiple, pages of one row; the quant codes' slot logits equal `slot_logits_xla` to fp32
  rounding with the same top-k slots: code bits 1/2/4/8, GQA groups 1/3/4/8, head dims
  64/128/256, ragged lengths, byte blocks off the block size;
- `decode_step(impl="interpret_tpu")` equals impl="xla" over a few steps (paper and quant
  stage 2);
- `rocketkv.export_decode_step(..., platforms=("tpu",))` of a whole decode step (the paper's
  RocketKV and `RocketConfig.recommended`) at Llama-3.1-8B and Gemma 3 shapes carries the
  Mosaic calls (`tpu_custom_call`), traced from `jax.ShapeDtypeStruct`s.
No TPU runs here: Mosaic's own compile of the exported calls happens on a TPU only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax import kernels
from rocketkv_jax.attend import sparse_attention_xla
from rocketkv_jax.cache import valid_slots
from rocketkv_jax.methods.stage2.quant import build as quant_build
from rocketkv_jax.methods.stage2.quant import slot_logits_xla
from rocketkv_jax.ops import group_sum, masked_softmax
from rocketkv_jax.select import approx_bounds_scores_xla, top_scored_slots, top_slots

F32, BF16 = jnp.float32, jnp.bfloat16


def _normal(rng, shape, dtype):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


# (B, Hq, Hkv, C, D, K, dtype, lengths, page_size, pages_per_block)
ATTN_CASES = [
    (2, 2, 2, 40, 64, 12, F32, (40, 17), 8, 2),      # G=1, D=64, ragged
    (1, 6, 2, 50, 128, 20, BF16, (50,), 16, 1),      # G=3, C off the page multiple
    (2, 8, 2, 48, 256, 16, F32, (48, 0), 16, 2),     # G=4, D=256, a row with nothing valid
    (1, 8, 1, 24, 128, 24, BF16, (19,), 1, 8),       # G=8, pages of one row
]


@pytest.mark.parametrize("case", ATTN_CASES)
def test_sparse_attention_interpret_tpu(case):
  b, hq, hkv, c, d, k, dt, lengths, page, bp = case
  rng = np.random.default_rng(c + d)
  q, kc, vc = (_normal(rng, s, dt) for s in ((b, hq, d), (b, hkv, c, d), (b, hkv, c, d)))
  idx = np.stack([rng.permutation(c)[:k] for _ in range(b * hkv)]).reshape(b, hkv, k)
  valid = jnp.asarray(idx < np.array(lengths)[:, None, None])
  idx = jnp.asarray(idx, jnp.int32)
  out = kernels.tpu_sparse_attention(q, kc, vc, idx, valid, interpret=True, page_size=page,
                                     pages_per_block=bp)
  ref = sparse_attention_xla(q, kc, vc, idx, valid)
  assert out.shape == q.shape and out.dtype == dt
  tol = dict(rtol=1e-5, atol=1e-6) if dt == F32 else dict(rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol)
  for i, n in enumerate(lengths):
    if n == 0:  # nothing valid: zeros, as the XLA path
      assert not np.any(np.asarray(out[i], np.float32))


def test_page_table_reads_only_pages_holding_a_selected_slot():
  """Slots {3, 5, 17, 40} of C=42 in pages of 16: pages at rows 0 and 16, and the last page
  clamped to start at 26 (so it ends at C) with slot 40 as its bit 14."""
  from rocketkv_jax.kernels.tpu_sparse_attention import page_table
  idx = jnp.array([[[40, 3, 17, 5, 9]]], jnp.int32)
  valid = jnp.array([[[True, True, True, True, False]]])
  starts, bits, count = page_table(idx, valid, 42, 16, 4)
  assert count.tolist() == [[3]]
  assert starts.tolist() == [[[0, 16, 26, 0]]]
  assert bits.tolist() == [[[(1 << 3) | (1 << 5), 1 << 1, 1 << 14, 0]]]


# (B, Hq, Hkv, D, NC, chunk_size, r, dtype, block_c)
SCORE_CASES = [
    (2, 2, 2, 64, 300, 4, 16, F32, 128),       # G=1, three chunk blocks, the last shifted
    (1, 6, 2, 128, 40, 8, 24, BF16, 2048),     # G=3, one block of all NC
    (1, 8, 2, 256, 130, 16, 32, BF16, 128),    # G=4, D=256
    (2, 8, 1, 128, 70, 1, 12, F32, 2048),      # G=8, chunks of one slot (one copy of the keys)
]


@pytest.mark.parametrize("case", SCORE_CASES)
def test_approx_scores_interpret_tpu(case):
  b, hq, hkv, d, nc, cs, r, dt, bc = case
  rng = np.random.default_rng(nc + r)
  rows = d if cs == 1 else 2 * d
  q = _normal(rng, (b, hq, d), dt)
  bounds = _normal(rng, (b, hkv, rows, nc), dt)
  length = jnp.asarray(rng.integers(1, nc * cs + 1, b), jnp.int32)
  out = kernels.tpu_approx_bounds_scores(q, bounds, length, chunk_size=cs, r=r, interpret=True,
                                         block_c=bc)
  ref = approx_bounds_scores_xla(q, bounds, length, cs, r)
  # fp32 logits summed over r in another order: equal up to rounding, and the same selection
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-7)
  valid = jnp.broadcast_to((jnp.arange(nc * cs) < length[:, None])[:, None], (b, hkv, nc * cs))
  np.testing.assert_array_equal(_top(out, valid, cs), _top(ref, valid, cs))


def _top(scores, valid, chunk_size, k=8):
  """The k best valid slots by their chunk's score, sorted: what `approx_select` picks."""
  return np.sort(np.asarray(top_slots(scores, valid, chunk_size, k)), -1)


# (B, Hq, Hkv, C, D, bits, r, q dtype, lengths, block_n, group_dims)
QUANT_CASES = [
    (2, 2, 2, 300, 64, 4, 16, F32, (300, 101), 128, "sum"),      # G=1, edge block past Nb
    (1, 6, 2, 520, 128, 2, 24, BF16, (400,), 128, "sum"),        # G=3, two blocks of 128 + 2
    (2, 8, 2, 130, 256, 8, 32, F32, (130, 0), 2048, "normalized"),  # G=4, D=256, empty row
    (1, 8, 1, 1000, 128, 1, 12, F32, (999,), 128, "sum"),        # G=8, 8 planes, Nb < block
]


@functools.partial(jax.jit, static_argnums=(2, 3))
def _quant_state(k, length, bits, capacity):
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, window_size=1,
                                             stage2=rocketkv.Quant(bits=bits), capacity=capacity),
                       capacity, 0, k.shape[-1])
  return quant_build(rocketkv.full_cache(k, k, capacity, 0, length), plan)


@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: f"G{c[1] // c[2]}-D{c[4]}-b{c[5]}")
def test_quant_slot_logits_interpret_tpu(case):
  b, hq, hkv, c, d, bits, r, dt, lengths, bn, gd = case
  rng = np.random.default_rng(c + r + bits)
  q = _normal(rng, (b, hq, d), dt)
  state = _quant_state(_normal(rng, (b, hkv, c, d), F32), jnp.array(lengths, jnp.int32), bits, c)
  out = kernels.tpu_quant_slot_logits(q, state.codes, state.step, r=r, bits=bits, capacity=c,
                                      group_dims=gd, interpret=True, block_n=bn)
  ref = slot_logits_xla(q, state, r, gd)
  assert out.shape == ref.shape == (b, hkv, hq // hkv, c) and out.dtype == F32
  # fp32 sums over the r dims (the kernel's over D with exact zeros) in another order
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5,
                             atol=1e-6 * float(jnp.max(jnp.abs(ref))))
  valid = valid_slots(state.cache)
  top = lambda x: np.sort(np.asarray(top_scored_slots(
      group_sum(masked_softmax(x, valid[:, :, None])), valid, 16, c)), -1)
  np.testing.assert_array_equal(top(out), top(ref))


def test_quant_slot_logits_dispatch_interpret_tpu():
  """`quant.slot_logits(impl="interpret_tpu")` runs the TPU kernel (the XLA path would also
  match: the kernel's name in the traced program tells them apart)."""
  from rocketkv_jax.methods.stage2.quant import slot_logits
  rng = np.random.default_rng(5)
  state = _quant_state(_normal(rng, (1, 2, 64, 64), F32), jnp.array([50], jnp.int32), 4, 64)
  q = _normal(rng, (1, 4, 64), F32)
  run = functools.partial(slot_logits, r=8, impl="interpret_tpu")
  assert "rocketkv_tpu_quant_slot_logits" in str(jax.make_jaxpr(run)(q, state))
  np.testing.assert_allclose(np.asarray(run(q, state)), np.asarray(slot_logits_xla(q, state, 8)),
                             rtol=1e-5, atol=1e-5)


def _decode_inputs(stage2, dt=F32):
  rng = np.random.default_rng(3)
  b, hq, hkv, d, prompt = 2, 8, 2, 64, 96
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=32, window_size=4, stage2=stage2),
                       prompt, 4, d)
  k, v = (_normal(rng, (b, hkv, prompt, d), dt) for _ in range(2))
  qw = _normal(rng, (b, hq, 4, d), dt)
  state = rocketkv.prefill(k, v, qw, plan, lengths=jnp.array([96, 41], jnp.int32), impl="xla")
  return rng, plan, state, (b, hq, hkv, d)


@pytest.mark.parametrize("stage2", ["minmax", "quant"])
def test_decode_step_interpret_tpu_matches_xla(stage2):
  """The paper's stage 2 (chunk scores) or the quant codes (slot logits) on the TPU kernels, then
  the page-DMA attention: the same outputs as XLA over two steps, and `rocketkv.select` the same
  slots."""
  rng, plan, state, (b, hq, hkv, d) = _decode_inputs(stage2)
  states = {"xla": state, "interpret_tpu": state}
  for _ in range(2):
    q = _normal(rng, (b, hq, d), F32)
    kn, vn = (_normal(rng, (b, hkv, 1, d), F32) for _ in range(2))
    outs = {}
    for impl in states:
      outs[impl], states[impl] = rocketkv.decode_step(q, kn, vn, states[impl], plan, impl=impl)
    np.testing.assert_allclose(np.asarray(outs["interpret_tpu"]), np.asarray(outs["xla"]),
                               rtol=1e-4, atol=1e-5)
  q = _normal(rng, (b, hq, d), F32)
  sel = {impl: np.sort(np.asarray(rocketkv.select(q, states[impl], plan, impl=impl)), -1)
         for impl in states}
  np.testing.assert_array_equal(sel["interpret_tpu"], sel["xla"])


# name: (Hq, Hkv, D, sliding window of the layer or None)
MODELS = {
    "llama31_8b": (32, 8, 128, None),
    "gemma3_4b_global": (8, 4, 256, None),
    "gemma3_4b_local": (8, 4, 256, 1024),
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("config", ["paper", "recommended"])
def test_decode_step_exports_for_tpu_with_the_mosaic_kernels(model, config):
  """A whole jitted decode step at a model's shapes (bf16, 32K context, budget 2048, batch 8),
  exported for TPU from this host: each carries two TPU kernels, the paper's stage 2 its chunk
  scores and the recommended quant stage 2 its code logits, then the attention."""
  hq, hkv, d, window = MODELS[model]
  b, ctx, S = 8, 32768, jax.ShapeDtypeStruct
  cfg = (rocketkv.RocketConfig(token_budget=2048) if config == "paper"
         else rocketkv.RocketConfig.recommended(2048))
  plan = rocketkv.plan(cfg, ctx, 256, d)
  kv = S((b, hkv, ctx, d), BF16)
  qw = S((b, hq, plan.window_size, d), BF16)
  state = jax.eval_shape(functools.partial(rocketkv.prefill, plan=plan, impl="xla"), kv, kv, qw)
  q, kn = S((b, hq, d), BF16), S((b, hkv, 1, d), BF16)
  exp = rocketkv.export_decode_step(plan, q, kn, kn, state, platforms=("tpu",),
                                    sliding_window=window)
  text = exp.mlir_module()
  assert exp.platforms == ("tpu",)
  assert text.count("tpu_custom_call") == 2
  assert "__gpu$xla.gpu.triton" not in text
  assert "rocketkv_tpu_sparse_attention" in text
  assert ("rocketkv_tpu_approx_chunk_logits" in text) == (config == "paper")
  assert ("rocketkv_tpu_quant_slot_logits" in text) == (config == "recommended")


def test_bad_arguments_raise():
  z = jnp.zeros((1, 2, 8, 64), F32)
  idx = jnp.zeros((1, 2, 4), jnp.int32)
  with pytest.raises(ValueError, match="page_size"):
    kernels.tpu_sparse_attention(jnp.zeros((1, 2, 64)), z, z, idx, idx >= 0, page_size=64)
  with pytest.raises(ValueError, match="block_c"):
    kernels.tpu_approx_bounds_scores(jnp.zeros((1, 2, 64)), jnp.zeros((1, 2, 128, 8)),
                                     jnp.array([8]), chunk_size=1, r=4, block_c=100)
  codes, step = jnp.zeros((1, 2, 64, 8), jnp.uint8), jnp.ones((1, 2, 64))
  with pytest.raises(ValueError, match="block_n"):
    kernels.tpu_quant_slot_logits(jnp.zeros((1, 2, 64)), codes, step, r=4, bits=4, capacity=16,
                                  block_n=100)
  with pytest.raises(ValueError, match="bits"):
    kernels.tpu_quant_slot_logits(jnp.zeros((1, 2, 64)), codes, step, r=4, bits=3, capacity=16)

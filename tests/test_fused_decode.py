"""The fused stage-2 decode kernels (kernels/fused_decode.py, interpret mode) against the XLA
path: the same slots as `select.top_slots` over `approx_bounds_scores_xla` (ties included), the
attention output within the kernels' tolerances, on ragged batches and GQA groups 1 / 3 / 4,
chunks of 1 and 3 slots, fp32 and bf16; and `MinMax.attend` / `Quant.attend` choosing them
(rocketkv_jax/fused_step.py)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax.kernels import fused_decode
from rocketkv_jax.select import approx_select

F32, BF16 = jnp.float32, jnp.bfloat16


def _cache(seed, b, hq, hkv, d, prompt, budget, lengths, dtype, **overrides):
  rng = np.random.default_rng(seed)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=budget, window_size=4, **overrides),
                       prompt, 4, d)
  k, v = (jnp.asarray(rng.standard_normal((b, hkv, prompt, d)), dtype) for _ in range(2))
  qw = jnp.asarray(rng.standard_normal((b, hq, 4, d)), dtype)
  cache = rocketkv.prefill(k, v, qw, plan, lengths=jnp.asarray(lengths, jnp.int32), impl="xla")
  k_new, v_new = (jnp.asarray(rng.standard_normal((b, hkv, 1, d)), dtype) for _ in range(2))
  q = jnp.asarray(rng.standard_normal((b, hq, d)), dtype)
  return q, rocketkv.append(cache, k_new, v_new), plan


@functools.partial(jax.jit, static_argnames=("plan",))
def _xla(q, cache, plan):
  idx = approx_select(q, cache, plan, impl="xla")
  return rocketkv.attend(q, cache, idx, impl="xla"), idx


def _slot_sets(idx, length):
  idx, length = np.asarray(idx), np.asarray(length)
  return [[sorted(int(s) for s in row if s < length[b]) for row in idx[b]]
          for b in range(idx.shape[0])]


def _taken_sets(taken, chunk_size):
  taken = np.asarray(taken)
  return [[sorted(c * chunk_size + j for c, n in enumerate(row) for j in range(n))
           for row in taken[b]] for b in range(taken.shape[0])]


# (B, Hq, Hkv, D, prompt, budget, lengths, dtype, overrides, zero query)
CASES = [
    (3, 8, 2, 32, 96, 32, [96, 61, 9], F32, {}, False),              # G=4, chunks of 3, ragged
    (2, 3, 3, 16, 80, 16, [80, 40], F32, {"chunk_size": 1}, False),   # G=1, one-sided bounds
    (2, 6, 2, 64, 120, 48, [120, 77], BF16, {}, False),               # G=3, bf16
    (2, 8, 2, 32, 96, 32, [96, 50], F32, {"group_dims": "normalized"}, False),  # heads 1:1
    # a zero query scores every chunk the same: ties go to the lower chunks, as lax.top_k; the
    # second sequence holds fewer valid slots than top_k
    (2, 4, 2, 16, 64, 16, [64, 5], F32, {}, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"G{c[1] // c[2]}-D{c[3]}-"
                         f"{c[7].__name__}{'-ties' if c[9] else ''}"
                         f"{''.join('-' + k for k in c[8])}")
def test_fused_equals_xla(case):
  b, hq, hkv, d, prompt, budget, lengths, dtype, overrides, zero = case
  q, cache, plan = _cache(0, b, hq, hkv, d, prompt, budget, lengths, dtype, **overrides)
  if zero:
    q = jnp.zeros_like(q)
  q = _loud_heads(q, plan)
  top_k = min(plan.top_k, cache.capacity)
  out, taken = fused_decode.fused_select_attend(
      q, cache.k, cache.v, cache.bounds, cache.length, chunk_size=cache.chunk_size, r=plan.r,
      group_dims=plan.group_dims,
      # several chunk blocks; the last case re-reads the scores in blocks on every count
      top_k=top_k, interpret=True, return_taken=True, block_c=16,
      block_s=16 if case is CASES[-1] else 8192)
  ref, idx = _xla(q, cache, plan)
  sets = _taken_sets(taken, cache.chunk_size)
  assert sets == _slot_sets(idx, cache.length)
  if zero:
    assert sets[0][0] == list(range(top_k)) and sets[1][0] == list(range(lengths[1] + 1))
  if plan.group_dims != "sum":  # the rule changes the slots here, so the kernel must follow it
    assert sets != _slot_sets(_xla(q, cache, dataclasses.replace(plan, group_dims="sum"))[1],
                              cache.length)
  tol = dict(rtol=1e-4, atol=1e-5) if dtype == F32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol)


def _loud_heads(q, plan):
  """Query heads 10x apart in norm under group_dims="normalized" (where the rules part ways)."""
  if plan.group_dims == "sum":
    return q
  scale = jnp.asarray([10.0, 1.0, 0.1, 1.0] * (q.shape[1] // 4), q.dtype)
  return q * scale[None, :, None]


def _pallas_calls(fn, *args):
  text = str(jax.make_jaxpr(fn)(*args))
  return text.count("pallas_call["), ("rocketkv_fused" in text)


def test_select_attend_hook_chooses_the_fused_kernels():
  """impl="interpret" traces the two fused kernels (their numbers: test_fused_equals_xla, and
  tests/test_kernels.py's 20 decode steps); a sliding window takes the unfused chain's two
  kernels; impl="interpret_tpu" the two TPU kernels of the chain; impl="auto" the fused pair
  (CUDA) and the TPU pair; impl="xla" none."""
  q, cache, plan = _cache(3, 2, 8, 2, 32, 96, 32, [96, 70], F32)
  run = functools.partial(plan.stage2.attend, plan=plan)  # MinMax.attend
  assert _pallas_calls(functools.partial(run, impl="interpret"), q, cache) == (2, True)
  assert _pallas_calls(functools.partial(run, impl="interpret", sliding_window=50), q,
                       cache) == (2, False)
  assert _pallas_calls(functools.partial(run, impl="interpret_tpu"), q, cache) == (2, False)
  # two kernels in each of the platform_dependent branches with kernels (CUDA, TPU)
  assert _pallas_calls(functools.partial(run, impl="auto"), q, cache) == (4, True)
  assert _pallas_calls(functools.partial(run, impl="xla"), q, cache) == (0, False)


def test_bad_inputs_raise():
  b, hq, hkv, c, d = 1, 4, 2, 12, 16
  z = lambda *shape: jnp.zeros(shape, F32)
  length = jnp.array([c], jnp.int32)
  kw = dict(chunk_size=3, r=4, interpret=True)
  with pytest.raises(ValueError, match="top_k"):
    fused_decode.fused_select_attend(z(b, hq, d), z(b, hkv, c, d), z(b, hkv, c, d),
                                     z(b, hkv, 2 * d, 4), length, top_k=c + 1, **kw)
  with pytest.raises(ValueError, match="power of two"):
    fused_decode.fused_select_attend(z(b, hq, 12), z(b, hkv, c, 12), z(b, hkv, c, 12),
                                     z(b, hkv, 24, 4), length, top_k=4, **kw)


@pytest.mark.parametrize("bits, dtype, group_dims",
                         [(4, F32, "sum"), (2, BF16, "sum"), (4, F32, "normalized")])
def test_fused_quant_equals_xla(bits, dtype, group_dims):
  """stage2="quant": the slots' scores from their codes (kernel 1 for codes), kernel 2 with
  chunks of one slot; the same slots as `select_quant` (lax.top_k over the slots) and output."""
  from rocketkv_jax.methods.stage2 import quant as stage2_quant
  b, hq, hkv, d, prompt = 2, 8, 2, 32, 96
  rng = np.random.default_rng(5)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=32, window_size=4, stage2=rocketkv.Quant(
                                                 bits=bits, capacity="equal_read"),
                                             window_reduce="max", group_dims=group_dims),
                       prompt, 4, d)
  k, v = (jnp.asarray(rng.standard_normal((b, hkv, prompt, d)), dtype) for _ in range(2))
  qw = jnp.asarray(rng.standard_normal((b, hq, 4, d)), dtype)
  state = rocketkv.prefill(k, v, qw, plan, lengths=jnp.array([96, 41], jnp.int32), impl="xla")
  q = _loud_heads(jnp.asarray(rng.standard_normal((b, hq, d)), dtype), plan)
  cache = state.cache
  top_k = min(plan.top_k, cache.capacity)
  out, taken = fused_decode.fused_quant_attend(
      q, cache.k, cache.v, state.codes, state.step, cache.length, r=plan.r, bits=bits,
      top_k=top_k, group_dims=group_dims, interpret=True, return_taken=True, block_n=16)
  select = lambda p: jax.jit(functools.partial(stage2_quant.select_quant, plan=p, impl="xla"))
  idx = select(plan)(q, state)
  assert _taken_sets(taken, 1) == _slot_sets(idx, cache.length)
  if group_dims != "sum":  # the rule changes the slots here, so the kernel must follow it
    other = select(dataclasses.replace(plan, group_dims="sum"))(q, state)
    assert _slot_sets(other, cache.length) != _slot_sets(idx, cache.length)
  ref = jax.jit(functools.partial(stage2_quant.decode_attend, plan=plan, impl="xla"))(q, state)
  tol = dict(rtol=1e-4, atol=1e-5) if dtype == F32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **tol)
  assert _pallas_calls(functools.partial(plan.stage2.attend, plan=plan, impl="interpret"),
                       q, state) == (2, True)

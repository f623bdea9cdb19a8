"""The paged Pallas kernels (kernels/paged_*.py) against the paged XLA path, the contiguous cache
and their own jnp references, on this CPU.

A contiguous cache (float32, capacity NP * P) is written into a pool of pages in scrambled order
(`paged_pool._write`, the engine's write), one row given fewer pages than NP (its table's tail
points at the scratch page 0, filled with garbage), GQA groups > 1, ragged lengths, several page
sizes. Each paged kernel, in Pallas interpret mode ("interpret": the Triton kernels) and in
Pallas TPU interpret mode ("interpret_tpu": the Mosaic kernels, simulated DMAs), must give the
paged XLA path's numbers and the contiguous cache's (fp32 tolerances) and select the same slots.
Then a bf16 pool through the call sites' dispatch, `impl="pallas"` on this host (ValueError),
whole paged decode steps with `impl="interpret"` / `"interpret_tpu"` against `impl="xla"` (the
paper's RocketKV, `RocketConfig.recommended` and full KV; `decode_step` and a tiny Llama's steps
over a paged pool), and `jax.export` for CUDA and TPU of a paged step and of each kernel at
Llama-3.1-8B shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax import kernels
from rocketkv_jax.attend import paged_sparse_attention_xla, sparse_attention_xla
from rocketkv_jax.budget import Plan
from rocketkv_jax.cache import full_cache, valid_slots
from rocketkv_jax.kernels.paged_approx_scores import paged_approx_scores_reference
from rocketkv_jax.kernels.paged_quant_scores import paged_quant_logits_reference
from rocketkv_jax.kernels.paged_sparse_attention import paged_sparse_attention_reference
from rocketkv_jax.methods.stage2 import quant
from rocketkv_jax.ops import group_sum, masked_softmax
from rocketkv_jax.runtime import paged_pool
from rocketkv_jax.select import (approx_bounds_scores_xla, paged_approx_scores_xla,
                                 top_scored_slots, top_slots)

F32 = jnp.float32
TOL = dict(rtol=2e-5, atol=2e-6)

# the kernels of each interpret mode: (attention, chunk scores, code logits)
KERNELS = {
    "interpret": (kernels.paged_sparse_attention, kernels.paged_approx_bounds_scores,
                  kernels.paged_quant_slot_logits),
    "interpret_tpu": (kernels.tpu_paged_sparse_attention, kernels.tpu_paged_approx_bounds_scores,
                      kernels.tpu_paged_quant_slot_logits),
}


PREFIX = {"interpret": "paged_", "interpret_tpu": "tpu_paged_"}  # the kernels' names


def _kernel(impl, which):
  return functools.partial(KERNELS[impl][which], interpret=True)


def _normal(rng, shape):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32))


def _to_pages(state, page_size, num_pages, short_row, seed):
  """`state` (contiguous, capacity NP * P) in a pool of `num_pages` pages: rows in scrambled
  pages (page 0 never given), row `short_row` given one page fewer (its last table entry is the
  scratch page 0); page 0 then filled with garbage."""
  cache = getattr(state, "cache", state)
  b, npg = cache.length.shape[0], -(-cache.capacity // page_size)
  row = jax.tree.map(lambda x: x[:1], state)
  pool = paged_pool._empty(row, b, num_pages, page_size, npg)
  ids = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
  for i in range(b):
    given = ids[i * npg:(i + 1) * npg].copy()
    if i == short_row:
      given[-1] = num_pages  # not given: the table points at the scratch page
    one = jax.tree.map(lambda x, i=i: x[i:i + 1], state)
    pool = paged_pool._write(pool, one, i, jnp.asarray(given, jnp.int32))
  rng = np.random.default_rng(seed + 1)
  junk = lambda x: x.at[0].set(jnp.asarray(rng.standard_normal(x.shape[1:]), x.dtype)
                               if jnp.issubdtype(x.dtype, jnp.floating)
                               else jnp.asarray(rng.integers(0, 256, x.shape[1:]), x.dtype))
  pc = getattr(pool, "cache", pool)
  pc = pc.replace(k_raw=junk(pc.k_raw), v_raw=junk(pc.v_raw), bounds_raw=junk(pc.bounds_raw))
  if isinstance(pool, quant.QuantState):
    return pool.replace(cache=pc, codes=junk(pool.codes))
  return pc


# (B, Hq, Hkv, D, P, NP, chunk_size, lengths, r, K)
CASES = [
    (2, 4, 2, 32, 4, 5, 2, (20, 7), 8, 6),        # G=2, pages of 4, the short row ends early
    (3, 6, 2, 64, 8, 4, 4, (32, 25, 1), 16, 9),   # G=3, a row of one token
    (2, 8, 1, 16, 16, 3, 1, (30, 48), 6, 20),     # G=8, chunks of one slot (one copy of the keys)
]


def _cache(case, seed=0):
  b, hq, hkv, d, p, npg, cs, lengths, r, k = case
  rng = np.random.default_rng(seed)
  c = p * npg
  kk, vv = _normal(rng, (b, hkv, c, d)), _normal(rng, (b, hkv, c, d))
  flat = full_cache(kk, vv, c, cs, jnp.asarray(lengths, jnp.int32))
  # the short row is one that fits in a page fewer
  short = next(i for i, n in enumerate(lengths) if n <= c - p)
  return rng, flat, _to_pages(flat, p, b * npg + 3, short, seed)


@pytest.mark.parametrize("impl", list(KERNELS))
@pytest.mark.parametrize("case", CASES + [
    (2, 4, 2, 16, 64, 2, 4, (100, 50), 4, 40)])  # pages of 64 rows: two bitmask words (TPU)
def test_paged_sparse_attention(impl, case):
  b, hq, hkv, d, p, npg, cs, lengths, r, k = case
  rng, flat, paged = _cache(case)
  c = flat.capacity
  q = _normal(rng, (b, hq, d))
  idx = jnp.asarray(np.stack([rng.permutation(c)[:k] for _ in range(b * hkv)]).reshape(b, hkv, k),
                    jnp.int32)
  valid = idx < jnp.asarray(lengths)[:, None, None]
  out = _kernel(impl, 0)(q, paged.k_raw, paged.v_raw, paged.table, idx, valid, page_size=p)
  assert out.shape == q.shape and out.dtype == q.dtype
  np.testing.assert_allclose(out, paged_sparse_attention_xla(q, paged, idx, valid), **TOL)
  np.testing.assert_allclose(out, sparse_attention_xla(q, flat.k, flat.v, idx, valid), **TOL)
  np.testing.assert_allclose(out, paged_sparse_attention_reference(
      q, paged.k_raw, paged.v_raw, paged.table, idx, valid, p), **TOL)


def test_paged_sparse_attention_splits():
  """More selected slots than one block, and split-K partials merged (GPU kernel)."""
  case = (2, 4, 2, 32, 4, 5, 2, (20, 7), 8, 6)
  b, hq, hkv, d, p, npg, *_ = case
  rng, flat, paged = _cache(case, seed=3)
  idx = jnp.asarray(np.stack([rng.permutation(20) for _ in range(b * hkv)]).reshape(b, hkv, 20),
                    jnp.int32)
  valid = idx < flat.length[:, None, None]
  q = _normal(rng, (b, hq, d))
  out = kernels.paged_sparse_attention(q, paged.k_raw, paged.v_raw, paged.table, idx, valid,
                                       page_size=p, interpret=True, block_k=16, num_splits=2)
  np.testing.assert_allclose(out, sparse_attention_xla(q, flat.k, flat.v, idx, valid), **TOL)


def _top(scores, cache, cs, k):
  return np.sort(np.asarray(top_slots(scores, valid_slots(cache), cs, k)), -1)


@pytest.mark.parametrize("impl", list(KERNELS))
@pytest.mark.parametrize("case,group_dims", [(CASES[0], "sum"), (CASES[1], "normalized"),
                                             (CASES[2], "sum")])
def test_paged_approx_scores(impl, case, group_dims):
  b, hq, hkv, d, p, npg, cs, lengths, r, k = case
  rng, flat, paged = _cache(case, seed=1)
  q = _normal(rng, (b, hq, d))
  out = _kernel(impl, 1)(q, paged.bounds_raw, paged.table, paged.length, chunk_size=cs, r=r,
                         group_dims=group_dims)
  xla = paged_approx_scores_xla(q, paged, r, group_dims)
  flat_scores = approx_bounds_scores_xla(q, flat.bounds, flat.length, cs, r, group_dims)
  assert out.shape == xla.shape == flat_scores.shape
  np.testing.assert_allclose(out, xla, **TOL)
  np.testing.assert_allclose(out, flat_scores, **TOL)
  np.testing.assert_allclose(out, paged_approx_scores_reference(
      q, paged.bounds_raw, paged.table, paged.length, cs, r, group_dims), **TOL)
  np.testing.assert_array_equal(_top(out, flat, cs, k), _top(flat_scores, flat, cs, k))


def _quant_states(case, bits, seed=2):
  b, hq, hkv, d, p, npg, cs, lengths, r, k = case
  plan = Plan(method="rocketkv", capacity=p * npg, prompt_budget=p * npg, top_k=k, chunk_size=0,
              r=r, window_size=4, kernel_size=1, sink_size=0, head_dim=d, prompt_len=p * npg,
              max_new_tokens=1, token_budget=2 * k, stage2=quant.Quant(bits=bits))
  rng = np.random.default_rng(seed)
  c = p * npg
  kk, vv = _normal(rng, (b, hkv, c, d)), _normal(rng, (b, hkv, c, d))
  flat = quant.build(full_cache(kk, vv, c, 0, jnp.asarray(lengths, jnp.int32)), plan)
  short = next(i for i, n in enumerate(lengths) if n <= c - p)
  return rng, plan, flat, _to_pages(flat, p, b * npg + 3, short, seed)


@pytest.mark.parametrize("impl", list(KERNELS))
@pytest.mark.parametrize("case,bits", [(CASES[0], 4), (CASES[1], 1), (CASES[2], 8)])
def test_paged_quant_slot_logits(impl, case, bits):
  b, hq, hkv, d, p, npg, cs, lengths, r, k = case
  rng, plan, flat, paged = _quant_states(case, bits)
  q = _normal(rng, (b, hq, d))
  out = _kernel(impl, 2)(q, paged.codes, paged.step, paged.cache.table, r=r, bits=bits)
  valid = np.asarray(valid_slots(flat.cache))[:, :, None, :]  # scratch / padding: any logits
  for other in (quant.slot_logits_xla(q, paged, r), quant.slot_logits_xla(q, flat, r)):
    assert out.shape == other.shape
    np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, other, 0), **TOL)
  ref = paged_quant_logits_reference(q, paged.codes, paged.step, paged.cache.table, r, bits)
  np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, ref, 0), **TOL)
  ok = valid_slots(flat.cache)
  pick = lambda x: np.sort(np.asarray(top_scored_slots(
      group_sum(masked_softmax(x, ok[:, :, None, :])), ok, k, flat.cache.capacity)), -1)
  np.testing.assert_array_equal(pick(out), pick(quant.slot_logits_xla(q, flat, r)))


@pytest.mark.parametrize("impl", list(KERNELS))
def test_bf16_pool_through_dispatch(impl):
  """A bf16 pool (stored as uint16 bits on this CPU) through the call sites' dispatch: `attend`
  and `approx_scores` with `impl` give impl="xla"'s numbers to bf16 rounding, the same slots."""
  from rocketkv_jax.attend import attend
  from rocketkv_jax.select import approx_scores
  b, hq, hkv, d, p, npg, cs, lengths, r, k = CASES[1]
  rng = np.random.default_rng(7)
  c = p * npg
  kk, vv = (_normal(rng, (b, hkv, c, d)).astype(jnp.bfloat16) for _ in range(2))
  flat = full_cache(kk, vv, c, cs, jnp.asarray(lengths, jnp.int32))
  paged = _to_pages(flat, p, b * npg + 3, 1, 7)
  q = _normal(rng, (b, hq, d)).astype(jnp.bfloat16)
  idx = jnp.asarray(np.stack([rng.permutation(c)[:k] for _ in range(b * hkv)]).reshape(b, hkv, k),
                    jnp.int32)  # no slot twice (`attend`'s contract)
  np.testing.assert_allclose(np.asarray(attend(q, paged, idx, impl=impl), np.float32),
                             np.asarray(attend(q, paged, idx, impl="xla"), np.float32),
                             rtol=1e-2, atol=1e-2)
  scores = {w: approx_scores(q, paged, r, impl=w) for w in (impl, "xla")}
  np.testing.assert_allclose(scores[impl], scores["xla"], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(_top(scores[impl], flat, cs, k), _top(scores["xla"], flat, cs, k))


def test_pallas_on_cpu_is_a_value_error():
  """impl="pallas" names the compiled kernels: on this CPU host a paged read is the one-line
  ValueError, as on a contiguous cache."""
  from rocketkv_jax.attend import attend
  rng, flat, paged = _cache(CASES[0])
  q = _normal(rng, (2, 4, 32))
  with pytest.raises(ValueError, match=r"^impl='pallas' needs a platform in \('cuda', 'tpu'\)"):
    attend(q, paged, jnp.zeros((2, 2, 3), jnp.int32), impl="pallas")


# ---------------------------------------------------------------- decode steps on pages
def _paged_decode_inputs(config, page):
  rng = np.random.default_rng(4)
  b, hq, hkv, d, prompt = 2, 8, 2, 32, 96
  plan = rocketkv.plan(config, prompt, 6, d)
  k, v = (_normal(rng, (b, hkv, prompt, d)) for _ in range(2))
  qw = _normal(rng, (b, hq, plan.window_size, d))
  state = rocketkv.prefill(k, v, qw, plan, lengths=jnp.array([96, 41], jnp.int32), impl="xla")
  p = paged_pool.page_tokens(plan, page)
  return rng, plan, _to_pages(state, p, 2 * -(-plan.capacity // p) + 3, 1, 5), (b, hq, hkv, d)


DECODE_CONFIGS = {
    "rocketkv": rocketkv.RocketConfig(token_budget=32, window_size=4),
    "recommended": rocketkv.RocketConfig.recommended(32, window_size=4),
    "full": rocketkv.RocketConfig(token_budget=32, window_size=4, method="full"),
}
# the kernels each method's paged decode step runs (full KV: every slot through the attention)
STEP_KERNELS = {"rocketkv": ("sparse_attention", "approx_chunk_logits"),
                "recommended": ("sparse_attention", "quant_slot_logits"),
                "full": ("sparse_attention",)}


# each (config, impl) pair not in the model steps below
@pytest.mark.parametrize("impl,name,page", [("interpret", "recommended", 4),
                                            ("interpret_tpu", "rocketkv", 8),
                                            ("interpret", "full", 4),
                                            ("interpret_tpu", "full", 8)])
def test_paged_decode_step_matches_xla(impl, name, page):
  """Steps of `decode_step` on a paged state (stage-2 kernel, then the attention kernel; full
  KV: the attention kernel over every slot) give impl="xla"'s outputs, and `select` the same
  slots."""
  rng, plan, state, (b, hq, hkv, d) = _paged_decode_inputs(DECODE_CONFIGS[name], page)
  assert pool_of(state).paged
  q = _normal(rng, (b, hq, d))
  kn = _normal(rng, (b, hkv, 1, d))
  step = lambda *a: rocketkv.decode_step(*a, plan, impl=impl)
  assert _kernel_names(step, q, kn, kn, state) == {
      f"rocketkv_{PREFIX[impl]}{k}" for k in STEP_KERNELS[name]}
  states = {"xla": state, impl: state}
  for _ in range(2):
    q = _normal(rng, (b, hq, d))
    kn, vn = (_normal(rng, (b, hkv, 1, d)) for _ in range(2))
    outs = {}
    for which in states:
      outs[which], states[which] = rocketkv.decode_step(q, kn, vn, states[which], plan,
                                                        impl=which)
    np.testing.assert_allclose(outs[impl], outs["xla"], rtol=1e-5, atol=1e-6)
  q = _normal(rng, (b, hq, d))
  sel = {which: np.sort(np.asarray(rocketkv.select(q, states[which], plan, impl=which)), -1)
         for which in states}
  np.testing.assert_array_equal(sel[impl], sel["xla"])


def pool_of(state):
  return getattr(state, "cache", state)


def _kernel_names(fn, *args):
  """The rocketkv Pallas kernels in the jaxpr of `fn(*args)`."""
  text = str(jax.make_jaxpr(fn)(*args))
  return {w for w in text.replace("=", " ").replace(",", " ").split()
          if w.startswith("rocketkv_")}


@pytest.mark.parametrize("impl,name", [("interpret", "rocketkv"),
                                       ("interpret_tpu", "recommended"),
                                       ("interpret", "full")])
def test_paged_model_step_matches_xla(impl, name):
  """A tiny Llama's decode steps over a paged pool of three requests (as the engine: prefill,
  `paged_pool.write_request` into scrambled pages, `llama.decode_step`): impl=`impl`
  gives impl="xla"'s logits and greedy tokens, with the paged kernels in the step."""
  from model_fixtures import hf_checkpoint
  from rocketkv_jax.models import llama
  model = rocketkv.models.load(hf_checkpoint("llama31")[0])
  cfg, params = model.config, model.params
  rc = DECODE_CONFIGS[name]
  plan = rocketkv.plan(rc, 128, 8, cfg.head_dim)
  p = paged_pool.page_tokens(plan, 8)
  npg = -(-plan.capacity // p)
  rng = np.random.default_rng(6)
  lengths = (128, 70, 101)
  prefill = jax.jit(functools.partial(llama.prefill, config=cfg, plan=plan, block_size=64,
                                      impl="xla", stacked=True))  # the engine's prefill
  rows = []
  for n in lengths:
    tokens = jnp.asarray(np.pad(rng.integers(3, 256, n), (0, 128 - n))[None], jnp.int32)
    rows.append(prefill(params, tokens, jnp.asarray([n], jnp.int32))[1])
  sliding = (False,) * len(rows[0].groups)
  num_pages = len(lengths) * npg + 2
  pool = paged_pool.empty_pool(rows[0], len(lengths), num_pages, p, npg, sliding)
  ids = rng.permutation(np.arange(1, num_pages))
  for i, row in enumerate(rows):
    pool = paged_pool.write_request(pool, row, jnp.int32(i),
                                    jnp.asarray(ids[i * npg:(i + 1) * npg], jnp.int32), sliding)
  tok = jnp.asarray(rng.integers(3, 256, len(lengths)), jnp.int32)
  pos = jnp.asarray(lengths, jnp.int32)
  step = {which: jax.jit(functools.partial(llama.decode_step, config=cfg, plan=plan, impl=which))
          for which in ("xla", impl)}
  assert _kernel_names(step[impl], params, pool, tok, pos) == {
      f"rocketkv_{PREFIX[impl]}{k}" for k in STEP_KERNELS[name]}
  states = {which: pool for which in step}
  toks = {which: tok for which in step}
  for i in range(4):
    for which in step:
      logits, states[which] = step[which](params, states[which], toks[which], pos + i)
      toks[which] = jnp.argmax(logits, -1).astype(jnp.int32)
      if which == "xla":
        ref = logits
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(toks[impl], toks["xla"])


# ---------------------------------------------------------------- export for CUDA and TPU
def _triton_modules(text):
  """The Triton IR modules a CUDA export's StableHLO text embeds, each verified."""
  from jax._src.interpreters import mlir as jmlir
  from jax._src.lib import triton
  from jax._src.lib.mlir import ir
  ctx = jmlir.make_ir_context()
  triton.dialect.register_dialect(ctx)
  ctx.load_all_available_dialects()
  out = []
  with ctx:
    def walk(op):
      for region in op.regions:
        for block in region.blocks:
          for child in block.operations:
            if (child.operation.name == "stablehlo.custom_call" and ir.StringAttr(
                child.attributes["call_target_name"]).value == "__gpu$xla.gpu.triton"):
              cfg = child.attributes["mhlo.backend_config"]
              tt = ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes)
              assert tt.operation.verify()
              out.append(str(tt))
            walk(child.operation)
    walk(ir.Module.parse(text).operation)
  return out


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", ["rocketkv", "recommended", "full"])
def test_paged_step_exports(platform, name):
  """A jitted paged decode step under impl="auto", exported from this CPU host, carries the
  platform's paged kernels (for CUDA: Triton IR that verifies)."""
  rng, plan, state, (b, hq, hkv, d) = _paged_decode_inputs(DECODE_CONFIGS[name], 8)
  q = _normal(rng, (b, hq, d))
  kn = _normal(rng, (b, hkv, 1, d))
  exp = rocketkv.export_decode_step(plan, q, kn, kn, state, platforms=(platform,))
  text = exp.mlir_module()
  prefix = "paged_" if platform == "cuda" else "tpu_paged_"
  for kernel in STEP_KERNELS[name]:
    assert f"rocketkv_{prefix}{kernel}" in text
  if platform == "cuda":
    assert len(_triton_modules(text)) == len(STEP_KERNELS[name])


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernels_export_at_llama_shapes(platform):
  """Each paged kernel alone at Llama-3.1-8B shapes (Hq 32, Hkv 8, D 128, bf16), batch 8, pages
  of 16, a pool of 8K pages, 1024 pages per sequence, top_k 1024, r 81: exported for the
  platform from `jax.ShapeDtypeStruct`s (the Triton modules verify)."""
  from rocketkv_jax.export import export_function
  s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
  b, hq, hkv, d, p, npg, n, k, r = 8, 32, 8, 128, 16, 1024, 8 * 1024 + 1, 1024, 81
  q, table = s((b, hq, d), bf), s((b, npg), jnp.int32)
  kv, idx = s((n, hkv, p, d), bf), s((b, hkv, k), jnp.int32)
  pre = "" if platform == "cuda" else "tpu_"
  calls = [("paged_sparse_attention", (q, kv, kv, table, idx, s(idx.shape, jnp.bool_)),
            dict(page_size=p)),
           ("paged_approx_bounds_scores", (q, s((n, hkv, 2 * d, p // 2), bf), table,
                                           s((b,), jnp.int32)), dict(chunk_size=2, r=r)),
           ("paged_quant_slot_logits", (q, s((n, hkv, d, p // 2), jnp.uint8),
                                        s((b, hkv, d), F32), table), dict(r=r, bits=4))]
  for name, args, kw in calls:
    fn = functools.partial(getattr(kernels, pre + name), **kw)
    text = export_function(fn, *args, platforms=(platform,)).mlir_module()
    if platform == "cuda":
      assert len(_triton_modules(text)) == 1
    else:
      assert text.count("tpu_custom_call") == 1

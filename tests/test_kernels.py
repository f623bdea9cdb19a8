"""Pallas kernels (rocketkv_jax.kernels) against the XLA reference path.

- interpret mode (CPU) equals the XLA functions across GQA groups 1/3/4/8, head dims 64/128,
  bf16/fp32, ragged lengths, nearly empty and full caches, sizes off the block multiples;
- each kernel lowers for CUDA (Triton custom call) at Llama-3.1-8B and SmolLM2 shapes, and the
  embedded Triton IR module verifies, with every tt.dot dim >= 16 (the chunk-score and
  quant-score kernels have none);
- decode_step with the kernels (impl="interpret" here, "pallas" compiled on a GPU) equals
  impl="xla" over 20 rocketkv decode steps, for the paper's stage 2 and for `stage2="quant"`.
Shapes are small: the whole file runs in well under two minutes on two CPU cores.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rocketkv
import reference
from rocketkv_jax import kernels
from rocketkv_jax.attend import sparse_attention_xla as _sparse_xla
from rocketkv_jax.cache import chunk_summaries
from rocketkv_jax.evict import window_scores_xla as _window_xla
from rocketkv_jax.select import approx_chunk_scores_xla as _approx_xla
from rocketkv_jax.methods.stage2.quant import build as quant_build
from rocketkv_jax.methods.stage2.quant import slot_logits_xla

# Module-scope jitted references: one compilation per shape instead of op-by-op dispatch.
sparse_attention_xla = jax.jit(_sparse_xla)
window_scores_xla = jax.jit(_window_xla, static_argnums=3)
approx_chunk_scores_xla = jax.jit(_approx_xla, static_argnums=(4, 5, 6))

F32, BF16 = jnp.float32, jnp.bfloat16
# The kernels end to end: compiled on a GPU (benchmarks/gpu_session.sh), interpret mode elsewhere.
KERNELS = "pallas" if jax.default_backend() == "gpu" else "interpret"


def _rng(seed):
  return np.random.default_rng(seed)


def _normal(rng, shape, dtype, scale=1.0):
  """Host-side random data (numpy): no per-shape RNG compilation."""
  return jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)


def _perm_rows(rng, shape, c, kk):
  """[*shape, kk] int32: distinct slots per row."""
  rows = [rng.permutation(c)[:kk] for _ in range(int(np.prod(shape)))]
  return jnp.asarray(np.stack(rows).reshape(*shape, kk).astype(np.int32))


def _close(out, ref, dtype, scale=1.0):
  """fp32: near bit-exact; bf16 inputs: computed in fp32 too, but outputs may be bf16."""
  out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  assert out.shape == ref.shape and np.all(np.isfinite(out))
  if dtype == F32:
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6 * scale)
  else:
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * scale)


# ---------------------------------------------------------------- sparse attention
# (B, Hq, Hkv, C, D, K, q dtype, cache dtype, valid pattern, kwargs)
SPARSE_CASES = [
    (2, 4, 4, 40, 64, 20, F32, F32, "random", {}),                 # G=1, K off the block
    (2, 8, 2, 96, 128, 40, BF16, BF16, "ragged", {}),              # G=4, split-K merge
    (1, 8, 1, 200, 64, 128, BF16, BF16, "first", {}),              # G=8, nearly empty
    (2, 6, 2, 70, 128, 50, F32, BF16, "ragged", {"num_splits": 1}),  # G=3, fp32 q, bf16 cache
    (2, 8, 2, 48, 64, 48, F32, F32, "full/none", {"block_k": 16}),  # K = C: full / no slot
]


@pytest.mark.parametrize("case", SPARSE_CASES, ids=lambda c: f"G{c[1] // c[2]}-D{c[4]}-K{c[5]}")
def test_sparse_attention_interpret(case):
  b, hq, hkv, c, d, kk, qdt, kdt, pattern, kw = case
  rng = _rng(kk + c)
  q = _normal(rng, (b, hq, d), qdt)
  k = _normal(rng, (b, hkv, c, d), kdt, 2.0)
  v = _normal(rng, (b, hkv, c, d), kdt)
  idx = _perm_rows(rng, (b, hkv), c, kk)
  if pattern == "random":
    valid = rng.random((b, hkv, kk)) < 0.6
  elif pattern == "ragged":  # sequence b holds `length[b]` slots
    valid = np.asarray(idx) < np.array([c, 5][:b])[:, None, None]
  elif pattern == "first":
    valid = np.zeros((b, hkv, kk), bool)
    valid[:, :, 0] = True
  elif pattern == "full/none":  # sequence 0 attends to its whole cache, sequence 1 to nothing
    valid = np.ones((b, hkv, kk), bool)
    valid[1] = False
  valid = jnp.asarray(valid)
  out = kernels.sparse_attention(q, k, v, idx, valid, interpret=True, **kw)
  ref = sparse_attention_xla(q, k, v, idx, valid)
  assert out.dtype == q.dtype
  _close(out, ref, kdt)
  if pattern == "full/none":
    assert not np.any(np.asarray(out[1], np.float32))


# ---------------------------------------------------------------- approx chunk scores
_summaries = jax.jit(chunk_summaries, static_argnums=2)

# (B, Hq, Hkv, C, D, chunk_size, r, dtype, lengths, kwargs)
APPROX_CASES = [
    (2, 4, 4, 50, 64, 3, 20, F32, (50, 1), {}),                      # G=1, full / nearly empty
    (2, 8, 2, 150, 128, 2, 61, BF16, (97, 150), {"block_c": 16}),   # G=4, NC off the block
    (2, 8, 2, 60, 64, 3, 9, F32, (60, 31), {"group_dims": "normalized"}),  # G=4, heads weighed 1:1
    (1, 16, 2, 40, 64, 1, 64, F32, (0,), {}),                        # G=8, empty cache, r = D
    (2, 6, 2, 70, 128, 4, 1, BF16, (3, 70), {}),                     # G=3, r = 1
]


@pytest.mark.parametrize("case", APPROX_CASES, ids=lambda c: f"G{c[1] // c[2]}-D{c[4]}-cs{c[5]}")
def test_approx_chunk_scores_interpret(case):
  b, hq, hkv, c, d, cs, r, dt, lengths, kw = case
  rng = _rng(c + r)
  q = _normal(rng, (b, hq, d), dt)
  k = _normal(rng, (b, hkv, c, d), dt)
  length = jnp.array(lengths, jnp.int32)
  kmin, kmax = _summaries(k, length, cs)
  out = kernels.approx_chunk_scores(q, kmin, kmax, length, chunk_size=cs, r=r, interpret=True,
                                    **kw)
  ref = approx_chunk_scores_xla(q, kmin, kmax, length, cs, r, kw.get("group_dims", "sum"))
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-6)
  if "group_dims" in kw:  # the rule changes the scores here, so the kernel must follow it
    other = approx_chunk_scores_xla(q, kmin, kmax, length, cs, r, "sum")
    assert np.abs(np.asarray(other) - np.asarray(ref)).max() > 1e-3
  nvalid = -(-np.asarray(length) // cs)
  for i in range(b):  # each query head's softmax sums to 1 over valid chunks
    np.testing.assert_allclose(np.asarray(out[i]).sum(-1), (hq // hkv) * (nvalid[i] > 0),
                               rtol=1e-5)
    assert not np.any(np.asarray(out[i, :, nvalid[i]:]))


# ---------------------------------------------------------------- window scores
# (B, Hq, Hkv, L, W, D, dtype, lengths, kwargs)
WINDOW_CASES = [
    (2, 2, 2, 100, 8, 64, F32, (100, 9), {}),                                # G=1
    (2, 8, 2, 300, 16, 128, BF16, (300, 177), {"block_l": 32}),              # G=4, L splits
    (1, 16, 2, 90, 32, 64, F32, (90,), {"block_m": 64, "num_splits": 2}),    # G=8, row blocks
    (2, 6, 2, 70, 16, 128, BF16, (70, 10), {"block_m": 16}),                 # G=3, len < W
]


@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"G{c[1] // c[2]}-D{c[5]}-L{c[3]}")
def test_window_scores_interpret(case):
  b, hq, hkv, l, w, d, dt, lengths, kw = case
  rng = _rng(l + w)
  q = _normal(rng, (b, hq, w, d), dt)
  k = _normal(rng, (b, hkv, l, d), dt)
  lengths = jnp.array(lengths, jnp.int32)
  g = hq // hkv
  for reduce, atol in (("sum", 1e-5 * g * w), ("max", 1e-5)):
    out = kernels.window_scores(q, k, lengths, reduce=reduce, interpret=True, **kw)
    ref = window_scores_xla(q, k, lengths, reduce)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=atol)
    for i in range(b):
      assert not np.any(np.asarray(out[i, :, int(lengths[i]):]))
  # the two reductions differ (the max is below the sum wherever more than one row sees a key)
  assert np.any(np.asarray(out) < np.asarray(window_scores_xla(q, k, lengths, "sum")) - 1e-3)


# ---------------------------------------------------------------- quant slot logits
# (B, Hq, Hkv, C, D, bits, r, dtype, lengths, kwargs)
QUANT_CASES = [
    (2, 4, 4, 63, 64, 4, 20, F32, (63, 1), {}),                      # G=1, partial last byte
    (2, 8, 2, 150, 128, 2, 61, BF16, (97, 150), {"block_n": 16}),   # G=4, bytes off the block
    (2, 8, 2, 50, 64, 4, 9, F32, (50, 17), {"group_dims": "normalized"}),  # G=4, heads 1:1
    (1, 16, 2, 40, 64, 8, 64, F32, (0,), {}),                        # G=8, empty cache, r = D
    (2, 6, 2, 70, 128, 1, 1, BF16, (3, 70), {}),                     # G=3, r = 1, 8 planes
]


@functools.partial(jax.jit, static_argnums=(2, 3))
def _quant_state(k, length, bits, capacity):
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, window_size=1,
                                             stage2=rocketkv.Quant(bits=bits), capacity=capacity),
                       capacity, 0, k.shape[-1])
  return quant_build(rocketkv.full_cache(k, k, capacity, 0, length), plan)


@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: f"G{c[1] // c[2]}-D{c[4]}-b{c[5]}")
def test_quant_slot_logits_interpret(case):
  b, hq, hkv, c, d, bits, r, dt, lengths, kw = case
  rng = _rng(c + r + bits)
  q = _normal(rng, (b, hq, d), dt)
  state = _quant_state(_normal(rng, (b, hkv, c, d), dt), jnp.array(lengths, jnp.int32), bits, c)
  out = kernels.quant_slot_logits(q, state.codes, state.step, r=r, bits=bits, capacity=c,
                                  interpret=True, **kw)
  assert out.shape == (b, hkv, hq // hkv, c) and out.dtype == jnp.float32
  # float64 from the definition: per slot, sum over the r dims of q_d * scale * step_d * code.
  qg = np.asarray(q, np.float64).reshape(b, hkv, hq // hkv, d)
  codes = np.asarray(state.codes).astype(np.int64)
  nb, per = codes.shape[-1], 8 // bits
  slot = np.arange(c)
  code = (codes[..., slot % nb] >> ((slot // nb) * bits)) & (2 ** bits - 1)  # [B, Hkv, D, C]
  gd = kw.get("group_dims", "sum")
  for i in range(b):
    for h in range(hkv):
      absq = np.abs(qg[i, h])  # [G, D]
      dims = np.argsort(-reference.dim_weights(absq, gd), kind="stable")[:r]  # ops.GROUP_DIMS
      scale = 1 / np.sqrt(d * absq[:, dims].sum(1) / absq.sum(1))  # per query head (SparQ)
      step = np.asarray(state.step[i, h], np.float64)[dims]
      want = (qg[i, h][:, dims] * scale[:, None] * step) @ code[i, h, dims]  # [G, C]
      np.testing.assert_allclose(np.asarray(out[i, h]), want, rtol=1e-4,
                                 atol=1e-5 * np.abs(want).max(initial=1))
  # and the XLA path it stands in for, on the same state
  ref = jax.jit(slot_logits_xla, static_argnums=(2, 3))(q, state, r, gd)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
  if gd != "sum":  # the rule changes the logits here, so the kernel must follow it
    other = jax.jit(slot_logits_xla, static_argnums=(2, 3))(q, state, r, "sum")
    assert np.abs(np.asarray(other) - np.asarray(ref)).max() > 1e-3


def test_bad_shapes_raise():
  q = jnp.zeros((1, 6, 64))
  k = jnp.zeros((1, 4, 16, 64))
  idx = jnp.zeros((1, 4, 8), jnp.int32)
  with pytest.raises(ValueError, match="multiple of the KV heads"):
    kernels.sparse_attention(q, k, k, idx, idx > 0, interpret=True)
  with pytest.raises(ValueError, match="block_k"):
    kernels.sparse_attention(jnp.zeros((1, 8, 64)), k, k, idx, idx > 0, block_k=24)
  with pytest.raises(ValueError, match="r must be"):
    kernels.approx_chunk_scores(jnp.zeros((1, 8, 64)), k, k, jnp.zeros((1,), jnp.int32),
                                chunk_size=2, r=65)
  with pytest.raises(ValueError, match="window"):
    kernels.window_scores(jnp.zeros((1, 8, 17, 64)), k, jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match=r"^reduce must be one of \['sum', 'max'\], got 'mean'"):
    kernels.window_scores(jnp.zeros((1, 8, 4, 64)), k, jnp.zeros((1,), jnp.int32), reduce="mean")


# ---------------------------------------------------------------- CUDA lowering
_TRITON = "__gpu$xla.gpu.triton"


def _export_cuda(f, *args):
  """Exports `f` for CUDA on this CPU host; returns the Triton IR modules it embeds (verified)."""
  from jax._src.interpreters import mlir as jmlir
  from jax._src.lib import triton
  from jax._src.lib.mlir import ir

  exp = jax.export.export(jax.jit(f), platforms=["cuda"],
                          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON)])(
                              *args)
  ctx = jmlir.make_ir_context()
  triton.dialect.register_dialect(ctx)
  ctx.load_all_available_dialects()
  modules = []
  with ctx:
    module = ir.Module.parse(exp.mlir_module())

    def walk(op):
      for region in op.regions:
        for block in region.blocks:
          for child in block.operations:
            if (child.operation.name == "stablehlo.custom_call"
                and ir.StringAttr(child.attributes["call_target_name"]).value == _TRITON):
              cfg = child.attributes["mhlo.backend_config"]
              tt_module = ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes)
              assert tt_module.operation.verify()
              modules.append(str(tt_module))
            walk(child.operation)

    walk(module.operation)
  return modules


def _dot_dims(tt_text):
  """All operand/result dims of the tt.dot ops in a Triton module's text."""
  dims = []
  for line in tt_text.splitlines():
    if "tt.dot" in line:
      for shape in re.findall(r"tensor<([0-9x]+)x[a-z]", line.split(":", 1)[1]):
        dims += [int(x) for x in shape.split("x")]
  return dims


# name, (Hq, Hkv, D), batch
MODELS = [("llama3.1-8b", (32, 8, 128), 1), ("smollm2", (9, 3, 64), 2)]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m[0])
def test_kernels_lower_for_cuda(model):
  _, (hq, hkv, d), b = model
  s = jax.ShapeDtypeStruct
  capacity, chunk, r = 1618, 3, 61  # the paper's 32K-prompt, budget-256 split
  nc = -(-capacity // chunk)
  exports = {
      "approx": _export_cuda(
          functools.partial(kernels.approx_chunk_scores, chunk_size=chunk, r=r),
          s((b, hq, d), BF16), s((b, hkv, nc, d), BF16), s((b, hkv, nc, d), BF16),
          s((b,), jnp.int32)),
      "quant": _export_cuda(  # stage2="quant", 4-bit codes of the same 1618 slots
          functools.partial(kernels.quant_slot_logits, r=r, bits=4, capacity=capacity),
          s((b, hq, d), BF16), s((b, hkv, d, capacity // 2), jnp.uint8),
          s((b, hkv, d), jnp.float32)),
  }
  for top_k in (128, 2048):
    kv = s((b, hkv, capacity if top_k < capacity else 4 * top_k, d), BF16)
    exports[f"sparse{top_k}"] = _export_cuda(
        kernels.sparse_attention, s((b, hq, d), BF16), kv, kv, s((b, hkv, top_k), jnp.int32),
        s((b, hkv, top_k), jnp.bool_))
  for length in (32768, 131072):
    exports[f"window{length}"] = _export_cuda(
        kernels.window_scores, s((b, hq, 32, d), BF16), s((b, hkv, length, d), BF16),
        s((b,), jnp.int32))
  exports["window32768_max"] = _export_cuda(  # RocketConfig(window_reduce="max")
      functools.partial(kernels.window_scores, reduce="max"), s((b, hq, 32, d), BF16),
      s((b, hkv, 32768, d), BF16), s((b,), jnp.int32))
  for name, mods in exports.items():
    assert len(mods) == (2 if name.startswith("window") else 1), name
    for text in mods:
      dims = _dot_dims(text)
      if name in ("approx", "quant"):  # fp32 elementwise products over gathered rows: no tt.dot
        assert not dims and "tt.load" in text, (name, dims)
      else:
        assert dims and min(dims) >= 16, (name, dims)


# ---------------------------------------------------------------- decode_step end to end
@functools.partial(jax.jit, static_argnames=("plan", "impl"))
def _step(q, k_new, v_new, cache, plan, impl):
  return rocketkv.decode_step(q, k_new, v_new, cache, plan, impl=impl)


@functools.partial(jax.jit, static_argnames=("plan", "impl"))
def _prefill(k, v, q_window, lengths, plan, impl):
  return rocketkv.prefill(k, v, q_window, plan, lengths=lengths, impl=impl)


@pytest.mark.parametrize("stage2", ["minmax", "quant"])
def test_decode_step_pallas_matches_xla(stage2):
  b, hq, hkv, d, prompt, new = 2, 8, 2, 64, 200, 20
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, stage2=stage2), prompt, new, d)
  assert plan.prompt_budget < prompt and plan.top_k < plan.capacity  # both stages active
  rng = _rng(7)
  k = _normal(rng, (b, hkv, prompt, d), F32)
  v = _normal(rng, (b, hkv, prompt, d), F32)
  qw = _normal(rng, (b, hq, plan.window_size, d), F32)
  lengths = jnp.array([prompt, 150], jnp.int32)
  caches = {impl: _prefill(k, v, qw, lengths, plan, impl) for impl in ("xla", KERNELS)}
  compiled = _step._cache_size()
  view = (lambda st: st) if stage2 == "minmax" else (lambda st: st.cache)
  # the same tokens kept
  np.testing.assert_array_equal(view(caches["xla"]).pos, view(caches[KERNELS]).pos)
  for step in range(new):
    q = _normal(rng, (b, hq, d), F32)
    k_new = _normal(rng, (b, hkv, 1, d), F32)
    v_new = _normal(rng, (b, hkv, 1, d), F32)
    outs = {}
    for impl in ("xla", KERNELS):
      outs[impl], caches[impl] = _step(q, k_new, v_new, caches[impl], plan, impl)
    np.testing.assert_allclose(np.asarray(outs[KERNELS]), np.asarray(outs["xla"]),
                               rtol=1e-4, atol=1e-5, err_msg=f"step {step}")
  assert _step._cache_size() == compiled + 2  # one compilation per impl, none per step


def test_generate_with_pallas_kernels_matches_xla():
  """The kernels (`KERNELS`) inside the generate loop: the same tokens as XLA."""
  import rocketkv_jax.models as M
  from model_fixtures import hf_checkpoint, random_tokens

  path, _ = hf_checkpoint("llama31")
  model = M.load(path)
  toks = random_tokens(2, 40, seed=5)
  prompts = [toks[0].tolist(), toks[1, :27].tolist()]
  cfg = rocketkv.RocketConfig(token_budget=16, window_size=8, kernel_size=7)
  runs = [rocketkv.generate(model, prompts, rocket_config=cfg, max_new_tokens=8,
                            eos_token_ids=(), impl=impl) for impl in ("xla", KERNELS)]
  assert runs[0].stats["kv_tokens_kept"] < 40  # stage 1 really evicted
  assert runs[0].tokens == runs[1].tokens

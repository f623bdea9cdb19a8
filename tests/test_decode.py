"""decode_step / attend / append / multi-turn against float64 references."""

import numpy as np
import jax
import jax.numpy as jnp
import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax.cache import valid_slots
import reference as ref
from xla_env import as_users_compile

D, HKV, G = 16, 2, 4
HQ = HKV * G


def _data(seed, b, l, steps, dtype=np.float32):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((b, HKV, l + steps, D)).astype(dtype)
  v = rng.standard_normal((b, HKV, l + steps, D)).astype(dtype)
  q = rng.standard_normal((b, HQ, l + steps, D)).astype(dtype)
  return k, v, q


_STEP = jax.jit(rocketkv.decode_step, static_argnums=4, static_argnames=("sliding_window",))


def _run(plan, k, v, q, l, steps, lengths=None, dtype=jnp.float32, sliding_window=None):
  """Prefill on the first l tokens of each sequence, then decode `steps` tokens."""
  b = k.shape[0]
  lengths = np.full((b,), l, np.int32) if lengths is None else np.asarray(lengths, np.int32)
  w = min(plan.window_size, l)
  qw = np.stack([q[i, :, lengths[i] - w:lengths[i]] for i in range(b)])
  kp = np.stack([np.concatenate([k[i, :, :lengths[i]], np.zeros_like(k[i, :, lengths[i]:l])],
                                axis=1) for i in range(b)])
  vp = np.stack([np.concatenate([v[i, :, :lengths[i]], np.zeros_like(v[i, :, lengths[i]:l])],
                                axis=1) for i in range(b)])
  state = rocketkv.prefill(jnp.asarray(kp[:, :, :l], dtype), jnp.asarray(vp[:, :, :l], dtype),
                           jnp.asarray(qw, dtype), plan, lengths=jnp.asarray(lengths))
  outs = []
  for t in range(steps):
    p = lengths + t  # absolute position of this token, per sequence
    kn = np.stack([k[i, :, p[i]:p[i] + 1] for i in range(b)])
    vn = np.stack([v[i, :, p[i]:p[i] + 1] for i in range(b)])
    qn = np.stack([q[i, :, p[i]] for i in range(b)])
    out, state = _STEP(jnp.asarray(qn, dtype), jnp.asarray(kn, dtype), jnp.asarray(vn, dtype),
                       state, plan, sliding_window=sliding_window)
    outs.append(np.asarray(out, np.float32))
  return np.stack(outs, 1), state  # [B, steps, Hq, D]


def _full_reference(k, v, q, lengths, steps, sliding_window=None):
  b = k.shape[0]
  out = np.zeros((b, steps, HQ, D))
  for i in range(b):
    for t in range(steps):
      p = lengths[i] + t
      kk = np.concatenate([k[i, :, :lengths[i]], k[i, :, lengths[i]:p + 1]], axis=1)
      vv = np.concatenate([v[i, :, :lengths[i]], v[i, :, lengths[i]:p + 1]], axis=1)
      lo = 0 if sliding_window is None else max(0, p - sliding_window + 1)
      slots = [np.arange(lo, p + 1)] * HKV
      out[i, t] = ref.attention(q[i, :, p], kk, vv, slots)
  return out


def _keep_all_plan(l, steps, **kw):
  cfg = rocketkv.RocketConfig(token_budget=8, window_size=4, prompt_budget=l,
                              top_k=l + steps, chunk_size=3, r=5, **kw)
  return rocketkv.plan(cfg, l, steps, D)


def test_keep_everything_equals_full_attention():
  l, steps = 40, 30
  k, v, q = _data(0, 2, l, steps)
  plan = _keep_all_plan(l, steps)
  got, state = _run(plan, k, v, q, l, steps)
  np.testing.assert_allclose(got, _full_reference(k, v, q, [l, l], steps), atol=1e-5, rtol=1e-5)
  # Summaries equal min/max recomputed from scratch after all those appends.
  for b in range(2):
    kmin, kmax = ref.chunk_bounds(np.asarray(state.k[b]), int(state.length[b]), 3)
    np.testing.assert_array_equal(np.asarray(state.kmin[b]), kmin)
    np.testing.assert_array_equal(np.asarray(state.kmax[b]), kmax)
  assert np.asarray(state.length).tolist() == [l + steps] * 2
  np.testing.assert_array_equal(np.asarray(state.pos[0, 0]), np.arange(l + steps))


@pytest.mark.parametrize("method", ["full", "snapkv"])
def test_dense_methods_equal_attention_over_kept(method):
  l, steps = 48, 5
  k, v, q = _data(1, 1, l, steps)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=16, window_size=4, method=method),
                       l, steps, D)
  got, state = _run(plan, k, v, q, l, steps)
  pos = np.asarray(state.pos[0])
  for t in range(steps):
    p = l + t
    slots = [pos[h][(pos[h] >= 0) & (pos[h] <= p)] for h in range(HKV)]
    want = ref.attention(q[0, :, p], k[0], v[0], slots)
    np.testing.assert_allclose(got[0, t], want, atol=1e-5, rtol=1e-5)
  if method == "snapkv":
    assert int(state.length[0]) == 16 + steps


@pytest.mark.parametrize("method", ["rocketkv", "quest", "sparq", "exact_topk", "streamingllm"])
def test_sparse_methods_attend_to_selected_slots(method):
  """decode_step == exact attention over the slots `select` picks after `append`."""
  l = 64
  k, v, q = _data(2, 2, l, 1)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=16, window_size=4, method=method,
                                             page_size=4), l, 1, D)
  lengths = np.array([64, 37], np.int32)
  kp = k.copy()
  kp[1, :, 37:] = 0
  state = rocketkv.prefill(jnp.asarray(kp[:, :, :l]), jnp.asarray(v[:, :, :l]),
                           jnp.asarray(q[:, :, l - 4:l]), plan, lengths=jnp.asarray(lengths),
                           layer=2)  # not one of Quest's dense layers (0, 1)
  kn = np.stack([k[i, :, lengths[i]:lengths[i] + 1] for i in range(2)])
  vn = np.stack([v[i, :, lengths[i]:lengths[i] + 1] for i in range(2)])
  qn = np.stack([q[i, :, lengths[i]] for i in range(2)])
  out, new = rocketkv.decode_step(jnp.asarray(qn), jnp.asarray(kn), jnp.asarray(vn), state, plan,
                                  layer=2)
  idx = np.asarray(rocketkv.select(jnp.asarray(qn), new, plan))
  assert idx.shape[-1] == plan.top_k
  for i in range(2):
    n = int(new.length[i])
    slots = [np.unique(idx[i, h][idx[i, h] < n]) for h in range(HKV)]
    assert all(len(s) == min(plan.top_k, n) for s in slots)
    want = ref.attention(qn[i], np.asarray(new.k[i]), np.asarray(new.v[i]), slots)
    np.testing.assert_allclose(np.asarray(out[i]), want, atol=1e-5, rtol=1e-5)


def test_ragged_batch_equals_each_sequence_alone():
  l, steps = 72, 12
  k, v, q = _data(3, 3, l, steps)
  lengths = [72, 50, 33]
  cfg = rocketkv.RocketConfig(token_budget=24, window_size=8, kernel_size=7)
  plan = rocketkv.plan(cfg, l, steps, D)
  got, _ = _run(plan, k, v, q, l, steps, lengths=lengths)
  for i, n in enumerate(lengths):
    alone_plan = plan  # same static split: a padded batch shares one plan
    one, _ = _run(alone_plan, k[i:i + 1, :, :n + steps], v[i:i + 1, :, :n + steps],
                  q[i:i + 1, :, :n + steps], n, steps)
    np.testing.assert_allclose(got[i], one[0], atol=1e-5, rtol=1e-5)


def test_bf16_cache_within_tolerance_of_fp64():
  """bf16 caches: attend over the same slots within 3e-2 (abs) of the float64 reference."""
  l, steps = 40, 6
  k, v, q = _data(4, 1, l, steps)
  plan = _keep_all_plan(l, steps)
  got, _ = _run(plan, k, v, q, l, steps, dtype=jnp.bfloat16)
  want = _full_reference(k, v, q, [l], steps)
  assert np.max(np.abs(got - want)) < 3e-2


def test_bf16_bit_storage_equals_plain_storage(monkeypatch):
  """CPU stores 16-bit caches as uint16 bits (cache.py); plain bf16 storage (the GPU layout)
  decodes to the same outputs and the same cache contents."""
  from rocketkv_jax import cache as cache_mod
  l, steps = 60, 5
  k, v, q = _data(7, 2, l, steps)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=24, window_size=8), l, steps, D)
  runs = {}
  for bits in (True, False):
    monkeypatch.setattr(cache_mod, "STORE_16BIT_AS_BITS", bits)
    jax.clear_caches()  # the storage policy is read at trace time
    out, state = _run(plan, k, v, q, l, steps, lengths=[l, l - 9], dtype=jnp.bfloat16)
    assert state.k_raw.dtype == (jnp.uint16 if bits else jnp.bfloat16)
    assert state.k.dtype == state.kmin.dtype == jnp.bfloat16
    runs[bits] = out, state
  np.testing.assert_array_equal(runs[True][0], runs[False][0])
  for name in ("k", "v", "kmin", "kmax"):
    np.testing.assert_array_equal(np.asarray(getattr(runs[True][1], name), np.float32),
                                  np.asarray(getattr(runs[False][1], name), np.float32))


@pytest.mark.parametrize("method", ["full", "rocketkv"])
def test_sliding_window(method):
  l, steps, sw = 30, 8, 12
  k, v, q = _data(5, 1, l, steps)
  plan = _keep_all_plan(l, steps) if method == "rocketkv" else rocketkv.plan(
      rocketkv.RocketConfig(token_budget=8, method="full"), l, steps, D)
  got, _ = _run(plan, k, v, q, l, steps, sliding_window=sw)
  np.testing.assert_allclose(got, _full_reference(k, v, q, [l], steps, sw), atol=1e-5)


def test_decode_compiles_once_over_50_steps():
  l, steps = 64, 50
  k, v, q = _data(6, 2, l, steps)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=16, window_size=4), l, steps, D)
  traces = []

  def step(q, kn, vn, cache):
    traces.append(1)
    return rocketkv.decode_step(q, kn, vn, cache, plan)

  f = jax.jit(step, donate_argnums=3)
  cache = rocketkv.prefill(jnp.asarray(k[:, :, :l]), jnp.asarray(v[:, :, :l]),
                           jnp.asarray(q[:, :, l - 4:l]), plan)
  for t in range(steps):
    _, cache = f(jnp.asarray(q[:, :, l + t]), jnp.asarray(k[:, :, l + t:l + t + 1]),
                 jnp.asarray(v[:, :, l + t:l + t + 1]), cache)
  assert len(traces) == 1 and f._cache_size() == 1
  assert np.asarray(cache.length).tolist() == [plan.capacity] * 2


def test_full_cache_overwrites_last_slot_and_flags_overflow():
  cache = rocketkv.empty_cache(2, 1, 3, 4, jnp.float32, chunk_size=2)
  one = jnp.ones((2, 1, 1, 4))
  for i in range(3):
    cache = rocketkv.append(cache, one * (i + 1), one)
  assert not bool(rocketkv.cache_overflow(cache).any())
  before = np.asarray(cache.k)
  cache = rocketkv.append(cache, one * 99, one)
  after = np.asarray(cache.k)
  assert after.shape == before.shape  # never out of bounds
  np.testing.assert_array_equal(after[:, :, :2], before[:, :, :2])
  np.testing.assert_array_equal(after[:, :, 2], np.full((2, 1, 4), 99.0))
  assert np.asarray(cache.length).tolist() == [3, 3]
  assert np.asarray(cache.pos[:, 0, 2]).tolist() == [3, 3]
  assert np.asarray(rocketkv.cache_overflow(cache)).tolist() == [True, True]
  np.testing.assert_array_equal(np.asarray(cache.kmax[0, 0]), [[2] * 4, [99] * 4])
  np.testing.assert_array_equal(np.asarray(cache.kmin[0, 0]), [[1] * 4, [99] * 4])


def test_multi_turn_reevicts_from_full_cache():
  l1, t2, steps = 60, 20, 4
  k, v, q = _data(7, 1, l1 + steps + t2, 1)
  cfg = rocketkv.RocketConfig(token_budget=16, window_size=4, kernel_size=5,
                              method="rocketkv_mt")
  plan1 = rocketkv.plan(cfg, l1, steps, D)
  state = rocketkv.prefill(jnp.asarray(k[:, :, :l1]), jnp.asarray(v[:, :, :l1]),
                           jnp.asarray(q[:, :, l1 - 4:l1]), plan1)
  for t in range(steps):
    p = l1 + t
    _, state = rocketkv.decode_step(jnp.asarray(q[:, :, p]), jnp.asarray(k[:, :, p:p + 1]),
                                    jnp.asarray(v[:, :, p:p + 1]), state, plan1)
  assert int(state.full.length[0]) == l1 + steps
  assert int(state.view.length[0]) == plan1.prompt_budget + steps
  # Turn 2: its prompt lands in the full cache; stage 1 re-runs over everything.
  n = l1 + steps + t2
  plan2 = rocketkv.plan(cfg, n, steps, D)
  state = rocketkv.begin_turn(state, jnp.asarray(k[:, :, l1 + steps:n]),
                              jnp.asarray(v[:, :, l1 + steps:n]),
                              jnp.asarray(q[:, :, n - 4:n]), plan2)
  np.testing.assert_array_equal(np.asarray(state.full.k[0, :, :n]), k[0, :, :n])
  fresh = rocketkv.evict(jnp.asarray(k[:, :, :n]), jnp.asarray(v[:, :, :n]),
                         jnp.asarray(q[:, :, n - 4:n]), plan2)
  np.testing.assert_array_equal(np.asarray(state.view.pos), np.asarray(fresh.pos))
  np.testing.assert_array_equal(np.asarray(state.view.k), np.asarray(fresh.k))
  assert int(state.view.seen[0]) == n
  out, state = rocketkv.decode_step(jnp.asarray(q[:, :, n]), jnp.asarray(k[:, :, n:n + 1]),
                                    jnp.asarray(v[:, :, n:n + 1]), state, plan2)
  assert int(state.full.length[0]) == n + 1 and int(state.view.pos[0, 0, state.view.length[0] - 1]) == n


def test_valid_slots_respects_length_and_window():
  cache = rocketkv.empty_cache(1, 1, 6, 2, jnp.float32)
  for _ in range(5):
    cache = rocketkv.append(cache, jnp.ones((1, 1, 1, 2)), jnp.ones((1, 1, 1, 2)))
  assert np.asarray(valid_slots(cache))[0, 0].tolist() == [1, 1, 1, 1, 1, 0]
  assert np.asarray(valid_slots(cache, 2))[0, 0].tolist() == [0, 0, 0, 1, 1, 0]


@pytest.mark.parametrize("batch", [3, 17])  # per-sequence in-place writes / one scatter
def test_append_writes_each_sequence_at_its_length(batch):
  rng = np.random.default_rng(batch)
  lengths = rng.integers(0, 6, batch).astype(np.int32)
  k0 = rng.standard_normal((batch, 2, 6, 4)).astype(np.float32)
  cache = rocketkv.full_cache(jnp.asarray(k0), jnp.asarray(k0), 7, 2, jnp.asarray(lengths))
  kn = rng.standard_normal((batch, 2, 1, 4)).astype(np.float32)
  new = rocketkv.append(cache, jnp.asarray(kn), jnp.asarray(kn))
  for b in range(batch):
    n = lengths[b]
    want = np.concatenate([k0[b, :, :n], kn[b]], axis=1)
    np.testing.assert_array_equal(np.asarray(new.k[b, :, :n + 1]), want)
    assert np.all(np.asarray(new.k[b, :, n + 1:]) == 0)
    kmin, kmax = ref.chunk_bounds(np.asarray(new.k[b]), n + 1, 2)
    np.testing.assert_array_equal(np.asarray(new.kmin[b]), kmin)
    np.testing.assert_array_equal(np.asarray(new.kmax[b]), kmax)
  assert np.asarray(new.length).tolist() == (lengths + 1).tolist()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("method", ["rocketkv", "full"])
def test_jitted_decode_step_updates_the_cache_in_place(dtype, method):
  """No whole-buffer copy of K, V or the summaries in the compiled, donated decode step."""
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, window_size=8, method=method),
                       4000, 16, 64)
  kc = jnp.zeros((1, 4, plan.prompt_budget, 64), dtype)
  cache = rocketkv.full_cache(kc, kc, plan.capacity, plan.chunk_size)
  q, kn = jnp.zeros((1, 12, 64), dtype), jnp.zeros((1, 4, 1, 64), dtype)
  step = jax.jit(rocketkv.decode_step, static_argnums=4, donate_argnums=3)
  hlo = as_users_compile(step.lower(q, kn, kn, cache, plan)).as_text()
  shapes = {f"[1,4,{plan.capacity},64]"} | ({f"[1,4,{plan.num_chunks},64]"} if plan.num_chunks
                                             else set())
  copies = [line for line in hlo.splitlines() if " copy(" in line and any(s in line for s in shapes)]
  assert copies == []
  if dtype == jnp.bfloat16:
    # XLA:CPU computes a bf16 dynamic-update-slice in f32, a pass over the whole buffer: the
    # cache stores the bits (u16), so no top-level op may produce a bf16 / f32 cache buffer.
    entry = hlo[hlo.index("\nENTRY"):].splitlines()
    widened = [line for line in entry if any(f"= {t}{s}" in line for t in ("bf16", "f32")
                                             for s in shapes)]
    assert widened == []

"""The scanned layer loop (`llama.LayerStack`, `layer_scan`): the same numbers as the unrolled
loop for every method, rows written in place in the stacked carry (no per-layer copy of a cache),
and the layout helpers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax import cache as cache_lib
from rocketkv_jax import layer_scan
from rocketkv_jax.models import llama
from rocketkv_jax.models.config import ModelConfig
from method_specs import SPECS, spec_plan
from xla_env import as_users_compile

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=40)
L, NEW = 48, 3


def _plan(spec, length=L):
  return spec_plan(spec, length, NEW, CFG.head_dim)


def _both(spec, batch, dtype=jnp.float32, users_compile=False):
  """Prefill a ragged batch, then NEW steps with the tuple cache and with its LayerStack (each
  step program compiled with XLA's default options if `users_compile`)."""
  params = jax.tree.map(lambda a: a.astype(dtype), llama.init_params(CFG, seed=3))
  rng = np.random.default_rng(batch)
  tokens = jnp.asarray(rng.integers(0, 64, (batch, L)), jnp.int32)
  lengths = jnp.asarray(rng.integers(20, L + 1, batch), jnp.int32)
  plan = _plan(spec)
  _, cache = llama.prefill(params, tokens, lengths, config=CFG, plan=plan, block_size=8)
  step = jitted = jax.jit(functools.partial(llama.decode_step, config=CFG, plan=plan))
  runs = []
  for c in (cache, llama.stack_cache(cache, plan)):
    if users_compile:
      step = as_users_compile(jitted.lower(params, c, tokens[:, 0], lengths))
    logits = []
    for t in range(NEW):
      out, c = step(params, c, tokens[:, t], lengths + t)
      logits.append(np.asarray(out))
    runs.append((np.stack(logits), c))
  return runs


@pytest.mark.parametrize("spec", SPECS)
def test_scanned_decode_equals_unrolled(spec):
  """Bit-identical logits and caches (a ragged batch, GQA, a sliding window, dense layers)."""
  (want, unrolled), (got, stack) = _both(spec, batch=2)
  np.testing.assert_array_equal(got, want)
  assert isinstance(stack, llama.LayerStack)
  back = llama.unstack_cache(stack)
  assert jax.tree.structure(back) == jax.tree.structure(unrolled)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(unrolled)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(rocketkv.cache_overflow(stack)),
                                np.asarray(rocketkv.cache_overflow(unrolled)))


def _assert_same_caches(stack, unrolled):
  for a, b in zip(jax.tree.leaves(llama.unstack_cache(stack)), jax.tree.leaves(unrolled)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_scanned_decode_scatters_rows_above_16_sequences():
  """Above 16 sequences the rows are scattered. (Compiled as users' programs: XLA:CPU's older
  fusion code generator, which the tests use, rounds this scatter differently in the two.)"""
  (want, unrolled), (got, stack) = _both("rocketkv:quant", batch=18, users_compile=True)
  np.testing.assert_array_equal(got, want)
  _assert_same_caches(stack, unrolled)


def test_scanned_decode_bf16_storage(monkeypatch):
  """bf16 caches are stored as uint16 bits, and the scanned and unrolled loops are bit-identical
  with fp32 compute (`ROCKETKV_NATIVE_BF16=0`). Native bf16 compute is left out on purpose: the
  two programs round their bf16 activations at different places (XLA fuses a scan body and an
  unrolled loop differently; measured 0.027 apart, each 0.051 from fp32 compute), and its
  accuracy against fp32 is tested in tests/test_models.py."""
  monkeypatch.setenv("ROCKETKV_NATIVE_BF16", "0")
  jax.clear_caches()  # the compute dtype is read at trace time
  (want, unrolled), (got, stack) = _both("rocketkv", batch=3, dtype=jnp.bfloat16)
  jax.clear_caches()
  np.testing.assert_array_equal(got, want)
  _assert_same_caches(stack, unrolled)
  assert stack.groups[0].k_raw.dtype == jnp.uint16  # bf16 bits on the CPU backend


def test_layer_spans_and_stack_round_trip():
  assert llama.layer_spans(4, _plan("rocketkv")) == ((0, 4),)
  assert llama.layer_spans(5, _plan("quest")) == ((0, 1), (1, 2), (2, 5))  # dense 0 and 1
  assert llama.layer_spans(5, _plan("rocketkv:skip_layers")) == ((0, 1), (1, 2), (2, 5))
  rng = np.random.default_rng(0)
  states = tuple(cache_lib.full_cache(jnp.asarray(rng.standard_normal((1, 2, 6, 4)), jnp.float32),
                                      jnp.asarray(rng.standard_normal((1, 2, 6, 4)), jnp.float32),
                                      8, 2, jnp.array([6], jnp.int32)) for _ in range(5))
  stack = llama.stack_cache(states, _plan("quest"))
  assert stack.groups[2].k_raw.shape == (3, 1, 2, 8, 4)
  for a, b in zip(jax.tree.leaves(llama.unstack_cache(stack)), jax.tree.leaves(states)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


N, B, H, C, D = 4, 2, 3, 64, 8


def _write_layers(k, counts, slots, rows, hook: bool):
  """Per layer i: k[i, b, :, slots[i, b]] = rows[i, b]; counts[i] += 1; returns the sum of
  every layer's row 0 (a read through the view). hook=False bypasses the views (the naive
  slice-write-back body)."""
  def fn(acc, state, i):
    kl, cl = state
    if not hook:
      kl = kl + 0  # a new array: `write_rows` no longer sees a view
    kl = cache_lib.write_rows(kl, rows[i], slots[i])
    return acc + kl[:, :, 0].sum(), (kl, cl + 1)

  acc, (k, counts) = layer_scan.scan_layers(fn, jnp.float32(0), (k, counts),
                                            jnp.arange(N, dtype=jnp.int32))
  return acc, k, counts


def test_scan_layers_writes_rows_into_the_stacked_carry():
  rng = np.random.default_rng(1)
  k = rng.standard_normal((N, B, H, C, D)).astype(np.float32)
  counts = np.zeros((N, B), np.int32)
  slots = rng.integers(0, C, (N, B)).astype(np.int32)
  rows = rng.standard_normal((N, B, H, D)).astype(np.float32)
  want = k.astype(np.float64).copy()
  for i in range(N):
    for b in range(B):
      want[i, b, :, slots[i, b]] = rows[i, b]
  want_acc = want[:, :, :, 0].sum()
  for hook in (True, False):
    f = jax.jit(functools.partial(_write_layers, hook=hook))
    acc, got, cnt = f(jnp.asarray(k), jnp.asarray(counts), jnp.asarray(slots), jnp.asarray(rows))
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=0)
    np.testing.assert_array_equal(np.asarray(cnt), np.ones((N, B), np.int32))
    np.testing.assert_allclose(float(acc), want_acc, rtol=1e-5)


def test_scan_layers_copies_no_layer_of_the_cache():
  """With the views, no op of the compiled scan makes a whole layer's `[B, H, C, D]` cache (no
  slice copied out and written back); the naive body does (so this test can fail)."""
  args = (jax.ShapeDtypeStruct((N, B, H, C, D), jnp.float32),
          jax.ShapeDtypeStruct((N, B), jnp.int32), jax.ShapeDtypeStruct((N, B), jnp.int32),
          jax.ShapeDtypeStruct((N, B, H, D), jnp.float32))
  layer = f"f32[{B},{H},{C},{D}]"

  def layer_sized_ops(hook):
    """Layer-sized results of ops that run (not of the ops inside a fusion's body)."""
    hlo = as_users_compile(
        jax.jit(functools.partial(_write_layers, hook=hook)).lower(*args)).as_text()
    found, fused = [], False
    for line in hlo.splitlines():
      if line and not line.startswith(" "):  # a computation's header
        fused = line.lstrip("%").startswith("fused")
      elif not fused and f"= {layer}" in line and "parameter(" not in line:
        found.append(line.strip())
    return found

  assert layer_sized_ops(hook=True) == []
  assert layer_sized_ops(hook=False)


def test_scan_layers_rejects_a_changed_state_structure():
  def fn(acc, state, i):
    return acc, (state, state)

  with pytest.raises(ValueError, match="structure"):
    layer_scan.scan_layers(fn, jnp.float32(0), jnp.zeros((2, 3)), jnp.arange(2))


def _layers_data(n=4, b=2, hkv=2, g=2, l=24, d=8, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  return (f(n, b, hkv, l, d), f(n, b, hkv, l, d), f(n, b, hkv * g, 4, d), f(n, b, hkv * g, d),
          f(n, b, hkv, 1, d), jnp.array([24, 13], jnp.int32))


def test_quest_scanned_with_a_traced_layer_index_equals_the_unrolled_loop():
  """Issue 41: a user scanning over layers passed layer=None and Quest's dense layers 0, 1 ran
  sparse. The traced index carries them as data: the scan equals the unrolled loop."""
  k, v, qw, q, kn, lengths = _layers_data()
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=8, window_size=4, page_size=4,
                                             method="quest"), 24, 1, 8)
  unrolled = [rocketkv.decode_step(q[i], kn[i], kn[i], rocketkv.prefill(
      k[i], v[i], qw[i], plan, lengths=lengths, layer=i), plan, layer=i)[0] for i in range(4)]

  def body(_, xs):
    i, kk, vv, qq, qn, kk_new = xs
    state = rocketkv.prefill(kk, vv, qq, plan, lengths=lengths, layer=i)
    return None, rocketkv.decode_step(qn, kk_new, kk_new, state, plan, layer=i)[0]

  _, scanned = jax.jit(lambda *a: lax_scan(body, a))(jnp.arange(4, dtype=jnp.int32), k, v, qw,
                                                     q, kn)
  np.testing.assert_allclose(np.asarray(scanned), np.stack(unrolled), rtol=1e-6, atol=1e-6)
  sparse = rocketkv.decode_step(q[0], kn[0], kn[0], rocketkv.prefill(
      k[0], v[0], qw[0], plan, lengths=lengths, layer=2), plan, layer=2)[0]
  assert not np.allclose(np.asarray(sparse), np.asarray(unrolled[0]))  # layer 0 is dense


def lax_scan(body, xs):
  return jax.lax.scan(body, None, xs)


@pytest.mark.parametrize("method,kw", [("quest", {}), ("rocketkv", dict(skip_layers=1))])
def test_layer_none_with_dense_layers_raises_one_line(method, kw):
  k, v, qw, q, kn, lengths = _layers_data()
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=8, window_size=4, page_size=4,
                                             method=method, **kw), 24, 1, 8)
  with pytest.raises(ValueError, match="layer must be this layer's index") as e:
    rocketkv.prefill(k[0], v[0], qw[0], plan, lengths=lengths)
  assert "\n" not in str(e.value)
  state = rocketkv.prefill(k[0], v[0], qw[0], plan, lengths=lengths, layer=3)
  with pytest.raises(ValueError, match="layer must be this layer's index"):
    rocketkv.decode_step(q[0], kn[0], kn[0], state, plan)


def test_skip_layers_with_a_traced_layer_index_raises_one_line():
  """skip_layers' dense layers hold a state of another structure: no scan can carry them."""
  k, v, qw, q, kn, lengths = _layers_data()
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=8, window_size=4, skip_layers=1),
                       24, 1, 8)
  with pytest.raises(ValueError, match="layer must be a Python int for method 'rocketkv'") as e:
    jax.jit(lambda i: rocketkv.prefill(k[0], v[0], qw[0], plan, lengths=lengths, layer=i))(
        jnp.int32(1))
  assert "\n" not in str(e.value)

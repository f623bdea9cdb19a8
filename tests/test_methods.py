"""The contract every registered KV method meets (a new method is tested by registering it).

Per method, on random K/V with GQA and a ragged batch: each row of a batch decodes exactly as
that row alone; a jitted decode step traces once over many steps; the cache holds at most the
planned prompt tokens and never overflows; a selecting method reads at most `top_k <= B` valid
slots per head, with no slot twice; a method's dense layers attend densely (float64
reference); bad configs are rejected before tracing.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax import methods
from method_specs import stage2_of

NAMES = sorted(methods.REGISTRY)
# Each registered method, plus the variants of a method's stage 2 (`Method.stage2_variants`)
# other than the default, as "method:stage2" (small lowrank pages so that several are summarised).
VARIANTS = NAMES + [f"{n}:{s}" for n in NAMES for s in methods.get(n).stage2_variants
                    if s != "minmax"]
# "method:stage2:group_dims": the methods that pick dims, under RocketConfig.group_dims.
GROUP_DIMS_SPECS = ["rocketkv::normalized", "rocketkv:quant:normalized", "sparq::normalized"]
B, HKV, G, D, L, NEW, BUDGET = 2, 2, 2, 16, 48, 6, 16
LENGTHS = np.array([48, 29], np.int32)
LAYER = 2  # a layer index no method keeps dense here (Quest's are 0 and 1)
# Methods whose `select` shares the layer's Hkv * top_k reads among its KV heads (one head may
# read more than top_k): [B, Hkv, min(Hkv * top_k, C)] indices, the rest marked invalid.
SHARES_READ_ACROSS_HEADS = ("exact_topk_heads",)


def _config(spec, **kw):
  name, stage2, group_dims = (spec.split(":") + ["", ""])[:3]
  kw = dict(dict(token_budget=BUDGET, window_size=4, page_size=4, sink_size=2,
                 stage2=stage2_of(stage2), group_dims=group_dims or "sum"), **kw)
  return rocketkv.RocketConfig(method=name, **kw)


def _method(spec):
  return methods.get(spec.partition(":")[0])


def _data(seed=0):
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((B, HKV, L, D)).astype(np.float32)
  v = rng.standard_normal((B, HKV, L, D)).astype(np.float32)
  for i, n in enumerate(LENGTHS):
    k[i, :, n:] = 0.0
    v[i, :, n:] = 0.0
  qw = np.stack([rng.standard_normal((HKV * G, 4, D)) for _ in range(B)]).astype(np.float32)
  steps = [tuple(rng.standard_normal(s).astype(np.float32)
                 for s in ((B, HKV * G, D), (B, HKV, 1, D), (B, HKV, 1, D)))
           for _ in range(NEW)]
  return k, v, qw, steps


def _decode(name, rows, traces=None):
  """Prefill rows `rows` of the shared data, then NEW jitted steps; (outputs, states)."""
  k, v, qw, steps = _data()
  plan = rocketkv.plan(_config(name), L, NEW, D)
  state = rocketkv.prefill(jnp.asarray(k[rows]), jnp.asarray(v[rows]), jnp.asarray(qw[rows]),
                           plan, lengths=jnp.asarray(LENGTHS[rows]), layer=LAYER)
  first = state

  def step(q, kn, vn, state):
    if traces is not None:
      traces.append(1)
    return rocketkv.decode_step(q, kn, vn, state, plan, layer=LAYER)

  step = jax.jit(step)
  outs = []
  for q, kn, vn in steps:
    out, state = step(jnp.asarray(q[rows]), jnp.asarray(kn[rows]), jnp.asarray(vn[rows]), state)
    outs.append(np.asarray(out))
  return np.stack(outs, 1), first, state, plan


@pytest.mark.parametrize("name", VARIANTS)
def test_ragged_batch_equals_each_row_alone_and_compiles_once(name):
  traces = []
  both, first, last, plan = _decode(name, [0, 1], traces)
  assert len(traces) == 1  # NEW steps, one trace
  assert np.all(np.isfinite(both))
  for i in range(B):
    alone, _, _, _ = _decode(name, [i])
    np.testing.assert_allclose(both[i], alone[0], rtol=1e-5, atol=1e-6)
  method = _method(name)
  view0, view = method.view(first), method.view(last)
  kept = np.asarray(view0.length)
  np.testing.assert_array_equal(kept, np.minimum(LENGTHS, plan.prompt_budget))
  np.testing.assert_array_equal(np.asarray(view.length), kept + NEW)
  assert not np.asarray(rocketkv.cache_overflow(last)).any()


@pytest.mark.parametrize("name", VARIANTS)
def test_selection_respects_the_budget(name):
  _, _, state, plan = _decode(name, [0, 1])
  method = _method(name)
  cache = method.view(state)
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.standard_normal((B, HKV * G, D)).astype(np.float32))
  idx = np.asarray(rocketkv.select(q, state, plan))  # the state: a method may read more
  length = np.asarray(cache.length)
  valid = idx < length[:, None, None]
  if method.dense:
    assert plan.top_k == 0 and idx.shape[2] == cache.capacity
  elif method.name in SHARES_READ_ACROSS_HEADS:
    assert 1 <= plan.top_k <= BUDGET
    assert idx.shape[2] == min(HKV * plan.top_k, cache.capacity)
    for b in range(B):
      sels = [idx[b, h][valid[b, h]] for h in range(HKV)]
      assert all(len(set(s.tolist())) == len(s) for s in sels)
      assert sum(map(len, sels)) == HKV * min(plan.top_k, length[b])
  elif method.reads_by_mass:  # per head, the fewest slots holding plan.read_mass: >= 1
    assert idx.shape[2] == cache.capacity and plan.top_k == cache.capacity
    for b in range(B):
      for h in range(HKV):
        sel = idx[b, h][valid[b, h]]
        assert len(set(sel.tolist())) == len(sel) and 1 <= len(sel) <= length[b]
  else:
    assert 1 <= plan.top_k <= BUDGET and idx.shape[2] == min(plan.top_k, cache.capacity)
    for b in range(B):
      for h in range(HKV):
        sel = idx[b, h][valid[b, h]]
        assert len(set(sel.tolist())) == len(sel) == min(plan.top_k, length[b])
  read = method.tokens_read(plan, int(length.max()) - NEW, NEW)
  assert read == (min(plan.top_k, int(length.max())) if plan.top_k else int(length.max()))
  if method.uses_budget and not method.dense:
    assert read <= BUDGET


@pytest.mark.parametrize("name", VARIANTS)
def test_dense_layers_attend_to_every_slot(name):
  method = _method(name)
  k, v, qw, steps = _data()
  plan = rocketkv.plan(_config(name), L, NEW, D)
  state = rocketkv.prefill(jnp.asarray(k), jnp.asarray(v), jnp.asarray(qw), plan,
                           lengths=jnp.asarray(LENGTHS), layer=LAYER)
  q, kn, vn = (jnp.asarray(x) for x in steps[0])
  for layer in method.dense_layers(plan):
    out, new = rocketkv.decode_step(q, kn, vn, state, plan, layer=layer)
    cache = method.view(new)
    ck, cv = np.asarray(cache.k, np.float64), np.asarray(cache.v, np.float64)
    n = np.asarray(cache.length)
    qg = np.asarray(q, np.float64).reshape(B, HKV, G, D)
    for b in range(B):
      s = np.einsum("hgd,hcd->hgc", qg[b], ck[b, :, :n[b]]) / np.sqrt(D)
      p = np.exp(s - s.max(-1, keepdims=True))
      ref = np.einsum("hgc,hcd->hgd", p / p.sum(-1, keepdims=True), cv[b, :, :n[b]])
      np.testing.assert_allclose(np.asarray(out[b]), ref.reshape(HKV * G, D), atol=1e-5)


@pytest.mark.parametrize("name", VARIANTS)
def test_bad_config_is_rejected(name):
  with pytest.raises(ValueError, match="token_budget"):
    _config(name, token_budget=0)
  with pytest.raises(ValueError, match="capacity must be >="):
    rocketkv.plan(_config(name, capacity=2), L, NEW, D)


def test_a_new_stage2_variant_is_one_class_and_one_registry_line():
  """A variant written here (exact per-slot scores: exact_topk's read over stage 1's cache),
  registered, passes the contract tests above as "rocketkv:<name>" and selects exactly what
  exact_topk selects from the same cache."""
  from rocketkv_jax.cache import valid_slots
  from rocketkv_jax.methods import stage2
  from rocketkv_jax.select import exact_slot_scores_xla, top_slots

  @dataclasses.dataclass(frozen=True)
  class ExactScores(stage2.Stage2):
    name = "exact_scores_test"

    def select(self, q, state, plan, *, sliding_window=None, impl="auto"):
      valid = valid_slots(state, sliding_window)
      k = min(plan.top_k, state.capacity)
      return top_slots(exact_slot_scores_xla(q, state.k, valid), valid, 1, k)

  stage2.register(ExactScores)
  try:
    spec = "rocketkv:exact_scores_test"
    assert spec.partition(":")[2] in methods.get("rocketkv").stage2_variants
    test_ragged_batch_equals_each_row_alone_and_compiles_once(spec)
    test_selection_respects_the_budget(spec)
    test_dense_layers_attend_to_every_slot(spec)
    _, _, state, plan = _decode(spec, [0, 1])
    q = jnp.asarray(np.random.default_rng(4).standard_normal((B, HKV * G, D)), jnp.float32)
    got = rocketkv.select(q, state, plan)
    want = methods.get("exact_topk").select(q, state, plan)
    np.testing.assert_array_equal(np.sort(np.asarray(got)), np.sort(np.asarray(want)))
  finally:
    del stage2.REGISTRY["exact_scores_test"]


def test_unknown_method_and_registry():
  with pytest.raises(ValueError, match="method must be one of"):
    rocketkv.RocketConfig(token_budget=64, method="h2o")
  assert set(rocketkv.METHODS) == set(NAMES)
  assert all(isinstance(m, methods.Method) and m.name == n for n, m in methods.REGISTRY.items())
  with pytest.raises(ValueError, match="new name"):
    methods.register(methods.get("full"))
  p = rocketkv.plan(rocketkv.RocketConfig(token_budget=64, method="rocketkv_mt"), 1000, 4, 64)
  assert p.method == "rocketkv_mt" and p.full_capacity == 1004  # Plan.method stays a string
  assert {"rocketkv:rerank", "rocketkv:lowrank", "rocketkv_mt:lowrank"} <= set(VARIANTS)
  for name in NAMES:  # a method without stage-2 variants rejects them before tracing
    if "rerank" not in methods.get(name).stage2_variants:
      with pytest.raises(ValueError, match="needs method in"):
        rocketkv.RocketConfig(token_budget=64, method=name, stage2="rerank")


@pytest.mark.parametrize("spec", GROUP_DIMS_SPECS)
def test_group_dims_meets_the_contract(spec):
  """`group_dims="normalized"` through the same contract (its numbers: tests/test_select.py)."""
  assert _config(spec).group_dims == "normalized"
  test_ragged_batch_equals_each_row_alone_and_compiles_once(spec)
  test_selection_respects_the_budget(spec)
  test_dense_layers_attend_to_every_slot(spec)

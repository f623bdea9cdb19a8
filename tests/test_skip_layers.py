"""`RocketConfig.skip_layers`: rocketkv / rocketkv_mt keep the first N layers whole and dense.

Against a float64 NumPy reference written here: a skipped layer's decode attention is dense
attention over every token (prompt, decoded and, in multi-turn, the next turn's), later layers
decode exactly as with skip_layers=0, and so do the multi-turn paths (`begin_turn`, `extend` /
`grow`). On a tiny random model: skip_layers = num_layers gives full KV's tokens, the stats count
the dense layers' whole cache, the eval variant spec reaches the runner, bad values raise.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax import methods
from rocketkv_jax.cache import grow
from rocketkv_jax.eval import variants
from rocketkv_jax.eval.runner import Runner
from rocketkv_jax.models import api, llama
from rocketkv_jax.models.config import ModelConfig
from rocketkv_jax.multiturn import MTState
from method_specs import stage2_of

B, HKV, G, D, L, NEW, BUDGET, SKIP = 2, 2, 2, 16, 48, 4, 16, 2
LENGTHS = np.array([48, 29], np.int32)
T, TURN_LENGTHS = 6, np.array([6, 4], np.int32)  # a later turn's prompt (right-padded)


def _config(spec, skip_layers):
  name, _, stage2 = spec.partition(":")
  return rocketkv.RocketConfig(token_budget=BUDGET, method=name, window_size=4,
                               stage2=stage2_of(stage2), skip_layers=skip_layers)


def _data(seed):
  """One layer's prompt K/V (zero past each length), window queries, and decode inputs."""
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((B, HKV, L, D)).astype(np.float32)
  v = rng.standard_normal((B, HKV, L, D)).astype(np.float32)
  for i, n in enumerate(LENGTHS):
    k[i, :, n:] = 0.0
    v[i, :, n:] = 0.0
  qw = rng.standard_normal((B, HKV * G, 4, D)).astype(np.float32)
  steps = [tuple(rng.standard_normal(s).astype(np.float32)
                 for s in ((B, HKV * G, D), (B, HKV, 1, D), (B, HKV, 1, D)))
           for _ in range(2 * NEW)]
  turn = tuple(rng.standard_normal(s).astype(np.float32)
               for s in ((B, HKV, T, D), (B, HKV, T, D), (B, HKV * G, 4, D)))
  return k, v, qw, steps, turn


def ref_dense(q, keys, vals):
  """float64 GQA attention of q [Hq, D] over keys / vals [Hkv, N, D] -> [Hq, D]."""
  q, keys, vals = (np.asarray(x, np.float64) for x in (q, keys, vals))
  out = np.zeros(q.shape)
  for h in range(q.shape[0]):
    s = keys[h // G] @ q[h] / np.sqrt(D)
    p = np.exp(s - s.max())
    out[h] = (p / p.sum()) @ vals[h // G]
  return out


def _steps(state, plan, layer, inputs):
  """Jitted decode steps of one layer; (outputs [steps, B, Hq, D], state)."""
  step = jax.jit(functools.partial(rocketkv.decode_step, plan=plan, layer=layer))
  outs = []
  for q, kn, vn in inputs:
    out, state = step(jnp.asarray(q), jnp.asarray(kn), jnp.asarray(vn), state)
    outs.append(np.asarray(out))
  return np.stack(outs), state


def _check_dense(outs, rows):
  """outs [steps, B, Hq, D]; rows[b] = the (keys, vals, queries) sequence seen by row b."""
  for b, (keys, vals, qs) in enumerate(rows):
    n0 = keys.shape[1] - len(qs)
    for t, q in enumerate(qs):  # step t sees the first n0 + t + 1 keys
      np.testing.assert_allclose(outs[t, b], ref_dense(q, keys[:, :n0 + t + 1],
                                                       vals[:, :n0 + t + 1]), atol=2e-5)


def _rows(parts):
  """parts: per row b, a list of (keys [Hkv, n, D], vals, queries [n', Hq, D] or None) blocks
  (queries of the decode blocks) -> per row (keys, vals, queries of the final block)."""
  return [(np.concatenate([p[0] for p in row], 1), np.concatenate([p[1] for p in row], 1),
           row[-1][2]) for row in parts]


@pytest.mark.parametrize("spec", ["rocketkv", "rocketkv_mt", "rocketkv:lowrank", "rocketkv:quant"])
def test_skipped_layers_are_dense_and_later_layers_unchanged(spec):
  plan = rocketkv.plan(_config(spec, SKIP), L, NEW, D)
  plan0 = rocketkv.plan(_config(spec, 0), L, NEW, D)
  method = methods.get(plan.method)
  assert method.dense_layers(plan) == (0, 1) and method.dense_layers(plan0) == ()
  assert plan.prompt_budget < L  # stage 1 evicts in the other layers
  for layer in range(SKIP + 1):
    k, v, qw, steps, _ = _data(seed=layer)
    args = (jnp.asarray(k), jnp.asarray(v), jnp.asarray(qw))
    state = rocketkv.prefill(*args, plan, lengths=jnp.asarray(LENGTHS), layer=layer)
    outs, state = _steps(state, plan, layer, steps[:NEW])
    cache = method.view(state)
    if layer < SKIP:
      np.testing.assert_array_equal(np.asarray(cache.length), LENGTHS + NEW)  # nothing evicted
      rows = [[(k[b, :, :n], v[b, :, :n], None),
               (np.concatenate([s[1][b] for s in steps[:NEW]], 1),
                np.concatenate([s[2][b] for s in steps[:NEW]], 1),
                [s[0][b] for s in steps[:NEW]])] for b, n in enumerate(LENGTHS)]
      _check_dense(outs, _rows(rows))
    else:
      state0 = rocketkv.prefill(*args, plan0, lengths=jnp.asarray(LENGTHS), layer=layer)
      outs0, state0 = _steps(state0, plan0, layer, steps[:NEW])
      np.testing.assert_array_equal(outs, outs0)
      np.testing.assert_array_equal(np.asarray(cache.length),
                                    np.minimum(LENGTHS, plan.prompt_budget) + NEW)
      for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(state0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _next_turn(spec, state, plan, turn, layer):
  """The harness's multi-turn step for one layer: rocketkv_mt re-runs stage 1 (`begin_turn`);
  rocketkv grows its cache and appends the turn (`extend`). Returns (state, turn plan)."""
  kt, vt, qwt = (jnp.asarray(x) for x in turn)
  tl = jnp.asarray(TURN_LENGTHS)
  tplan = rocketkv.plan(_config(spec, plan.skip_layers), L + NEW + T, NEW, D)
  if methods.get(spec).keeps_full_cache:
    return rocketkv.begin_turn(state, kt, vt, qwt, tplan, turn_lengths=tl), tplan
  dense = layer in methods.get(spec).dense_layers(plan)
  state = grow(state, max(tplan.capacity, state.capacity + T + NEW),
               chunk_size=None if dense else tplan.chunk_size)
  return rocketkv.extend(state, kt, vt, tl), tplan


@pytest.mark.parametrize("spec", ["rocketkv", "rocketkv_mt"])
def test_skipped_layers_stay_whole_across_turns(spec):
  """A second turn: the skipped layer's cache holds every token of both turns and attends
  densely over them; the next layer decodes as with skip_layers=0."""
  plan = rocketkv.plan(_config(spec, SKIP), L, NEW, D)
  plan0 = rocketkv.plan(_config(spec, 0), L, NEW, D)
  method = methods.get(spec)
  for layer in (0, SKIP):
    k, v, qw, steps, turn = _data(seed=10 + layer)
    args = (jnp.asarray(k), jnp.asarray(v), jnp.asarray(qw))
    got = []
    for p in ((plan, plan0) if layer >= SKIP else (plan,)):
      state = rocketkv.prefill(*args, p, lengths=jnp.asarray(LENGTHS), layer=layer)
      _, state = _steps(state, p, layer, steps[:NEW])
      state, tplan = _next_turn(spec, state, p, turn, layer)
      outs, state = _steps(state, tplan, layer, steps[NEW:])
      got.append((outs, state))
    outs, state = got[0]
    if layer < SKIP:
      cache = method.view(state)
      if method.keeps_full_cache:
        assert isinstance(state, MTState) and state.view is None  # reads `full`
      np.testing.assert_array_equal(np.asarray(cache.length),
                                    LENGTHS + NEW + TURN_LENGTHS + NEW)
      rows = []
      for b, n in enumerate(LENGTHS):
        cat = lambda i, sl: np.concatenate([s[i][b] for s in steps[sl]], 1)
        m = TURN_LENGTHS[b]
        rows.append([(k[b, :, :n], v[b, :, :n], None),
                     (cat(1, slice(0, NEW)), cat(2, slice(0, NEW)), None),
                     (turn[0][b, :, :m], turn[1][b, :, :m], None),
                     (cat(1, slice(NEW, None)), cat(2, slice(NEW, None)),
                      [s[0][b] for s in steps[NEW:]])])
      _check_dense(outs, _rows(rows))
    else:
      np.testing.assert_array_equal(outs, got[1][0])


# --------------------------------------------------------------------------- tiny model
CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
PROMPT_LENS = (60, 41)
MAX_NEW = 8


@functools.lru_cache(maxsize=None)
def _model():
  params = llama.init_params(CFG, seed=0)
  # larger weights than init_params' 0.02: less degenerate logits, distinct greedy choices
  params = jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, params)
  return api.Model(config=CFG, params=params)


def _prompts():
  rng = np.random.default_rng(5)
  return [rng.integers(3, 64, n).tolist() for n in PROMPT_LENS]


def _generate(skip_layers, method="rocketkv"):
  cfg = rocketkv.RocketConfig(token_budget=BUDGET, method=method, window_size=4,
                              skip_layers=skip_layers)
  return rocketkv.generate(_model(), _prompts(), rocket_config=cfg, max_new_tokens=MAX_NEW,
                           eos_token_ids=())


def test_every_layer_skipped_is_full_kv_and_stats_count_dense_layers():
  full = rocketkv.generate(_model(), _prompts(), method="full", max_new_tokens=MAX_NEW,
                           eos_token_ids=())
  every = _generate(CFG.num_layers)
  assert every.tokens == full.tokens
  n = max(PROMPT_LENS)
  totals = [m + MAX_NEW for m in PROMPT_LENS]  # each row's own prompt + new tokens
  for st in (every.stats, full.stats):
    assert st["kv_tokens_read_per_row"] == st["kv_tokens_full_per_row"] == totals
    assert st["kv_tokens_read"] == round(np.mean(totals)) and st["compression_ratio"] == 1.0

  two = _generate(SKIP)
  st, plan = two.stats, two.stats["plan"]
  assert plan.skip_layers == SKIP and plan.prompt_budget < max(PROMPT_LENS)
  sparse = CFG.num_layers - SKIP
  kept = np.array([[m] * SKIP + [min(m, plan.prompt_budget)] * sparse for m in PROMPT_LENS])
  read = np.array([[m + MAX_NEW] * SKIP + [plan.top_k] * sparse for m in PROMPT_LENS])
  assert st["kv_tokens_kept_per_layer"] == [round(x) for x in kept.mean(0)]
  assert st["kv_tokens_read_per_layer"] == [round(x) for x in read.mean(0)]
  assert st["kv_tokens_kept_per_row"] == [round(x) for x in kept.mean(1)]
  assert st["kv_tokens_read_per_row"] == [round(x) for x in read.mean(1)]
  assert st["kv_tokens_kept"] == round(kept.mean())
  assert st["kv_tokens_read"] == round(read.mean())
  assert st["compression_ratio"] == pytest.approx(np.mean(totals) / read.mean())
  assert st["compression_ratio_per_row"] == pytest.approx(list(np.array(totals) / read.mean(1)))
  # memory: the two dense layers hold full KV's cache, the third a stage-1 cache
  per_layer_full = full.stats["kv_cache_bytes"] / CFG.num_layers
  assert SKIP * per_layer_full < st["kv_cache_bytes"] < full.stats["kv_cache_bytes"]

  # the eval variant spec reaches the runner, which decodes as generate does
  tokens = np.zeros((2, n), np.int32)
  for i, p in enumerate(_prompts()):
    tokens[i, :len(p)] = p
  runner = Runner(_model(), window_size=4, eos_token_ids=())
  assert runner.plan("rocketkv:skip_layers=2", BUDGET, n, MAX_NEW) == plan
  got, _, _, _ = runner.decode(runner.prompt_pass(tokens, list(PROMPT_LENS)),
                               "rocketkv:skip_layers=2", BUDGET, MAX_NEW)
  assert got == two.tokens


def test_bad_skip_layers_raise_before_tracing():
  for bad in (-1, 1.5, True, "2"):
    with pytest.raises(ValueError, match=r"skip_layers must be an int >= 0"):
      rocketkv.RocketConfig(token_budget=64, skip_layers=bad)
  for name, m in methods.REGISTRY.items():  # only rocketkv and rocketkv_mt accept it
    if m.accepts_skip_layers:
      assert name in ("rocketkv", "rocketkv_mt")
      rocketkv.RocketConfig(token_budget=64, method=name, skip_layers=3)
    else:
      with pytest.raises(ValueError, match=r"skip_layers=3 needs method in \['rocketkv', "
                                           r"'rocketkv_mt'\]"):
        rocketkv.RocketConfig(token_budget=64, method=name, skip_layers=3)
  too_many = rocketkv.RocketConfig(token_budget=BUDGET, window_size=4, skip_layers=4)
  msg = r"skip_layers must be an int in \[0, num_layers=3\], got 4"
  with pytest.raises(ValueError, match=msg):
    rocketkv.generate(_model(), _prompts(), rocket_config=too_many, max_new_tokens=2)
  with pytest.raises(ValueError, match=msg):
    Runner(_model(), window_size=4).plan("rocketkv:skip_layers=4", BUDGET, 60, 2)
  plan = rocketkv.plan(too_many, 60, 2, CFG.head_dim)
  with pytest.raises(ValueError, match=msg):
    llama.prefill(_model().params, jnp.zeros((1, 60), jnp.int32), jnp.array([60]), config=CFG,
                  plan=plan)
  k = jnp.zeros((1, HKV, L, D))
  with pytest.raises(ValueError, match="layer must be an int >= 0 or an integer scalar array"):
    rocketkv.prefill(k, k, jnp.zeros((1, HKV * G, 4, D)),
                     rocketkv.plan(_config("rocketkv", SKIP), L, NEW, D), layer=-1)
  assert variants.parse("rocketkv:skip_layers=2") == ("rocketkv", {"skip_layers": 2})
  assert variants.rocket_config("rocketkv_mt:skip_layers=2", 64).skip_layers == 2
  with pytest.raises(ValueError, match="needs method in"):
    variants.rocket_config("snapkv:skip_layers=2", 64)

"""Fuzz test of the public API (issue #41 item 5): `plan`, `prefill`, `decode_step`, `select`,
`attend` on random shapes, dtypes, ragged lengths, budgets, methods and layers, and `generate`
on a tiny model.

Every call either returns finite outputs that meet the invariants -- kept <= capacity and the
planned count per row, selected slots valid and distinct, `attend` equal to a float64 reference
over the selected slots, full attention (method "full", a dense layer, or any method once the
budget holds every token) equal to a float64 reference -- or raises a ValueError of one line.
Bad inputs (lengths outside [1, L], a window of another length, layer=None where the plan has
dense layers, a state from another method's plan) must raise.

CI runs a few examples; a longer run:

    python tests/test_fuzz_api.py --examples 500      # or FUZZ_EXAMPLES=500 pytest ...
"""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import rocketkv_jax as rocketkv
from rocketkv_jax import methods
import reference as ref

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "25"))
CI = EXAMPLES <= 25  # the default run: fixed draws, no shrinking
SPECS = sorted(rocketkv.METHODS) + ["rocketkv:rerank", "rocketkv:lowrank", "rocketkv:quant",
                                    "rocketkv_mt:lowrank"]
# No shrinking in CI (each example compiles its shapes): the failing draws are printed as they are.
PHASES = (Phase.explicit, Phase.reuse, Phase.generate) + (() if CI else (Phase.shrink,))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=CI,
                suppress_health_check=list(HealthCheck), phases=PHASES)


def _one_line(e: BaseException) -> None:
  assert type(e) is ValueError and "\n" not in str(e) and str(e), repr(e)


def _call(fn, *args, **kw):
  """(result, None) or (None, the ValueError), after checking it is one line."""
  try:
    return fn(*args, **kw), None
  except ValueError as e:
    _one_line(e)
    return None, e


def _f64(x) -> np.ndarray:
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@given(data=st.data())
@FUZZ
def test_core_api_fuzz(data):
  draw = data.draw
  spec = draw(st.sampled_from(SPECS), "spec")
  name, _, stage2 = spec.partition(":")
  method = methods.get(name)
  b, hkv, g = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
  d, l, new = draw(st.sampled_from([4, 8])), draw(st.integers(1, 20)), draw(st.integers(0, 3))
  budget = draw(st.one_of(st.integers(1, 40), st.integers(1000, 100_000)), "budget")
  window = draw(st.integers(1, 6))
  dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
  layer = draw(st.sampled_from([None, 0, 1, 2, 3]), "layer")
  kw = dict(token_budget=budget, method=name, window_size=window,
            page_size=draw(st.integers(1, 4)), sink_size=draw(st.integers(0, 3)),
            stage2=rocketkv.LowRank(page_size=4, rank=2) if stage2 == "lowrank"
            else stage2 or "minmax",
            skip_layers=draw(st.integers(0, 2)) if method.accepts_skip_layers else 0)
  cfg, err = _call(rocketkv.RocketConfig, **kw)
  if err:
    return
  plan, err = _call(rocketkv.plan, cfg, l, new, d)
  if err:
    return
  # The plan is valid.
  assert plan.capacity >= min(plan.prompt_budget, l) + new and 0 <= plan.top_k <= plan.capacity
  assert 1 <= plan.r <= d and plan.chunk_size >= 0

  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1), "seed"))
  arr = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
  k, v, q_prompt = arr(b, hkv, l, d), arr(b, hkv, l, d), arr(b, hkv * g, l, d)
  lengths = np.array([draw(st.integers(1, l)) for _ in range(b)], np.int32)
  bad_len = draw(st.sampled_from([None] * 6 + [-5, 0, l + 1, l + 100]), "bad_len")
  if bad_len is not None:
    lengths[draw(st.integers(0, b - 1))] = bad_len
    _, err = _call(rocketkv.prefill, k, v, q_prompt[:, :, :min(window, l)], plan,
                   lengths=jnp.asarray(lengths), layer=layer)
    assert err is not None and "lengths must be in [1, L=" in str(err)
    return
  qw = rocketkv.last_valid_window(q_prompt, jnp.asarray(lengths), window)
  if layer is None and method.dense_layers(plan):  # would make a dense layer sparse silently
    _, err = _call(rocketkv.prefill, k, v, qw, plan, lengths=jnp.asarray(lengths))
    assert err is not None and "layer must be this layer's index" in str(err)
    return
  if draw(st.booleans(), "bad_window") and l > 1:
    w_bad = draw(st.sampled_from([x for x in range(1, l + 1) if x != qw.shape[2]]))
    _, err = _call(rocketkv.prefill, k, v, q_prompt[:, :, :w_bad], plan,
                   lengths=jnp.asarray(lengths), layer=layer)
    assert err is not None and "W=" in str(err)  # the window check (or an earlier one on W)
    return
  state, err = _call(rocketkv.prefill, k, v, qw, plan, lengths=jnp.asarray(lengths),
                     layer=layer)
  if err:
    return
  dense_layer = layer is not None and layer in method.dense_layers(plan)
  other = draw(st.sampled_from([n for n in rocketkv.METHODS if n != name]), "other method")
  other_cfg, err = _call(rocketkv.RocketConfig, token_budget=budget, method=other,
                         window_size=window)
  other_plan = _call(rocketkv.plan, other_cfg, l, new, d)[0] if other_cfg else None
  if other_plan is not None:  # a state made for another method's plan is refused
    _, err = _call(rocketkv.decode_step, arr(b, hkv * g, d), arr(b, hkv, 1, d),
                   arr(b, hkv, 1, d), state, other_plan, layer=layer)
    assert err is not None and "cache must come from" in str(err)
  cache = method.view(state)
  kept = np.asarray(cache.length)
  want = lengths if dense_layer else np.minimum(lengths, plan.prompt_budget)
  np.testing.assert_array_equal(kept, want)
  assert (kept <= cache.capacity).all()

  # Every token written so far, per row: the valid prompt, then the new ones.
  keys = [list(_f64(k[i, :, :lengths[i]]).transpose(1, 0, 2)) for i in range(b)]
  vals = [list(_f64(v[i, :, :lengths[i]]).transpose(1, 0, 2)) for i in range(b)]
  tol = dict(rtol=1e-4, atol=1e-4) if dtype == jnp.float32 else dict(rtol=3e-2, atol=3e-2)
  # a B that covers every token reads them all, except for an oracle whose read follows the mass
  exact = name == "full" or dense_layer or (budget >= l + new and not method.reads_by_mass)
  for _ in range(new):
    q, kn, vn = arr(b, hkv * g, d), arr(b, hkv, 1, d), arr(b, hkv, 1, d)
    out, state = rocketkv.decode_step(q, kn, vn, state, plan, layer=layer)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.isfinite(_f64(out)).all()
    for i in range(b):
      keys[i].append(_f64(kn[i, :, 0]))
      vals[i].append(_f64(vn[i, :, 0]))
    cache = method.view(state)
    assert (np.asarray(cache.length) <= cache.capacity).all()
    assert not np.asarray(rocketkv.cache_overflow(state)).any()
    if exact:  # full attention over every token written: the float64 reference
      for i in range(b):
        kk, vv = np.stack(keys[i], 1), np.stack(vals[i], 1)  # [Hkv, n, D]
        every = [np.arange(kk.shape[1])] * hkv
        np.testing.assert_allclose(_f64(out[i]), ref.attention(_f64(q[i]), kk, vv, every),
                                   **tol)
    if method.dense or dense_layer:
      continue
    idx, err = _call(rocketkv.select, q, state, plan)
    assert err is None
    idx = np.asarray(idx)
    n = np.asarray(cache.length)
    assert idx.shape == (b, hkv, min(plan.top_k, cache.capacity))
    assert (idx >= 0).all()  # slots >= length (even >= capacity) are invalid: attend masks them
    attended = rocketkv.attend(q, cache, jnp.asarray(idx))
    assert np.isfinite(_f64(attended)).all()
    ck, cv = _f64(cache.k), _f64(cache.v)
    for i in range(b):
      slots = []
      for h in range(hkv):
        valid = idx[i, h][idx[i, h] < n[i]]
        assert len(np.unique(valid)) == len(valid), "selected slots repeat"
        assert len(valid) == min(idx.shape[2], n[i]), "fewer valid slots than available"
        slots.append(valid)
      np.testing.assert_allclose(_f64(attended[i]), ref.attention(_f64(q[i]), ck[i], cv[i],
                                                                   slots), **tol)


@functools.lru_cache(maxsize=None)
def _tiny_model():
  """A 3-layer Llama (Quest keeps 0 and 1 dense, so layer 2 selects), random weights."""
  from rocketkv_jax.models import api, llama
  from rocketkv_jax.models.config import ModelConfig
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
  params = llama.init_params(cfg, seed=0)
  # larger weights than init_params' 0.02: less degenerate logits, distinct greedy choices
  params = jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, params)
  return api.Model(config=cfg, params=params)


def _tokens(n, length, seed):
  return np.random.default_rng(seed).integers(0, 64, (n, length))


@given(data=st.data())
@settings(max_examples=max(2, EXAMPLES // 12), deadline=None, derandomize=CI,
          suppress_health_check=list(HealthCheck), phases=PHASES)
def test_generate_fuzz(data):
  """`generate` on random prompts, methods and budgets: valid tokens and stats, or one line;
  once the budget holds every token, the tokens of full KV."""
  draw = data.draw
  model = _tiny_model()
  name = draw(st.sampled_from(sorted(rocketkv.METHODS)), "method")
  n = draw(st.integers(1, 2))
  lens = [draw(st.integers(1, 40)) for _ in range(n)]
  toks = _tokens(n, 40, seed=draw(st.integers(0, 1000)))
  prompts = [toks[i, :lens[i]].tolist() for i in range(n)]
  new = draw(st.integers(1, 4))
  budget = draw(st.sampled_from([4, 16, 33, 100, 100_000]), "budget")
  res, err = _call(rocketkv.generate, model, prompts, method=name, token_budget=budget,
                   max_new_tokens=new, eos_token_ids=())
  if err:
    return
  assert all(len(t) == new and all(0 <= x < model.config.vocab_size for x in t)
             for t in res.tokens)
  assert res.stats["kv_tokens_kept"] <= res.stats["capacity"]
  if budget >= max(lens) + new:
    full = rocketkv.generate(model, prompts, method="full", max_new_tokens=new, eos_token_ids=())
    assert res.tokens == full.tokens


def test_generate_large_budget_keeps_full_kv_tokens():
  """Issue 41: on a tiny Llama, B = 100000 kept the window only and left full KV's tokens."""
  model = _tiny_model()
  prompts = [_tokens(1, 106, seed=11)[0].tolist()]
  full = rocketkv.generate(model, prompts, method="full", max_new_tokens=4, eos_token_ids=())
  big = rocketkv.generate(model, prompts, method="rocketkv", token_budget=100_000,
                          max_new_tokens=4, eos_token_ids=())
  assert big.tokens == full.tokens
  assert big.stats["kv_tokens_kept"] == 106


if __name__ == "__main__":
  args = sys.argv[1:]
  if args[:1] == ["--examples"]:
    os.environ["FUZZ_EXAMPLES"] = args[1]
    args = args[2:]
  sys.exit(pytest.main(["-q", __file__, "-p", "no:cacheprovider"] + args))

"""Every bad input gets a ValueError naming the argument and the allowed range."""

import jax.numpy as jnp
import pytest

import rocketkv_jax as rocketkv


def _arrays(b=1, hq=4, hkv=2, l=64, w=8, d=16, dtype=jnp.float32):
  k = jnp.zeros((b, hkv, l, d), dtype)
  return k, k, jnp.zeros((b, hq, w, d), dtype)


CFG = rocketkv.RocketConfig(token_budget=32, window_size=8)
PLAN = rocketkv.plan(CFG, 64, 4, 16)


@pytest.mark.parametrize("kwargs,match", [
    (dict(token_budget=16, window_size=32), "token_budget must be >= window_size"),
    (dict(token_budget=0), "token_budget must be an int"),
    (dict(token_budget=-5), "token_budget must be an int"),
    (dict(token_budget=64, method="h2o"), "method must be one of"),
    (dict(token_budget=64, kernel_size=4), "kernel_size must be odd"),
    (dict(token_budget=64, top_k=0), "top_k must be an int"),
    (dict(token_budget=64, alpha=1.5), "alpha must be a float"),
    (dict(token_budget=4, method="streamingllm", sink_size=4), "token_budget must be > sink"),
])
def test_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    rocketkv.RocketConfig(**kwargs)


@pytest.mark.parametrize("args,match", [
    ((0, 10, 64), "prompt_len must be an int"),
    ((100, -1, 64), "max_new_tokens must be an int"),
    ((100, 10, 0), "head_dim must be an int"),
])
def test_plan_errors(args, match):
  with pytest.raises(ValueError, match=match):
    rocketkv.plan(CFG, *args)


def test_r_larger_than_head_dim():
  with pytest.raises(ValueError, match="r must be in"):
    rocketkv.plan(rocketkv.RocketConfig(token_budget=64, r=65), 1000, 4, 64)


def test_capacity_override_too_small():
  with pytest.raises(ValueError, match="capacity must be >="):
    rocketkv.plan(rocketkv.RocketConfig(token_budget=64, capacity=20), 1000, 4, 64)


def test_prefill_errors():
  k, v, qw = _arrays()
  with pytest.raises(ValueError, match="multiple of the KV heads"):
    rocketkv.prefill(k, v, jnp.zeros((1, 3, 8, 16)), PLAN)
  with pytest.raises(ValueError, match="same shape"):
    rocketkv.prefill(k, v[:, :, :10], qw, PLAN)
  with pytest.raises(ValueError, match="same dtype"):
    rocketkv.prefill(k, v.astype(jnp.bfloat16), qw, PLAN)
  with pytest.raises(ValueError, match="window longer than the prompt"):
    rocketkv.prefill(k[:, :, :4], v[:, :, :4], qw, PLAN)
  with pytest.raises(ValueError, match="head dim"):
    rocketkv.prefill(k[..., :8], v[..., :8], qw[..., :8], PLAN)
  with pytest.raises(ValueError, match="q_window must have shape"):
    rocketkv.prefill(k, v, qw[0], PLAN)
  with pytest.raises(ValueError, match="lengths must have shape"):
    rocketkv.prefill(k, v, qw, PLAN, lengths=jnp.array([3, 4]))
  with pytest.raises(ValueError, match="plan must be a Plan"):
    rocketkv.prefill(k, v, qw, CFG)
  with pytest.raises(ValueError, match="impl must be one of"):
    rocketkv.evict(k, v, qw, PLAN, impl="cuda")


def test_decode_errors():
  k, v, qw = _arrays()
  cache = rocketkv.prefill(k, v, qw, PLAN)
  q = jnp.zeros((1, 4, 16))
  kn = jnp.zeros((1, 2, 1, 16))
  with pytest.raises(ValueError, match="k_new must have shape"):
    rocketkv.decode_step(q, kn[:, :1], kn, cache, PLAN)
  with pytest.raises(ValueError, match="dtype"):
    rocketkv.decode_step(q, kn.astype(jnp.bfloat16), kn, cache, PLAN)
  with pytest.raises(ValueError, match="multiple of the KV heads"):
    rocketkv.decode_step(jnp.zeros((1, 3, 16)), kn, kn, cache, PLAN)
  with pytest.raises(ValueError, match="q must have shape"):
    rocketkv.decode_step(jnp.zeros((1, 4, 8)), kn, kn, cache, PLAN)
  with pytest.raises(ValueError, match="sliding_window"):
    rocketkv.decode_step(q, kn, kn, cache, PLAN, sliding_window=0)
  with pytest.raises(ValueError, match="idx must have shape"):
    rocketkv.attend(q, cache, jnp.zeros((1, 3, 4), jnp.int32))

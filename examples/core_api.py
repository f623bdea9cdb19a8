"""The README's core-API example with random tensors: stage 1 on a prompt, then decode steps.

    python examples/core_api.py
"""

import functools

import jax
import jax.numpy as jnp

import rocketkv_jax as rocketkv


def main(prompt_len: int = 4096, new_tokens: int = 8, budget: int = 256):
  b, hq, hkv, d = 2, 32, 8, 128
  cfg = rocketkv.RocketConfig(token_budget=budget)
  plan = rocketkv.plan(cfg, prompt_len=prompt_len, max_new_tokens=new_tokens, head_dim=d)
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  k = jax.random.normal(keys[0], (b, hkv, prompt_len, d), jnp.bfloat16)
  v = jax.random.normal(keys[1], (b, hkv, prompt_len, d), jnp.bfloat16)
  lengths = jnp.array([prompt_len, prompt_len - 1000], jnp.int32)  # a ragged batch
  q_window = jax.random.normal(keys[2], (b, hq, plan.window_size, d), jnp.bfloat16)
  cache = rocketkv.prefill(k, v, q_window, plan, lengths=lengths)

  @functools.partial(jax.jit, static_argnums=4, donate_argnums=3)
  def step(q, k_new, v_new, cache, plan):
    return rocketkv.decode_step(q, k_new, v_new, cache, plan)

  for t in range(new_tokens):
    kt = jax.random.fold_in(keys[3], t)
    q = jax.random.normal(kt, (b, hq, d), jnp.bfloat16)
    k_new = jax.random.normal(jax.random.fold_in(keys[4], t), (b, hkv, 1, d), jnp.bfloat16)
    v_new = jax.random.normal(jax.random.fold_in(keys[5], t), (b, hkv, 1, d), jnp.bfloat16)
    out, cache = step(q, k_new, v_new, cache, plan)
  print(f"plan: capacity={plan.capacity} prompt_budget={plan.prompt_budget} top_k={plan.top_k}"
        f" chunk_size={plan.chunk_size} r={plan.r}")
  print(f"kept slots per sequence: {cache.length.tolist()} of {lengths.tolist()} prompt tokens"
        f" + {new_tokens} new; out {out.shape} {out.dtype}")
  return out, cache


if __name__ == "__main__":
  main()

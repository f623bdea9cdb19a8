"""The README's core-API example with random tensors: stage 1 on a prompt, then decode steps.

    python examples/core_api.py
"""

import functools

import jax
import jax.numpy as jnp

import rocketkv_jax as rocketkv


def main(prompt_len: int = 4096, new_tokens: int = 8, budget: int = 256):
  b, hq, hkv, d = 2, 32, 8, 128  # batch B, query heads Hq, KV heads Hkv, head dim D
  cfg = rocketkv.RocketConfig(token_budget=budget)
  plan = rocketkv.plan(cfg, prompt_len=prompt_len, max_new_tokens=new_tokens, head_dim=d)
  keys = jax.random.split(jax.random.PRNGKey(0), 7)
  # One layer's prompt, right-padded to L = prompt_len: post-RoPE keys, values and queries.
  k = jax.random.normal(keys[0], (b, hkv, prompt_len, d), jnp.bfloat16)  # [B, Hkv, L, D]
  v = jax.random.normal(keys[1], (b, hkv, prompt_len, d), jnp.bfloat16)  # [B, Hkv, L, D]
  q = jax.random.normal(keys[6], (b, hq, prompt_len, d), jnp.bfloat16)   # [B, Hq, L, D]
  lengths = jnp.array([prompt_len, prompt_len - prompt_len // 4], jnp.int32)  # [B], ragged
  # The queries of each row's last W *valid* tokens (not the padded array's last W columns).
  q_window = rocketkv.last_valid_window(q, lengths, plan.window_size)  # [B, Hq, W, D]
  cache = rocketkv.prefill(k, v, q_window, plan, lengths=lengths)      # stage 1 -> KVCache

  @functools.partial(jax.jit, static_argnums=4, donate_argnums=3)
  def step(q, k_new, v_new, cache, plan):
    return rocketkv.decode_step(q, k_new, v_new, cache, plan)  # -> out [B, Hq, D], cache

  for t in range(new_tokens):
    kt = jax.random.fold_in(keys[3], t)
    q = jax.random.normal(kt, (b, hq, d), jnp.bfloat16)  # the new token's query [B, Hq, D]
    k_new = jax.random.normal(jax.random.fold_in(keys[4], t), (b, hkv, 1, d),
                              jnp.bfloat16)  # its key [B, Hkv, 1, D]
    v_new = jax.random.normal(jax.random.fold_in(keys[5], t), (b, hkv, 1, d),
                              jnp.bfloat16)  # its value [B, Hkv, 1, D]
    out, cache = step(q, k_new, v_new, cache, plan)  # out [B, Hq, D]
  print(f"plan: capacity={plan.capacity} prompt_budget={plan.prompt_budget} top_k={plan.top_k}"
        f" chunk_size={plan.chunk_size} r={plan.r}")
  print(f"kept slots per sequence: {cache.length.tolist()} of {lengths.tolist()} prompt tokens"
        f" + {new_tokens} new; out {out.shape} {out.dtype}")
  return out, cache


if __name__ == "__main__":
  main()

"""Selection quality from a prompt pass: how much of the exact attention mass a method reads.

For every layer the query of the last prompt token (it sees every prompt token) is scored
exactly against the full prompt K (softmax per query head). Each (method, budget) builds its
cache from the same prompt pass (`rocketkv.prefill`) and runs its stage-2 selection
(`rocketkv.select`) for that query; the slots it would read map to prompt positions through
`cache.pos`. Recall = exact attention mass on those positions (mean over query heads, layers
and batch rows; a method's dense layers, `Method.dense_layers`, read all of it). `exact_topk`
with the same budget is the best any B-token selection can do;
"kept" is the mass on every token stage 1 kept (what dense attention over the evicted cache
sees: SnapKV's whole read, RocketKV's stage-1 upper bound before stage 2).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import rocketkv_jax as rocketkv
from rocketkv_jax import methods as methods_lib
from rocketkv_jax.eval import variants
from rocketkv_jax.ops import group_queries, masked_softmax


def _exact_probs(q, k, lengths):
  """q [B, Hq, D], k [B, Hkv, L, D] -> probs [B, Hkv, G, L] over valid positions."""
  d = q.shape[2]
  length = k.shape[2]
  s = jnp.einsum("bhgd,bhld->bhgl", group_queries(q, k.shape[1]).astype(jnp.float32),
                 k.astype(jnp.float32)) / jnp.sqrt(float(d))
  return masked_softmax(s, (jnp.arange(length) < lengths[:, None])[:, None, None, :])


def _mass(probs, pos, ok):
  """probs [B, Hkv, G, L]; pos/ok [B, Hkv, K] -> [B] mean over heads of the mass at pos."""
  length = probs.shape[-1]
  onehot = jnp.zeros(probs.shape[:2] + (length,), jnp.float32)
  bi = jnp.arange(pos.shape[0])[:, None, None]
  hi = jnp.arange(pos.shape[1])[None, :, None]
  onehot = onehot.at[bi, hi, jnp.where(ok, pos, length)].set(1.0, mode="drop")
  return jnp.mean(jnp.sum(probs * onehot[:, :, None, :], axis=-1), axis=(1, 2))


@functools.partial(jax.jit, static_argnames=("plan",))
def _recall(k, v, qw, lengths, *, plan):
  # Every layer as a sparse one (the dense layers' rows are set below): the first layer index
  # the method does not keep dense.
  dense_set = set(methods_lib.get(plan.method).dense_layers(plan))
  sparse = min(set(range(len(dense_set) + 1)) - dense_set)

  def one(_, xs):
    kk, vv, qq = xs
    kk, vv = kk[:, :, :plan.prompt_len], vv[:, :, :plan.prompt_len]  # a pass with capacity
    q = qq[:, :, -1]
    probs = _exact_probs(q, kk, lengths)
    state = rocketkv.prefill(kk, vv, qq, plan, lengths=lengths, layer=sparse)
    cache = methods_lib.get(plan.method).view(state)
    kept_ok = jnp.arange(cache.capacity)[None, None, :] < cache.length[:, None, None]
    kept = _mass(probs, cache.pos, kept_ok)
    idx = rocketkv.select(q, state, plan)  # the state: stage2="lowrank" reads its summaries
    sel_ok = jnp.take_along_axis(kept_ok, idx, axis=2) & (idx < cache.capacity)
    pos = jnp.take_along_axis(cache.pos, jnp.clip(idx, 0, cache.capacity - 1), axis=2)
    read = _mass(probs, pos, sel_ok)
    return None, (kept, read)

  _, (kept, read) = lax.scan(one, None, (k, v, qw))
  # The method's dense layers (Quest's first two, RocketKV's skip_layers) keep and read every
  # prompt token: all of the mass.
  dense = [i for i in methods_lib.get(plan.method).dense_layers(plan) if i < k.shape[0]]
  if dense:
    kept, read = kept.at[jnp.asarray(dense)].set(1.0), read.at[jnp.asarray(dense)].set(1.0)
  return kept, read  # [N, B] each


def attention_recall(runner, pp, methods, budgets) -> list[dict]:
  """Rows {method, budget, kept_recall, read_recall, per_layer_read} for one prompt pass."""
  rows = []
  for m in methods:
    uses_budget = methods_lib.get(variants.base_method(m)).uses_budget
    for b in (budgets if uses_budget else [None]):
      plan = runner.plan(m, b or max(budgets), pp.padded_len, 1)
      kept, read = _recall(pp.k, pp.v, pp.q_window, pp.lengths, plan=plan)
      rows.append(dict(method=m, budget=b, kept_recall=float(jnp.mean(kept)),
                       read_recall=float(jnp.mean(read)),
                       per_layer_read=[float(x) for x in jnp.mean(read, axis=1)]))
  return rows

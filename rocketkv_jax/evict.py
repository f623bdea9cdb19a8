"""Stage 1 (prefill, permanent eviction), SnapKV style.

The last W prompt queries score every key: softmax(q k^T / sqrt(D)) with the causal mask, summed
over the window and over the G query heads of each KV head's group (`Plan.window_reduce="sum"`,
SnapKV and the paper; "max" takes the largest probability instead). Keys older than the window
are candidates; their scores are max-pooled (kernel `kernel_size`, 'same' padding, over
candidates only) and each KV head keeps the top `prompt_budget - W` candidates plus the window,
in position order. Prompts that fit in `prompt_budget` are kept whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from rocketkv_jax import _impl
from rocketkv_jax._checks import (check_lengths, divides, group_size, require,
                                require_float, require_layout, require_rank)
from rocketkv_jax.budget import Plan
from rocketkv_jax.cache import KVCache, from_kept
from rocketkv_jax.ops import (WINDOW_REDUCE, gather_rows, group_queries, masked_softmax,
                             sink_recent_indices)


def window_scores_xla(q_window: jax.Array, k: jax.Array, lengths: jax.Array,
                      reduce: str = "sum") -> jax.Array:
  """Attention mass each key receives from the window, summed (or maxed) over window and group.

  Args:
    q_window: [B, Hq, W, D] the last W valid queries of each sequence (post-RoPE).
    k: [B, Hkv, L, D] keys (post-RoPE), right-padded.
    lengths: [B] valid prompt lengths.
    reduce: "sum" | "max" over the W queries and the G heads of the group (`WINDOW_REDUCE`).
  Returns:
    [B, Hkv, L] float32; 0 at padding.
  """
  w, d = q_window.shape[2:]
  l = k.shape[2]
  q = group_queries(q_window, k.shape[1])
  logits = jnp.einsum("bhgwd,bhld->bhgwl", q, k, preferred_element_type=jnp.float32)
  logits = logits * (1.0 / jnp.sqrt(jnp.float32(d)))
  qpos = lengths[:, None] - w + jnp.arange(w)  # [B, W]
  kpos = jnp.arange(l)
  mask = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < lengths[:, None, None])
  p = masked_softmax(logits, mask[:, None, None])  # mask [B, 1, 1, W, L]
  return (jnp.max if reduce == "max" else jnp.sum)(p, axis=(2, 3))


def pooled_candidate_scores(scores: jax.Array, lengths: jax.Array, window: int,
                            kernel_size: int) -> jax.Array:
  """Max-pools candidate scores. [B, Hkv, L] -> [B, Hkv, L], -inf where not a candidate.

  Candidates of sequence b are positions < lengths[b] - window. A NaN score (a NaN in a prompt
  key or window query) ranks lowest: `lax.top_k` ranks NaN above +inf, which would drop the
  window that stage 1 always keeps.
  """
  l = scores.shape[-1]
  cand = (jnp.arange(l) < (lengths - window)[:, None])[:, None, :]
  s = jnp.where(cand & ~jnp.isnan(scores), scores.astype(jnp.float32), -jnp.inf)
  pooled = lax.reduce_window(s, -jnp.inf, lax.max, (1, 1, kernel_size), (1, 1, 1), "SAME")
  return jnp.where(cand, pooled, -jnp.inf)


def check_prefill_inputs(k, v, q_window, plan: Plan, lengths, exact_window: bool = False) -> None:
  """Shapes, dtypes and plan of a prefill call (`evict`, `rocketkv.prefill`); ValueError if bad.

  `exact_window` (`rocketkv.prefill`): W must be min(plan.window_size, L), checked before the
  budget so that a wrong window is named as such; otherwise any W in [1, L] (a later turn's)."""
  require(isinstance(plan, Plan), f"plan must be a Plan from rocketkv.plan(), got {type(plan)}")
  require_rank("k", k, 4, "[B, Hkv, L, D]")
  require_rank("v", v, 4, "[B, Hkv, L, D]")
  require_rank("q_window", q_window, 4, "[B, Hq, W, D]")
  require(k.shape == v.shape, f"k and v must have the same shape, got {k.shape} and {v.shape}")
  # Layout mistakes first, named as such: heads and tokens swapped ([B, L, H, D], a common
  # layout) otherwise surface as a heads or window mismatch.
  hq, hkv = q_window.shape[1], k.shape[1]
  require_layout(divides(hkv, hq) or not divides(k.shape[2], hq), "k", "[B, Hkv, L, D]",
                 k.shape, "[B, L, Hkv, D]", "transpose with k.transpose(0, 2, 1, 3) (and v)")
  window = min(plan.window_size, k.shape[2])
  require_layout(divides(hkv, hq) or not divides(hkv, q_window.shape[2]) or hq != window,
                 "q_window", "[B, Hq, W, D]", q_window.shape, "[B, W, Hq, D]",
                 "transpose with q_window.transpose(0, 2, 1, 3)")
  require(k.dtype == v.dtype, f"k and v must have the same dtype, got {k.dtype} and {v.dtype}")
  require_float("k", k)
  require(q_window.dtype == k.dtype,
          f"q_window must have the dtype of k and v ({k.dtype}), got {q_window.dtype}")
  b, hkv, l, d = k.shape
  require(q_window.shape[0] == b and q_window.shape[3] == d,
          f"q_window must have shape [B={b}, Hq, W, D={d}], got {q_window.shape}")
  group_size(q_window.shape[1], hkv, "q_window")
  w = q_window.shape[2]
  require(1 <= w <= l, f"q_window length W={w} must be in [1, L={l}] (window longer than the "
          f"prompt)")
  if exact_window:
    check_window(q_window, l, window)
  require(d == plan.head_dim, f"head dim D={d} must equal plan.head_dim={plan.head_dim}")
  require(w < l or w <= plan.window_size, f"q_window must be [B, Hq, W, D], the queries of "
          f"the last W <= plan.window_size={plan.window_size} valid tokens; got all L={l} "
          f"prompt queries: pass rocketkv.last_valid_window(q, lengths, plan.window_size)")
  require(w <= plan.prompt_budget or plan.prompt_budget >= l,
          f"window W={w} must be <= plan.prompt_budget={plan.prompt_budget}")
  require(plan.capacity >= min(plan.prompt_budget, l),
          f"plan.capacity={plan.capacity} must be >= the kept prompt tokens "
          f"{min(plan.prompt_budget, l)}")
  if lengths is not None:
    check_lengths(lengths, b, l)


def check_window(q_window, length: int, window: int) -> None:
  """q_window must hold exactly `window` queries, the last valid ones of a prompt of `length`."""
  w = q_window.shape[2]
  hint = ""
  if w == length:
    hint = ("; got all L prompt queries: pass rocketkv.last_valid_window(q, lengths, "
            "plan.window_size)")
  elif q_window.shape[1] == window:
    hint = (f"; got shape {tuple(q_window.shape)}: it looks like [B, W, Hq, D], transpose with "
            f"q_window.transpose(0, 2, 1, 3)")
  require(w == window, f"q_window length W={w} must equal min(plan.window_size, L) = {window} "
          f"(the last W valid queries, [B, Hq, W, D]){hint}")


def evict(k: jax.Array, v: jax.Array, q_window: jax.Array, plan: Plan, *,
          lengths: jax.Array | None = None, impl: str = "auto") -> KVCache:
  """Stage 1: keeps the window plus the top `plan.prompt_budget - W` tokens per KV head.

  Args:
    k, v: [B, Hkv, L, D] prompt keys (post-RoPE) and values, right-padded.
    q_window: [B, Hq, W, D] post-RoPE queries of the last W valid prompt tokens of each sequence.
    plan: from `rocketkv.plan`; uses `prompt_budget`, `capacity`, `chunk_size`, `kernel_size`,
      `window_reduce`.
    lengths: [B] valid prompt lengths (None: all L). A sequence shorter than the budget keeps
      every token.
    impl: "auto" | "xla" | "pallas" for the window scoring (either `window_reduce`).
  Returns:
    A `KVCache` of capacity `plan.capacity` holding min(prompt_budget, lengths[b]) tokens per
    sequence, in position order, with `seen = lengths`.
  """
  check_prefill_inputs(k, v, q_window, plan, lengths)
  b, hkv, l, d = k.shape
  w = q_window.shape[2]
  lengths = jnp.full((b,), l, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
  pb = plan.prompt_budget
  if pb >= l:  # every sequence fits: nothing to score
    pos = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, hkv, l))
    return from_kept(k, v, pos, lengths, lengths, plan.capacity, plan.chunk_size)
  xla = lambda: window_scores_xla(q_window, k, lengths, plan.window_reduce)  # noqa: E731
  scores = _impl.dispatch(impl, xla, "window_scores", q_window, k, lengths,
                          reduce=plan.window_reduce)
  pri = pooled_candidate_scores(scores, lengths, w, plan.kernel_size)
  kpos = jnp.arange(l)[None, None, :]
  keep_all = (lengths <= pb)[:, None, None]
  must = ((kpos >= (lengths - w)[:, None, None]) | keep_all) & (kpos < lengths[:, None, None])
  pri = jnp.where(must, jnp.inf, pri)
  _, idx = lax.top_k(pri, pb)  # [B, Hkv, pb]
  idx = jnp.sort(idx, axis=-1).astype(jnp.int32)  # valid positions come first
  kept = jnp.minimum(lengths, pb)
  return from_kept(gather_rows(k, idx), gather_rows(v, idx), idx, kept, lengths, plan.capacity,
                   plan.chunk_size)


def evict_streaming(k: jax.Array, v: jax.Array, plan: Plan, *,
                    lengths: jax.Array | None = None) -> KVCache:
  """StreamingLLM prefill: keeps `sink_size` first tokens and the most recent
  `prompt_budget - sink_size` tokens of each sequence, in position order."""
  b, hkv, l, d = k.shape
  lengths = jnp.full((b,), l, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
  pb = min(plan.prompt_budget, l)
  idx = jnp.clip(sink_recent_indices(lengths, pb, plan.sink_size), 0, l - 1).astype(jnp.int32)
  idx = jnp.broadcast_to(idx[:, None, :], (b, hkv, pb))
  kept = jnp.minimum(lengths, pb)
  return from_kept(gather_rows(k, idx), gather_rows(v, idx), idx, kept, lengths, plan.capacity,
                   plan.chunk_size)

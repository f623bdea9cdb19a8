"""Teacher-forced scoring: the log-probability a KV method's own cache gives a continuation.

    scores = rocketkv.score_continuations(model, contexts, continuations, method="rocketkv",
                                          token_budget=256)
    scores.logprobs[i]    # [M_i] fp32: log p(continuation[i][t] | context, continuation[:t])
    scores.is_argmax[i]   # [M_i] bool: that token was the argmax of its step's logits
    scores.totals, scores.greedy   # per row: summed log-prob, all tokens argmax

What is scored: the context is prefilled exactly as `rocketkv.generate` prefills a prompt
(`llama.prefill` -> `rocketkv.prefill` per layer: stage-1 eviction for the methods that evict),
then the continuation is fed token by token through the method's own decode step
(`llama.decode_step` -> `rocketkv.decode_step`: sparse selection, appends), as if the model had
generated it. So the score of token t is what the compressed cache predicts after the context
and the t forced tokens -- not what full attention over the whole text predicts. With
method="full" it equals the log-softmax of `model.logits(context + continuation)`.

Structure: one jitted program per (batch, padded context length L, padded continuation length M,
plan): the prefill, then one `lax.scan` over the M - 1 forced tokens. Nothing syncs with the host
per token. Contexts are right-padded (ragged lengths); the t-th forced token of row b sits at
position lengths[b] + t, as in `rocketkv.generate`.

Decisions:
  * The plan (budget split) is made for the padded batch (prompt_len = L, max_new_tokens = M),
    as `rocketkv.generate` makes it for a ragged batch; `pad_multiple` > 1 rounds L up to a
    multiple of it and M up to a power of two (fewer compiles for many lengths) at the price of
    a split made for the rounded lengths.
  * Teacher forcing a continuation c_0..c_{M-1} runs M - 1 decode steps (c_{M-1} is never fed),
    i.e. exactly the cache states `generate` would pass through if it produced c greedily; the
    plan is that of `generate(max_new_tokens=M)`, so a greedy continuation scores is_argmax
    everywhere under the same method and budget.
  * A batch's rows beyond a row's own continuation are fed pad id 0 and ignored.

`forced_logprobs` is the scan alone (a pure function from a prefilled cache), for callers that
build the cache themselves (e.g. one prompt pass shared by many methods).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from rocketkv_jax import methods
from rocketkv_jax.cache import cache_overflow
from rocketkv_jax.config import RocketConfig
from rocketkv_jax.config import plan as make_plan
from rocketkv_jax.runtime.generate import token_ids
from rocketkv_jax.models import llama
from rocketkv_jax.models.api import as_model


@dataclasses.dataclass
class ContinuationScores:
  """Output of `score_continuations` (one entry per request, in request order).

  Attributes:
    logprobs: per request, `[M_i]` fp32 log-probabilities of the continuation's tokens.
    is_argmax: per request, `[M_i]` bool: the token was the argmax of its step's logits.
  """

  logprobs: list[np.ndarray]
  is_argmax: list[np.ndarray]

  @property
  def totals(self) -> list[float]:
    """Summed log-probability of each continuation."""
    return [float(np.sum(lp, dtype=np.float64)) for lp in self.logprobs]

  @property
  def greedy(self) -> list[bool]:
    """Whether greedy decoding would have produced each continuation."""
    return [bool(np.all(a)) for a in self.is_argmax]


def _token_scores(logits: jnp.ndarray, target: jnp.ndarray):
  """logits `[B, V]` fp32, target `[B]` -> (log p(target) `[B]`, target is argmax `[B]`)."""
  logp = jax.nn.log_softmax(logits, axis=-1)
  lp = jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0]
  return lp, jnp.argmax(logits, axis=-1).astype(jnp.int32) == target


def forced_logprobs(params, cache, first_logits, forced, lengths, *, config, plan,
                    impl: str = "auto"):
  """Feeds `forced` through the decode step from a prefilled cache; pure and jittable.

  Args:
    params: the model's parameter pytree.
    cache: per-layer KV states from `llama.prefill` (made with `plan`).
    first_logits: `[B, V]` fp32 logits at each context's last token (predicting forced[:, 0]).
    forced: `[B, M]` int32 continuation ids (M >= 1; pad past a row's end with any id).
    lengths: `[B]` int32 context lengths (forced[:, t] sits at position lengths + t).
    config: static `ModelConfig`; plan: static `rocketkv.Plan`; impl: the core's hot path.

  Returns:
    (logprobs `[B, M]` fp32, is_argmax `[B, M]` bool, overflow `[B]` bool, final cache).
  """
  lp0, am0 = _token_scores(first_logits, forced[:, 0])
  m = forced.shape[1]

  def step(cache, xs):
    t, tok, target = xs
    logits, cache = llama.decode_step(params, cache, tok, lengths + t, config=config, plan=plan,
                                      impl=impl)
    return cache, _token_scores(logits, target)

  xs = (jnp.arange(m - 1, dtype=jnp.int32), forced[:, :-1].T, forced[:, 1:].T)
  cache, (lps, ams) = lax.scan(step, cache, xs)
  logprobs = jnp.concatenate([lp0[:, None], lps.T], axis=1)
  is_argmax = jnp.concatenate([am0[:, None], ams.T], axis=1)
  return logprobs, is_argmax, cache_overflow(cache), cache


@functools.partial(jax.jit, static_argnames=("config", "plan", "block_size", "impl"))
def _score_batch(params, context, lengths, forced, *, config, plan, block_size, impl):
  first_logits, cache = llama.prefill(params, context, lengths, config=config, plan=plan,
                                      block_size=block_size, impl=impl)
  logprobs, is_argmax, overflow, _ = forced_logprobs(
      params, cache, first_logits, forced, lengths, config=config, plan=plan, impl=impl)
  return logprobs, is_argmax, overflow


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _as_id_lists(name: str, seqs, vocab_size: int) -> list[list[int]]:
  """A list of id lists, or a `[B, L]` array as its rows; ids checked against the vocabulary."""
  if isinstance(seqs, (np.ndarray, jax.Array)) and np.ndim(seqs) == 2:
    seqs = list(np.asarray(seqs))
  if not isinstance(seqs, Sequence) or isinstance(seqs, (str, bytes)) or len(seqs) == 0:
    raise ValueError(f"{name} must be a non-empty list of token id lists or a [B, L] array")
  out = []
  for s in seqs:
    try:
      ids = token_ids(s, vocab_size)
    except ValueError as e:  # "prompts: ..." -> this argument's name
      raise ValueError(f"{name}{str(e).removeprefix('prompts')}") from None
    if not ids:
      raise ValueError(f"every entry of {name} must have at least one token")
    out.append(ids)
  return out


def score_continuations(
    model,
    contexts,
    continuations,
    *,
    method: str = "full",
    token_budget: int = 256,
    rocket_config: RocketConfig | None = None,
    batch_size: int = 8,
    pad_multiple: int = 1,
    block_size: int = 512,
    impl: str = "auto",
) -> ContinuationScores:
  """Teacher-forced per-token log-probs of `continuations` after `contexts` under a KV method.

  Args:
    model: a `rocketkv.models.Model`, or its NNX module (`model.module`).
    contexts: N token id lists (each >= 1 token), prefilled.
    continuations: N token id lists (each >= 1 token), forced through the decode steps.
    method: one of `rocketkv.METHODS`; token_budget: its budget B (ignored by "full").
    rocket_config: a full `rocketkv.RocketConfig` (overrides method / token_budget).
    batch_size: rows per compiled batch. Requests are sorted by length and the last batch of a
      multi-batch call is filled with copies of its last row (outputs dropped), so every batch
      of a call has the same row count.
    pad_multiple: 1: pad to the batch's longest context / continuation (exact plan). Larger:
      round the padded context length up to a multiple of it and the continuation length up to
      a power of two (fewer compiled programs; the plan is made for the rounded lengths).
    block_size: prefill attention tile. impl: "auto" | "xla" | "pallas".

  Returns:
    `ContinuationScores`, in request order.

  Raises:
    ValueError: bad argument, or a context + continuation longer than the model's context.
    RuntimeError: KV cache overflow (cannot happen with a plan made for these lengths).
  """
  model = as_model(model)
  ctxs = _as_id_lists("contexts", contexts, model.config.vocab_size)
  conts = _as_id_lists("continuations", continuations, model.config.vocab_size)
  if len(ctxs) != len(conts):
    raise ValueError(f"contexts and continuations must have the same length, got {len(ctxs)} "
                     f"and {len(conts)}")
  for name, val in (("batch_size", batch_size), ("pad_multiple", pad_multiple),
                    ("token_budget", token_budget)):
    if not isinstance(val, int) or isinstance(val, bool) or val < 1:
      raise ValueError(f"{name} must be an int >= 1, got {val!r}")
  if rocket_config is None:
    methods.get(method)  # ValueError naming the registered methods
    rocket_config = RocketConfig(token_budget=token_budget, method=method)
  config = model.config
  limit = config.max_position_embeddings
  for i, (c, f) in enumerate(zip(ctxs, conts)):
    if len(c) + len(f) - 1 > limit:
      raise ValueError(f"request {i}: context ({len(c)} tokens) + continuation ({len(f)}) - 1 "
                       f"exceeds the model's context of {limit} tokens")

  n = len(ctxs)
  order = sorted(range(n), key=lambda i: (-(len(ctxs[i]) + len(conts[i])), i))
  logprobs: list = [None] * n
  is_argmax: list = [None] * n
  for start in range(0, n, batch_size):
    rows = order[start:start + batch_size]
    fill = rows + [rows[-1]] * ((batch_size - len(rows)) if n > batch_size else 0)
    lengths = np.array([len(ctxs[i]) for i in fill], np.int32)
    big_l = min(_round_up(int(lengths.max()), pad_multiple), limit)
    big_m = max(len(conts[i]) for i in fill)
    if pad_multiple > 1:
      big_m = max(min(1 << (big_m - 1).bit_length(), limit + 1 - big_l), big_m)
    context = np.zeros((len(fill), big_l), np.int32)
    forced = np.zeros((len(fill), big_m), np.int32)
    for r, i in enumerate(fill):
      context[r, :len(ctxs[i])] = ctxs[i]
      forced[r, :len(conts[i])] = conts[i]
    plan = make_plan(rocket_config, big_l, big_m, config.head_dim)
    lp, am, overflow = _score_batch(model.params, jnp.asarray(context), jnp.asarray(lengths),
                                    jnp.asarray(forced), config=config, plan=plan,
                                    block_size=block_size, impl=impl)
    lp, am, overflow = np.asarray(lp), np.asarray(am), np.asarray(overflow)
    if overflow.any():
      raise RuntimeError(f"KV cache overflow (capacity {plan.capacity}) while scoring a batch "
                         f"planned for context {big_l} + continuation {big_m}")
    for r, i in enumerate(rows):
      logprobs[i] = lp[r, :len(conts[i])]
      is_argmax[i] = am[r, :len(conts[i])]
  return ContinuationScores(logprobs=logprobs, is_argmax=is_argmax)

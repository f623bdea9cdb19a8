"""The decode loop shared by `rocketkv.generate` and the eval runner, and its EOS rule.

    state = sample_loop(step_fn, cache, first, positions, eos, key, sampler,
                        max_new_tokens=64)
    rows = strip_eos(state.tokens, state.step, eos_ids)

One `lax.while_loop` on device: each iteration runs the model's decode step on the last
sampled token, samples the next one (`rocketkv_jax.runtime.sampling`), and stops when every sequence
has sampled an EOS or `max_new_tokens` tokens exist. Nothing syncs with the host per step.

EOS rule (one for both callers): `eos_token_ids=None` means the model's (tokenizer's, else its
config's); an empty list never stops early. A sequence that sampled an EOS keeps feeding it
until the batch finishes; `strip_eos` cuts each row before its first EOS.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax
import numpy as np


@struct.dataclass
class LoopState:
  """The carry of `sample_loop`."""

  step: jax.Array  # [] int32: the next index of `tokens` to fill (tokens so far)
  token: jax.Array  # [B] int32: the last sampled token, fed to the next step
  tokens: jax.Array  # [B, max_new_tokens] int32: every sampled token (EOS and after kept)
  done: jax.Array  # [B] bool: the sequence has sampled an EOS
  cache: Any  # the model's per-layer KV states


def default_eos_ids(model) -> tuple[int, ...]:
  """The tokenizer's EOS ids, else the model config's."""
  if model.tokenizer is not None and model.tokenizer.eos_token_ids:
    return tuple(int(e) for e in model.tokenizer.eos_token_ids)
  return tuple(int(e) for e in (model.config.eos_token_ids or ()))


def eos_array(eos_token_ids: Sequence[int]) -> jax.Array:
  """`[E]` int32 (E may be 0: never stop early)."""
  return jnp.asarray(np.array(list(eos_token_ids), np.int32).reshape(-1))


def is_eos(tokens: jax.Array, eos: jax.Array) -> jax.Array:
  """tokens `[B]`, eos `[E]` -> `[B]` bool."""
  return jnp.any(tokens[:, None] == eos[None, :], axis=-1)


def sample_loop(step_fn: Callable, cache, first: jax.Array, positions: jax.Array,
                eos: jax.Array, key: jax.Array, sampler, *, max_new_tokens: int,
                on_token: Callable | None = None) -> LoopState:
  """Decodes until every sequence sampled an EOS or `max_new_tokens` tokens exist.

  Args:
    step_fn: `(cache, tokens [B], positions [B]) -> (logits [B, V], cache)`.
    cache: the per-layer KV states after the prompt.
    first: `[B]` int32 the token sampled from the prompt (token 0).
    positions: `[B]` int32 the absolute position of `first`; token t sits at positions + t.
    eos: `[E]` int32 stop ids (`eos_array`).
    key: PRNG key; step t samples with `fold_in(key, t)`.
    sampler: a `sampling` strategy.
    max_new_tokens: static, >= 1.
    on_token: optional `(step, tokens [B], done [B]) -> None`, traced once per emitted token
      (e.g. an ordered `io_callback` for streaming).
  Returns:
    The final `LoopState`; `step` tokens of each row are filled.
  """
  b = first.shape[0]

  def emit(step, tok, tokens, done):
    tokens = tokens.at[:, step].set(tok)
    done = done | is_eos(tok, eos)
    if on_token is not None:
      on_token(step, tok, done)
    return tokens, done

  tokens, done = emit(0, first, jnp.zeros((b, max_new_tokens), jnp.int32), jnp.zeros((b,), bool))

  def cond(s: LoopState):
    return (s.step < max_new_tokens) & ~jnp.all(s.done)

  def body(s: LoopState):
    logits, cache = step_fn(s.cache, s.token, positions + s.step - 1)  # s.token is s.step - 1
    nxt = sampler(logits, jax.random.fold_in(key, s.step))
    nxt = jnp.where(s.done, s.token, nxt)
    tokens, done = emit(s.step, nxt, s.tokens, s.done)
    return LoopState(step=s.step + 1, token=nxt, tokens=tokens, done=done, cache=cache)

  return lax.while_loop(cond, body, LoopState(step=jnp.int32(1), token=first, tokens=tokens,
                                              done=done, cache=cache))


def strip_eos(tokens, steps: int, eos_token_ids: Sequence[int]) -> list[list[int]]:
  """Rows of `tokens [B, N]` (host) cut to `steps` and before their first EOS (dropped)."""
  eos = set(int(e) for e in eos_token_ids)
  rows = []
  for row in np.asarray(tokens)[:, :steps].tolist():
    toks = []
    for t in row:
      if t in eos:
        break
      toks.append(t)
    rows.append(toks)
  return rows

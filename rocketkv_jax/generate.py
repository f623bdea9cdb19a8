"""`rocketkv.generate`: batched text generation with any KV method, chosen by name.

    model = rocketkv.models.load(rocketkv.models.smollm2_path())
    result = rocketkv.generate(model, ["Hello"], method="rocketkv", token_budget=256,
                               max_new_tokens=64)
    result.text[0], result.stats

Structure (two compiled programs per (shapes, method, budget); none per step):
  1. prefill (jit): blockwise causal attention over the right-padded prompt batch, and per layer
     `rocketkv.prefill` builds that method's KV state; returns the first sampled token.
  2. decode (jit, cache donated): one `lax.while_loop` over `models.llama.decode_step`
     (-> `rocketkv.decode_step` per layer), sampling each next token on device, stopping when
     every sequence hit EOS or `max_new_tokens`. An optional streaming callback receives each
     step's tokens through an ordered `io_callback`.

Tensor parallelism: load the model with `rocketkv.models.load(path, mesh=make_mesh(tp))`;
`generate` is unchanged -- GSPMD propagates the head sharding of Q/K/V into the KV caches, so
each device holds and scores only its KV heads (tested: same tokens as one device).

Compilation: both programs are compiled ahead of time (`jit(...).lower(...).compile()`) and
cached per (static config, plan, argument shapes / shardings); a repeated call with the same
shapes compiles nothing (`stats["compile_s"] == 0`). A new prompt length is a new plan and so a
new compile (the plan's split depends on it).

Decisions where the issue is silent:
  * The t-th generated token of sequence b gets RoPE position lengths[b] + t (right padding).
  * Tokens after a sequence's EOS are not fed back in any meaningful way (the sequence keeps
    stepping with EOS until the batch finishes) and are dropped from the result; the EOS itself
    is dropped too.
  * `temperature == 0` is greedy (argmax); otherwise softmax(logits / temperature) restricted to
    the smallest top-p nucleus, with `jax.random` keyed by `seed` and the step index.
  * A cache overflow (an append into a full cache, which the core drops) raises RuntimeError on
    the host after the loop; it cannot happen with a plan made for these lengths.
  * Stats: `kv_tokens_kept` is the number of valid cache slots per layer after prefill (stage 1),
    `kv_tokens_read` the tokens attended per decode step (top-k for sparse methods, else the
    whole valid cache), and `compression_ratio` = (prompt + new tokens) / kv_tokens_read.
    Times are wall-clock with compilation reported separately (`compile_s`). `kv_cache_bytes` is
    the size of every layer's KV state; `peak_bytes` XLA's memory estimate (arguments + outputs +
    temporaries) of the larger of the two compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import io_callback
import numpy as np

import rocketkv_jax as rocketkv
from rocketkv_jax.models import llama


@dataclasses.dataclass
class GenerationResult:
  """Output of `generate`.

  Attributes:
    tokens: per prompt, the generated ids (EOS and anything after it removed).
    text: per prompt, the decoded text (None when the model has no tokenizer).
    stats: per-run numbers (see the module docstring).
  """

  tokens: list[list[int]]
  text: list[str] | None
  stats: dict[str, Any]


# --------------------------------------------------------------------------- sampling
def _sample(logits: jnp.ndarray, key, temperature, top_p, greedy: bool) -> jnp.ndarray:
  """logits `[B, V]` fp32 -> token ids `[B]` int32."""
  if greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / jnp.maximum(temperature, 1e-6)
  sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  cum = jnp.cumsum(probs, axis=-1)
  # keep the smallest prefix whose mass reaches top_p (always at least the top token)
  keep = (cum - probs) < top_p
  cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
  logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# --------------------------------------------------------------------------- streaming
_STREAM: list[Callable | None] = [None]


def _stream_trampoline(step, tokens, done):
  cb = _STREAM[0]
  if cb is not None:
    cb(int(step), np.asarray(tokens), np.asarray(done))
  return np.zeros((), np.int32)


# --------------------------------------------------------------------------- programs
def _prefill_fn(params, tokens, lengths, key, temperature, top_p, *, config, plan, greedy,
                block_size, impl):
  logits, cache = llama.prefill(params, tokens, lengths, config=config, plan=plan,
                                block_size=block_size, impl=impl)
  first = _sample(logits, jax.random.fold_in(key, 0), temperature, top_p, greedy)
  return first, cache


def _decode_fn(params, cache, first, lengths, key, temperature, top_p, eos, *, config, plan,
               greedy, max_new_tokens, stream, impl):
  b = first.shape[0]
  out = jnp.zeros((b, max_new_tokens), jnp.int32)
  is_eos = lambda t: jnp.any(t[:, None] == eos[None, :], axis=-1) if eos.shape[0] else \
      jnp.zeros(t.shape, bool)

  def emit(step, tok, out, done):
    out = out.at[:, step].set(tok)
    done = done | is_eos(tok)
    if stream:
      io_callback(_stream_trampoline, jax.ShapeDtypeStruct((), jnp.int32), step, tok, done,
                  ordered=True)
    return out, done

  out, done = emit(0, first, out, jnp.zeros((b,), bool))

  def cond(carry):
    step, _, _, done, _ = carry
    return (step < max_new_tokens) & ~jnp.all(done)

  def body(carry):
    step, tok, out, done, cache = carry
    positions = lengths + step - 1  # the token being fed was generated at step - 1
    logits, cache = llama.decode_step(params, cache, tok, positions, config=config, plan=plan,
                                      impl=impl)
    nxt = _sample(logits, jax.random.fold_in(key, step), temperature, top_p, greedy)
    nxt = jnp.where(done, tok, nxt)
    out, done = emit(step, nxt, out, done)
    return step + 1, nxt, out, done, cache

  steps, _, out, done, cache = lax.while_loop(
      cond, body, (jnp.int32(1), first, out, done, cache))
  return out, steps, rocketkv.cache_overflow(cache), cache


_COMPILED: dict[Any, Any] = {}


def _peak_bytes(exe) -> int:
  """XLA's estimate of the memory one compiled program needs (arguments + outputs + temps)."""
  try:
    m = exe.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return 0
  if m is None:
    return 0
  peak = getattr(m, "peak_memory_in_bytes", 0) or 0
  total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
           - m.alias_size_in_bytes)
  return int(max(peak, total))


def _compiled(name, fn, static, donate, args):
  """AOT-compiles `fn` once per (static args, argument shapes); returns (executable, seconds)."""
  sig = (name, tuple(sorted(static.items())),
         tuple((a.shape, str(a.dtype), getattr(a, "sharding", None))
               for a in jax.tree_util.tree_leaves(args)),
         jax.tree_util.tree_structure(args))
  if sig in _COMPILED:
    return _COMPILED[sig], 0.0
  t0 = time.perf_counter()
  jitted = jax.jit(functools.partial(fn, **static), donate_argnums=donate)
  exe = jitted.lower(*args).compile()
  _COMPILED[sig] = exe
  return exe, time.perf_counter() - t0


class _Progress:
  """`generate(verbose=True)`: "<phase> ... (N s)" lines, the phase printed before it runs."""

  def __init__(self, on: bool):
    self.on = on

  def start(self, what: str) -> None:
    if self.on:
      print(f"{what} ...", end=" ", flush=True)

  def done(self, seconds: float) -> None:
    if self.on:
      print("(cached)" if seconds == 0.0 else f"({seconds:.1f} s)", flush=True)


# --------------------------------------------------------------------------- inputs
def _encode_prompts(model, prompts, chat: bool) -> list[list[int]]:
  if isinstance(prompts, (str, np.ndarray)) or (
      isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], (int, np.integer))):
    prompts = [prompts]
  if isinstance(prompts, np.ndarray):
    prompts = list(prompts)
  if not isinstance(prompts, Sequence) or len(prompts) == 0:
    raise ValueError("prompts must be a non-empty string, list of strings, or token id lists")
  out = []
  for p in prompts:
    if isinstance(p, str):
      if model.tokenizer is None:
        raise ValueError("string prompts need a model with a tokenizer; pass token ids instead")
      if chat:
        p = model.tokenizer.apply_chat_template([{"role": "user", "content": p}])
        out.append(model.tokenizer.encode(p, add_special_tokens=False))
      else:
        out.append(model.tokenizer.encode(p))
    else:
      ids = [int(t) for t in np.asarray(p).reshape(-1)]
      out.append(ids)
    if not out[-1]:
      raise ValueError("every prompt must have at least one token")
  return out


def generate(
    model,
    prompts,
    *,
    method: str = "rocketkv",
    token_budget: int = 256,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    chat: bool = False,
    stream: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
    rocket_config: "rocketkv.RocketConfig | None" = None,
    block_size: int = 512,
    impl: str = "auto",
    verbose: bool = False,
) -> GenerationResult:
  """Generates continuations of `prompts` with the KV method `method`.

  Args:
    model: a `rocketkv.models.Model` (from `rocketkv.models.load`).
    prompts: a string, a list of strings, a list of token ids, or a list of those.
    method: one of `rocketkv.METHODS` ("full", "exact_topk", "snapkv", "quest", "sparq",
      "streamingllm", "rocketkv", "rocketkv_mt").
    token_budget: the method's token budget B (ignored by "full").
    max_new_tokens: >= 1 tokens to generate at most.
    temperature: 0 for greedy, else the sampling temperature (> 0).
    top_p: nucleus mass in (0, 1].
    seed: sampling seed.
    eos_token_ids: stop ids; default the tokenizer's / config's EOS. Pass () to never stop early.
    chat: wrap each string prompt in the model's chat template (user turn + generation prompt).
    stream: optional `fn(step, tokens [B], done [B])` called on the host for every step.
    rocket_config: a full `rocketkv.RocketConfig` (overrides method / token_budget).
    block_size: prefill attention tile.
    impl: "auto" | "xla" | "pallas" for the core's hot path ("auto": Pallas kernels on GPU).
    verbose: print each phase as it runs, with its wall time: "compiling prefill ... (N s)",
      "prefill of M tokens ... (N s)", "compiling decode ... (N s)" (then any `stream` output).

  Returns:
    `GenerationResult`.

  Raises:
    ValueError: bad argument or prompt longer than the context. RuntimeError: cache overflow.
  """
  if max_new_tokens < 1 or not isinstance(max_new_tokens, int):
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  if method not in rocketkv.METHODS:
    raise ValueError(f"method must be one of {tuple(rocketkv.METHODS)}, got {method!r}")
  config = model.config
  ids = _encode_prompts(model, prompts, chat)
  lengths = np.array([len(p) for p in ids], np.int32)
  length = int(lengths.max())
  if length + max_new_tokens > config.max_position_embeddings:
    raise ValueError(
        f"prompt ({length} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
        f"context of {config.max_position_embeddings} tokens")
  pad = 0
  tokens = np.full((len(ids), length), pad, np.int32)
  for i, p in enumerate(ids):
    tokens[i, :len(p)] = p
  if eos_token_ids is None:
    eos_token_ids = config.eos_token_ids
    if model.tokenizer is not None and model.tokenizer.eos_token_ids:
      eos_token_ids = tuple(model.tokenizer.eos_token_ids)
  eos = jnp.asarray(np.array(list(eos_token_ids), np.int32).reshape(-1))

  rcfg = rocket_config or rocketkv.RocketConfig(token_budget=token_budget, method=method)
  plan = rocketkv.plan(rcfg, length, max_new_tokens, config.head_dim)
  greedy = temperature == 0.0
  key = jax.random.PRNGKey(seed)
  temp = jnp.float32(temperature)
  tp = jnp.float32(top_p)
  tokens_j, lengths_j = jnp.asarray(tokens), jnp.asarray(lengths)

  say = _Progress(verbose)
  pre_args = (model.params, tokens_j, lengths_j, key, temp, tp)
  say.start("compiling prefill")
  pre_exe, pre_compile = _compiled(
      "prefill", _prefill_fn,
      dict(config=config, plan=plan, greedy=greedy, block_size=block_size, impl=impl), (),
      pre_args)
  say.done(pre_compile)
  say.start(f"prefill of {int(lengths.sum())} tokens")
  t0 = time.perf_counter()
  first, cache = pre_exe(*pre_args)
  first.block_until_ready()
  prefill_s = time.perf_counter() - t0
  say.done(prefill_s)
  kept_cache = rocketkv.decoding_cache(cache[0])
  kv_kept = int(np.asarray(kept_cache.length).max())
  kv_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache))

  dec_args = (model.params, cache, first, lengths_j, key, temp, tp, eos)
  say.start("compiling decode")
  dec_exe, dec_compile = _compiled(
      "decode", _decode_fn,
      dict(config=config, plan=plan, greedy=greedy, max_new_tokens=max_new_tokens,
           stream=stream is not None, impl=impl), (1,), dec_args)
  say.done(dec_compile)
  _STREAM[0] = stream
  try:
    t0 = time.perf_counter()
    out, steps, overflow, _ = dec_exe(*dec_args)
    out = np.asarray(out)
    decode_s = time.perf_counter() - t0
  finally:
    _STREAM[0] = None
  steps = int(steps)
  overflow = np.asarray(overflow)
  if overflow.any():
    raise RuntimeError(
        f"KV cache overflow for batch rows {np.nonzero(overflow.reshape(-1, len(ids)).any(0))[0]}"
        f" (capacity {plan.capacity}); the plan was made for prompt_len={length}, "
        f"max_new_tokens={max_new_tokens}")

  eos_set = set(int(e) for e in eos_token_ids)
  result_tokens = []
  for row in out[:, :steps]:
    toks = []
    for t in row.tolist():
      if t in eos_set:
        break
      toks.append(t)
    result_tokens.append(toks)
  text = None
  if model.tokenizer is not None:
    text = [model.tokenizer.decode(t) for t in result_tokens]

  new = max(len(t) for t in result_tokens)
  read = min(plan.top_k, kv_kept + steps) if plan.top_k else kv_kept + steps
  stats = dict(
      method=plan.method, token_budget=plan.token_budget, batch=len(ids),
      prompt_lengths=lengths.tolist(), new_tokens=[len(t) for t in result_tokens],
      decode_steps=steps - 1, prefill_s=prefill_s, decode_s=decode_s,
      decode_ms_per_token=1e3 * decode_s / max(steps - 1, 1),
      decode_tokens_per_s=(steps - 1) * len(ids) / decode_s if steps > 1 else 0.0,
      compile_s=pre_compile + dec_compile,
      kv_tokens_full=length + new, kv_tokens_kept=kv_kept, kv_tokens_read=int(read),
      compression_ratio=(length + new) / max(int(read), 1),
      capacity=plan.capacity, plan=plan, kv_cache_bytes=int(kv_bytes),
      peak_bytes=max(_peak_bytes(pre_exe), _peak_bytes(dec_exe)),
  )
  return GenerationResult(tokens=result_tokens, text=text, stats=stats)

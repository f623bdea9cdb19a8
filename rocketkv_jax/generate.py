"""`rocketkv.generate`: batched text generation with any KV method, chosen by name.

    model = rocketkv.models.load(rocketkv.models.smollm2_path())
    result = rocketkv.generate(model, ["Hello"], method="rocketkv", token_budget=256,
                               max_new_tokens=64)
    result.text[0], result.stats

Structure (two compiled programs per (shapes, method, budget); none per step):
  1. prefill (jit): blockwise causal attention over the right-padded prompt batch, and per layer
     `rocketkv.prefill` builds that method's KV state; returns the first sampled token.
  2. decode (jit, cache donated): `decode_loop.sample_loop` (the loop the eval runner shares)
     over `models.llama.decode_step` (-> `rocketkv.decode_step` per layer), sampling each next
     token on device, stopping when every sequence hit EOS or `max_new_tokens`. An optional
     streaming callback receives each step's tokens through an ordered `io_callback`.
  The cache passes between the two as the `llama.LayerStack` the prompt pass's layer scans made
  (`llama.prefill(stacked=True)`), and the decode step scans over it: the KV method's ops are
  compiled once instead of once per layer (a smaller, faster-compiling decode program), and
  the prefill returns the scans' stacked states as they are instead of copying them out layer
  by layer.

Sharding: load the model with `rocketkv.models.load(path, mesh=sharding.make_mesh(tp, dp))`;
`generate` is unchanged. It finds the mesh on the parameters, splits the batch over "dp" and
GSPMD propagates the head sharding of Q/K/V into the KV caches, so each device holds and scores
only its sequences' KV heads (tested: same tokens as one device). The mesh may span processes
(`models/distributed.py`): every process calls `generate` with the same prompts (SPMD); the
inputs are global arrays each process places its own slices of, and the outputs the host reads
(tokens, overflow flags, step count) are replicated on device, so every process returns every
sequence's tokens; no host sync per step. A batch that "dp" does not divide is padded with
copies of its last prompt, whose outputs are dropped.

Compilation: both programs are compiled ahead of time (`jit(...).lower(...).compile()`) and
cached per (static config, plan, argument shapes / shardings); a repeated call with the same
shapes compiles nothing (`stats["compile_s"] == 0`). A new prompt length is a new plan and so a
new compile (the plan's split depends on it).

Decisions where the issue is silent:
  * The t-th generated token of sequence b gets RoPE position lengths[b] + t (right padding).
  * Tokens after a sequence's EOS are not fed back in any meaningful way (the sequence keeps
    stepping with EOS until the batch finishes) and are dropped from the result; the EOS itself
    is dropped too (`decode_loop`'s EOS rule).
  * `temperature == 0` is greedy (argmax); otherwise softmax(logits / temperature) restricted to
    the smallest top-p nucleus, with `jax.random` keyed by `seed` and the step index
    (`rocketkv_jax.sampling`).
  * A cache overflow (an append into a full cache, which the core drops) raises RuntimeError on
    the host after the loop; it cannot happen with a plan made for these lengths.
  * Stats: `kv_tokens_kept` is the number of valid cache slots per KV head after prefill
    (stage 1), `kv_tokens_read` the tokens attended per decode step (the method's
    `layer_reads`: top-k for sparse methods, else the whole valid cache), both the mean over
    layers (rounded), and `compression_ratio` = (prompt + new tokens) / that mean read. A
    method's dense layers (Quest's first two, RocketKV's `skip_layers`) count their whole
    cache; `kv_tokens_kept_per_layer` / `kv_tokens_read_per_layer` give each layer's.
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
from jax.experimental import io_callback
import numpy as np

from rocketkv_jax import decode_loop, methods, sampling
from rocketkv_jax.cache import cache_overflow
from rocketkv_jax.config import RocketConfig, check_num_layers
from rocketkv_jax.config import plan as make_plan
from rocketkv_jax.models import llama
from rocketkv_jax.models import sharding as sharding_lib
from rocketkv_jax.models.precision import compute_params


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


# --------------------------------------------------------------------------- streaming
_STREAM: list[Callable | None] = [None]


def _stream_trampoline(step, tokens, done):
  cb = _STREAM[0]
  if cb is not None:
    cb(int(step), np.asarray(tokens), np.asarray(done))
  return np.zeros((), np.int32)


# --------------------------------------------------------------------------- programs
def _host_out(x, out_sharding):
  """An output the host reads: replicated on `out_sharding`'s mesh (every process has it)."""
  return x if out_sharding is None else jax.lax.with_sharding_constraint(x, out_sharding)


def _prefill_fn(params, tokens, lengths, key, sampler, *, config, plan, block_size, impl,
                out_sharding):
  logits, cache = llama.prefill(params, tokens, lengths, config=config, plan=plan,
                                block_size=block_size, impl=impl, stacked=True)
  view = llama.state_view(plan, config)  # a hybrid's sliding layers: their own KVCache
  # [N] per layer, replicated (a stacked group's lengths are [layers, B])
  kept = jnp.concatenate([jnp.max(view(g).length, axis=-1).reshape(-1) for g in cache.groups])
  return sampler(logits, jax.random.fold_in(key, 0)), cache, _host_out(kept, out_sharding)


def _on_token(step, tok, done, *, out_sharding):
  # gathered first: the callback runs on one device, and GSPMD warns about (and rematerialises)
  # a batch-sharded operand it has to move there itself
  tok, done = _host_out(tok, out_sharding), _host_out(done, out_sharding)
  io_callback(_stream_trampoline, jax.ShapeDtypeStruct((), jnp.int32), step, tok, done,
              ordered=True)


def _decode_fn(params, cache, first, lengths, key, sampler, eos, *, config, plan,
               max_new_tokens, stream, impl, out_sharding):
  # bf16 weights on a CPU without bf16 dots: upcast once here, not in every step of the loop
  params = compute_params(params)
  step_fn = lambda c, t, p: llama.decode_step(params, c, t, p, config=config, plan=plan,
                                              impl=impl)
  s = decode_loop.sample_loop(step_fn, cache, first, lengths, eos, key, sampler,
                              max_new_tokens=max_new_tokens,
                              on_token=functools.partial(_on_token, out_sharding=out_sharding)
                              if stream else None)
  return (_host_out(s.tokens, out_sharding), s.step,
          _host_out(cache_overflow(s.cache), out_sharding), s.cache)


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
    rocket_config: RocketConfig | None = None,
    block_size: int = 512,
    impl: str = "auto",
    verbose: bool = False,
    pad_to: int | None = None,
) -> GenerationResult:
  """Generates continuations of `prompts` with the KV method `method`.

  Args:
    model: a `rocketkv.models.Model` (from `rocketkv.models.load`).
    prompts: a string, a list of strings, a list of token ids, or a list of those.
    method: a name from `rocketkv.METHODS` ("full", "exact_topk", "snapkv", "quest", "sparq",
      "streamingllm", "rocketkv", "rocketkv_mt", and any registered later).
    token_budget: the method's token budget B (ignored by "full").
    max_new_tokens: >= 1 tokens to generate at most.
    temperature: 0 for greedy, else the sampling temperature (> 0).
    top_p: nucleus mass in (0, 1].
    seed: sampling seed.
    eos_token_ids: stop ids; default the tokenizer's / config's EOS. Pass () to never stop early.
    chat: wrap each string prompt in the model's chat template (user turn + generation prompt).
    stream: optional `fn(step, tokens [B], done [B])` called on the host for every step (with
      several processes, on the process that owns the mesh's first device only).
    rocket_config: a full `rocketkv.RocketConfig` (overrides method / token_budget).
    block_size: prefill attention tile.
    impl: "auto" | "xla" | "pallas" for the core's hot path ("auto": Pallas kernels on GPU).
    verbose: print each phase as it runs, with its wall time: "compiling prefill ... (N s)",
      "prefill of M tokens ... (N s)", "compiling decode ... (N s)" (then any `stream` output).
    pad_to: pad the batch to at least this many prompt tokens and plan the budget split for
      that length instead of the longest prompt (None). Calls with the same `pad_to` share
      compiled programs, and the eval harness plans this way for its nominal context length;
      padding itself does not change any sequence's tokens (each row is masked to its length).

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
  method_obj = methods.get(method if rocket_config is None else rocket_config.method)
  config = model.config
  ids = _encode_prompts(model, prompts, chat)
  lengths = np.array([len(p) for p in ids], np.int32)
  longest = length = int(lengths.max())
  if pad_to is not None:
    if not isinstance(pad_to, (int, np.integer)) or isinstance(pad_to, bool) or pad_to < 1:
      raise ValueError(f"pad_to must be None or an int >= 1, got {pad_to!r}")
    length = max(length, int(pad_to))
  if length + max_new_tokens > config.max_position_embeddings:
    padded = " with pad_to" if length > longest else ""
    raise ValueError(
        f"prompt ({length} tokens{padded}) + max_new_tokens ({max_new_tokens}) exceeds the "
        f"model's context of {config.max_position_embeddings} tokens")
  mesh = sharding_lib.mesh_of(model.params)
  dp = 1 if mesh is None else sharding_lib.axis_size(mesh, "dp")
  rows = -(-len(ids) // dp) * dp  # padded with copies of the last prompt, dropped at the end
  pad = 0
  tokens = np.full((rows, length), pad, np.int32)
  for i, p in enumerate(ids + [ids[-1]] * (rows - len(ids))):
    tokens[i, :len(p)] = p
  row_lengths = np.concatenate([lengths, np.full(rows - len(ids), lengths[-1], np.int32)])
  if eos_token_ids is None:
    eos_token_ids = decode_loop.default_eos_ids(model)
  eos = np.asarray(decode_loop.eos_array(eos_token_ids))

  rcfg = rocket_config or RocketConfig(token_budget=token_budget, method=method)
  plan = make_plan(rcfg, length, max_new_tokens, config.head_dim)
  check_num_layers(plan, config.num_layers)
  sampler = sampling.sampler(temperature, top_p)
  key = np.asarray(jax.random.PRNGKey(seed))
  if mesh is None:
    out_sharding = None
    tokens_j, lengths_j, key, eos = (jnp.asarray(x) for x in (tokens, row_lengths, key, eos))
  else:  # global arrays: batch over "dp", the rest replicated; each process puts its slices
    out_sharding = sharding_lib.replicated(mesh)
    tokens_j, lengths_j = (sharding_lib.global_array(x, sharding_lib.batch_sharding(mesh, x.ndim))
                           for x in (tokens, row_lengths))
    key, eos = (sharding_lib.global_array(x, out_sharding) for x in (key, eos))
    sampler = jax.tree.map(lambda x: sharding_lib.global_array(x, out_sharding), sampler)

  say = _Progress(verbose)
  pre_args = (model.params, tokens_j, lengths_j, key, sampler)
  say.start("compiling prefill")
  pre_exe, pre_compile = _compiled(
      "prefill", _prefill_fn,
      dict(config=config, plan=plan, block_size=block_size, impl=impl,
           out_sharding=out_sharding), (), pre_args)
  say.done(pre_compile)
  say.start(f"prefill of {int(lengths.sum())} tokens")
  t0 = time.perf_counter()
  first, cache, kv_kept = pre_exe(*pre_args)
  first.block_until_ready()
  prefill_s = time.perf_counter() - t0
  say.done(prefill_s)
  kept_per_layer = [int(x) for x in np.asarray(kv_kept)]
  # the caller's rows only (every row's state has the same size): not the "dp" padding
  kv_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache)) * len(ids) // rows

  dec_args = (model.params, cache, first, lengths_j, key, sampler, eos)
  say.start("compiling decode")
  dec_exe, dec_compile = _compiled(
      "decode", _decode_fn,
      dict(config=config, plan=plan, max_new_tokens=max_new_tokens,
           stream=stream is not None, impl=impl, out_sharding=out_sharding), (1,), dec_args)
  say.done(dec_compile)
  n = len(ids)  # the stream sees the caller's rows, not the "dp" padding
  _STREAM[0] = stream and (lambda step, t, done: stream(step, t[:n], done[:n]))
  try:
    t0 = time.perf_counter()
    out, steps, overflow, _ = dec_exe(*dec_args)
    out = np.asarray(out)[:len(ids)]
    decode_s = time.perf_counter() - t0
  finally:
    _STREAM[0] = None
  steps = int(steps)
  overflow = np.asarray(overflow).reshape(-1, rows)[:, :len(ids)]
  if overflow.any():
    raise RuntimeError(
        f"KV cache overflow for batch rows {np.nonzero(overflow.any(0))[0]}"
        f" (capacity {plan.capacity}); the plan was made for prompt_len={length}, "
        f"max_new_tokens={max_new_tokens}")

  result_tokens = decode_loop.strip_eos(out, steps, eos_token_ids)
  text = None
  if model.tokenizer is not None:
    text = [model.tokenizer.decode(t) for t in result_tokens]

  new = max(len(t) for t in result_tokens)
  read_per_layer = llama.layer_reads(config, plan, kept_per_layer, steps)
  read = float(np.mean(read_per_layer))
  stats = dict(
      method=plan.method, token_budget=plan.token_budget, batch=len(ids),
      prompt_lengths=lengths.tolist(), new_tokens=[len(t) for t in result_tokens],
      decode_steps=steps - 1, prefill_s=prefill_s, decode_s=decode_s,
      decode_ms_per_token=1e3 * decode_s / max(steps - 1, 1),
      decode_tokens_per_s=(steps - 1) * len(ids) / decode_s if steps > 1 else 0.0,
      compile_s=pre_compile + dec_compile,
      kv_tokens_full=longest + new, kv_tokens_kept=round(float(np.mean(kept_per_layer))),
      kv_tokens_read=round(read), compression_ratio=(longest + new) / max(read, 1.0),
      kv_tokens_kept_per_layer=kept_per_layer, kv_tokens_read_per_layer=read_per_layer,
      capacity=plan.capacity, plan=plan, kv_cache_bytes=int(kv_bytes),
      peak_bytes=max(_peak_bytes(pre_exe), _peak_bytes(dec_exe)),
  )
  return GenerationResult(tokens=result_tokens, text=text, stats=stats)

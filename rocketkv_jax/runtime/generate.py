"""`rocketkv.generate`: batched text generation with any KV method, chosen by name.

    model = rocketkv.models.load(rocketkv.models.smollm2_path())
    result = rocketkv.generate(model, ["Hello"], method="rocketkv", token_budget=256,
                               max_new_tokens=64)
    result.text[0], result.stats

Two compiled programs per (shapes, method, budget), none per step:
  1. prefill (jit): blockwise causal attention over the right-padded prompt batch; per layer
     `rocketkv.prefill` builds the method's KV state; returns the first sampled token.
  2. decode (jit, cache donated): `decode_loop.sample_loop` over `models.llama.decode_step`,
     sampling on device until every sequence hit EOS or `max_new_tokens`; an optional stream
     callback receives each step's tokens (`StreamSink`).
  The cache passes between them as the prompt pass's `llama.LayerStack`, which the decode step
  scans over. Both are compiled ahead of time into a `ProgramCache` (`PROGRAMS` keeps the 16
  most recently used) keyed by config, plan and shapes: a repeated call compiles nothing.
A model loaded on a mesh runs sharded with no change here (batch over "dp", KV heads over "tp",
across processes too).

Parts: `_prepare` (arguments checked, prompts encoded, padded and placed, the plan), `_run` (the
two programs), `_stats`; `generate` chains them. Sharding, compilation, the sampling and EOS
rules and each stat's definition: docs/generation.md#inside-generate-rocketkv_jaxruntimegeneratepy.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import io_callback
import numpy as np

from rocketkv_jax import methods
from rocketkv_jax.runtime import decode_loop, sampling
from rocketkv_jax.cache import cache_overflow
from rocketkv_jax.config import RocketConfig, check_num_layers
from rocketkv_jax.config import plan as make_plan
from rocketkv_jax.models import llama
from rocketkv_jax.models.api import as_model
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


# --------------------------------------------------------------------------- programs
def _host_out(x, out_sharding):
  """An output the host reads: replicated on `out_sharding`'s mesh (every process has it)."""
  return x if out_sharding is None else jax.lax.with_sharding_constraint(x, out_sharding)


def prefill_program(params, tokens, lengths, key, sampler, *, config, plan, block_size, impl,
                    out_sharding):
  """`generate`'s prompt pass (jit with the keywords static): the right-padded batch
  `tokens [B, T]` -> (token 0 `[B]`, the stacked per-layer KV states, kept prompt tokens per
  layer and row `[N, B]`)."""
  logits, cache = llama.prefill(params, tokens, lengths, config=config, plan=plan,
                                block_size=block_size, impl=impl, stacked=True)
  view = llama.state_view(plan, config)  # a hybrid's sliding layers: their own KVCache
  # [N, B], replicated (a stacked group's lengths are [layers, B])
  kept = jnp.concatenate([view(g).length.reshape(-1, tokens.shape[0]) for g in cache.groups])
  return sampler(logits, jax.random.fold_in(key, 0)), cache, _host_out(kept, out_sharding)


def decode_program(params, cache, first, lengths, key, sampler, eos, stream_id=None, *, config,
                   plan, max_new_tokens, stream, impl, out_sharding):
  """`generate`'s decode loop (jit with the keywords static, `cache` donated): -> (tokens
  `[B, max_new_tokens]`, steps taken, overflow flags, the final cache).

  `stream`: None, or a `StreamSink` whose callback registered under the traced `stream_id`
  receives every step's tokens through an ordered `io_callback`.
  """
  # bf16 weights on a CPU without bf16 dots: upcast once here, not in every step of the loop
  params = compute_params(params)
  step_fn = lambda c, t, p: llama.decode_step(params, c, t, p, config=config, plan=plan,
                                              impl=impl)
  on_token = None
  if stream is not None:
    def on_token(step, tok, done):
      # gathered first: the callback runs on one device, and GSPMD warns about (and
      # rematerialises) a batch-sharded operand it has to move there itself
      tok, done = _host_out(tok, out_sharding), _host_out(done, out_sharding)
      io_callback(stream, jax.ShapeDtypeStruct((), jnp.int32), stream_id, step, tok, done,
                  ordered=True)
  s = decode_loop.sample_loop(step_fn, cache, first, lengths, eos, key, sampler,
                              max_new_tokens=max_new_tokens, on_token=on_token)
  return (_host_out(s.tokens, out_sharding), s.step,
          _host_out(cache_overflow(s.cache), out_sharding), s.cache)


class StreamSink:
  """The host end of a streaming decode program's `io_callback`: hands each step to the
  callback registered for the call that runs the program (its id is a program argument, so
  one compiled program serves every call and concurrent calls do not mix)."""

  def __init__(self):
    self._callbacks: dict[int, Callable] = {}
    self._ids = itertools.count()
    self._lock = threading.Lock()

  def register(self, fn: Callable) -> int:
    with self._lock:
      i = next(self._ids) % (1 << 31)
      self._callbacks[i] = fn
    return i

  def unregister(self, i: int) -> None:
    with self._lock:
      self._callbacks.pop(i, None)

  def __call__(self, stream_id, step, tokens, done):
    fn = self._callbacks.get(int(stream_id))
    if fn is not None:
      fn(int(step), np.asarray(tokens), np.asarray(done))
    return np.zeros((), np.int32)


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


class ProgramCache:
  """`generate`'s compiled programs, ahead of time (`jit(...).lower(...).compile()`), keyed by
  (program, static arguments, argument shapes / dtypes / shardings / tree structure).

  Bounded: at most `max_programs` executables (a prefill and a decode program per (shapes,
  method, budget) configuration), the least recently used dropped first; each compiled
  XLA:CPU program holds memory mappings of its own (`eval.runner.Runner.release_compiled`).
  `generate` uses the module's `PROGRAMS` unless given another. Not thread-safe.
  """

  def __init__(self, max_programs: int = 16):
    if not isinstance(max_programs, int) or max_programs < 2:
      raise ValueError(f"max_programs must be an int >= 2 (a prefill and a decode program), "
                       f"got {max_programs!r}")
    self.max_programs = max_programs
    self.stream_sink = StreamSink()
    self._exes: collections.OrderedDict[Any, Any] = collections.OrderedDict()

  def __len__(self) -> int:
    return len(self._exes)

  def clear(self) -> None:
    self._exes.clear()

  def get(self, name: str, fn: Callable, static: dict, donate: tuple, args: tuple):
    """(the executable of `jit(partial(fn, **static), donate_argnums=donate)` for `args`,
    seconds spent compiling it: 0.0 when it was cached)."""
    sig = (name, tuple(sorted(static.items())),
           tuple((a.shape, str(a.dtype), getattr(a, "sharding", None))
                 for a in jax.tree_util.tree_leaves(args)),
           jax.tree_util.tree_structure(args))
    if sig in self._exes:
      self._exes.move_to_end(sig)
      return self._exes[sig], 0.0
    t0 = time.perf_counter()
    exe = jax.jit(functools.partial(fn, **static), donate_argnums=donate).lower(*args).compile()
    self._exes[sig] = exe
    while len(self._exes) > self.max_programs:
      self._exes.popitem(last=False)
    return exe, time.perf_counter() - t0


PROGRAMS = ProgramCache()


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
def _prompt_list(prompts):
  """One prompt (a string, token ids, a `[L]` array) as a list of one; a `[B, L]` array as its
  rows; a list of prompts as it is."""
  if isinstance(prompts, jax.Array):
    prompts = np.asarray(prompts)
  if isinstance(prompts, np.ndarray):
    if prompts.ndim not in (1, 2):
      raise ValueError(f"prompts: an array of token ids must be [L] (one prompt) or [B, L] "
                       f"(one prompt per row), got shape {prompts.shape}")
    return [prompts] if prompts.ndim == 1 else list(prompts)
  if isinstance(prompts, str) or (
      isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], (int, np.integer))):
    return [prompts]
  return prompts


def token_ids(p, vocab_size: int) -> list[int]:
  """A prompt's token ids as Python ints; ValueError unless every one is an integer in
  [0, vocab_size) (an id past the vocabulary would be clamped by the embedding lookup)."""
  a = np.asarray(p)
  if a.size and not np.issubdtype(a.dtype, np.integer):
    raise ValueError(f"prompts: token ids must be integers, got dtype {a.dtype}")
  ids = [int(t) for t in a.reshape(-1)]
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"prompts: token ids must be in [0, vocab_size={vocab_size}), got {bad[:5]}")
  return ids


def _encode_prompts(model, prompts, chat: bool) -> list[list[int]]:
  prompts = _prompt_list(prompts)
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
      out.append(token_ids(p, model.config.vocab_size))
    if not out[-1]:
      raise ValueError("every prompt must have at least one token")
  return out


@dataclasses.dataclass
class _Inputs:
  """A checked call, ready to run: the caller's prompts, the plan and the placed arrays."""

  ids: list[list[int]]  # the caller's prompts (no "dp" padding)
  lengths: np.ndarray  # [len(ids)] their lengths
  rows: int  # the batch the programs run (len(ids) padded up to a multiple of "dp")
  length: int  # the padded prompt length the plan is for (>= every prompt's)
  max_new_tokens: int
  eos_token_ids: Sequence[int]
  plan: Any
  out_sharding: Any
  prefill_args: tuple  # (params, tokens, lengths, key, sampler)
  eos: Any


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def check_args(*, method, max_new_tokens, temperature, top_p, sampler, seed, eos_token_ids,
               rocket_config, **_):
  """The arguments `generate` and `Conversation` share, checked before any model work:
  ValueError naming the argument and what it takes."""
  if rocket_config is not None and not isinstance(rocket_config, RocketConfig):
    raise ValueError(f"rocket_config must be None or a rocketkv.RocketConfig, got "
                     f"{type(rocket_config).__name__}")
  methods.get(method if rocket_config is None else rocket_config.method)
  if not _is_int(max_new_tokens) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
  if not _is_number(temperature) or not math.isfinite(temperature) or temperature < 0:
    raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
  if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
  if sampler is not None and (temperature != 0.0 or top_p != 1.0):
    raise ValueError("sampler: pass a sampling strategy or temperature / top_p, not both")
  if not _is_int(seed) or not 0 <= seed < 2**32:  # (a wider one would be cut to 32 bits)
    raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
  if eos_token_ids is not None and (
      isinstance(eos_token_ids, (str, bytes)) or not isinstance(eos_token_ids, Sequence)
      or not all(_is_int(e) and e >= 0 for e in eos_token_ids)):
    raise ValueError(f"eos_token_ids must be None or a sequence of token ids (ints >= 0), got "
                     f"{eos_token_ids!r}")


def _pad_rows(ids: list, rows: int, length: int) -> tuple[np.ndarray, list[int]]:
  """`ids` right-padded into tokens [rows, length], the rows past len(ids) copies of the last
  one (a mesh's "dp" padding, dropped at the end); also each row's index into `ids`."""
  index = list(range(len(ids))) + [len(ids) - 1] * (rows - len(ids))
  tokens = np.zeros((rows, length), np.int32)
  for b, i in enumerate(index):
    tokens[b, :len(ids[i])] = ids[i]
  return tokens, index


def _place(out_sharding, batch: tuple, replicated: tuple) -> tuple[list, list]:
  """Host arrays as program inputs: on the default device, or (on `out_sharding`'s mesh) as
  global arrays, `batch` split over "dp" on its leading axis and `replicated` replicated;
  each process puts its own slices."""
  if out_sharding is None:
    return [jnp.asarray(x) for x in batch], [jnp.asarray(x) for x in replicated]
  mesh = out_sharding.mesh
  return ([sharding_lib.global_array(x, sharding_lib.batch_sharding(mesh, x.ndim)) for x in batch],
          [sharding_lib.global_array(x, out_sharding) for x in replicated])


def _prepare(model, prompts, *, method, token_budget, max_new_tokens, temperature, top_p, seed,
             eos_token_ids, chat, rocket_config, pad_to, sampler=None) -> _Inputs:
  """Checks the arguments, encodes and right-pads the prompts, plans, and places the inputs
  (on the model's mesh, the batch over "dp", if it has one)."""
  check_args(method=method, max_new_tokens=max_new_tokens, temperature=temperature,
             top_p=top_p, sampler=sampler, seed=seed, eos_token_ids=eos_token_ids,
             rocket_config=rocket_config)
  max_new_tokens = int(max_new_tokens)
  if sampler is not None:
    sampler = sampling.as_strategy(sampler)
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
  tokens, index = _pad_rows(ids, rows, length)
  row_lengths = lengths[index]
  if eos_token_ids is None:
    eos_token_ids = decode_loop.default_eos_ids(model)
  eos = np.asarray(decode_loop.eos_array(eos_token_ids))

  rcfg = rocket_config or RocketConfig(token_budget=token_budget, method=method)
  plan = make_plan(rcfg, length, max_new_tokens, config.head_dim)
  check_num_layers(plan, config.num_layers)
  if sampler is None:
    sampler = sampling.sampler(temperature, top_p)
  key = np.asarray(jax.random.PRNGKey(seed))
  out_sharding = None if mesh is None else sharding_lib.replicated(mesh)
  (tokens_j, lengths_j), (key, eos) = _place(out_sharding, (tokens, row_lengths), (key, eos))
  if mesh is not None:
    sampler = jax.tree.map(lambda x: sharding_lib.global_array(x, out_sharding), sampler)
  return _Inputs(ids=ids, lengths=lengths, rows=rows, length=length,
                 max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, plan=plan,
                 out_sharding=out_sharding,
                 prefill_args=(model.params, tokens_j, lengths_j, key, sampler), eos=eos)


# --------------------------------------------------------------------------- the run
@dataclasses.dataclass
class _Run:
  """What the two programs returned, for the caller's rows, and their costs."""

  tokens: np.ndarray  # [len(ids), max_new_tokens]
  steps: int
  kept: np.ndarray  # [layers, len(ids)] prompt tokens kept per layer and row
  kv_bytes: int
  prefill_s: float
  decode_s: float
  compile_s: float
  peak_bytes: int
  rows_read: np.ndarray | None = None  # [layers, len(ids)]: a reads_by_mass method's count
  cache: Any = None  # the decode's final `llama.LayerStack` (a conversation's next turn)


def _run(model, inp: _Inputs, *, programs: ProgramCache, stream, block_size, impl,
         verbose) -> _Run:
  """Compiles (or finds) and runs the prefill and decode programs; raises on a cache overflow."""
  say = _Progress(verbose)
  plan, n = inp.plan, len(inp.ids)
  say.start("compiling prefill")
  pre_exe, pre_compile = programs.get(
      "prefill", prefill_program,
      dict(config=model.config, plan=plan, block_size=block_size, impl=impl,
           out_sharding=inp.out_sharding), (), inp.prefill_args)
  say.done(pre_compile)
  say.start(f"prefill of {int(inp.lengths.sum())} tokens")
  t0 = time.perf_counter()
  first, cache, kv_kept = pre_exe(*inp.prefill_args)
  first.block_until_ready()
  prefill_s = time.perf_counter() - t0
  say.done(prefill_s)
  kept = np.asarray(kv_kept)[:, :n].astype(np.int64)
  # the caller's rows only (every row's state has the same size): not the "dp" padding
  kv_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(cache)) * n // inp.rows

  params, _, lengths_j, key, sampler = inp.prefill_args
  dec = _decode(model, plan, (params, cache, first, lengths_j, key, sampler, inp.eos),
                programs=programs, stream=stream, impl=impl, say=say, n=n, rows=inp.rows,
                max_new_tokens=inp.max_new_tokens, out_sharding=inp.out_sharding)
  if dec.overflow.any():
    raise RuntimeError(
        f"KV cache overflow for batch rows {np.nonzero(dec.overflow.any(0))[0]}"
        f" (capacity {plan.capacity}); the plan was made for prompt_len={inp.length}, "
        f"max_new_tokens={inp.max_new_tokens}")
  return _Run(tokens=dec.tokens, steps=dec.steps, kept=kept, kv_bytes=int(kv_bytes),
              prefill_s=prefill_s, decode_s=dec.seconds, compile_s=pre_compile + dec.compile_s,
              peak_bytes=max(_peak_bytes(pre_exe), dec.peak_bytes),
              rows_read=_rows_read(plan, dec.cache, n), cache=dec.cache)


@dataclasses.dataclass
class _Decoded:
  """What one run of the decode program returned, for the caller's rows."""

  tokens: np.ndarray  # [n, max_new_tokens]
  steps: int
  overflow: np.ndarray  # [groups, n] bool
  cache: Any  # the final `llama.LayerStack` (every row, "dp" padding included)
  seconds: float
  compile_s: float
  peak_bytes: int


def _decode(model, plan, dec_args: tuple, *, programs: ProgramCache, stream, impl, say, n: int,
            rows: int, max_new_tokens: int, out_sharding) -> _Decoded:
  """Compiles (or finds) and runs `decode_program` on `dec_args` = (params, cache `LayerStack`
  (donated), first token `[rows]`, its positions `[rows]`, key, sampler, eos)."""
  sink = None
  if stream is not None:
    sink = programs.stream_sink
    # the stream sees the caller's rows, not the "dp" padding
    stream_id = sink.register(lambda step, t, done: stream(step, t[:n], done[:n]))
    sid = np.asarray(stream_id, np.int32)
    dec_args += (jnp.asarray(sid) if out_sharding is None
                 else sharding_lib.global_array(sid, out_sharding),)
  say.start("compiling decode")
  try:
    dec_exe, dec_compile = programs.get(
        "decode", decode_program,
        dict(config=model.config, plan=plan, max_new_tokens=max_new_tokens, stream=sink,
             impl=impl, out_sharding=out_sharding), (1,), dec_args)
    say.done(dec_compile)
    t0 = time.perf_counter()
    out, steps, overflow, final = dec_exe(*dec_args)
    out = np.asarray(out)[:n]
    decode_s = time.perf_counter() - t0
  finally:
    if sink is not None:
      sink.unregister(stream_id)
  return _Decoded(tokens=out, steps=int(steps),
                  overflow=np.asarray(overflow).reshape(-1, rows)[:, :n], cache=final,
                  seconds=decode_s, compile_s=dec_compile, peak_bytes=_peak_bytes(dec_exe))


def _rows_read(plan, cache, n: int) -> np.ndarray | None:
  """[layers, n] rows read per KV head and decode step, for a method whose state counts them
  (`Method.reads_by_mass`); None for the others (their read is the plan's)."""
  method = methods.get(plan.method)
  # (a hybrid's sliding layers keep a window cache of their own; several processes hold parts)
  if (not method.reads_by_mass or jax.process_count() > 1
      or not all(hasattr(g, "rows") for g in cache.groups)):
    return None
  per = [np.asarray(method.rows_read(g)).reshape(-1, np.shape(g.rows)[-1]) for g in cache.groups]
  return np.concatenate(per)[:, :n]


def _kv_stats(config, plan, kept: np.ndarray, steps: int, full: np.ndarray,
              rows_read: np.ndarray | None = None) -> dict[str, Any]:
  """The KV numbers of `GenerationResult.stats` from the tokens each layer kept `[N, n]`, the
  decode steps taken and each row's whole context `[n]` (prompt + new tokens)."""
  n = kept.shape[1]
  # [layers, rows]: per row, its own kept tokens and the reads they imply
  read = np.array([llama.layer_reads(config, plan, [int(x) for x in kept[:, b]], steps)
                   for b in range(n)], np.float64).T
  if rows_read is not None:  # counted by the method's state: the mean over the steps
    read = rows_read.astype(np.float64)
  full = full.astype(np.float64)
  read_rows = read.mean(0)
  return dict(
      kv_tokens_full=round(float(full.mean())), kv_tokens_kept=round(float(kept.mean())),
      kv_tokens_read=round(float(read_rows.mean())),
      compression_ratio=float(full.mean() / max(read_rows.mean(), 1.0)),
      kv_tokens_full_per_row=[int(x) for x in full],
      kv_tokens_kept_per_row=[round(float(x)) for x in kept.mean(0)],
      kv_tokens_read_per_row=[round(float(x)) for x in read_rows],
      compression_ratio_per_row=[float(f / max(r, 1.0)) for f, r in zip(full, read_rows)],
      kv_tokens_kept_per_layer=[round(float(x)) for x in kept.mean(1)],
      kv_tokens_read_per_layer=[round(float(x)) for x in read.mean(1)],
      capacity=plan.capacity, plan=plan)


def _stats(inp: _Inputs, run: _Run, result_tokens: list[list[int]], config) -> dict[str, Any]:
  """`GenerationResult.stats` (the module docstring says what each number is)."""
  plan, n, steps = inp.plan, len(inp.ids), run.steps
  new = [len(t) for t in result_tokens]
  full = inp.lengths.astype(np.float64) + np.array(new)
  return dict(
      method=plan.method, token_budget=plan.token_budget, batch=n,
      prompt_lengths=inp.lengths.tolist(), new_tokens=new,
      decode_steps=steps - 1, prefill_s=run.prefill_s, decode_s=run.decode_s,
      decode_ms_per_token=1e3 * run.decode_s / max(steps - 1, 1),
      decode_tokens_per_s=(steps - 1) * n / run.decode_s if steps > 1 else 0.0,
      compile_s=run.compile_s,
      **_kv_stats(config, plan, run.kept.astype(np.float64), steps, full, run.rows_read),
      kv_cache_bytes=run.kv_bytes, peak_bytes=run.peak_bytes,
  )


def generate(
    model,
    prompts,
    *,
    method: str = "rocketkv",
    token_budget: int = 256,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    sampler: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
    seed: int = 0,
    eos_token_ids: Sequence[int] | None = None,
    chat: bool = False,
    stream: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
    rocket_config: RocketConfig | None = None,
    block_size: int = 512,
    impl: str = "auto",
    verbose: bool = False,
    pad_to: int | None = None,
    programs: ProgramCache | None = None,
) -> GenerationResult:
  """Generates continuations of `prompts` with the KV method `method`.

  Args:
    model: a `rocketkv.models.Model` (from `rocketkv.models.load`), or its NNX module
      (`model.module`, an `nnx_model.CausalLM`; then prompts are token ids).
    prompts: a string, a list of strings, a list of token ids (ints in [0, vocab_size)), a
      list of those, or an int array: `[L]` one prompt, `[B, L]` one prompt per row.
    method: a name from `rocketkv.METHODS` ("full", "exact_topk", "snapkv", "quest", "sparq",
      "streamingllm", "rocketkv", "rocketkv_mt", and any registered later).
    token_budget: the method's token budget B (ignored by "full").
    max_new_tokens: >= 1 tokens to generate at most.
    temperature: 0 for greedy, else the sampling temperature (> 0).
    top_p: nucleus mass in (0, 1].
    sampler: a sampling strategy instead of temperature / top_p (which then stay at their
      defaults): `rocketkv.sampling.Greedy()`, `TopP(temperature, top_p)`, `TopK(temperature,
      k)`, or one's own `fn(logits [B, V], key) -> ids [B] int32`: a pytree with array leaves,
      or a plain function (static: each new function object compiles again).
    seed: sampling seed, an int in [0, 2**32).
    eos_token_ids: stop ids; default the tokenizer's / config's EOS. Pass () to never stop early.
    chat: wrap each string prompt in the model's chat template (user turn + generation prompt).
    stream: optional `fn(step, tokens [B], done [B])` called on the host for every step (with
      several processes, on the process that owns the mesh's first device only).
    rocket_config: a full `rocketkv.RocketConfig` (overrides method / token_budget), e.g.
      `RocketConfig.recommended(256)`, the configuration the README recommends.
    block_size: prefill attention tile.
    impl: "auto" | "xla" | "pallas" for the core's hot path ("auto": Pallas kernels on GPU).
    verbose: print each phase as it runs, with its wall time: "compiling prefill ... (N s)",
      "prefill of M tokens ... (N s)", "compiling decode ... (N s)" (then any `stream` output).
    pad_to: pad the batch to at least this many prompt tokens and plan the budget split for
      that length instead of the longest prompt (None). Calls with the same `pad_to` share
      compiled programs, and the eval harness plans this way for its nominal context length;
      padding itself does not change any sequence's tokens (each row is masked to its length).
    programs: the `ProgramCache` to compile into and reuse from (default: the module's
      `PROGRAMS`, at most 16 programs, least recently used dropped first).

  Returns:
    `GenerationResult`.

  Raises:
    ValueError: bad argument or prompt longer than the context. RuntimeError: cache overflow.
  """
  check_args(method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
             sampler=sampler, seed=seed, eos_token_ids=eos_token_ids,
             rocket_config=rocket_config)  # before the model is touched
  model = as_model(model)
  inp = _prepare(model, prompts, method=method, token_budget=token_budget,
                 max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                 eos_token_ids=eos_token_ids, chat=chat, rocket_config=rocket_config,
                 pad_to=pad_to, sampler=sampler)
  run = _run(model, inp, programs=PROGRAMS if programs is None else programs, stream=stream,
             block_size=block_size, impl=impl, verbose=verbose)
  result_tokens = decode_loop.strip_eos(run.tokens, run.steps, inp.eos_token_ids)
  text = None
  if model.tokenizer is not None:
    text = [model.tokenizer.decode(t) for t in result_tokens]
  return GenerationResult(tokens=result_tokens, text=text,
                          stats=_stats(inp, run, result_tokens, model.config))

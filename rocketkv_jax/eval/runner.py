"""Jit-traced evaluation runner: one prompt pass per prompt batch, every method built from it.

    runner = Runner(model)
    pp = runner.prompt_pass(tokens, lengths)           # jit: full K/V + last-W queries per layer
    out = runner.decode(pp, method="rocketkv", token_budget=256, max_new_tokens=16)

The prompt pass runs the model once over a right-padded batch `[B, L]` with full (blockwise
causal) attention and keeps, for every layer, the post-RoPE keys and values of every prompt
token and the post-RoPE queries of the last W valid tokens. Because stage-1 eviction (SnapKV /
RocketKV), StreamingLLM's sink + window and the dense caches of Quest / SparQ / exact top-k /
full KV are all functions of exactly these tensors, every (method, budget) then builds its
cache with `rocketkv.prefill(k, v, q_window, plan, lengths=...)` per layer inside one jitted
program that also runs the greedy decode loop (`decode_loop.sample_loop`, the loop
`rocketkv.generate` uses, over `models.llama.decode_step`). A sweep therefore costs one prefill
per prompt batch; each (method, budget, padded length, batch size) compiles once, and once more
for the teacher-forced gold score (`_gold_scores_impl`, a program of its own).

The first generated token is the argmax of the prompt pass's last-token logits, which are the
same for every method (every method attends densely while reading the prompt), exactly as in
`rocketkv.generate`; later tokens are fed back with `positions = seen + step - 1`.

Multi-turn (`turn_prefill`, `models.llama.turn_prefill`): a later turn's prompt tokens are run
densely (full attention over the valid slots of the given per-layer KV caches, causal inside the
turn), which returns that turn's keys / values / last-W queries; the caller appends them
(`rocketkv.extend`) or re-runs stage 1 (`rocketkv.begin_turn`, RocketKV-MT).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

import rocketkv_jax as rocketkv
from rocketkv_jax import decode_loop, sampling, teacher_forced
from rocketkv_jax import methods as methods_lib
from rocketkv_jax.config import check_num_layers
from rocketkv_jax.eval import variants
from rocketkv_jax.models import llama
from rocketkv_jax.models.precision import compute_params


def _trim_host_memory() -> None:
  """Returns freed heap memory to the OS (glibc `malloc_trim`); a no-op elsewhere."""
  import ctypes
  import gc

  gc.collect()
  try:
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass


# --------------------------------------------------------------------------- programs
@dataclasses.dataclass
class PromptPass:
  """Output of the prompt pass for one right-padded batch.

  Attributes:
    k, v: `[N, B, Hkv, L, Dh]` post-RoPE keys / values of every layer.
    q_window: `[N, B, Hq, W, Dh]` post-RoPE queries of the last W valid tokens.
    lengths: `[B]` int32 valid prompt lengths.
    first: `[B]` int32 greedy first generated token (same for every method).
    first_logits: `[B, V]` fp32 logits at each prompt's last token (they predict `first`).
  """

  k: jax.Array
  v: jax.Array
  q_window: jax.Array
  lengths: jax.Array
  first: jax.Array
  first_logits: jax.Array

  @property
  def padded_len(self) -> int:
    return int(self.k.shape[3])

  @property
  def batch(self) -> int:
    return int(self.k.shape[1])


@functools.partial(jax.jit, static_argnames=("config", "window", "block_size"))
def _prompt_pass(params, tokens, lengths, *, config, window, block_size):
  last, outs = llama.prompt_pass(params, tokens, lengths, config=config, window=window,
                                 block_size=block_size,
                                 per_layer=lambda k, v, qw, layer: (k, v, qw))
  ks, vs, qws = (jnp.stack(xs) for xs in zip(*outs))
  logits = llama.unembed(params, config, last)
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, ks, vs, qws


def _greedy_loop(params, cache, first, seen, eos, *, config, plan, max_new_tokens):
  """Greedy decode: `first` [B] was sampled already and sits at position `seen`; `params`
  upcast (`compute_params`)."""
  step_fn = lambda c, t, p: llama.decode_step(params, c, t, p, config=config, plan=plan)
  s = decode_loop.sample_loop(step_fn, cache, first, seen, eos, jax.random.PRNGKey(0),
                              sampling.Greedy(), max_new_tokens=max_new_tokens)
  return s.tokens, s.step, s.cache


def _build_stack(k, v, qw, lengths, plan) -> llama.LayerStack:
  """The method's states from the stored prompt K/V `[N, ...]` as the scanned decode loop's
  `LayerStack`: each run of like layers built by one `lax.scan` over its own layers' slices.
  The method's dense layers (`layer=i`: every prompt token kept, a state of another shape) are
  built one by one. (One scan over all N layers, then slices of its output, held both at
  once: Quest's group of 28 layers cost 1.6 caches of temporaries instead of one; a scan over
  slices of the arguments copies those slices first.)"""
  def one(_, i):  # layer i's slices read inside the body: a slice of the arguments is a copy
    kk, vv, qq = (lax.dynamic_index_in_dim(x, i, keepdims=False) for x in (k, v, qw))
    return None, rocketkv.prefill(kk, vv, qq, plan, lengths=lengths)

  dense = methods_lib.get(plan.method).dense_layers(plan)
  groups, spans = [], llama.layer_spans(k.shape[0], plan)
  for lo, hi in spans:
    if lo in dense:
      groups.append(rocketkv.prefill(k[lo], v[lo], qw[lo], plan, lengths=lengths, layer=lo))
    elif hi == lo + 1:
      groups.append(rocketkv.prefill(k[lo], v[lo], qw[lo], plan, lengths=lengths))
    else:
      groups.append(lax.scan(one, None, jnp.arange(lo, hi))[1])
  return llama.LayerStack(groups=tuple(groups), spans=spans)


def _method_cache(k, v, qw, lengths, plan, scan_layers: bool):
  """The method's decode cache from the stored prompt K/V: a `LayerStack` (scanned layer loop),
  or per-layer states with `scan_layers=False` (unrolled; the same numbers)."""
  # The eval programs decode over a `LayerStack`: the KV method's ops compiled once, not once
  # per layer (issue #16: ~300 MB of machine code per program unrolled); the same numbers.
  cache = _build_stack(k, v, qw, lengths, plan)
  return cache if scan_layers else llama.unstack_cache(cache)


def _method_decode_impl(params, k, v, qw, lengths, first, eos, *, config, plan,
                        max_new_tokens, keep_cache, scan_layers=True):
  """Builds the method's cache and decodes greedily: (tokens `[B, max_new]`, steps, the final
  cache if `keep_cache` else None). `scan_layers=False` unrolls the layer loop (the same
  numbers; for benchmarks/eval_memory.py)."""
  cache = _method_cache(k, v, qw, lengths, plan, scan_layers)
  params = compute_params(params)  # bf16 on a CPU without bf16 dots: upcast once, not per step
  out, steps, cache = _greedy_loop(params, cache, first, lengths, eos, config=config, plan=plan,
                                   max_new_tokens=max_new_tokens)
  if keep_cache and scan_layers:
    cache = llama.unstack_cache(cache)
  return out, steps, (cache if keep_cache else None)


def _gold_scores_impl(params, k, v, qw, lengths, first_logits, ids, *, config, plan,
                      scan_layers=True):
  """Builds the method's cache as `_method_decode_impl` does and teacher-forces the gold ids
  `[B, G]` through the method's decode steps (`teacher_forced.forced_logprobs`): the per-token
  log-probs `[B, G]` and is-argmax flags.

  Its own program, run before the decode program, rather than a second loop inside it: two
  loops over one freshly built cache made XLA keep a copy of the cache for each loop next to
  the built one (2.5 caches of temporaries for full KV; issue #16 item 2), while two programs
  called one after the other each hold one."""
  cache = _method_cache(k, v, qw, lengths, plan, scan_layers)
  params = compute_params(params)
  lp, am, _, _ = teacher_forced.forced_logprobs(params, cache, first_logits, ids, lengths,
                                                config=config, plan=plan)
  return lp, am


_method_decode = jax.jit(_method_decode_impl, static_argnames=(
    "config", "plan", "max_new_tokens", "keep_cache"))
_gold_scores = jax.jit(_gold_scores_impl, static_argnames=("config", "plan"))


@functools.partial(jax.jit, static_argnames=("config", "plan", "max_new_tokens"))
def _continue_decode(params, cache, first, seen, eos, *, config, plan, max_new_tokens):
  params, cache = compute_params(params), llama.stack_cache(cache, plan)
  out, steps, cache = _greedy_loop(params, cache, first, seen, eos, config=config, plan=plan,
                                   max_new_tokens=max_new_tokens)
  return out, steps, llama.unstack_cache(cache)


_turn_prefill = jax.jit(llama.turn_prefill, static_argnames=("config", "window"))


# --------------------------------------------------------------------------- user API
_FUTURES: dict = {}  # ahead-of-time compiled decode programs (futures), shared by runners
_POOL: list = []


class Runner:
  """Binds a model; every method reuses one prompt pass.

  Args:
    model: a `rocketkv.models.Model`.
    window_size: stage-1 observation window W (RocketConfig default 32).
    block_size: prefill attention tile.
    quest_page_size: Quest's page size (`RocketConfig.page_size`).
    eos_token_ids: stop ids (None: the model's; `decode_loop`'s EOS rule).
  """

  def __init__(self, model, *, window_size: int = 32, block_size: int = 512,
               eos_token_ids=None, quest_page_size: int = 16):
    self.model = model
    self.quest_page_size = int(quest_page_size)
    self._futures = _FUTURES  # shared: executables take params as an argument
    self.config = model.config
    self.window_size = window_size
    self.block_size = block_size
    if eos_token_ids is None:
      eos_token_ids = decode_loop.default_eos_ids(model)
    self.eos_token_ids = tuple(int(e) for e in eos_token_ids)
    self._eos = decode_loop.eos_array(self.eos_token_ids)
    self.last_forced = None  # (log-probs, is-argmax) `[B, G]` of the last `decode(gold=...)`

  # ---------------------------------------------------------------- helpers
  def rocket_config(self, method: str, token_budget: int) -> "rocketkv.RocketConfig":
    """`method` is a name from `rocketkv.METHODS` or a variant spec (`eval.variants`)."""
    return variants.rocket_config(method, token_budget, window_size=self.window_size,
                                  page_size=self.quest_page_size)

  def plan(self, method: str, token_budget: int, prompt_len: int, max_new_tokens: int):
    plan = rocketkv.plan(self.rocket_config(method, token_budget), prompt_len, max_new_tokens,
                         self.config.head_dim)
    check_num_layers(plan, self.config.num_layers)
    return plan

  def strip(self, out: np.ndarray, steps: int) -> list[list[int]]:
    """Rows of generated ids cut at the first EOS (EOS dropped), as `rocketkv.generate`."""
    return decode_loop.strip_eos(out, steps, self.eos_token_ids)

  # ---------------------------------------------------------------- programs
  def prompt_pass(self, tokens: np.ndarray, lengths: np.ndarray) -> PromptPass:
    """tokens `[B, L]` right-padded ids, lengths `[B]` -> `PromptPass` (one jit call)."""
    tokens = np.asarray(tokens, np.int32)
    lengths = np.asarray(lengths, np.int32)
    if tokens.ndim != 2 or lengths.shape != (tokens.shape[0],):
      raise ValueError(f"tokens must be [B, L] and lengths [B], got {tokens.shape}, "
                       f"{lengths.shape}")
    if lengths.min() < 1 or lengths.max() > tokens.shape[1]:
      raise ValueError(f"lengths must be in [1, {tokens.shape[1]}], got {lengths.tolist()}")
    lj = jnp.asarray(lengths)
    first, logits, k, v, qw = _prompt_pass(self.model.params, jnp.asarray(tokens), lj,
                                           config=self.config, window=self.window_size,
                                           block_size=self.block_size)
    return PromptPass(k=k, v=v, q_window=qw, lengths=lj, first=first, first_logits=logits)

  def decode(self, pp: PromptPass, method: str, token_budget: int, max_new_tokens: int, *,
             keep_cache: bool = False, max_new_for_plan: int | None = None, gold=None):
    """Builds `method`'s cache from the prompt pass and decodes greedily.

    Returns (tokens per row (EOS-stripped), raw output `[B, max_new]`, steps, cache or None).
    `max_new_for_plan` sizes the plan for more tokens than this call decodes (multi-turn).
    `gold`: `[B, max_new_tokens]` int32 ids to teacher-force from the same cache (see
    `gold_scores`); then `self.last_forced` holds (log-probs, is-argmax), each `[B, G]` numpy.
    """
    if self.config.max_position_embeddings < pp.padded_len + max_new_tokens:
      raise ValueError(f"prompt ({pp.padded_len}) + max_new_tokens ({max_new_tokens}) exceeds "
                       f"the model's context of {self.config.max_position_embeddings}")
    plan = self.plan(method, token_budget, pp.padded_len, max_new_for_plan or max_new_tokens)
    self.last_forced = None
    if gold is not None:  # its own program, before the decode program (`_gold_scores_impl`)
      gold = np.asarray(gold, np.int32)
      if gold.shape != (pp.batch, max_new_tokens):
        raise ValueError(f"gold must be [B, max_new_tokens] = {(pp.batch, max_new_tokens)}, "
                         f"got {gold.shape}")
      gargs = (self.model.params, pp.k, pp.v, pp.q_window, pp.lengths, pp.first_logits,
               jnp.asarray(gold))
      key = self._gold_key(plan, pp.k.shape, pp.q_window.shape, max_new_tokens)
      if key in self._futures:
        forced = self._futures[key].result()(*gargs)
      else:
        forced = _gold_scores(*gargs, config=self.config, plan=plan)
      self.last_forced = tuple(np.asarray(x) for x in forced)
    args = (self.model.params, pp.k, pp.v, pp.q_window, pp.lengths, pp.first, self._eos)
    key = self._key(plan, pp.k.shape, pp.q_window.shape, max_new_tokens, keep_cache)
    if key in self._futures:  # compiled ahead of time (see `precompile`)
      out, steps, cache = self._futures[key].result()(*args)
    else:
      out, steps, cache = _method_decode(*args, config=self.config, plan=plan,
                                         max_new_tokens=max_new_tokens, keep_cache=keep_cache)
    out = np.asarray(out)
    steps = int(steps)
    return self.strip(out, steps), out, steps, cache

  # ---------------------------------------------------------------- ahead-of-time compiles
  def _key(self, plan, k_shape, qw_shape, max_new_tokens, keep_cache):
    dt = str(self.model.params["embed"].dtype)
    return (self.config, dt, plan, tuple(k_shape), tuple(qw_shape), int(max_new_tokens),
            bool(keep_cache))

  def _gold_key(self, plan, k_shape, qw_shape, gold_len):
    return ("gold",) + self._key(plan, k_shape, qw_shape, gold_len, False)

  def precompile(self, configs, batch: int, padded_len: int, max_new_tokens: int,
                 workers: int = 2, gold: bool = False) -> None:
    """Starts compiling the decode programs of `configs` [(method, budget)] for a batch of
    `batch` prompts padded to `padded_len` (and with `gold` their gold-score programs, `[batch,
    max_new_tokens]` ids), on `workers` background threads (XLA compiles are single-threaded,
    so they overlap with each other and with prompt passes); `decode` then waits for its
    programs instead of compiling them."""
    import concurrent.futures

    if not _POOL:
      _POOL.append(concurrent.futures.ThreadPoolExecutor(max_workers=workers))
    c = self.config
    dt = self.model.params["embed"].dtype
    w = min(self.window_size, padded_len)
    sds = jax.ShapeDtypeStruct
    k = sds((c.num_layers, batch, c.num_kv_heads, padded_len, c.head_dim), dt)
    qw = sds((c.num_layers, batch, c.num_heads, w, c.head_dim), dt)
    vec = sds((batch,), jnp.int32)
    submit = lambda fn, args: _POOL[0].submit(lambda: fn.lower(*args).compile())
    for method, budget in configs:
      plan = self.plan(method, budget, padded_len, max_new_tokens)
      key = self._gold_key(plan, k.shape, qw.shape, max_new_tokens)
      if gold and key not in self._futures:
        fn = jax.jit(functools.partial(_gold_scores_impl, config=c, plan=plan))
        self._futures[key] = submit(fn, (self.model.params, k, k, qw, vec,
                                         sds((batch, c.vocab_size), jnp.float32),
                                         sds((batch, max_new_tokens), jnp.int32)))
      key = self._key(plan, k.shape, qw.shape, max_new_tokens, False)
      if key not in self._futures:
        fn = jax.jit(functools.partial(_method_decode_impl, config=c, plan=plan,
                                       max_new_tokens=int(max_new_tokens), keep_cache=False))
        self._futures[key] = submit(fn, (self.model.params, k, k, qw, vec, vec, self._eos))

  def release_compiled(self) -> None:
    """Drops every compiled decode program (ahead-of-time futures and the jit cache).

    Each program holds its machine code in memory mappings of its own; a process has a fixed
    number of them (Linux `vm.max_map_count`, 65530 by default), and a 2K sweep over four tasks
    (124 programs of 30 unrolled layers) ran out and aborted in LLVM ("Cannot allocate
    memory"). The sweep calls this between (task, length) groups whose shapes differ; programs
    a later group needs are compiled again (or loaded from `--cache-dir`).

    The programs also take memory: the 31 of an 8K sweep group (SmolLM2, batch 10) held 5.7 GB
    with the layers unrolled, 1.2 GB scanned (`llama.LayerStack`). Freed, that memory stays in
    the C allocator's per-thread pools until `malloc_trim` hands it back, which this calls
    where glibc provides it."""
    for fut in self._futures.values():
      fut.cancel()
    self._futures.clear()
    _method_decode.clear_cache()
    _gold_scores.clear_cache()
    _continue_decode.clear_cache()
    _trim_host_memory()

  def continue_decode(self, cache, first, seen, plan, max_new_tokens: int):
    """Greedy decode from an existing cache (multi-turn)."""
    out, steps, cache = _continue_decode(self.model.params, cache, first, seen, self._eos,
                                         config=self.config, plan=plan,
                                         max_new_tokens=max_new_tokens)
    out = np.asarray(out)
    steps = int(steps)
    return self.strip(out, steps), out, steps, cache

  def turn_prefill(self, caches: list, tokens: np.ndarray, turn_lengths: np.ndarray):
    """Dense pass of a later turn's tokens over per-layer `KVCache`s (see module doc)."""
    return _turn_prefill(self.model.params, list(caches), jnp.asarray(tokens, jnp.int32),
                         jnp.asarray(turn_lengths, jnp.int32), config=self.config,
                         window=self.window_size)


def layer_states(params, cache) -> list:
  """The decode cache (a tuple of per-layer states) as a list."""
  del params
  return list(cache)


def as_cache(params, states: list) -> Any:
  """Per-layer states as the decode cache `continue_decode` takes."""
  del params
  return tuple(states)

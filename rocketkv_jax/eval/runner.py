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

Memory: the sweep makes each prompt pass with room for the new tokens (`prompt_pass(...,
capacity=L + max_new)`, zeros past L). The methods whose cache is every prompt token at every
layer (full KV, exact top-k, Quest, SparQ: `keeps_prompt_in_place`) then build it over the prompt
K/V's own buffers, which their programs take donated and hand back (`_full_stack`); the evicting
methods read the prompt's slots and build their smaller caches beside them. One batch thus holds
one full-size copy of its K/V, not two. What a full-prompt program leaves at
and past each sequence's length (its new tokens) is scratch: every method masks those slots,
as it masks a ragged batch's padding (tests/test_runner_programs.py checks the records).

The first generated token is the argmax of the prompt pass's last-token logits, which are the
same for every method (every method attends densely while reading the prompt), exactly as in
`rocketkv.generate`; later tokens are fed back with `positions = seen + step - 1`.

Multi-turn (`next_turn`: `conversation.turn_states`, the step `rocketkv.Conversation` takes): a
later turn's prompt tokens are run densely (full attention over the valid slots of each layer's
cache, causal inside the turn) and added to the state: appended (`rocketkv.extend`), or stage 1
re-run on the full cache (`rocketkv.begin_turn`, RocketKV-MT).
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
from rocketkv_jax import cache as cache_lib
from rocketkv_jax.runtime import conversation, decode_loop, sampling, teacher_forced
from rocketkv_jax import methods as methods_lib
from rocketkv_jax.config import check_num_layers
from rocketkv_jax.eval import variants
from rocketkv_jax.models import llama
from rocketkv_jax.models.api import as_model
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


def memory_mappings() -> tuple[int, int]:
  """(memory mappings this process holds, the per-process limit `vm.max_map_count`); (0, 0)
  where /proc does not tell (not Linux)."""
  try:
    with open("/proc/self/maps") as f:
      n = sum(1 for _ in f)
    with open("/proc/sys/vm/max_map_count") as f:
      limit = int(f.read())
  except (OSError, ValueError):
    return 0, 0
  return n, limit


# --------------------------------------------------------------------------- programs
@dataclasses.dataclass
class PromptPass:
  """Output of the prompt pass for one right-padded batch.

  Attributes:
    k, v: `[N, B, Hkv, C, Dh]` post-RoPE keys / values of every layer, C = L (the padded prompt
      length) or the `capacity` the pass was made with (see `Runner.prompt_pass`).
    q_window: `[N, B, Hq, W, Dh]` post-RoPE queries of the last W valid tokens.
    lengths: `[B]` int32 valid prompt lengths.
    first: `[B]` int32 greedy first generated token (same for every method).
    first_logits: `[B, V]` fp32 logits at each prompt's last token (they predict `first`).
    prompt_len: L (None: C).
  """

  k: jax.Array
  v: jax.Array
  q_window: jax.Array
  lengths: jax.Array
  first: jax.Array
  first_logits: jax.Array
  prompt_len: int | None = None

  @property
  def padded_len(self) -> int:
    return int(self.k.shape[3]) if self.prompt_len is None else self.prompt_len

  @property
  def capacity(self) -> int:
    return int(self.k.shape[3])

  @property
  def batch(self) -> int:
    return int(self.k.shape[1])


@functools.partial(jax.jit, static_argnames=("config", "window", "block_size", "capacity"))
def _prompt_pass(params, tokens, lengths, *, config, window, block_size, capacity):
  last, outs = llama.prompt_pass(params, tokens, lengths, config=config, window=window,
                                 block_size=block_size,
                                 per_layer=lambda k, v, qw, layer: (k, v, qw))
  ks, vs, qws = (jnp.stack(xs) for xs in zip(*outs))
  room = ((0, 0),) * 3 + ((0, capacity - tokens.shape[1]), (0, 0))
  ks, vs = jnp.pad(ks, room), jnp.pad(vs, room)
  logits = llama.unembed(params, config, last)
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), logits, ks, vs, qws


def _greedy_loop(params, cache, first, seen, eos, *, config, plan, max_new_tokens):
  """Greedy decode: `first` [B] was sampled already and sits at position `seen`; `params`
  upcast (`compute_params`)."""
  step_fn = lambda c, t, p: llama.decode_step(params, c, t, p, config=config, plan=plan)
  s = decode_loop.sample_loop(step_fn, cache, first, seen, eos, jax.random.PRNGKey(0),
                              sampling.Greedy(), max_new_tokens=max_new_tokens)
  return s.tokens, s.step, s.cache


def _build_stack(k, v, qw, lengths, plan, config=None) -> llama.LayerStack:
  """The method's states from the stored prompt K/V `[N, ...]` as the scanned decode loop's
  `LayerStack`: each run of like layers built by one `lax.scan` over its own layers' slices.
  The method's dense layers (`layer=i`: every prompt token kept, a state of another shape) are
  built one by one. (One scan over all N layers, then slices of its output, held both at
  once: Quest's group of 28 layers cost 1.6 caches of temporaries instead of one; a scan over
  slices of the arguments copies those slices first.)"""
  prompt = lambda x: x[:, :, :plan.prompt_len]  # the prompt's slots of `[B, Hkv, C, D]`

  def one(_, i, lo):  # layer i's slices read inside the body: a slice of the arguments is a copy
    kk, vv, qq = (lax.dynamic_index_in_dim(x, i, keepdims=False) for x in (k, v, qw))
    # `layer=lo`: the run's first layer stands for each of its layers (none of them dense)
    return None, rocketkv.prefill(prompt(kk), prompt(vv), qq, plan, lengths=lengths, layer=lo)

  dense = methods_lib.get(plan.method).dense_layers(plan)
  sliding = () if config is None else config.window_layers  # a hybrid's: bounded, no method
  groups, spans = [], llama.layer_spans(k.shape[0], plan, alone=sliding)
  for lo, hi in spans:
    if lo in sliding:
      groups.append(llama.window_cache(prompt(k[lo]), prompt(v[lo]), lengths,
                                       config.sliding_window, plan.max_new_tokens))
    elif lo in dense:
      groups.append(rocketkv.prefill(prompt(k[lo]), prompt(v[lo]), qw[lo], plan,
                                     lengths=lengths, layer=lo))
    elif hi == lo + 1:
      groups.append(rocketkv.prefill(prompt(k[lo]), prompt(v[lo]), qw[lo], plan,
                                     lengths=lengths, layer=lo))
    else:
      groups.append(lax.scan(functools.partial(one, lo=lo), None, jnp.arange(lo, hi))[1])
  return llama.LayerStack(groups=tuple(groups), spans=spans)


def keeps_prompt_in_place(plan, capacity: int) -> bool:
  """Whether the method's cache is every layer's `full_cache` of the prompt K/V (its prefill is
  the base `Method.prefill`: full KV, exact top-k, Quest, SparQ) with the prompt K/V's own
  capacity: then its programs build that cache over the prompt K/V's buffers (`_full_stack`)."""
  method = methods_lib.get(plan.method)
  return type(method).prefill is methods_lib.Method.prefill and capacity == plan.capacity


def _full_stack(k, v, lengths, plan) -> llama.LayerStack:
  """Every layer's `full_cache(k[i], v[i], C, chunk_size, lengths)` as one stacked group, from
  prompt K/V `[N, B, Hkv, C, D]` that already have the plan's capacity C: zeroing the slots at
  and past each length is an element-wise pass that XLA runs in the (donated) argument buffers,
  so the cache costs no second copy of the K/V (the prompt K/V and the cache
  built from them were 2 of the ~3.5 caches resident in an 8K sweep). The chunk summaries are
  made layer by layer (a scan), as `_build_stack` does: made for the whole stack at once, XLA:CPU
  transposes SparQ's dim-major key copy through a buffer of another layout, half a cache more.
  The method's dense layers (Quest's) share the stack: `llama.decode_step` runs them apart."""
  n, c = k.shape[0], k.shape[3]
  # Each layer's `full_cache` without summaries: vmapped, its zeroing pass is one element-wise
  # op over the whole stack (the pad to capacity C is empty).
  group = jax.vmap(lambda kk, vv: cache_lib.full_cache(kk, vv, c, 0, lengths))(k, v)

  def bounds(_, i):
    kmin, kmax = cache_lib.chunk_summaries(lax.dynamic_index_in_dim(group.k, i, keepdims=False),
                                           lengths, plan.chunk_size)
    return None, cache_lib.to_storage(cache_lib.summary_bounds(kmin, kmax, plan.chunk_size))

  group = group.replace(bounds_raw=lax.scan(bounds, None, jnp.arange(n))[1],
                        chunk_size=plan.chunk_size)
  return llama.LayerStack(groups=(group,), spans=((0, n),))


def _method_cache(k, v, qw, lengths, plan, scan_layers: bool, in_place: bool = False,
                  config=None):
  """The method's decode cache from the stored prompt K/V: a `LayerStack` (scanned layer loop),
  or per-layer states with `scan_layers=False` (unrolled; the same numbers). `in_place`: over
  the prompt K/V's buffers (`_full_stack`; `keeps_prompt_in_place` must hold)."""
  # The eval programs decode over a `LayerStack`: the KV method's ops compiled once, not once
  # per layer (far smaller programs: results/sweep.md); the same numbers.
  if in_place:
    cache = _full_stack(k, v, lengths, plan)
  else:
    cache = _build_stack(k, v, qw, lengths, plan, config)
  return cache if scan_layers else llama.unstack_cache(cache)


def _handed_back(cache, dtype):
  """The prompt K/V buffers of an in-place program's final cache, in the prompt K/V's dtype."""
  g = cache.groups[0]
  return cache_lib.from_storage(g.k_raw, dtype), cache_lib.from_storage(g.v_raw, dtype)


def _method_decode_impl(params, k, v, qw, lengths, first, eos, *, config, plan,
                        max_new_tokens, keep_cache, scan_layers=True, in_place=False):
  """Builds the method's cache and decodes greedily: (tokens `[B, max_new]`, steps, the final
  cache if `keep_cache` else None). `scan_layers=False` unrolls the layer loop (the same
  numbers; for benchmarks/eval_memory.py). `in_place` (k, v donated; not with `keep_cache`):
  the cache is built over k and v (`_full_stack`) and the third result is instead their
  buffers handed back, `(k, v)`: the prompt's slots as they were; every slot at or past a
  sequence's length is scratch (this program's new tokens)."""
  cache = _method_cache(k, v, qw, lengths, plan, scan_layers, in_place, config)
  params = compute_params(params)  # bf16 on a CPU without bf16 dots: upcast once, not per step
  out, steps, cache = _greedy_loop(params, cache, first, lengths, eos, config=config, plan=plan,
                                   max_new_tokens=max_new_tokens)
  if in_place:
    return out, steps, _handed_back(cache, k.dtype)
  if keep_cache and scan_layers:
    cache = llama.unstack_cache(cache)
  return out, steps, (cache if keep_cache else None)


def _gold_scores_impl(params, k, v, qw, lengths, first_logits, ids, *, config, plan,
                      scan_layers=True, in_place=False):
  """Builds the method's cache as `_method_decode_impl` does and teacher-forces the gold ids
  `[B, G]` through the method's decode steps (`teacher_forced.forced_logprobs`): the per-token
  log-probs `[B, G]` and is-argmax flags (and with `in_place`, k and v handed back, as there).

  Its own program, run before the decode program, rather than a second loop inside it: two
  loops over one freshly built cache made XLA keep a copy of the cache for each loop next to
  the built one (2.5 caches of temporaries for full KV), while two programs
  called one after the other each hold one."""
  cache = _method_cache(k, v, qw, lengths, plan, scan_layers, in_place, config)
  params = compute_params(params)
  lp, am, _, cache = teacher_forced.forced_logprobs(params, cache, first_logits, ids, lengths,
                                                    config=config, plan=plan)
  return (lp, am, _handed_back(cache, k.dtype)) if in_place else (lp, am)


_method_decode = jax.jit(_method_decode_impl, static_argnames=(
    "config", "plan", "max_new_tokens", "keep_cache"))
_gold_scores = jax.jit(_gold_scores_impl, static_argnames=("config", "plan"))
# The programs of `keeps_prompt_in_place` methods: k and v (arguments 1 and 2) donated.
_method_decode_in_place = jax.jit(
    functools.partial(_method_decode_impl, in_place=True),
    static_argnames=("config", "plan", "max_new_tokens", "keep_cache"), donate_argnums=(1, 2))
_gold_scores_in_place = jax.jit(functools.partial(_gold_scores_impl, in_place=True),
                                static_argnames=("config", "plan"), donate_argnums=(1, 2))


@functools.partial(jax.jit, static_argnames=("config", "plan", "max_new_tokens"))
def _continue_decode(params, cache, first, seen, eos, *, config, plan, max_new_tokens):
  params, cache = compute_params(params), llama.stack_cache(cache, plan, config.window_layers)
  out, steps, cache = _greedy_loop(params, cache, first, seen, eos, config=config, plan=plan,
                                   max_new_tokens=max_new_tokens)
  return out, steps, llama.unstack_cache(cache)


@functools.partial(jax.jit, static_argnames=("config", "plan"))
def _continue_gold(params, cache, first_logits, seen, ids, *, config, plan):
  """Teacher-forces `ids [B, G]` from an existing cache (multi-turn; the cache is not donated:
  the turn's decode runs from it next): log-probs and is-argmax flags, each `[B, G]`."""
  params, cache = compute_params(params), llama.stack_cache(cache, plan, config.window_layers)
  lp, am, _, _ = teacher_forced.forced_logprobs(params, cache, first_logits, ids, seen,
                                                config=config, plan=plan)
  return lp, am


_next_turn = jax.jit(conversation.turn_states,
                     static_argnames=("config", "plan", "max_new_tokens", "impl"))


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
    self.model = model = as_model(model)
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
  def prompt_pass(self, tokens: np.ndarray, lengths: np.ndarray,
                  capacity: int | None = None) -> PromptPass:
    """tokens `[B, L]` right-padded ids, lengths `[B]` -> `PromptPass` (one jit call).

    `capacity` (>= L; None: L): slots per sequence of the stored K/V, zeros past L. With
    `capacity = L + max_new_tokens`, the methods whose cache is the full prompt (full KV, exact
    top-k, Quest, SparQ: `keeps_prompt_in_place`) decode in the prompt K/V's own buffers:
    `decode` donates `pp.k` / `pp.v` to their programs and puts the buffers they hand back in
    their place (the prompt's slots unchanged, every slot at or past a sequence's length
    scratch, which no method reads). One cache of K/V per batch instead of two."""
    tokens = np.asarray(tokens, np.int32)
    lengths = np.asarray(lengths, np.int32)
    if tokens.ndim != 2 or lengths.shape != (tokens.shape[0],):
      raise ValueError(f"tokens must be [B, L] and lengths [B], got {tokens.shape}, "
                       f"{lengths.shape}")
    if lengths.min() < 1 or lengths.max() > tokens.shape[1]:
      raise ValueError(f"lengths must be in [1, {tokens.shape[1]}], got {lengths.tolist()}")
    L = tokens.shape[1]
    if capacity is not None and (not isinstance(capacity, (int, np.integer)) or capacity < L):
      raise ValueError(f"capacity must be an int >= the padded length {L} or None, got "
                       f"{capacity!r}")
    lj = jnp.asarray(lengths)
    first, logits, k, v, qw = _prompt_pass(self.model.params, jnp.asarray(tokens), lj,
                                           config=self.config, window=self.window_size,
                                           block_size=self.block_size,
                                           capacity=int(capacity or L))
    return PromptPass(k=k, v=v, q_window=qw, lengths=lj, first=first, first_logits=logits,
                      prompt_len=L)

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
    in_place = (not keep_cache and keeps_prompt_in_place(plan, pp.capacity)
                and not self.config.window_layers)  # a hybrid's sliding caches are their own
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
        forced = (_gold_scores_in_place if in_place else _gold_scores)(
            *gargs, config=self.config, plan=plan)
      if in_place:
        *forced, (pp.k, pp.v) = forced
      self.last_forced = tuple(np.asarray(x) for x in forced)
    args = (self.model.params, pp.k, pp.v, pp.q_window, pp.lengths, pp.first, self._eos)
    key = self._key(plan, pp.k.shape, pp.q_window.shape, max_new_tokens, keep_cache)
    if key in self._futures:  # compiled ahead of time (see `precompile`)
      out, steps, cache = self._futures[key].result()(*args)
    else:
      out, steps, cache = (_method_decode_in_place if in_place else _method_decode)(
          *args, config=self.config, plan=plan, max_new_tokens=max_new_tokens,
          keep_cache=keep_cache)
    if in_place:
      (pp.k, pp.v), cache = cache, None
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
                 workers: int = 2, gold: bool = False, capacity: int | None = None) -> None:
    """Starts compiling the decode programs of `configs` [(method, budget)] for a batch of
    `batch` prompts padded to `padded_len` (and with `gold` their gold-score programs, `[batch,
    max_new_tokens]` ids), on `workers` background threads (XLA compiles are single-threaded,
    so they overlap with each other and with prompt passes); `decode` then waits for its
    programs instead of compiling them. `capacity`: that of the prompt passes
    (`prompt_pass(..., capacity)`; None: `padded_len`)."""
    import concurrent.futures

    if not _POOL:
      _POOL.append(concurrent.futures.ThreadPoolExecutor(max_workers=workers))
    c = self.config
    dt = self.model.params["embed"].dtype
    w = min(self.window_size, padded_len)
    sds = jax.ShapeDtypeStruct
    k = sds((c.num_layers, batch, c.num_kv_heads, capacity or padded_len, c.head_dim), dt)
    qw = sds((c.num_layers, batch, c.num_heads, w, c.head_dim), dt)
    vec = sds((batch,), jnp.int32)
    submit = lambda fn, args: _POOL[0].submit(lambda: fn.lower(*args).compile())
    for method, budget in configs:
      plan = self.plan(method, budget, padded_len, max_new_tokens)
      in_place = keeps_prompt_in_place(plan, k.shape[3]) and not c.window_layers
      donate = (1, 2) if in_place else ()
      key = self._gold_key(plan, k.shape, qw.shape, max_new_tokens)
      if gold and key not in self._futures:
        fn = jax.jit(functools.partial(_gold_scores_impl, config=c, plan=plan,
                                       in_place=in_place), donate_argnums=donate)
        self._futures[key] = submit(fn, (self.model.params, k, k, qw, vec,
                                         sds((batch, c.vocab_size), jnp.float32),
                                         sds((batch, max_new_tokens), jnp.int32)))
      key = self._key(plan, k.shape, qw.shape, max_new_tokens, False)
      if key not in self._futures:
        fn = jax.jit(functools.partial(_method_decode_impl, config=c, plan=plan,
                                       max_new_tokens=int(max_new_tokens), keep_cache=False,
                                       in_place=in_place), donate_argnums=donate)
        self._futures[key] = submit(fn, (self.model.params, k, k, qw, vec, vec, self._eos))

  def release_compiled(self) -> None:
    """Drops every compiled decode program (ahead-of-time futures and the jit cache).

    Each program holds its machine code in memory mappings of its own, and a process has a
    fixed number of them (Linux `vm.max_map_count`, 65530 by default): a long sweep can run out
    (results/sweep.md).
    The sweep calls this between (task, length) groups whose shapes differ; programs a later
    group needs are compiled again (or loaded from `--cache-dir`). The programs also take
    memory; freed, it stays in the C allocator's per-thread pools until `malloc_trim` hands it
    back, which this calls where glibc provides it."""
    for fut in self._futures.values():
      fut.cancel()
    self._futures.clear()
    for fn in (_method_decode, _gold_scores, _method_decode_in_place, _gold_scores_in_place):
      fn.clear_cache()
    _continue_decode.clear_cache()
    _continue_gold.clear_cache()
    _trim_host_memory()

  def release_if_crowded(self, fraction: float = 0.5) -> bool:
    """`release_compiled` and every other jit cache (`jax.clear_caches`) once this process
    holds more than `fraction` of its memory-mapping limit (`memory_mappings`); returns whether
    it released. The multi-turn task calls it after each prompt: its (method, budget, turn)
    programs stay within one (task, length) group, and a 2K run of five methods x three budgets
    with gold scores ran out of mappings in LLVM ("Cannot allocate memory") after ~30 min."""
    n, limit = memory_mappings()
    if not limit or n <= fraction * limit:
      return False
    self.release_compiled()
    jax.clear_caches()
    return True

  def continue_decode(self, cache, first, seen, plan, max_new_tokens: int):
    """Greedy decode from an existing cache (multi-turn)."""
    out, steps, cache = _continue_decode(self.model.params, cache, first, seen, self._eos,
                                         config=self.config, plan=plan,
                                         max_new_tokens=max_new_tokens)
    out = np.asarray(out)
    steps = int(steps)
    return self.strip(out, steps), out, steps, cache

  def continue_gold(self, cache, first_logits, seen, plan, gold) -> tuple:
    """Teacher-forces `gold [B, G]` int32 from an existing cache (multi-turn), as `decode(gold=)`
    does from a prompt pass: (log-probs, is-argmax), each `[B, G]` numpy. `first_logits`: the
    `[B, V]` logits that predict gold[:, 0] (`next_turn`'s)."""
    lp, am = _continue_gold(self.model.params, cache, first_logits, seen,
                            jnp.asarray(gold, jnp.int32), config=self.config, plan=plan)
    return np.asarray(lp), np.asarray(am)

  def next_turn(self, states, tokens: np.ndarray, turn_lengths: np.ndarray, plan,
                max_new_tokens: int):
    """A later turn's prompt added to the per-layer states (`conversation.turn_states`, batch
    rows none of which stopped early): (logits `[B, V]` at its last token, the new states,
    the next token's position `[B]`)."""
    b = tokens.shape[0]
    logits, states, seen, _ = _next_turn(
        self.model.params, tuple(states), jnp.asarray(tokens, jnp.int32),
        jnp.asarray(turn_lengths, jnp.int32), jnp.zeros((b,), jnp.int32), config=self.config,
        plan=plan, max_new_tokens=max_new_tokens)
    return logits, list(states), seen


def layer_states(params, cache) -> list:
  """The decode cache (a tuple of per-layer states) as a list."""
  del params
  return list(cache)


def as_cache(params, states: list) -> Any:
  """Per-layer states as the decode cache `continue_decode` takes."""
  del params
  return tuple(states)

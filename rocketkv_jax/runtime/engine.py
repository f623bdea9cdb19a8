"""`Engine`: continuous batching over a fixed pool of decode slots, any KV method.

    engine = Engine(model, EngineConfig(RocketConfig.recommended(256), max_model_len=8192,
                                        max_num_seqs=16))
    engine.start()                                          # the scheduling thread
    handle = engine.add_request("Hello", SamplingParams(max_tokens=32, temperature=0.0))
    print(handle.result().text)
    engine.shutdown()

Each of the `S` slots holds one request's compressed KV state. A request waits in a bounded
queue until a slot is free, is prefilled alone (its prompt padded to a power-of-two length
bucket) straight into its slot, then decodes with the others, `steps_per_call` tokens per
compiled call, and leaves at EOS, `max_tokens`, a stop string or cancellation; its slot is
free for the next one at once. Nothing recompiles: one admit program per bucket (one per
layer group of it in layer groups, below), one decode program (`engine_programs.py`), all
compiled by `warmup()` or on first use.

Prefill in layer groups (`prefill_layer_groups = G > 1`): a request's prefill runs as G calls,
each over a group of consecutive layers, carrying only the hidden states `[1, L, D]` from one
to the next (stage 1 is per layer, so each layer's compressed state is final once it ran). The
request is "prefilling" in between (it holds its pages and a slot's place, not a slot), and the
running requests decode once between two of its calls, so a long prompt stalls them for about
1/G of its prefill at a time; after its last group it joins the batch as a one-call admission.
G is the longest bucket's; a shorter bucket takes G x its share of the longest, rounded up
(`_groups_of`), so no prompt stalls them longer than the longest one's groups and a short
bucket compiles one program, not G.

One budget split for every request: the `Plan` is made once for prompts of `max_model_len -
max_new_tokens` tokens and `max_new_tokens` new ones, as `rocketkv.generate(..., pad_to=...)`
plans for a nominal length (docs/serving.md says why). With it every slot's state has the same
shapes, and a request's greedy output is `generate`'s with `pad_to=plan.prompt_len,
max_new_tokens=plan.max_new_tokens`, alone or among others.

Memory, two ways. Slots (`page_size=None`): each slot reserves its plan's whole capacity; with
`kv_cache_mb`, `S` is the number of slots that fit (at most `max_num_seqs`), and a compressing
method's capacity is smaller, so the same pool holds more requests. Pages (`page_size=P`,
`paged_pool.py`): the `max_num_seqs` slots share a pool of pages, taken two ways
(`page_allocation`). "reserve": a request takes the pages of its kept prompt tokens +
max_tokens when it is admitted (it waits in the queue until they are free: nothing is preempted
or runs out of memory later) and returns them when it ends, so short requests hold little and
as many run as their pages allow. "lazy" (vLLM's way): it takes the pages of its kept prompt
and first decode call, and before each decode call the pages its next call fills; when the
pool runs dry the most recently admitted request is preempted: its pages go back, and it waits
at the head of the queue to be recomputed from its prompt, regenerating (and checking, not
emitting again) the tokens it had sent.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
import threading
import time
import zlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax.config import RocketConfig, check_num_layers
from rocketkv_jax.config import plan as make_plan
from rocketkv_jax.models import llama
from rocketkv_jax.models import sharding as sharding_lib
from rocketkv_jax.models.api import as_model
from rocketkv_jax.runtime import decode_loop, engine_programs as programs, paged_pool
from rocketkv_jax.runtime.requests import Output, Request, RequestHandle, SamplingParams

__all__ = ["Engine", "EngineClosed", "EngineConfig", "EngineStats", "Output", "QueueFull",
           "RequestHandle", "SamplingParams"]


def _nbytes(tree) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def decode_batches(slots: int) -> tuple[int, ...]:
  """Decode batch sizes with pages (one program each): 1, 2, 4, every multiple of 8 below
  `slots`, and `slots`, as vLLM's CUDA graph sizes: a decode call over n busy slots runs fewer
  than n + 8 rows (powers of two alone would run up to 2n)."""
  return tuple(sorted({b for b in (1, 2, 4, *range(8, slots, 8)) if b < slots} | {slots}))


class QueueFull(RuntimeError):
  """The waiting queue is full: retry later (a server answers 503)."""


class EngineClosed(RuntimeError):
  """The engine is shutting down and admits nothing."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Static settings of an `Engine`.

  Attributes:
    rocket_config: the KV method and budget (`RocketConfig`, e.g. `.recommended(256)`).
    max_model_len: prompt + generated tokens of one request, at most.
    max_new_tokens: the new tokens the budget split plans for; prompts may hold up to
      `max_model_len - max_new_tokens` tokens. A request may ask for more new tokens than
      this when its prompt leaves room in its slot.
    max_num_seqs: decode slots (requests decoding at once), at most.
    kv_cache_mb: the pool's size in MiB: the slots are as many as fit (None: `max_num_seqs`).
    max_waiting: requests that may wait for a slot; beyond it `add_request` raises QueueFull.
    steps_per_call: decode steps per compiled call (host round trips are amortised over them;
      a finished request's extra steps are dropped).
    prefill_tokens_per_step: admissions of one step stop once their prompts reach this many
      tokens (at least one request is admitted): the running requests then decode before the
      next prefills. None: every free slot is filled first (best time to first token).
    prefill_layer_groups: G: a request's prefill runs as G calls over groups of consecutive
      layers (sizes differing by at most one), with one decode call of the running requests
      between two of them: a long prompt stalls them ~1/G of its prefill at a time instead of
      all of it, for the same total work. 1: one call (no split). At most the model's layers.
      G is the longest bucket's; a bucket of b tokens takes ceil(G * b / longest) groups.
    page_size: None: each slot reserves its plan's whole capacity (the slots are the unit of
      memory). An int P: a paged pool (`paged_pool.py`): K, V and the method's summaries
      live in pages of about P tokens (rounded up to whole chunks / code bytes) shared by the
      `max_num_seqs` slots, taken as `page_allocation` says and returned when it ends.
    page_allocation: with pages, "reserve": a request takes the pages of its kept prompt
      tokens + max_tokens when it is admitted (it waits until they are free; never
      preempted). "lazy": it takes those of its kept prompt + its first `steps_per_call`
      tokens, then before each decode call those its next call fills; it is admitted only
      while the free pages left cover one decode call of every admitted request (ceil(
      steps_per_call / P) pages each), and when the pool runs dry the most recently admitted
      request is preempted and later recomputed (its output as if it ran through). Ignored
      without pages.
    min_bucket: the smallest prompt length bucket (a power of two).
    block_size: prefill attention tile.
    impl: "auto" | "xla" | "pallas" for the KV method's hot path.
  """

  rocket_config: RocketConfig
  max_model_len: int = 4096
  max_new_tokens: int = 256
  max_num_seqs: int = 8
  kv_cache_mb: float | None = None
  max_waiting: int = 256
  steps_per_call: int = 1
  prefill_tokens_per_step: int | None = None
  prefill_layer_groups: int = 1
  page_size: int | None = None
  page_allocation: str = "reserve"
  min_bucket: int = 64
  block_size: int = 512
  impl: str = "auto"

  def __post_init__(self):
    if not isinstance(self.rocket_config, RocketConfig):
      raise ValueError(f"rocket_config must be a RocketConfig, got {self.rocket_config!r}")
    for name, lo in (("max_model_len", 2), ("max_new_tokens", 1), ("max_num_seqs", 1),
                     ("max_waiting", 0), ("steps_per_call", 1), ("min_bucket", 1),
                     ("block_size", 1)):
      x = getattr(self, name)
      if isinstance(x, bool) or not isinstance(x, int) or x < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {x!r}")
    if self.max_new_tokens >= self.max_model_len:
      raise ValueError(f"max_new_tokens must be < max_model_len={self.max_model_len}, got "
                       f"{self.max_new_tokens}")
    if self.prefill_tokens_per_step is not None and (
        isinstance(self.prefill_tokens_per_step, bool)
        or not isinstance(self.prefill_tokens_per_step, int) or self.prefill_tokens_per_step < 1):
      raise ValueError(f"prefill_tokens_per_step must be None or an int >= 1, got "
                       f"{self.prefill_tokens_per_step!r}")
    g = self.prefill_layer_groups
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
      raise ValueError(f"prefill_layer_groups must be an int in [1, the model's layers], got "
                       f"{g!r}")
    if self.page_size is not None and (isinstance(self.page_size, bool)
                                       or not isinstance(self.page_size, int)
                                       or self.page_size < 1):
      raise ValueError(f"page_size must be None or an int >= 1, got {self.page_size!r}")
    if self.page_allocation not in ("reserve", "lazy"):
      raise ValueError(f"page_allocation must be 'reserve' or 'lazy', got "
                       f"{self.page_allocation!r}")
    if self.page_size is not None and self.impl not in ("auto", "xla"):
      raise ValueError(f"impl must be 'auto' or 'xla' with page_size ('auto' runs the paged "
                       f"kernels on a GPU or TPU), got {self.impl!r}")
    if self.min_bucket & (self.min_bucket - 1):
      raise ValueError(f"min_bucket must be a power of two, got {self.min_bucket}")
    if self.kv_cache_mb is not None and not (isinstance(self.kv_cache_mb, (int, float))
                                             and self.kv_cache_mb > 0):
      raise ValueError(f"kv_cache_mb must be None or a number > 0, got {self.kv_cache_mb!r}")

  @property
  def max_prompt_len(self) -> int:
    return self.max_model_len - self.max_new_tokens


@dataclasses.dataclass(frozen=True)
class EngineStats:
  """A snapshot of the engine (what `/metrics` exports)."""

  num_running: int
  num_waiting: int  # not admitted yet (prefilling requests are neither: `num_prefilling`)
  num_slots: int
  kv_cache_usage: float  # 0-1: pages (slots: tokens) running requests hold / the pool's
  slot_bytes: int  # one slot's KV state (paged: one request of the plan's capacity)
  prompt_tokens_total: int
  generation_tokens_total: int
  requests_finished_total: int
  prefill_seconds_total: float  # wall time in admissions (prefill + first token)
  decode_seconds_total: float  # wall time in decode calls
  num_prefilling: int = 0  # admitted, their prefill in layer groups under way
  num_preemptions: int = 0  # requests preempted so far (lazy pages: the pool ran dry)
  recomputed_tokens_total: int = 0  # generated tokens regenerated after those preemptions


@dataclasses.dataclass
class _Prefilling:
  """A request whose prefill runs in layer groups: what it holds between its group calls."""

  req: Request
  bucket: int
  tokens: np.ndarray  # [1, bucket] right-padded prompt ids
  seed: int
  pages: list[int]  # paged pool: the pages taken at admission (written by the last call)
  group: int = 0  # the next group to run
  x: jax.Array | None = None  # [1, bucket, D] hidden states entering the next group
  parts: tuple = ()  # the `LayerStack` parts of the groups run so far


class Engine:
  """Continuous batching over `S` decode slots (module docstring). Thread-safe: `add_request`,
  `abort` and `stats` may be called from any thread while `start()`'s thread runs the loop;
  or drive it by hand with `step()` (tests). It serves the model's weights as they are when it
  is built (read once: a model's `params` assembles its pytree on every read)."""

  def __init__(self, model, config: EngineConfig):
    self.model = model = as_model(model)
    self.params = model.params
    self.config = config
    mc = model.config
    if config.max_model_len > mc.max_position_embeddings:
      raise ValueError(f"max_model_len must be <= the model's context "
                       f"{mc.max_position_embeddings}, got {config.max_model_len}")
    self.plan = make_plan(config.rocket_config, config.max_prompt_len, config.max_new_tokens,
                          mc.head_dim)
    check_num_layers(self.plan, mc.num_layers)
    groups = config.prefill_layer_groups
    if groups > mc.num_layers:
      raise ValueError(f"prefill_layer_groups must be in [1, {mc.num_layers}] (at most the "
                       f"model's {mc.num_layers} layers), got {groups}")
    self.tokenizer = model.tokenizer
    self.eos_ids = decode_loop.default_eos_ids(model)
    self._eos = jnp.asarray(np.array(list(self.eos_ids) or [-1], np.int32))
    self._static = dict(config=mc, plan=self.plan, impl=config.impl)
    self._mesh = sharding_lib.mesh_of(self.params)  # tensor parallel over KV heads, or None
    if self._mesh is not None:
      sharding_lib.check_mesh(mc, self._mesh)

    self.buckets = self._buckets()
    # each bucket's layer groups [bounds[g], bounds[g + 1]) (sizes differing by at most one):
    # G for the longest bucket, fewer for shorter ones (`_groups_of`)
    self.bucket_bounds = {b: tuple(g * mc.num_layers // n for g in range(n + 1))
                          for b in self.buckets for n in [self._groups_of(b)]}
    self.layer_bounds = self.bucket_bounds[self.buckets[-1]]
    one = (jnp.zeros((1, self.buckets[0]), jnp.int32), jnp.ones((1,), jnp.int32))
    row = jax.eval_shape(functools.partial(programs._prefill, block_size=config.block_size,
                                           **self._static), self.params, *one)[1]
    self.slot_bytes = _nbytes(row)
    self.sliding_groups = tuple(any(i in mc.window_layers for i in range(lo, hi))
                                for lo, hi in row.spans)
    self.paged = config.page_size is not None
    self.lazy = self.paged and config.page_allocation == "lazy"
    slots = config.max_num_seqs
    if self.paged:
      paged_pool.check_pageable(row, self.sliding_groups, self.plan)
      self.page_size = paged_pool.page_tokens(self.plan, config.page_size)
      self.pages_per_seq = -(-self.plan.capacity // self.page_size)
      pool = lambda s, n: _nbytes(jax.eval_shape(
          lambda r: paged_pool.empty_pool(r, s, n, self.page_size, self.pages_per_seq,
                                          self.sliding_groups), row))
      self.page_bytes = pool(1, 2) - pool(1, 1)
      self.slot_fixed_bytes = pool(2, 1) - pool(1, 1)
      self.slot_bytes = self.slot_fixed_bytes + self.pages_per_seq * self.page_bytes
      if config.kv_cache_mb is None:
        num_pages = slots * self.pages_per_seq + 1
      else:
        num_pages = int((config.kv_cache_mb * 2**20 - (pool(slots, 1) - self.page_bytes))
                        // self.page_bytes)
        if num_pages - 1 < self.pages_per_seq:
          raise ValueError(
              f"kv_cache_mb must hold the {slots} slots (max_num_seqs) and one request of the "
              f"plan's capacity ({pool(slots, self.pages_per_seq + 1) / 2**20:.2f} MiB), got "
              f"{config.kv_cache_mb}")
      self.num_pages = num_pages  # page 0 is the scratch page (paged_pool.SCRATCH)
    elif config.kv_cache_mb is not None:
      fit = int(config.kv_cache_mb * 2**20 // self.slot_bytes)
      if fit < 1:
        raise ValueError(f"kv_cache_mb must hold one request's KV state "
                         f"({self.slot_bytes / 2**20:.2f} MiB for this model, method and "
                         f"max_model_len), got {config.kv_cache_mb}")
      slots = min(slots, fit)
    self.num_slots = slots
    self.batches = decode_batches(slots)

    self._lock = threading.Condition()
    self._waiting: collections.deque[Request] = collections.deque()
    self._prefilling: list[_Prefilling] = []  # admitted, prefill in layer groups under way
    self._slots: list[Request | None] = [None] * slots
    self._ids = itertools.count()
    self._admissions = itertools.count()  # admission order (lazy pages: the latest preempted)
    self._requests: dict[str, Request] = {}
    self._closed = False
    self._thread: threading.Thread | None = None
    self._exes: dict = {}
    self._decode_exes: dict = {}  # rows -> the decode program (its lookup off the hot path)
    self._tables = None  # lazy pages: the program that writes page tables
    self._counters = collections.Counter()
    # host mirror of each slot's decode inputs
    self._last = np.zeros(slots, np.int32)
    self._pos = np.zeros(slots, np.int32)
    self._ngen = np.zeros(slots, np.int32)
    self._temp = np.zeros(slots, np.float32)
    self._top_p = np.ones(slots, np.float32)
    self._seed = np.zeros(slots, np.uint32)
    self._min_tokens = np.zeros(slots, np.int32)
    self._held = np.zeros(slots, np.int64)  # tokens each slot's request holds (usage)
    if self.paged:
      self._free_pages = list(range(1, self.num_pages))  # free page ids (0: scratch)
      self._slot_pages: list[list[int]] = [[] for _ in range(slots)]
      self._released: list[int] = []  # pages of ended requests, free once their slots release
      self._release_mask = np.zeros(slots, bool)
      self._table_dirty = np.zeros(slots, bool)  # lazy: rows the next tables call rewrites
      self.state = self._program(
          "init", programs.init_paged_program, (), self.params, *one, slots=slots,
          num_pages=self.num_pages, page_size=self.page_size, pages_per_seq=self.pages_per_seq,
          sliding_groups=self.sliding_groups, block_size=config.block_size)(self.params, *one)
    else:
      self.state = self._program("init", programs.init_program, (), self.params, *one,
                                 slots=slots, block_size=config.block_size)(self.params, *one)

  # ------------------------------------------------------------------ programs
  def _buckets(self) -> tuple[int, ...]:
    """Prompt length buckets: powers of two from `min_bucket`, the longest prompt last. A
    hybrid model's sliding layers keep min(window, bucket) prompt tokens, so its buckets start
    at the window: every bucket's state then has the same shapes."""
    lo = self.config.min_bucket
    if self.model.config.window_layers:
      lo = max(lo, 1 << (self.model.config.sliding_window - 1).bit_length())
    out, b = [], lo
    while b < self.config.max_prompt_len:
      out.append(b)
      b *= 2
    return tuple(out) + (self.config.max_prompt_len,)

  def _groups_of(self, bucket: int) -> int:
    """Layer groups of a bucket's prefill: G x its share of the longest bucket, rounded up
    (at least 1). A prefill's cost grows with its tokens, so a shorter prompt's groups stall
    the running requests no longer than the longest one's, and the short buckets compile 1
    program instead of G."""
    g = self.config.prefill_layer_groups
    return max(1, min(g, -(-g * bucket // self.buckets[-1])))

  def _program(self, name, fn, donate, *args, **static):
    """The compiled `fn` for these argument shapes (compiled once, kept)."""
    sig = (name, tuple(sorted(static.items())),
           tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(args)))
    if sig not in self._exes:
      t0 = time.perf_counter()
      fn = functools.partial(fn, **self._static, **static)
      out = None if self._mesh is None else self._out_shardings(jax.eval_shape(fn, *args))
      jitted = jax.jit(fn, donate_argnums=donate, out_shardings=out)
      self._exes[sig] = jitted.lower(*args).compile()
      self._counters["compile_s"] += time.perf_counter() - t0
      self._counters["programs"] += 1
    return self._exes[sig]

  def _out_shardings(self, out):
    """On a mesh, every program leaves the state in one layout (so the next one takes it as it
    is): the KV-head axis of each per-layer array over "tp" (axis 1 of a layer's leaves of rank
    >= 3, after the stacked layer axis), the rest replicated; other outputs replicated."""
    mesh = self._mesh
    rep = sharding_lib.replicated(mesh)

    def state(st):
      groups = []
      for (lo, hi), g in zip(st.spans, st.groups):
        off = 1 if hi - lo > 1 else 0
        groups.append(jax.tree.map(
            lambda x, off=off: jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec(*[None] * (off + 1), "tp"))
            if x.ndim >= off + 3 else rep, g))
      return st.replace(groups=tuple(groups))

    is_stack = lambda x: isinstance(x, llama.LayerStack)
    return jax.tree.map(lambda x: state(x) if is_stack(x) else rep, out, is_leaf=is_stack)

  def _admit_args(self, tokens, length, slot, p: SamplingParams, seed: int, page_ids=None):
    paged = () if not self.paged else (
        np.full(self.pages_per_seq, self.num_pages, np.int32) if page_ids is None
        else page_ids,)
    return (self.params, self.state, tokens, np.array([length], np.int32),
            np.int32(slot), *paged, np.array([p.temperature], np.float32),
            np.array([p.top_p], np.float32), np.array([seed], np.uint32),
            np.array([p.min_tokens], np.int32), self._eos)

  def _decode_args(self, rows=None):
    r = slice(rows)
    return (self.params, self.state, self._last[r], self._pos[r], self._ngen[r],
            self._temp[r], self._top_p[r], self._seed[r], self._min_tokens[r], self._eos)

  def _decode_rows(self) -> int | None:
    """Slots the next decode call runs: with pages, the smallest batch size (`decode_batches`)
    covering every busy slot (they are kept first); without, all (None)."""
    if not self.paged:
      return None
    top = max((i for i, r in enumerate(self._slots) if r is not None), default=0) + 1
    return next(b for b in self.batches if b >= top)

  def _admit_exe(self, bucket: int, args):
    if self.paged:
      return self._program(f"admit{bucket}", programs.admit_paged_program, (1,), *args,
                           sliding_groups=self.sliding_groups,
                           block_size=self.config.block_size)
    return self._program(f"admit{bucket}", programs.admit_program, (1,), *args,
                         block_size=self.config.block_size)

  def _group_exe(self, bucket: int, lo: int, hi: int, args):
    return self._program(f"prefill{bucket}", programs.prefill_group_program, (), *args, lo=lo,
                         hi=hi, block_size=self.config.block_size)

  def _last_exe(self, bucket: int, lo: int, args):
    """The last layer group's program (`admit_program` with lo > 0)."""
    if self.paged:
      return self._program(f"admit{bucket}", programs.admit_paged_program, (1,), *args, lo=lo,
                           sliding_groups=self.sliding_groups,
                           block_size=self.config.block_size)
    return self._program(f"admit{bucket}", programs.admit_program, (1,), *args, lo=lo,
                         block_size=self.config.block_size)

  def _abstract(self, fn, *args, **static):
    """`fn(*args)`'s outputs as shapes, laid out as the engine's programs leave them (on a
    mesh: `_out_shardings`), to compile the program that takes them without running `fn`."""
    out = jax.eval_shape(functools.partial(fn, **self._static, **static), *args)
    if self._mesh is None:
      return out
    return jax.tree.map(lambda o, sh: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh), out,
                        self._out_shardings(out))

  def _release_exe(self, args):
    return self._program("release", programs.release_program, (0,), *args,
                         sliding_groups=self.sliding_groups)

  def _tables_exe(self, args):
    # found once (as the decode program): `_program`'s signature walks every state leaf
    if self._tables is None:
      self._tables = self._program("tables", programs.tables_program, (0,), *args,
                                   sliding_groups=self.sliding_groups)
    return self._tables

  def _decode_exe(self, args):
    # A decode call's argument shapes depend only on its row count (the state and parameters
    # never change shape), so its program is found by that count: `_program`'s signature walks
    # every leaf of the parameters and the state, a cost paid on every step otherwise.
    rows = len(args[2])
    if rows not in self._decode_exes:
      self._decode_exes[rows] = self._lookup_decode_exe(args)
    return self._decode_exes[rows]

  def _lookup_decode_exe(self, args):
    if self.paged:
      return self._program(f"decode{len(args[2])}", programs.decode_rows_program, (1,), *args,
                           steps=self.config.steps_per_call, sliding_groups=self.sliding_groups)
    return self._program("decode", programs.decode_program, (1,), *args,
                         steps=self.config.steps_per_call)

  def _move_exe(self, args):
    return self._program("move", programs.move_program, (0,), *args,
                         sliding_groups=self.sliding_groups)

  def warmup(self) -> float:
    """Compiles every program (one per layer group of each bucket; the decode step) now, so
    that no request waits for a compile. Returns the seconds spent."""
    t0 = self._counters["compile_s"]
    for b in self.buckets:
      bounds = self.bucket_bounds[b]
      carried = np.zeros((1, b), np.int32)
      if len(bounds) > 2:  # layer groups: G - 1 group programs, then the last one
        lengths, parts = np.ones((1,), np.int32), ()
        for lo, hi in zip(bounds[:-2], bounds[1:-1]):
          args = (self.params, carried, lengths)
          self._group_exe(b, lo, hi, args)
          carried, part = self._abstract(programs.prefill_group_program, *args, lo=lo, hi=hi,
                                         block_size=self.config.block_size)
          parts += (part,)
        args = self._admit_args((carried, parts), 1, 0, SamplingParams(), 0)
        self._last_exe(b, bounds[-2], args)
        continue
      self._admit_exe(b, self._admit_args(carried, 1, 0, SamplingParams(), 0))
    for rows in (self.batches if self.paged else (None,)):
      self._decode_exe(self._decode_args(rows))
    if self.paged:
      self._release_exe((self.state, self._release_mask))
      self._move_exe((self.state, np.int32(0), np.int32(0)))
    if self.lazy:
      self._tables_exe((self.state, np.zeros((self.num_slots, self.pages_per_seq), np.int32),
                        np.zeros(self.num_slots, bool)))
    return self._counters["compile_s"] - t0

  @property
  def num_programs(self) -> int:
    return len(self._exes)

  # ------------------------------------------------------------------ requests
  def encode(self, prompt: str | Sequence[int]) -> list[int]:
    """Token ids of a prompt (a string needs the model's tokenizer)."""
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise ValueError("prompt must be token ids: the model has no tokenizer")
      return self.tokenizer.encode(prompt)
    ids = list(prompt)
    vocab = self.model.config.vocab_size
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < vocab
               for t in ids):
      raise ValueError(f"prompt token ids must be ints in [0, {vocab})")
    return [int(t) for t in ids]

  @property
  def closed(self) -> bool:
    """True once `shutdown` began: nothing more is admitted."""
    return self._closed

  def max_tokens_for(self, prompt_len: int) -> int:
    """The most new tokens a request with a `prompt_len`-token prompt may ask for: its slot's
    room after stage 1, within max_model_len."""
    room = self.plan.capacity - self._kept(prompt_len)
    if self.model.config.window_layers:  # sliding layers hold the window + max_new_tokens
      room = min(room, self.plan.max_new_tokens)
    return max(0, min(room, self.config.max_model_len - prompt_len))

  def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
    """ValueError if the request can never run here (too long for a slot)."""
    n, p = len(prompt_ids), self.config.max_prompt_len
    if n < 1:
      raise ValueError("prompt must hold at least one token")
    if n > p:
      raise ValueError(f"prompt has {n} tokens; at most {p} are accepted (max_model_len "
                       f"{self.config.max_model_len} - max_new_tokens {self.config.max_new_tokens})")
    if n + params.max_tokens > self.config.max_model_len:
      raise ValueError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) must be <= "
                       f"max_model_len {self.config.max_model_len}")
    room = self.max_tokens_for(n)
    if params.max_tokens > room:
      raise ValueError(f"max_tokens must be <= {room} for a prompt of {n} tokens (the "
                       f"{self.plan.method} cache holds {self.plan.capacity} tokens), got "
                       f"{params.max_tokens}")

  def _kept(self, n: int) -> int:
    """Prompt tokens stage 1 keeps of an n-token prompt (an upper bound over layers)."""
    return min(n, max(self.plan.prompt_budget, min(n, self.plan.window_size)))

  def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                  request_id: str | None = None,
                  on_output: Callable[[Output], None] | None = None) -> RequestHandle:
    """Queues a request. ValueError: it can never run (bad ids, too long); QueueFull: the
    waiting queue is full; EngineClosed: the engine is shutting down."""
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
      raise ValueError(f"params must be a SamplingParams, got {params!r}")
    ids = self.encode(prompt)
    self.check(ids, params)
    detok = None if self.tokenizer is None else self.tokenizer.decode
    with self._lock:
      if self._closed:
        raise EngineClosed("the engine is shutting down")
      if len(self._waiting) >= self.config.max_waiting:
        raise QueueFull(f"{len(self._waiting)} requests are waiting (max_waiting)")
      rid = request_id or f"req-{next(self._ids)}"
      if rid in self._requests:
        raise ValueError(f"request_id {rid!r} is already running")
      req = Request(rid, ids, params, detok, self.eos_ids, on_output)
      self._requests[rid] = req
      self._waiting.append(req)
      self._counters["prompt_tokens"] += len(ids)
      self._lock.notify_all()
    return RequestHandle(req, self.abort)

  def abort(self, request_id: str) -> None:
    """Cancels a request (waiting, prefilling or running); its slot and pages are freed at the
    next step."""
    with self._lock:
      req = self._requests.get(request_id)
      if req is not None:
        req.aborted.set()
        self._lock.notify_all()

  def stats(self) -> EngineStats:
    with self._lock:
      running = [r for r in self._slots if r is not None]
      if self.paged:  # prefilling requests hold their pages too
        held = sum(map(len, self._slot_pages)) + sum(len(p.pages) for p in self._prefilling)
        usage = held / (self.num_pages - 1)
      else:
        held = int(self._held.sum()) + sum(self._kept(len(p.req.prompt_ids))
                                           for p in self._prefilling)
        usage = held / (self.num_slots * self.plan.capacity)
      return EngineStats(
          num_running=len(running), num_waiting=len(self._waiting), num_slots=self.num_slots,
          kv_cache_usage=usage,
          slot_bytes=int(self.slot_bytes),
          prompt_tokens_total=int(self._counters["prompt_tokens"]),
          generation_tokens_total=int(self._counters["generation_tokens"]),
          requests_finished_total=int(self._counters["finished"]),
          prefill_seconds_total=float(self._counters["prefill_s"]),
          decode_seconds_total=float(self._counters["decode_s"]),
          num_prefilling=len(self._prefilling),
          num_preemptions=int(self._counters["preemptions"]),
          recomputed_tokens_total=int(self._counters["recomputed_tokens"]))

  # ------------------------------------------------------------------ the loop
  def has_work(self) -> bool:
    with self._lock:
      return (bool(self._waiting) or bool(self._prefilling)
              or any(r is not None for r in self._slots))

  def step(self) -> None:
    """One iteration: drop cancelled requests, run the next layer group of each prefilling
    request (the last one joins the batch), admit waiting ones (prefill, or its first layer
    group), then one decode call over the slots if any is busy (lazy pages: once they hold the
    pages it fills, `_grow`)."""
    self._reap()
    self._release()
    for p in list(self._prefilling):  # one group each: a decode call comes between two
      self._prefill_group(p)
    prefilled, limit = 0, self.config.prefill_tokens_per_step
    while limit is None or prefilled < limit:
      with self._lock:
        free = [i for i, r in enumerate(self._slots) if r is None]
        if len(free) <= len(self._prefilling) or not self._waiting:  # a slot each is theirs
          break
        req = self._waiting[0]
        if req.aborted.is_set():
          self._waiting.popleft()
          self._end(req, "abort")
          continue
        taken, n = [], len(req.prompt_ids)
        bucket = next(b for b in self.buckets if b >= n)
        one_call = len(self.bucket_bounds[bucket]) == 2
        if self.paged:  # first come, first served: the head waits until its pages are free
          need = self._admission_pages(n, req.params.max_tokens)
          if need + self._watermark() > len(self._free_pages):
            break
          taken = self._free_pages[:need]
          del self._free_pages[:need]
          if one_call:
            self._slot_pages[free[0]] = taken
            self._release_mask[free[0]] = False  # the admission rewrites the slot's table
        self._waiting.popleft()
        req.admission = next(self._admissions)
      prefilled += n
      if one_call:
        self._admit(req, free[0], self._page_ids(taken))
        continue
      tokens = np.zeros((1, bucket), np.int32)
      tokens[0, :n] = req.prompt_ids
      p = _Prefilling(req, bucket, tokens, self._seed_of(req), taken)
      with self._lock:
        self._prefilling.append(p)
      self._prefill_group(p)
    if self.lazy and any(r is not None for r in self._slots):
      self._grow()
    if any(r is not None for r in self._slots):
      self._decode()

  def _page_ids(self, taken):
    """A request's page list as the admit programs take it `[NP]` (N past its pages)."""
    if not self.paged:
      return None
    page_ids = np.full(self.pages_per_seq, self.num_pages, np.int32)
    page_ids[:len(taken)] = taken
    return page_ids

  @staticmethod
  def _seed_of(req: Request) -> int:
    return req.params.seed if req.params.seed is not None else zlib.crc32(req.id.encode())

  def _prefill_group(self, p: _Prefilling) -> None:
    """Runs the next layer group of `p`'s prefill; the last one writes its state into a free
    slot (and its pages) and samples its first token (`_finish_admit`)."""
    bounds, g = self.bucket_bounds[p.bucket], p.group
    lo, hi = bounds[g], bounds[g + 1]
    n = len(p.req.prompt_ids)
    lengths = np.array([n], np.int32)
    if hi < bounds[-1]:
      args = (self.params, p.tokens if g == 0 else p.x, lengths)
      try:
        exe = self._group_exe(p.bucket, lo, hi, args)
        t0 = time.perf_counter()
        x, part = exe(*args)
        p.x = jax.block_until_ready(x)  # this group's work falls between two decode calls
        self._counters["prefill_s"] += time.perf_counter() - t0
      except Exception as e:  # pylint: disable=broad-except
        with self._lock:
          self._drop_prefilling(p, "error", f"prefill failed: {type(e).__name__}: {e}")
        raise
      p.parts += (part,)
      p.group += 1
      self._counters["prefill_groups"] += 1
      return
    with self._lock:  # the last group: the request takes a free slot (one is kept for it)
      self._prefilling.remove(p)
      slot = next(i for i, r in enumerate(self._slots) if r is None)
      if self.paged:
        self._slot_pages[slot] = p.pages
        self._release_mask[slot] = False  # the admission rewrites the slot's table
    args = self._admit_args((p.x, p.parts), n, slot, p.req.params, p.seed,
                            self._page_ids(p.pages))
    p.x, p.parts = None, ()
    self._counters["prefill_groups"] += 1
    self._finish_admit(p.req, slot, p.seed, args, functools.partial(self._last_exe, p.bucket, lo))

  def _drop_prefilling(self, p: _Prefilling, reason: str, error: str | None = None) -> None:
    """(lock held) Ends a prefilling request: its pages (never in a table) are free at once."""
    self._prefilling.remove(p)
    self._free_pages += p.pages
    p.pages, p.x, p.parts = [], None, ()
    self._end(p.req, reason, error)

  def pages_needed(self, prompt_len: int, max_tokens: int) -> int:
    """Pages a request takes in a paged pool: its kept prompt tokens + max_tokens (its worst
    case; under lazy allocation it never holds more)."""
    return min(self.pages_per_seq, -(-(self._kept(prompt_len) + max_tokens) // self.page_size))

  def _admission_pages(self, prompt_len: int, max_tokens: int) -> int:
    """Pages a request takes when it is admitted: all it may need ("reserve"), or those of its
    kept prompt tokens and its first decode call ("lazy")."""
    need = self.pages_needed(prompt_len, max_tokens)
    if not self.lazy:
      return need
    first = self._kept(prompt_len) + self.config.steps_per_call
    return min(need, -(-first // self.page_size))

  def _watermark(self) -> int:
    """(lock held) Free pages an admission must leave ("lazy"): one decode call's worth for
    every admitted request, so that admitting does not preempt at the next call."""
    if not self.lazy:
      return 0
    busy = sum(r is not None for r in self._slots) + len(self._prefilling)
    return busy * -(-self.config.steps_per_call // self.page_size)

  def _pages_wanted(self, slot: int) -> int:
    """(lock held) New pages the request in `slot` needs for its next decode call: those its
    cache's rows fill (up to its `pages_needed`; a finished request's extra steps write into
    the scratch page past them)."""
    req = self._slots[slot]
    limit = self.pages_needed(len(req.prompt_ids), req.params.max_tokens)
    # the cache holds `_held - 1` rows (the last token is appended by the next call)
    rows = int(self._held[slot]) - 1 + self.config.steps_per_call
    return max(0, min(limit, -(-rows // self.page_size)) - len(self._slot_pages[slot]))

  def _grow(self) -> None:
    """("lazy") Gives every running request the pages its next decode call fills, preempting
    the most recently admitted requests while the free pages fall short, then writes the page
    tables that changed in one call."""
    with self._lock:
      while True:
        want = {i: self._pages_wanted(i) for i, r in enumerate(self._slots) if r is not None}
        if sum(want.values()) <= len(self._free_pages):
          break
        if self._released or self._release_mask.any():
          # requests ended since this step's release: their tables go to the scratch page in
          # this call, before the decode call, so their pages are free now
          self._table_dirty |= self._release_mask
          self._release_mask[:] = False
          self._free_pages += self._released
          self._released = []
          continue
        self._preempt(max([r for r in self._slots if r is not None]
                          + [p.req for p in self._prefilling], key=lambda r: r.admission))
      for i, n in want.items():
        if n:
          self._slot_pages[i] += self._free_pages[:n]
          del self._free_pages[:n]
          self._table_dirty[i] = True
      mask = self._table_dirty.copy()
      if not mask.any():
        return
      rows = np.full((self.num_slots, self.pages_per_seq), paged_pool.SCRATCH, np.int32)
      for i in np.flatnonzero(mask):
        rows[i, :len(self._slot_pages[i])] = self._slot_pages[i]
      self._table_dirty[:] = False
    args = (self.state, rows, mask)
    self.state = self._tables_exe(args)(*args)

  def _preempt(self, req: Request) -> None:
    """(lock held) Takes the slot (or prefill) and every page of a running or prefilling
    request back and puts it at the head of the queue: it is recomputed from its prompt, and
    regenerates the tokens it has sent before it sends new ones (`Request.preempt`)."""
    p = next((p for p in self._prefilling if p.req is req), None)
    if p is not None:  # its pages were never in a table
      self._prefilling.remove(p)
      self._free_pages += p.pages
      p.pages, p.x, p.parts = [], None, ()
    else:  # its table row goes to the scratch page in this step's tables call
      slot = self._slots.index(req)
      self._slots[slot] = None
      self._held[slot] = 0
      self._temp[slot] = 0.0
      self._free_pages += self._slot_pages[slot]
      self._slot_pages[slot] = []
      self._table_dirty[slot] = True
    self._counters["preemptions"] += 1
    self._counters["recomputed_tokens"] += len(req.generated)
    req.preempt()
    self._waiting.appendleft(req)

  def _release(self) -> None:
    """Points the tables of the slots freed since the last call at the scratch page, then
    returns their pages to the free list (an idle slot keeps decoding: its writes must not
    reach a page another request owns)."""
    if not self.paged:
      return
    self._compact()
    with self._lock:
      mask = self._release_mask.copy()
    if mask.any():
      args = (self.state, mask)
      self.state = self._release_exe(args)(*args)
    with self._lock:
      self._release_mask[mask] = False
      self._free_pages += self._released
      self._released = []

  def _compact(self) -> None:
    """Moves the last busy slots into the free ones below them, so that the busy slots are the
    first ones and a decode call runs only those (`_decode_rows`)."""
    while True:
      with self._lock:
        busy = [i for i, r in enumerate(self._slots) if r is not None]
        holes = [i for i, r in enumerate(self._slots[:busy[-1]]) if r is None] if busy else []
        if not holes:
          return
        src, dst = busy[-1], holes[0]
      args = (self.state, np.int32(src), np.int32(dst))
      self.state = self._move_exe(args)(*args)
      self._counters["moves"] += 1
      with self._lock:
        self._slots[dst], self._slots[src] = self._slots[src], None
        for a in (self._last, self._pos, self._ngen, self._temp, self._top_p, self._seed,
                  self._min_tokens, self._held):
          a[dst] = a[src]
        self._slot_pages[dst], self._slot_pages[src] = self._slot_pages[src], []
        self._release_mask[dst] = False  # it holds the moved request's table now
        self._release_mask[src] = True  # its table still names those pages: to the scratch
        self._temp[src] = 0.0

  def _reap(self) -> None:
    with self._lock:
      for req in [r for r in self._waiting if r.aborted.is_set()]:
        self._waiting.remove(req)
        self._end(req, "abort")
      for p in [p for p in self._prefilling if p.req.aborted.is_set()]:
        self._drop_prefilling(p, "abort")
      for i, req in enumerate(self._slots):
        if req is not None and req.aborted.is_set():
          self._free(i, "abort")

  def _admit(self, req: Request, slot: int, page_ids=None) -> None:
    """The whole prefill of `req` in one call, into `slot` (its pages taken already)."""
    n = len(req.prompt_ids)
    bucket = next(b for b in self.buckets if b >= n)
    tokens = np.zeros((1, bucket), np.int32)
    tokens[0, :n] = req.prompt_ids
    seed = self._seed_of(req)
    args = self._admit_args(tokens, n, slot, req.params, seed, page_ids)
    self._finish_admit(req, slot, seed, args, functools.partial(self._admit_exe, bucket))

  def _finish_admit(self, req: Request, slot: int, seed: int, args, exe_of) -> None:
    """Runs an admit program `exe_of(args)` (the whole prefill, or the last layer group) into
    `slot` and starts the request there with its first token."""
    n = len(req.prompt_ids)
    try:
      exe = exe_of(args)
      t0 = time.perf_counter()
      if self.paged:
        first, kept, self.state = exe(*args)
        kept = int(kept)
      else:
        first, self.state = exe(*args)
      first = int(np.asarray(first)[0])
      self._counters["prefill_s"] += time.perf_counter() - t0
      replay = req.replaying  # a preempted request's first token was sent already
    except Exception as e:  # pylint: disable=broad-except
      with self._lock:
        if self.paged:  # the pages were never written into the slot's table
          self._free_pages += self._slot_pages[slot]
          self._slot_pages[slot] = []
        self._end(req, "error", f"prefill failed: {type(e).__name__}: {e}")
      raise
    if self.paged and kept > self._kept(n):  # its pages were taken for _kept(n): never reached
      with self._lock:
        self._slots[slot] = req
        self._free(slot, "error", f"internal error: a {self.plan.method} state kept {kept} "
                   f"tokens of a {n}-token prompt, past the {self._kept(n)} its pages hold")
      return
    with self._lock:
      self._slots[slot] = req
      self._last[slot], self._pos[slot], self._ngen[slot] = first, n, 1
      self._temp[slot], self._top_p[slot] = req.params.temperature, req.params.top_p
      self._seed[slot], self._min_tokens[slot] = seed, req.params.min_tokens
      self._held[slot] = self._kept(n) + 1
      self._counters["generation_tokens"] += 0 if replay else 1
    req.add_tokens([first])
    if req.finished:
      with self._lock:
        self._free(slot, req.finish_reason)

  def _decode(self) -> None:
    rows = self._decode_rows()
    args = self._decode_args(rows)
    exe = self._decode_exe(args)
    t0 = time.perf_counter()
    out, self.state = exe(*args)
    out = np.asarray(out)  # [S | rows, K]: the host sees each call's tokens (streaming, stops)
    self._counters["decode_s"] += time.perf_counter() - t0
    k, n = out.shape[1], out.shape[0]
    with self._lock:
      busy = [(i, r) for i, r in enumerate(self._slots) if r is not None]
      self._last[:n] = out[:, -1]
      self._pos[:n] += k
      self._ngen[:n] += k
    for i, req in busy:
      before = len(req.generated)
      req.add_tokens(out[i].tolist())
      with self._lock:
        self._counters["generation_tokens"] += len(req.generated) - before
        self._held[i] = min(self._held[i] + k, self.plan.capacity)
        if req.finished:
          self._free(i, req.finish_reason)

  def _free(self, slot: int, reason: str, error: str | None = None) -> None:
    """(lock held) Ends the slot's request and frees the slot."""
    req = self._slots[slot]
    self._slots[slot] = None
    self._held[slot] = 0
    if self.paged and self._slot_pages[slot]:
      self._released += self._slot_pages[slot]
      self._slot_pages[slot] = []
      self._release_mask[slot] = True
    self._temp[slot] = 0.0  # an idle slot decodes greedily
    if req is not None:
      self._end(req, reason, error)

  def _end(self, req: Request, reason: str, error: str | None = None) -> None:
    """(lock held) Finishes `req` and forgets it."""
    req.finish(reason, error)
    self._requests.pop(req.id, None)
    self._counters["finished"] += 1

  # ------------------------------------------------------------------ the thread
  def start(self) -> None:
    """Runs the loop on a daemon thread until `shutdown`."""
    if self._thread is not None:
      return
    self._thread = threading.Thread(target=self._run, name="rocketkv-engine", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while True:
      with self._lock:
        while (not self._closed and not self._waiting and not self._prefilling
               and all(r is None for r in self._slots)):
          self._lock.wait()
        if (self._closed and not any(r is not None for r in self._slots) and not self._waiting
            and not self._prefilling):
          return
      try:
        self.step()
      except Exception as e:  # pylint: disable=broad-except
        self._fail_all(f"{type(e).__name__}: {e}")

  def _fail_all(self, message: str) -> None:
    with self._lock:
      for i, r in enumerate(self._slots):
        if r is not None:
          self._free(i, "error", message)
      for p in list(self._prefilling):
        self._drop_prefilling(p, "error", message)
      self._held[:] = 0
      while self._waiting:
        self._end(self._waiting.popleft(), "error", message)

  def shutdown(self, timeout: float = 30.0) -> None:
    """Stops admitting; lets running (and prefilling) requests finish for up to `timeout`
    seconds, then aborts what is left (waiting requests are aborted at once) and stops the
    thread."""
    with self._lock:
      self._closed = True
      while self._waiting:
        self._end(self._waiting.popleft(), "abort")
      self._lock.notify_all()
    deadline = time.monotonic() + timeout
    while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
      self._thread.join(0.05)
    for r in list(self._requests.values()):
      r.aborted.set()
    if self._thread is not None:
      self._thread.join(5.0)
    with self._lock:
      for i, r in enumerate(self._slots):
        if r is not None:
          self._free(i, "abort")
      for p in list(self._prefilling):
        self._drop_prefilling(p, "abort")

  def generate(self, prompts: Sequence[str | Sequence[int]],
               params: SamplingParams | None = None) -> list[Output]:
    """Runs `prompts` to completion (the loop on this thread unless `start()`ed); one finished
    `Output` per prompt, in order."""
    handles = [self.add_request(p, params) for p in prompts]
    if self._thread is None:
      while self.has_work():
        self.step()
    return [h.result() for h in handles]

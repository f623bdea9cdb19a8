"""Helpers shared by the scripts in benchmarks/: the one call timer, jax profiler trace events,
the long-context prompts, the prompt pass's FLOP count and `--model`'s resolution.

A script run as `python3 benchmarks/x.py` has benchmarks/ on sys.path and imports this as
`import bench_common`. jax is imported inside the functions, so that a script can import this
module before it sets XLA_FLAGS (e.g. the per-op trace flag).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable


@dataclasses.dataclass
class Timing:
  """Wall and process-CPU seconds of each timed call, and what the calls returned."""
  wall: list[float]
  cpu: list[float]  # all threads of this process (`time.process_time`)
  warmup_s: float  # wall seconds of the warm-up calls (compilation included)
  out: Any = None  # the last call's output (the carried state, with `chain`)

  @property
  def median(self) -> float:
    return statistics.median(self.wall)

  @property
  def best(self) -> float:
    return min(self.wall)

  @property
  def mean(self) -> float:
    return statistics.fmean(self.wall)

  @property
  def cpu_median(self) -> float:
    return statistics.median(self.cpu)

  @property
  def cpu_mean(self) -> float:
    return statistics.fmean(self.cpu)


def time_calls(fn: Callable, *args, repeats: int = 1, warmup: int = 1,
               chain: Callable | None = None) -> Timing:
  """Times `fn(*args)`: `warmup` untimed calls (compilation), then `repeats` timed calls, each
  waited for (`jax.block_until_ready`) so that its time is its own.

  `chain(args, out) -> args` gives the next call's arguments from a call's output: a donated
  cache or a decode state carried from step to step (warm-up calls included).
  """
  import jax

  out, t0 = None, time.perf_counter()
  for _ in range(warmup):
    out = jax.block_until_ready(fn(*args))
    if chain is not None:
      args = chain(args, out)
  warmup_s = time.perf_counter() - t0
  wall, cpu = [], []
  for _ in range(repeats):
    t0, c0 = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn(*args))
    wall.append(time.perf_counter() - t0)
    cpu.append(time.process_time() - c0)
    if chain is not None:
      args = chain(args, out)
  return Timing(wall=wall, cpu=cpu, warmup_s=warmup_s, out=out)


def trace_events(fn: Callable[[], Any], **trace_kw) -> list[dict]:
  """The complete ("X") events of a jax profiler trace of `fn()` (XLA:CPU emits per-op events
  only with --xla_cpu_enable_xprof_traceme=true in XLA_FLAGS before jax is imported)."""
  import jax

  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, **trace_kw):
      fn()
    path = sorted(glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
      events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  return [e for e in events if e.get("ph") == "X"]


def niah_prompt_ids(tokenizer, length: int, index: int = 0, seed: int = 0,
                    target_tokens: int | None = None) -> list[int]:
  """Token ids of sample `index` of the `niah_single` eval task at context `length`, at most
  `target_tokens` (default `length`) of them: the haystack chat-templated, or in completion
  form (`tasks.CompletionFormat`) for a tokenizer without a chat template."""
  from rocketkv_jax.eval import tasks

  tok = tasks.formatted(tokenizer, "chat" if tokenizer.chat_template else "completion")
  return tasks.prompt_ids(tok, tasks.make_sample(tok, "niah_single", length, index, seed=seed,
                                                 target_tokens=target_tokens))


def prefill_gflop(config, n: int) -> float:
  """Matmul GFLOPs of an n-token prompt pass that skips masked attention exactly: projections
  and MLP for every token, causal QK^T and PV (n(n+1)/2 pairs per query head), LM head once."""
  d, f, dh = config.hidden_size, config.intermediate_size, config.head_dim
  proj = d * dh * (2 * config.num_heads + 2 * config.num_kv_heads) + 3 * d * f
  attn = 2 * config.num_heads * dh * n * (n + 1) / 2
  return (2 * config.num_layers * (n * proj + attn) + 2 * d * config.vocab_size) / 1e9


def resolve_model(name: str) -> str | None:
  """`rocketkv.models.resolve(name)`, or None after printing `error: --model: ...` (the script
  then exits 2)."""
  import rocketkv_jax as rocketkv

  try:
    return rocketkv.models.resolve(name)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: --model: {e}", file=sys.stderr)
    return None

"""Batched long-context throughput and memory: our full KV, SnapKV and RocketKV against
transformers' own `generate` (full KV) on the same ragged prompt batches.

    python benchmarks/throughput.py                                   # 4K and 8K, batch 1/4/8
    python benchmarks/throughput.py --lengths 4096 --batches 16       # batch 16 where it fits
    python benchmarks/throughput.py --lengths 1024 --batches 1,4 --new-tokens 16 \\
        --methods full,rocketkv,transformers --budgets 256               # a smoke run
    python benchmarks/throughput.py --profile-prefill --lengths 2048 --batches 4
    python benchmarks/throughput.py --dry-run                          # the rows, no runs

Prompts: for a longest prompt of L tokens and batch B, sequence i is the chat-templated (a base
model without a template: completion-form, `tasks.CompletionFormat`) `niah_single` haystack (`rocketkv_jax/eval/tasks.py`, sample i) of
`L - floor(0.1 * L * i / B)` tokens, so every batch is ragged over its top 10% of L. A model
without a tokenizer (tests' tiny checkpoints) gets seeded random ids of the same lengths. The
parent builds them once (`prompts.json` in --out) and every row reads the same ids.

Rows: for each length, dtype and batch: `full`, `snapkv` and `rocketkv` at each budget (and
`recommended`, `RocketConfig.recommended(B)`, when --methods names it) through
`rocketkv.generate`, and `transformers` (full KV, the same ids left-padded with an attention
mask, greedy, its own `generate`). Both sides decode exactly `--new-tokens` tokens (ours:
`eos_token_ids=()`; transformers: `min_new_tokens`). Each row runs in a fresh subprocess (this
script with `--row JSON`) that prints one JSON line, so that its memory is its own.

Reported per row:
  * prefill s: the prompt pass and stage 1 (ours: `stats["prefill_s"]`, compilation excluded;
    transformers: from `generate()` to its first logits processor call). `prefill CPU s`:
    the process's CPU time over the same phase (all threads; steadier than wall time on a
    shared machine).
  * decode tok/s: generated tokens of all sequences per second over the N-1 decode steps
    after the prompt pass (ours: `stats["decode_tokens_per_s"]`; transformers: between its
    first and last logits processor calls, which bracket the same N-1 forward passes).
    `decode ms/step` is the same wall time per step, `decode CPU ms/step` the process's CPU
    time per step.
  * compile s: ours, prefill + decode compilation (never in the times above).
  * KV MB: the KV state kept for decoding (ours: every layer's state with metadata and room
    for the new tokens; transformers: its DynamicCache after the last step).
  * peak RSS MB prefill / decode / process: the child's VmHWM (/proc/self/status) over that
    phase. At each phase boundary freed heap pages go back to the OS (glibc `malloc_trim`)
    and the high-water mark is reset (write "5" to /proc/self/clear_refs), so the decode peak
    excludes the prompt pass and the compiles and starts from the memory still in use;
    "process" is the largest of all phases, loading and compiling included. Ours: phases are
    cut where `rocketkv.generate` compiles (this script passes it a `ProgramCache` whose `get`
    marks them, the one call between prefill and decode). Where the reset is refused, every
    peak is cumulative and the header says so.
Then the issue's targets (issue #16) as ratios of rows of this run, each marked met / NOT met
by wall time with the CPU-time ratio beside it, for every (length, dtype, batch) that has the
rows a target needs.

transformers loads its own dequantisation of the GGUF file (`gguf_file=`; the weights ours
loads, as the parity tests check), converted once per run into a temporary safetensors
directory that every transformers row loads: its GGUF path takes minutes per load.

Output: `throughput.md` and `throughput.json` in --out (default a new git-ignored
`runs/throughput-<timestamp>/`; a folder holding files takes --overwrite), rewritten after
every row so an interrupted grid keeps what it measured.

--profile-prefill: per (length, batch, dtype), full and rocketkv at the first budget, each
compiled once, run once to warm up, then --profile-calls calls traced with XLA:CPU's per-op
trace events (`--xla_cpu_enable_xprof_traceme`): (1) the whole prompt pass
(`llama.prefill`, skipped by --layer-only) and (2) one layer's KV-state build
(`rocketkv.prefill` on random K/V of the model's shapes: for rocketkv that is stage 1). Every
op is attributed to the source lines of its HLO metadata (its stack frame and the caller's),
ops are summed per source, and it prints wall and CPU time per call and the sources whose cost
differs most between the two methods. Trace durations are wall time: on a loaded machine
compare them with each other, and trust the CPU time per call for totals.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time

import bench_common

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS_DIR = os.path.join(_ROOT, "runs")
METHODS = ("full", "snapkv", "rocketkv", "recommended", "transformers")
DEFAULT_METHODS = ("full", "snapkv", "rocketkv", "transformers")
BUDGETED = ("snapkv", "rocketkv", "recommended")  # recommended: RocketConfig.recommended(B)
RAGGED = 0.1  # sequence i of B is L - floor(RAGGED * L * i / B) tokens long


# --------------------------------------------------------------------------- memory and time
def _proc_kb(field: str) -> int | None:
  try:
    with open("/proc/self/status") as f:
      m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
  except OSError:
    return None
  return int(m.group(1)) if m else None


def _peak_mb() -> float:
  kb = _proc_kb("VmHWM")
  if kb is None:  # no /proc: getrusage's maximum (kB on Linux, bytes on macOS)
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024
  return kb / 1024


def _reset_peak() -> bool:
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _trim_heap() -> None:
  """Returns freed heap pages to the OS (glibc `malloc_trim`), so that a phase's peak starts
  from the memory still in use, not from what a compile freed but kept in malloc's arenas."""
  try:
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass


def _cpu_s() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


class Phases:
  """Wall time, CPU time and peak RSS of this process per phase, phases cut by `mark`."""

  def __init__(self):
    self.resettable = _reset_peak()
    self.t, self.cpu = time.perf_counter(), _cpu_s()
    self.out: dict[str, dict] = {}

  def mark(self, name: str) -> None:
    """Ends the running phase, recording it as `name`, and starts the next one."""
    t, cpu = time.perf_counter(), _cpu_s()
    self.out[name] = dict(wall_s=t - self.t, cpu_s=cpu - self.cpu, peak_mb=_peak_mb(),
                          rss_end_mb=(_proc_kb("VmRSS") or 0) / 1024)
    _trim_heap()
    if self.resettable:
      _reset_peak()
    self.t, self.cpu = time.perf_counter(), _cpu_s()

  def process_peak_mb(self) -> float:
    return max(p["peak_mb"] for p in self.out.values())


# --------------------------------------------------------------------------- prompts
def _targets(length: int, batch: int) -> list[int]:
  return [length - int(RAGGED * length * i / batch) for i in range(batch)]


def build_prompts(model_path: str, lengths, batches, seed: int = 0) -> dict[str, list[list[int]]]:
  """{"LxB": B prompts (token ids)} for every length and batch (see the module docstring)."""
  import numpy as np

  from rocketkv_jax import models

  config, tok = models.load_config(model_path)
  out = {}
  for n in lengths:
    for b in batches:
      if tok is None:
        rng = np.random.default_rng([seed, n, b])
        ids = [rng.integers(3, config.vocab_size, size=t).tolist() for t in _targets(n, b)]
      else:
        ids = [bench_common.niah_prompt_ids(tok, n, i, seed=seed, target_tokens=t)
               for i, t in enumerate(_targets(n, b))]
      out[f"{n}x{b}"] = ids
  return out


# --------------------------------------------------------------------------- row workers
def _ours_row(spec: dict, ids: list[list[int]]) -> dict:
  """One `rocketkv.generate` call, phases cut at its two compiles."""
  ph = Phases()
  import jax.numpy as jnp

  import rocketkv_jax as rocketkv

  gen_mod = importlib.import_module("rocketkv_jax.runtime.generate")  # the module, not the function
  model = rocketkv.models.load(spec["model"], dtype=getattr(jnp, spec["dtype"]))
  ph.mark("load")

  class Tracked(gen_mod.ProgramCache):
    def get(self, name, *args):
      ph.mark({"prefill": "setup", "decode": "prefill"}[name])
      out = super().get(name, *args)
      ph.mark(f"{name}_compile")
      return out

  budget = spec["budget"] or 256
  rc = rocketkv.RocketConfig.recommended(budget) if spec["method"] == "recommended" else None
  res = rocketkv.generate(model, ids, method=spec["method"] if rc is None else "rocketkv",
                          token_budget=budget, rocket_config=rc,
                          max_new_tokens=spec["new_tokens"], eos_token_ids=(),
                          programs=Tracked())
  ph.mark("decode")
  s = res.stats
  return dict(
      prefill_s=s["prefill_s"], prefill_cpu_s=ph.out["prefill"]["cpu_s"],
      decode_s=s["decode_s"], decode_cpu_s=ph.out["decode"]["cpu_s"],
      decode_steps=s["decode_steps"], decode_tokens_per_s=s["decode_tokens_per_s"],
      decode_ms_per_step=s["decode_ms_per_token"], compile_s=s["compile_s"],
      kv_bytes=s["kv_cache_bytes"], kv_tokens_kept=s["kv_tokens_kept"],
      kv_tokens_read=s["kv_tokens_read"], xla_peak_bytes=s["peak_bytes"],
      new_tokens=s["new_tokens"], phases=ph.out, peak_reset=ph.resettable,
      peak_prefill_mb=ph.out["prefill"]["peak_mb"], peak_decode_mb=ph.out["decode"]["peak_mb"],
      peak_process_mb=ph.process_peak_mb(), rocket_config=None if rc is None else repr(rc))


def _hf_row(spec: dict, ids: list[list[int]]) -> dict:
  """transformers' `generate` on the same ids, left-padded; phases cut by a logits processor."""
  ph = Phases()
  import torch
  from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

  torch.set_num_threads(os.cpu_count() or 1)
  dtype = getattr(torch, spec["dtype"])
  path = spec.get("hf_model") or spec["model"]
  if os.path.isdir(path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
  else:
    directory, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
  model.eval()
  b, n = len(ids), max(len(p) for p in ids)
  x = torch.zeros((b, n), dtype=torch.long)
  mask = torch.zeros((b, n), dtype=torch.long)
  for i, p in enumerate(ids):  # left padding, as transformers' batched generate expects
    x[i, n - len(p):] = torch.tensor(p)
    mask[i, n - len(p):] = 1
  ph.mark("load")
  calls: list[float] = []

  class Clock(LogitsProcessor):
    """Called once per generated token, after that token's forward pass."""

    def __call__(self, input_ids, scores):
      if not calls:
        ph.mark("prefill")
      calls.append(time.perf_counter())
      return scores

  new = spec["new_tokens"]
  with torch.no_grad():
    t0 = time.perf_counter()
    out = model.generate(x, attention_mask=mask, do_sample=False, max_new_tokens=new,
                         min_new_tokens=new, logits_processor=LogitsProcessorList([Clock()]),
                         return_dict_in_generate=True, pad_token_id=0)
  ph.mark("decode")
  past = out.past_key_values
  kv = sum(t.nbytes for layer in past.layers for t in (layer.keys, layer.values))
  decode_s = calls[-1] - calls[0]
  steps = len(calls) - 1
  return dict(
      prefill_s=ph.out["prefill"]["wall_s"], prefill_cpu_s=ph.out["prefill"]["cpu_s"],
      prefill_to_first_call_s=calls[0] - t0,
      decode_s=decode_s, decode_cpu_s=ph.out["decode"]["cpu_s"], decode_steps=steps,
      decode_tokens_per_s=steps * b / decode_s if steps else 0.0,
      decode_ms_per_step=1e3 * decode_s / max(steps, 1), compile_s=None, kv_bytes=int(kv),
      kv_tokens_kept=n, kv_tokens_read=None, xla_peak_bytes=None,
      new_tokens=[int(out.sequences.shape[1] - n)] * b, phases=ph.out,
      peak_reset=ph.resettable, peak_prefill_mb=ph.out["prefill"]["peak_mb"],
      peak_decode_mb=ph.out["decode"]["peak_mb"], peak_process_mb=ph.process_peak_mb())


def _convert(spec: dict) -> dict:
  """Saves transformers' fp32 load of a GGUF file as a safetensors directory: its GGUF
  dequantisation takes minutes, so the transformers rows load this copy (the same weights)."""
  import torch
  from transformers import AutoModelForCausalLM

  directory, name = os.path.split(spec["model"])
  model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
  # The weights are plain dequantised fp32 tensors (nn.Linear); only the GGUF quantizer object
  # refuses to save them. Without it and its config entry, the copy is an ordinary checkpoint.
  model.hf_quantizer = None
  if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
  model.save_pretrained(spec["to"], safe_serialization=True)
  return dict(path=spec["to"])


def _run_row(spec: dict) -> dict:
  with open(spec["prompts"]) as f:
    ids = json.load(f)[f"{spec['length']}x{spec['batch']}"]
  if spec["method"] == "transformers":
    return _hf_row(spec, ids)
  return _ours_row(spec, ids)


# --------------------------------------------------------------------------- prefill profile
_SKIP = ("Thunk", "Pjit", "PjRt", "$", "SlinkyThreadPool", "Handle inputs", "ParseArguments",
         "AllocateOutputBuffers", "PythonRefManager", "end: ")  # runtime frames, not ops


def _hlo_sources(hlo_text: str) -> dict[str, str]:
  """HLO instruction name -> "file:line function < caller file:line function (op)", from the
  instruction's metadata (`stack_frame_id` into the module's StackFrames table)."""
  tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
  section = None
  for line in hlo_text.splitlines():
    if line.strip() in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = line.strip()
      continue
    m = re.match(r"(\d+) (.*)$", line)
    if section and m:
      tables[section][int(m.group(1))] = m.group(2)
    elif not line.strip():
      section = None
  field = lambda text, name: int(re.search(rf"{name}=(\d+)", text).group(1))

  def frame(i: int) -> tuple[str, int]:
    loc = tables["FileLocations"][field(tables["StackFrames"][i], "file_location_id")]
    name = tables["FileNames"][field(loc, "file_name_id")].strip('"')
    func = tables["FunctionNames"][field(loc, "function_name_id")].strip('"')
    # parent_frame_id is one more than the parent's id; 0 is no parent (the root)
    return (f"{os.path.basename(name)}:{field(loc, 'line')} {func}",
            field(tables["StackFrames"][i], "parent_frame_id") - 1)

  src: dict[str, str] = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = .*metadata=\{([^}]*)\}", line)
    if not m:
      continue
    op = re.search(r'op_name="([^"]+)"', m.group(2))
    sf = re.search(r"stack_frame_id=(\d+)", m.group(2))
    where = []
    try:
      i = int(sf.group(1)) if sf else 0
      while i > 0 and len(where) < 2:
        text, parent = frame(i)
        where.append(text)
        i = parent if parent != i else 0
    except (KeyError, AttributeError):
      pass
    label = " < ".join(where) or "?"
    src[m.group(1)] = label + (f" ({op.group(1).split('/')[-1]})" if op else "")
  return src


def _trace_ms(fn, args, calls: int) -> tuple[dict[str, float], float, float]:
  """(ms per call by source line of every traced op, best wall s, CPU s per call) of a
  compiled `fn(*args)` over `calls` traced calls."""
  import jax

  jax.block_until_ready(fn(*args))  # warm up, outside the trace
  timing = None

  def traced():
    nonlocal timing
    timing = bench_common.time_calls(fn, *args, repeats=calls, warmup=0)

  events = bench_common.trace_events(traced)
  src = _hlo_sources(fn.as_text())
  per_src: collections.Counter = collections.Counter()
  for e in events:
    if not any(s in e["name"] for s in _SKIP):
      per_src[src.get(e["name"], e["name"])] += e.get("dur", 0) / calls / 1e3
  return dict(per_src), timing.best, timing.cpu_mean


def _profile_row(spec: dict) -> dict:
  """Per-op profiles of full's and rocketkv's prompt pass and of one layer's state build."""
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_cpu_enable_xprof_traceme=true").strip()
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np

  import rocketkv_jax as rocketkv
  from rocketkv_jax.models import llama

  with open(spec["prompts"]) as f:
    ids = json.load(f)[f"{spec['length']}x{spec['batch']}"]
  model = rocketkv.models.load(spec["model"], dtype=getattr(jnp, spec["dtype"]))
  cfg = model.config
  lengths = np.array([len(p) for p in ids], np.int32)
  tokens = np.zeros((len(ids), lengths.max()), np.int32)
  for i, p in enumerate(ids):
    tokens[i, :len(p)] = p
  tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
  b, n = tokens.shape
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  kv_dtype = model.params["embed"].dtype
  k = jax.random.normal(keys[0], (b, cfg.num_kv_heads, n, cfg.head_dim), kv_dtype)
  v = jax.random.normal(keys[1], (b, cfg.num_kv_heads, n, cfg.head_dim), kv_dtype)
  out = {}
  for method in ("full", "rocketkv"):
    rc = rocketkv.RocketConfig(token_budget=spec["budget"], method=method)
    plan = rocketkv.plan(rc, n, spec["new_tokens"], cfg.head_dim)
    qw = jax.random.normal(keys[2], (b, cfg.num_heads, plan.window_size, cfg.head_dim), kv_dtype)
    res = {}
    if spec.get("whole", True):
      fn = jax.jit(functools.partial(llama.prefill, config=cfg, plan=plan))
      exe = fn.lower(model.params, tokens, lengths).compile()
      res["pass"] = _trace_ms(exe, (model.params, tokens, lengths), spec["calls"])
    fn = jax.jit(lambda k, v, qw, lengths, plan=plan: rocketkv.prefill(k, v, qw, plan,
                                                                       lengths=lengths))
    exe = fn.lower(k, v, qw, lengths).compile()
    res["layer"] = _trace_ms(exe, (k, v, qw, lengths), max(spec["calls"], 5))
    out[method] = res
  out["num_layers"] = cfg.num_layers
  return out


def _profile_report(res: dict, top: int) -> list[str]:
  lines = []
  for part, title in (("pass", "whole prompt pass (llama.prefill)"),
                      ("layer", "one layer's KV state (rocketkv.prefill on random K/V of the "
                                "model's shapes)")):
    if part not in res["full"]:
      continue
    (f_ms, f_best, f_cpu), (r_ms, r_best, r_cpu) = res["full"][part], res["rocketkv"][part]
    lines += [f"{title}: wall best full {f_best * 1e3:.1f} ms, rocketkv {r_best * 1e3:.1f} ms; "
              f"CPU per call full {f_cpu * 1e3:.1f} ms, rocketkv {r_cpu * 1e3:.1f} ms "
              f"({r_cpu / f_cpu - 1:+.1%}); traced op time per call full "
              f"{sum(f_ms.values()):.1f} ms, rocketkv {sum(r_ms.values()):.1f} ms"]
    if part == "layer":
      lines.append(f"  x {res['num_layers']} layers: stage 1 adds "
                   f"{(r_cpu - f_cpu) * res['num_layers']:.2f} CPU s per prompt pass")
    lines.append("  ms per call by source (rocketkv, full, difference), largest differences:")
    diff = {k: r_ms.get(k, 0.0) - f_ms.get(k, 0.0) for k in set(f_ms) | set(r_ms)}
    for k in sorted(diff, key=lambda k: -abs(diff[k]))[:top]:
      lines.append(f"  {r_ms.get(k, 0.0):9.1f} {f_ms.get(k, 0.0):9.1f} {diff[k]:+9.1f}  {k}")
  return lines


# --------------------------------------------------------------------------- the grid
def _rows(a) -> list[dict]:
  rows = []
  for n in a.lengths:
    for dt in a.dtypes:
      for b in a.batches:
        for m in a.methods:
          for budget in (a.budgets if m in BUDGETED else [None]):
            rows.append(dict(method=m, budget=budget, length=n, batch=b, dtype=dt,
                             new_tokens=a.new_tokens, model=a.model))
  return rows


def _label(r: dict) -> str:
  return r["method"] + (f"@{r['budget']}" if r["budget"] else "")


HEADER = ("| prompt tokens (max / all) | batch | dtype | system | prefill s | prefill CPU s "
          "| decode tok/s | decode ms/step | decode CPU ms/step | compile s | KV MB "
          "| peak RSS MB prefill | peak RSS MB decode | peak RSS MB process |")
NCOLS = HEADER.count("|") - 1


def _md_row(r: dict) -> str:
  toks = f"{r['length']} / {r.get('prompt_tokens', '?')}"
  head = f"| {toks} | {r['batch']} | {r['dtype']} | {_label(r)} "
  if "error" in r:
    return head + f"| error: {r['error']} |" + " |" * (NCOLS - 5)
  f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"
  return (head + f"| {f(r['prefill_s'])} | {f(r['prefill_cpu_s'])} "
          f"| {f(r['decode_tokens_per_s'], 1)} | {f(r['decode_ms_per_step'], 1)} "
          f"| {f(1e3 * r['decode_cpu_s'] / max(r['decode_steps'], 1), 1)} "
          f"| {f(r['compile_s'], 1)} | {r['kv_bytes'] / 2**20:.1f} "
          f"| {r['peak_prefill_mb']:.0f} | {r['peak_decode_mb']:.0f} "
          f"| {r['peak_process_mb']:.0f} |")


def _cpu_tps(r: dict) -> float:
  """Decode tokens per CPU second of the whole process (all threads)."""
  return r["decode_steps"] * r["batch"] / max(r["decode_cpu_s"], 1e-9)


def targets(rows: list[dict]) -> list[str]:
  """Issue #16's targets as ratios of rows of this run, for each (length, dtype, batch) that has
  the rows a target needs. Wall-time ratios decide met / NOT met; the same ratio in CPU time
  follows in parentheses (on a shared machine wall time also counts time spent waiting)."""
  got = {(r["length"], r["dtype"], r["batch"], _label(r)): r for r in rows if "error" not in r}
  out = []

  def line(name, num, den, op, limit, cpu=None):
    r = num / den
    ok = r >= limit if op == ">=" else r <= limit
    out.append(f"- {name}: {num:.2f} / {den:.2f} = {r:.2f} (target {op} {limit}): "
               f"{'met' if ok else 'NOT met'}" + ("" if cpu is None else
                                                   f" (CPU time: {cpu:.2f})"))

  for (n, dt, b) in sorted({k[:3] for k in got}):
    full, hf = got.get((n, dt, b, "full")), got.get((n, dt, b, "transformers"))
    rkv = got.get((n, dt, b, "rocketkv@256"))
    where = f"{n} x {b} {dt}"
    for name, x, y in (("RocketKV@256 decode tok/s / our full KV's", rkv, full),
                       ("RocketKV@256 decode tok/s / transformers'", rkv, hf),
                       ("our full-KV decode tok/s / transformers'", full, hf)):
      if x and y:
        line(f"{where}: {name}", x["decode_tokens_per_s"], y["decode_tokens_per_s"], ">=",
             5 if y is hf and x is rkv else 4 if x is rkv else 1, _cpu_tps(x) / _cpu_tps(y))
    if rkv and full:
      line(f"{where}: RocketKV@256 decode peak RSS / our full KV's decode peak RSS (MB)",
           rkv["peak_decode_mb"], full["peak_decode_mb"], "<=", 0.5)
    for label in sorted(k[3] for k in got if k[:3] == (n, dt, b) and k[3].startswith("rocketkv@")):
      r = got[(n, dt, b, label)]
      if full:
        line(f"{where}: {label} prefill s / our full KV's", r["prefill_s"], full["prefill_s"],
             "<=", 1.05, r["prefill_cpu_s"] / full["prefill_cpu_s"])
  return out


def _write(out_dir: str, a, info: list[str], rows: list[dict]) -> None:
  with open(os.path.join(out_dir, "throughput.json"), "w") as f:
    json.dump(dict(args=vars(a), info=info, rows=rows), f, indent=1, default=str)
  lines = ["# Batched throughput and memory (benchmarks/throughput.py)", "",
           f"{os.path.basename(a.model)}, greedy, {a.new_tokens} new tokens per sequence, "
           f"ragged prompts (sequence i of B: L - floor({RAGGED} L i / B) tokens).", ""]
  lines += [f"- {x}" for x in info] + ["", HEADER, "|" + "---|" * NCOLS]
  lines += [_md_row(r) for r in rows]
  t = targets(rows)
  if t:
    lines += ["", "Targets (issue #16; ratios of rows above):", ""] + t
  with open(os.path.join(out_dir, "throughput.md"), "w") as f:
    f.write("\n".join(lines) + "\n")


def output_dir(out: str | None, overwrite: bool) -> str:
  """`out`, or a new `runs/throughput-<timestamp>/`; a folder with files needs `overwrite`."""
  if out is None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out, i = os.path.join(RUNS_DIR, f"throughput-{stamp}"), 1
    while os.path.exists(out):
      out, i = os.path.join(RUNS_DIR, f"throughput-{stamp}-{i}"), i + 1
    return out
  if os.path.exists(out) and not os.path.isdir(out):
    raise ValueError(f"--out {out!r} is a file, not a folder")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise ValueError(f"--out {out!r} already holds files; pass --overwrite to write into it "
                     "(or leave --out out: a new runs/throughput-<timestamp>/ folder)")
  return out


def _child(spec: dict, timeout: float | None) -> dict:
  """Runs one row (or profile) in a fresh interpreter; its last stdout line is the JSON."""
  cmd = [sys.executable, os.path.abspath(__file__), "--row", json.dumps(spec)]
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return dict(error=f"timed out after {timeout:.0f} s")
  if p.returncode != 0:
    tail = (p.stderr.strip().splitlines() or ["?"])[-1]
    return dict(error=f"exit {p.returncode}: {tail[-200:]}")
  return json.loads(p.stdout.strip().splitlines()[-1])


def _info() -> list[str]:
  import importlib.metadata as md

  import jax

  from rocketkv_jax.models import precision

  try:
    commit = subprocess.run(["git", "-C", _ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
  except OSError:
    commit = "?"
  try:  # versions without importing them (seconds of imports)
    hf = f"transformers {md.version('transformers')}, torch {md.version('torch')}"
  except md.PackageNotFoundError:
    hf = "transformers not installed"
  return [f"jax {jax.__version__} ({jax.default_backend()}), {hf}, {os.cpu_count()} CPU cores "
          f"({platform.processor() or platform.machine()}); XLA:CPU bf16 dots native: "
          f"{'yes' if precision.native_bf16_cpu() else 'no'}; commit {commit}",
          f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average "
          f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())}"]


def _ints(s: str) -> list[int]:
  return [int(x) for x in s.split(",") if x]


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=None,
                 help="smollm2 (the embedded SmolLM2-135M, the default), gemma3 (Gemma 3 270M), "
                      "an HF directory or a .gguf")
  p.add_argument("--lengths", default="4096,8000",
                 help="longest prompt per batch, comma-separated (8000 + 64 new fit in 8192)")
  p.add_argument("--batches", default="1,4,8",
                 help="batch sizes (16 at 8000 tokens: ~15 GB for our full-KV prompt pass)")
  p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                 help=f"any of {','.join(METHODS)} (recommended: RocketConfig.recommended(B); "
                      f"default {','.join(DEFAULT_METHODS)})")
  p.add_argument("--budgets", default="256,512", help="B for snapkv, rocketkv and recommended")
  p.add_argument("--dtypes", default="float32", help="float32 and/or bfloat16")
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--seed", type=int, default=0, help="prompt sample seed")
  p.add_argument("--row-timeout", type=float, default=None, help="seconds per row")
  p.add_argument("--out", default=None,
                 help="output folder (default: a new runs/throughput-<timestamp>/)")
  p.add_argument("--overwrite", action="store_true")
  p.add_argument("--dry-run", action="store_true", help="list the rows and exit")
  p.add_argument("--profile-prefill", action="store_true",
                 help="per-op profile of stage 1 in the prompt pass instead of the grid")
  p.add_argument("--profile-calls", type=int, default=2, help="traced calls per program")
  p.add_argument("--layer-only", action="store_true",
                 help="--profile-prefill: one layer's state build only, not the whole pass")
  p.add_argument("--top", type=int, default=20, help="--profile-prefill: lines shown")
  p.add_argument("--row", default=None, help=argparse.SUPPRESS)
  return p


def _check(a) -> None:
  """User errors, before anything heavy runs (ValueError -> `error: ...`, exit 2)."""
  try:
    a.lengths, a.batches, a.budgets = _ints(a.lengths), _ints(a.batches), _ints(a.budgets)
  except ValueError as e:
    raise ValueError(f"--lengths, --batches and --budgets take comma-separated integers ({e})")
  a.methods = [m for m in a.methods.split(",") if m]
  a.dtypes = [d for d in a.dtypes.split(",") if d]
  bad = [m for m in a.methods if m not in METHODS]
  if bad or not a.methods:
    raise ValueError(f"--methods must be a subset of {','.join(METHODS)}, got {bad or 'none'}")
  if not a.dtypes or any(d not in ("float32", "bfloat16") for d in a.dtypes):
    raise ValueError(f"--dtypes must be float32 and/or bfloat16, got {a.dtypes}")
  for name in ("lengths", "batches", "budgets"):
    if not getattr(a, name) or min(getattr(a, name)) < 1:
      raise ValueError(f"--{name} must be positive integers")
  if a.new_tokens < 2:
    raise ValueError(f"--new-tokens must be >= 2 (one decode step), got {a.new_tokens}")
  from rocketkv_jax import models
  try:
    a.model = models.resolve(a.model)
  except ValueError as e:
    raise ValueError(f"--model: {e}") from None
  if not a.dry_run:
    a.out = output_dir(a.out, a.overwrite)


def main(argv=None) -> int:
  a = _parser().parse_args(argv)
  if a.row is not None:  # a child: one row, one JSON line
    spec = json.loads(a.row)
    work = _profile_row if spec.get("profile") else _convert if spec.get("to") else _run_row
    res = work(spec)
    print(json.dumps(res, default=str), flush=True)
    return 0
  try:
    _check(a)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if a.dry_run:
    for r in _rows(a):
      print(f"{r['length']} x {r['batch']} {r['dtype']} {_label(r)}")
    return 0
  os.makedirs(a.out, exist_ok=True)
  info = _info()
  for x in info:
    print("# " + x, flush=True)
  prompts = os.path.join(a.out, "prompts.json")
  t0 = time.perf_counter()
  with open(prompts, "w") as f:
    json.dump(build_prompts(a.model, a.lengths, a.batches, a.seed), f)
  print(f"# prompts built in {time.perf_counter() - t0:.1f} s: {prompts}", flush=True)

  if a.profile_prefill:
    budget = a.budgets[0]
    lines = []
    for n in a.lengths:
      for dt in a.dtypes:
        for b in a.batches:
          res = _child(dict(profile=True, length=n, batch=b, dtype=dt, budget=budget,
                            new_tokens=a.new_tokens, model=a.model, prompts=prompts,
                            calls=a.profile_calls, whole=not a.layer_only), a.row_timeout)
          head = f"## {n} x {b} {dt}, rocketkv@{budget} vs full"
          body = [f"error: {res['error']}"] if "error" in res else _profile_report(res, a.top)
          print("\n".join([head] + body), flush=True)
          lines += [head, "", "```"] + body + ["```", ""]
          with open(os.path.join(a.out, f"profile_prefill_{n}x{b}_{dt}.json"), "w") as f:
            json.dump(res, f, indent=1)
    with open(os.path.join(a.out, "profile_prefill.md"), "w") as f:
      f.write("# Prompt-pass profile (benchmarks/throughput.py --profile-prefill)\n\n"
              + "\n".join(f"- {x}" for x in info) + "\n\n" + "\n".join(lines))
    return 0

  with open(prompts) as f:
    n_tokens = {k: sum(len(p) for p in v) for k, v in json.load(f).items()}
  with tempfile.TemporaryDirectory(prefix="throughput_hf_") as tmp:
    hf_model = None
    if "transformers" in a.methods and not os.path.isdir(a.model):
      t0 = time.perf_counter()
      res = _child(dict(model=a.model, to=os.path.join(tmp, "model")), None)
      if "error" in res:
        print(f"error: converting {a.model} for transformers failed: {res['error']}",
              file=sys.stderr)
        return 1
      hf_model = res["path"]
      print(f"# transformers' GGUF load saved as safetensors in {time.perf_counter() - t0:.0f} s",
            flush=True)
    rows = _grid(a, info, prompts, n_tokens, hf_model)
  info.append(f"finished {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load average "
              f"{'/'.join(f'{x:.1f}' for x in os.getloadavg())}")
  if not all(r.get("peak_reset", True) for r in rows):
    info.append("peak RSS could not be reset per phase here: every peak is cumulative")
  _write(a.out, a, info, rows)
  for x in ["", "Targets:"] + targets(rows):
    print(x, flush=True)
  print(f"# wrote {a.out}/throughput.md and throughput.json", flush=True)
  return 0


def _grid(a, info, prompts, n_tokens, hf_model) -> list[dict]:
  rows = []
  print(HEADER, flush=True)
  for spec in _rows(a):
    res = _child(dict(spec, prompts=prompts, hf_model=hf_model), a.row_timeout)
    row = dict(spec, prompt_tokens=n_tokens[f"{spec['length']}x{spec['batch']}"], **res)
    rows.append(row)
    print(_md_row(row), flush=True)
    _write(a.out, a, info, rows)
  return rows


if __name__ == "__main__":
  sys.exit(main())

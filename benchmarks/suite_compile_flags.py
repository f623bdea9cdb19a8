"""How XLA flags change the test suite's compile time (tests/xla_env.py's FAST_COMPILE).

Each child Python builds the suite's tiny llama checkpoint (tests/eval_fixtures.py), runs one
ragged prompt pass and four methods' decodes through the eval runner, and reports the seconds of
those first calls (compile-bound) and of the same calls again (run-bound), with a digest of the
tokens. The flag sets run in fresh children, alternating, `--reps` times each:

    python benchmarks/suite_compile_flags.py              # default XLA, -O0, FAST_COMPILE; ~6 min
    python benchmarks/suite_compile_flags.py --reps 1 --sets default

Results: docs/cpu_performance.md, "The tests and CI".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, _TESTS)
from xla_env import FAST_COMPILE  # noqa: E402  pylint: disable=wrong-import-position

SETS = {
    "default": "",
    "O0": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
    "no_fusion_emitters": "--xla_cpu_use_fusion_emitters=false",
    "fast_compile": FAST_COMPILE,
}

_CHILD = """
import hashlib, sys, time
sys.path.insert(0, {tests!r})
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import numpy as np
from rocketkv_jax.eval import runner as runner_lib
from eval_fixtures import tiny_model

runner = runner_lib.Runner(tiny_model(), eos_token_ids=(), window_size=8, quest_page_size=4)
rng = np.random.default_rng(5)
tokens = rng.integers(3, 256, size=(3, 48)).astype(np.int32)
lengths = np.array([48, 35, 21], np.int32)
specs = ["full", "rocketkv", "quest", "rocketkv:stage2=quant"]

def calls():
  start = time.perf_counter()
  pp = runner.prompt_pass(tokens, lengths)
  out = [np.asarray(runner.decode(pp, s, 16, 6)[1]) for s in specs]
  return time.perf_counter() - start, hashlib.md5(np.concatenate(out).tobytes()).hexdigest()

first, digest = calls()
again, _ = calls()
print("RESULT", first, again, digest[:10])
"""


def run_child(flags: str) -> tuple[float, float, str]:
  """(first calls s, again s, token digest) of one child run with XLA_FLAGS=`flags`."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  proc = subprocess.run([sys.executable, "-c", _CHILD.format(tests=_TESTS)], env=env,
                        capture_output=True, text=True, cwd=_TESTS, check=False)
  lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
  if proc.returncode or not lines:
    raise RuntimeError(f"child with XLA_FLAGS={flags!r} failed:\n{proc.stderr[-2000:]}")
  _, first, again, digest = lines[-1].split()
  return float(first), float(again), digest


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--reps", type=int, default=3, help="runs per flag set (default 3)")
  ap.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS),
                  help="flag sets to time (default all)")
  args = ap.parse_args(argv)
  if args.reps < 1:
    print("error: --reps must be >= 1", file=sys.stderr)
    return 2
  rows = {name: [] for name in args.sets}
  for _ in range(args.reps):
    for name in args.sets:
      rows[name].append(run_child(SETS[name]))
  base = statistics.median(r[0] for r in rows[args.sets[0]])
  print(f"| flags | first calls s (median of {args.reps}) | vs {args.sets[0]} | again s | tokens |")
  print("|---|---|---|---|---|")
  for name, runs in rows.items():
    first = statistics.median(r[0] for r in runs)
    again = statistics.median(r[1] for r in runs)
    digests = ",".join(sorted({r[2] for r in runs}))
    print(f"| {name} | {first:.2f} | {first / base:.2f}x | {again:.3f} | {digests} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())

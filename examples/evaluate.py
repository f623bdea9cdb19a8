"""Long-context accuracy vs token budget for every KV method (NIAH, RULER-style, LongBench).

    python examples/evaluate.py --tasks passkey niah_single --lengths 2048 4096 \\
        --methods full rocketkv snapkv quest streamingllm --budgets 128 256 512 \\
        --samples 5

    # LongBench-format jsonl files (<dataset>.jsonl with input / context / answers):
    python examples/evaluate.py --data-dir /path/to/longbench --tasks --lengths 4096 ...

    # multi-turn: rocketkv vs rocketkv_mt vs full, scored per turn
    python examples/evaluate.py --tasks multiturn --lengths 2048 --budgets 256

Needs the eval extra for its plots: pip install -e ".[eval]".

Writes <out>/<name>.json (config + per-sample records), <name>.md (tables),
<name>_accuracy.png and <name>_niah_heatmap.png. One prompt pass per prompt batch is shared by
every (method, budget); the same seed gives identical records.

Output goes to a new scratch folder, runs/<timestamp>/ (git-ignored), unless --out names
another. A folder that already holds files (such as the committed results/) is written into
only with --overwrite, which replaces <name>.* there and removes its stale plots.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import rocketkv_jax.models as M  # noqa: E402
from rocketkv_jax.eval import harness, report, tasks as tasks_lib  # noqa: E402


RUNS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs")


def output_dir(out: str | None, overwrite: bool) -> str:
  """The folder to write into: `out`, or a new `runs/<timestamp>/`.

  Raises ValueError when `out` already holds files and `overwrite` is False, so that committed
  results are never replaced by accident.
  """
  if out is None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out, i = os.path.join(RUNS_DIR, stamp), 1
    while os.path.exists(out):
      out, i = os.path.join(RUNS_DIR, f"{stamp}-{i}"), i + 1
    return out
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise ValueError(f"--out {out!r} already holds files; pass --overwrite to write into it "
                     "(or leave --out out: a new runs/<timestamp>/ folder)")
  if os.path.exists(out) and not os.path.isdir(out):
    raise ValueError(f"--out {out!r} is a file, not a folder")
  return out


def _write(results, out: str, name: str) -> dict[str, str]:
  """`report.write_all`, then removes this name's plots that the new results did not redraw."""
  paths = report.write_all(results, out, name)
  for suffix in ("_accuracy.png", "_niah_heatmap.png"):
    stale = os.path.join(out, name + suffix)
    if stale not in paths.values() and os.path.exists(stale):
      os.remove(stale)
  return paths


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--tasks", nargs="*", default=["passkey", "niah_single"],
                 help=f"any of {tasks_lib.TASKS + (tasks_lib.MULTITURN_TASK,)}")
  p.add_argument("--lengths", nargs="+", type=int, default=[2048])
  p.add_argument("--methods", nargs="+", default=list(harness.DEFAULT_METHODS),
                 help="names from rocketkv.METHODS, or ablation variants such as "
                      "rocketkv:chunk_size=1,r=64 or rocketkv:top_k=B (rocketkv_jax/eval/"
                      "variants.py)")
  p.add_argument("--mt-methods", nargs="+", default=list(harness.MT_METHODS))
  p.add_argument("--budgets", nargs="+", type=int, default=[64, 128, 256, 512, 1024])
  p.add_argument("--samples", type=int, default=20, help="per (task, length)")
  p.add_argument("--sample-start", type=int, default=0,
                 help="first sample index (split a sweep into runs over disjoint index ranges, "
                      "then --merge them)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--batch-size", type=int, default=1)
  p.add_argument("--quest-page-size", type=int, default=16,
                 help="Quest's page size (16 as in the Quest paper)")
  p.add_argument("--max-new-tokens", type=int, default=None, help="default: per task")
  p.add_argument("--data-dir", default=None, help="LongBench-format *.jsonl directory")
  p.add_argument("--datasets", nargs="*", default=None, help="subset of --data-dir files")
  p.add_argument("--out", default=None,
                 help="output folder (default: a new runs/<timestamp>/ in the repository)")
  p.add_argument("--name", default="results")
  p.add_argument("--overwrite", action="store_true",
                 help="allow writing into an --out folder that already holds files")
  p.add_argument("--cache-dir", default=None, help="persistent XLA compilation cache")
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--no-gold-score", action="store_true",
                 help="skip the teacher-forced gold-answer score (gold_* record fields)")
  p.add_argument("--diagnostics", action="store_true",
                 help="also report each method's attention recall (selection quality)")
  p.add_argument("--diagnostics-only", action="store_true",
                 help="prompt passes + selection-quality diagnostics, no decoding")
  p.add_argument("--merge", nargs="+", default=None, metavar="JSON[:TASK,...]",
                 help="only merge these result files (e.g. one per length) into --out/--name; "
                 "PATH:TASK,TASK takes only those tasks from a file (leave out a task a later "
                 "run replaces)")
  a = p.parse_args(argv)
  try:
    if importlib.util.find_spec("matplotlib") is None:  # fail now, not after an hour's run
      raise ValueError('the plots need matplotlib: pip install -e ".[eval]"')
    # every method spec, task and count checked before a model is loaded or a folder made
    cfg = harness.SweepConfig(
        tasks=tuple(a.tasks), context_lengths=tuple(a.lengths), methods=tuple(a.methods),
        budgets=tuple(a.budgets), samples=a.samples, sample_start=a.sample_start, seed=a.seed,
        batch_size=a.batch_size,
        max_new_tokens=a.max_new_tokens, quest_page_size=a.quest_page_size,
        data_dir=a.data_dir, datasets=tuple(a.datasets) if a.datasets else None,
        multiturn_methods=tuple(a.mt_methods), diagnostics=a.diagnostics or a.diagnostics_only,
        decode=not a.diagnostics_only, gold_score=not a.no_gold_score)
    a.out = output_dir(a.out, a.overwrite)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  print(f"writing to {a.out}/", flush=True)
  if a.merge:
    results = report.merge([report.load_for_merge(f) for f in a.merge])
    paths = _write(results, a.out, a.name)
    print(report.markdown(results))
    for k, v in paths.items():
      print(f"{k}: {v}")
    return
  if a.cache_dir:
    jax.config.update("jax_compilation_cache_dir", a.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)

  t0 = time.perf_counter()
  try:
    model = M.load(a.model or M.smollm2_path(), dtype=jnp.dtype(a.dtype))
  except (ValueError, OSError) as e:  # a missing path, a corrupt or mismatched checkpoint
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  os.makedirs(a.out, exist_ok=True)
  partial_path = os.path.join(a.out, f"{a.name}.partial.json")

  def save_partial(res):  # completed (task, length) groups, in case the run is interrupted
    res = dict(res, command="python examples/evaluate.py " + " ".join(
        sys.argv[1:] if argv is None else argv), partial=True)
    report.save_json(res, partial_path)

  results = harness.run_sweep(model, cfg, progress=not a.no_progress, on_group=save_partial)
  if os.path.exists(partial_path):
    os.remove(partial_path)
  results["timing"]["wall_s_including_load"] = time.perf_counter() - t0
  results["command"] = "python examples/evaluate.py " + " ".join(
      sys.argv[1:] if argv is None else argv)
  paths = _write(results, a.out, a.name)
  print(report.markdown(results))
  for k, v in paths.items():
    print(f"{k}: {v}")


if __name__ == "__main__":
  main()

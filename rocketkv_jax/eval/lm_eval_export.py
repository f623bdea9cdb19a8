"""Exports our synthetic tasks (`tasks.py`) as lm-evaluation-harness tasks: JSON lines + YAML.

    python -m rocketkv_jax.eval.lm_eval export --tasks niah_single --lengths 1024 --samples 4 \\
        --seed 0 --out lm_eval_tasks/
    python -m rocketkv_jax.eval.lm_eval --model_args method=rocketkv,token_budget=256 \\
        --tasks rocketkv_niah_single_1024 --include_path lm_eval_tasks/

Per (task, length) the samples are exactly those of our harness for the same (seed, sample
indices) (`harness.build_samples`: same token target, same prompts), written to
`rocketkv_<task>_<length>.jsonl`, one object per sample:

  prompt         the text our harness decodes from: the chat-templated user message plus the
                 RULER answer prefix (`tasks.prompt_ids` as text). Used by `<name>.yaml`.
  user, answer_prefix   the raw user message and the prefix, used by `<name>_chat.yaml` with
                 lm-eval's --apply_chat_template (gen_prefix = answer_prefix): the same text.
  answers, answer, metric, max_new_tokens, task, context_len, index, prompt_tokens, depth.

Two task files per set:
  rocketkv_<task>_<length>.yaml       doc_to_text: prompt; run WITHOUT --apply_chat_template
                                       and with chat=false (the prompt is already templated).
  rocketkv_<task>_<length>_chat.yaml  doc_to_text: user, gen_prefix: answer_prefix; run WITH
                                       --apply_chat_template.
Both are generate_until with `until: []` (stop at EOS only) and max_gen_toks our harness's
per-task `MAX_NEW_TOKENS`, greedy, and one metric `score` (mean) computed by the
`rocketkv_metric.py` written next to them: `contains` (any answer occurs in the output,
case-insensitive) or `recall` (fraction of the answers that occur), as `tasks.score`.

The export checks that the backend's encoding of `prompt` (`tokenizer.encode(prompt)`) gives
our harness's prompt ids, and warns for every sample where it does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

METRIC_FILE = "rocketkv_metric.py"
_METRIC_SOURCE = '''"""Scores of rocketkv-jax's synthetic tasks (written by `rocketkv_jax.eval.lm_eval export`; the
same definitions as `rocketkv_jax.eval.tasks.score`)."""


def score(metric, prediction, answers):
  p = prediction.lower()
  if metric == "contains":
    return float(any(a.lower() in p for a in answers))
  if metric == "recall":
    return sum(a.lower() in p for a in answers) / len(answers)
  raise ValueError(f"metric must be one of ('contains', 'recall'), got {metric!r}")


def process_results(doc, results):
  return {"score": score(doc["metric"], results[0], doc["answers"])}
'''

_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: {text_field}
doc_to_target: answer
{gen_prefix}generation_kwargs:
  until: []
  max_gen_toks: {max_new}
  do_sample: false
process_results: !function rocketkv_metric.process_results
metric_list:
  - metric: score
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
  source: "rocketkv_jax.eval.tasks {task} context_len={length} seed={seed} samples={start}..{end}"
"""


def task_name(task: str, length: int) -> str:
  return f"rocketkv_{task}_{length}"


def export(model, out_dir: str, tasks, lengths, samples: int, seed: int = 0,
           sample_start: int = 0) -> list[str]:
  """Writes the JSON lines, YAML files and `rocketkv_metric.py`; returns the task names."""
  from rocketkv_jax.eval import harness, tasks as tasks_lib

  for t in tasks:
    if t not in tasks_lib.TASKS:
      raise ValueError(f"task must be one of {tasks_lib.TASKS}, got {t!r}")
  cfg = harness.SweepConfig(tasks=tuple(tasks), context_lengths=tuple(int(n) for n in lengths),
                            methods=("full",), samples=samples, sample_start=sample_start,
                            seed=seed)
  tok = model.tokenizer
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, METRIC_FILE), "w") as f:
    f.write(_METRIC_SOURCE)
  names = []
  for (task, length), (ss, max_new, _) in harness.build_samples(model, cfg).items():
    name = task_name(task, length)
    data = os.path.abspath(os.path.join(out_dir, name + ".jsonl"))
    with open(data, "w", encoding="utf-8") as f:
      for s in ss:
        templated = tok.apply_chat_template([{"role": "user", "content": s.prompt}])
        prompt = templated + s.answer_prefix
        if tok.encode(prompt) != tasks_lib.prompt_ids(tok, s):
          print(f"warning: {name} sample {s.index}: encoding the prompt text does not give the "
                "harness's prompt ids", file=sys.stderr)
        row = dict(task=task, context_len=length, index=s.index, prompt=prompt, user=s.prompt,
                   answer_prefix=s.answer_prefix, answers=list(s.answers),
                   answer=s.answers[0], metric=s.metric, max_new_tokens=max_new,
                   prompt_tokens=int(s.meta.get("prompt_tokens", 0)))
        if "depth" in s.meta:
          row["depth"] = float(s.meta["depth"])
        f.write(json.dumps(row) + "\n")
    kw = dict(data=json.dumps(data), max_new=max_new, task=task, length=length, seed=seed,
              start=sample_start, end=sample_start + samples - 1)
    with open(os.path.join(out_dir, name + ".yaml"), "w") as f:
      f.write(_YAML.format(name=name, text_field="prompt", gen_prefix="", **kw))
    with open(os.path.join(out_dir, name + "_chat.yaml"), "w") as f:
      f.write(_YAML.format(name=name + "_chat", text_field="user",
                           gen_prefix="gen_prefix: answer_prefix\n", **kw))
    names.append(name)
  return names


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m rocketkv_jax.eval.lm_eval export",
                              description="Write rocketkv-jax synthetic tasks as lm-eval tasks.")
  p.add_argument("--tasks", default="niah_single",
                 help="comma-separated task names (rocketkv_jax.eval.tasks.TASKS)")
  p.add_argument("--lengths", default="2048", help="comma-separated context lengths (tokens)")
  p.add_argument("--samples", type=int, default=20)
  p.add_argument("--sample-start", type=int, default=0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--model", default=None,
                 help="the model whose tokenizer sizes the prompts (default: embedded SmolLM2)")
  p.add_argument("--out", required=True, help="output directory (the --include_path)")
  args = p.parse_args(argv)
  from rocketkv_jax.eval import tasks as tasks_lib
  import rocketkv_jax.models as models

  tasks = [t for t in args.tasks.split(",") if t]
  bad = [t for t in tasks if t not in tasks_lib.TASKS]
  if bad or not tasks:
    print(f"error: --tasks must be names from {tasks_lib.TASKS}, got {bad or args.tasks!r}",
          file=sys.stderr)
    return 2
  try:
    lengths = [int(n) for n in args.lengths.split(",") if n]
  except ValueError:
    lengths = []
  if not lengths or min(lengths) < 1:
    print(f"error: --lengths must be positive integers, got {args.lengths!r}", file=sys.stderr)
    return 2
  if args.samples < 1 or args.sample_start < 0:
    print("error: --samples must be >= 1 and --sample-start >= 0", file=sys.stderr)
    return 2
  try:
    model = models.load(args.model or models.smollm2_path())
    names = export(model, args.out, tasks, lengths, args.samples, args.seed, args.sample_start)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for n in names:
    print(f"{n}: {os.path.join(args.out, n + '.yaml')} (and {n}_chat.yaml)")
  return 0

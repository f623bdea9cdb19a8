"""LongBench-format jsonl data from a local directory (`--data-dir`).

Each `<dataset>.jsonl` line is an object with `input` (the question / instruction), `context`,
`answers` (list of strings), optional `all_classes` (classification) and `_id` / `length`.
The dataset name (file stem) picks the metric (`metrics.DATASET_METRIC`; unknown names fall
back to `qa_f1`).

Prompt (written here, one generic template per metric family):
  qa / count / retrieval / classification:
      "Read the text below and answer the question.\n\n{context}\n\nQuestion: {input}\nAnswer:"
  rouge_l (summaries): "{context}\n\n{input}\nSummary:"
  code_sim: "{context}{input}" (the model continues the code).
A context longer than the token target is cut in the middle (head and tail kept), measured in
tokens of the model's tokenizer on the whole chat-templated prompt.
"""

from __future__ import annotations

import glob
import json
import os

from rocketkv_jax.eval import metrics
from rocketkv_jax.eval.tasks import Sample, chat_ids

MAX_NEW_TOKENS = {"qa_f1": 32, "rouge_l": 64, "classification": 16, "code_sim": 32,
                  "count": 8, "retrieval": 8}


def read_jsonl(path: str) -> list[dict]:
  rows = []
  with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f):
      line = line.strip()
      if not line:
        continue
      row = json.loads(line)
      for key in ("input", "context", "answers"):
        if key not in row:
          raise ValueError(f"{path}:{i + 1}: missing field {key!r}")
      rows.append(row)
  return rows


def datasets_in(data_dir: str) -> list[str]:
  files = sorted(glob.glob(os.path.join(data_dir, "*.jsonl")))
  if not files:
    raise FileNotFoundError(f"no *.jsonl files in {data_dir!r}")
  return [os.path.splitext(os.path.basename(f))[0] for f in files]


def _template(metric: str, context: str, question: str) -> str:
  if metric == "rouge_l":
    return f"{context}\n\n{question}\nSummary:"
  if metric == "code_sim":
    return f"{context}{question}"
  return (f"Read the text below and answer the question.\n\n{context}\n\nQuestion: {question}"
          f"\nAnswer:")


def _fit(tokenizer, metric: str, context: str, question: str, target: int) -> tuple[str, int]:
  msg = _template(metric, context, question)
  n = len(chat_ids(tokenizer, msg))
  if n <= target:
    return msg, n
  ids = tokenizer.encode(context, add_special_tokens=False)
  over = n - target
  keep = max(len(ids) - over - 8, 0)
  while True:
    head, tail = ids[:keep // 2], ids[len(ids) - (keep - keep // 2):] if keep else []
    ctx = tokenizer.decode(head) + "\n...\n" + tokenizer.decode(tail)
    msg = _template(metric, ctx, question)
    n = len(chat_ids(tokenizer, msg))
    if n <= target or keep == 0:
      if n > target:
        raise ValueError(f"the question alone needs {n} > {target} tokens")
      return msg, n
    keep = max(keep - (n - target) - 8, 0)


def load_samples(tokenizer, data_dir: str, context_len: int, *, datasets=None,
                 max_samples: int | None = None, target_tokens: int | None = None) -> list[Sample]:
  """Samples of every (or the named) dataset in `data_dir`, fitted to `context_len` tokens."""
  names = datasets or datasets_in(data_dir)
  out = []
  for name in names:
    rows = read_jsonl(os.path.join(data_dir, f"{name}.jsonl"))
    if max_samples is not None:
      rows = rows[:max_samples]
    metric = metrics.DATASET_METRIC.get(name, "qa_f1")
    for i, row in enumerate(rows):
      msg, n = _fit(tokenizer, metric, row["context"], row["input"],
                    int(target_tokens or context_len))
      answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
      out.append(Sample(f"lb_{name}", context_len, i, msg, [str(a) for a in answers], metric,
                        dict(prompt_tokens=n, all_classes=list(row.get("all_classes") or []),
                             id=row.get("_id", i))))
  return out

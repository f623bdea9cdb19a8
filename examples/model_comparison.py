"""Two (or more) models side by side: each method minus full KV per (task, length), at one budget.

    python examples/model_comparison.py --budget 256 \\
        --model SmolLM2-135M results/results.json results/stage2_heldout/wmax_2k.json \\
        --model "Gemma 3 270M" results/gemma3_accuracy/gemma3.json \\
        --methods rocketkv snapkv --tasks niah_single --lengths 2048 4096

Each `--model NAME JSON [JSON ...]`: the first JSON is that model's sweep; later ones add the
records of methods the first lacks (e.g. a configuration run later on the same samples and
seed), never replacing its own. A row per (task, length, model): the model's head dim, full
KV's exact match (x100), and each method's paired difference to full KV (exact match x100, and
the teacher-forced gold log-prob in nats per token where both records have it), with 95%
paired-bootstrap intervals (`report.compare`). A cell that a model's records lack is "-".
"""

import argparse
import sys

from rocketkv_jax.eval import report


def _load(paths: list[str]) -> dict:
  runs = []
  for path in paths:
    try:
      runs.append(report.load_json(path))
    except (OSError, ValueError) as e:
      raise ValueError(f"cannot read results JSON {path!r}: {e}") from None
  first, rest = runs[0], runs[1:]
  own = {r["method"] for r in first["records"]}
  return report.pool(first, [dict(r, records=[x for x in r["records"] if x["method"] not in own])
                             for r in rest])


def _cell(row, gold: bool = True) -> str:
  if row is None:
    return "-"
  d = row["diff"]
  text = f"{d[0]:+.1f} [{d[1]:+.1f}, {d[2]:+.1f}]"
  if gold and row["logprob_diff"] is not None:
    g = row["logprob_diff"]
    text += f"; {g[0]:+.2f} [{g[1]:+.2f}, {g[2]:+.2f}]"
  return text + f" (n={row['n']})"


def table(models: list[tuple[str, dict]], methods: list[str], budget: int, tasks=None,
          lengths=None, gold: bool = True) -> str:
  rows = {}
  head_dim = {}
  for name, res in models:
    head_dim[name] = res["config"].get("model", {}).get("head_dim", "?")
    present = {r["method"] for r in res["records"]}
    ms = [m for m in methods if m in present]
    if "full" not in present or not ms:
      raise ValueError(f"{name}: its records need full and one of {methods}")
    for r in report.compare(res, "full", ms, budget):
      if (tasks is None or r["task"] in tasks) and (lengths is None or r["context_len"] in lengths):
        rows[(r["task"], r["context_len"], name, r["method"])] = r
  cells = sorted({(t, n) for t, n, _, _ in rows}, key=lambda c: (c[0], c[1]))
  out = [f"Method minus full KV at B={budget}: exact match x100 [95% paired-bootstrap interval]"
         + ("; gold log-prob per answer token, nats [interval], where recorded" if gold else "")
         + "; n paired samples.", "",
         "| task | length | model (head dim) | full KV | " + " | ".join(methods) + " |",
         "|---|---|---|---|" + "---|" * len(methods)]
  for task, length in cells:
    for name, _ in models:
      mine = [rows.get((task, length, name, m)) for m in methods]
      if not any(mine):
        continue
      ref = next(r["ref"] for r in mine if r is not None)
      out.append(f"| {task} | {length // 1024}K | {name} ({head_dim[name]}) | {ref:.1f} | "
                 + " | ".join(_cell(r, gold) for r in mine) + " |")
  return "\n".join(out)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", nargs="+", action="append", required=True, metavar="NAME JSON",
                 help="a model's name, then its results JSONs")
  p.add_argument("--budget", type=int, required=True)
  p.add_argument("--methods", nargs="+", default=["rocketkv", "snapkv"])
  p.add_argument("--tasks", nargs="+", default=None)
  p.add_argument("--lengths", nargs="+", type=int, default=None)
  p.add_argument("--no-gold", action="store_true", help="exact match only (a narrower table)")
  a = p.parse_args(argv)
  try:
    if any(len(m) < 2 for m in a.model):
      raise ValueError("--model takes a name and at least one results JSON")
    models = [(m[0], _load(m[1:])) for m in a.model]
    out = table(models, a.methods, a.budget, a.tasks, a.lengths, gold=not a.no_gold)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  print(out)


if __name__ == "__main__":
  main()

"""The tables of results/sweep.md and docs/evaluation.md, from a merged results JSON.

    python examples/results_tables.py results/results.json per-length   # per-length sections
    python examples/results_tables.py results/results.json claims       # issue #5's two checks
    python examples/results_tables.py results/results.json means        # the summary in docs/evaluation.md
    python examples/results_tables.py --compare full --budget 256 results/results.json
    python examples/results_tables.py results/results.json --compare full --budget 256 \\
        --methods rocketkv snapkv
    python examples/results_tables.py A.json --targets METHOD --budget 256 --with B.json ... \\
        --baselines-from SWEEP.json ...
    python examples/results_tables.py A.json --task-means full --budget 256 --with B.json ...

`claims`: per (task, length), full KV vs RocketKV at B=256, and whether RocketKV is at or above
every other compressed method (SnapKV, Quest, SparQ, StreamingLLM; the exact_topk oracle is
not counted) at B = 128 / 256 / 512 / 1024.

`--compare REF --budget B`: per (task, length), every other method (or `--methods`) at B minus
REF, for the score and, where the records have it, the teacher-forced gold log-prob per token,
with 95% paired-bootstrap intervals over the shared samples (`report.compare_markdown`), then a
count per method of the cells whose interval lies below / above 0.

`--task-means REF --budget B`: per length, every other method's (or `--methods`') mean over
tasks of its paired difference to REF, each task weighing the same, with a stratified
bootstrap interval (`report.task_means`); a length's tasks are those every method has.

`--targets METHOD --budget B`: issue #13's accuracy targets for one method, per (task, length)
cell where full KV scores at least 20: the score within 2 points of full KV at 4K and longer
and within 5 at 2K, the gold log-prob within 0.1 nats/token of full KV's at 4K and longer, and
at or above each other compressed method the records hold (SnapKV, Quest, SparQ,
StreamingLLM) -- each on the paired point estimate, the 95% interval printed beside it. Where
the records hold exact_topk at B/2 (the oracle that reads top_k = B/2 rows, as RocketKV does,
from the whole cache with exact scores), its paired difference to full KV is shown too, and
counted against the same tolerance: where it misses, reading top_k = B/2 rows chosen by exact
scores over the whole cache does not reach full KV either; the method's gold log-prob is paired
with that oracle's too (last column), since both read as many exact rows. `--baselines-from`
pools only the other compressed methods' records of a run (the committed sweeps, whose
RocketKV and full-KV records may come from older code or decode lengths).
"""

import argparse
import collections
import sys

import numpy as np

from rocketkv_jax.eval import report, variants

OTHERS = ("snapkv", "quest", "sparq", "streamingllm")
HALF = "exact_topk at B/2"  # the B/2 oracle's records, relabelled to pair with the method at B


def per_length(res) -> str:
  recs = res["records"]
  out = []
  for length in sorted({r["context_len"] for r in recs}):
    md = report.markdown(dict(res, records=[r for r in recs if r["context_len"] == length]))
    body = md.split("\n", 4)[4].split("\nTiming (s)")[0].replace("\n## ", "\n### ")
    if body.startswith("## "):
      body = "#" + body
    out.append(f"## {length // 1024}K\n\n" + body.strip() + "\n")
  return "\n".join(out)


def _require(table: str, agg, needed: list) -> None:
  """ValueError unless every (task, length, method, budget) cell `table` reads is in `agg`."""
  needed = list(dict.fromkeys(needed))
  missing = [k for k in needed if k not in agg]
  if missing or not needed:
    raise ValueError(
        f"{table} reads the full sweep of issue #5 (full; rocketkv and {list(OTHERS)} at every "
        f"budget it prints); this file lacks {len(missing) if needed else 'all'} of its cells"
        + (f", e.g. (task, length, method, budget) = {missing[0]}" if missing else "")
        + "; --compare or --task-means read any run")


def claims(res) -> str:
  agg = report.aggregate(res["records"])
  tasks = list(dict.fromkeys(r["task"] for r in res["records"]))
  lengths = sorted({r["context_len"] for r in res["records"]})
  _require("claims", agg, [(t, n, m, b) for t in tasks for n in lengths
                           if (t, n, "full", None) in agg
                           for m in ("rocketkv",) + tuple(OTHERS) for b in (128, 256, 512, 1024)])
  lines = ["| task | length | full | rocketkv B=256 | gap | best other at 256 | RocketKV >= "
           "every other, B=128 / 256 / 512 / 1024 | n |", "|---|---|---|---|---|---|---|---|"]
  wins = cells_n = near = near_n = 0
  losers = collections.Counter()
  for t in tasks:
    for length in lengths:
      full = agg.get((t, length, "full", None))
      if full is None:
        continue
      rk = agg[(t, length, "rocketkv", 256)][0]
      near_n += 1
      near += rk >= full[0] - 2
      best = max(OTHERS, key=lambda m: agg[(t, length, m, 256)][0])
      cells = []
      for b in (128, 256, 512, 1024):
        rv = agg[(t, length, "rocketkv", b)][0]
        who = max(OTHERS, key=lambda m: agg[(t, length, m, b)][0])
        ov = agg[(t, length, who, b)][0]
        ok = rv >= ov - 1e-9
        cells_n += 1
        wins += ok
        if not ok:
          losers[who] += 1
        cells.append("yes" if ok else f"no ({rv:.0f} vs {who} {ov:.0f})")
      lines.append(f"| {t} | {length // 1024}K | {full[0]:.1f} | {rk:.1f} | {rk - full[0]:+.1f} "
                   f"| {best} {agg[(t, length, best, 256)][0]:.1f} | {' / '.join(cells)} "
                   f"| {full[1]} |")
  lines += ["", f"RocketKV >= every other compressed method in {wins} of {cells_n} cells; "
            f"losses to {dict(losers)}; RocketKV at B=256 within 2 points of full KV in {near} "
            f"of {near_n} (task, length) cells"]
  return "\n".join(lines)


def means(res) -> str:
  agg = report.aggregate(res["records"])
  recs = res["records"]
  lines = ["| length (tasks) | method | B=64 | B=128 | B=256 | B=512 | B=1024 |",
           "|---|---|---|---|---|---|---|"]
  labels = (("full", "full"), ("exact_topk", "exact_topk (oracle, reads B)"),
            ("rocketkv", "**rocketkv** (reads B/2)"), ("snapkv", "snapkv"),
            ("quest", "quest (page 16)"), ("sparq", "sparq (reads B/2)"),
            ("streamingllm", "streamingllm"))
  _require("means", agg, [(r["task"], r["context_len"], m, None if m == "full" else b)
                          for r in recs for m, _ in labels for b in (64, 128, 256, 512, 1024)])
  for length in sorted({r["context_len"] for r in recs}):
    tasks = list(dict.fromkeys(r["task"] for r in recs if r["context_len"] == length))
    for m, label in labels:
      cells = [np.mean([agg[(t, length, m, None if m == "full" else b)][0] for t in tasks])
               for b in (64, 128, 256, 512, 1024)]
      lines.append(f"| {length // 1024}K ({len(tasks)}) | {label} | "
                   + " | ".join(f"{c:.1f}" for c in cells) + " |")
  return "\n".join(lines)


def _diff(d, fmt="{:+.1f}") -> str:
  return f"{fmt.format(d[0])} [{fmt.format(d[1])}, {fmt.format(d[2])}]"


def targets(res, method: str, budget: int) -> str:
  """Issue #13's targets for `method` at `budget`, per (task, length) cell (module doc)."""
  present = {r["method"] for r in res["records"]}
  others = [m for m in OTHERS if m in present]
  vs_full = report.compare(res, "full", [method], budget)
  vs_other = {(r["task"], r["context_len"], m): r for m in others
              for r in report.compare(res, m, [method], budget)}
  agg = report.aggregate(res["records"])
  # The oracle reading B/2 rows (RocketKV's top_k), chosen by exact scores over the whole
  # cache: what reading that many rows gives without stage 1 or approximate scores.
  half_oracle, vs_half = {}, {}
  if any(r["method"] == "exact_topk" and r["budget"] == budget // 2 for r in res["records"]):
    half_oracle = {(r["task"], r["context_len"]): r
                   for r in report.compare(res, "full", ["exact_topk"], budget // 2)}
    # The method at B paired with that oracle: its records relabelled as a reference at B.
    half = [dict(r, method=HALF, budget=budget) for r in res["records"]
            if r["method"] == "exact_topk" and r["budget"] == budget // 2]
    vs_half = {(r["task"], r["context_len"]): r for r in report.compare(
        dict(res, records=res["records"] + half), HALF, [method], budget)}
  lines = [f"| task | length | n | full | exact_topk | exact_topk B/2 vs full | {method} | "
           "vs full | within 2 (4K+) / 5 (2K) | gold vs full | gold within 0.1 (4K+) | lowest vs "
           f"{' / '.join(others) or 'others'} | gold vs exact_topk B/2 |", "|---" * 13 + "|"]
  met = collections.Counter()
  cells = collections.Counter()
  skipped = []
  for r in vs_full:
    task, length = r["task"], r["context_len"]
    label = f"{length // 1024}K"
    if r["ref"] < 20:
      skipped.append(f"{task} {label}")
      continue
    tol = 2.0 if length >= 4096 else 5.0
    near = r["diff"][0] >= -tol
    cells["near"] += 1
    met["near"] += near
    gold = gold_ok = ""
    if r["logprob_diff"] is not None:
      gold = _diff(r["logprob_diff"], "{:+.3f}")
      if length >= 4096:
        ok = r["logprob_diff"][0] >= -0.1
        cells["gold"] += 1
        met["gold"] += ok
        gold_ok = "yes" if ok else "no"
    worst = [(vs_other[(task, length, m)]["diff"], m) for m in others
             if (task, length, m) in vs_other]
    above = ""
    if worst:
      d, m = min(worst)
      cells["above"] += 1
      met["above"] += d[0] >= 0
      above = f"{m} {_diff(d)}"
    exact = agg.get((task, length, "exact_topk", budget))
    half = half_oracle.get((task, length))
    if half is not None:
      cells["half"] += 1
      met["half"] += half["diff"][0] >= -tol
    gold_half = ""
    h = vs_half.get((task, length))
    if h is not None and h["logprob_diff"] is not None:
      gold_half = _diff(h["logprob_diff"], "{:+.3f}")
      cells["gold_half"] += 1
      met["gold_half"] += h["logprob_diff"][0] >= 0
    lines.append(f"| {task} | {label} | {r['n']} | {r['ref']:.1f} | "
                 f"{'-' if exact is None else f'{exact[0]:.1f}'} | "
                 f"{'-' if half is None else _diff(half['diff'])} | {r['score']:.1f} | "
                 f"{_diff(r['diff'])} | {'yes' if near else 'no'} | {gold} | {gold_ok} | "
                 f"{above} | {gold_half} |")
  lines += ["", f"{method} at B={budget}: within 2 / 5 points of full KV in {met['near']} of "
            f"{cells['near']} cells; gold log-prob within 0.1 of full KV in {met['gold']} of "
            f"{cells['gold']} cells at 4K and longer; at or above every other compressed method "
            f"in {met['above']} of {cells['above']} cells"
            + (f"; left out (full KV below 20): {', '.join(skipped)}" if skipped else "") + "."]
  if cells["half"]:
    lines.append(f"exact_topk at B/2 = {budget // 2} (the oracle reading as many rows as "
                 f"top_k = B/2) within 2 / 5 points of full KV in {met['half']} of "
                 f"{cells['half']} cells that have it.")
  if cells["gold_half"]:
    lines.append(f"{method}'s gold log-prob at or above that oracle's (paired point estimate) in "
                 f"{met['gold_half']} of {cells['gold_half']} cells that have both.")
  return "\n".join(lines)


TABLES = {"per-length": per_length, "claims": claims, "means": means}


def _load(path):
  try:
    res = report.load_json(path)
  except (OSError, ValueError) as e:
    raise ValueError(f"cannot read results JSON {path!r}: {e}") from None
  if not isinstance(res, dict) or not isinstance(res.get("records"), list):
    raise ValueError(f"{path!r} is not a results JSON (it has no records)")
  return res


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("results", help="a results JSON (examples/evaluate.py)")
  p.add_argument("table", nargs="?", choices=tuple(TABLES),
                 help="the table to print (or --compare)")
  p.add_argument("--compare", metavar="METHOD", default=None,
                 help="reference method (e.g. full): paired differences of the others to it")
  p.add_argument("--task-means", dest="task_means", metavar="METHOD", default=None,
                 help="reference method: per length, the mean over tasks of the paired "
                      "differences of the others to it")
  p.add_argument("--targets", metavar="METHOD", default=None,
                 help="issue #13's targets for METHOD against full KV (needs --budget)")
  p.add_argument("--budget", type=int, default=None,
                 help="with --compare / --task-means / --targets: the token budget")
  p.add_argument("--methods", nargs="+", default=None,
                 help="with --compare / --task-means: the methods to compare (default: every "
                      "other one)")
  p.add_argument("--tasks", nargs="+", default=None,
                 help="with --compare / --task-means: only these tasks (after pooling)")
  p.add_argument("--with", dest="others", nargs="+", action="extend", default=[],
                 metavar="JSON",
                 help="with --compare / --task-means / --targets: later runs of the same cells "
                      "(same seed and samples) whose other methods join the comparison (repeat "
                      "it to add more); records both runs hold "
                      "must agree on every field both have (gold scores only one has are joined)")
  p.add_argument("--baselines-from", dest="baselines", nargs="+", default=[], metavar="JSON",
                 help="with --targets: runs (e.g. the committed sweeps) of which only the other "
                      f"compressed methods' records ({', '.join(OTHERS)}) join, so that a sweep "
                      "whose own RocketKV records are from older code can still be paired")
  a = p.parse_args(argv)
  try:
    if (a.table is not None) + (a.compare is not None) + (a.targets is not None) + (
        a.task_means is not None) != 1:
      raise ValueError(f"give one of a table ({', '.join(TABLES)}), --compare METHOD, "
                       "--task-means METHOD or --targets METHOD")
    if a.tasks is not None and a.compare is None and a.task_means is None:
      raise ValueError("--tasks goes with --compare or --task-means")
    if a.table is not None and (a.budget is not None or a.methods is not None or a.others):
      raise ValueError("--budget, --methods and --with go with --compare, --task-means or "
                       "--targets")
    if a.targets is not None and (a.budget is None or a.methods is not None):
      raise ValueError("--targets needs --budget and takes no --methods")
    if a.baselines and a.targets is None:
      raise ValueError("--baselines-from goes with --targets")
    for name in ("compare", "task_means"):  # "recommended" -> its spec, as records name it
      if getattr(a, name) is not None:
        setattr(a, name, variants.canonical(getattr(a, name)))
    if a.methods is not None:
      a.methods = [variants.canonical(m) for m in a.methods]
    res = _load(a.results)
    others = [_load(path) for path in a.others]
    for path in a.baselines:
      run = _load(path)
      others.append(dict(run, records=[r for r in run["records"] if r["method"] in OTHERS]))
    if others:
      res = report.pool(res, others)
    if a.tasks is not None:
      res = report.only_tasks(res, a.tasks)
    if a.compare is not None:
      out = report.compare_markdown(res, a.compare, a.methods, a.budget)
    elif a.task_means is not None:
      out = report.task_means_markdown(res, a.task_means, a.methods, a.budget)
    elif a.targets is not None:
      out = targets(res, a.targets, a.budget)
    else:
      out = TABLES[a.table](res)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  print(out)


if __name__ == "__main__":
  main()

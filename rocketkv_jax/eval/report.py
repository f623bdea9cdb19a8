"""Sweep outputs: JSON (config + per-sample records), Markdown tables, matplotlib plots.

Scores are reported as mean x 100 over the samples of a (task, length, method, budget). A method
that ignores the budget ("full": `Method.uses_budget` is False) has budget None; its value is
repeated in every budget column and it is listed first.
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np

from rocketkv_jax import methods as methods_lib


def _budgetless(method: str) -> bool:
  """Whether a record's method (a name or a variant spec) ignores the budget."""
  m = methods_lib.REGISTRY.get(method.partition(":")[0])
  return m is not None and not m.uses_budget


def save_json(results: dict, path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(results, f, indent=1, sort_keys=True)


def load_json(path: str) -> dict:
  with open(path) as f:
    return json.load(f)


def only_tasks(result: dict, tasks) -> dict:
  """`result` with the records of `tasks` only, e.g. to leave out a task that a later run
  replaces. The config lists the kept tasks and the dropped ones (`dropped_tasks`)."""
  tasks = tuple(tasks)
  unknown = sorted(set(tasks) - {r["task"] for r in result["records"]})
  if unknown:
    raise ValueError(f"tasks {unknown} have no records in this run; it has "
                     f"{sorted({r['task'] for r in result['records']})}")
  cfg = dict(result["config"])
  cfg["dropped_tasks"] = [t for t in cfg["tasks"] if t not in tasks]
  cfg["tasks"] = [t for t in cfg["tasks"] if t in tasks]
  return dict(result, config=cfg, records=[r for r in result["records"] if r["task"] in tasks])


def load_for_merge(spec: str) -> dict:
  """A `--merge` argument: `PATH` (the whole run) or `PATH:TASK,TASK` (those tasks only)."""
  path, _, tasks = spec.rpartition(":") if not os.path.exists(spec) else (spec, "", "")
  result = load_json(path)
  return only_tasks(result, tasks.split(",")) if tasks else result


def merge(results: list[dict]) -> dict:
  """Concatenates the records of several runs (e.g. one per context length); the config is the
  first run's with `context_lengths` / `tasks` unioned, every run's config and command kept."""
  first = results[0]
  cfg = dict(first["config"])
  cfg["context_lengths"] = sorted({x for r in results for x in r["config"]["context_lengths"]})
  cfg["tasks"] = list(dict.fromkeys(t for r in results for t in r["config"]["tasks"]))
  records = [x for r in results for x in r["records"]]
  seen = set()
  for x in records:
    key = (x["task"], x["context_len"], x["index"], x["method"], x["budget"], x.get("turn"))
    if key in seen:
      raise ValueError(f"runs to merge overlap: two records for {key} (task, length, sample, "
                       "method, budget, turn); split sweeps with --sample-start")
    seen.add(key)
  # runs over disjoint sample ranges of one (task, length) pool their records: report the
  # sample counts the merged cells actually hold
  counts = sorted({n for _, n in aggregate(records).values()})
  cfg["samples"] = counts[0] if len(counts) == 1 else f"{counts[0]}-{counts[-1]} (see n)"
  cfg.pop("sample_start", None)
  timing = {}
  for i, r in enumerate(results):
    for k, v in r.get("timing", {}).items():
      timing[f"run{i}_{k}"] = v
  diag = [d for r in results for d in r.get("diagnostics", [])]
  extra = dict(diagnostics=diag) if diag else {}
  return dict(config=cfg, plans={k: v for r in results for k, v in r.get("plans", {}).items()},
              records=records, timing=timing, **extra,
              runs=[dict(config=r["config"], command=r.get("command"), timing=r.get("timing"))
                    for r in results])


def aggregate(records: list[dict]) -> dict:
  """{(task, length, method, budget): (mean score x 100, n)}."""
  acc = collections.defaultdict(list)
  for r in records:
    acc[(r["task"], r["context_len"], r["method"], r["budget"])].append(r["score"])
  return {k: (100.0 * float(np.mean(v)), len(v)) for k, v in acc.items()}


def _axes(records):
  tasks = list(dict.fromkeys(r["task"] for r in records))
  lengths = sorted({r["context_len"] for r in records})
  methods = list(dict.fromkeys(r["method"] for r in records))
  methods = [m for m in methods if _budgetless(m)] + [m for m in methods if not _budgetless(m)]
  budgets = sorted({r["budget"] for r in records if r["budget"] is not None})
  return tasks, lengths, methods, budgets


def _cell(agg, key):
  task, length, method, budget = key
  if _budgetless(method):
    key = (task, length, method, None)
  v = agg.get(key)
  return "" if v is None else f"{v[0]:.1f}"


def markdown(results: dict) -> str:
  recs = results["records"]
  agg = aggregate(recs)
  tasks, lengths, methods, budgets = _axes(recs)
  lines = ["# Results", ""]
  c = results["config"]
  lines.append(f"Model `{c['model']['source']}`; seed {c['seed']}; greedy; samples per "
               f"(task, length) {c['samples']}; scores are mean x 100.")
  lines.append("")
  cols = budgets or [None]  # a full-KV-only run has no budgets: one column
  head = " | ".join("score" if b is None else f"B={b}" for b in cols)
  # summary: mean over the synthetic (non multi-turn) tasks that ran at every length, so rows
  # of different lengths average the same tasks
  synth = [t for t in tasks if not t.startswith(("multiturn", "lb_"))]
  common = [t for t in synth
            if all(any(r["task"] == t and r["context_len"] == n for r in recs) for n in lengths)]
  if len(common) > 1:
    lines += ["## Mean over synthetic tasks (" + ", ".join(common) + ")", ""]
    rest = [t for t in synth if t not in common]
    if rest:
      lines += [f"({', '.join(rest)} did not run at every length; this mean leaves them out.)", ""]
    lines.append(f"| length | method | {head} |")
    lines.append("|---|---|" + "---|" * len(cols))
    for length in lengths:
      for m in methods:
        if not any(r["method"] == m and r["task"] in common for r in recs):
          continue
        cells = []
        for b in cols:
          vals = [agg.get((t, length, m, None if _budgetless(m) else b)) for t in common]
          vals = [v[0] for v in vals if v is not None]
          cells.append(f"{np.mean(vals):.1f}" if len(vals) == len(common) else "")
        lines.append(f"| {length} | {m} | " + " | ".join(cells) + " |")
    lines.append("")
  for task in tasks:
    lines += [f"## {task}", ""]
    lines.append(f"| length | method | {head} | n |")
    lines.append("|---|---|" + "---|" * (len(cols) + 1))
    for length in lengths:
      for m in methods:
        key0 = (task, length, m, None if _budgetless(m) else cols[0])
        if key0 not in agg:
          continue
        n = agg[key0][1]
        cells = [_cell(agg, (task, length, m, b)) for b in cols]
        lines.append(f"| {length} | {m} | " + " | ".join(cells) + f" | {n} |")
    lines.append("")
  diag = results.get("diagnostics")
  if diag:
    lines += ["## Selection quality (attention recall of the last prompt query)", "",
              "Exact attention mass on the tokens each method reads (read) and on the tokens "
              "stage 1 kept (kept), mean over heads, layers and the first batch; exact_topk "
              "is the best possible read at that budget.", ""]
    bud = sorted({d["budget"] for d in diag if d["budget"] is not None})
    lines.append("| task | length | method | " + " | ".join(f"B={b} read / kept" for b in bud)
                 + " |")
    lines.append("|---|---|---|" + "---|" * len(bud))
    idx = {(d["task"], d["context_len"], d["method"], d["budget"]): d for d in diag}
    for (task, length, m) in dict.fromkeys((d["task"], d["context_len"], d["method"])
                                           for d in diag):
      cells = []
      for b in bud:
        d = idx.get((task, length, m, None if _budgetless(m) else b))
        cells.append("" if d is None else f"{d['read_recall']:.3f} / {d['kept_recall']:.3f}")
      lines.append(f"| {task} | {length} | {m} | " + " | ".join(cells) + " |")
    lines.append("")
  t = results.get("timing", {})
  if t:
    lines.append("Timing (s): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(t.items())))
    lines.append("")
  return "\n".join(lines)


def plot_accuracy(results: dict, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  recs = results["records"]
  agg = aggregate(recs)
  tasks, lengths, methods, budgets = _axes(recs)
  fig, axes = plt.subplots(len(tasks), len(lengths), figsize=(4 * len(lengths), 3 * len(tasks)),
                           squeeze=False)
  for i, task in enumerate(tasks):
    for j, length in enumerate(lengths):
      ax = axes[i][j]
      for m in methods:
        if _budgetless(m):
          v = agg.get((task, length, m, None))
          if v is not None:
            ax.axhline(v[0], color="k", ls="--", lw=1, label=m)
          continue
        xs = [b for b in budgets if (task, length, m, b) in agg]
        if xs:
          ax.plot(xs, [agg[(task, length, m, b)][0] for b in xs], marker="o", label=m)
      ax.set_xscale("log", base=2)
      if budgets:  # an empty panel keeps the others' axis (no squeezed ticks)
        ax.set_xlim(min(budgets) / 1.25, max(budgets) * 1.25)
      ax.set_xticks(budgets)
      ax.set_xticklabels([str(b) for b in budgets])
      ax.set_ylim(-5, 105)
      ax.set_title(f"{task} @ {length}")
      ax.set_xlabel("token budget")
      ax.set_ylabel("score")
      if not ax.get_lines():
        ax.text(0.5, 0.5, "not run", transform=ax.transAxes, ha="center", va="center",
                color="0.5")
  # one legend above the grid, from the panel that has the most methods
  fullest = max((a for row in axes for a in row), key=lambda a: len(a.get_lines()))
  handles, labels = fullest.get_legend_handles_labels()
  ncol = max(1, min(len(labels), int(fig.get_figwidth() / 1.15)))  # ~1.15 in per entry
  rows = -(-len(labels) // ncol)
  fig.legend(handles, labels, loc="upper center", ncol=ncol, fontsize=8, frameon=False)
  fig.tight_layout(rect=(0, 0, 1, 1 - (0.1 + 0.22 * rows) / fig.get_figheight()))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_niah_heatmap(results: dict, path: str, task: str = "passkey") -> bool:
  """Depth x length heatmap per (method, budget) for records that have a depth."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  recs = [r for r in results["records"] if r["task"] == task and "depth" in r]
  if not recs:
    return False
  _, lengths, methods, budgets = _axes(recs)
  depths = sorted({r["depth"] for r in recs})
  cols = [(m, None) for m in methods if _budgetless(m)] + [
      (m, b) for m in methods if not _budgetless(m) for b in budgets]
  acc = collections.defaultdict(list)
  for r in recs:
    acc[(r["method"], r["budget"], r["depth"], r["context_len"])].append(r["score"])
  n = len(cols)
  ncol = min(n, len(budgets) + 1 if budgets else 1)
  nrow = -(-n // ncol)
  fig, axes = plt.subplots(nrow, ncol, figsize=(2.6 * ncol, 2.4 * nrow), squeeze=False)
  for ax in axes.flat:
    ax.axis("off")
  for idx, (m, b) in enumerate(cols):
    ax = axes.flat[idx]
    ax.axis("on")
    grid = np.full((len(depths), len(lengths)), np.nan)
    for di, d in enumerate(depths):
      for li, length in enumerate(lengths):
        v = acc.get((m, b, d, length))
        if v:
          grid[di, li] = 100 * np.mean(v)
    ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)))
    ax.set_xticklabels([str(x) for x in lengths], fontsize=7)
    ax.set_yticks(range(len(depths)))
    ax.set_yticklabels([f"{d:.2f}" for d in depths], fontsize=7)
    ax.set_title(m if b is None else f"{m} B={b}", fontsize=8)
    for di in range(len(depths)):
      for li in range(len(lengths)):
        if not np.isnan(grid[di, li]):
          ax.text(li, di, f"{grid[di, li]:.0f}", ha="center", va="center", fontsize=7)
  fig.suptitle(f"{task}: needle depth (rows) x context length (cols), score x 100", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def write_all(results: dict, out_dir: str, name: str = "results") -> dict[str, str]:
  """Writes <name>.json, <name>.md, <name>_accuracy.png and <name>_niah_heatmap.png."""
  os.makedirs(out_dir, exist_ok=True)
  paths = dict(json=os.path.join(out_dir, f"{name}.json"),
               markdown=os.path.join(out_dir, f"{name}.md"),
               accuracy=os.path.join(out_dir, f"{name}_accuracy.png"))
  save_json(results, paths["json"])
  with open(paths["markdown"], "w") as f:
    f.write(markdown(results))
  if not results["records"]:
    del paths["accuracy"]
    return paths
  plot_accuracy(results, paths["accuracy"])
  heat = os.path.join(out_dir, f"{name}_niah_heatmap.png")
  tasks = {r["task"] for r in results["records"] if "depth" in r}
  for t in ("passkey", "niah_single", "niah_multikey"):
    if t in tasks and plot_niah_heatmap(results, heat, task=t):
      paths["heatmap"] = heat
      break
  return paths

"""Sweep outputs: JSON (config + per-sample records), Markdown tables, matplotlib plots.

Scores are reported as mean x 100 over the samples of a (task, length, method, budget), with a
95% percentile-bootstrap interval over those samples (`stats.bootstrap_ci`, seed 0, so tables
are reproducible). A method that ignores the budget ("full": `Method.uses_budget` is False) has
budget None; its value is repeated in every budget column. The ceiling rows come first: `full`,
then the `exact_topk` oracle, then the other methods in the order they ran.

Records may carry the teacher-forced gold answer under the method's own cache and decode steps:
`gold_logprob` (mean log-probability per gold token, nats), `gold_argmax` (share of gold tokens
that were the argmax) and `gold_tokens`. Runs made before these fields existed lack them; their
tables simply have no gold section. A per-(task, length) gold table averages the per-sample
values over samples (each sample weighs the same, whatever its answer's length).

`compare` gives the paired differences to a reference method (e.g. full KV) at one budget, for
exact match and gold log-prob, with paired-bootstrap intervals (the claims in docs/evaluation.md).
"""

from __future__ import annotations

import collections
import json
import os

import numpy as np

from rocketkv_jax import methods as methods_lib
from rocketkv_jax.eval import stats

CEILING = ("full", "exact_topk")  # listed first in every table: full KV, then the oracle
LEVEL, N_BOOT, SEED = 0.95, 10000, 0  # the tables' bootstrap settings


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
  path = path or spec  # no ":": a path that does not exist, named as given
  if not os.path.isfile(path):
    raise ValueError(f"--merge: no result file {path!r}")
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


GOLD_TOL = 1e-4  # nats per token: float rounding of one teacher-forced score across batch sizes


def _same(field: str, a, b) -> bool:
  if field == "gold_logprob" and a is not None and b is not None:
    return abs(a - b) <= GOLD_TOL
  return a == b


def pool(result: dict, others: list[dict]) -> dict:
  """`result` with the records of `others` (later runs of the same cells, e.g. a new method run
  beside committed ones with the same seed and samples) that it lacks. A record both hold must
  agree on every field both have -- the check that the later run reproduces the committed one --
  else ValueError; fields only one of them has (the gold-answer scores, which sweeps from before
  the teacher-forced score lack) are joined into one record. The gold log-prob may differ by
  `GOLD_TOL` (the same tokens scored in another batch composition round differently); the
  first run's value is kept."""
  key = lambda x: (x["task"], x["context_len"], x["index"], x["method"], x["budget"],
                   x.get("turn"))
  at = {key(x): i for i, x in enumerate(result["records"])}
  records = list(result["records"])
  for other in others:
    for x in other["records"]:
      k = key(x)
      if k not in at:
        at[k] = len(records)
        records.append(x)
        continue
      mine = records[at[k]]
      if any(not _same(f, mine[f], x[f]) for f in mine.keys() & x.keys()):
        raise ValueError(f"runs disagree on {k} (task, length, sample, method, budget, turn): "
                         "pool only runs of the same seed and code")
      records[at[k]] = {**x, **mine}
  return dict(result, records=records)


def aggregate(records: list[dict]) -> dict:
  """{(task, length, method, budget): (mean score x 100, n)}."""
  acc = collections.defaultdict(list)
  for r in records:
    acc[(r["task"], r["context_len"], r["method"], r["budget"])].append(r["score"])
  return {k: (100.0 * float(np.mean(v)), len(v)) for k, v in acc.items()}


def _sample_key(record) -> tuple[int, int]:
  return record["index"], record.get("turn") or 0


def _by_cell(records) -> dict:
  """{(task, length, method, budget): [record, ...]}, each cell ordered by (sample index, turn),
  so that its bootstrap resamples do not depend on the order records were merged in."""
  acc = collections.defaultdict(list)
  for r in records:
    acc[(r["task"], r["context_len"], r["method"], r["budget"])].append(r)
  return {k: sorted(v, key=_sample_key) for k, v in acc.items()}


def intervals(records: list[dict], *, level: float = LEVEL, n_boot: int = N_BOOT,
              seed: int = SEED) -> dict:
  """{(task, length, method, budget): (mean x 100, lo x 100, hi x 100, n)}: `aggregate` with the
  percentile-bootstrap interval of each cell's mean score."""
  out = {}
  for k, rs in _by_cell(records).items():
    scores = [r["score"] for r in rs]
    lo, hi = stats.bootstrap_ci(scores, level=level, n_boot=n_boot, seed=seed)
    out[k] = (100.0 * float(np.mean(scores)), 100.0 * lo, 100.0 * hi, len(scores))
  return out


def gold_of(record: dict) -> tuple[float, float] | None:
  """(gold_logprob, gold_argmax) of a record; None when it has no teacher-forced gold answer
  (a run from before these fields, or an answer of no tokens). A missing argmax is NaN."""
  lp = record.get("gold_logprob")
  if lp is None or record.get("gold_tokens", 1) == 0 or not np.isfinite(lp):
    return None
  am = record.get("gold_argmax")
  return float(lp), float("nan") if am is None else float(am)


def gold_intervals(records: list[dict], *, level: float = LEVEL, n_boot: int = N_BOOT,
                   seed: int = SEED) -> dict:
  """{(task, length, method, budget): (mean gold log-prob per token, lo, hi, mean argmax rate,
  n)} over the samples that have gold fields (`gold_of`); cells with none are left out. Means
  are over samples; the argmax rate is NaN when no sample has one."""
  out = {}
  for k, rs in _by_cell(records).items():
    g = [x for x in map(gold_of, rs) if x is not None]
    if not g:
      continue
    lp = np.array([x[0] for x in g])
    am = np.array([x[1] for x in g])
    lo, hi = stats.bootstrap_ci(lp, level=level, n_boot=n_boot, seed=seed)
    rate = float(np.mean(am[np.isfinite(am)])) if np.isfinite(am).any() else float("nan")
    out[k] = (float(lp.mean()), lo, hi, rate, len(g))
  return out


def order_methods(methods) -> list[str]:
  """`methods` with the ceiling first (full, then exact_topk), then the other methods that
  ignore the budget, then the rest, each group in the given (run) order."""
  def rank(m):
    return CEILING.index(m) if m in CEILING else len(CEILING) + (not _budgetless(m))

  return sorted(dict.fromkeys(methods), key=rank)


def _axes(records):
  tasks = list(dict.fromkeys(r["task"] for r in records))
  lengths = sorted({r["context_len"] for r in records})
  methods = order_methods(r["method"] for r in records)
  budgets = sorted({r["budget"] for r in records if r["budget"] is not None})
  return tasks, lengths, methods, budgets


def _ceiling_caption(methods) -> list[str]:
  names = dict(full="`full` (full KV)",
               exact_topk="`exact_topk` (exact top-B attention over the full cache, an oracle)")
  first = [names[m] for m in CEILING if m in methods]
  if not first:
    return []
  return [f"Ceiling first: {' and '.join(first)}, then the methods to compare with "
          f"{'them' if len(first) > 1 else 'it'}.", ""]


def _ci(mean, lo, hi, fmt="{:.1f}") -> str:
  return f"{fmt.format(mean)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def _key(task, length, method, budget):
  return (task, length, method, None if _budgetless(method) else budget)


def _cell(ints, key) -> str:
  v = ints.get(_key(*key))
  return "" if v is None else _ci(*v[:3])


def _gold_cell(gold, key, n_row) -> str:
  v = gold.get(_key(*key))
  if v is None:
    return ""
  lp, lo, hi, rate, n = v
  cell = _ci(lp, lo, hi, "{:.2f}") + ("" if np.isnan(rate) else f" / {100 * rate:.0f}%")
  return cell + ("" if n == n_row else f" (n={n})")


def markdown(results: dict) -> str:
  recs = results["records"]
  ints = intervals(recs)
  gold = gold_intervals(recs)
  by_cell = _by_cell(recs)
  tasks, lengths, methods, budgets = _axes(recs)
  lines = ["# Results", ""]
  c = results["config"]
  lines.append(f"Model `{c['model']['source']}`; seed {c['seed']}; greedy; samples per "
               f"(task, length) {c['samples']}; scores are mean x 100 [{100 * LEVEL:.0f}% "
               f"percentile-bootstrap interval over the samples, {N_BOOT} resamples, seed {SEED}].")
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
    lines += ["Intervals: each task's samples resampled on their own (stratified bootstrap).", ""]
    lines += _ceiling_caption([m for m in methods if any(r["method"] == m and r["task"] in common
                                                         for r in recs)])
    lines.append(f"| length | method | {head} |")
    lines.append("|---|---|" + "---|" * len(cols))
    for length in lengths:
      for m in methods:
        if not any(r["method"] == m and r["task"] in common for r in recs):
          continue
        row = []
        for b in cols:
          groups = [[r["score"] for r in by_cell.get(_key(t, length, m, b), ())] for t in common]
          if all(groups):
            lo, hi = stats.stratified_bootstrap_ci(groups, level=LEVEL, n_boot=N_BOOT, seed=SEED)
            row.append(_ci(100 * np.mean([np.mean(g) for g in groups]), 100 * lo, 100 * hi))
          else:
            row.append("")
        lines.append(f"| {length} | {m} | " + " | ".join(row) + " |")
    lines.append("")
  for task in tasks:
    lines += [f"## {task}", ""]
    lines += _ceiling_caption([m for m in methods if any(r["method"] == m and r["task"] == task
                                                         for r in recs)])
    lines.append(f"| length | method | {head} | n |")
    lines.append("|---|---|" + "---|" * (len(cols) + 1))
    for length in lengths:
      for m in methods:
        key0 = _key(task, length, m, cols[0])
        if key0 not in ints:
          continue
        row = [_cell(ints, (task, length, m, b)) for b in cols]
        lines.append(f"| {length} | {m} | " + " | ".join(row) + f" | {ints[key0][3]} |")
    lines.append("")
    if any(k[0] == task for k in gold):
      lines += [f"Teacher-forced gold answer ({task}), under each method's own cache and decode "
                "steps: mean log-probability per gold token (nats; mean over samples "
                f"[{100 * LEVEL:.0f}% bootstrap interval]) / share of gold tokens that were the "
                "argmax (mean over samples); n = samples with these fields.", ""]
      lines.append(f"| length | method | {head} | n |")
      lines.append("|---|---|" + "---|" * (len(cols) + 1))
      for length in lengths:
        for m in methods:
          got = [gold[_key(task, length, m, b)] for b in cols if _key(task, length, m, b) in gold]
          if not got:
            continue
          n_row = got[0][4]
          row = [_gold_cell(gold, (task, length, m, b), n_row) for b in cols]
          lines.append(f"| {length} | {m} | " + " | ".join(row) + f" | {n_row} |")
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


def _length_label(length: int) -> str:
  return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def _check_compare(results: dict, reference: str, methods, budget) -> list[str]:
  """`compare`'s argument checks (ValueError before any work); the methods to compare."""
  recs = results["records"]
  present = order_methods(r["method"] for r in recs)
  budgets = sorted({r["budget"] for r in recs if r["budget"] is not None})
  if reference not in present:
    raise ValueError(f"reference {reference!r} has no records; methods in this run: {present}")
  methods = [m for m in present if m != reference] if methods is None else list(methods)
  unknown = [m for m in methods if m not in present]
  if unknown:
    raise ValueError(f"methods {unknown} have no records; methods in this run: {present}")
  if reference in methods:
    raise ValueError(f"methods must not include the reference {reference!r}")
  if not methods:
    raise ValueError(f"no method to compare with {reference!r}; methods in this run: {present}")
  budgeted = [m for m in [reference] + methods if not _budgetless(m)]
  if budgeted and budget is None:
    raise ValueError(f"budget is required for {budgeted}; budgets in this run: {budgets}")
  if budgeted and budget not in budgets:
    raise ValueError(f"budget {budget!r} has no records; budgets in this run: {budgets}")
  return methods


def _pairs(by_cell, task, length, reference, method, budget) -> list[tuple[dict, dict]]:
  """(method record, reference record) per sample both have, in the reference's sample order."""
  ref = {_sample_key(r): r for r in by_cell.get(_key(task, length, reference, budget), ())}
  got = {_sample_key(r): r for r in by_cell.get(_key(task, length, method, budget), ())}
  return [(got[i], ref[i]) for i in ref if i in got]


def compare(results: dict, reference: str = "full", methods=None, budget: int | None = None, *,
            level: float = LEVEL, n_boot: int = N_BOOT, seed: int = SEED) -> list[dict]:
  """Paired differences `method - reference` per (task, length), at `budget`.

  `methods` defaults to every other method of the run. Samples are paired by (index, turn);
  a (task, length) where either side has no records is left out. Each row: task, context_len,
  method, budget, n (paired samples), ref / score (mean x 100), diff (mean, lo, hi; x 100),
  and, over the pairs where both records have gold fields, gold_n, ref_logprob, logprob and
  logprob_diff (mean, lo, hi; nats per gold token), or None for those when there are none.
  Intervals: `stats.paired_bootstrap_diff`.

  Raises ValueError, before any work, for a reference, method or budget the run has no
  records of, or a missing budget that a compared method needs.
  """
  methods = _check_compare(results, reference, methods, budget)
  recs = results["records"]
  by_cell = _by_cell(recs)
  tasks, lengths, _, _ = _axes(recs)
  rows = []
  for task in tasks:
    for length in lengths:
      for m in methods:
        pairs = _pairs(by_cell, task, length, reference, m, budget)
        if not pairs:
          continue
        a = [x["score"] for x, _ in pairs]
        b = [y["score"] for _, y in pairs]
        d = stats.paired_bootstrap_diff(a, b, level=level, n_boot=n_boot, seed=seed)
        row = dict(task=task, context_len=length, method=m,
                   budget=None if _budgetless(m) else budget, n=len(pairs),
                   ref=100.0 * float(np.mean(b)), score=100.0 * float(np.mean(a)),
                   diff=tuple(100.0 * v for v in d), gold_n=0, ref_logprob=None, logprob=None,
                   logprob_diff=None, rows_read=_mean_rows_read(x for x, _ in pairs))
        gold = [(gold_of(x), gold_of(y)) for x, y in pairs]
        gold = [(gx[0], gy[0]) for gx, gy in gold if gx is not None and gy is not None]
        if gold:
          ga, gb = [g[0] for g in gold], [g[1] for g in gold]
          row.update(gold_n=len(gold), ref_logprob=float(np.mean(gb)),
                     logprob=float(np.mean(ga)),
                     logprob_diff=stats.paired_bootstrap_diff(ga, gb, level=level,
                                                              n_boot=n_boot, seed=seed))
        rows.append(row)
  return rows


def task_means(results: dict, reference: str = "full", methods=None, budget: int | None = None,
               *, level: float = LEVEL, n_boot: int = N_BOOT, seed: int = SEED) -> list[dict]:
  """Per length, the mean over tasks of each method's paired difference to `reference`.

  A length's tasks are those where the reference and every method in `methods` have paired
  samples (so all rows of a length average the same tasks); each task weighs the same,
  whatever its sample count. Intervals: `stats.stratified_bootstrap_ci`, each task's paired
  differences resampled on their own. Each row: context_len, tasks, method, budget, n (pairs,
  all tasks), ref / score (task means x 100), diff (mean, lo, hi; x 100), and logprob_diff
  (mean, lo, hi; nats per gold token, tasks whose pairs all have gold fields) or None. Argument
  errors as `compare`'s."""
  asked = methods
  methods = _check_compare(results, reference, methods, budget)
  by_cell = _by_cell(results["records"])
  all_tasks, lengths, _, _ = _axes(results["records"])
  pairs_of = {(t, length, m): _pairs(by_cell, t, length, reference, m, budget)
              for t in all_tasks for length in lengths for m in methods}
  if asked is None:  # every other method that pairs with the reference somewhere
    methods = [m for m in methods if any(v for k, v in pairs_of.items() if k[2] == m)]
  out = []
  for length in lengths:
    tasks = [t for t in all_tasks if all(pairs_of[(t, length, m)] for m in methods)]
    if not tasks:
      continue
    for m in methods:
      diffs, golds, refs, scores, n = [], [], [], [], 0
      for t in tasks:
        pairs = pairs_of[(t, length, m)]
        n += len(pairs)
        a = np.array([x["score"] for x, _ in pairs], float)
        b = np.array([y["score"] for _, y in pairs], float)
        diffs.append(a - b)
        refs.append(b.mean())
        scores.append(a.mean())
        g = [(gold_of(x), gold_of(y)) for x, y in pairs]
        golds.append(None if any(gx is None or gy is None for gx, gy in g) else
                     np.array([gx[0] - gy[0] for gx, gy in g]))
      lo, hi = stats.stratified_bootstrap_ci(diffs, level=level, n_boot=n_boot, seed=seed)
      gold = [g for g in golds if g is not None]
      logprob_diff = None
      if gold:
        glo, ghi = stats.stratified_bootstrap_ci(gold, level=level, n_boot=n_boot, seed=seed)
        logprob_diff = (float(np.mean([g.mean() for g in gold])), glo, ghi, len(gold))
      out.append(dict(context_len=length, tasks=tasks, method=m,
                      budget=None if _budgetless(m) else budget, n=n,
                      ref=100.0 * float(np.mean(refs)), score=100.0 * float(np.mean(scores)),
                      diff=(100.0 * float(np.mean([d.mean() for d in diffs])), 100.0 * lo,
                            100.0 * hi), logprob_diff=logprob_diff))
  return out


def task_means_markdown(results: dict, reference: str = "full", methods=None,
                        budget: int | None = None) -> str:
  """`task_means` as a Markdown table, one line per length naming its tasks."""
  rows = task_means(results, reference, methods, budget)
  at = "" if budget is None else f" at B={budget}"
  lines = [f"Mean over tasks of the paired difference to {reference}{at} (method - "
           f"{reference}), each task weighing the same, with {100 * LEVEL:.0f}% stratified "
           f"bootstrap intervals (each task's pairs resampled on their own; {N_BOOT} resamples, "
           f"seed {SEED}). Score: exact match x 100. Gold: mean teacher-forced log-prob per "
           "gold token (nats), over the tasks whose records all have it.", "",
           f"| length | tasks | method | pairs | {reference} | method | diff [lo, hi] | "
           "gold diff [lo, hi] (tasks) |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    g = ("" if r["logprob_diff"] is None else
         "{:+.3f} [{:+.3f}, {:+.3f}] ({})".format(*r["logprob_diff"]))
    lines.append(f"| {_length_label(r['context_len'])} | {len(r['tasks'])} | {r['method']} | "
                 f"{r['n']} | {r['ref']:.1f} | {r['score']:.1f} | {r['diff'][0]:+.1f} "
                 f"[{r['diff'][1]:+.1f}, {r['diff'][2]:+.1f}] | {g} |")
  lines.append("")
  for length in sorted({r["context_len"] for r in rows}):
    tasks = next(r["tasks"] for r in rows if r["context_len"] == length)
    lines.append(f"{_length_label(length)} tasks: {', '.join(tasks)}.")
  return "\n".join(lines)


def _mean_rows_read(records) -> float | None:
  """Mean rows read per KV head and decode step over records that count them (`rows_read`:
  the methods whose read follows the attention mass), else None."""
  got = [r["rows_read"] for r in records if r.get("rows_read") is not None]
  return float(np.mean(got)) if got else None


def _side(lo: float, hi: float) -> str:
  return "below" if hi < 0 else "above" if lo > 0 else "zero"


def compare_markdown(results: dict, reference: str = "full", methods=None,
                     budget: int | None = None) -> str:
  """`compare` as a Markdown table, then one line per method counting the (task, length) cells
  whose interval lies below 0, above 0, or contains 0."""
  rows = compare(results, reference, methods, budget)
  at = "" if budget is None else f" at B={budget}"
  lines = [f"Paired differences to {reference}{at} (method - {reference}), per (task, length), "
           f"over the samples both scored, with {100 * LEVEL:.0f}% paired-bootstrap intervals "
           f"({N_BOOT} resamples, seed {SEED}). Score: the task's score (exact match) x 100. "
           "Gold log-prob: "
           "teacher-forced mean log-probability per gold token (nats), under each method's own "
           "cache and decode steps; empty where the records lack it.", "",
           f"| task | length | method | n | {reference} | method | diff [lo, hi] | gold n | "
           f"{reference} log-prob | method log-prob | diff [lo, hi] |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  reads = any(r["rows_read"] is not None for r in rows)
  if reads:  # a method whose read varies: its mean rows read per KV head and step
    lines[0] += " Rows read: the method's mean rows per KV head and decode step."
    lines[2] += " rows read |"
    lines[3] += "---|"
  for r in rows:
    g = ("| | | |" if r["logprob_diff"] is None else
         f"| {r['ref_logprob']:.3f} | {r['logprob']:.3f} | "
         "{:+.3f} [{:+.3f}, {:+.3f}] |".format(*r["logprob_diff"]))
    lines.append(f"| {r['task']} | {_length_label(r['context_len'])} | {r['method']} | {r['n']} "
                 f"| {r['ref']:.1f} | {r['score']:.1f} | {r['diff'][0]:+.1f} "
                 f"[{r['diff'][1]:+.1f}, {r['diff'][2]:+.1f}] | {r['gold_n'] or ''} " + g
                 + ("" if not reads else
                    f" {'' if r['rows_read'] is None else format(r['rows_read'], '.1f')} |"))
  lines.append("")
  for m in dict.fromkeys(r["method"] for r in rows):
    mine = [r for r in rows if r["method"] == m]
    em = collections.Counter(_side(*r["diff"][1:]) for r in mine)
    text = (f"{m}: exact match below {reference} in {em['below']} of {len(mine)} (task, length) "
            f"cells, above in {em['above']}, interval contains 0 in {em['zero']}")
    lp = [r for r in mine if r["logprob_diff"] is not None]
    if lp:
      gc = collections.Counter(_side(*r["logprob_diff"][1:]) for r in lp)
      text += (f"; gold log-prob below in {gc['below']} of {len(lp)}, above in {gc['above']}, "
               f"contains 0 in {gc['zero']}")
    lines.append(text + ".")
  return "\n".join(lines)


def _pyplot():
  """matplotlib.pyplot on the file-only Agg backend; a one-line ImportError without the extra."""
  try:
    import matplotlib
  except ModuleNotFoundError:
    raise ImportError('the plots need matplotlib: pip install -e ".[eval]"') from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt


def plot_accuracy(results: dict, path: str) -> None:
  plt = _pyplot()

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
  plt = _pyplot()

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

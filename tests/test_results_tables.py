"""examples/results_tables.py and the tables of rocketkv_jax/eval/report.py: the README's tables,
the cell-by-cell check of issue #5, bootstrap intervals, the teacher-forced gold tables and the
paired comparison to full KV (`--compare`)."""

import json
import random
import runpy
from pathlib import Path

import numpy as np
import pytest

from rocketkv_jax.eval import report, stats, variants

TABLES = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "results_tables.py"))
BUDGETS = (64, 128, 256, 512, 1024)


def _results(scores):
  """scores: {(task, length, method): per-budget scores in [0, 1] (a float for "full")}; two
  samples per cell, both with that score."""
  recs = []
  for (task, length, method), v in scores.items():
    cells = [(None, v)] if method == "full" else list(zip(BUDGETS, v))
    for b, x in cells:
      for i in range(2):
        recs.append(dict(task=task, context_len=length, index=i, method=method, budget=b,
                         score=x, prediction="", answers=[]))
  return dict(config=dict(tasks=sorted({k[0] for k in scores}), model=dict(source="m.gguf"),
                          seed=0, samples=2), records=recs)


def _grid():
  s = {("passkey", 2048, "full"): 0.8,
       ("passkey", 2048, "rocketkv"): (0.1, 0.5, 0.79, 0.8, 0.8),
       ("passkey", 2048, "snapkv"): (0.0, 0.6, 0.7, 0.8, 0.9),
       ("passkey", 4096, "full"): 0.5,
       ("passkey", 4096, "rocketkv"): (0.2, 0.4, 0.5, 0.5, 0.5),
       ("passkey", 4096, "snapkv"): (0.0, 0.4, 0.45, 0.5, 0.5)}
  for length in (2048, 4096):
    s[("passkey", length, "exact_topk")] = (1.0,) * 5  # the oracle is not a competitor
    for m in ("quest", "sparq", "streamingllm"):
      s[("passkey", length, m)] = (0.0,) * 5
  return _results(s)


def test_claims_counts_cells_against_the_best_other_method():
  out = TABLES["claims"](_grid())
  rows = {l.split(" | ")[1]: l for l in out.splitlines() if l.startswith("| passkey")}
  # 2K: B=256 gap -1 (within 2), loses to snapkv at 128 (50 < 60) and 1024 (80 < 90)
  assert rows["2K"].startswith("| passkey | 2K | 80.0 | 79.0 | -1.0 | snapkv 70.0 | "
                               "no (50 vs snapkv 60) / yes / yes / no (80 vs snapkv 90) | 2 |")
  # 4K: ties count as at-or-above
  assert "| 50.0 | 50.0 | +0.0 | snapkv 45.0 | yes / yes / yes / yes | 2 |" in rows["4K"]
  assert out.splitlines()[-1] == (
      "RocketKV >= every other compressed method in 6 of 8 cells; losses to {'snapkv': 2}; "
      "RocketKV at B=256 within 2 points of full KV in 2 of 2 (task, length) cells")


def test_claims_and_means_name_the_cells_a_run_lacks():
  """A run without issue #5's whole grid (another sweep's methods or budgets): a ValueError
  naming a missing cell, not a KeyError or an empty table."""
  res = _grid()
  res["records"] = [r for r in res["records"] if r["method"] != "quest"]
  for table in ("claims", "means"):
    with pytest.raises(ValueError, match=rf"^{table} reads the full sweep .* e\.g\. .*'quest'"):
      TABLES[table](res)
  res["records"] = [r for r in res["records"] if r["method"] != "full"]
  with pytest.raises(ValueError, match="lacks all of its cells"):
    TABLES["claims"](res)


def test_means_and_per_length_tables():
  res = _grid()
  means = TABLES["means"](res)
  assert "| 2K (1) | **rocketkv** (reads B/2) | 10.0 | 50.0 | 79.0 | 80.0 | 80.0 |" in means
  assert "| 4K (1) | full | 50.0 | 50.0 | 50.0 | 50.0 | 50.0 |" in means
  per = TABLES["per_length"](res)
  assert per.index("## 2K") < per.index("## 4K")
  assert ("| 4096 | snapkv | 0.0 [0.0, 0.0] | 40.0 [40.0, 40.0] | 45.0 [45.0, 45.0] "
          "| 50.0 [50.0, 50.0] | 50.0 [50.0, 50.0] | 2 |") in per
  # the ceiling first in every table (records: full, rocketkv, snapkv, exact_topk, ...)
  table = per[per.index("### passkey"):per.index("## 4K")]
  assert "Ceiling first: `full` (full KV) and `exact_topk`" in table
  rows = [l.split(" | ")[1] for l in table.splitlines() if l.startswith("| 2048 |")]
  assert rows == ["full", "exact_topk", "rocketkv", "snapkv", "quest", "sparq", "streamingllm"]


# ------------------------------------------------------------- intervals, gold tables, --compare
FULL = [1, 1, 0, 1, 0, 1, 1, 0, 1, 1]  # full KV's per-sample scores (index 0..9), mean 0.7
LP_FULL = [-0.1, -0.2, -2.0, -0.1, -1.5, -0.3, -0.2, -2.5, -0.1, -0.4]


def _rec(method, budget, i, score, lp=None, argmax=None, ntok=3, task="passkey", length=2048):
  r = dict(task=task, context_len=length, index=i, method=method, budget=budget, score=score,
           prediction="", answers=[], tokens=[])
  if lp is not None:
    r.update(gold_logprob=lp, gold_argmax=argmax, gold_tokens=ntok)
  return r


def _run():
  """10 samples; run order snapkv, rocketkv, exact_topk, full. rocketkv differs from full on
  samples 2 (+1) and 5, 6 (-1); snapkv scores 0 everywhere; exact_topk equals full. Gold fields
  on every record except rocketkv's samples 8 and 9 (an older run merged in)."""
  rk = list(FULL)
  rk[2], rk[5], rk[6] = 1, 0, 0
  lp_rk = [x - 0.1 * (i % 3) for i, x in enumerate(LP_FULL)]
  blocks = []
  for b in (128, 256):
    blocks.append([_rec("snapkv", b, i, 0.0, lp=-3.0, argmax=0.0) for i in range(10)])
    blocks.append([_rec("rocketkv", b, i, float(rk[i]), *((lp_rk[i], 0.5) if i < 8 else ()))
                   for i in range(10)])
    blocks.append([_rec("exact_topk", b, i, float(FULL[i]), lp=LP_FULL[i], argmax=1.0)
                   for i in range(10)])
  blocks.append([_rec("full", None, i, float(FULL[i]), lp=LP_FULL[i],
                      argmax=1.0 - 0.1 * (i % 2)) for i in range(10)])
  recs = []
  for k, block in enumerate(blocks):  # pairing must go by sample index, not record order
    random.Random(k).shuffle(block)
    recs += block
  return dict(config=dict(tasks=["passkey"], model=dict(source="m.gguf"), seed=0, samples=10),
              records=recs), rk, lp_rk


def _section(md, heading):
  i = md.index(heading)
  j = md.find("\n## ", i + 1)
  return md[i:] if j < 0 else md[i:j]


def test_markdown_cells_have_bootstrap_intervals_ceiling_first_and_gold_tables():
  res, rk, lp_rk = _run()
  md = report.markdown(res)
  sec = _section(md, "## passkey")
  assert sec.splitlines()[2].startswith("Ceiling first: `full` (full KV) and `exact_topk`")
  score_table, gold_table = sec.split("Teacher-forced gold answer (passkey)")
  rows = [l for l in score_table.splitlines() if l.startswith("| 2048 |")]
  assert [l.split(" | ")[1] for l in rows] == ["full", "exact_topk", "snapkv", "rocketkv"]
  lo, hi = stats.bootstrap_ci(rk)
  assert rows[3] == (f"| 2048 | rocketkv | 60.0 [{100 * lo:.1f}, {100 * hi:.1f}] "
                     f"| 60.0 [{100 * lo:.1f}, {100 * hi:.1f}] | 10 |")
  assert 25 <= 100 * lo < 60 < 100 * hi <= 95  # 10 Bernoulli(0.6): about +-30 points
  assert rows[2] == "| 2048 | snapkv | 0.0 [0.0, 0.0] | 0.0 [0.0, 0.0] | 10 |"
  # gold: per-sample log-probs averaged over samples; argmax rate over samples
  grows = {l.split(" | ")[1]: l for l in gold_table.splitlines() if l.startswith("| 2048 |")}
  assert list(grows) == ["full", "exact_topk", "snapkv", "rocketkv"]
  lo, hi = stats.bootstrap_ci(LP_FULL)
  full_cell = f"{np.mean(LP_FULL):.2f} [{lo:.2f}, {hi:.2f}] / 95%"  # argmax 1.0 / 0.9 alternating
  assert grows["full"] == f"| 2048 | full | {full_cell} | {full_cell} | 10 |"
  assert np.mean(LP_FULL) == pytest.approx(-0.74)
  lo, hi = stats.bootstrap_ci(lp_rk[:8])
  cell = f"{np.mean(lp_rk[:8]):.2f} [{lo:.2f}, {hi:.2f}] / 50%"  # its 8 samples with gold fields
  assert grows["rocketkv"] == f"| 2048 | rocketkv | {cell} | {cell} | 8 |"
  assert "| 2048 | snapkv | -3.00 [-3.00, -3.00] / 0% |" in grows["snapkv"]
  # a cell with fewer gold samples than its row says so
  part = [r for r in res["records"]
          if not (r["method"] == "snapkv" and r["budget"] == 256 and r["index"] < 4)]
  part += [_rec("snapkv", 256, i, 0.0) for i in range(4)]  # these 4 without gold fields
  gsec = _section(report.markdown(dict(res, records=part)), "## passkey")
  assert "| 2048 | snapkv | -3.00 [-3.00, -3.00] / 0% | -3.00 [-3.00, -3.00] / 0% (n=6) | 10 |" \
      in gsec
  # an answer of no tokens has no gold log-prob
  empty = [dict(r, gold_tokens=0) if r["method"] == "full" and r["index"] == 2 else r
           for r in res["records"]]
  gold = report.gold_intervals(empty)
  assert gold[("passkey", 2048, "full", None)][4] == 9
  assert gold[("passkey", 2048, "full", None)][0] == pytest.approx(
      np.mean(LP_FULL[:2] + LP_FULL[3:]))


def test_old_records_without_gold_fields_render_scores_with_intervals_only():
  res, rk, _ = _run()
  gold_keys = ("gold_logprob", "gold_argmax", "gold_tokens")
  old = [{k: v for k, v in r.items() if k not in gold_keys} for r in res["records"]]
  md = report.markdown(dict(res, records=old))
  assert "Teacher-forced" not in md and "log-prob" not in md
  lo, hi = stats.bootstrap_ci(rk)
  assert f"| 2048 | rocketkv | 60.0 [{100 * lo:.1f}, {100 * hi:.1f}] |" in md
  # no ceiling method in the run: no caption
  md2 = report.markdown(dict(res, records=[r for r in old if r["method"] in ("snapkv",
                                                                              "rocketkv")]))
  assert "Ceiling first" not in md2
  # a full-KV-only run: one score column, the caption names full alone
  md3 = report.markdown(dict(res, records=[r for r in old if r["method"] == "full"]))
  assert "Ceiling first: `full` (full KV), then the methods to compare with it." in md3
  lo, hi = stats.bootstrap_ci(FULL)
  assert f"| 2048 | full | 70.0 [{100 * lo:.1f}, {100 * hi:.1f}] | 10 |" in md3


def test_compare_pairs_samples_by_index():
  res, rk, lp_rk = _run()
  rows = {r["method"]: r for r in report.compare(res, "full", budget=256)}
  assert list(rows) == ["exact_topk", "snapkv", "rocketkv"]
  r = rows["rocketkv"]
  d = np.array(rk, float) - np.array(FULL, float)  # by sample index
  assert (r["n"], r["ref"], r["score"], r["budget"]) == (10, 70.0, 60.0, 256)
  want = stats.paired_bootstrap_diff(rk, FULL)
  assert r["diff"] == pytest.approx(tuple(100 * x for x in want))
  assert r["diff"][0] == pytest.approx(100 * d.mean()) == pytest.approx(-10.0)
  assert r["diff"][1] < -10 < r["diff"][2]
  # gold: the 8 samples both records have
  assert r["gold_n"] == 8
  assert r["logprob_diff"] == pytest.approx(stats.paired_bootstrap_diff(lp_rk[:8], LP_FULL[:8]))
  assert r["logprob_diff"][0] == pytest.approx(np.mean([-0.1 * (i % 3) for i in range(8)]))
  assert r["logprob"] - r["ref_logprob"] == pytest.approx(r["logprob_diff"][0])
  # equal on every sample: a zero-width interval only when the samples are paired right
  assert rows["exact_topk"]["diff"] == (0.0, 0.0, 0.0)
  assert rows["exact_topk"]["logprob_diff"] == (0.0, 0.0, 0.0)
  s = rows["snapkv"]
  assert s["diff"][0] == pytest.approx(-70.0) and s["diff"][2] < 0
  assert s["logprob_diff"][0] == pytest.approx(-3.0 + 0.74) and s["logprob_diff"][2] < 0
  # another reference and a subset of methods
  rows = report.compare(res, "exact_topk", ["full", "rocketkv"], budget=128)
  assert [(r["method"], r["budget"], r["diff"]) for r in rows][:1] == [("full", None, (0, 0, 0))]
  assert rows[1]["diff"] == pytest.approx(tuple(100 * x for x in want))


def test_compare_markdown_rows_and_summary_lines():
  res, rk, _ = _run()
  md = report.compare_markdown(res, "full", ["rocketkv", "snapkv"], 256)
  lines = md.splitlines()
  assert lines[0].startswith("Paired differences to full at B=256 (method - full)")
  d, lo, hi = (100 * x for x in stats.paired_bootstrap_diff(rk, FULL))
  row = next(l for l in lines if l.startswith("| passkey | 2K | rocketkv |"))
  assert row.startswith(f"| passkey | 2K | rocketkv | 10 | 70.0 | 60.0 | {d:+.1f} "
                        f"[{lo:+.1f}, {hi:+.1f}] | 8 | {np.mean(LP_FULL[:8]):.3f} |")  # pairs
  assert lines[-2:] == [
      "rocketkv: exact match below full in 0 of 1 (task, length) cells, above in 0, interval "
      "contains 0 in 1; gold log-prob below in 1 of 1, above in 0, contains 0 in 0.",
      "snapkv: exact match below full in 1 of 1 (task, length) cells, above in 0, interval "
      "contains 0 in 0; gold log-prob below in 1 of 1, above in 0, contains 0 in 0."]
  # records without gold fields: the gold columns stay empty and the summary says nothing
  old = [{k: v for k, v in r.items() if not k.startswith("gold_")} for r in res["records"]]
  md = report.compare_markdown(dict(res, records=old), "full", ["snapkv"], 256)
  assert "| passkey | 2K | snapkv | 10 | 70.0 | 0.0 | -70.0 [" in md
  assert md.splitlines()[4].endswith("|  | | | |")
  assert md.splitlines()[-1].endswith("interval contains 0 in 0.")


def test_compare_pools_a_later_run_of_other_methods(tmp_path, capsys):
  """--with: a later run adds a method beside the committed ones; the records both hold must be
  identical, and the pooled comparison pairs the new method's samples with the old reference."""
  res, rk, _ = _run()
  old = dict(res, records=[r for r in res["records"] if r["method"] != "rocketkv"])
  new = dict(res, records=[r for r in res["records"] if r["method"] in ("rocketkv", "full")])
  (tmp_path / "old.json").write_text(json.dumps(old))
  (tmp_path / "new.json").write_text(json.dumps(new))
  TABLES["main"](["--compare", "full", "--budget", "256", str(tmp_path / "old.json"),
                  "--methods", "rocketkv", "--with", str(tmp_path / "new.json")])
  d, lo, hi = (100 * x for x in stats.paired_bootstrap_diff(rk, FULL))
  assert f"| passkey | 2K | rocketkv | 10 | 70.0 | 60.0 | {d:+.1f} [{lo:+.1f}, {hi:+.1f}] |" in (
      capsys.readouterr().out)
  bad = dict(new, records=[dict(r, score=1 - r["score"]) if r["method"] == "full" else r
                           for r in new["records"]])
  (tmp_path / "bad.json").write_text(json.dumps(bad))
  with pytest.raises(SystemExit) as e:
    TABLES["main"](["--compare", "full", "--budget", "256", str(tmp_path / "old.json"),
                    "--with", str(tmp_path / "bad.json")])
  assert e.value.code == 2 and "runs disagree on ('passkey', 2048, 5, 'full', None" in (
      capsys.readouterr().err)
  # --with repeated adds to the pool: the new run's methods in two files
  full_only = dict(new, records=[r for r in new["records"] if r["method"] == "full"])
  rk_only = dict(new, records=[r for r in new["records"] if r["method"] == "rocketkv"])
  (tmp_path / "f.json").write_text(json.dumps(full_only))
  (tmp_path / "k.json").write_text(json.dumps(rk_only))
  TABLES["main"](["--compare", "full", "--budget", "256", str(tmp_path / "old.json"),
                  "--methods", "rocketkv", "--with", str(tmp_path / "f.json"),
                  "--with", str(tmp_path / "k.json")])
  assert f"| passkey | 2K | rocketkv | 10 | 70.0 | 60.0 | {d:+.1f} [{lo:+.1f}, {hi:+.1f}] |" in (
      capsys.readouterr().out)


def test_pool_joins_gold_fields_that_only_one_run_has():
  """An old sweep without gold-answer scores and a later run of the same samples with them: the
  pooled record carries both runs' fields; a record that differs on a shared field is refused."""
  res, _, _ = _run()
  full = [r for r in res["records"] if r["method"] == "full"]
  no_gold = [{k: v for k, v in r.items() if not k.startswith("gold_")} for r in full]
  pooled = report.pool(dict(res, records=no_gold), [dict(res, records=full)])["records"]
  assert pooled == full
  pooled = report.pool(dict(res, records=full), [dict(res, records=no_gold)])["records"]
  assert pooled == full
  with pytest.raises(ValueError, match="runs disagree"):
    report.pool(dict(res, records=no_gold),
                [dict(res, records=[dict(full[0], tokens=[7])])])
  # the same tokens scored in another batch: gold within GOLD_TOL pools (first value kept)
  near = [dict(r, gold_logprob=r["gold_logprob"] + 3e-6) for r in full if "gold_logprob" in r]
  assert near and report.pool(dict(res, records=full), [dict(res, records=near)])[
      "records"] == full
  far = [dict(near[0], gold_logprob=near[0]["gold_logprob"] + 2 * report.GOLD_TOL)]
  with pytest.raises(ValueError, match="runs disagree"):
    report.pool(dict(res, records=full), [dict(res, records=far)])


def test_baselines_from_pools_only_the_other_compressed_methods(tmp_path, capsys):
  """--baselines-from: an older sweep whose rocketkv and full records differ from the new run's
  (other code, other decode length) gives only its SnapKV / Quest / SparQ / StreamingLLM records;
  the same file through --with is refused."""
  res, rk, _ = _run()  # rocketkv 60 vs full 70, snapkv 0 (2K, 10 samples)
  new = dict(res, records=[r for r in res["records"] if r["method"] != "snapkv"])
  quest = [1.0] * 6 + [0.0] * 4  # quest 60: rocketkv's 60 is tied on the mean
  sweep = dict(res, records=(
      [dict(r, tokens=[9]) for r in res["records"] if r["method"] in ("full", "rocketkv")]
      + [r for r in res["records"] if r["method"] == "snapkv"]
      + [_rec("quest", 256, i, quest[i]) for i in range(10)]))
  (tmp_path / "new.json").write_text(json.dumps(new))
  (tmp_path / "sweep.json").write_text(json.dumps(sweep))
  with pytest.raises(SystemExit):
    TABLES["main"]([str(tmp_path / "new.json"), "--targets", "rocketkv", "--budget", "256",
                    "--with", str(tmp_path / "sweep.json")])
  assert "runs disagree" in capsys.readouterr().err
  TABLES["main"]([str(tmp_path / "new.json"), "--targets", "rocketkv", "--budget", "256",
                  "--baselines-from", str(tmp_path / "sweep.json")])
  row = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("| passkey"))
  q = [100 * x for x in stats.paired_bootstrap_diff(rk, quest)]
  s = [100 * x for x in stats.paired_bootstrap_diff(rk, [0] * 10)]
  assert min((q, "quest"), (s, "snapkv"))[1] == "quest" and q[0] < s[0]
  assert f"| quest {q[0]:+.1f} [{q[1]:+.1f}, {q[2]:+.1f}] |" in row
  with pytest.raises(SystemExit):
    TABLES["main"]([str(tmp_path / "new.json"), "--compare", "full", "--budget", "256",
                    "--baselines-from", str(tmp_path / "sweep.json")])
  assert "--baselines-from goes with --targets" in capsys.readouterr().err


def test_targets_checks_issue_13_cells_against_full_kv_and_the_other_methods(tmp_path, capsys):
  """--targets: per cell, the paired difference to full KV (tolerance 5 at 2K, 2 from 4K on), the
  gold log-prob within 0.1 from 4K on, the lowest paired difference to the other methods, and
  the B/2 oracle (exact_topk at 128) against full KV where it is recorded; cells where full KV
  scores below 20 are left out."""
  res, rk, lp_rk = _run()  # 2K: rocketkv 60 vs full 70; snapkv 0
  rk4 = list(FULL)
  rk4[0] = 0  # 4K: one answer lost (-10), gold 0.05 nats/token below full everywhere
  recs = list(res["records"])
  recs += [_rec("full", None, i, float(FULL[i]), lp=LP_FULL[i], argmax=1.0, length=4096)
           for i in range(10)]
  recs += [_rec("rocketkv", 256, i, float(rk4[i]), lp=LP_FULL[i] - 0.05, argmax=1.0,
                length=4096) for i in range(10)]
  recs += [_rec("snapkv", 256, i, float(FULL[i]), lp=-3.0, argmax=0.0, length=4096)
           for i in range(10)]
  lp_half = [LP_FULL[i] - 0.01 * (i % 3) for i in range(9)]  # sample 9: no gold answer
  recs += [_rec("exact_topk", 128, i, float(rk4[i]), lp=lp_half[i] if i < 9 else None,
                argmax=1.0, length=4096)
           for i in range(10)]  # the B/2 oracle at 4K loses what rocketkv loses
  recs += [_rec(m, b, i, float(i == 0), lp=-1.0, argmax=0.0, length=8192)  # full KV at 10
           for m, b in (("full", None), ("rocketkv", 256)) for i in range(10)]
  recs += [_rec(m, b, i, float(m == "full" or i > 0), task="vt")  # 2K: -5, no gold, no snapkv
           for m, b in (("full", None), ("rocketkv", 256)) for i in range(20)]
  path = tmp_path / "r.json"
  path.write_text(json.dumps(dict(res, records=recs)))
  TABLES["main"]([str(path), "--targets", "rocketkv", "--budget", "256"])
  lines = capsys.readouterr().out.splitlines()
  rows = {l.split(" | ")[1]: l for l in lines if l.startswith("| passkey")}
  assert list(rows) == ["2K", "4K"]
  d2 = [100 * x for x in stats.paired_bootstrap_diff(rk, FULL)]
  g2 = stats.paired_bootstrap_diff(lp_rk[:8], LP_FULL[:8])
  s2 = [100 * x for x in stats.paired_bootstrap_diff(rk, [0] * 10)]
  assert rows["2K"] == (
      f"| passkey | 2K | 10 | 70.0 | 70.0 | +0.0 [+0.0, +0.0] | 60.0 | {d2[0]:+.1f} [{d2[1]:+.1f}, {d2[2]:+.1f}] | no "
      f"| {g2[0]:+.3f} [{g2[1]:+.3f}, {g2[2]:+.3f}] |  | snapkv +60.0 [{s2[1]:+.1f}, "
      f"{s2[2]:+.1f}] | {g2[0]:+.3f} [{g2[1]:+.3f}, {g2[2]:+.3f}] |")  # oracle gold = full's
  assert d2[0] == pytest.approx(-10.0) and s2[0] == pytest.approx(60.0)
  d4 = [100 * x for x in stats.paired_bootstrap_diff(rk4, FULL)]
  h4 = stats.paired_bootstrap_diff([LP_FULL[i] - 0.05 for i in range(9)], lp_half)
  assert rows["4K"] == (
      f"| passkey | 4K | 10 | 70.0 | - | -10.0 [{d4[1]:+.1f}, {d4[2]:+.1f}] | 60.0 | "
      f"-10.0 [{d4[1]:+.1f}, {d4[2]:+.1f}] | no "
      f"| -0.050 [-0.050, -0.050] | yes | snapkv -10.0 [{d4[1]:+.1f}, {d4[2]:+.1f}] "
      f"| {h4[0]:+.3f} [{h4[1]:+.3f}, {h4[2]:+.3f}] |")
  assert h4[0] == pytest.approx(-0.04)  # 9 gold pairs: -0.05 + mean(0.01 * (i % 3))
  vt = next(l for l in lines if l.startswith("| vt |"))
  assert vt.startswith("| vt | 2K | 20 | 100.0 | - | - | 95.0 | -5.0 [") and vt.endswith(
      "| yes |  |  |  |  |")
  assert lines[-1] == (
      "rocketkv's gold log-prob at or above that oracle's (paired point estimate) in 0 of 2 "
      "cells that have both.")
  assert lines[-2] == (
      "exact_topk at B/2 = 128 (the oracle reading as many rows as top_k = B/2) within 2 / 5 "
      "points of full KV in 1 of 2 cells that have it.")
  assert lines[-3] == (
      "rocketkv at B=256: within 2 / 5 points of full KV in 1 of 3 cells; gold log-prob within "
      "0.1 of full KV in 1 of 1 cells at 4K and longer; at or above every other compressed "
      "method in 1 of 2 cells; left out (full KV below 20): passkey 8K.")
  for argv, msg in (([str(path), "--targets", "rocketkv"], "--targets needs --budget"),
                    ([str(path), "--targets", "rocketkv", "--compare", "full"], "give one of")):
    with pytest.raises(SystemExit) as e:
      TABLES["main"](argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_compare_command_line(tmp_path, capsys):
  res, _, _ = _run()
  path = tmp_path / "r.json"
  path.write_text(json.dumps(res))
  TABLES["main"](["--compare", "full", "--budget", "256", str(path)])
  out = capsys.readouterr().out
  assert "| passkey | 2K | rocketkv | 10 | 70.0 | 60.0 | -10.0 [" in out
  assert "| passkey | 2K | exact_topk | 10 | 70.0 | 70.0 | +0.0 [+0.0, +0.0] |" in out
  TABLES["main"]([str(path), "--compare", "full", "--budget", "128", "--methods", "snapkv"])
  out = capsys.readouterr().out
  assert "snapkv" in out and "rocketkv" not in out
  (tmp_path / "list.json").write_text("[]")
  for argv, msg in (
      (["--compare", "nope", "--budget", "256", str(path)], "reference 'nope' has no records"),
      (["--compare", "full", str(path)], "budget is required for"),
      (["--compare", "full", "--budget", "999", str(path)], "budget 999 has no records"),
      (["--compare", "full", "--budget", "256", "--methods", "quest", "--", str(path)],
       "methods ['quest'] have no records"),
      ([str(path), "means", "--compare", "full"], "give one of a table"),
      ([str(path)], "give one of a table"),
      ([str(path), "means", "--budget", "256"], "--budget, --methods and --with go with"),
      ([str(path), "means", "--with", str(path)], "--budget, --methods and --with go with"),
      ([str(tmp_path / "missing.json"), "--compare", "full"], "cannot read results JSON"),
      ([str(tmp_path / "list.json"), "--compare", "full"], "is not a results JSON")):
    with pytest.raises(SystemExit) as e:
      TABLES["main"](argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err and "Traceback" not in err, (argv, err)


def test_compare_markdown_shows_rows_read_where_records_count_them():
  """Records of a method whose read follows the attention (exact_topp: `rows_read`) add a
  column with their mean; the other rows leave it empty, and a run without any has none."""
  res, _, _ = _run()
  reads = [3.0 + (r["index"] % 2) for r in res["records"] if r["method"] == "rocketkv"]
  recs = [dict(r, rows_read=3.0 + (r["index"] % 2)) if r["method"] == "rocketkv" else r
          for r in res["records"]]
  rows = {r["method"]: r for r in report.compare(dict(res, records=recs), "full", budget=256)}
  assert rows["rocketkv"]["rows_read"] == pytest.approx(np.mean(reads[:10]))
  assert rows["snapkv"]["rows_read"] is None
  md = report.compare_markdown(dict(res, records=recs), "full", ["rocketkv", "snapkv"], 256)
  lines = md.splitlines()
  assert lines[2].endswith("| rows read |") and lines[3].endswith("|---|")
  rk = next(l for l in lines if l.startswith("| passkey | 2K | rocketkv |"))
  assert rk.endswith(f" {rows['rocketkv']['rows_read']:.1f} |")
  assert next(l for l in lines if l.startswith("| passkey | 2K | snapkv |")).endswith("|  |")
  assert "rows read" not in report.compare_markdown(res, "full", ["snapkv"], 256)


def _task_means_run():
  """Two tasks at 2K with 4 and 10 samples, one at 4K; rocketkv misses one task at 4K's
  neighbour so only the tasks every method has count."""
  recs = []

  def add(task, length, method, budget, scores, gold=None):
    for i, x in enumerate(scores):
      r = dict(task=task, context_len=length, index=i, method=method, budget=budget, score=x,
               prediction="", answers=[])
      if gold is not None:
        r.update(gold_logprob=gold[i], gold_argmax=1.0, gold_tokens=3)
      recs.append(r)

  add("passkey", 2048, "full", None, [1, 1, 1, 1], gold=[-0.1] * 4)
  add("passkey", 2048, "rocketkv", 256, [0, 1, 1, 1], gold=[-0.5, -0.1, -0.1, -0.1])
  add("passkey", 2048, "snapkv", 256, [0, 0, 0, 0], gold=[-1.0] * 4)
  add("vt", 2048, "full", None, [1] * 5 + [0] * 5, gold=[-0.2] * 10)
  add("vt", 2048, "rocketkv", 256, [1] * 10, gold=[-0.2] * 10)
  add("vt", 2048, "snapkv", 256, [1] * 5 + [0] * 5, gold=[-0.2] * 10)
  add("cwe", 4096, "full", None, [1, 0])
  add("cwe", 4096, "rocketkv", 256, [1, 1])
  add("cwe", 4096, "snapkv", 256, [0, 0])
  add("vt", 4096, "full", None, [1, 1])
  add("vt", 4096, "snapkv", 256, [1, 1])  # no rocketkv at vt 4K: 4K averages cwe only
  return dict(config=dict(tasks=["passkey", "vt", "cwe"], model=dict(source="m.gguf"), seed=0,
                          samples=10), records=recs)


def test_task_means_weighs_tasks_equally_with_stratified_intervals(tmp_path, capsys):
  res = _task_means_run()
  rows = {(r["context_len"], r["method"]): r
          for r in report.task_means(res, "full", ["rocketkv", "snapkv"], 256)}
  r = rows[(2048, "rocketkv")]
  # passkey: -1/4 per sample; vt: +5/10. Task means: (-0.25 + 0.5) / 2 = +0.125 (a mean over
  # the 14 pairs would give (-1 + 5) / 14 = +0.286).
  assert r["tasks"] == ["passkey", "vt"] and r["n"] == 14
  assert r["diff"][0] == pytest.approx(12.5) and r["ref"] == pytest.approx(75.0)
  assert r["score"] == pytest.approx(87.5)
  # the interval resamples each task's pairs on their own: against a Monte Carlo of that
  rng = np.random.default_rng(1)
  pk = rng.choice([-1.0, 0, 0, 0], (200_000, 4)).mean(1)
  vt = rng.choice([1.0] * 5 + [0.0] * 5, (200_000, 10)).mean(1)
  lo, hi = np.percentile(100 * (pk + vt) / 2, [2.5, 97.5])
  assert r["diff"][1] == pytest.approx(lo, abs=2.5) and r["diff"][2] == pytest.approx(hi, abs=2.5)
  gold = r["logprob_diff"]
  assert gold[0] == pytest.approx((-0.4 / 4 + 0.0) / 2) and gold[3] == 2
  s = rows[(2048, "snapkv")]
  assert s["diff"][0] == pytest.approx(-50.0)  # passkey -100, vt 0
  assert s["diff"][1] == pytest.approx(-50.0) and s["diff"][2] == pytest.approx(-50.0)
  assert s["logprob_diff"][:3] == pytest.approx(((-0.9 + 0.0) / 2,) * 3)
  four = rows[(4096, "rocketkv")]
  assert four["tasks"] == ["cwe"] and four["diff"][0] == pytest.approx(50.0)
  assert four["logprob_diff"] is None and rows[(4096, "snapkv")]["tasks"] == ["cwe"]
  path = tmp_path / "r.json"
  path.write_text(json.dumps(res))
  TABLES["main"]([str(path), "--task-means", "full", "--budget", "256"])
  out = capsys.readouterr().out
  assert "| 2K | 2 | rocketkv | 14 | 75.0 | 87.5 | +12.5 [" in out
  assert "| 2K | 2 | snapkv | 14 | 75.0 | 25.0 | -50.0 [-50.0, -50.0] | -0.450 [-0.450, " in out
  assert "2K tasks: passkey, vt." in out and "4K tasks: cwe." in out
  TABLES["main"]([str(path), "--task-means", "full", "--budget", "256", "--tasks", "vt", "cwe"])
  out = capsys.readouterr().out
  assert "| 2K | 1 | rocketkv | 10 | 50.0 | 100.0 | +50.0 [" in out and "2K tasks: vt." in out
  # "recommended" names the recommended configuration's spec, as its records do
  spec = variants.RECOMMENDED_SPEC
  res["records"] = [dict(r, method=spec) if r["method"] == "snapkv" else r
                    for r in res["records"]]
  path.write_text(json.dumps(res))
  TABLES["main"]([str(path), "--task-means", "full", "--budget", "256", "--methods",
                  "recommended"])
  out = capsys.readouterr().out
  assert f"| 2K | 2 | {spec} | 14 | 75.0 | 25.0 | -50.0 [-50.0, -50.0] |" in out
  for argv, msg in ((["--task-means", "full"], "budget is required for"),
                    (["--task-means", "full", "--budget", "256", "--tasks", "qa"],
                     "tasks ['qa'] have no records"),
                    (["--targets", "rocketkv", "--budget", "256", "--tasks", "vt"],
                     "--tasks goes with --compare or --task-means")):
    with pytest.raises(SystemExit) as e:
      TABLES["main"]([str(path)] + argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err

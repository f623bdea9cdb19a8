"""Evaluation harness, no model: task generators (seeded, answers recoverable from the prompt,
token targets), metrics against hand-computed values, the LongBench-format loader, reports."""

import collections
import os

import pytest

from eval_fixtures import ByteTokenizer
from rocketkv_jax.runtime.conversation import turn_text
from rocketkv_jax.eval import longbench, metrics, report, tasks

TOK = ByteTokenizer()
DATA = os.path.join(os.path.dirname(__file__), "data", "longbench")


@pytest.mark.parametrize("task", tasks.TASKS + (tasks.MULTITURN_TASK,))
def test_generators_are_seeded_and_fit_the_target(task):
  a = tasks.make_sample(TOK, task, 1500, 3, seed=11)
  b = tasks.make_sample(TOK, task, 1500, 3, seed=11)
  c = tasks.make_sample(TOK, task, 1500, 4, seed=11)
  d = tasks.make_sample(TOK, task, 1500, 3, seed=12)
  assert a == b
  assert a.prompt != c.prompt and a.prompt != d.prompt
  n = len(tasks.prompt_ids(TOK, a))
  slack = 300 if task == "cwe" else 120  # cwe grows in rounds of 20 listed words
  assert n == a.meta["prompt_tokens"] and 1500 - slack <= n <= 1500
  assert a.prompt in TOK.apply_chat_template([{"role": "user", "content": a.prompt}])


@pytest.mark.parametrize("task", tasks.TASKS + (tasks.MULTITURN_TASK,))
def test_answers_are_recoverable_from_the_prompt(task):
  for i in range(3):
    s = tasks.make_sample(TOK, task, 1500, i)
    p = s.prompt
    if task == "cwe":
      items = [tok for tok in p.split("\n")[1].split(" ") if tok.isalpha()]
      counts = collections.Counter(items)
      top = [w for w, _ in counts.most_common(5)]
      assert sorted(top) == sorted(s.answers)
      assert min(counts[w] for w in s.answers) > max(
          c for w, c in counts.items() if w not in s.answers)
    elif task == "vt":
      v = s.meta["value"]
      assert f"VAR {s.answers[0]} = {v}." in p
      for x, y in zip(s.answers, s.answers[1:]):
        assert f"VAR {y} = VAR {x}." in p
    elif task == "multiturn":
      body_start, body_end = p.index("\n\n") + 2, p.rindex("\n\n")
      thirds = set()
      for k, ans, d in zip(s.meta["keys"], [s.answers] + s.turn_answers, s.meta["depths"]):
        pos = p.index(f"for {k} is: {ans[0]}.")
        frac = (pos - body_start) / (body_end - body_start)
        assert abs(frac - d) < 0.1, (frac, d)
        thirds.add(int(frac * 3))
      assert thirds == {0, 1, 2}  # one needle per third of the haystack
      assert len(s.questions) == 2 and s.meta["keys"][1] in s.questions[0]
    else:
      for ans in s.answers:
        assert ans in p
      assert tasks.score(s.metric, f"... {' '.join(s.answers)} ...", s.answers) == 1.0
    if task in ("passkey", "niah_single", "niah_multikey"):
      needle = (f"The pass key is {s.answers[0]}" if task == "passkey"
                else f"for {s.meta['key']} is: {s.answers[0]}")
      body_start = p.index("\n\n") + 2
      body_end = p.rindex("\n\n")
      frac = (p.index(needle) - body_start) / (body_end - body_start)
      tol = 0.3 if task == "niah_multikey" else 0.1  # distractor needles shift it
      assert abs(frac - s.meta["depth"]) < tol, (frac, s.meta["depth"])


def test_answer_prefix_starts_the_assistant_turn():
  """Tasks with an answer prefix (RULER style) decode from chat template + prefix ids; the
  prefix is not in the user message. The passkey haystack is the task's classic filler line."""
  for task in tasks.TASKS + (tasks.MULTITURN_TASK,):
    s = tasks.make_sample(TOK, task, 1500, 0)
    ids = tasks.prompt_ids(TOK, s)
    chat = TOK.encode(TOK.apply_chat_template([{"role": "user", "content": s.prompt}]))
    assert ids == chat + TOK.encode(s.answer_prefix)
    has_prefix = task in ("passkey", "niah_multivalue", "niah_multiquery", "vt", "cwe")
    assert bool(s.answer_prefix) == has_prefix, task
    if has_prefix:
      assert s.answer_prefix not in s.prompt and s.prompt[-1] in "?."
  p = tasks.make_sample(TOK, "passkey", 1500, 2).prompt
  assert p.count("The grass is green. The sky is blue.") >= 10
  assert "fisherman" not in p and "magic" not in p


def test_completion_form_for_base_models():
  """prompt_format "completion": the message as a document, the answer prefix on a new line,
  then ":" (niah_single: its own prefix, then ":"); the token target still holds; a
  conversation is one document (`CompletionFormat`)."""
  comp = tasks.formatted(TOK, "completion")
  assert tasks.formatted(TOK, "chat") is TOK
  for task in tasks.TASKS:
    s = tasks.make_sample(comp, task, 1500, 1)
    ids = tasks.prompt_ids(comp, s)
    assert len(ids) == s.meta["prompt_tokens"] <= 1500
    text = TOK.decode(ids)
    assert "<u>" not in text and "<a>" not in text
    if s.answer_prefix:
      assert text == s.prompt + "\n" + s.answer_prefix + ("" if s.answer_prefix.endswith(":")
                                                           else ":")
    else:
      assert text == s.prompt + ":" and s.prompt.endswith("mentioned in the provided text is")
  assert (tasks.make_sample(comp, "passkey", 1500, 1).answers ==
          tasks.make_sample(TOK, "passkey", 1500, 1).answers)
  # a conversation is one document: answer after the question's ":", next question after a
  # blank line, ":" as the generation prompt
  u = lambda c: {"role": "user", "content": c}
  a = lambda c: {"role": "assistant", "content": c}
  lone = comp.apply_chat_template([u("Q1")])
  assert comp.apply_chat_template([u("Q1"), a(" 7"), u("Q2")]) == lone + ": 7\n\nQ2:"
  assert comp.apply_chat_template([u("Q1"), a(" 7")], add_generation_prompt=False) == lone + ": 7"
  assert turn_text(comp, "Q2") == "\n\nQ2:"
  with pytest.raises(ValueError, match="alternating from a user one"):
    comp.apply_chat_template([u("a"), u("b")])
  with pytest.raises(ValueError, match="prompt_format must be one of"):
    tasks.formatted(TOK, "plain")


def test_passkey_depth_grid_and_bad_task():
  depths = [tasks.make_sample(TOK, "passkey", 800, i).meta["depth"] for i in range(5)]
  assert depths == list(tasks.NIAH_DEPTHS)
  with pytest.raises(ValueError, match="task must be one of"):
    tasks.make_sample(TOK, "nope", 800, 0)
  with pytest.raises(ValueError, match="too short"):
    tasks.make_sample(TOK, "niah_multiquery", 300, 0)


def test_synthetic_scores():
  assert tasks.score("contains", "The number is 1234567.", ["1234567"]) == 1.0
  assert tasks.score("contains", "The number is 123456.", ["1234567"]) == 0.0
  assert tasks.score("recall", "11, 22 and 44", ["11", "22", "33", "44"]) == 0.75
  assert tasks.score("recall", "ABCDE", ["abcde", "fghij"]) == 0.5


def test_metrics_hand_computed():
  assert metrics.normalize("The  Marlow, town!") == "marlow town"
  assert metrics.qa_f1("The Marlow town", "Marlow") == pytest.approx(2 / 3)
  assert metrics.score("qa_f1", "Anna", ["Anna Holt", "Holt"]) == pytest.approx(2 / 3)
  assert metrics.qa_f1("an apple", "the apple") == 1.0
  assert metrics.qa_f1("", "x") == 0.0
  assert metrics.rouge_l("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
  assert metrics.rouge_l("a b c d", "b d") == pytest.approx(2 / 3)
  assert metrics.rouge_l("x y", "z") == 0.0
  classes = ["Individual", "Distance", "City", "Country"]
  assert metrics.score("classification", "It is a City", ["City"], classes) == 1.0
  assert metrics.score("classification", "City or Country", ["City"], classes) == 0.5
  assert metrics.score("classification", "Country", ["City"], classes) == 0.0
  assert metrics.levenshtein("kitten", "sitting") == 3
  assert metrics.edit_similarity("kitten", "sitting") == pytest.approx(4 / 7)
  assert metrics.score("code_sim", "# comment\n    return a * b\n", ["    return a * b"]) == 1.0
  assert metrics.code_sim("return a+b", "return a*b") == pytest.approx(0.9)
  assert metrics.score("count", "There are 2 unique ones", ["2"]) == 1.0
  assert metrics.score("count", "12", ["2"]) == 0.0
  assert metrics.score("retrieval", "Paragraph 3", ["Paragraph 3"]) == 1.0
  assert metrics.score("retrieval", "Paragraph 13", ["Paragraph 3"]) == 0.0
  assert tasks.score("qa_f1", "Marlow", ["Marlow"]) == 1.0
  with pytest.raises(ValueError, match="metric must be one of"):
    metrics.score("bleu", "a", ["a"])


def test_longbench_loader():
  names = longbench.datasets_in(DATA)
  assert names == ["gov_report", "hotpotqa", "lcc", "passage_count", "trec"]
  ss = longbench.load_samples(TOK, DATA, 1024)
  by = collections.defaultdict(list)
  for s in ss:
    by[s.task].append(s)
  assert len(by["lb_hotpotqa"]) == 2 and by["lb_hotpotqa"][1].answers == ["Anna Holt", "Holt"]
  assert {s.metric for s in ss} == {"qa_f1", "rouge_l", "code_sim", "count", "classification"}
  trec = by["lb_trec"][0]
  assert trec.meta["all_classes"] == ["Individual", "Distance", "City", "Country"]
  assert "What is the capital of Norway?" in trec.prompt and "Where is Lima?" in trec.prompt
  assert by["lb_lcc"][0].prompt.endswith("def mul(a, b):\n")
  # middle truncation keeps the head and the question
  short = longbench.load_samples(TOK, DATA, 200, datasets=["hotpotqa"], max_samples=1)[0]
  assert short.meta["prompt_tokens"] <= 200 and "\n...\n" in short.prompt
  assert short.prompt.startswith("Read the text below") and "Which city" in short.prompt


def _fake_results():
  recs = []
  for length in (1000, 2000):
    for i, depth in enumerate((0.0, 0.5)):
      for m, b, sc in (("full", None, 1.0), ("rocketkv", 64, 0.0), ("rocketkv", 128, 1.0),
                       ("snapkv", 64, 0.0), ("snapkv", 128, 0.0)):
        recs.append(dict(task="passkey", context_len=length, index=i, method=m, budget=b,
                         tokens=[], prediction="", answers=["1"], score=sc, depth=depth))
        recs.append(dict(task="vt", context_len=length, index=i, method=m, budget=b,
                         tokens=[], prediction="", answers=["1"], score=sc / 2))
  return dict(config=dict(model=dict(source="m"), seed=0, samples=2), records=recs,
              timing=dict(total_s=1.0))


def test_report_tables_and_plots(tmp_path):
  res = _fake_results()
  agg = report.aggregate(res["records"])
  assert agg[("passkey", 1000, "rocketkv", 128)] == (100.0, 2)
  assert agg[("vt", 2000, "full", None)] == (50.0, 2)
  md = report.markdown(res)
  assert "| 1000 | full | 100.0 [100.0, 100.0] | 100.0 [100.0, 100.0] | 2 |" in md  # per budget
  assert "| 2000 | rocketkv | 0.0 [0.0, 0.0] | 100.0 [100.0, 100.0] | 2 |" in md
  assert "| 1000 | rocketkv | 0.0 [0.0, 0.0] | 75.0 [75.0, 75.0] |" in md  # passkey + vt
  # a task that ran at one length only stays out of the per-length mean
  cwe = [dict(r, task="cwe", score=0.0) for r in res["records"]
         if r["context_len"] == 1000 and r["task"] == "passkey"]
  md3 = report.markdown(dict(res, records=res["records"] + cwe))
  assert "## Mean over synthetic tasks (passkey, vt)" in md3 and "(cwe did not run" in md3
  assert "| 1000 | rocketkv | 0.0 [0.0, 0.0] | 75.0 [75.0, 75.0] |" in md3
  assert "| 1000 | rocketkv | 0.0 [0.0, 0.0] | 0.0 [0.0, 0.0] | 2 |" in md3
  # a full-KV-only run (no budgets) gets one score column
  full = [r for r in res["records"] if r["method"] == "full"]
  md_full = report.markdown(dict(res, records=full))
  assert "| length | method | score | n |" in md_full
  assert "| 2000 | full | 50.0 [50.0, 50.0] | 2 |" in md_full
  paths = report.write_all(res, str(tmp_path), "r")
  for k in ("json", "markdown", "accuracy", "heatmap"):
    assert os.path.getsize(paths[k]) > 0
  assert report.load_json(paths["json"]) == res


def test_merge_runs():
  a, b = _fake_results(), _fake_results()
  a["config"]["context_lengths"], b["config"]["context_lengths"] = [1000], [2000]
  a["config"]["tasks"] = b["config"]["tasks"] = ["passkey", "vt"]
  a["records"] = [r for r in a["records"] if r["context_len"] == 1000]
  b["records"] = [r for r in b["records"] if r["context_len"] == 2000]
  m = report.merge([a, b])
  assert m["config"]["context_lengths"] == [1000, 2000] and len(m["runs"]) == 2
  assert report.aggregate(m["records"]) == report.aggregate(_fake_results()["records"])


def test_merge_pools_disjoint_sample_ranges_and_rejects_overlap():
  def run():
    r = _fake_results()
    r["config"].update(context_lengths=[1000, 2000], tasks=["passkey", "vt"])
    return r

  whole, a, b, c = run(), run(), run(), run()
  a["records"] = [r for r in a["records"] if r["index"] == 0]
  b["records"] = [r for r in b["records"] if r["index"] == 1]
  m = report.merge([a, b])
  assert report.aggregate(m["records"]) == report.aggregate(whole["records"])
  assert m["config"]["samples"] == 2
  c["records"] = [r for r in c["records"] if r["context_len"] == 1000 and r["index"] == 1]
  assert report.merge([a, c])["config"]["samples"] == "1-2 (see n)"  # 2 at 1000, 1 at 2000
  with pytest.raises(ValueError, match="overlap"):
    report.merge([whole, b])


def test_merge_takes_named_tasks_of_a_run(tmp_path):
  """`PATH:TASK` keeps only that task's records: a later run of another task replaces it."""
  old, new = _fake_results(), _fake_results()
  old["config"].update(tasks=["passkey", "vt"], context_lengths=[1000, 2000])
  new["config"].update(tasks=["vt"], context_lengths=[1000, 2000])
  new["records"] = [dict(r, score=1.0) for r in new["records"] if r["task"] == "vt"]
  path = str(tmp_path / "old.json")
  report.save_json(old, path)
  assert report.load_for_merge(path) == old
  kept = report.load_for_merge(path + ":passkey")
  assert kept["config"]["tasks"] == ["passkey"] and kept["config"]["dropped_tasks"] == ["vt"]
  m = report.merge([kept, new])
  agg, agg_old = report.aggregate(m["records"]), report.aggregate(old["records"])
  assert {k: v for k, v in agg.items() if k[0] == "passkey"} == {
      k: v for k, v in agg_old.items() if k[0] == "passkey"}
  assert all(v[0] == 100.0 for k, v in agg.items() if k[0] == "vt")
  with pytest.raises(ValueError, match="overlap"):
    report.merge([old, new])
  with pytest.raises(ValueError, match=r"tasks \['cwe'\] have no records"):
    report.load_for_merge(path + ":passkey,cwe")


def test_sample_start_continues_the_same_sample_sequence():
  """Samples [2, 4) of a split sweep are samples 2 and 3 of a whole one (same seed)."""
  from rocketkv_jax.eval import harness

  class _Model:  # build_samples reads only the tokenizer and the context length
    tokenizer = TOK
    config = type("C", (), dict(max_position_embeddings=4096))

  whole = harness.build_samples(_Model, harness.SweepConfig(
      tasks=("niah_single",), context_lengths=(600,), samples=4, max_new_tokens=8))
  part = harness.build_samples(_Model, harness.SweepConfig(
      tasks=("niah_single",), context_lengths=(600,), samples=2, sample_start=2,
      max_new_tokens=8))
  (ws, _, wp), (ps, _, pp) = whole[("niah_single", 600)], part[("niah_single", 600)]
  assert wp == pp and [s.index for s in ps] == [2, 3]
  assert [(s.prompt, s.answers) for s in ps] == [(s.prompt, s.answers) for s in ws[2:]]
  with pytest.raises(ValueError, match="sample_start"):
    harness.SweepConfig(sample_start=-1)

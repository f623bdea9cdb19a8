"""Evaluation harness end to end on a tiny random Llama (byte tokenizer): JSON / table
produced, identical re-runs, the runner's tokens equal `rocketkv.generate`'s (per method and
inside the sweep for full KV), and multi-turn (full == generate on the whole transcript)."""

import json
import os

import numpy as np
import pytest

import rocketkv_jax as rocketkv
from eval_fixtures import tiny_model
from rocketkv_jax.runtime.conversation import turn_text
from rocketkv_jax.eval import harness, report, tasks
from rocketkv_jax.eval.runner import Runner

CFG = harness.SweepConfig(tasks=("passkey",), context_lengths=(768,), methods=("full", "rocketkv"),
                          budgets=(64,), samples=2, batch_size=2, max_new_tokens=6)


@pytest.fixture(scope="module")
def sweep():
  return harness.run_sweep(tiny_model(), CFG, progress=False)


def test_sweep_writes_json_table_plots_and_is_reproducible(sweep, tmp_path):
  recs = sweep["records"]
  assert len(recs) == 4
  assert {(r["method"], r["budget"]) for r in recs} == {("full", None), ("rocketkv", 64)}
  assert all(len(r["tokens"]) <= 6 and 0.0 <= r["score"] <= 1.0 for r in recs)
  assert sweep["config"]["budgets"] == [64] or sweep["config"]["budgets"] == (64,)
  assert any(k.startswith("rocketkv/64/") for k in sweep["plans"])
  paths = report.write_all(sweep, str(tmp_path))
  with open(paths["json"]) as f:
    saved = json.load(f)
  assert saved["records"] == json.loads(json.dumps(recs))
  md = open(paths["markdown"]).read()
  assert "| 768 | full |" in md and "| 768 | rocketkv |" in md
  assert os.path.getsize(paths["accuracy"]) > 0 and os.path.getsize(paths["heatmap"]) > 0
  again = harness.run_sweep(tiny_model(), CFG, progress=False)
  assert again["records"] == recs


def test_full_kv_sweep_equals_generate(sweep):
  """The sweep's full-KV predictions and scores equal those from `rocketkv.generate` tokens."""
  model = tiny_model()
  samples = [tasks.make_sample(model.tokenizer, "passkey", 768, i, CFG.seed, target_tokens=768)
             for i in range(CFG.samples)]
  ids = [tasks.prompt_ids(model.tokenizer, s) for s in samples]  # + the answer prefix
  gen = rocketkv.generate(model, ids, method="full", max_new_tokens=6, eos_token_ids=(2,))
  full = sorted((r for r in sweep["records"] if r["method"] == "full"), key=lambda r: r["index"])
  for s, r, toks in zip(samples, full, gen.tokens):
    assert r["tokens"] == toks
    pred = model.tokenizer.decode(toks)
    assert r["prediction"] == pred and r["score"] == tasks.score("contains", pred, s.answers)


@pytest.mark.parametrize("method", ["rocketkv"])
def test_runner_tokens_equal_generate(method):
  """Same padded length as generate (the longest prompt): identical greedy tokens."""
  model = tiny_model()
  rng = np.random.default_rng(3)
  prompts = [rng.integers(3, 256, size=n).tolist() for n in (48, 35)]
  tokens = np.zeros((2, 48), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, :len(p)] = p
  runner = Runner(model, eos_token_ids=())
  pp = runner.prompt_pass(tokens, [48, 35])
  got, _, _, _ = runner.decode(pp, method, 32, 8)
  ref = rocketkv.generate(model, prompts, method=method, token_budget=32, max_new_tokens=8,
                          eos_token_ids=())
  assert got == ref.tokens
  # dropping every compiled program (the sweep does it between groups) changes nothing
  runner.precompile([(method, 32)], 2, 48, 8)
  assert runner._futures
  runner.release_compiled()
  assert not runner._futures and runner.decode(pp, method, 32, 8)[0] == ref.tokens


def test_quest_page_size_reaches_the_plan():
  runner = Runner(tiny_model(), quest_page_size=4)
  assert runner.plan("quest", 64, 100, 8).chunk_size == 4
  assert Runner(tiny_model()).plan("quest", 64, 100, 8).chunk_size == 16
  with pytest.raises(ValueError, match="quest_page_size"):
    harness.SweepConfig(quest_page_size=0)


def test_multiturn_scored_per_turn_and_full_matches_generate():
  model = tiny_model()
  pad = 192  # the tiny model's byte-level tokenizer: a turn question is ~170 tokens
  cfg = harness.SweepConfig(tasks=("multiturn",), context_lengths=(1024,), budgets=(64,),
                            samples=1, max_new_tokens=5, turn_pad=pad, turns=2)
  res = harness.run_sweep(model, cfg, progress=False)
  recs = res["records"]
  assert {(r["task"], r["method"]) for r in recs} == {
      (f"multiturn_t{t}", m) for t in (1, 2) for m in ("full", "rocketkv", "rocketkv_mt")}
  # Full KV turn 2 == generate over (turn-1 prompt + turn-1 answer + turn-2 prompt).
  s = tasks.make_sample(model.tokenizer, "multiturn", 1024, 0, 0,
                        target_tokens=harness.padded_len(model, 1024, 5 + 1 * (pad + 5)))
  by = {(r["task"], r["method"]): r for r in recs}
  conv = tasks.chat_ids(model.tokenizer, s.prompt) + by[("multiturn_t1", "full")]["tokens"]
  conv += model.tokenizer.encode(turn_text(model.tokenizer, s.questions[0]))
  ref = rocketkv.generate(model, [conv], method="full", max_new_tokens=5, eos_token_ids=(2,))
  assert by[("multiturn_t2", "full")]["tokens"] == ref.tokens[0]
  # Turn 1 of rocketkv and rocketkv_mt is the same computation (stage 1 from question 1).
  assert by[("multiturn_t1", "rocketkv")]["tokens"] == by[("multiturn_t1", "rocketkv_mt")]["tokens"]
  assert (by[("multiturn_t1", "rocketkv")]["gold_logprob"]
          == by[("multiturn_t1", "rocketkv_mt")]["gold_logprob"])
  # The gold score per turn: for full KV, the log-softmax of a plain forward pass (float64 here)
  # over the conversation so far + that turn's gold answer.
  tok = model.tokenizer
  for t, (ctx, answers) in enumerate([(tasks.chat_ids(tok, s.prompt), s.answers),
                                      (conv, s.turn_answers[0])]):
    g, mask = tasks.gold_ids(tok, tasks.Sample(**{**vars(s), "answers": list(answers)}), 5)
    logits = np.asarray(model.logits(np.array([ctx + g], np.int32)), np.float64)[0]
    logits = logits[len(ctx) - 1:len(ctx) - 1 + len(g)]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    m = np.array(mask)
    r = by[(f"multiturn_t{t + 1}", "full")]
    assert r["gold_tokens"] == m.sum() > 0
    np.testing.assert_allclose(r["gold_logprob"], logp[np.arange(len(g)), g][m].mean(), atol=1e-4)
    assert r["gold_argmax"] == pytest.approx((logits.argmax(-1) == np.array(g))[m].mean())
  # The sparse methods score the same tokens from their own, different caches.
  for m in ("rocketkv", "rocketkv_mt"):
    r = by[("multiturn_t2", m)]
    assert r["gold_tokens"] == by[("multiturn_t2", "full")]["gold_tokens"]
    assert np.isfinite(r["gold_logprob"]) and r["gold_logprob"] <= 0


def test_multiturn_takes_stage2_variants():
  """`multiturn_methods` takes variant specs. A later turn must rebuild the quant state over the
  grown cache (rocketkv) or the re-run stage 1 (rocketkv_mt): a state left unbuilt fails the
  decode step's state check (checked by removing the rebuild). With top_k above every capacity
  each reader attends to every kept slot, so the codes must give the paper's stage 2's tokens
  turn by turn (on this tiny random model the greedy tokens are nearly constant, so that part
  is a weak check; tests/test_stage2.py checks the codes against float64)."""
  model = tiny_model()
  pad = 192
  every = ("rocketkv:top_k=4096", "rocketkv:stage2=quant,top_k=4096",
           "rocketkv_mt:top_k=4096", "rocketkv_mt:stage2=quant,top_k=4096")
  coded = ("rocketkv:stage2=quant", "rocketkv_mt:stage2=quant")
  cfg = harness.SweepConfig(tasks=("multiturn",), context_lengths=(1024,), budgets=(64,),
                            samples=1, max_new_tokens=5, turn_pad=pad, turns=2,
                            multiturn_methods=every + coded)
  res = harness.run_sweep(model, cfg, progress=False)
  by = {(r["task"], r["method"]): r["tokens"] for r in res["records"]}
  assert set(by) == {(f"multiturn_t{t}", m) for t in (1, 2) for m in every + coded}
  for t in (1, 2):
    for base in ("rocketkv", "rocketkv_mt"):
      assert (by[(f"multiturn_t{t}", f"{base}:stage2=quant,top_k=4096")]
              == by[(f"multiturn_t{t}", f"{base}:top_k=4096")])
  assert by[("multiturn_t1", coded[0])] == by[("multiturn_t1", coded[1])]
  assert res["plans"]["multiturn/rocketkv:stage2=quant/64/turn2"]["stage2"] == "quant"
  with pytest.raises(ValueError, match="unknown method"):
    harness.SweepConfig(multiturn_methods=("rocketkv_x",))
  with pytest.raises(ValueError, match="multiturn_methods: 'exact_topp' has no multi-turn path"):
    harness.SweepConfig(multiturn_methods=("exact_topp:read_mass=0.8",))


def test_attention_recall_exact_topk_is_the_upper_bound():
  from rocketkv_jax.eval import diagnostics

  model = tiny_model()
  runner = Runner(model)
  rng = np.random.default_rng(4)
  tokens = rng.integers(3, 256, size=(1, 300)).astype(np.int32)
  pp = runner.prompt_pass(tokens, [300])
  rows = {(r["method"], r["budget"]): r for r in diagnostics.attention_recall(
      runner, pp, ["exact_topk", "rocketkv", "snapkv"], [64])}
  best = rows[("exact_topk", 64)]["read_recall"]
  for m in ("rocketkv", "snapkv"):
    r = rows[(m, 64)]
    assert r["read_recall"] <= best + 1e-5 and r["read_recall"] <= r["kept_recall"] + 1e-5
  assert rows[("rocketkv", 64)]["kept_recall"] > rows[("snapkv", 64)]["kept_recall"]


def test_longbench_data_dir_through_the_sweep():
  import dataclasses

  data = os.path.join(os.path.dirname(__file__), "data", "longbench")
  cfg = dataclasses.replace(CFG, tasks=(), data_dir=data, datasets=("hotpotqa",))
  res = harness.run_sweep(tiny_model(), cfg, progress=False)  # same shapes as CFG: no compiles
  recs = res["records"]
  assert {(r["task"], r["method"]) for r in recs} == {("lb_hotpotqa", "full"),
                                                      ("lb_hotpotqa", "rocketkv")}
  assert len(recs) == 4 and recs[0]["answers"] == ["Marlow"]
  assert "## lb_hotpotqa" in report.markdown(res)


def test_gold_score_equals_full_logits_and_score_continuations():
  """The sweep's teacher-forced gold score: for full KV it equals the log-softmax of a plain
  forward pass over prompt + gold answer (float64 here); for rocketkv it equals
  `rocketkv.score_continuations` under the same plan (context padded to the sweep's length)."""
  model = tiny_model()
  cfg = harness.SweepConfig(tasks=("passkey",), context_lengths=(768,),
                            methods=("full", "rocketkv"), budgets=(64,), samples=2, batch_size=2,
                            max_new_tokens=8)
  recs = harness.run_sweep(model, cfg, progress=False)["records"]
  tok = model.tokenizer
  samples = [tasks.make_sample(tok, "passkey", 768, i, 0, target_tokens=768) for i in range(2)]
  golds = [tasks.gold_ids(tok, s, 8) for s in samples]
  assert [sum(m) for _, m in golds] == [5, 5]  # the 5 digits, not the leading space
  by = {(r["method"], r["index"]): r for r in recs}
  for s, (g, mask) in zip(samples, golds):
    ids = tasks.prompt_ids(tok, s)
    logits = np.asarray(model.logits(np.array([ids + g], np.int32)), np.float64)[0]
    logits = logits[len(ids) - 1:len(ids) - 1 + len(g)]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    lp = logp[np.arange(len(g)), g]
    am = logits.argmax(-1) == np.array(g)
    m = np.array(mask)
    r = by[("full", s.index)]
    assert r["gold_tokens"] == 5
    np.testing.assert_allclose(r["gold_logprob"], lp[m].mean(), atol=1e-4)
    assert r["gold_argmax"] == pytest.approx(am[m].mean())
  conts = [g + [0] * (8 - len(g)) for g, _ in golds]
  ref = rocketkv.score_continuations(
      model, [tasks.prompt_ids(tok, s) for s in samples], conts,
      rocket_config=rocketkv.RocketConfig(token_budget=64, method="rocketkv"), batch_size=2,
      pad_multiple=768)
  for s, (g, mask), lp in zip(samples, golds, ref.logprobs):
    m = np.array(mask + [False] * (8 - len(g)))
    r = by[("rocketkv", s.index)]
    np.testing.assert_allclose(r["gold_logprob"], lp[m].mean(), atol=1e-4)
    assert r["gold_logprob"] != by[("full", s.index)]["gold_logprob"]


def test_runner_releases_its_programs_only_when_mappings_are_crowded(monkeypatch):
  from rocketkv_jax.eval import runner as runner_mod

  n, limit = runner_mod.memory_mappings()
  assert 0 < n < limit  # Linux: this process's mappings and vm.max_map_count
  runner = Runner(tiny_model())
  runner.precompile([("rocketkv", 32)], 1, 48, 4)
  assert runner._futures
  monkeypatch.setattr(runner_mod, "memory_mappings", lambda: (30000, 65530))
  assert not runner.release_if_crowded() and runner._futures
  monkeypatch.setattr(runner_mod, "memory_mappings", lambda: (40000, 65530))
  assert runner.release_if_crowded() and not runner._futures
  monkeypatch.setattr(runner_mod, "memory_mappings", lambda: (0, 0))  # unknown: never
  assert not runner.release_if_crowded()


def test_prompt_format_resolves_and_rejects():
  """"auto" prompts in the chat template when the tokenizer has one, else in completion form
  (a base model), multi-turn included; unknown formats are refused before any run."""
  import types

  from rocketkv_jax.eval import harness, tasks

  chat_model = types.SimpleNamespace(tokenizer=types.SimpleNamespace(chat_template="{{x}}"))
  base_model = types.SimpleNamespace(tokenizer=types.SimpleNamespace(chat_template=None))
  cfg = harness.SweepConfig(tasks=("niah_single",))
  assert harness.prompt_format(chat_model, cfg) == "chat"
  assert harness.prompt_format(base_model, cfg) == "completion"
  assert isinstance(harness.sweep_tokenizer(base_model, cfg), tasks.CompletionFormat)
  assert harness.sweep_tokenizer(chat_model, cfg) is chat_model.tokenizer
  forced = harness.SweepConfig(tasks=("niah_single",), prompt_format="chat")
  assert harness.prompt_format(base_model, forced) == "chat"
  with pytest.raises(ValueError, match="prompt_format must be one of"):
    harness.SweepConfig(prompt_format="plain")
  # a conversation in completion form is one document (tasks.CompletionFormat)
  mt = harness.SweepConfig(tasks=("multiturn",), prompt_format="completion")
  assert isinstance(harness.sweep_tokenizer(base_model, mt), tasks.CompletionFormat)


def test_multiturn_on_a_hybrid_model_in_completion_form():
  """Tiny Gemma 3 (8-token sliding layers) with the byte tokenizer, prompted as a base model: a
  turn goes through the sliding layers' windows, and full KV's turn 2 is `generate`'s answer
  to the transcript as one prompt (question, ":", answer, blank line, next question, ":")."""
  import dataclasses

  import rocketkv_jax.models as M
  from eval_fixtures import ByteTokenizer
  from model_fixtures import gemma3_checkpoint

  path, _ = gemma3_checkpoint()
  model = M.load(path)
  model.config = dataclasses.replace(model.config, max_position_embeddings=2048)
  model.tokenizer = ByteTokenizer()
  pad = 192
  cfg = harness.SweepConfig(tasks=("multiturn",), context_lengths=(1024,), budgets=(64,),
                            samples=1, max_new_tokens=5, turn_pad=pad, turns=2,
                            prompt_format="completion", multiturn_methods=("full", "rocketkv_mt"))
  recs = harness.run_sweep(model, cfg, progress=False)["records"]
  by = {(r["task"], r["method"]): r for r in recs}
  assert set(by) == {(f"multiturn_t{t}", m) for t in (1, 2) for m in ("full", "rocketkv_mt")}
  comp = tasks.formatted(model.tokenizer, "completion")
  s = tasks.make_sample(comp, "multiturn", 1024, 0, 0,
                        target_tokens=harness.padded_len(model, 1024, 5 + 1 * (pad + 5)))
  conv = tasks.prompt_ids(comp, s) + by[("multiturn_t1", "full")]["tokens"]
  conv += comp.encode(turn_text(comp, s.questions[0]), add_special_tokens=False)
  assert comp.decode(conv).endswith(s.questions[0] + ":")
  ref = rocketkv.generate(model, [conv], method="full", max_new_tokens=5, eos_token_ids=(2,))
  assert by[("multiturn_t2", "full")]["tokens"] == ref.tokens[0]

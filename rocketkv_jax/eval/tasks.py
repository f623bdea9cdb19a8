"""Seeded synthetic long-context tasks: passkey / NIAH and RULER-style tasks, written here.

Every generator is a pure function of (seed, task, context length, sample index): the same
arguments give the same prompt, answer and needle positions. A haystack is filled up to a token
target measured with the model's own tokenizer, and the final prompt is the user message wrapped
in the model's chat template (`tokenizer.apply_chat_template`).

Tasks (name -> what is asked, how it is scored):
  passkey          a 5-digit pass key hidden at a given depth of filler text; `contains`
                   (the NIAH depth x length grid uses this task).
  niah_single      one "special magic number for <key>" needle; `contains`.
  niah_multikey    the queried needle plus 3 distractor needles with other keys; `contains`.
  niah_multivalue  4 numbers for the same key, all asked for; `recall` of the 4 numbers.
  niah_multiquery  4 keys with one number each, all 4 asked for; `recall`.
  vt               variable tracking: a chain `VAR A = 12345`, `VAR B = VAR A`, ... (4 names)
                   spread through the filler, plus a distractor chain; `recall` of the names.
  cwe              common-words extraction: a numbered word list where 5 words appear far more
                   often than the rest; `recall` of those 5 words.

Filler is seeded prose from a small grammar (passkey: its classic repeated line); five tasks
start the assistant turn with RULER's answer prefix; multi-turn asks about three needles, one
per turn. Details: docs/evaluation.md#the-synthetic-tasks-rocketkv_jaxevaltaskspy; why each
form: results/sweep.md, "Task design notes".

Prompt format: a chat model gets the chat template (above); a base model (Gemma 3 270M) gets
the same user message in completion form (`CompletionFormat`: BOS, the message, then the
answer prefix on a new line and a ":"), so every task reads the same text either way.

Tokenizer interface used here (satisfied by `rocketkv.models.Tokenizer`):
`encode(text, add_special_tokens=False) -> list[int]` and
`apply_chat_template(messages, add_generation_prompt=True) -> str`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt",
         "cwe")
MULTITURN_TASK = "multiturn"
NIAH_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

# Per-task generation length (answers plus a short preamble).
MAX_NEW_TOKENS = {"passkey": 16, "niah_single": 24, "niah_multikey": 24, "niah_multivalue": 64,
                  "niah_multiquery": 96, "vt": 32, "cwe": 48, "multiturn": 40}

_SUBJECTS = ("The old fisherman", "A young painter", "The village council", "My neighbour",
             "The night train", "A curious fox", "The librarian", "Our grandmother",
             "The river", "A travelling merchant", "The tired farmer", "The school choir",
             "A quiet engineer", "The harbour master", "The morning wind", "A lost traveller",
             "The baker", "The mountain guide", "A small robot", "The gardener")
_VERBS = ("walked past", "painted", "talked about", "remembered", "carried", "looked at",
          "repaired", "wrote a letter about", "sang about", "dreamed of", "cleaned",
          "measured", "followed", "described", "photographed", "visited", "forgot",
          "admired", "counted", "planted")
_OBJECTS = ("the wooden bridge", "a basket of apples", "the stone tower", "an empty boat",
            "the red lantern", "a box of letters", "the green hills", "a broken clock",
            "the narrow street", "a field of barley", "the copper kettle", "a flock of geese",
            "the old map", "a jar of honey", "the silver bell", "the winter market",
            "a pile of books", "the lighthouse", "a pair of boots", "the orchard gate")
_PLACES = ("near the harbour", "before sunrise", "after the long rain", "in the quiet valley",
           "during the festival", "on a cold afternoon", "beside the mill", "at the edge of town",
           "under the bright moon", "in late autumn", "while the kettle boiled",
           "without saying a word", "for the third time that week", "as the bells rang",
           "behind the bakery", "in the old square")
_TAILS = ("", "", "", " Nobody seemed surprised.", " It was an ordinary day.",
          " The sky stayed grey for hours.", " Everyone went home early.",
          " The air smelled of bread and smoke.", " A dog barked somewhere far away.")
_KEY_ADJ = ("amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy",
            "jolly", "keen", "lively", "misty", "noble", "odd", "proud", "quick", "rusty",
            "silent", "tidy", "upbeat", "vivid", "wild", "young", "zesty")
_KEY_NOUN = ("anchor", "badger", "candle", "dolphin", "engine", "falcon", "glacier", "harbor",
             "island", "jacket", "kitten", "lantern", "meadow", "needle", "otter", "pepper",
             "quarry", "rocket", "saddle", "tunnel", "umbrella", "violin", "walnut", "yacht",
             "zebra")
_PASSKEY_FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There "
                   "and back again.")
_CWE_WORDS = tuple(sorted(set(
    "apple river stone cloud maple tiger piano lemon candle forest rocket silver garden "
    "window bottle pencil mirror button dragon castle island jungle ladder magnet needle "
    "orange parrot pillow rabbit saddle tomato turtle violin wallet yogurt zipper anchor "
    "basket carpet donkey engine falcon guitar hammer jacket kettle lizard meadow napkin "
    "oyster pepper quartz ribbon salmon tablet umbrella velvet walnut barley copper desert "
    "feather glider harbor insect jigsaw koala lantern marble nectar orchid planet quiver "
    "raisin sponge tundra utensil vessel willow".split())))


@dataclasses.dataclass
class Sample:
  """One evaluation prompt.

  Attributes:
    task: task name; context_len: the length bucket it was built for; index: sample index.
    prompt: the user message (before the chat template).
    answers: reference strings.
    metric: "contains" | "recall" | a LongBench metric name.
    meta: task details (needle depth, keys, ...).
    questions, turn_answers: multi-turn only: the later turns' questions and answers
      (`prompt` holds the context and the first question, `answers` its answer).
    answer_prefix: text the assistant turn starts with (RULER's answer prefix), appended after
      the chat template's generation prompt; the model continues it. See `prompt_ids`.
  """

  task: str
  context_len: int
  index: int
  prompt: str
  answers: list[str]
  metric: str
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)
  questions: list[str] = dataclasses.field(default_factory=list)
  turn_answers: list[list[str]] = dataclasses.field(default_factory=list)
  answer_prefix: str = ""


def sample_rng(seed: int, task: str, context_len: int, index: int) -> np.random.Generator:
  """A generator keyed by stable integers (no Python `hash`, which is salted per process)."""
  tid = sum((i + 1) * ord(c) for i, c in enumerate(task))
  return np.random.default_rng([int(seed), tid, int(context_len), int(index)])


def filler_sentences(rng: np.random.Generator, n: int) -> list[str]:
  out = []
  for _ in range(n):
    out.append(f"{_SUBJECTS[rng.integers(len(_SUBJECTS))]} "
               f"{_VERBS[rng.integers(len(_VERBS))]} {_OBJECTS[rng.integers(len(_OBJECTS))]} "
               f"{_PLACES[rng.integers(len(_PLACES))]}.{_TAILS[rng.integers(len(_TAILS))]}")
  return out


def passkey_filler(rng: np.random.Generator, n: int) -> list[str]:
  """The passkey task's standard filler (Mohtashami & Jaggi, 2023): one line, repeated."""
  del rng
  return [_PASSKEY_FILLER] * n


PROMPT_FORMATS = ("chat", "completion")


class CompletionFormat:
  """A tokenizer whose "chat template" is completion form, for base models: BOS (as the
  tokenizer adds it) and the user message; an answer prefix follows on a new line
  (`prompt_ids`), and the prompt ends with ":" ("... The pass key mentioned in the provided
  text is:"), after which the base model writes the answer rather than more prose (`answer_tail`;
  checked with full KV only, docs/evaluation.md).

  A conversation (user and assistant messages alternating, from a user one) is one document:
  each answer follows the ":" that ends its question, and the next question starts after a
  blank line; the generation prompt of a conversation is that ":" (one message alone gets it
  from `answer_tail`, as before conversations were supported).
  """

  prefix_separator = "\n"  # between the message and an answer prefix (chat: the template's)
  answer_lead = ":"  # ends every prompt: a base model then writes the answer, not more prose
  turn_separator = "\n\n"  # between an answer and the next question

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer

  def __getattr__(self, name):  # encode / decode / eos_token_ids ... of the wrapped tokenizer
    return getattr(self.tokenizer, name)

  def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
    roles = [m["role"] for m in messages]
    if not roles or roles != [("user", "assistant")[i % 2] for i in range(len(roles))]:
      raise ValueError("prompt_format='completion' formats user and assistant messages "
                       f"alternating from a user one, got roles {roles}")
    bos = getattr(self.tokenizer, "bos_token", None) if getattr(
        self.tokenizer, "add_bos", False) else None
    text = (bos or "") + messages[0]["content"]
    for m in messages[1:]:
      sep = self.answer_lead if m["role"] == "assistant" else self.turn_separator
      text += sep + m["content"]
    if add_generation_prompt and len(messages) > 1 and roles[-1] == "user":
      text += self.answer_lead
    return text


def formatted(tokenizer, prompt_format: str):
  """`tokenizer` itself for "chat", or its `CompletionFormat` for "completion"."""
  if prompt_format not in PROMPT_FORMATS:
    raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
  return tokenizer if prompt_format == "chat" else CompletionFormat(tokenizer)


def chat_ids(tokenizer, user_message: str) -> list[int]:
  """The chat-templated prompt ids (user turn + generation prompt), as `generate(chat=True)`."""
  text = tokenizer.apply_chat_template([{"role": "user", "content": user_message}])
  return tokenizer.encode(text, add_special_tokens=False)


def answer_tail(tokenizer, answer_prefix: str) -> str:
  """The text after the formatted message: the answer prefix (completion form: on a new line,
  and a ":" after it unless it has one; `CompletionFormat`)."""
  tail = getattr(tokenizer, "prefix_separator", "") + answer_prefix if answer_prefix else ""
  lead = getattr(tokenizer, "answer_lead", "")
  if lead and not answer_prefix.rstrip().endswith(lead):
    tail += lead
  return tail


def prompt_ids(tokenizer, sample: Sample) -> list[int]:
  """The ids a sample is decoded from: `chat_ids(prompt)` then `answer_tail`'s ids."""
  ids = chat_ids(tokenizer, sample.prompt)
  tail = answer_tail(tokenizer, sample.answer_prefix)
  if tail:
    ids = ids + tokenizer.encode(tail, add_special_tokens=False)
  return ids


def _key(rng, used: set) -> str:
  while True:
    k = f"{_KEY_ADJ[rng.integers(len(_KEY_ADJ))]}-{_KEY_NOUN[rng.integers(len(_KEY_NOUN))]}"
    if k not in used:
      used.add(k)
      return k


def _number(rng, digits: int = 7) -> str:
  return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _magic(key: str, value: str) -> str:
  return f"One of the special magic numbers for {key} is: {value}."


class _Haystack:
  """Fills filler sentences around needles up to a token target (measured with the tokenizer)."""

  def __init__(self, tokenizer, rng, target_tokens: int, filler=None):
    self.tok = tokenizer
    self.rng = rng
    self.target = target_tokens
    self.filler = filler or filler_sentences

  def build(self, make_message, needles: list[str], depths: list[float],
            answer_prefix: str = "") -> tuple[str, int]:
    """make_message(haystack) -> user message. Returns (message, prompt token count), the count
    including `answer_prefix`'s tokens (see `prompt_ids`)."""
    tail = answer_tail(self.tok, answer_prefix)
    extra = len(self.tok.encode(tail, add_special_tokens=False)) if tail else 0
    target = self.target - extra
    est = max(8, target // 10)
    sents = self.filler(self.rng, est)
    # Grow until the prompt exceeds the target, then trim sentences until it fits.
    while True:
      msg = make_message(self._insert(sents, needles, depths))
      n = len(chat_ids(self.tok, msg))
      if n > target:
        break
      per = max(n / max(len(sents), 1), 1.0)
      more = max(4, int((target - n) / per) + 4)
      sents = sents + self.filler(self.rng, more)
    lo, hi = 0, len(sents)  # largest prefix length whose prompt fits
    while lo < hi:
      mid = (lo + hi + 1) // 2
      m = make_message(self._insert(sents[:mid], needles, depths))
      if len(chat_ids(self.tok, m)) <= target:
        lo = mid
      else:
        hi = mid - 1
    msg = make_message(self._insert(sents[:lo], needles, depths))
    n = len(chat_ids(self.tok, msg))
    if n > target:
      raise ValueError(f"a context of {self.target} tokens is too short for this task: the "
                       f"prompt without filler has {n + extra} tokens")
    return msg, n + extra

  @staticmethod
  def _insert(sents: list[str], needles: list[str], depths: list[float]) -> str:
    out = list(sents)
    # insert deepest first so earlier indices stay valid
    order = sorted(range(len(needles)), key=lambda i: -depths[i])
    for i in order:
      pos = int(round(depths[i] * len(sents)))
      out.insert(min(pos, len(out)), needles[i])
    return " ".join(out)


def _number_question(key: str) -> str:
  """niah_single / multikey / multiturn question, with its answer prefix in the user message."""
  return (f"What is the special magic number for {key} mentioned in the provided text? "
          f"The special magic number for {key} mentioned in the provided text is")


def _spread_depths(rng, n: int) -> list[float]:
  return sorted(float(d) for d in rng.uniform(0.05, 0.95, size=n))


def make_sample(tokenizer, task: str, context_len: int, index: int, seed: int = 0,
                target_tokens: int | None = None) -> Sample:
  """Builds sample `index` of `task` whose chat-templated prompt has <= target_tokens tokens
  (default `context_len`)."""
  if task not in TASKS and task != MULTITURN_TASK:
    raise ValueError(f"task must be one of {TASKS + (MULTITURN_TASK,)}, got {task!r}")
  rng = sample_rng(seed, task, context_len, index)
  target = int(target_tokens or context_len)
  hay = _Haystack(tokenizer, rng, target, passkey_filler if task == "passkey" else None)
  used: set = set()

  if task == "passkey":
    depth = NIAH_DEPTHS[index % len(NIAH_DEPTHS)]
    key = _number(rng, 5)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    intro = ("There is an important piece of information hidden inside a lot of irrelevant "
             "text. Find it and memorize it.\n\n")
    q = "\n\nWhat is the pass key mentioned in the provided text?"
    pre = "The pass key mentioned in the provided text is"
    msg, n = hay.build(lambda h: intro + h + q, [needle], [depth], pre)
    return Sample(task, context_len, index, msg, [key], "contains",
                  dict(depth=depth, prompt_tokens=n), answer_prefix=pre)

  intro = ("Some special magic numbers are hidden within the following text. Make sure to "
           "memorize them. I will quiz you about the numbers afterwards.\n\n")
  if task in ("niah_single", "niah_multikey"):
    depth = NIAH_DEPTHS[index % len(NIAH_DEPTHS)]
    key, val = _key(rng, used), _number(rng)
    needles, depths = [_magic(key, val)], [depth]
    if task == "niah_multikey":
      for d in rng.uniform(0.0, 1.0, size=3):
        needles.append(_magic(_key(rng, used), _number(rng)))
        depths.append(float(d))
    q = "\n\n" + _number_question(key)
    msg, n = hay.build(lambda h: intro + h + q, needles, depths)
    return Sample(task, context_len, index, msg, [val], "contains",
                  dict(depth=depth, key=key, prompt_tokens=n))

  if task in ("niah_multivalue", "niah_multiquery"):  # one key with 4 numbers / 4 keys
    keys = [_key(rng, used) for _ in range(1 if task == "niah_multivalue" else 4)]
    vals = [_number(rng) for _ in range(4)]
    named = keys[0] if len(keys) == 1 else f"{', '.join(keys[:-1])} and {keys[-1]}"
    q = f"\n\nWhat are all the special magic numbers for {named} mentioned in the provided text?"
    pre = f"The special magic numbers for {named} mentioned in the provided text are"
    msg, n = hay.build(lambda h: intro + h + q,
                       [_magic(keys[k % len(keys)], v) for k, v in enumerate(vals)],
                       _spread_depths(rng, 4), pre)
    meta = dict(key=keys[0]) if len(keys) == 1 else dict(keys=keys)
    return Sample(task, context_len, index, msg, vals, "recall", dict(meta, prompt_tokens=n),
                  answer_prefix=pre)

  if task == "vt":
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    names: set = set()

    def name():
      while True:
        s = "".join(letters[i] for i in rng.integers(0, 26, size=5))
        if s not in names:
          names.add(s)
          return s

    value, other = _number(rng, 5), _number(rng, 5)
    chain = [name() for _ in range(4)]
    decoy = [name() for _ in range(4)]
    needles = [f"VAR {chain[0]} = {value}."] + [
        f"VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, 4)]
    needles += [f"VAR {decoy[0]} = {other}."] + [
        f"VAR {decoy[i]} = VAR {decoy[i - 1]}." for i in range(1, 4)]
    d1, d2 = _spread_depths(rng, 4), _spread_depths(rng, 4)
    intro_vt = ("Memorize and track the chain(s) of variable assignment hidden in the following "
                "text.\n\n")
    q = (f"\n\nQuestion: Find all variables that are assigned the value {value} in the text "
         f"above.")
    pre = (f"Answer: According to the chain(s) of variable assignment in the text above, 4 "
           f"variables are assigned the value {value}, they are:")
    msg, n = hay.build(lambda h: intro_vt + h + q, needles, d1 + d2, pre)
    return Sample(task, context_len, index, msg, chain, "recall",
                  dict(value=value, prompt_tokens=n), answer_prefix=pre)

  if task == "cwe":
    words = list(_CWE_WORDS)
    rng.shuffle(words)
    common, rare = words[:5], words[5:]

    def message(k: int) -> str:
      # k rounds; each round lists every common word twice and the next 10 rare words once
      r2 = np.random.default_rng([int(seed), 7, int(context_len), int(index)])
      items = []
      for r in range(k):
        items += [rare[(10 * r + j) % len(rare)] for j in range(10)] + common * 2
      r2.shuffle(items)
      body = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
      return ("Below is a numbered list of words. In these words, some appear more often than "
              "others. Memorize the ones that appear most often.\n" + body +
              "\nQuestion: What are the 5 most common words in the above list?")

    pre = "Answer: The top 5 words that appear most often in the list are:"
    extra = len(tokenizer.encode(answer_tail(tokenizer, pre), add_special_tokens=False))
    target -= extra
    lo, hi = 1, 1
    while len(chat_ids(tokenizer, message(hi))) <= target:
      lo, hi = hi, hi * 2
    while hi - lo > 1:
      mid = (lo + hi) // 2
      if len(chat_ids(tokenizer, message(mid))) <= target:
        lo = mid
      else:
        hi = mid
    msg = message(lo)
    n = len(chat_ids(tokenizer, msg)) + extra
    if n > target + extra:
      raise ValueError(f"context {target_tokens or context_len} is too short for the cwe task "
                       f"({n} tokens)")
    return Sample(task, context_len, index, msg, common, "recall", dict(prompt_tokens=n),
                  answer_prefix=pre)

  # multi-turn: 3 needles, one question per turn (RocketKV-MT scenario)
  keys = [_key(rng, used) for _ in range(3)]
  vals = [_number(rng) for _ in range(3)]
  qs = [_number_question(k) for k in keys]
  # One needle in each third of the haystack, in a random order (not the order asked).
  thirds = [float(d) for d in (np.arange(3) + rng.uniform(0.1, 0.9, size=3)) / 3]
  depths = [thirds[int(i)] for i in rng.permutation(3)]
  msg, n = hay.build(lambda h: intro + h + "\n\n" + qs[0], [_magic(k, v) for k, v in
                                                             zip(keys, vals)], depths)
  return Sample(MULTITURN_TASK, context_len, index, msg, [vals[0]], "contains",
                dict(keys=keys, depths=depths, prompt_tokens=n), questions=qs[1:],
                turn_answers=[[v] for v in vals[1:]])


def score(metric: str, prediction: str, answers: list[str], **kw) -> float:
  """Synthetic-task scores in [0, 1]: `contains` (any answer appears, case-insensitive) or
  `recall` (fraction of answers that appear); LongBench metric names dispatch to `metrics`."""
  p = prediction.lower()
  if metric == "contains":
    return float(any(a.lower() in p for a in answers))
  if metric == "recall":
    return sum(a.lower() in p for a in answers) / len(answers)
  from rocketkv_jax.eval import metrics

  return metrics.score(metric, prediction, answers, **kw)


def gold_ids(tokenizer, sample: Sample, limit: int) -> tuple[list[int], list[bool]]:
  """The gold continuation a sample is teacher-forced with, and which of its tokens are scored.

  The continuation is `" " + answers joined by ", "` right after `prompt_ids(sample)` (the
  answer prefix, where the task has one, already ends the prompt; niah_single / niah_multikey
  ask with the prefix at the end of the user message, so the assistant turn starts with the
  number). Only the answers' own tokens are scored (`mask` True), not the spaces and commas
  between them: what a KV method can lose is the needle's digits, and the separators' log-probs
  would only dilute the mean. LongBench samples are forced with their first reference answer.
  The pieces are tokenized one by one, so a token never straddles an answer and a separator.
  At most `limit` tokens (the sweep's generation length, which sizes the method's cache for
  `limit - 1` forced steps); answers that do not fit are cut.

  Returns:
    (ids, mask): equal-length lists, at least one scored token.
  """
  answers = list(sample.answers[:1] if sample.task.startswith("lb_") else sample.answers)
  ids: list[int] = []
  mask: list[bool] = []
  for i, a in enumerate(answers):
    for text, scored in (("," if i else "", False), (" ", False), (str(a).strip(), True)):
      piece = tokenizer.encode(text, add_special_tokens=False) if text else []
      ids += piece
      mask += [scored] * len(piece)
  ids, mask = ids[:limit], mask[:limit]
  if not any(mask):
    raise ValueError(f"{sample.task} sample {sample.index}: no answer token fits in "
                     f"{limit} forced tokens")
  return ids, mask

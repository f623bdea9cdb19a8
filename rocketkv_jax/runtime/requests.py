"""What a serving request asks for (`SamplingParams`), what it gets back (`Output`), and its
host-side bookkeeping (`Request`: generated ids, incremental text, stop strings).

    params = SamplingParams(max_tokens=64, temperature=0.0, stop=("\\n\\n",))
    handle = engine.add_request("Once upon a time", params)
    for out in handle:              # one `Output` per engine step that produced text
      print(out.text, end="")
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
import time
from typing import Callable, Sequence

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Per-request decoding settings (OpenAI / vLLM names).

  Attributes:
    max_tokens: >= 1 tokens to generate at most.
    temperature: 0 for greedy (argmax), else > 0.
    top_p: nucleus mass in (0, 1].
    seed: sampling seed in [0, 2**32), or None (the request's id decides).
    stop: strings that end the output (not included in it).
    ignore_eos: keep generating past the EOS token.
    min_tokens: EOS cannot be sampled before this many tokens.
  """

  max_tokens: int = 16
  temperature: float = 1.0
  top_p: float = 1.0
  seed: int | None = None
  stop: tuple[str, ...] = ()
  ignore_eos: bool = False
  min_tokens: int = 0

  def __post_init__(self):
    if isinstance(self.stop, str):
      object.__setattr__(self, "stop", (self.stop,))
    object.__setattr__(self, "stop", tuple(self.stop))
    _int("max_tokens", self.max_tokens, 1)
    _int("min_tokens", self.min_tokens, 0)
    if self.seed is not None:
      _int("seed", self.seed, 0, 2**32 - 1)
    t = self.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
      raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
    p = self.top_p
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
      raise ValueError(f"top_p must be a number in (0, 1], got {p!r}")
    if not all(isinstance(s, str) and s for s in self.stop) or len(self.stop) > 16:
      raise ValueError(f"stop must be at most 16 non-empty strings, got {self.stop!r}")
    if not isinstance(self.ignore_eos, bool):
      raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")


def _int(name: str, x, lo: int, hi: int | None = None) -> None:
  if isinstance(x, bool) or not isinstance(x, int) or x < lo or (hi is not None and x > hi):
    allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise ValueError(f"{name} must be an int {allowed}, got {x!r}")


@dataclasses.dataclass
class Output:
  """One event of a request's stream: what is new since the previous one.

  Attributes:
    request_id: the request's id.
    token_ids: the tokens generated since the last event.
    text: the text they add (held back while it may be the start of a stop string).
    finished: the last event of the request.
    finish_reason: None until finished; then "stop" (EOS or a stop string), "length"
      (max_tokens), "abort" (cancelled, or the engine shut down) or "error".
    prompt_tokens / completion_tokens: counts so far.
    arrival_time / first_token_time: `time.monotonic()` stamps (TTFT = their difference).
    error: the message when finish_reason is "error".
  """

  request_id: str
  token_ids: list[int]
  text: str
  finished: bool = False
  finish_reason: str | None = None
  prompt_tokens: int = 0
  completion_tokens: int = 0
  arrival_time: float = 0.0
  first_token_time: float | None = None
  error: str | None = None


class Request:
  """A request inside the engine: its ids, settings, generated tokens and output stream.

  `Output`s go to `on_output` when given (called on the engine's thread: keep it short, e.g.
  `loop.call_soon_threadsafe`), else to a queue read by iterating the `RequestHandle`."""

  def __init__(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
               detokenize: Callable[[list[int]], str] | None, eos_ids: Sequence[int],
               on_output: Callable[[Output], None] | None = None):
    self.id = request_id
    self.prompt_ids = list(prompt_ids)
    self.params = params
    self.eos = frozenset(int(e) for e in eos_ids)
    self._detok = detokenize
    self._on_output = on_output
    self.queue: queue.Queue[Output] = queue.Queue()
    self.generated: list[int] = []
    self.arrival_time = time.monotonic()
    self.first_token_time: float | None = None
    self.finish_reason: str | None = None
    self.aborted = threading.Event()
    self._text = ""        # text of `generated` (up to a stop string once found)
    self._cut = False      # a stop string was found: `_text` ends before it
    self._sent_text = 0    # characters of `_text` already emitted
    self._sent_tokens = 0  # tokens of `generated` already emitted
    self._replay_at = 0    # after a preemption: tokens of `generated` regenerated so far
    self._replay_end = 0   # ... of the len(generated) to regenerate before new ones count
    self.admission = -1    # the engine's count of its latest admission (preemption order)

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None

  @property
  def replaying(self) -> bool:
    """True while a preempted request regenerates tokens it has already emitted."""
    return self._replay_at < self._replay_end

  def preempt(self) -> None:
    """The engine took its slot back: it is recomputed from its prompt, and the tokens it has
    generated so far are regenerated (checked, not emitted again) before new ones count."""
    self._replay_at, self._replay_end = 0, len(self.generated)

  def add_tokens(self, tokens: Sequence[int]) -> None:
    """Takes the tokens one engine call sampled for it, stopping at EOS, max_tokens or a stop
    string (what comes after is dropped). Emits one `Output`. After a preemption the first
    tokens regenerate the ones already emitted: each must equal its earlier value (sampling is
    deterministic per request and token index), else the request ends with an error."""
    i = 0
    while self.replaying and i < len(tokens) and not self.finished:
      t, want = int(tokens[i]), self.generated[self._replay_at]
      if t != want:
        self.finish("error", f"recomputing the request after a preemption gave token {t} at "
                             f"index {self._replay_at}, not the {want} already sent")
        return
      self._replay_at += 1
      i += 1
    p = self.params
    for t in tokens[i:]:
      if self.finished:
        break
      t = int(t)
      if self.first_token_time is None:
        self.first_token_time = time.monotonic()
      if t in self.eos and not p.ignore_eos and len(self.generated) >= p.min_tokens:
        self.finish_reason = "stop"
        break
      self.generated.append(t)
      if p.stop and self._find_stop():
        self.finish_reason = "stop"
        break
      if len(self.generated) >= p.max_tokens:
        self.finish_reason = "length"
    self._emit()

  def finish(self, reason: str, error: str | None = None) -> None:
    """Ends the request (abort, error, shutdown) and emits the last `Output`."""
    if not self.finished:
      self.finish_reason = reason
      self._emit(error)

  def _find_stop(self) -> bool:
    text = self._detok(self.generated) if self._detok else ""
    hits = [i for i in (text.find(s) for s in self.params.stop) if i >= 0]
    if hits:
      self._text, self._cut = text[:min(hits)], True
    return self._cut

  def _emit(self, error: str | None = None) -> None:
    if self._detok is not None and not self._cut:
      self._text = self._detok(self.generated)
    text = self._text
    end = len(text)
    if not self.finished:
      # hold back an incomplete UTF-8 sequence and what may start a stop string
      if text.endswith("\ufffd"):
        end = len(text.rstrip("\ufffd"))
      for s in self.params.stop:
        for n in range(min(len(s) - 1, end), 0, -1):
          if text[:end].endswith(s[:n]):
            end -= n
            break
    new_text = text[self._sent_text:max(end, self._sent_text)]
    self._sent_text = max(end, self._sent_text)
    new_ids = self.generated[self._sent_tokens:]
    self._sent_tokens = len(self.generated)
    if not new_ids and not new_text and not self.finished:
      return
    out = Output(request_id=self.id, token_ids=new_ids, text=new_text, finished=self.finished,
                 finish_reason=self.finish_reason, prompt_tokens=len(self.prompt_ids),
                 completion_tokens=len(self.generated), arrival_time=self.arrival_time,
                 first_token_time=self.first_token_time, error=error)
    if self._on_output is not None:
      self._on_output(out)
    else:
      self.queue.put(out)


class RequestHandle:
  """What `Engine.add_request` returns: iterate it for the `Output`s (blocking), or call
  `result()` for the whole completion; `cancel()` aborts the request and frees its slot."""

  def __init__(self, request: Request, cancel: Callable[[str], None]):
    self._request = request
    self._cancel = cancel
    self.request_id = request.id

  def __iter__(self):
    while True:
      out = self._request.queue.get()
      yield out
      if out.finished:
        return

  def result(self) -> Output:
    """Every token and the whole text of the finished request (blocks until then)."""
    ids, text, last = [], [], None
    for out in self:
      ids += out.token_ids
      text.append(out.text)
      last = out
    return dataclasses.replace(last, token_ids=ids, text="".join(text))

  def cancel(self) -> None:
    self._cancel(self.request_id)

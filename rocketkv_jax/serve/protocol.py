"""Request validation for `/v1/completions` and `/v1/chat/completions`.

A JSON body becomes a `CompletionRequest` or an `APIError` (HTTP 4xx with OpenAI's error body).
Fields are checked by hand, one rule each, so that every error names its field:

- supported: `model`, `prompt` / `messages`, `max_tokens` (chat also `max_completion_tokens`),
  `temperature`, `top_p`, `seed`, `stop`, `n` (1 only), `ignore_eos`, `min_tokens`, `stream`,
  `stream_options` (`include_usage`, vLLM's `continuous_usage_stats`), `user`;
- known to OpenAI or vLLM but not implemented here (`logprobs`, `echo`, penalties, tools, ...):
  accepted only at their "off" value, else a 400 saying it is not supported;
- anything else: a 400 naming the field (a typo must not pass silently).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from rocketkv_jax.runtime.requests import SamplingParams


class APIError(Exception):
  """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

  def __init__(self, message: str, *, status: int = 400, param: str | None = None,
               type: str = "invalid_request_error", code: str | None = None):  # noqa: A002
    super().__init__(message)
    self.message, self.status, self.param, self.type, self.code = (
        message, status, param, type, code)

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param,
                      "code": self.code}}


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
  """A validated request. `prompt` is the text or token ids to continue (for chat: None, and
  `messages` holds the conversation); `max_tokens` None means the server's default."""

  model: str | None
  prompt: str | list[int] | None
  messages: list[dict[str, str]] | None
  max_tokens: int | None
  temperature: float
  top_p: float
  seed: int | None
  stop: tuple[str, ...]
  ignore_eos: bool
  min_tokens: int
  stream: bool
  include_usage: bool
  continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats

  def sampling_params(self, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                          top_p=self.top_p, seed=self.seed, stop=self.stop,
                          ignore_eos=self.ignore_eos, min_tokens=self.min_tokens)


# ------------------------------------------------------------------ field checks
def _bad(param: str, message: str) -> APIError:
  return APIError(f"{param} {message}", param=param)


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int(lo: int, hi: int | None = None) -> Callable[[str, Any], int | None]:
  def check(param, x):
    if x is None:
      return None
    if not _is_int(x) or x < lo or (hi is not None and x > hi):
      allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
      raise _bad(param, f"must be an integer {allowed}, got {x!r}")
    return x
  return check


def _bool(param, x):
  if x is None:
    return None
  if not isinstance(x, bool):
    raise _bad(param, f"must be a boolean, got {x!r}")
  return x


def _temperature(param, x):
  if x is None:
    return None
  if not _is_number(x) or not math.isfinite(x) or x < 0:
    raise _bad(param, f"must be a finite number >= 0, got {x!r}")
  return float(x)


def _top_p(param, x):
  if x is None:
    return None
  if not _is_number(x) or not 0.0 < x <= 1.0:  # NaN fails both comparisons
    raise _bad(param, f"must be a number in (0, 1], got {x!r}")
  return float(x)


def _stop(param, x):
  if x is None:
    return ()
  stops = [x] if isinstance(x, str) else x
  if (not isinstance(stops, list) or len(stops) > 16
      or not all(isinstance(s, str) and s for s in stops)):
    raise _bad(param, f"must be a non-empty string or a list of at most 16 of them, got {x!r}")
  return tuple(stops)


def _n(param, x):
  if x is not None and x != 1:
    raise _bad(param, f"must be 1 (one choice per request), got {x!r}")
  return None


def _stream_options(param, x):
  if x is None:
    return None
  if not isinstance(x, dict) or set(x) - {"include_usage", "continuous_usage_stats"}:
    raise _bad(param, f"must be an object with `include_usage` (a boolean), got {x!r}")
  return (bool(_bool(f"{param}.include_usage", x.get("include_usage"))),
          bool(_bool(f"{param}.continuous_usage_stats", x.get("continuous_usage_stats"))))


def _string(param, x):
  if x is not None and not isinstance(x, str):
    raise _bad(param, f"must be a string, got {x!r}")
  return x


def _ignored(param, x):
  """Accepted and without effect here (bookkeeping fields such as `user` or `metadata`)."""
  del param, x


def _off(*values) -> Callable[[str, Any], None]:
  """A feature this server does not implement: only its "off" values (and null) pass."""
  def check(param, x):
    if x is not None and not any(type(x) is type(v) and x == v for v in values):
      raise _bad(param, f"is not supported by this server (got {x!r})")
  return check


def _prompt(param, x):
  """A string or token ids; a list of one of those (a batch of one) is taken too."""
  if isinstance(x, list) and len(x) == 1 and isinstance(x[0], (str, list)):
    x = x[0]
  if isinstance(x, str):
    if not x:
      raise _bad(param, "must not be empty")
    return x
  if isinstance(x, list) and x and all(_is_int(t) for t in x):
    return x
  if isinstance(x, list) and x and all(isinstance(p, (str, list)) for p in x):
    raise _bad(param, "must be one prompt (batches of prompts are not supported)")
  raise _bad(param, f"must be a non-empty string or a list of token ids, got {x!r:.80}")


_ROLES = ("system", "developer", "user", "assistant")


def _messages(param, x):
  """[{"role", "content"}]: content a string or text parts ([{"type": "text", "text"}])."""
  if not isinstance(x, list) or not x:
    raise _bad(param, "must be a non-empty list of messages")
  out = []
  for i, m in enumerate(x):
    where = f"{param}[{i}]"
    if not isinstance(m, dict):
      raise _bad(where, f"must be an object, got {m!r:.80}")
    extra = set(m) - {"role", "content", "name"}
    if extra:
      raise _bad(where, f"has unsupported fields {sorted(extra)} (text messages only)")
    role = m.get("role")
    if role not in _ROLES:
      raise _bad(f"{where}.role", f"must be one of {list(_ROLES)}, got {role!r}")
    content = m.get("content")
    if isinstance(content, list):
      if not all(isinstance(p, dict) and p.get("type") == "text"
                 and isinstance(p.get("text"), str) and set(p) <= {"type", "text"}
                 for p in content):
        raise _bad(f"{where}.content", "must be a string or text parts ({'type': 'text', "
                   "'text': ...}); other parts are not supported")
      content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
      raise _bad(f"{where}.content", f"must be a string or a list of text parts, got "
                 f"{content!r:.80}")
    out.append({"role": role, "content": content})
  return out


# field -> check, per endpoint; a check returns the parsed value (None: not given)
_COMMON: dict[str, Callable[[str, Any], Any]] = {
    "model": _string,
    "max_tokens": _int(1),
    "temperature": _temperature,
    "top_p": _top_p,
    "seed": _int(0, 2**32 - 1),
    "stop": _stop,
    "n": _n,
    "ignore_eos": _bool,
    "min_tokens": _int(0),
    "stream": _bool,
    "stream_options": _stream_options,
    "user": _ignored,
    # vLLM's sampling extras, at their "off" values only
    "top_k": _off(-1, 0),
    "min_p": _off(0, 0.0),
    "repetition_penalty": _off(1, 1.0),
    "presence_penalty": _off(0, 0.0),
    "frequency_penalty": _off(0, 0.0),
    "logit_bias": _off({}),
    "best_of": _off(1),
    "use_beam_search": _off(False),
    "skip_special_tokens": _off(True),
}
COMPLETION_FIELDS = dict(_COMMON, prompt=_prompt, logprobs=_off(), echo=_off(False),
                         suffix=_off(""))
CHAT_FIELDS = dict(
    _COMMON, messages=_messages, max_completion_tokens=_int(1), logprobs=_off(False),
    top_logprobs=_off(0), tools=_off([]), tool_choice=_off("none"),
    parallel_tool_calls=_ignored, response_format=_off({"type": "text"}), metadata=_ignored,
    store=_off(False), service_tier=_ignored, add_generation_prompt=_off(True))


def parse(body: Any, chat: bool) -> CompletionRequest:
  """Validates a decoded JSON body; APIError (400) names the first bad field."""
  if not isinstance(body, dict):
    raise APIError("the request body must be a JSON object")
  fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
  unknown = sorted(set(body) - set(fields))
  if unknown:
    raise APIError(f"unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
  required = "messages" if chat else "prompt"
  if required not in body:
    raise APIError(f"{required} is required", param=required)
  v = {name: fields[name](name, x) for name, x in body.items()}
  max_tokens = v.get("max_completion_tokens") or v.get("max_tokens")
  min_tokens = v.get("min_tokens") or 0
  if max_tokens is not None and min_tokens > max_tokens:
    raise _bad("min_tokens", f"must be <= max_tokens ({max_tokens}), got {min_tokens}")
  if v.get("stream_options") is not None and not v.get("stream"):
    raise _bad("stream_options", "is only allowed with stream=true")
  return CompletionRequest(
      model=v.get("model"), prompt=None if chat else v["prompt"],
      messages=v["messages"] if chat else None, max_tokens=max_tokens,
      temperature=1.0 if v.get("temperature") is None else v["temperature"],
      top_p=1.0 if v.get("top_p") is None else v["top_p"], seed=v.get("seed"),
      stop=v.get("stop") or (), ignore_eos=bool(v.get("ignore_eos")), min_tokens=min_tokens,
      stream=bool(v.get("stream")),
      include_usage=bool(v.get("stream_options") and v["stream_options"][0]),
      continuous_usage=bool(v.get("stream_options") and v["stream_options"][1]))

"""OpenAI's response bodies: whole completions, streamed chunks and the usage block.

Completions are `text_completion` objects (`choices[0].text`); chat completions are
`chat.completion` objects (`choices[0].message`), and their chunks carry a `delta`. A streamed
response is server-sent events, `data: <chunk>` each, ending with `data: [DONE]`.
"""

from __future__ import annotations

import json


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
          "total_tokens": prompt_tokens + completion_tokens}


def completion(rid: str, created: int, model: str, chat: bool, text: str,
               finish_reason: str | None, use: dict) -> dict:
  """A whole (non-streamed) response."""
  if chat:
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": None, "finish_reason": finish_reason}
  else:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
  return {"id": rid, "object": "chat.completion" if chat else "text_completion",
          "created": created, "model": model, "choices": [choice], "usage": use}


def chunk(rid: str, created: int, model: str, chat: bool, *, text: str | None = None,
          role: bool = False, finish_reason: str | None = None, use: dict | None = None,
          with_usage: bool = False, usage_now: dict | None = None) -> dict:
  """One streamed chunk: a text delta (`text`), the chat's opening role delta (`role`), the
  finish reason, or (`use` without choices) the usage chunk that `include_usage` adds last.
  `with_usage`: every chunk carries `"usage": null` until that last one (OpenAI's shape);
  `usage_now`: the counts so far in this chunk instead (vLLM's continuous_usage_stats)."""
  if use is not None:
    choices = []
  elif chat:
    delta = {}
    if role:
      delta["role"] = "assistant"
    if text is not None or role:
      delta["content"] = text or ""
    choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
  else:
    choices = [{"index": 0, "text": text or "", "logprobs": None,
                "finish_reason": finish_reason}]
  out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
         "created": created, "model": model, "choices": choices}
  if with_usage or use is not None or usage_now is not None:
    out["usage"] = use if use is not None else usage_now
  return out


def sse(data: dict | str) -> str:
  """One server-sent event."""
  return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


DONE = sse("[DONE]")

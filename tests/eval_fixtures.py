"""Helpers for the evaluation tests: a byte-level tokenizer with a tiny chat template, and the
tiny random Llama checkpoint of `model_fixtures` wrapped with it."""

from __future__ import annotations

import functools


class ByteTokenizer:
  """ids = UTF-8 bytes (0..2 mapped to 3; 2 is EOS). Template: <u>..</u><a>..</a>."""

  eos_token_ids = (2,)
  bos_token_id = None

  def encode(self, text, add_special_tokens=True):
    return [max(b, 3) for b in text.encode("utf-8")]

  def decode(self, ids, skip_special_tokens=True):
    return bytes(int(i) for i in ids if int(i) not in self.eos_token_ids).decode(
        "utf-8", errors="replace")

  def apply_chat_template(self, messages, add_generation_prompt=True):
    out = ""
    for m in messages:
      tag = "u" if m["role"] == "user" else "a"
      out += f"<{tag}>{m['content']}</{tag}>"
    return out + ("<a>" if add_generation_prompt else "")


@functools.lru_cache(maxsize=None)
def tiny_model(context: int = 2048):
  """The tiny llama31 checkpoint (random weights) with a byte tokenizer and a 2K context
  (byte-level prompts are long; the llama3 RoPE does not depend on this limit)."""
  import dataclasses

  import rocketkv_jax.models as M
  from model_fixtures import hf_checkpoint

  path, _ = hf_checkpoint("llama31")
  model = M.load(path)
  model.config = dataclasses.replace(model.config, max_position_embeddings=context)
  model.tokenizer = ByteTokenizer()
  return model

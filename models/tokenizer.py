"""Tokenizers: a Hugging Face `tokenizer.json`, or one rebuilt from a GGUF file's vocabulary.

`Tokenizer` wraps a `tokenizers.Tokenizer` and adds what generation needs: BOS handling, EOS
ids, special-token skipping on decode, and the Jinja chat template.

GGUF byte-level BPE ("gpt2" model): the vocabulary and merges come from
`tokenizer.ggml.tokens` / `tokenizer.ggml.merges`; control tokens (type 3) become special added
tokens, user-defined ones (type 4) plain added tokens. The pre-tokenizer follows llama.cpp's
`tokenizer.ggml.pre`: "smollm" splits every digit on its own before the GPT-2 regex (as the
original SmolLM2 `tokenizer.json` does: `Digits(individual_digits=True)` + `ByteLevel`);
Llama-3 style names use the Llama-3 split regex; "qwen2" (Qwen 2 / 2.5 / 3) the same regex with
digits split one by one, after NFC normalisation (as Qwen's `tokenizer.json`); anything else
uses the GPT-2 regex.

GGUF SentencePiece BPE ("llama" model without a space prefix: Gemma 3): spaces are written "▁",
unknown bytes fall back to `<0xNN>` tokens, and, the file having no merges, each token of the
vocabulary becomes the merges of its two-piece splits, ranked by the token's position in the
file (what Gemma's vocabulary order means; its scores are not merge ranks), a longer left
piece first among splits of one token -- the tokenization transformers' GGUF loader gives.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3")


class Tokenizer:
  """Text <-> ids, plus chat templating.

  Attributes:
    backend: the `tokenizers.Tokenizer`.
    bos_token_id, eos_token_ids: special ids (eos_token_ids may be empty).
    add_bos: prepend BOS in `encode` (when the backend's post-processor does not already).
    chat_template: Jinja template string or None.
  """

  def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None = None,
               eos_token_ids: Sequence[int] = (), add_bos: bool = False,
               chat_template: str | None = None, bos_token: str | None = None,
               eos_token: str | None = None):
    self.backend = backend
    self.bos_token_id = bos_token_id
    self.eos_token_ids = tuple(eos_token_ids)
    self.add_bos = add_bos
    self.chat_template = chat_template
    self.bos_token = bos_token
    self.eos_token = eos_token

  @property
  def vocab_size(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
    if (add_special_tokens and self.add_bos and self.bos_token_id is not None
        and (not ids or ids[0] != self.bos_token_id)):
      ids = [self.bos_token_id] + ids
    return ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    """Renders `messages` ([{"role", "content"}]) with the model's template (sandboxed Jinja)."""
    if not self.chat_template:
      raise ValueError("this tokenizer has no chat template; use a plain prompt (chat=False)")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(msg):
      raise ValueError(msg)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(self.chat_template).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=self.bos_token or "", eos_token=self.eos_token or "")

  # ------------------------------------------------------------------ constructors
  @classmethod
  def from_hf_dir(cls, path: str) -> "Tokenizer | None":
    """From `tokenizer.json` (+ `tokenizer_config.json`); None when the directory has none."""
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tj):
      return None
    backend = tokenizers.Tokenizer.from_file(tj)
    conf: dict[str, Any] = {}
    cj = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cj):
      with open(cj) as f:
        conf = json.load(f)

    def tok_str(x):
      return x.get("content") if isinstance(x, dict) else x

    bos, eos = tok_str(conf.get("bos_token")), tok_str(conf.get("eos_token"))
    template = conf.get("chat_template")
    tpl_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(tpl_file):
      with open(tpl_file) as f:
        template = f.read()
    bos_id = backend.token_to_id(bos) if bos else None
    eos_id = backend.token_to_id(eos) if eos else None
    return cls(backend, bos_token_id=bos_id, eos_token_ids=() if eos_id is None else (eos_id,),
               add_bos=bool(conf.get("add_bos_token", False)), chat_template=template,
               bos_token=bos, eos_token=eos)

  @classmethod
  def from_gguf_fields(cls, fields: dict[str, Any]) -> "Tokenizer":
    """From decoded `tokenizer.*` GGUF metadata (see `gguf_loader.read_metadata`)."""
    model = fields.get("tokenizer.ggml.model")
    spm = model == "llama" and not fields.get("tokenizer.ggml.add_space_prefix", True)
    if model != "gpt2" and not spm:
      raise ValueError(
          f"GGUF tokenizer model {model!r} is not supported; allowed: ('gpt2',) (byte-level BPE) "
          "and 'llama' without a space prefix (Gemma's SentencePiece BPE)")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if spm:
      backend = _sentencepiece_bpe(tokens)
    else:
      backend = _byte_level_bpe(fields, tokens)
    special = [tokenizers.AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == 3]
    # a user-defined token the vocabulary spells otherwise (Gemma's runs of spaces) stays out
    vocab = backend.get_vocab()
    user = [tokenizers.AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == 4 and t in vocab]
    backend.add_special_tokens(special)
    if user:
      backend.add_tokens(user)
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    eos_id = fields.get("tokenizer.ggml.eos_token_id")
    eos_ids = [] if eos_id is None else [eos_id]
    eot = fields.get("tokenizer.ggml.eot_token_id")
    if eot is not None and eot not in eos_ids:
      eos_ids.append(eot)
    return cls(backend, bos_token_id=bos_id, eos_token_ids=eos_ids,
               add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
               chat_template=fields.get("tokenizer.chat_template"),
               bos_token=tokens[bos_id] if bos_id is not None else None,
               eos_token=tokens[eos_id] if eos_id is not None else None)


def _sentencepiece_bpe(tokens: list[str]) -> tokenizers.Tokenizer:
  """Gemma's SentencePiece BPE from its GGUF vocabulary (module docstring)."""
  # a token of spaces only is stored with real spaces; the model sees them as "▁"
  tokens = ["\u2581" * len(t) if t and not t.strip(" ") else t for t in tokens]
  vocab = {t: i for i, t in enumerate(tokens)}  # a respelled duplicate: its last position
  merges = []  # ranked by their token's position in the file
  for t in sorted(vocab, key=vocab.get):
    for cut in range(len(t) - 1, 0, -1):  # longer left piece first
      if t[:cut] in vocab and t[cut:] in vocab:
        merges.append((t[:cut], t[cut:]))
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True,
                                            unk_token=tokens[3] if len(tokens) > 3 else None,
                                            byte_fallback=True))
  backend.normalizer = tokenizers.normalizers.Replace(" ", "\u2581")
  backend.decoder = decoders.Sequence(
      [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
  return backend


def _byte_level_bpe(fields: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
  """Byte-level BPE (GGUF "gpt2") with llama.cpp's pre-tokenizer (module docstring)."""
  merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
  vocab = {t: i for i, t in enumerate(tokens)}
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  pre = fields.get("tokenizer.ggml.pre", "default")
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
  elif pre in _LLAMA3_PRE or pre == "qwen2":
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(_QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT),
                             behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "qwen2":
      backend.normalizer = tokenizers.normalizers.NFC()
  else:
    backend.pre_tokenizer = byte_level
  backend.decoder = decoders.ByteLevel()
  backend.post_processor = processors.ByteLevel(trim_offsets=False)
  return backend

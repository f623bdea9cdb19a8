"""An lm-evaluation-harness backend, registered as "rocketkv", and its command line.

    pip install -e ".[lm-eval]"
    python -m rocketkv_jax.eval.lm_eval --model_args method=rocketkv,token_budget=256 \\
        --tasks my_task --include_path my_tasks/          # forwards to lm-eval's CLI
    python -m rocketkv_jax.eval.lm_eval export --tasks niah_single --lengths 1024 --samples 4 \\
        --out my_tasks/                                   # our synthetic tasks as lm-eval tasks

From Python: `import rocketkv_jax.eval.lm_eval` registers the model; then
`lm_eval.simple_evaluate(model="rocketkv", model_args="method=rocketkv,...", tasks=[...])`, or
pass an instance: `simple_evaluate(model=RocketKVLM(pretrained=model), ...)`.

model_args (lm-eval's `key=value,...`): `pretrained` (an HF directory, a .gguf or a loaded
`rocketkv.models.Model`; default the embedded SmolLM2), `method` (or `recommended`),
`token_budget`, any `RocketConfig` field by name, `dtype`, `batch_size`, `max_length`, `chat`,
`pad_multiple`, `pad_to`, `seed`, `impl`: each explained in docs/evaluation.md.

Requests: generate_until through `rocketkv.generate`; loglikelihood through
`rocketkv.score_continuations` (the continuation teacher-forced through the method's own decode
steps); loglikelihood_rolling with method="full" only. Details:
docs/evaluation.md#lm-evaluation-harness.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import types
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

try:
  from lm_eval.api.model import TemplateLM
  from lm_eval.api.registry import register_model
  from lm_eval import utils as lm_utils
except ModuleNotFoundError as e:  # the optional extra is missing: one line, not a traceback
  if not (e.name or "").startswith("lm_eval"):
    raise
  _MSG = 'rocketkv_jax.eval.lm_eval needs lm-eval: pip install -e ".[lm-eval]"'
  if __name__ == "__main__":
    print(f"error: {_MSG}", file=sys.stderr)
    sys.exit(2)
  raise ImportError(_MSG) from None

import rocketkv_jax as rocketkv
from rocketkv_jax import methods
from rocketkv_jax.runtime import sampling
from rocketkv_jax.methods import stage2 as stage2_lib
from rocketkv_jax.models import llama

logger = logging.getLogger(__name__)

# The backend's own model_args (besides RocketConfig's fields) and their defaults.
_OWN_ARGS = dict(pretrained=None, dtype="float32", batch_size=1, max_length=None, chat=False,
                 pad_multiple=64, pad_to=None, seed=0, impl="auto")
# Passed by lm-eval itself (simple_evaluate / CLI); accepted and ignored.
_IGNORED_ARGS = ("device", "max_batch_size")
_GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k", "seed")


def rocket_config_fields() -> dict[str, Any]:
  """{name: resolved type} of every `RocketConfig` field (read from the dataclass)."""
  hints = typing.get_type_hints(rocketkv.RocketConfig)
  return {f.name: hints.get(f.name, str) for f in dataclasses.fields(rocketkv.RocketConfig)}


def _coerce(name: str, value: Any, typ) -> Any:
  """Converts a model_args value (already typed by lm-eval's parser, or a string) to `typ`."""
  if typing.get_origin(typ) is typing.Literal:
    for choice in typing.get_args(typ):
      if value == choice or str(value) == str(choice):
        return choice
    raise ValueError(f"{name} must be one of {typing.get_args(typ)}, got {value!r}")
  args = typing.get_args(typ)
  optional = type(None) in args
  if args:
    bases = [a for a in args if a is not type(None)]
  else:
    bases = [typ]
  if value is None or (optional and isinstance(value, str) and value.lower() == "none"):
    if optional:
      return None
    raise ValueError(f"{name} must not be None")
  for base in bases:
    try:
      if base is bool:
        if isinstance(value, bool):
          return value
        if str(value).lower() in ("true", "false", "1", "0"):
          return str(value).lower() in ("true", "1")
        continue
      if base is int:
        if isinstance(value, bool):
          continue
        if isinstance(value, float) and not value.is_integer():
          continue
        return int(value)
      if base is float:
        return float(value)
      if base is str:
        return str(value)
      return base(value)
    except (TypeError, ValueError):
      continue
  raise ValueError(f"{name} must be of type {typ}, got {value!r}")


def _as_bool(name: str, value: Any) -> bool:
  return _coerce(name, value, bool)


class RocketKVLM(TemplateLM):
  """lm-eval model over `rocketkv.generate` / `rocketkv.score_continuations` (see the module
  docstring for the arguments and the request semantics)."""

  def __init__(self, pretrained=None, method: str = "rocketkv", token_budget: int = 256,
               **kwargs):
    super().__init__()
    fields = rocket_config_fields()
    s2_keys = stage2_lib.spec_keys()  # a variant's own fields: quant_bits=2 -> Quant(bits=2)
    own = dict(_OWN_ARGS)
    rocket, variant = {}, {}
    unknown = []
    for name, value in kwargs.items():
      if name in _IGNORED_ARGS:
        continue
      if name in own:
        own[name] = value
      elif name in fields and name not in ("method", "token_budget"):
        rocket[name] = _coerce(name, value, fields[name])
      elif name in s2_keys:
        cls, field = s2_keys[name]
        variant[name] = _coerce(name, value, typing.get_type_hints(cls)[field])
      else:
        unknown.append(name)
    if unknown:
      valid = sorted(set(_OWN_ARGS) | set(fields) | set(s2_keys))
      raise ValueError(f"unknown model_args {sorted(unknown)}; valid: {', '.join(valid)}")
    # method=recommended: `RocketConfig.recommended`'s fields, under the ones given
    preset = dict(rocketkv.RECOMMENDED) if method == "recommended" else {"method": method}
    method = preset.pop("method")
    if method not in rocketkv.METHODS:
      raise ValueError(f"method must be one of {tuple(rocketkv.METHODS) + ('recommended',)}, "
                       f"got {method!r}")
    if variant:
      base = stage2_lib.get(rocket.get("stage2", preset.get("stage2", "minmax")))
      built = stage2_lib.from_spec(base.name, variant)  # checks the keys belong to it
      rocket["stage2"] = dataclasses.replace(
          base, **{f: getattr(built, f) for f in (s2_keys[k][1] for k in variant)})
    self.method = method
    self.token_budget = _coerce("token_budget", token_budget, int)
    self.rocket_config = rocketkv.RocketConfig(token_budget=self.token_budget, method=method,
                                               **{**preset, **rocket})

    if isinstance(pretrained, rocketkv.models.Model):
      self.model = pretrained
    else:
      import rocketkv_jax.models as models

      dtype = str(own["dtype"]).replace("torch.", "")
      if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be one of ('float32', 'bfloat16'), got {own['dtype']!r}")
      path = pretrained or models.smollm2_path()
      self.model = models.load(path, dtype=jnp.dtype(dtype))
    if self.model.tokenizer is None:
      raise ValueError("pretrained must come with a tokenizer (tokenizer.json or a GGUF)")
    self.tokenizer = self.model.tokenizer

    bs = own["batch_size"]
    if isinstance(bs, str) and bs.startswith("auto"):
      bs = 1
    self.batch_size = _coerce("batch_size", bs, int)
    self.pad_multiple = _coerce("pad_multiple", own["pad_multiple"], int)
    self.seed = _coerce("seed", own["seed"], int)
    self.pad_to = _coerce("pad_to", own["pad_to"], int | None)
    if self.pad_to is not None and self.pad_to < 1:
      raise ValueError(f"pad_to must be None or an int >= 1, got {self.pad_to!r}")
    for name, val in (("batch_size", self.batch_size), ("pad_multiple", self.pad_multiple)):
      if val < 1:
        raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    context = self.model.config.max_position_embeddings
    self._max_length = (context if own["max_length"] is None
                        else _coerce("max_length", own["max_length"], int))
    if not 2 <= self._max_length <= context:
      raise ValueError(f"max_length must be in [2, {context}], got {self._max_length}")
    self.chat = _as_bool("chat", own["chat"])
    self.impl = own["impl"]

  # ------------------------------------------------------------------ lm-eval construction
  @classmethod
  def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
    """model_args win over lm-eval's own arguments (e.g. the CLI's default --batch_size 1)."""
    args = lm_utils.simple_parse_args_string(arg_string)
    return cls.create_from_arg_obj(args, additional_config)

  @classmethod
  def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
    merged = {k: v for k, v in (additional_config or {}).items() if v is not None}
    merged.update(arg_dict)
    return cls(**merged)

  # ------------------------------------------------------------------ tokenizer / chat
  @property
  def eot_token_id(self) -> int:
    eos = self.tokenizer.eos_token_ids or self.model.config.eos_token_ids
    return int(eos[0])

  @property
  def prefix_token_id(self) -> int:
    bos = getattr(self.tokenizer, "bos_token_id", None)
    return int(bos) if bos is not None else self.eot_token_id

  @property
  def max_length(self) -> int:
    return self._max_length

  @property
  def max_gen_toks(self) -> int:
    return 256

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs):
    if add_special_tokens is None:
      return self.tokenizer.encode(string)
    return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

  def tok_decode(self, tokens) -> str:
    return self.tokenizer.decode(tokens)

  @property
  def tokenizer_name(self) -> str:
    src = self.model.source or "rocketkv-model"
    return os.path.basename(os.path.normpath(str(src))).replace("/", "__")

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    if chat_template is False or chat_template is None:
      return None
    return getattr(self.tokenizer, "chat_template", None) or ""

  def apply_chat_template(self, chat_history: list[dict[str, str]],
                          add_generation_prompt: bool = True) -> str:
    """The model's chat template over `chat_history`. With add_generation_prompt=False and an
    assistant message last (lm-eval's gen_prefix), the text ends right after that message's
    content, so the model continues it (transformers' `continue_final_message`)."""
    text = self.tokenizer.apply_chat_template(chat_history,
                                              add_generation_prompt=add_generation_prompt)
    if not add_generation_prompt and chat_history and chat_history[-1]["role"] == "assistant":
      final = chat_history[-1]["content"]
      cut = text.rfind(final) if final else -1
      if cut < 0:
        raise ValueError("the chat template does not render the final assistant message as is; "
                         "cannot continue it (gen_prefix)")
      text = text[:cut + len(final)]
    return text

  def _context(self, context: str) -> str:
    if not self.chat:
      return context
    return self.tokenizer.apply_chat_template([{"role": "user", "content": context}])

  def _context_ids(self, context: str) -> list[int]:
    """Prompt ids of a generation request, as `rocketkv.generate` encodes a string prompt."""
    if self.chat:
      return self.tok_encode(self._context(context), add_special_tokens=False)
    return self.tok_encode(context)

  # ------------------------------------------------------------------ loglikelihood
  def loglikelihood(self, requests, disable_tqdm: bool = False):
    if self.chat:  # templated copies; lm-eval's instances are left as they are
      requests = [types.SimpleNamespace(args=(self._context(r.args[0]), r.args[1]))
                  for r in requests]
    return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
    ctxs, conts = [], []
    for _, ctx, cont in requests:
      # keep the last max_length + 1 tokens: max_length positions are fed
      whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
      cont = list(cont)[-self.max_length:]
      ctxs.append(whole[:len(whole) - len(cont)])
      conts.append(cont)
    out: list = [None] * len(requests)
    order = sorted(range(len(requests)), key=lambda i: -(len(ctxs[i]) + len(conts[i])))
    chunk = self.batch_size * 8  # a progress update every few batches
    bar = tqdm(total=len(requests), desc="rocketkv loglikelihood", disable=disable_tqdm)
    for start in range(0, len(order), chunk):
      idx = order[start:start + chunk]
      scores = rocketkv.score_continuations(
          self.model, [ctxs[i] for i in idx], [conts[i] for i in idx],
          rocket_config=self.rocket_config, batch_size=self.batch_size,
          pad_multiple=self.pad_multiple, impl=self.impl)
      for i, total, greedy in zip(idx, scores.totals, scores.greedy):
        out[i] = (total, greedy)
        if requests[i][0] is not None:
          self.cache_hook.add_partial("loglikelihood", requests[i][0], (total, greedy))
      bar.update(len(idx))
    bar.close()
    return out

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    if methods.get(self.method).uses_budget:  # only an uncompressed method ('full') qualifies
      raise ValueError(f"loglikelihood_rolling needs method='full', got {self.method!r} "
                       "(a compressed cache is built from a prompt; rolling perplexity has none)")
    windows, owner = [], []
    for r, req in enumerate(requests):
      (string,) = req.args
      for ctx, cont in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1)):
        windows.append((ctx, cont))
        owner.append(r)
    totals = np.zeros(len(requests), np.float64)
    for start in tqdm(range(0, len(windows), self.batch_size), desc="rocketkv rolling",
                      disable=disable_tqdm):
      batch = windows[start:start + self.batch_size]
      for j, lp in enumerate(self._full_logprobs(batch)):
        totals[owner[start + j]] += float(np.sum(lp, dtype=np.float64))
    out = [float(t) for t in totals]
    for req, t in zip(requests, out):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, t)
    return out

  def _full_logprobs(self, pairs) -> list[np.ndarray]:
    """Full-attention log-probs of each (context, continuation) pair's continuation."""
    seqs = [list(c) + list(f) for c, f in pairs]
    length = max(len(s) for s in seqs) - 1
    length = -(-length // self.pad_multiple) * self.pad_multiple
    length = min(length, self.model.config.max_position_embeddings)
    tokens = np.zeros((len(seqs), length), np.int32)
    targets = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
      tokens[i, :len(s) - 1] = s[:-1]
      targets[i, :len(s) - 1] = s[1:]
    lp = np.asarray(_target_logprobs(self.model.params, jnp.asarray(tokens), jnp.asarray(targets),
                                     config=self.model.config))
    return [lp[i, len(c) - 1:len(c) - 1 + len(f)] for i, (c, f) in enumerate(pairs)]

  # ------------------------------------------------------------------ generation
  def generate_until(self, requests, disable_tqdm: bool = False):
    groups: dict = {}
    settings = []
    for i, req in enumerate(requests):
      ctx, gen_kwargs = req.args
      s = self._gen_settings(gen_kwargs)
      settings.append(s)
      groups.setdefault(s["key"], []).append(i)
    out: list = [None] * len(requests)
    bar = tqdm(total=len(requests), desc="rocketkv generate_until", disable=disable_tqdm)
    batch_no = 0
    for idx in groups.values():
      s = settings[idx[0]]
      max_new = s["max_gen_toks"]
      keep = self.max_length - max_new
      if keep < 1:
        raise ValueError(f"max_gen_toks={max_new} leaves no room for a context within "
                         f"max_length={self.max_length}")
      ids = {i: self._context_ids(requests[i].args[0])[-keep:] for i in idx}
      idx = sorted(idx, key=lambda i: -len(ids[i]))
      for start in range(0, len(idx), self.batch_size):
        rows = idx[start:start + self.batch_size]
        res = rocketkv.generate(
            self.model, [ids[i] for i in rows], rocket_config=self.rocket_config,
            max_new_tokens=max_new, sampler=s["sampler"],
            seed=s["seed"] + batch_no, impl=self.impl, pad_to=self.pad_to)
        batch_no += 1
        for i, text in zip(rows, res.text):
          text = cut_at_stop(text, settings[i]["until"])
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
        bar.update(len(rows))
    bar.close()
    return out

  def _gen_settings(self, gen_kwargs: dict) -> dict:
    kw = dict(gen_kwargs or {})
    until = kw.get("until") or []
    if isinstance(until, str):
      until = [until]
    max_new = kw.get("max_gen_toks", kw.get("max_new_tokens", self.max_gen_toks))
    do_sample = _as_bool("do_sample", kw.get("do_sample", False))
    temperature = float(kw.get("temperature", 0.0) or 0.0)
    if do_sample and temperature == 0.0:
      temperature = 1.0
    if not do_sample:
      temperature = 0.0
    top_p = float(kw.get("top_p", 1.0) or 1.0)
    top_k = int(kw.get("top_k", 0) or 0) if temperature else 0
    if top_k < 0 or (top_k and top_p < 1.0):
      raise ValueError(f"generation kwargs: top_k must be >= 0 and goes without top_p < 1, got "
                       f"top_k={top_k}, top_p={top_p}")
    seed = int(kw.get("seed", self.seed))
    ignored = sorted(set(kw) - set(_GEN_KWARGS) - {"max_new_tokens"})
    if ignored:
      logger.warning("rocketkv: generation kwargs %s are ignored", ignored)
    key = (int(max_new), temperature, top_p if temperature else 1.0, top_k, seed)
    return dict(until=list(until), max_gen_toks=int(max_new),
                sampler=sampling.sampler(temperature, top_p, top_k), seed=seed, key=key)


def cut_at_stop(text: str, until) -> str:
  """`text` up to the first occurrence of any stop string (empty strings ignored)."""
  cut = len(text)
  for stop in until or ():
    if stop:
      pos = text.find(stop)
      if 0 <= pos < cut:
        cut = pos
  return text[:cut]


@functools.partial(jax.jit, static_argnames=("config",))
def _target_logprobs(params, tokens, targets, *, config):
  """Full-attention log p(targets[b, t] | tokens[b, :t+1]): `[B, T]` fp32."""
  logits = llama.forward(params, tokens, config=config)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


# --------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> int:
  """`export ...` writes lm-eval tasks; anything else is lm-eval's CLI with --model rocketkv."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] == "export":
    from rocketkv_jax.eval import lm_eval_export

    return lm_eval_export.main(argv[1:])
  sub = argv[:1] if argv and argv[0] in ("run", "ls", "validate") else []
  rest = argv[len(sub):]
  if sub in ([], ["run"]) and rest and "--model" not in rest and not any(
      a.startswith("--model=") for a in rest):
    rest = ["--model", "rocketkv"] + rest
  argv = sub + rest
  from lm_eval.__main__ import cli_evaluate

  old = sys.argv
  sys.argv = ["lm-eval"] + argv
  try:
    cli_evaluate()
  except ValueError as e:  # bad model_args / task names: one line, no traceback
    print(f"error: {e}", file=sys.stderr)
    return 2
  finally:
    sys.argv = old
  return 0


if __name__ == "__main__":
  # Run the canonical module (registered once) rather than this __main__ copy.
  from rocketkv_jax.eval.lm_eval import main as _main

  sys.exit(_main())
else:
  register_model("rocketkv")(RocketKVLM)

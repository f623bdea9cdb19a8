"""`rocketkv.Conversation`: multi-turn generation that keeps each conversation's KV state.

    conv = rocketkv.Conversation(model, method="rocketkv_mt", token_budget=256, chat=True)
    r1 = conv.send([document + "\\n\\nWhat is the pass key?"])   # a GenerationResult
    r2 = conv.send(["And the magic number for alpha?"])         # the same conversations

The first `send` is `rocketkv.generate` (the same programs, the same tokens) that keeps the
final KV state. Every later `send` runs one program over that state (`turn_program`: the
turn's prompt attends densely to each layer's cache, as `models.llama.turn_prefill`, and is
added to it) and then `generate`'s decode program. RocketKV-MT (`method="rocketkv_mt"`) keeps
the full cache and re-runs stage 1 on it with each turn's window queries (`rocketkv.begin_turn`),
so a token evicted for one question can come back for the next; every other method keeps what
it kept and appends the turn (`rocketkv` evicts once, the paper's multi-turn baseline).

Decisions where the paper is silent:
  * Between turns a row's cache holds every token of its conversation: the prompts and its
    answers, without the EOS that ended an answer and without the tokens a finished row kept
    stepping with while the batch finished (trimmed: the cache's last slots). An answer's last
    token, when the loop stopped before feeding it back (`max_new_tokens`), opens the next
    turn's tokens.
  * `chat=True`: a later message is added as the chat template continues a conversation after
    an assistant answer (end-of-turn, the user turn, the generation prompt: `turn_text`);
    `chat=False`: its text as is (no BOS); token ids: as given.
  * Each turn is planned for its context (the longest row's tokens so far plus this turn's
    padded prompt) and `max_new_tokens`, so the budget split follows the conversation's growth.
    The plan is static: a turn compiles its two programs once (never per step), and a later
    conversation of the same shapes reuses them. Turn prompts are padded to a multiple of
    `turn_pad` tokens.
  * A hybrid's sliding layers (Gemma 3) keep their window: `llama.window_extend`.
  * Methods: every registered method whose state can take a turn (`Method.takes_turns`; the
    `exact_topp` oracle's per-decode counters cannot).
  * A model on a mesh runs as `generate` does: the batch over "dp" (padded to a multiple of it
    with copies of the last conversation, whose answers are dropped), KV heads over "tp",
    several processes calling `send` with the same messages (SPMD).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax import methods
from rocketkv_jax.runtime import decode_loop
from rocketkv_jax.cache import KVCache, extend, grow
from rocketkv_jax.config import RocketConfig, check_num_layers
from rocketkv_jax.config import plan as make_plan
from rocketkv_jax.runtime.generate import (PROGRAMS, GenerationResult, ProgramCache, _decode,
                                           _host_out, _kv_stats, _pad_rows, _peak_bytes, _place,
                                           _prepare, _Progress, _prompt_list, _run, _stats,
                                           check_args, token_ids)
from rocketkv_jax.models import llama
from rocketkv_jax.models.api import as_model
from rocketkv_jax.models.precision import compute_params
from rocketkv_jax.multiturn import begin_turn


def turn_text(tokenizer, message: str) -> str:
  """The text the chat template puts between the end of an assistant answer and the next
  answer: end-of-turn, `message` as a user turn, the generation prompt. ValueError if the
  template does not extend a conversation by appending."""
  mark = "ZQZQANSWERZQZQ"
  user = {"role": "user", "content": "U"}
  prev = tokenizer.apply_chat_template([user, {"role": "assistant", "content": mark}],
                                       add_generation_prompt=False)
  full = tokenizer.apply_chat_template(
      [user, {"role": "assistant", "content": mark}, {"role": "user", "content": message}],
      add_generation_prompt=True)
  end = prev[prev.index(mark) + len(mark):]
  if not full.startswith(prev):
    raise ValueError("the chat template does not extend a conversation by appending")
  return end + full[len(prev):]


def _trimmed(cache: KVCache, trim: jax.Array) -> KVCache:
  """The cache without its last `trim[b]` tokens (slots; a decode appends in order)."""
  return cache.replace(length=cache.length - trim, seen=cache.seen - trim)


def turn_states(params, states, tokens, turn_lengths, trim, *, config, plan, max_new_tokens,
                impl="auto"):
  """A later turn's prompt added to per-layer decode states (pure; jit with the keywords static).

  Args:
    params: the model's parameters.
    states: per layer, the decode state the turn before left (a tuple, as `llama.prefill`
      makes it, or `llama.unstack_cache` of a `LayerStack`).
    tokens: `[B, T]` int32 the turn's right-padded ids; turn_lengths `[B]` valid ones.
    trim: `[B]` int32 tokens to drop from the end of every cache first (fed after an EOS).
    plan: this turn's plan; `max_new_tokens` the room its decode needs.
  Returns:
    (fp32 logits `[B, V]` at the turn's last token, the new per-layer states (a tuple), the
    position of the next token `[B]`, kept tokens per layer and row `[N, B]`).
  """
  method = methods.get(plan.method)
  dense = set(method.dense_layers(plan))
  sliding = config.window_layers
  trimmed, reads = [], []
  for i, st in enumerate(states):
    if i in sliding or not method.keeps_full_cache:
      st = _trimmed(st if i in sliding else method.view(st), trim)
      reads.append(st)
    else:  # RocketKV-MT: the full cache (its view is rebuilt by begin_turn)
      st = st.replace(full=_trimmed(st.full, trim))
      reads.append(st.full)
    trimmed.append(st)
  _, ks, vs, qws, logits = llama.turn_prefill(compute_params(params), reads, tokens,
                                              turn_lengths, config=config,
                                              window=plan.window_size, return_logits=True)
  t = tokens.shape[1]
  new = []
  for i, st in enumerate(trimmed):
    k, v = ks[i].astype(reads[i].dtype), vs[i].astype(reads[i].dtype)
    if i in sliding:
      new.append(llama.window_extend(st, k, v, turn_lengths, config.sliding_window,
                                     max_new_tokens))
    elif method.keeps_full_cache:
      new.append(begin_turn(st, k, v, qws[i], plan, turn_lengths=turn_lengths, impl=impl))
    else:  # what it kept, grown, the turn appended, its stage-2 state rebuilt over it
      c = grow(st, max(plan.capacity, st.capacity + t + max_new_tokens),
               st.chunk_size if i in dense else plan.chunk_size)
      c = extend(c, k, v, turn_lengths)
      new.append(c if i in dense else plan.stage2.prefill(c, plan))
  view = llama.state_view(plan, config)
  kept = jnp.stack([view(s).length for s in new])
  return logits, tuple(new), reads[0].seen + turn_lengths, kept


def turn_program(params, stack, tokens, turn_lengths, trim, key, sampler, *, config, plan,
                 max_new_tokens, impl, out_sharding=None):
  """`Conversation`'s turn (jit with the keywords static; the state is not donated: the new
  one has other shapes, its capacity grown for the turn): `turn_states` over the previous
  decode's final `llama.LayerStack`, and the turn's first token sampled with
  `fold_in(key, 0)`. Returns (first token `[B]`, the new `LayerStack` for `plan`, its position
  `[B]`, kept tokens per layer and row `[N, B]`; the last two replicated on `out_sharding`'s
  mesh, for the host)."""
  logits, states, seen, kept = turn_states(
      params, llama.unstack_cache(stack), tokens, turn_lengths, trim, config=config, plan=plan,
      max_new_tokens=max_new_tokens, impl=impl)
  first = sampler(logits, jax.random.fold_in(key, 0))
  return (first, llama.stack_cache(states, plan, config.window_layers),
          _host_out(seen, out_sharding), _host_out(kept, out_sharding))


class Conversation:
  """A batch of conversations decoded turn by turn with one KV method.

  Every argument is `rocketkv.generate`'s, fixed for the whole conversation, plus `turn_pad`
  (later turns' prompts are padded to a multiple of it). `send` takes one message per
  conversation (the first fixes the batch) and returns a `GenerationResult` with `generate`'s
  stats, plus `turn` and `context_lengths` (each row's tokens before this turn's answer); a
  later turn's `prompt_lengths` (also `turn_tokens`) count its tokens: the message, after the
  previous answer's last token when that one was never fed back (`max_new_tokens`).
  """

  def __init__(self, model, *, method: str = "rocketkv", token_budget: int = 256,
               max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               sampler: Callable | None = None, seed: int = 0,
               eos_token_ids: Sequence[int] | None = None, chat: bool = False,
               rocket_config: RocketConfig | None = None, block_size: int = 512,
               impl: str = "auto", programs: ProgramCache | None = None, turn_pad: int = 64):
    check_args(method=method, max_new_tokens=max_new_tokens, temperature=temperature,
               top_p=top_p, sampler=sampler, seed=seed, eos_token_ids=eos_token_ids,
               rocket_config=rocket_config)
    name = method if rocket_config is None else rocket_config.method
    if not methods.get(name).takes_turns:
      allowed = tuple(m for m in methods.METHODS if methods.get(m).takes_turns)
      raise ValueError(f"method {name!r} cannot take a turn; allowed: {allowed}")
    if not isinstance(turn_pad, int) or isinstance(turn_pad, bool) or turn_pad < 1:
      raise ValueError(f"turn_pad must be an int >= 1, got {turn_pad!r}")
    self.model = as_model(model)
    self.rocket_config = rocket_config or RocketConfig(token_budget=token_budget, method=method)
    self._generate_args = dict(
        method=method, token_budget=token_budget, max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, seed=seed, eos_token_ids=eos_token_ids,
        chat=chat, rocket_config=self.rocket_config, pad_to=None, sampler=sampler)
    self.max_new_tokens = max_new_tokens
    self.chat = chat
    self.block_size = block_size
    self.impl = impl
    self.programs = PROGRAMS if programs is None else programs
    self.turn_pad = turn_pad
    self.turn = 0  # turns sent so far
    self._inp = None  # turn 1's checked inputs (sampler, key, eos)
    self._stack = None  # the last decode's final LayerStack ("dp" padding rows included)
    self._seen = None  # [n] tokens in each row's cache
    self._trim = None  # [n] tokens fed after each row's EOS, dropped at the next turn
    self._carry = None  # per row, answer tokens not yet in its cache (0 or 1)
    self._lost = None  # the turn whose failed decode took the state with it

  @property
  def context_lengths(self) -> list[int]:
    """Each row's conversation so far, in tokens (0 before the first turn)."""
    if self._seen is None:
      return []
    return [int(s) + len(c) for s, c in zip(self._seen, self._carry)]

  def send(self, messages, *, stream=None, verbose: bool = False) -> GenerationResult:
    """The next turn: one message per conversation (a string, or token ids), as `generate`'s
    prompts. Returns the answers; raises ValueError on a wrong batch or a context overflow.

    A turn that raises did not happen (the conversation stays as it was), except one whose
    decode failed (a `stream` callback that raised, an interrupt): the decode had taken the KV
    state over, and every later `send` raises RuntimeError."""
    if self._lost is not None:
      raise RuntimeError(f"this conversation's KV state was lost when turn {self._lost} failed "
                         f"in its decode; start a new Conversation")
    if self.turn == 0:
      inp = _prepare(self.model, messages, **self._generate_args)
      run = _run(self.model, inp, programs=self.programs, stream=stream,
                 block_size=self.block_size, impl=self.impl, verbose=verbose)
      self._inp = inp
      result = self._finish(run.tokens, run.steps, run.cache, inp.lengths)
      result.stats.update(_stats(inp, run, result.tokens, self.model.config))
    else:
      result = self._next_turn(messages, stream=stream, verbose=verbose)
    self.turn += 1
    result.stats["turn"] = self.turn
    return result

  # ------------------------------------------------------------------ internals
  def _finish(self, out: np.ndarray, steps: int, stack, context: np.ndarray):
    """Keeps the final state and the per-row bookkeeping; the result of the turn."""
    tokens = decode_loop.strip_eos(out, steps, self._inp.eos_token_ids)
    fed = steps - 1  # the loop feeds back every token but the last one sampled
    in_cache = np.array([min(fed, len(t)) for t in tokens], np.int64)
    self._stack = stack
    self._seen = context.astype(np.int64) + in_cache
    self._trim = (fed - in_cache).astype(np.int32)
    self._carry = [t[k:] for t, k in zip(tokens, in_cache)]
    text = None
    if self.model.tokenizer is not None:
      text = [self.model.tokenizer.decode(t) for t in tokens]
    return GenerationResult(tokens=tokens, text=text,
                            stats=dict(context_lengths=[int(c) for c in context]))

  def _turn_ids(self, messages) -> list[list[int]]:
    n = len(self._seen)
    messages = _prompt_list(messages)
    if not isinstance(messages, Sequence) or len(messages) != n:
      raise ValueError(f"messages must hold one message per conversation ({n}), got "
                       f"{len(messages) if isinstance(messages, Sequence) else messages!r}")
    tok = self.model.tokenizer
    out = []
    for carry, m in zip(self._carry, messages):
      if isinstance(m, str):
        if tok is None:
          raise ValueError("string messages need a model with a tokenizer; pass token ids")
        ids = tok.encode(turn_text(tok, m) if self.chat else m, add_special_tokens=False)
      else:
        ids = token_ids(m, self.model.config.vocab_size)
      out.append(list(carry) + ids)
      if not out[-1]:
        raise ValueError("every message must have at least one token")
    return out

  def _next_turn(self, messages, *, stream, verbose: bool) -> GenerationResult:
    config, inp = self.model.config, self._inp
    ids = self._turn_ids(messages)
    n = len(ids)
    lengths = np.array([len(i) for i in ids], np.int32)
    t = -(-int(lengths.max()) // self.turn_pad) * self.turn_pad
    context = int(self._seen.max()) + t  # the plan's (padding past a row's tokens: no position)
    longest = int((self._seen + lengths).max())
    if longest + self.max_new_tokens > config.max_position_embeddings:
      raise ValueError(
          f"messages: the conversation ({longest} tokens with this turn) + "
          f"max_new_tokens ({self.max_new_tokens}) exceeds the model's context of "
          f"{config.max_position_embeddings} tokens")
    plan = make_plan(self.rocket_config, context, self.max_new_tokens, config.head_dim)
    check_num_layers(plan, config.num_layers)
    # the programs' rows: a mesh's "dp" padding repeats the last conversation (its cache holds
    # that conversation's tokens at the same positions, so its lengths and trim fit it too)
    tokens, rows = _pad_rows(ids, inp.rows, t)
    params, _, _, _, sampler = inp.prefill_args
    key = np.asarray(jax.random.fold_in(jax.random.PRNGKey(self._generate_args["seed"]),
                                        self.turn))
    batch, (key,) = _place(inp.out_sharding, (tokens, lengths[rows], self._trim[rows]), (key,))
    args = (params, self._stack, *batch, key, sampler)
    self._stack = None  # the turn program returns the new state; `args` holds the old one
    say = _Progress(verbose)
    try:
      say.start("compiling turn")
      exe, turn_compile = self.programs.get(
          "turn", turn_program,
          dict(config=config, plan=plan, max_new_tokens=self.max_new_tokens, impl=self.impl,
               out_sharding=inp.out_sharding), (), args)
      say.done(turn_compile)
      say.start(f"turn prompt of {int(lengths.sum())} tokens")
      t0 = time.perf_counter()
      first, stack, seen, kept = exe(*args)
      first.block_until_ready()
    except BaseException:
      self._stack = args[1]  # not donated: the previous state is whole, the turn did not happen
      raise
    del args  # the previous state: freed before the decode, not held beside the new one
    turn_s = time.perf_counter() - t0
    say.done(turn_s)
    # the caller's rows only (every row's state has the same size): not the "dp" padding
    kv_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(stack)) * n // inp.rows
    try:
      dec = _decode(self.model, plan, (params, stack, first, seen, key, sampler, inp.eos),
                    programs=self.programs, stream=stream, impl=self.impl, say=say, n=n,
                    rows=inp.rows, max_new_tokens=self.max_new_tokens,
                    out_sharding=inp.out_sharding)
    except BaseException:
      self._lost = self.turn + 1  # the decode program donated `stack`
      raise
    if dec.overflow.any():
      self._lost = self.turn + 1
      raise RuntimeError(f"KV cache overflow for batch rows {np.nonzero(dec.overflow.any(0))[0]}"
                         f" in turn {self.turn + 1} (capacity {plan.capacity})")
    context = np.asarray(seen)[:n]
    result = self._finish(dec.tokens, dec.steps, dec.cache, context)
    kept = np.asarray(kept)[:, :n].astype(np.float64)
    steps = dec.steps
    new = [len(x) for x in result.tokens]
    result.stats.update(
        method=plan.method, token_budget=plan.token_budget, batch=n,
        prompt_lengths=lengths.tolist(), turn_tokens=lengths.tolist(), new_tokens=new,
        decode_steps=steps - 1, prefill_s=turn_s, decode_s=dec.seconds,
        decode_ms_per_token=1e3 * dec.seconds / max(steps - 1, 1),
        decode_tokens_per_s=(steps - 1) * n / dec.seconds if steps > 1 else 0.0,
        compile_s=turn_compile + dec.compile_s,
        **_kv_stats(config, plan, kept, steps, context + np.array(new)),
        kv_cache_bytes=int(kv_bytes), peak_bytes=max(_peak_bytes(exe), dec.peak_bytes))
    return result

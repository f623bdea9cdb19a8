"""The sweep: tasks x context lengths x methods x budgets, one prefill per prompt batch.

    cfg = SweepConfig(tasks=("passkey",), context_lengths=(2048,), methods=("full", "rocketkv"),
                      budgets=(256,), samples=5)
    results = run_sweep(model, cfg)          # {"config", "plans", "records", "timing"}
    report.write_all(results, "results/")     # JSON + Markdown + plots

Per (task, length): the samples are generated (seeded), chat-templated or in completion form
(`SweepConfig.prompt_format`), right-padded to one static length and cut into equal batches of
`batch_size`, so each (method, budget) compiles once per (task, length). Each batch gets one
prompt pass; every (method, budget) then decodes from it. "full" ignores the budget (its
record has budget None). A method may be an ablation variant, e.g.
"rocketkv:chunk_size=1,r=64" (`variants`).

Multi-turn ("multiturn" in tasks): batch 1, three questions on one context; a later turn's
prompt goes through `conversation.turn_states` (as `rocketkv.Conversation`), and each turn's
answer is scored on its own (multiturn_t1, multiturn_t2, ...). The teacher-forced gold score
(`gold_score`, on by default) forces the gold answer through the method's own decode steps, in
a program of its own before each decode program (`gold_logprob`, `gold_argmax`,
`gold_tokens`). The details (padding, each method's later turns, the gold score per turn):
docs/evaluation.md#how-a-sweep-runs-rocketkv_jaxevalharnesspy.

Records hold no timings, so the same seed and configuration give identical records; timings
go to the separate "timing" section.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from typing import Any

import jax
import numpy as np

from rocketkv_jax import methods as methods_lib
from rocketkv_jax.runtime.conversation import turn_text
from rocketkv_jax.eval import longbench, tasks as tasks_lib, variants
from rocketkv_jax.eval.runner import Runner, as_cache, layer_states

DEFAULT_METHODS = ("full", "exact_topk", "rocketkv", "snapkv", "quest", "sparq", "streamingllm")
MT_METHODS = ("full", "rocketkv", "rocketkv_mt")


@dataclasses.dataclass(frozen=True)
class SweepConfig:
  tasks: tuple = ("passkey", "niah_single")
  context_lengths: tuple = (2048,)
  methods: tuple = DEFAULT_METHODS
  budgets: tuple = (64, 128, 256, 512, 1024)
  samples: int = 20
  sample_start: int = 0  # first sample index: runs over disjoint index ranges merge cleanly
  seed: int = 0
  batch_size: int = 1
  max_new_tokens: int | None = None  # None: per task (tasks.MAX_NEW_TOKENS)
  window_size: int = 32
  quest_page_size: int = 16  # Quest page (RocketConfig.page_size; 16 as in the Quest paper)
  data_dir: str | None = None
  datasets: tuple | None = None
  multiturn_methods: tuple = MT_METHODS
  turn_pad: int = 64
  turns: int = 3  # multi-turn: questions answered in turn (at most 3)
  diagnostics: bool = False  # attention recall of each selection on each group's first batch
  decode: bool = True  # False: prompt passes (+ diagnostics) only, no records
  gold_score: bool = True  # teacher-forced gold answer score per record (`gold_*` fields)
  precompile: bool = True  # compile each group's decode programs on 2 background threads
  # "chat": the model's chat template; "completion": the message as a document to continue
  # (base models); "auto": chat when the tokenizer has a template, else completion.
  prompt_format: str = "auto"

  def __post_init__(self):
    for field in ("methods", "multiturn_methods"):  # aliases stored as their specs
      object.__setattr__(self, field, tuple(variants.canonical(m) for m in getattr(self, field)))
    for m in self.methods:
      variants.parse(m)  # a METHODS name, or a variant spec such as "rocketkv:top_k=B"
    for m in self.multiturn_methods:
      base, _ = variants.parse(m)
      if methods_lib.get(base).reads_by_mass:  # its state is not a cache a turn can extend
        raise ValueError(f"multiturn_methods: {base!r} has no multi-turn path (an oracle whose "
                         f"state counts its reads); use it in methods")
    for t in self.tasks:
      if t not in tasks_lib.TASKS + (tasks_lib.MULTITURN_TASK,):
        raise ValueError(f"unknown task {t!r}; allowed: "
                         f"{tasks_lib.TASKS + (tasks_lib.MULTITURN_TASK,)}")
    for name, vals in (("context_lengths", self.context_lengths), ("budgets", self.budgets)):
      if not vals or not all(isinstance(v, (int, np.integer)) and v >= 1 for v in vals):
        raise ValueError(f"{name} must be ints >= 1, got {list(vals)}")
    if self.max_new_tokens is not None and self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be None or >= 1, got {self.max_new_tokens}")
    if self.samples < 1 or self.batch_size < 1:
      raise ValueError(f"samples and batch_size must be >= 1, got samples={self.samples}, "
                       f"batch_size={self.batch_size}")
    if self.sample_start < 0:
      raise ValueError(f"sample_start must be >= 0, got {self.sample_start}")
    if self.quest_page_size < 1:
      raise ValueError(f"quest_page_size must be >= 1, got {self.quest_page_size}")
    if self.prompt_format not in tasks_lib.PROMPT_FORMATS + ("auto",):
      raise ValueError(f"prompt_format must be one of {tasks_lib.PROMPT_FORMATS + ('auto',)}, "
                       f"got {self.prompt_format!r}")


def prompt_format(model, cfg: SweepConfig) -> str:
  """The format a sweep prompts `model` in: `cfg.prompt_format`, "auto" resolved."""
  if cfg.prompt_format != "auto":
    return cfg.prompt_format
  # a tokenizer object without the attribute (a custom one) is taken to template itself
  return "chat" if getattr(model.tokenizer, "chat_template", True) else "completion"


def sweep_tokenizer(model, cfg: SweepConfig):
  """The model's tokenizer, wrapped for completion form where the sweep prompts in it."""
  fmt = prompt_format(model, cfg)
  return tasks_lib.formatted(model.tokenizer, fmt)


def max_new_tokens_for(cfg: SweepConfig, task: str, metric: str | None = None) -> int:
  """Tokens generated per prompt of `task`: the config's override, else the task's own."""
  if cfg.max_new_tokens is not None:
    return cfg.max_new_tokens
  if task.startswith("lb_"):
    return longbench.MAX_NEW_TOKENS.get(metric, 32)
  return tasks_lib.MAX_NEW_TOKENS[task]


def padded_len(model, length: int, max_new: int) -> int:
  """The prompt length a sweep pads to: `length`, shortened so that `max_new` tokens still fit
  in the model's context."""
  return min(int(length), model.config.max_position_embeddings - max_new)


def decode_configs(cfg: SweepConfig, names=None) -> list[tuple[str, int | None]]:
  """(method, budget) pairs a sweep decodes for `names` (default `cfg.methods`); a method that
  ignores the budget appears once, with budget None."""
  out = []
  for m in names or cfg.methods:
    if not methods_lib.get(variants.base_method(m)).uses_budget:
      out.append((m, None))
    else:
      out.extend((m, int(b)) for b in cfg.budgets)
  return out


def gold_fields(logprobs: np.ndarray, is_argmax: np.ndarray, mask) -> dict:
  """A record's teacher-forced gold score from one row's `[G]` log-probs / argmax flags and the
  scored-token mask of `tasks.gold_ids`: mean log-prob per scored token (nats), the fraction of
  scored tokens that were the argmax, and their count."""
  m = np.zeros(len(logprobs), bool)
  m[:len(mask)] = mask
  return dict(gold_logprob=float(np.mean(logprobs[m], dtype=np.float64)),
              gold_argmax=float(np.mean(is_argmax[m])), gold_tokens=int(m.sum()))


def _record(sample, method, budget, tokens, prediction, score, turn=None, task=None):
  r = dict(task=task or sample.task, context_len=sample.context_len, index=sample.index,
           method=method, budget=budget, tokens=[int(t) for t in tokens], prediction=prediction,
           answers=list(sample.answers),
           score=float(score), prompt_tokens=int(sample.meta.get("prompt_tokens", 0)))
  if "depth" in sample.meta:
    r["depth"] = float(sample.meta["depth"])
  if turn is not None:
    r["turn"] = turn
  return r


def _rows_read(plan, cache) -> np.ndarray:
  """[B] rows one decode step read per KV head, the mean over layers and steps, of a method
  whose state counts them (`Method.reads_by_mass`)."""
  method = methods_lib.get(plan.method)
  return np.mean([np.asarray(method.rows_read(state)) for state in cache], axis=0)


def _plan_dict(plan) -> dict:
  """The plan's fields, its stage-2 variant as `stage2=<name>` and the variant's own fields
  under their spec keys (`quant_bits`, ...: the flat fields of the records written before the
  variants were objects)."""
  d = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
  if plan.stage2 is not None:
    d.update(stage2=plan.stage2.name, **plan.stage2.record())
  return d


# --------------------------------------------------------------------------- sweep
class _Progress:
  def __init__(self, total: int, enabled: bool):
    self.bar = None
    if enabled:
      from tqdm.auto import tqdm

      self.bar = tqdm(total=total, unit="run", smoothing=0.1, dynamic_ncols=True)

  def update(self, n=1, desc=None):
    if self.bar is not None:
      if desc:
        self.bar.set_description(desc, refresh=False)
      self.bar.update(n)

  def close(self):
    if self.bar is not None:
      self.bar.close()


def _task_len(model, cfg: SweepConfig, task: str, length: int) -> tuple[int, int]:
  """(new tokens per answer, the padded prompt length) of a synthetic task at `length`: a
  multi-turn prompt leaves room for its later turns too."""
  mn = max_new_tokens_for(cfg, task)
  later = (cfg.turns - 1) * (cfg.turn_pad + mn) if task == tasks_lib.MULTITURN_TASK else 0
  return mn, padded_len(model, length, mn + later)


def check_model(model, cfg: SweepConfig) -> None:
  """ValueError, before any run, for a length past the model's context (a sweep shortens a
  length only by the new tokens it must still fit) or too short for a task's fixed text."""
  ctx = model.config.max_position_embeddings
  for length in cfg.context_lengths:
    if length > ctx:
      raise ValueError(f"context_lengths: {length} exceeds the model's context of {ctx} tokens")
  tok = sweep_tokenizer(model, cfg)
  for length in cfg.context_lengths:
    for task in cfg.tasks:  # one sample each: a too-short length fails here, not mid-sweep
      try:
        tasks_lib.make_sample(tok, task, length, cfg.sample_start, cfg.seed,
                              target_tokens=_task_len(model, cfg, task, length)[1])
      except ValueError as e:
        raise ValueError(f"context_lengths: {length} for {task}: {e}") from None


def build_samples(model, cfg: SweepConfig) -> dict:
  """{(task, length): (samples, max_new, padded_len)} for every synthetic / LongBench task."""
  tok = sweep_tokenizer(model, cfg)
  out = {}
  for length in cfg.context_lengths:
    for task in cfg.tasks:
      mn, p = _task_len(model, cfg, task, length)
      ss = [tasks_lib.make_sample(tok, task, length, i, cfg.seed, target_tokens=p)
            for i in range(cfg.sample_start, cfg.sample_start + cfg.samples)]
      out[(task, length)] = (ss, mn, p)
    if cfg.data_dir:
      lb = longbench.load_samples(tok, cfg.data_dir, length, datasets=cfg.datasets,
                                  max_samples=cfg.samples,
                                  target_tokens=padded_len(model, length, 64))
      by_task: dict = {}
      for s in lb:
        by_task.setdefault(s.task, []).append(s)
      for task, ss in by_task.items():
        mn = max_new_tokens_for(cfg, task, ss[0].metric)
        p = padded_len(model, length, mn)
        out[(task, length)] = (ss, mn, p)
  return out


def _unit(task: str, length: int, first: int) -> str:
  """The name of one resumable unit of work: a prompt batch from sample `first` of a (task,
  length) group (a multi-turn sample on its own)."""
  return f"{task}@{length}#{first}"


def check_resume(saved: dict, config: dict) -> None:
  """Raises ValueError unless `saved` (partial results) is of a sweep with this `config`."""
  if "done" not in saved or "records" not in saved:
    raise ValueError("resume: the saved results hold no list of finished batches ('done'); "
                     "only a partial JSON written by run_sweep's on_batch can be resumed")
  want, got = json.loads(json.dumps(config)), json.loads(json.dumps(saved.get("config", {})))
  diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
  if diff:
    raise ValueError(f"resume: the saved sweep differs in config fields {diff}; resume it with "
                     "the arguments it was started with")


def run_sweep(model, cfg: SweepConfig, *, progress: bool = True, on_group=None, on_batch=None,
              resume: dict | None = None) -> dict[str, Any]:
  """Runs the sweep.

  Args:
    on_group: `on_group(partial_results)` after every (task, length) group.
    on_batch: `on_batch(partial_results)` after every prompt batch (multi-turn: every sample),
      e.g. to save a partial JSON that survives an interrupted run. Partial results also list
      the finished batches under "done".
    resume: such partial results of an interrupted run with the same configuration: its
      finished batches are skipped and their records, plans and diagnostics kept, so the
      records end identical to an uninterrupted run's (records hold no timings). ValueError
      when its configuration differs.
  """
  if model.tokenizer is None:
    raise ValueError("the evaluation needs a model with a tokenizer (chat template)")
  if resume is not None:
    check_resume(resume, _config_dict(model, cfg))
  tok = sweep_tokenizer(model, cfg)
  runner = Runner(model, window_size=cfg.window_size, quest_page_size=cfg.quest_page_size)
  t_start = time.perf_counter()
  groups = build_samples(model, cfg)
  gen_s = time.perf_counter() - t_start

  total = 0
  for (task, _), (ss, _, _) in groups.items():
    if task == tasks_lib.MULTITURN_TASK:
      total += len(ss) * (1 + len(decode_configs(cfg, cfg.multiturn_methods)))
    else:
      nb = -(-len(ss) // cfg.batch_size)
      total += nb * (1 + (len(decode_configs(cfg)) if cfg.decode else 0))
  bar = _Progress(total, progress)
  resume = resume or {}
  records: list[dict] = list(resume.get("records", []))
  diag: list[dict] = list(resume.get("diagnostics", []))
  plans: dict[str, dict] = dict(resume.get("plans", {}))
  done: list[str] = list(resume.get("done", []))
  timing = dict(generate_samples_s=gen_s, prompt_pass_s=0.0, decode_s=0.0)
  if done:
    timing["resumed_batches"] = len(done)

  def partial(final=False):
    out = dict(config=_config_dict(model, cfg), plans=plans, records=records, timing=timing)
    if diag:
      out["diagnostics"] = diag
    if not final:
      out["done"] = done
    return out

  def finished(unit):
    done.append(unit)
    if on_batch is not None:
      on_batch(partial())

  shape = None
  for (task, length), (ss, mn, p) in groups.items():
    if on_group is not None and records:
      on_group(partial())
    units = ([_unit(task, length, s.index) for s in ss] if task == tasks_lib.MULTITURN_TASK
             else [_unit(task, length, ss[i].index) for i in range(0, len(ss), cfg.batch_size)])
    if set(units) <= set(done):
      bar.update(len(units) * (1 + (len(decode_configs(cfg, cfg.multiturn_methods))
                                    if task == tasks_lib.MULTITURN_TASK else
                                    len(decode_configs(cfg)) if cfg.decode else 0)))
      continue
    if shape not in (None, (p, mn)):
      runner.release_compiled()  # other shapes: the previous group's programs are not reused
    shape = (p, mn)
    if task == tasks_lib.MULTITURN_TASK:
      _run_multiturn(runner, tok, cfg, ss, mn, p, records, plans, timing, bar,
                     skip=set(done), finished=finished, unit=functools.partial(_unit, task, length))
      continue
    if cfg.decode and cfg.precompile:
      runner.precompile([(m, b if b is not None else max(cfg.budgets))
                         for m, b in decode_configs(cfg)],
                        cfg.batch_size, p, mn, gold=cfg.gold_score, capacity=p + mn)
    for start in range(0, len(ss), cfg.batch_size):
      batch = ss[start:start + cfg.batch_size]
      if _unit(task, length, batch[0].index) in done:  # an interrupted run's, resumed
        bar.update(1 + (len(decode_configs(cfg)) if cfg.decode else 0))
        continue
      ids = [tasks_lib.prompt_ids(tok, s) for s in batch]
      ids += [ids[-1]] * (cfg.batch_size - len(ids))
      tokens = np.zeros((cfg.batch_size, p), np.int32)
      lengths = np.array([len(x) for x in ids], np.int32)
      if lengths.max() > p:
        raise ValueError(f"{task}@{length}: a prompt has {lengths.max()} > {p} tokens")
      for i, x in enumerate(ids):
        tokens[i, :len(x)] = x
      gold, masks = None, []
      if cfg.gold_score:  # teacher-forced answer ids, `[batch, mn]` (pad id 0, unscored)
        gold = np.zeros((cfg.batch_size, mn), np.int32)
        for i, s in enumerate(batch + [batch[-1]] * (cfg.batch_size - len(batch))):
          g, mask = tasks_lib.gold_ids(tok, s, mn)
          gold[i, :len(g)] = g
          masks.append(mask)
      t0 = time.perf_counter()
      # Room for the new tokens: the full-prompt methods decode in these buffers (Runner docs).
      pp = runner.prompt_pass(tokens, lengths, capacity=p + mn)
      pp.first.block_until_ready()
      timing["prompt_pass_s"] += time.perf_counter() - t0
      bar.update(1, f"{task}@{length} prefill")
      if cfg.diagnostics and start == 0:
        from rocketkv_jax.eval import diagnostics

        for row in diagnostics.attention_recall(runner, pp, cfg.methods, cfg.budgets):
          diag.append(dict(task=task, context_len=length, **row))
      for method, budget in (decode_configs(cfg) if cfg.decode else []):
        t0 = time.perf_counter()
        b = budget if budget is not None else max(cfg.budgets)
        plan = runner.plan(method, b, p, mn)
        counted = methods_lib.get(plan.method).reads_by_mass  # its state counts the rows read
        got, _, _, cache = runner.decode(pp, method, b, mn, gold=gold, keep_cache=counted)
        timing["decode_s"] += time.perf_counter() - t0
        plans[f"{method}/{budget}/{p}+{mn}"] = _plan_dict(plan)
        rows_read = _rows_read(plan, cache) if counted else None
        for i, (s, row) in enumerate(zip(batch, got)):
          pred = tok.decode(row)
          records.append(_record(s, method, budget, row, pred, tasks_lib.score(
              s.metric, pred, s.answers, all_classes=s.meta.get("all_classes", ()))))
          if rows_read is not None:
            records[-1]["rows_read"] = float(rows_read[i])
          if gold is not None:
            lp, am = runner.last_forced
            records[-1].update(gold_fields(lp[i], am[i], masks[i]))
        bar.update(1, f"{task}@{length} {method}/{budget}")
      del pp  # this batch's prompt K/V, the largest buffer, is freed before the next prompt pass
      finished(_unit(task, length, batch[0].index))
  bar.close()
  timing["total_s"] = time.perf_counter() - t_start
  return partial(final=True)


def _run_multiturn(runner, tok, cfg, ss, mn, p, records, plans, timing, bar, skip=frozenset(),
                   finished=lambda unit: None, unit=str):
  turns = min(cfg.turns, 1 + min(len(s.questions) for s in ss))
  tpad = cfg.turn_pad
  rest = (turns - 1) * (tpad + mn) + mn  # tokens after the first prompt, upper bound
  eos = set(runner.eos_token_ids)
  for s in ss:
    if unit(s.index) in skip:  # an interrupted run's, resumed
      bar.update(1 + len(decode_configs(cfg, cfg.multiturn_methods)))
      continue
    ids = tasks_lib.prompt_ids(tok, s)  # completion form: ends with the answer lead
    if len(ids) > p:
      raise ValueError(f"multiturn: prompt has {len(ids)} > {p} tokens")
    tokens = np.zeros((1, p), np.int32)
    tokens[0, :len(ids)] = ids
    t0 = time.perf_counter()
    pp = runner.prompt_pass(tokens, np.array([len(ids)], np.int32))
    pp.first.block_until_ready()
    timing["prompt_pass_s"] += time.perf_counter() - t0
    bar.update(1, "multiturn prefill")
    for method, budget in decode_configs(cfg, cfg.multiturn_methods):
      t0 = time.perf_counter()
      b = budget if budget is not None else max(cfg.budgets)
      method_obj = methods_lib.get(variants.base_method(method))
      per_turn = method_obj.replan_per_turn  # rocketkv and rocketkv_mt: same split per turn
      plan = runner.plan(method, b, p, mn if per_turn else rest)
      plans[f"multiturn/{method}/{budget}/{p}+{plan.max_new_tokens}"] = _plan_dict(plan)
      answers = [s.answers] + list(s.turn_answers)
      golds = [_turn_gold(tok, s, answers[t], mn) if cfg.gold_score else None
               for t in range(turns)]
      got, out, steps, cache = runner.decode(pp, method, b, mn, keep_cache=True,
                                             max_new_for_plan=plan.max_new_tokens,
                                             gold=golds[0][0] if golds[0] else None)
      forced = runner.last_forced
      for t in range(turns):
        if t > 0:
          last = int(out[0, steps - 1])
          text = turn_text(tok, s.questions[t - 1])
          tids = ([] if last in eos else [last]) + tok.encode(text, add_special_tokens=False)
          if len(tids) > tpad:
            raise ValueError(f"turn prompt has {len(tids)} > turn_pad={tpad} tokens")
          tt = np.zeros((1, tpad), np.int32)
          tt[0, :len(tids)] = tids
          tl = np.array([len(tids)], np.int32)
          tplan = plan
          if per_turn:  # rocketkv_mt re-runs stage 1 with it; rocketkv only reads its split
            tplan = runner.plan(method, b, p + t * (tpad + mn), mn)
            plans[f"multiturn/{method}/{budget}/turn{t + 1}"] = _plan_dict(tplan)
          logits, states, seen = runner.next_turn(layer_states(runner.model.params, cache), tt,
                                                  tl, tplan, mn)
          first = jax.numpy.argmax(logits, axis=-1).astype(jax.numpy.int32)
          tcache = as_cache(runner.model.params, states)
          if golds[t]:  # from the state this turn decodes from, before the decode
            forced = runner.continue_gold(tcache, logits, seen, tplan, golds[t][0])
          got, out, steps, cache = runner.continue_decode(tcache, first, seen, tplan, mn)
        pred = tok.decode(got[0])
        records.append(_record(s, method, budget, got[0], pred,
                               tasks_lib.score("contains", pred, answers[t]), turn=t + 1,
                               task=f"multiturn_t{t + 1}") | dict(answers=list(answers[t])))
        if golds[t]:
          records[-1].update(gold_fields(forced[0][0], forced[1][0], golds[t][1]))
      timing["decode_s"] += time.perf_counter() - t0
      bar.update(1, f"multiturn {method}/{budget}")
    runner.release_if_crowded()
    finished(unit(s.index))


def _turn_gold(tok, sample, answers, limit: int):
  """A multi-turn turn's teacher-forced gold: (ids `[1, limit]` int32, pad 0; the scored-token
  mask), as `tasks.gold_ids` makes them for that turn's answers."""
  g, mask = tasks_lib.gold_ids(tok, dataclasses.replace(sample, answers=list(answers)), limit)
  ids = np.zeros((1, limit), np.int32)
  ids[0, :len(g)] = g
  return ids, mask


def _config_dict(model, cfg: SweepConfig) -> dict:
  c = dataclasses.asdict(cfg)
  c["model"] = dict(source=model.source and str(model.source).split("/")[-1],
                    num_layers=model.config.num_layers, head_dim=model.config.head_dim,
                    num_heads=model.config.num_heads, num_kv_heads=model.config.num_kv_heads,
                    max_position_embeddings=model.config.max_position_embeddings,
                    dtype=str(model.dtype))
  c["max_new_tokens_per_task"] = {t: max_new_tokens_for(cfg, t) for t in cfg.tasks}
  c["prompt_format_used"] = prompt_format(model, cfg)
  c["jax_version"] = jax.__version__
  c["greedy"] = True
  return c

"""Real-text fidelity: how well a KV method's own cache still predicts real documents.

    cfg = RealTextConfig(corpora=("python_docs",), lengths=(4096,), budgets=(256,), docs=8)
    results = run(model, cfg)        # {"config", "documents", "probes", "records", "summary"}
    print(markdown(results))
    compare(merge_records([results, other]), "rocketkv", "snapkv")   # paired per document

Two probes per document and context length N (`make_probes`):
  * continuation: the context is the document's first N tokens; the next `target_tokens` (48)
    are scored.
  * recall: the document is cut at a sentence start c <= N - cue; the context is ids[:c] followed
    by the first `cue_tokens` (8) of a sentence that began d in `distance` (1000-3000) tokens
    before c, and the rest of that sentence (at most `target_tokens`) is scored. The cue occurs
    once in ids[:c], so the rest is determined by the text the cache had to keep.

Every target is teacher-forced through the method's own decode steps after its own prefill, its
cache built (as in the accuracy sweep, `runner`) from one dense prompt pass that every method of
a batch shares: the numbers of `rocketkv.score_continuations`, plus the argmax id at each step
(tests/test_real_text.py checks the two agree). Per document,
a method's score is its mean log-prob per target token; the table reports its difference from
full KV's on the same probe (paired over documents, percentile-bootstrap 95% interval from
`stats`) and the top-1 agreement: the fraction of target positions whose argmax equals full
KV's. Full KV's own delta is 0 and its agreement 1 by construction.

Documents come from `corpora` (each with its source and sha256 in the results); a probe run
picks `docs` documents per corpus from a seeded permutation of those long enough for N.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from rocketkv_jax.cache import cache_overflow
from rocketkv_jax.eval import (corpora as corpora_lib, read_cost, runner as runner_lib, stats,
                               variants)
from rocketkv_jax.models import llama
from rocketkv_jax.models.precision import compute_params

PROBES = ("continuation", "recall")
FULL = "full"


@dataclasses.dataclass(frozen=True)
class RealTextConfig:
  corpora: tuple = corpora_lib.CORPORA
  lengths: tuple = (4096,)
  methods: tuple = ("full", "rocketkv", "recommended", "snapkv")
  budgets: tuple = (256,)
  probes: tuple = PROBES
  docs: int = 8  # per corpus and length
  seed: int = 0
  target_tokens: int = 48
  cue_tokens: int = 8
  distance: tuple = (1000, 3000)  # recall: tokens from the sentence's start to the cut
  batch_size: int = 2
  n_boot: int = 10000

  def __post_init__(self):
    object.__setattr__(self, "methods", tuple(variants.canonical(m) for m in self.methods))
    if FULL not in self.methods:  # every delta is taken against it
      object.__setattr__(self, "methods", (FULL,) + self.methods)
    for m in self.methods:
      variants.parse(m)
    for c in self.corpora:
      if c not in corpora_lib.CORPORA:
        raise ValueError(f"unknown corpus {c!r}; allowed: {list(corpora_lib.CORPORA)}")
    for p in self.probes:
      if p not in PROBES:
        raise ValueError(f"unknown probe {p!r}; allowed: {list(PROBES)}")
    for name in ("lengths", "budgets", "corpora", "probes"):
      if not getattr(self, name):
        raise ValueError(f"{name} must not be empty")
    for name, vals in (("lengths", self.lengths), ("budgets", self.budgets)):
      if not all(isinstance(v, (int, np.integer)) and v >= 1 for v in vals):
        raise ValueError(f"{name} must be ints >= 1, got {list(vals)}")
    for name in ("docs", "target_tokens", "cue_tokens", "batch_size", "n_boot"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    lo, hi = self.distance
    if not 1 <= lo <= hi:
      raise ValueError(f"distance must be (lo, hi) with 1 <= lo <= hi, got {self.distance}")


@dataclasses.dataclass(frozen=True)
class Probe:
  """One scored target: `context` is prefilled, `target` teacher-forced.

  For recall, `source` is the token index where the sentence first occurs in the document and
  `cut` where the document is cut (context = ids[:cut] + ids[source:source + cue_tokens],
  target = the sentence's next tokens); both are None for continuation (cut = N).
  """

  kind: str
  corpus: str
  doc: str
  length: int
  context: tuple
  target: tuple
  source: int | None = None
  cut: int | None = None

  @property
  def key(self) -> tuple:
    return (self.corpus, self.doc, self.kind, self.length)


# --- tokens and sentences --------------------------------------------------------------------

def encode_with_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
  """(ids, char offsets per id) of `text`, BOS first (offsets (0, 0)) when the tokenizer adds it.

  A tokenizer of one's own (tests) may define `encode_with_offsets(text)` instead of wrapping a
  `tokenizers.Tokenizer` as `rocketkv.models.Tokenizer` does.
  """
  if hasattr(tokenizer, "encode_with_offsets"):
    return tokenizer.encode_with_offsets(text)
  enc = tokenizer.backend.encode(text, add_special_tokens=False)
  ids, offsets = list(enc.ids), [tuple(o) for o in enc.offsets]
  if getattr(tokenizer, "add_bos", False) and tokenizer.bos_token_id is not None:
    ids, offsets = [tokenizer.bos_token_id] + ids, [(0, 0)] + offsets
  return ids, offsets


# A sentence ends at . ! or ? (and any closing quotes / brackets) before whitespace; a blank line
# ends a segment too (a heading, a list item), which is then no sentence.
_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s)|\n[ \t]*\n")


def sentence_spans(text: str) -> list[tuple[int, int, bool]]:
  """[(start, end, is_sentence)] char spans of the segments of `text`: is_sentence when the
  segment starts with an upper-case letter and ends with its own . ! or ?."""
  spans, pos = [], 0
  for m in _END.finditer(text):
    start = pos + len(text[pos:m.start()]) - len(text[pos:m.start()].lstrip())
    punct = not m.group().startswith("\n")
    end = m.end() if punct else m.start()
    if start < end:
      spans.append((start, end, punct and text[start].isupper()))
    pos = m.end()
  return spans


def _token_spans(text, offsets, spans):
  """Sentence char spans -> token spans [(s, e, is_sentence)]: s is the first token holding the
  segment's first char, kept only when that token starts on the segment or on whitespace before
  it (a clean boundary); e is the first token starting at or after the segment's end."""
  ends = np.array([o[1] for o in offsets])
  starts = np.array([o[0] for o in offsets])
  out = []
  for cs, ce, is_sentence in spans:
    s = int(np.searchsorted(ends, cs, side="right"))
    if s >= len(offsets) or (starts[s] < cs and not text[starts[s]:cs].isspace()):
      continue
    if s > 0 and ends[s - 1] > cs:
      continue
    e = int(np.searchsorted(starts, ce, side="left"))
    out.append((s, e, is_sentence))
  return out


def continuation_probe(ids, length: int, target_tokens: int, corpus="", doc="") -> Probe | None:
  """The first `length` ids, then the next `target_tokens`; None if the document is shorter."""
  if len(ids) < length + target_tokens:
    return None
  return Probe("continuation", corpus, doc, length, tuple(ids[:length]),
               tuple(ids[length:length + target_tokens]))


def recall_probe(ids, offsets, text, length: int, *, target_tokens: int, cue_tokens: int,
                 distance: tuple, rng: np.random.Generator, corpus="", doc="",
                 min_rest: int = 4, max_slack: int = 512) -> Probe | None:
  """The recall probe of one document at context length `length` (module docstring), or None
  when the document has no cut within `max_slack` of `length - cue_tokens` or no sentence that
  fits (its cue unique in ids[:cut], at least `min_rest` tokens after the cue)."""
  tspans = _token_spans(text, offsets, sentence_spans(text))
  cuts = [s for s, _, _ in tspans if length - cue_tokens - max_slack <= s <= length - cue_tokens]
  if not cuts:
    return None
  cut = max(cuts)
  if cut < cue_tokens:
    return None
  lo, hi = distance
  head = np.asarray(ids[:cut])
  windows = np.lib.stride_tricks.sliding_window_view(head, cue_tokens)
  cands = []
  for s, e, is_sentence in tspans:
    if not is_sentence or not lo <= cut - s <= hi or e > cut or e - s < cue_tokens + min_rest:
      continue
    cue = head[s:s + cue_tokens]
    if int(np.sum(np.all(windows == cue, axis=1))) != 1:
      continue
    cands.append((s, e))
  if not cands:
    return None
  s, e = cands[int(rng.integers(len(cands)))]
  context = tuple(ids[:cut]) + tuple(ids[s:s + cue_tokens])
  target = tuple(ids[s + cue_tokens:min(e, s + cue_tokens + target_tokens)])
  return Probe("recall", corpus, doc, length, context, target, source=s, cut=cut)


def _rng(seed: int, *keys) -> np.random.Generator:
  digest = hashlib.sha256(repr((seed,) + keys).encode()).digest()
  return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def make_probes(tokenizer, documents, cfg: RealTextConfig) -> tuple[list[Probe], list[dict]]:
  """(probes, the documents they read): per corpus and length, the first `cfg.docs` documents
  of a seeded permutation that have at least length + target_tokens tokens; each gets every
  probe in `cfg.probes` that fits it (a recall probe may not: then that document has none)."""
  by_corpus: dict[str, list] = {}
  for d in documents:
    by_corpus.setdefault(d.corpus, []).append(d)
  probes, used = [], {}
  for corpus, docs in by_corpus.items():
    order = _rng(cfg.seed, corpus).permutation(len(docs))
    encoded: dict[int, tuple] = {}
    for length in cfg.lengths:
      taken = 0
      for i in order:
        if taken == cfg.docs:
          break
        d = docs[i]
        if len(d.text) < length:  # fewer chars than tokens needed: skip without tokenizing
          continue
        if i not in encoded:
          encoded[i] = encode_with_offsets(tokenizer, d.text)
        ids, offsets = encoded[i]
        cont = continuation_probe(ids, length, cfg.target_tokens, corpus, d.name)
        if cont is None:
          continue
        taken += 1
        used[(corpus, d.name)] = dict(corpus=corpus, name=d.name, source=d.source,
                                      sha256=d.sha256, tokens=len(ids))
        if "continuation" in cfg.probes:
          probes.append(cont)
        if "recall" in cfg.probes:
          rec = recall_probe(ids, offsets, d.text, length, target_tokens=cfg.target_tokens,
                             cue_tokens=cfg.cue_tokens, distance=tuple(cfg.distance),
                             rng=_rng(cfg.seed, corpus, d.name, length), corpus=corpus,
                             doc=d.name)
          if rec is not None:
            probes.append(rec)
  return probes, list(used.values())


# --- scoring ---------------------------------------------------------------------------------

def _scores(logits, target):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return (jnp.take_along_axis(logp, target[:, None], axis=-1)[:, 0],
          jnp.argmax(logits, axis=-1).astype(jnp.int32))


def _forced(params, cache, first_logits, forced, lengths, *, config, plan):
  """`teacher_forced.forced_logprobs` plus each step's argmax id: (log p(forced) `[B, M]`,
  argmax ids `[B, M]`, overflow `[B]`); step t's argmax is the method's top-1 prediction for
  forced[:, t] given the context and forced[:, :t]."""
  lp0, am0 = _scores(first_logits, forced[:, 0])

  def step(cache, xs):
    t, tok, target = xs
    logits, cache = llama.decode_step(params, cache, tok, lengths + t, config=config, plan=plan)
    return cache, _scores(logits, target)

  m = forced.shape[1]
  xs = (jnp.arange(m - 1, dtype=jnp.int32), forced[:, :-1].T, forced[:, 1:].T)
  cache, (lps, ams) = jax.lax.scan(step, cache, xs)
  return (jnp.concatenate([lp0[:, None], lps.T], axis=1),
          jnp.concatenate([am0[:, None], ams.T], axis=1), cache_overflow(cache))


@functools.partial(jax.jit, static_argnames=("config", "plan", "block_size"))
def forced_scores(params, context, lengths, forced, *, config, plan, block_size=512):
  """The program of `rocketkv.score_continuations` (`llama.prefill`, then the forced decode
  steps), returning `_forced`'s argmax ids too. The reference `run`'s shared prompt pass is
  tested against."""
  first_logits, cache = llama.prefill(params, context, lengths, config=config, plan=plan,
                                      block_size=block_size)
  return _forced(params, cache, first_logits, forced, lengths, config=config, plan=plan)


@functools.partial(jax.jit, static_argnames=("config", "plan"))
def _forced_from_prompt(params, k, v, qw, lengths, first_logits, forced, *, config, plan):
  """`_forced` from one method's cache built out of a shared prompt pass (`runner`): every
  method reads the same dense prompt pass, so a batch pays for one prefill, not one per method."""
  cache = runner_lib._method_cache(k, v, qw, lengths, plan, True, False, config)
  return _forced(compute_params(params), cache, first_logits, forced, lengths, config=config,
                 plan=plan)


def _batches(probes, cfg: RealTextConfig):
  """[(probes, context `[bs, N]`, lengths `[bs]`, forced `[bs, target_tokens]`)]: every batch
  `cfg.batch_size` rows (the last filled with copies of its last probe), padded to N."""
  big_l, big_m, bs = probes[0].length, cfg.target_tokens, cfg.batch_size
  out = []
  for i in range(0, len(probes), bs):
    batch = probes[i:i + bs]
    rows = batch + [batch[-1]] * (bs - len(batch))
    ctx = np.zeros((bs, big_l), np.int32)
    forced = np.zeros((bs, big_m), np.int32)
    for r, p in enumerate(rows):
      ctx[r, :len(p.context)] = p.context
      forced[r, :len(p.target)] = p.target
    out.append((batch, ctx, np.array([len(p.context) for p in rows], np.int32), forced))
  return out


def score_probes(model, probes, jobs, cfg: RealTextConfig, progress=None):
  """Scores probes of one length under every (method spec, budget) in `jobs`.

  Per batch, one prompt pass (`Runner.prompt_pass`), then each job's cache is built from it and
  the targets forced through its decode steps; plans are made for (N, target_tokens). Returns
  ({job: [{"logprobs", "argmax"}] per probe}, [timing per job and for the prompt passes]).
  """
  runner = runner_lib.Runner(model)
  length = probes[0].length
  plans = {job: runner.plan(job[0], job[1], length, cfg.target_tokens) for job in jobs}
  compiled, out = {}, {job: [] for job in jobs}
  timing = {job: dict(compile_s=0.0, run_s=0.0) for job in jobs}
  timing["prompt"] = dict(compile_s=0.0, run_s=0.0)
  batches = _batches(probes, cfg)
  for bi, (batch, ctx, lens, forced) in enumerate(batches):
    t0 = time.perf_counter()
    pp = runner.prompt_pass(ctx, lens)
    jax.block_until_ready(pp.k)
    timing["prompt"]["compile_s" if bi == 0 else "run_s"] += time.perf_counter() - t0
    args = (model.params, pp.k, pp.v, pp.q_window, pp.lengths, pp.first_logits,
            jnp.asarray(forced))
    for job in jobs:
      if job not in compiled:
        t0 = time.perf_counter()
        compiled[job] = _forced_from_prompt.lower(*args, config=model.config,
                                                  plan=plans[job]).compile()
        timing[job]["compile_s"] += time.perf_counter() - t0
      t0 = time.perf_counter()
      lp, am, overflow = jax.device_get(compiled[job](*args))
      timing[job]["run_s"] += time.perf_counter() - t0
      if np.any(overflow):
        raise RuntimeError(f"KV cache overflow (capacity {plans[job].capacity}) for {job}")
      for r, p in enumerate(batch):
        out[job].append(dict(logprobs=lp[r, :len(p.target)].astype(np.float64),
                             argmax=am[r, :len(p.target)].astype(np.int64)))
    if progress is not None:
      progress(f"N={length}: batch {bi + 1}/{len(batches)} done")
  # The first prompt pass compiled and ran: its run share is estimated from the later ones.
  # With one batch the two are not told apart: compile_s None, run_s both.
  pt = timing["prompt"]
  if len(batches) > 1:
    per = pt["run_s"] / (len(batches) - 1)
    pt["compile_s"], pt["run_s"] = max(0.0, pt["compile_s"] - per), pt["run_s"] + per
  else:
    pt["compile_s"], pt["run_s"] = None, pt["compile_s"]
  rows = [dict(length=length, method="(prompt pass)", budget=None, rows=len(probes),
               batches=len(batches), **pt)]
  for job in jobs:
    rows.append(dict(length=length, method=job[0], budget=job[2], rows=len(probes),
                     batches=len(batches), **timing[job]))
  return out, rows


def summarize(records: list[dict], cfg: RealTextConfig) -> list[dict]:
  """Per (corpus, probe, length, method, budget): mean log-prob/token minus full KV's, paired
  over documents, with its bootstrap interval; top-1 agreement with full KV and its interval;
  full KV's own mean log-prob and gold top-1 rate for scale."""
  full = {(r["corpus"], r["doc"], r["probe"], r["length"]): r for r in records
          if r["method"] == FULL}
  groups: dict[tuple, list] = {}
  for r in records:
    groups.setdefault((r["corpus"], r["probe"], r["length"], r["method"], r["budget"]),
                      []).append(r)
  rows = []
  for (corpus, probe, length, method, budget), rs in groups.items():
    rs = sorted(rs, key=lambda r: r["doc"])
    refs = [full[(corpus, r["doc"], probe, length)] for r in rs]
    a = np.array([r["mean_logprob"] for r in rs])
    b = np.array([f["mean_logprob"] for f in refs])
    d, lo, hi = stats.paired_bootstrap_diff(a, b, n_boot=cfg.n_boot, seed=cfg.seed)
    agree = np.array([r["agreement"] for r in rs])
    alo, ahi = stats.bootstrap_ci(agree, n_boot=cfg.n_boot, seed=cfg.seed)
    rows.append(dict(
        corpus=corpus, role=("calibration" if corpus == corpora_lib.CALIBRATION else "held out"),
        probe=probe, length=length, method=method, budget=budget, n=len(rs),
        delta=d, delta_lo=lo, delta_hi=hi, agreement=float(agree.mean()), agreement_lo=alo,
        agreement_hi=ahi, full_logprob=float(b.mean()),
        full_top1=float(np.mean([f["gold_top1"] for f in refs])),
        target_tokens=int(sum(len(r["logprobs"]) for r in rs))))
  order = {m: i for i, m in enumerate(cfg.methods)}
  corpus_order = {c: i for i, c in enumerate(cfg.corpora)}
  rows.sort(key=lambda r: (corpus_order.get(r["corpus"], len(corpus_order)), r["corpus"],
                           r["probe"], r["length"],
                           order.get(r["method"], len(order)), r["budget"] or 0))
  return rows


def merge_records(results: list[dict]) -> list[dict]:
  """The records of several runs' results (e.g. a run of extra variants on the same documents),
  each (corpus, doc, probe, length, method, budget) once, the first run's kept. ValueError when
  two runs read a document of the same name with different text (sha256)."""
  shas, out, seen = {}, [], set()
  for res in results:
    for d in res["documents"]:
      if shas.setdefault((d["corpus"], d["name"]), d["sha256"]) != d["sha256"]:
        raise ValueError(f"document {d['corpus']}/{d['name']} differs between the runs (sha256)")
    for r in res["records"]:
      key = (r["corpus"], r["doc"], r["probe"], r["length"], r["method"], r["budget"])
      if key not in seen:
        seen.add(key)
        out.append(r)
  return out


def compare(records: list[dict], a: str, b: str, *, n_boot: int = 10000,
            seed: int = 0) -> list[dict]:
  """Method `a` minus method `b` (specs; aliases allowed), paired per document: per (corpus,
  probe, length, budget) where both scored the same documents, the mean log-prob difference and
  its bootstrap interval. A method with one budget (full) pairs with every budget of the other."""
  a, b = variants.canonical(a), variants.canonical(b)
  by: dict = {}
  for r in records:
    if r["method"] in (a, b):
      by.setdefault((r["method"], r["corpus"], r["probe"], r["length"], r["budget"]),
                    {})[r["doc"]] = r["mean_logprob"]

  def budgets(m, k):
    return sorted({key[4] for key in by if key[0] == m and key[1:4] == k}, key=lambda x: x or 0)

  rows = []
  for k in sorted({key[1:4] for key in by if key[0] == a}):
    ba, bb = budgets(a, k), budgets(b, k)
    if len(ba) == 1 or len(bb) == 1:  # one side has a single budget: it pairs with each other
      pairs = [(x, y) for x in ba for y in bb]
    else:
      pairs = [(x, x) for x in ba if x in bb]
    for x, y in pairs:
      xa, xb = by[(a, *k, x)], by[(b, *k, y)]
      if sorted(xa) != sorted(xb):
        continue
      docs = sorted(xa)
      d, lo, hi = stats.paired_bootstrap_diff([xa[i] for i in docs], [xb[i] for i in docs],
                                              n_boot=n_boot, seed=seed)
      rows.append(dict(corpus=k[0], probe=k[1], length=k[2], budget=x if x is not None else y,
                       n=len(docs), delta=d, delta_lo=lo, delta_hi=hi))
  return rows


def run(model, cfg: RealTextConfig, *, documents=None, tokenizer=None,
        progress: Callable[[str], None] | None = None) -> dict:
  """Probes, scores and summarizes (`RealTextConfig`); `documents` default to the corpora's.

  Returns a JSON-ready dict: config, corpora (package, version, role), documents (source,
  sha256), probes (positions), records (per probe, method and budget: per-token log-probs, the
  argmax agreement with full KV), summary (`summarize`) and timing per (length, method, budget).
  """
  tokenizer = tokenizer if tokenizer is not None else model.tokenizer
  limit = model.config.max_position_embeddings
  for n in cfg.lengths:
    if n + cfg.target_tokens - 1 > limit:
      raise ValueError(f"length {n} + {cfg.target_tokens} target tokens - 1 exceeds the model's "
                       f"context of {limit} tokens (largest length: "
                       f"{limit + 1 - cfg.target_tokens})")
  corpus_info = {}
  if documents is None:
    documents = []
    for c in cfg.corpora:
      documents += corpora_lib.load(c)
      corpus_info[c] = corpora_lib.info(c)
  probes, docs = make_probes(tokenizer, documents, cfg)
  if not probes:
    raise ValueError(f"no document of {list(cfg.corpora)} is long enough for lengths "
                     f"{list(cfg.lengths)}")
  records, timing = [], []
  jobs = [(spec, b, None if spec == FULL else b) for spec in cfg.methods
          for b in ((max(cfg.budgets),) if spec == FULL else cfg.budgets)]
  for length in cfg.lengths:
    group = [p for p in probes if p.length == length]
    if not group:
      continue
    scored, t = score_probes(model, group, jobs, cfg, progress)
    timing += t
    full_job = next(j for j in jobs if j[0] == FULL)
    full_argmax = {p.key: s["argmax"] for p, s in zip(group, scored[full_job])}
    for spec, _, budget in jobs:
      for p, s in zip(group, scored[(spec, _, budget)]):
        agree = s["argmax"] == full_argmax[p.key]
        records.append(dict(
            corpus=p.corpus, doc=p.doc, probe=p.kind, length=length, method=spec,
            budget=budget, mean_logprob=float(s["logprobs"].mean()),
            agreement=float(agree.mean()),
            gold_top1=float(np.mean(s["argmax"] == np.asarray(p.target))),
            logprobs=[round(float(x), 5) for x in s["logprobs"]],
            agree=[bool(x) for x in agree]))
  return dict(
      config=dataclasses.asdict(cfg),
      read_bytes=read_bytes(model, cfg),
      corpora=corpus_info,
      calibration=corpora_lib.CALIBRATION,
      documents=docs,
      probes=[dict(corpus=p.corpus, doc=p.doc, probe=p.kind, length=p.length,
                   context_tokens=len(p.context), target_tokens=len(p.target), source=p.source,
                   cut=p.cut, distance=None if p.cut is None else p.cut - p.source)
              for p in probes],
      records=records,
      summary=summarize(records, cfg),
      timing=timing)


def read_bytes(model, cfg: RealTextConfig) -> list[dict]:
  """Per (length, method, budget): the KV bytes one decode step reads at the probe's last
  target token (`read_cost.step_read_bytes`, one batch row), and that as a fraction of full
  KV's at the same length. Counted at 2 bytes per K/V value, as a served bf16 / fp16 cache
  holds them (and as the 4-bit codes' equal read is defined), whatever dtype the run used."""
  runner = runner_lib.Runner(model)
  itemsize = 2
  out = []
  for length in cfg.lengths:
    full = read_cost.step_read_bytes(runner.plan(FULL, max(cfg.budgets), length,
                                                 cfg.target_tokens), model.config, itemsize)
    for spec in cfg.methods:
      for b in ((max(cfg.budgets),) if spec == FULL else cfg.budgets):
        n = read_cost.step_read_bytes(runner.plan(spec, b, length, cfg.target_tokens),
                                      model.config, itemsize)
        out.append(dict(length=length, method=spec, budget=None if spec == FULL else b,
                        bytes=n, fraction=n / full))
  return out


POSITION_BUCKETS = ((1, 4), (5, 16), (17, 48))  # target positions after the context, 1-based


def by_position(records: list[dict], buckets=POSITION_BUCKETS) -> list[dict]:
  """Per (corpus, probe, length, method, budget) and bucket of target positions: the mean over
  documents of the method's mean log-prob minus full KV's on those positions (a document
  counts where its target reaches the bucket). Where after the context a method loses."""
  full = {(r["corpus"], r["doc"], r["probe"], r["length"]): r["logprobs"] for r in records
          if r["method"] == FULL}
  groups: dict[tuple, list] = {}
  for r in records:
    if r["method"] != FULL:
      groups.setdefault((r["corpus"], r["probe"], r["length"], r["method"], r["budget"]),
                        []).append(r)
  rows = []
  for (corpus, probe, length, method, budget), rs in groups.items():
    row = dict(corpus=corpus, probe=probe, length=length, method=method, budget=budget)
    for lo, hi in buckets:
      d = [np.mean(np.subtract(r["logprobs"][lo - 1:hi],
                               full[(corpus, r["doc"], probe, length)][lo - 1:hi]))
           for r in rs if len(r["logprobs"]) >= lo]
      row[f"{lo}-{hi}"] = (float(np.mean(d)) if d else None, len(d))
    rows.append(row)
  return rows


def config_of(results: list[dict]) -> RealTextConfig:
  """The `RealTextConfig` of one or more runs' results: their corpora, lengths, methods and
  budgets united (in order of first appearance), the first run's other settings."""
  first = dict(results[0]["config"])
  for key in ("corpora", "lengths", "methods", "budgets", "probes"):
    first[key] = tuple(dict.fromkeys(v for res in results for v in res["config"][key]))
  first["distance"] = tuple(first["distance"])
  return RealTextConfig(**first)


def pooled(records: list[dict], cfg: RealTextConfig) -> list[dict]:
  """`summarize` over every held-out corpus at once, as one corpus named "a+b" (each document
  still paired with its own full KV): a row's interval is over all their documents."""
  names = sorted({r["corpus"] for r in records if r["corpus"] != corpora_lib.CALIBRATION})
  held = [dict(r, corpus="+".join(names), doc=f"{r['corpus']}/{r['doc']}") for r in records
          if r["corpus"] in names]
  return summarize(held, cfg)


PLOT_FLOOR = -0.5  # nats/token: the plot's lower edge; points below it are drawn on it


def plot_fidelity(results: list[dict], path: str, *, role: str = "held out") -> None:
  """nats/token lost against the share of full KV's bytes read per decode step: a row of
  panels per model, one panel per (probe, length), one line per method through its budgets,
  95% intervals as bars, each method one colour everywhere. `results` are `run` outputs with
  their "model" entry (examples/real_text.py writes it); runs of the same model merge
  (`merge_records`). `role`: "held out" pools the held-out corpora (`pooled`), "calibration"
  reads the calibration corpus. Points below `PLOT_FLOOR` sit on it, their value written."""
  from rocketkv_jax.eval.report import _pyplot  # matplotlib only where a plot is drawn

  plt = _pyplot()
  from matplotlib import ticker

  by_model: dict[str, list[dict]] = {}
  for res in results:
    by_model.setdefault(res.get("model", {}).get("name", "?"), []).append(res)
  grid = []  # per model: [(title, rows, read)]
  for name, group in by_model.items():
    cfg = config_of(group)
    records = merge_records(group)
    rows = (pooled(records, cfg) if role == "held out" else
            [r for r in summarize(records, cfg) if r["role"] == "calibration"])
    read = {(r["length"], r["method"], r["budget"]): r["fraction"]
            for g in group for r in g.get("read_bytes", [])}
    panels = []
    for probe in cfg.probes:
      for length in sorted({r["length"] for r in rows}):
        sel = [r for r in rows if r["probe"] == probe and r["length"] == length
               and (length, r["method"], r["budget"]) in read and r["method"] != FULL]
        if sel:
          panels.append((f"{name}, {probe}, N = {length}", sel, read))
    if panels:
      grid.append(panels)
  if not grid:
    raise ValueError(f"no {role} rows with read bytes in the results to plot")
  methods = list(dict.fromkeys(r["method"] for panels in grid for _, sel, _ in panels
                               for r in sel))
  cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
  colour = {m: cmap(i % cmap.N) for i, m in enumerate(methods)}
  ncol = max(len(p) for p in grid)
  fig, axes = plt.subplots(len(grid), ncol, figsize=(4.2 * ncol, 3.4 * len(grid)),
                           squeeze=False)
  for i, panels in enumerate(grid):
    for j in range(ncol):
      ax = axes[i][j]
      if j >= len(panels):
        ax.axis("off")
        continue
      title, sel, read = panels[j]
      for method in dict.fromkeys(r["method"] for r in sel):
        pts = sorted((read[(r["length"], method, r["budget"])], r) for r in sel
                     if r["method"] == method)
        xs = [x for x, _ in pts]
        ys = [max(r["delta"], PLOT_FLOOR) for _, r in pts]
        err = [[max(0.0, y - max(r["delta_lo"], PLOT_FLOOR)) for y, (_, r) in zip(ys, pts)],
               [max(0.0, r["delta_hi"] - y) for y, (_, r) in zip(ys, pts)]]
        ax.errorbar(xs, ys, yerr=err, marker="o", ms=4, capsize=2, color=colour[method],
                    label=_label(method))
        for x, y, (_, r) in zip(xs, ys, pts):
          text = f"B={r['budget']}" + ("" if r["delta"] >= PLOT_FLOOR else f" ({r['delta']:.2f})")
          ax.annotate(text, (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6)
      ax.axhline(0.0, color="k", lw=0.8)
      ax.axhline(-0.05, color="k", ls=":", lw=0.8)
      ax.set_xscale("log")
      ax.xaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
      ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{100 * v:g}%"))
      ax.xaxis.set_minor_formatter(ticker.NullFormatter())
      top = max([0.1] + [min(r["delta_hi"], 0.5) + 0.02 for r in sel])
      ax.set_ylim(PLOT_FLOOR - 0.03, top)
      ax.set_xlabel("KV bytes read per step, % of full KV's", fontsize=8)
      ax.set_ylabel("Δ log-prob / token vs full KV", fontsize=8)
      ax.set_title(title, fontsize=9)
  handles = [plt.Line2D([], [], color=colour[m], marker="o", label=_label(m)) for m in methods]
  per_row = 2 if max(len(h.get_label()) for h in handles) > 30 else 4
  fig.legend(handles=handles, loc="lower center", ncol=per_row, fontsize=7)
  fig.suptitle(f"real text ({role}): dotted line -0.05 nats/token", fontsize=9)
  fig.tight_layout(rect=(0, (0.05 + 0.035 * ((len(handles) - 1) // per_row)) / len(grid), 1, 1))
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _label(spec: str) -> str:
  """A method spec as a table shows it: the alias where it has one (`recommended`)."""
  return next((alias for alias, s in variants.ALIASES.items() if s == spec), spec)


def _ci(x, lo, hi, fmt="{:+.3f}") -> str:
  return f"{fmt.format(x)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def markdown(results: dict) -> str:
  """Tables: per corpus (calibration / held out), probe and length, each method's delta and
  agreement with intervals; then the time per probe of each (length, method, budget). The
  recommended configuration shows as `recommended` (`variants.ALIASES`)."""
  out = []
  rows = list(results["summary"])
  if sum(c != corpora_lib.CALIBRATION for c in results["config"]["corpora"]) > 1:
    rows += pooled(results["records"], config_of([results]))  # one interval over them all
  read = {(r["length"], r["method"], r["budget"]): r["fraction"]
          for r in results.get("read_bytes", [])}
  keys = []
  for r in rows:
    k = (r["corpus"], r["role"], r["probe"], r["length"])
    if k not in keys:
      keys.append(k)
  for corpus, role, probe, length in keys:
    out.append(f"### {corpus} ({role}), {probe}, N = {length}\n")
    out.append("| method | B | read / step (of full) | n docs | Δ log-prob / token vs full "
               "[95% CI] | top-1 agreement with full [95% CI] |")
    out.append("| --- | --- | --- | --- | --- | --- |")
    sel = [r for r in rows if (r["corpus"], r["probe"], r["length"]) == (corpus, probe, length)]
    for r in sel:
      frac = read.get((r["length"], r["method"], r["budget"]))
      out.append(f"| {_label(r['method'])} | {r['budget'] if r['budget'] is not None else '-'} | "
                 f"{'-' if frac is None else f'{frac:.3f}'} | "
                 f"{r['n']} | {_ci(r['delta'], r['delta_lo'], r['delta_hi'])} | "
                 f"{_ci(r['agreement'], r['agreement_lo'], r['agreement_hi'], '{:.3f}')} |")
    full = sel[0]
    out.append(f"\nfull KV: mean log-prob / token {full['full_logprob']:.3f}, gold token is its "
               f"top-1 at {full['full_top1']:.3f} of positions; {full['target_tokens']} scored "
               "tokens per method.\n")
  pos = by_position(results["records"])
  if pos:
    names = [f"{lo}-{hi}" for lo, hi in POSITION_BUCKETS]
    out.append("### Δ log-prob / token vs full by target position (docs counted)\n")
    out.append("| corpus | probe | N | method | B | " + " | ".join(names) + " |")
    out.append("| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in names) + " |")
    for r in pos:
      cells = ["-" if r[n][0] is None else f"{r[n][0]:+.3f} ({r[n][1]})" for n in names]
      out.append(f"| {r['corpus']} | {r['probe']} | {r['length']} | {_label(r['method'])} | "
                 f"{r['budget']} | " + " | ".join(cells) + " |")
    out.append("")
  out.append("### Time (this machine)\n")
  out.append("| N | method | B | probes | compile s | run s | s per probe |")
  out.append("| --- | --- | --- | --- | --- | --- | --- |")
  mixed = False
  for t in results["timing"]:
    compile_s, run_s = t["compile_s"], t["run_s"]
    if t["method"] == "(prompt pass)" and t.get("batches") == 1:  # one batch: compile + run
      compile_s, run_s, mixed = None, (compile_s or 0.0) + run_s, True
    out.append(f"| {t['length']} | {_label(t['method'])} | {t['budget'] if t['budget'] else '-'} | "
               f"{t['rows']} | {'-' if compile_s is None else f'{compile_s:.1f}'} | "
               f"{run_s:.1f}{'*' if compile_s is None else ''} | "
               f"{run_s / max(1, t['rows']):.2f} |")
  if mixed:
    out.append("\n\\* one batch: its prompt pass's compile time is included.")
  return "\n".join(out) + "\n"

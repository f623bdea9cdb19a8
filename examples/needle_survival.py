"""Where a needle is lost: stage 1 (evicted at prefill) or stage 2 (not selected at decode).

    python examples/needle_survival.py --model gemma3 --task niah_single --length 2048 \\
        --samples 20 --budget 256 --methods snapkv rocketkv

For each sample: one prompt pass; the needle's answer tokens (the value's digits in the
haystack); then, for every attention layer the KV method compresses (a hybrid's sliding layers
are exact and left out) and every method spec, whether stage 1 kept all of them (`cache.pos`
after `rocketkv.prefill`) and whether stage 2 selects all of them for the last prompt query
(`rocketkv.select`; a method without a stage 2 reads what it kept). Beside them, the exact
attention of that query on the needle (max over query heads), which names the layers that
retrieve it, and how far apart its query heads are in norm (the largest ratio of two |q|_1 in
one KV head's group: what `group_dims="normalized"` evens out). Prints a table per method
(share of samples, per layer) and writes a JSON with every sample's rows (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import rocketkv_jax as rocketkv
from rocketkv_jax import methods as methods_lib
from rocketkv_jax.eval import harness, tasks, variants
from rocketkv_jax.eval.runner import Runner


def needle_positions(ids: list[int], value_ids: list[int]) -> list[int]:
  """Positions of the last occurrence of `value_ids` in `ids` (the needle, not the question)."""
  n = len(value_ids)
  for start in range(len(ids) - n, -1, -1):
    if ids[start:start + n] == value_ids:
      return list(range(start, start + n))
  raise ValueError("the answer's tokens are not in the prompt")


def survival(runner, ids, value_ids, specs, budget, max_new):
  """Rows {layer, method, kept, read, attention, norm_ratio} for one prompt."""
  length = len(ids)
  pp = runner.prompt_pass(np.asarray([ids], np.int32), np.asarray([length], np.int32))
  needle = needle_positions(ids, value_ids)
  config = runner.config
  rows = []
  for layer in range(config.num_layers):
    if layer in config.window_layers:
      continue
    k, v, qw = pp.k[layer][:, :, :length], pp.v[layer][:, :, :length], pp.q_window[layer]
    q = qw[:, :, -1]  # [1, Hq, D]: the last prompt token's query
    kk = np.asarray(k[0], np.float64)  # [Hkv, L, D]
    qq = np.asarray(q[0], np.float64).reshape(kk.shape[0], -1, kk.shape[-1])  # [Hkv, G, D]
    s = np.einsum("hgd,hld->hgl", qq, kk) / np.sqrt(kk.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attention = float(p[:, :, needle].sum(-1).max())
    l1 = np.abs(qq).sum(-1)  # [Hkv, G]
    norm_ratio = float((l1.max(-1) / np.maximum(l1.min(-1), 1e-30)).max())
    for spec in specs:
      plan = runner.plan(spec, budget, length, max_new)
      state = rocketkv.prefill(k, v, qw, plan, lengths=pp.lengths, layer=layer)
      cache = methods_lib.get(plan.method).view(state)
      n_valid = int(cache.length[0])
      pos = np.asarray(cache.pos[0])  # [Hkv, C]
      kept_sets = [set(pos[h, :n_valid].tolist()) for h in range(pos.shape[0])]
      kept = all(set(needle) <= ks for ks in kept_sets)
      if plan.method in ("rocketkv", "quest", "sparq", "exact_topk"):  # a stage-2 selection
        idx = np.asarray(rocketkv.select(q, state, plan))[0]  # [Hkv, K]
        read_sets = [set(pos[h, idx[h][idx[h] < n_valid]].tolist()) for h in range(pos.shape[0])]
        read = all(set(needle) <= rs for rs in read_sets)
      else:
        read = kept
      rows.append(dict(layer=layer, method=spec, kept=kept, read=read, attention=attention,
                       norm_ratio=norm_ratio))
  return rows


def summary(rows: list[dict], specs: list[str]) -> str:
  layers = sorted({r["layer"] for r in rows})
  n = len({r["sample"] for r in rows})
  out = [f"Share of {n} samples whose needle tokens are all kept by stage 1 / all read by stage "
         "2 for the last prompt query, per compressed layer; 'attention': mean over samples of "
         "that query's exact attention on the needle (max over query heads); 'query heads' norm "
         "ratio': mean of the largest |q|_1 ratio of two query heads sharing a KV head.", "",
         "| method | " + " | ".join(f"layer {i} kept / read" for i in layers) +
         " | any layer reads it |", "|---|" + "---|" * (len(layers) + 1)]
  for spec in specs:
    mine = [r for r in rows if r["method"] == spec]
    cells = []
    for i in layers:
      at = [r for r in mine if r["layer"] == i]
      cells.append(f"{np.mean([r['kept'] for r in at]):.2f} / {np.mean([r['read'] for r in at]):.2f}")
    anyr = np.mean([any(r["read"] for r in mine if r["sample"] == s)
                    for s in sorted({r["sample"] for r in mine})])
    out.append(f"| {spec} | " + " | ".join(cells) + f" | {anyr:.2f} |")
  for key, label, fmt in (("attention", "attention", ".3f"),
                          ("norm_ratio", "query heads' norm ratio", ".2f")):
    val = [np.mean([r[key] for r in rows if r["layer"] == i and r["method"] == specs[0]])
           for i in layers]
    out.append(f"| {label} | " + " | ".join(f"{a:{fmt}}" for a in val) + " | |")
  return "\n".join(out)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default=None,
                 help="smollm2 (the default), gemma3, an HF directory or a .gguf")
  p.add_argument("--task", default="niah_single", choices=("niah_single", "niah_multikey"))
  p.add_argument("--length", type=int, default=2048, help="context tokens (default 2048)")
  p.add_argument("--samples", type=int, default=20, help="default 20")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--budget", type=int, default=256, help="token budget B (default 256)")
  p.add_argument("--methods", nargs="+", default=["snapkv", "rocketkv"],
                 help="method names or variant specs (default: snapkv rocketkv)")
  p.add_argument("--prompt-format", default="auto", choices=("auto", "chat", "completion"))
  p.add_argument("--out", default=None, help="JSON of every sample's rows")
  a = p.parse_args(argv)
  try:  # every user error: one line, exit 2, the model's own checks included
    for m in a.methods:
      variants.parse(m)
    cfg = harness.SweepConfig(tasks=(a.task,), context_lengths=(a.length,),
                              budgets=(a.budget,), samples=a.samples, seed=a.seed,
                              prompt_format=a.prompt_format)
    for m in a.methods:
      variants.rocket_config(m, a.budget)
    model = rocketkv.models.load(rocketkv.models.resolve(a.model))
    harness.check_model(model, cfg)
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  tok = harness.sweep_tokenizer(model, cfg)
  runner = Runner(model)
  mn = tasks.MAX_NEW_TOKENS[a.task]
  rows = []
  for i in range(a.samples):
    s = tasks.make_sample(tok, a.task, a.length, i, a.seed)
    ids = tasks.prompt_ids(tok, s)
    value_ids = tok.encode(s.answers[0], add_special_tokens=False)
    for r in survival(runner, ids, value_ids, a.methods, a.budget, mn):
      rows.append(dict(r, sample=i, depth=s.meta.get("depth")))
    print(f"sample {i}: done", file=sys.stderr, flush=True)
  text = summary(rows, a.methods)
  print(text)
  if a.out:
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
      json.dump(dict(argv=sys.argv[1:] if argv is None else argv, rows=rows, table=text), f,
                indent=1)


if __name__ == "__main__":
  main()

"""The calibration of `group_dims`: how should a GQA group choose stage 2's r dims?

    python results/group_dims/calibration_rules.py --budget 256 > results/group_dims/calibration_b256.md
    python results/group_dims/calibration_rules.py --budget 512 > results/group_dims/calibration_b512.md

Gemma 3 270M, niah_single 2K (the calibration cell; every other cell of the study is held out),
the paper's RocketKV split. For each sample: one prompt pass, stage 1 as the library runs it,
then for the last prompt query of each global layer, in float64 NumPy written here, the chunk
scores under each candidate rule and whether the top_k slots they pick hold every token of the
needle (as examples/needle_survival.py's "read"). The rules (all but the last two read the same
bytes as the paper's):

  sum             the paper: the r dims with the largest |q| summed over the group; kmax / kmin
                  by the sign of the group-summed q (library: group_dims="sum")
  normalized      each head's |q| divided by its own sum first (library: group_dims="normalized")
  normalized_max  the dims by the largest normalized |q| of any head of the group
  normalized_sign normalized, and the bound's side by the sign of sum over the heads of q / |q|_1
  group_max       sum's dims, the group's per-head softmaxes reduced by max instead of sum
  own_dims        each query head its own r dims and bounds (G x the bound rows read)
  upper_bound     sum's dims, each head its exact upper bound max(q kmin, q kmax) (2x rows)
  exact           the oracle: exact scores over the kept slots
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import rocketkv_jax as rocketkv
import rocketkv_jax.models as M
from rocketkv_jax import methods as methods_lib
from rocketkv_jax.eval import harness, tasks
from rocketkv_jax.eval.runner import Runner

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from needle_survival import needle_positions  # noqa: E402

RULES = ("sum", "normalized", "normalized_max", "normalized_sign", "group_max", "own_dims",
         "upper_bound", "exact")


def softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def scale(q, dims, d):
  """SparQ's 1 / sqrt(D * sum|q_r| / sum|q|) per head; q [G, D]."""
  return 1 / np.sqrt(d * np.abs(q[..., dims]).sum(-1) / np.abs(q).sum(-1))


def chunk_scores(rule, q, k, kmin, kmax, r):
  """q [G, D], k [n, D], kmin / kmax [NC, D] -> per-chunk scores [NC] (per-slot for exact)."""
  g, d = q.shape
  a = np.abs(q)
  w = a / a.sum(1, keepdims=True)
  if rule == "exact":
    return softmax(q @ k.T / np.sqrt(d)).sum(0)
  if rule == "own_dims":
    out = []
    for x in q:
      dims = np.argsort(-np.abs(x), kind="stable")[:r]
      b = np.where(x[dims] > 0, kmax[:, dims], kmin[:, dims])
      out.append(b @ x[dims] * scale(x[None], dims, d)[0])
    return softmax(np.stack(out)).sum(0)
  weights = {"normalized": w.sum(0), "normalized_sign": w.sum(0), "normalized_max": w.max(0)}
  dims = np.argsort(-weights.get(rule, a.sum(0)), kind="stable")[:r]
  qd = q[:, dims]
  if rule == "upper_bound":
    logits = np.maximum(qd[:, None] * kmin[None][..., dims], qd[:, None] * kmax[None][..., dims])
    logits = logits.sum(-1)
  else:
    signed = q / a.sum(1, keepdims=True) if rule == "normalized_sign" else q
    side = signed.sum(0)[dims] > 0
    logits = qd @ np.where(side, kmax[:, dims], kmin[:, dims]).T
  p = softmax(logits * scale(q, dims, d)[:, None])
  return p.max(0) if rule == "group_max" else p.sum(0)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--budget", type=int, default=256)
  p.add_argument("--samples", type=int, default=20)
  p.add_argument("--length", type=int, default=2048)
  a = p.parse_args()
  model = M.load(M.gemma3_path())
  tok = harness.sweep_tokenizer(model, harness.SweepConfig(tasks=("niah_single",)))
  runner = Runner(model)
  mn = tasks.MAX_NEW_TOKENS["niah_single"]
  hits: dict[tuple[int, str], list[bool]] = {}
  for i in range(a.samples):
    s = tasks.make_sample(tok, "niah_single", a.length, i, 0)
    ids = tasks.prompt_ids(tok, s)
    needle = set(needle_positions(ids, tok.encode(s.answers[0], add_special_tokens=False)))
    n_ids = len(ids)
    pp = runner.prompt_pass(np.asarray([ids], np.int32), np.asarray([n_ids], np.int32))
    plan = runner.plan("rocketkv", a.budget, n_ids, mn)
    for layer in range(runner.config.num_layers):
      if layer in runner.config.window_layers:
        continue
      qw = pp.q_window[layer]
      state = rocketkv.prefill(pp.k[layer][:, :, :n_ids], pp.v[layer][:, :, :n_ids], qw, plan,
                               lengths=pp.lengths, layer=layer)
      cache = methods_lib.get(plan.method).view(state)
      n = int(cache.length[0])
      pos = np.asarray(cache.pos[0])  # [Hkv, C] prompt position of each slot
      k = np.asarray(cache.k[0], np.float64)[:, :n]  # [Hkv, n, D]
      hkv, _, d = k.shape
      q = np.asarray(qw[0, :, -1], np.float64).reshape(hkv, -1, d)  # [Hkv, G, D]
      cs = plan.chunk_size
      nc = -(-n // cs)
      kp = np.concatenate([k, np.full((hkv, nc * cs - n, d), np.nan)], 1).reshape(hkv, nc, cs, d)
      kmin, kmax = np.nanmin(kp, 2), np.nanmax(kp, 2)
      for rule in RULES:
        read = True
        for h in range(hkv):
          sc = chunk_scores(rule, q[h], k[h], kmin[h], kmax[h], plan.r)
          if rule == "exact":
            slots = np.argsort(-sc, kind="stable")[:plan.top_k]
          else:  # every slot takes its chunk's score; ties to the lower chunk
            order = sorted(range(nc), key=lambda c: (-sc[c], c))
            slots = [c * cs + j for c in order for j in range(cs) if c * cs + j < n][:plan.top_k]
          read &= needle <= set(pos[h, slots].tolist())
        hits.setdefault((layer, rule), []).append(read)
    print(f"sample {i}: done", file=sys.stderr, flush=True)
  layers = sorted({layer for layer, _ in hits})
  print(f"Gemma 3 270M, niah_single {a.length}, B = {a.budget} (chunk {plan.chunk_size}, "
        f"r {plan.r}, top_k {plan.top_k}, capacity {plan.capacity}), {a.samples} samples: share "
        "whose needle tokens are all among the top_k slots the rule picks for the last prompt "
        "query.\n")
  print("| rule | " + " | ".join(f"layer {i}" for i in layers) + " |")
  print("|---|" + "---|" * len(layers))
  for rule in RULES:
    print(f"| {rule} | " + " | ".join(f"{np.mean(hits[(i, rule)]):.2f}" for i in layers) + " |")


if __name__ == "__main__":
  main()

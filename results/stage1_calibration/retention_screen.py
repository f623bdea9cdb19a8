"""Stage-1 screen: how often each (layer, KV head) keeps every digit of the gold number, under
candidate reductions of the window's probabilities, at equal_read's capacity (prompt passes
only, no decoding). Run on the calibration family only (niah_multikey), to pick which rule to
calibrate (results/stage1_calibration/README.md, "Calibration, adopted: stage 1 reduces the window by its max").

    python results/stage1_calibration/retention_screen.py niah_multikey 4096 20 128,256
"""
import sys, numpy as np, jax, jax.numpy as jnp
from jax import lax
import rocketkv_jax.models as M
from rocketkv_jax.eval import tasks as T, harness
from rocketkv_jax.eval.runner import Runner
from rocketkv_jax.evict import pooled_candidate_scores
from rocketkv_jax.ops import group_queries, masked_softmax

task, length, nsamp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
budgets = [int(x) for x in sys.argv[4].split(",")]
model = M.load(M.smollm2_path(), dtype=jnp.float32)
tok = model.tokenizer
mn = T.MAX_NEW_TOKENS[task]
p = harness.padded_len(model, length, mn)
runner = Runner(model, window_size=32)
ss = [T.make_sample(tok, task, length, i, 0, target_tokens=p) for i in range(nsamp)]

def find(ids, sub):
  out = []
  for i in range(len(ids) - len(sub) + 1):
    if ids[i:i + len(sub)] == sub:
      out += list(range(i, i + len(sub)))
  return out

@jax.jit
def probs_layer(qw, k, lengths):
  w, d = qw.shape[2:]
  l = k.shape[2]
  q = group_queries(qw, k.shape[1])
  logits = jnp.einsum("bhgwd,bhld->bhgwl", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(1.0 * d)
  qpos = lengths[:, None] - w + jnp.arange(w)
  kpos = jnp.arange(l)
  mask = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < lengths[:, None, None])
  return masked_softmax(logits, mask[:, None, None])  # [B,H,G,W,L]

RULES = {
  "sum_wg": lambda pr: pr.sum((2, 3)),
  "max_g": lambda pr: pr.sum(3).max(2),
  "max_w": lambda pr: pr.sum(2).max(2),
  "max_wg": lambda pr: pr.max((2, 3)),
  "sqrt_sum": lambda pr: jnp.sqrt(pr).sum((2, 3)),
}

def keep(scores, lengths, pb, kernel):
  l = scores.shape[-1]
  pri = pooled_candidate_scores(scores, lengths, 32, kernel)
  kpos = jnp.arange(l)[None, None, :]
  must = (kpos >= (lengths - 32)[:, None, None]) & (kpos < lengths[:, None, None])
  pri = jnp.where(must, jnp.inf, pri)
  _, idx = lax.top_k(pri, pb)
  return idx

res = {}
for start in range(0, nsamp, 10):
  batch = ss[start:start + 10]
  ids = [T.prompt_ids(tok, s) for s in batch]
  tokens = np.zeros((len(batch), p), np.int32)
  lengths = np.array([len(x) for x in ids], np.int32)
  for i, x in enumerate(ids):
    tokens[i, :len(x)] = x
  pp = runner.prompt_pass(tokens, lengths)
  targets = [find(x, tok.encode(s.answers[0], add_special_tokens=False)) for x, s in zip(ids, batch)]
  lj = jnp.asarray(lengths)
  nl = pp.k.shape[0]
  for b in budgets:
    pb = runner.plan("rocketkv:stage2=quant,quant_capacity=equal_read", b, p, mn).prompt_budget
    for layer in range(nl):
      pr = probs_layer(pp.q_window[layer], pp.k[layer][:, :, :p], lj)
      for rname, rule in RULES.items():
        for kern in ((63, 31) if rname == "sum_wg" else (63,)):
          idx = np.asarray(keep(rule(pr), lj, pb, kern))
          for i in range(len(batch)):
            tg = np.array(targets[i])
            for h in range(idx.shape[1]):
              frac = np.isin(tg, idx[i, h]).mean()
              res.setdefault((b, rname, kern), []).append((start + i, layer, h, frac))
for key, v in sorted(res.items()):
  a = np.array(v)
  frac = a[:, 3]
  # per sample: mean over (layer, head); and share of (layer, head) keeping every digit
  per_s = [frac[a[:, 0] == s].mean() for s in range(nsamp)]
  full = [(frac[a[:, 0] == s] == 1).mean() for s in range(nsamp)]
  print(key, f"mean kept {np.mean(per_s):.4f}  all-digits heads {np.mean(full):.4f}  worst sample {min(per_s):.3f}")

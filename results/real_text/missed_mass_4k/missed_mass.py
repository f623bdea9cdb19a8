"""Experiment (not library code): where the attention mass that stage 1 lets go sits.

For each calibration document's continuation probe (python_docs, N context tokens, the next 48
teacher-forced), one prompt pass over context + target keeps every layer's K and the queries of
the last 32 context tokens (stage 1's window) and of the 48 target tokens. Stage 1 runs on the
context as the method's plan says; then, for each target token's query, exact causal
attention over context + earlier targets (softmax per query head) gives the mass on the context
tokens stage 1 evicted ("missed"), split by where they sit (the first 4 tokens: sinks; the 512
before the window; the rest) and by KV head. Global (non-sliding) layers only: a sliding layer
keeps its window whole in every method. Stage 2's read is not modelled: this is stage 1's part.

    python results/real_text/missed_mass_4k/missed_mass.py smollm2 gemma3 --docs 8 \
        --methods recommended,rocketkv,snapkv --out runs/missed_mass_4k
"""
import argparse, json, os, sys
import numpy as np
import jax, jax.numpy as jnp
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks"))
import bench_common
import rocketkv_jax as rocketkv
from rocketkv_jax import methods as methods_lib
from rocketkv_jax.eval import corpora, real_text
from rocketkv_jax.eval.runner import Runner
from rocketkv_jax.models import llama

W, T = 32, 48
REGIONS = ("sinks (first 4)", "far (4 .. N-544)", "near (N-544 .. N-32)", "window (last 32)")


def region_of(n):
  j = np.arange(n)
  return np.select([j < 4, j < n - 544, j < n - 32], [0, 1, 2], 3)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("models", nargs="+")
  ap.add_argument("--length", type=int, default=4096)
  ap.add_argument("--budget", type=int, default=256)
  ap.add_argument("--methods", default="recommended,rocketkv")
  ap.add_argument("--docs", type=int, default=8)
  ap.add_argument("--out", default="runs/missed_mass")
  a = ap.parse_args()
  cfg = real_text.RealTextConfig(corpora=(corpora.CALIBRATION,), lengths=(a.length,),
                                 probes=("continuation",), docs=a.docs)
  out = {"command": "python " + " ".join(sys.argv), "rows": []}
  for name in a.models:
    model = rocketkv.models.load(bench_common.resolve_model(name))
    mc = model.config
    probes, _ = real_text.make_probes(model.tokenizer, corpora.load(corpora.CALIBRATION), cfg)
    runner = Runner(model)
    glob_layers = [i for i in range(mc.num_layers) if i not in set(mc.window_layers or ())]
    keep = lambda k, v, qw, layer: (k, qw)

    @jax.jit
    def pass_(tokens, lengths):
      return llama.prompt_pass(model.params, tokens, lengths, config=mc, window=W + T,
                               per_layer=keep)[1]

    n = a.length
    reg = region_of(n)
    ms = a.methods.split(",")
    plans = {m: runner.plan(m, a.budget, n, T) for m in ms}
    missed = {m: np.zeros((len(probes), len(glob_layers), mc.num_kv_heads, 4)) for m in ms}
    total = np.zeros((len(probes), len(glob_layers), mc.num_kv_heads))  # mass on the context
    for p_i, pr in enumerate(probes):
      ids = np.asarray(list(pr.context) + list(pr.target), np.int32)[None]
      outs = pass_(jnp.asarray(ids), jnp.asarray([ids.shape[1]], jnp.int32))
      for l_i, layer in enumerate(glob_layers):
        k, qw = outs[layer]  # [1, Hkv, N+T, D], [1, Hq, W+T, D]
        q = np.asarray(qw[0, :, W:], np.float64)  # [Hq, T, D]
        kk = np.asarray(k[0], np.float64)  # [Hkv, N+T, D]
        g = q.shape[0] // kk.shape[0]
        s = np.einsum("hgtd,hld->hgtl", q.reshape(kk.shape[0], g, T, -1), kk) / np.sqrt(kk.shape[-1])
        mask = np.arange(n + T)[None, :] <= (n + np.arange(T))[:, None]  # [T, N+T] causal
        s = np.where(mask, s, -np.inf)
        prob = np.exp(s - s.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        ctx = prob[..., :n].mean(axis=(1, 2))  # [Hkv, N]: mean over group heads and targets
        total[p_i, l_i] = ctx.sum(-1)
        for m in ms:
          plan, meth = plans[m], methods_lib.get(plans[m].method)
          if layer in set(meth.dense_layers(plan)):
            continue  # keeps every token
          kc = k[:, :, :n]
          state = rocketkv.prefill(kc, kc, qw[:, :, :W], plan, lengths=jnp.asarray([n]),
                                   layer=layer)
          cache = meth.view(state)
          pos, ln = np.asarray(cache.pos[0]), int(cache.length[0])
          kept = np.zeros((mc.num_kv_heads, n), bool)
          for h in range(mc.num_kv_heads):
            kept[h, pos[h, :ln]] = True
          for r in range(4):
            missed[m][p_i, l_i, :, r] = (ctx * (~kept & (reg == r))).sum(-1)
      print(f"{name}: document {p_i + 1}/{len(probes)}", file=sys.stderr, flush=True)
    for m in ms:
      mis = missed[m].sum(-1)  # [P, L, H]
      row = dict(model=name, method=m, budget=a.budget, length=n, docs=len(probes),
                 layers=glob_layers, context_mass=float(total.mean()),
                 missed_mass=float(mis.mean()),
                 missed_by_region={REGIONS[r]: float(missed[m][..., r].mean()) for r in range(4)},
                 missed_by_layer=[float(x) for x in mis.mean(axis=(0, 2))],
                 missed_by_head=[float(x) for x in mis.mean(axis=(0, 1))],
                 worst_head_share=float(np.mean(mis.max(-1) / np.maximum(mis.sum(-1), 1e-12))))
      out["rows"].append(row)
      print(json.dumps(row), flush=True)
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "missed_mass.json"), "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()

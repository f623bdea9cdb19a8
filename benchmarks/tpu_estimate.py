"""On paper, for TPU: HBM bytes and DMAs per decode step of RocketKV's TPU kernels against dense
attention, from the kernels' block specs (kernels/tpu_*.py) and the plan. No TPU is used.

    python benchmarks/tpu_estimate.py                    # Llama-3.1-8B, 32K and 128K, B 1 and 8
    python benchmarks/tpu_estimate.py --dma-ns 20 --page-sizes 1 4 16
    python benchmarks/tpu_estimate.py --configs recommended  # the recommended config alone

Two configs: "paper" (`RocketConfig(token_budget)`, stage 2 the chunk scores) and
"recommended" (`RocketConfig.recommended(token_budget)`, stage 2 the 4-bit key codes of every
kept slot, `Quant(capacity="equal_read")`). Per layer and step (bf16 cache), per (batch row,
KV head):
- chunk scores (`tpu_approx_bounds_scores`, paper): r row strips of `block_c` chunks per chunk
  block, one DMA each: bytes r * NC * 2, DMAs r * ceil(NC / block_c). The "all rows" variant
  (one [2D, block_c] block per step, not built) reads 2D rows in ceil(NC / block_c) DMAs.
- code logits (`tpu_quant_slot_logits`, recommended): whole [D, block_n] blocks of the packed
  codes [D, Nb], Nb = ceil(C * bits / 8) bytes, one DMA each: bytes D * Nb, DMAs = grid steps
  = ceil(Nb / block_n). The r-rows variant (not built) would read r * Nb bytes in
  r * ceil(Nb / block_n) DMAs; the script prints both.
- attention (`tpu_sparse_attention`): pages of P rows holding the top_k selected slots, one DMA
  per page for K and one for V: bytes 2 * pages * P * D * 2. The selection is whole chunks of
  `chunk_size` slots (single slots for the codes): `best` = the selected rows packed into
  ceil(top_k / P) pages (clustered attention); `spread` = the expected pages when the selected
  chunks fall uniformly at random over the cache (a pessimistic spread).
- dense: every context token's K and V (what dense ragged paged attention reads), in pages of
  16 tokens holding all KV heads' K and V: one DMA per page.
Time model (an assumption, not a measurement): a kernel takes max(bytes / HBM bandwidth,
DMAs * dma_ns) + grid steps * step_us; the XLA glue between the kernels (top-k over the slot
scores, the page table's sort) is left out, and so are the scores' fp32 logits the kernels write
(G * 4 bytes per chunk or slot) and the MXU / VPU time of the scores.
"""

from __future__ import annotations

import argparse
import math

import rocketkv_jax as rocketkv

CHIPS = {"v5e": 819e9, "v6e": 1640e9}  # HBM bytes / s
DENSE_PAGE = 16  # tokens per dense page (all KV heads)
BLOCK_C = 2048  # tpu_approx_bounds_scores' default block_c
BLOCK_N = 2048  # tpu_quant_slot_logits' default block_n (code bytes per grid step)
CONFIGS = ("paper", "recommended")


def pages_spread(top_k: int, chunk: int, capacity: int, p: int) -> float:
  """Expected pages of p rows touched when top_k / chunk chunks are picked uniformly at random
  among the cache's chunks (each page holds ~p / chunk chunks, or a chunk spans chunk / p)."""
  nc = math.ceil(capacity / chunk)
  picked = math.ceil(top_k / chunk)
  if chunk >= p:
    return picked * math.ceil(chunk / p)
  per_page = p / chunk
  untouched = (1.0 - picked / nc) ** per_page
  return math.ceil(capacity / p) * (1.0 - untouched)


def code_bytes(plan) -> int:
  """Nb: bytes of one dim's packed codes over the plan's capacity (`QuantState.codes`)."""
  per = 8 // plan.stage2.bits
  return math.ceil(plan.capacity / per)


def make_plan(config, ctx, budget, d):
  cfg = (rocketkv.RocketConfig(token_budget=budget) if config == "paper"
         else rocketkv.RocketConfig.recommended(budget))
  return rocketkv.plan(cfg, ctx, 256, d)


def estimate(ctx, batch, layers, hq, hkv, d, budget, p, dma_ns, step_us, bw, itemsize=2,
             config="paper"):
  plan = make_plan(config, ctx, budget, d)
  r, cs, top_k, cap = plan.r, plan.chunk_size, plan.top_k, plan.capacity
  heads = batch * hkv
  t = lambda nbytes, dmas, steps: max(nbytes / bw, dmas * dma_ns * 1e-9) + steps * step_us * 1e-6
  if config == "paper":  # chunk scores, picked rows (the kernel as built)
    nc = plan.num_chunks
    s_bytes = heads * r * nc * itemsize
    s_dmas = heads * r * math.ceil(nc / BLOCK_C)
    s_steps = heads * math.ceil(nc / BLOCK_C)
  else:  # code logits, whole [D, block_n] blocks (the kernel as built); slots picked one by one
    nb, cs = code_bytes(plan), 1
    s_steps = heads * math.ceil(nb / BLOCK_N)
    s_bytes, s_dmas = heads * d * nb, s_steps
  # attention over pages
  rows = {}
  for name, pages in (("best", math.ceil(top_k / p)), ("spread", pages_spread(top_k, cs, cap, p))):
    a_bytes = heads * 2 * pages * p * d * itemsize
    a_dmas = heads * 2 * pages
    rows[name] = (s_bytes + a_bytes, s_dmas + a_dmas,
                  t(s_bytes, s_dmas, s_steps) + t(a_bytes, a_dmas, heads))
  d_bytes = batch * ctx * hkv * d * 2 * itemsize
  d_dmas = batch * math.ceil(ctx / DENSE_PAGE)
  dense = (d_bytes, d_dmas, t(d_bytes, d_dmas, batch))
  scale = lambda x: (x[0] * layers, x[1] * layers, x[2] * layers)
  return plan, scale(dense), {k: scale(v) for k, v in rows.items()}


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
  ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
  ap.add_argument("--budget", type=int, default=2048, help="RocketConfig.token_budget")
  ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
  ap.add_argument("--dma-ns", type=float, default=50.0,
                  help="assumed issue cost of one DMA descriptor (unmeasured)")
  ap.add_argument("--step-us", type=float, default=0.35,
                  help="assumed Pallas TPU grid-step overhead (unmeasured here)")
  ap.add_argument("--model", default="llama31_8b", choices=["llama31_8b"])
  ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS,
                  help="paper: RocketConfig(token_budget); recommended: "
                       "RocketConfig.recommended(token_budget), stage2 quant")
  args = ap.parse_args()
  layers, hq, hkv, d = 32, 32, 8, 128  # Llama-3.1-8B
  print(f"Llama-3.1-8B ({layers} layers, Hq {hq}, Hkv {hkv}, D {d}, bf16), RocketKV "
        f"{' / '.join(args.configs)} config, token_budget {args.budget}; per decode step, all "
        f"layers. Model: "
        f"max(bytes / BW, DMAs x {args.dma_ns:g} ns) + grid steps x {args.step_us:g} us. "
        f"No TPU timing exists.\n")
  head = (f"| config | ctx | B | P | plan (C, chunk, r, top_k) | dense MB | dense DMAs | rocket MB "
          f"best / spread | rocket DMAs best / spread | " +
          " | ".join(f"{c} dense ms | {c} rocket ms best / spread | {c} speed-up best / spread"
                     for c in CHIPS) + " |")
  print(head)
  print("|" + "---|" * (head.count("|") - 1))
  for config in args.configs:
    for ctx in args.contexts:
      for b in args.batches:
        for p in args.page_sizes:
          cells = []
          for chip, bw in CHIPS.items():
            plan, dense, rk = estimate(ctx, b, layers, hq, hkv, d, args.budget, p, args.dma_ns,
                                       args.step_us, bw, config=config)
            cells.append(f"{dense[2] * 1e3:.2f} | {rk['best'][2] * 1e3:.2f} / "
                         f"{rk['spread'][2] * 1e3:.2f} | {dense[2] / rk['best'][2]:.1f}x / "
                         f"{dense[2] / rk['spread'][2]:.1f}x")
          chunk = plan.chunk_size or 1  # the codes pick single slots
          print(f"| {config} | {ctx // 1024}K | {b} | {p} | {plan.capacity}, {chunk}, "
                f"{plan.r}, {plan.top_k} | {dense[0] / 1e6:.0f} | {dense[1]:.0f} | "
                f"{rk['best'][0] / 1e6:.0f} / {rk['spread'][0] / 1e6:.0f} | "
                f"{rk['best'][1]:.0f} / {rk['spread'][1]:.0f} | " + " | ".join(cells) + " |")
  if "recommended" in args.configs:
    print("\nrecommended, the code logits alone per decode step (all layers): whole blocks as "
          "built vs the r picked rows (not built)")
    for ctx in args.contexts:
      for b in args.batches:
        plan = make_plan("recommended", ctx, args.budget, d)
        nb, heads = code_bytes(plan), b * hkv * layers
        blocks = math.ceil(nb / BLOCK_N)
        print(f"- {ctx // 1024}K, B {b}: Nb {nb} bytes, r {plan.r} of D {d}: whole blocks "
              f"{heads * d * nb / 1e6:.0f} MB in {heads * blocks} DMAs; r rows "
              f"{heads * plan.r * nb / 1e6:.0f} MB in {heads * plan.r * blocks} DMAs; logits "
              f"written {heads * (hq // hkv) * plan.capacity * 4 / 1e6:.0f} MB")


if __name__ == "__main__":
  main()

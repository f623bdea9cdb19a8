"""The fused stage-2 decode step (kernels/fused_decode.py) on a GPU: correctness, kernel count,
time, against the unfused Pallas chain and the XLA path. One Llama-3.1-8B layer (Hq 32, Hkv 8,
D 128), bf16, RocketKV's split for the context and budget: the paper's stage 2 ("minmax") and
the small-head configuration ("quant": stage2=quant, quant_capacity=equal_read).

    python benchmarks/fused_step.py --deadline-s 60 --json out.json   # GPU
    python benchmarks/fused_step.py --smoke                           # CPU: interpret mode, tiny

For each (batch, context, budget):
  * check: the fused kernels compiled vs the XLA path at precision "highest" on the same random
    cache (ragged lengths at batch > 1): ||out - ref|| / ||ref|| and the share of the XLA path's
    valid selected slots the fused selection also took (1.0 = the same slots);
  * kernels: launches per call in the compiled program (entry instructions other than
    parameters, tuples, bitcasts and constants) for fused / chain / XLA;
  * time: microseconds per call, `benchmarks/kernel_bench.py`'s loop (serialised calls in one
    jitted fori_loop, median of 5), and the empty-loop floor measured the same way.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import rocketkv_jax as rocketkv
from rocketkv_jax.methods.stage2 import quant as stage2_quant
from rocketkv_jax.kernels import fused_decode

import kernel_bench as kb  # benchmarks/kernel_bench.py: its random caches, loop timer, checks

T0 = time.perf_counter()


@functools.partial(jax.jit, static_argnames=("plan", "impl"))
def _fused(q, cache, plan, impl):
  return plan.stage2.attend(q, cache, plan, impl=impl)  # MinMax.attend: fused_step.select_attend


@functools.partial(jax.jit, static_argnames=("plan", "impl"))
def _chain(q, cache, plan, impl):
  idx = rocketkv.select(q, cache, plan, impl=impl)
  return rocketkv.attend(q, cache, idx, impl=impl)


@functools.partial(jax.jit, static_argnames=("plan", "impl"))
def _fused_quant(q, state, plan, impl):
  return plan.stage2.attend(q, state, plan, impl=impl)  # Quant.attend: fused_step.quant_attend


@functools.partial(jax.jit, static_argnames=("plan", "impl"))
def _chain_quant(q, state, plan, impl):
  return stage2_quant.decode_attend(q, state, plan, impl=impl)


def launches(f, *args) -> int:
  """Kernel-launching instructions in the compiled program's entry computation."""
  text = f.lower(*args).compile().as_text()
  entry = text[text.index("ENTRY"):]
  entry = entry[:entry.index("\n}")]
  skip = ("parameter(", "tuple(", "get-tuple-element(", "bitcast(", "constant(")
  return sum(1 for line in entry.splitlines()[1:]
             if "=" in line and not any(s in line for s in skip))


def run_case(variant, b, ctx, budget, hq, hkv, d, interpret, iters) -> dict:
  extra = dict(stage2=rocketkv.Quant(capacity="equal_read")) if variant == "quant" else {}
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=budget, **extra), ctx - 100, 100, d)
  lengths = kb._ragged(b, plan.capacity) if b <= 4 else [plan.capacity - 37] * b
  key = jax.random.PRNGKey(b * 7 + budget)
  cache = kb._random_cache(key, b, hkv, plan.capacity, d, lengths, plan.chunk_size or 1,
                           jnp.bfloat16)
  q = jax.random.normal(jax.random.fold_in(key, 1), (b, hq, d), jnp.float32).astype(jnp.bfloat16)
  if variant == "quant":
    state = kb._quant_state(cache, plan)
    fused, chain, select = _fused_quant, _chain_quant, stage2_quant.select_quant
  else:
    state, fused, chain, select = cache, _fused, _chain, rocketkv.select
  kernels_impl = "interpret" if interpret else "pallas"  # compiled on a GPU
  rec = dict(kind="case", variant=variant, batch=b, ctx=ctx, budget=budget,
             capacity=plan.capacity, chunk=plan.chunk_size, r=plan.r, top_k=plan.top_k)
  try:
    out = fused(q, state, plan, kernels_impl)
    ref = kb._highest(functools.partial(chain, plan=plan, impl="xla"), q, state)
    rec["err"] = float(np.linalg.norm(np.asarray(out, np.float32) - np.asarray(ref))
                       / np.linalg.norm(np.asarray(ref)))
    top_k = min(plan.top_k, plan.capacity)
    if variant == "quant":
      _, taken = fused_decode.fused_quant_attend(
          q, cache.k, cache.v, state.codes, state.step, cache.length, r=plan.r,
          bits=state.bits, top_k=top_k, interpret=interpret, return_taken=True)
      cs = 1
    else:
      _, taken = fused_decode.fused_select_attend(
          q, cache.k, cache.v, cache.bounds, cache.length, chunk_size=plan.chunk_size,
          r=plan.r, top_k=top_k, interpret=interpret, return_taken=True)
      cs = plan.chunk_size
    idx = np.asarray(kb._highest(
        jax.jit(functools.partial(select, plan=plan, impl="xla")), q, state))
    taken, length = np.asarray(taken), np.asarray(cache.length)
    share = []
    for bi in range(b):
      for h in range(hkv):
        want = {int(s) for s in idx[bi, h] if s < length[bi]}
        got = {c * cs + j for c in np.nonzero(taken[bi, h])[0] for j in range(taken[bi, h, c])}
        share.append(len(want & got) / max(len(want), 1))
    rec["same_slots_mean"], rec["same_slots_min"] = float(np.mean(share)), float(min(share))
    runs = (("fused", fused, kernels_impl), ("chain", chain, kernels_impl), ("xla", chain, "xla"))
    rec["launches"] = {name: launches(f, q, state, plan, im) for name, f, im in runs}
    for name, f, im in runs:
      rec[f"{name}_us"], _ = kb._time_us(functools.partial(f, plan=plan, impl=im), q, state,
                                         iters=iters)
  except Exception as e:  # noqa: BLE001 - report and go on
    rec["error"] = kb._err(e, 1500)
  return rec


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cases", default="1,32768,256;4,32768,256;1,131072,256;1,32768,1024;"
                 "16,32768,256;4,131072,4096", help="batch,context,budget;...")
  p.add_argument("--iters", type=int, default=30)
  p.add_argument("--deadline-s", type=float, default=1e9)
  p.add_argument("--json", default=None)
  p.add_argument("--smoke", action="store_true", help="CPU: interpret mode, tiny shapes")
  args = p.parse_args(argv)
  interpret = args.smoke or jax.default_backend() != "gpu"
  hq, hkv, d = (8, 2, 32) if interpret else (32, 8, 128)
  cases = [tuple(int(x) for x in c.split(",")) for c in args.cases.split(";")]
  if interpret:
    cases, args.iters = [(2, 512, 64)], 2
  dev = jax.devices()[0]
  print(f"jax {jax.__version__}, {dev.device_kind} ({jax.default_backend()})"
        + ("  [interpret mode: timings meaningless]" if interpret else ""), flush=True)
  records = []
  floor, _ = kb._time_us(lambda a: a * 2, jnp.ones((1024,), jnp.bfloat16), iters=args.iters)
  print(f"empty loop iteration: {floor:.1f} us", flush=True)
  records.append(dict(kind="floor", us=floor))
  for b, ctx, budget in cases:
    if time.perf_counter() - T0 > args.deadline_s:
      print(f"skipped (past --deadline-s): {b},{ctx},{budget}", flush=True)
      records.append(dict(kind="skipped", batch=b, ctx=ctx, budget=budget))
      continue
    for variant in ("minmax", "quant"):
      rec = run_case(variant, b, ctx, budget, hq, hkv, d, interpret, args.iters)
      records.append(rec)
      print(json.dumps(rec), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(jax=jax.__version__, device=dev.device_kind, argv=sys.argv[1:],
                     records=records), f, indent=1)
  bad = [r for r in records if r["kind"] == "case" and ("error" in r or r["err"] > 2e-2)]
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())

"""End-to-end benchmark: SmolLM2-135M prefill and decode in fp32 and bf16, full KV vs RocketKV,
with transformers (PyTorch CPU, full KV, same dtype) on the same prompt as the outside reference.

    python benchmarks/end_to_end.py                       # 2K, 4K, 8K prompts, fp32 and bf16
    python benchmarks/end_to_end.py --lengths 2048,4096 --out benchmarks/end_to_end_results.md
    python benchmarks/end_to_end.py --lengths 4096 --skip-layers 2   # + rocketkv:skip_layers=2

`--skip-layers N` adds, at each budget, RocketKV with `RocketConfig.skip_layers=N` (an ablation:
the first N layers keep their whole cache and attend densely), labelled `rocketkv:skip_layers=N`.

Prompt: the chat-templated `niah_single` haystack (`rocketkv_jax/eval/tasks.py`, sample 0) of
at most --lengths tokens (`bench_common.niah_prompt_ids`, as in throughput.py), the same ids for
both systems; the table's prompt column is its token count.

For each prompt length and dtype: our full KV, RocketKV at each budget, then transformers in a
subprocess (so its peak RSS is its own). Then the bf16 targets of issue #15 as ratios of rows
measured in this run: our bf16 prefill / our fp32 prefill (target <= 0.5 at 4K and 8K), our bf16
prefill / transformers' bf16 prefill (<= 0.7), our bf16 decode / our fp32 decode (<= 1).
The header says whether XLA:CPU runs bf16 dots natively on this CPU (`models/precision.py`);
where it does not, it runs them as fp32 and our bf16 computes in fp32 with bf16 weights and
caches.
Reported:
  * prefill s: the prompt pass (ours: after compilation, which is listed separately).
  * decode ms/tok: mean over `--new-tokens` greedy steps (EOS ignored).
  * KV kept (tokens): prompt tokens cached per KV head after prefill, the mean over layers
    (`generate`'s `kv_tokens_kept`; dense layers, e.g. `--skip-layers`, keep the whole prompt).
  * KV MB: the KV cache kept for decoding (ours: every layer's state incl. metadata;
    transformers: its DynamicCache at the end).
  * floor rows: the prompt pass's matmul FLOPs divided by this machine's fp32 matmul rate
    measured in the same run (XLA's `jnp.dot`) -- a lower bound for any fp32 prefill that
    uses a matmul no faster than XLA's.
  * peak MB: ours = XLA's estimate for the larger compiled program (params + cache + temps);
    transformers = the worker process's peak RSS (includes the Python/torch runtime).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import bench_common


def _hf_worker(n: int, new_tokens: int, dtype: str) -> None:
  """Runs in a subprocess: transformers prefill + decode on the same ids, prints JSON."""
  import torch
  from transformers import AutoModelForCausalLM

  import rocketkv_jax as rocketkv

  torch.set_num_threads(os.cpu_count() or 1)
  path = rocketkv.models.smollm2_path()
  from rocketkv_jax.models import gguf_loader  # our tokenizer only, not our weights
  from rocketkv_jax.models.tokenizer import Tokenizer

  meta = gguf_loader.read_metadata(gguf_loader.open_gguf(path))
  ids = bench_common.niah_prompt_ids(Tokenizer.from_gguf_fields(meta), n)
  directory, name = os.path.split(path)
  model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                               dtype=getattr(torch, dtype)).eval()
  with torch.no_grad():
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    # logits for the last position only, as transformers' own generate() asks for
    out = model(x, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t0
    past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
      out = model(nxt, past_key_values=past, use_cache=True)
      past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    decode = (time.perf_counter() - t0) / max(new_tokens - 1, 1)
  kv = sum(t.nbytes for layer in past.layers for t in (layer.keys, layer.values))
  print(json.dumps(dict(prefill_s=prefill, decode_ms=decode * 1e3, kv_mb=kv / 2**20,
                        peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                        tokens=len(ids))))


def _matmul_gflops(dtype="float32") -> float:
  """Measured matmul rate of this machine (GFLOP/s): best of 2048^3 jnp.dot runs."""
  import jax
  import jax.numpy as jnp

  n = 2048
  best = bench_common.time_calls(jax.jit(lambda a: a @ a), jnp.ones((n, n), dtype),
                                 repeats=10).best
  return 2 * n**3 / best / 1e9


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--lengths", default="2048,4096,8000")  # 8000 + new tokens fit in 8192
  p.add_argument("--budgets", default="128,256,512")
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--skip-layers", type=int, default=0,
                 help="also run rocketkv with RocketConfig.skip_layers=N at each budget")
  p.add_argument("--no-transformers", action="store_true")
  p.add_argument("--out", default=None, help="also write the markdown table here")
  p.add_argument("--hf-worker", type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument("--hf-dtype", default="float32", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.hf_worker is not None:
    return _hf_worker(args.hf_worker, args.new_tokens, args.hf_dtype)

  import jax
  import jax.numpy as jnp

  import rocketkv_jax as rocketkv
  from rocketkv_jax.models import precision

  dtypes = args.dtypes.split(",")
  models = {}
  for dt in dtypes:
    t0 = time.perf_counter()
    models[dt] = rocketkv.models.load(rocketkv.models.smollm2_path(), dtype=getattr(jnp, dt))
    print(f"# loaded SmolLM2-135M ({dt}) in {time.perf_counter() - t0:.1f}s", flush=True)
  native = precision.native_bf16_cpu()
  info = [f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPU cores; "
          f"XLA:CPU runs bf16 dots natively (avx512_bf16/amx_bf16 and no fp32 converts in a bf16 "
          f"dot's HLO; models/precision.py): {'yes' if native else 'no'}"
          + ("" if native else " -> our bf16 computes in fp32, bf16 weights and K/V caches")]
  rates = {dt: _matmul_gflops(dt) for dt in dtypes}
  info.append("matmul rate (2048^3 jnp.dot, best of 10): " + ", ".join(
      f"{dt} {r:.0f} GFLOP/s" for dt, r in rates.items()))
  for line in info:
    print("# " + line, flush=True)
  rows = []
  header = ("| prompt | system | dtype | method | budget | prefill s | decode ms/tok "
            "| KV kept (tokens) | KV MB | peak MB | compile s |")
  sep = "|" + "---|" * 11
  print(header + "\n" + sep, flush=True)
  got = {}  # (n, system, dtype, method, budget) -> (prefill s, decode ms)

  def emit(row):
    rows.append(row)
    print(row, flush=True)

  for n in [int(x) for x in args.lengths.split(",")]:
    for dt in dtypes:
      model = models[dt]
      ids = bench_common.niah_prompt_ids(model.tokenizer, n)
      runs = [("full", 0)] + [("rocketkv", int(b)) for b in args.budgets.split(",")]
      if args.skip_layers:
        runs += [(f"rocketkv:skip_layers={args.skip_layers}", int(b))
                 for b in args.budgets.split(",")]
      for method, budget in runs:
        name, _, skip = method.partition(":skip_layers=")
        cfg = rocketkv.RocketConfig(token_budget=budget or 256, method=name,
                                    skip_layers=int(skip or 0))
        res = rocketkv.generate(model, [ids], rocket_config=cfg,
                                max_new_tokens=args.new_tokens, eos_token_ids=())
        s = res.stats
        got[(n, "ours", dt, method, budget)] = (s["prefill_s"], s["decode_ms_per_token"])
        emit(f"| {len(ids)} | rocketkv-jax | {dt} | {method} | {budget or '-'} "
             f"| {s['prefill_s']:.2f} | {s['decode_ms_per_token']:.1f} | {s['kv_tokens_kept']} "
             f"| {s['kv_cache_bytes'] / 2**20:.1f} | {s['peak_bytes'] / 2**20:.0f} "
             f"| {s['compile_s']:.1f} |")
      if not args.no_transformers:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--hf-worker", str(n),
                              "--new-tokens", str(args.new_tokens), "--hf-dtype", dt],
                             capture_output=True, text=True, check=True)
        hf = json.loads(out.stdout.strip().splitlines()[-1])
        got[(n, "hf", dt, "full", 0)] = (hf["prefill_s"], hf["decode_ms"])
        emit(f"| {hf['tokens']} | transformers {_hf_version()} | {dt} | full | - "
             f"| {hf['prefill_s']:.2f} | {hf['decode_ms']:.1f} | {hf['tokens']} "
             f"| {hf['kv_mb']:.1f} | {hf['peak_mb']:.0f} (RSS) | - |")
    if "float32" in rates:
      gflop = bench_common.prefill_gflop(models[dtypes[0]].config, len(ids))
      emit(f"| {len(ids)} | floor: {gflop:.0f} GFLOP at {rates['float32']:.0f} GFLOP/s "
           f"| float32 | - | - | {gflop / rates['float32']:.2f} | - | - | - | - | - |")
  targets = _targets(got, [int(x) for x in args.lengths.split(",")],
                     [0] + [int(b) for b in args.budgets.split(",")])
  for line in targets:
    print(line, flush=True)
  if args.out:
    with open(args.out, "w") as f:
      f.write("# End-to-end benchmark (benchmarks/end_to_end.py)\n\n")
      f.write(f"SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to each dtype), greedy, "
              f"{args.new_tokens} new tokens, batch 1. " + "; ".join(info) + ".\n\n")
      f.write(header + "\n" + sep + "\n" + "\n".join(rows) + "\n\n")
      f.write("\n".join(targets) + "\n")


def _targets(got, lengths, budgets) -> list[str]:
  """Issue #15's bf16 targets as ratios of this run's rows, each marked met / NOT met."""
  out = ["bf16 targets (ratios of rows above):"]

  def line(name, num, den, limit):
    if num is None or den is None:
      return
    r = num / den
    out.append(f"  {name}: {num:.2f} / {den:.2f} = {r:.2f} (target <= {limit}): "
               f"{'met' if r <= limit else 'NOT met'}")

  for n in lengths:
    f32 = got.get((n, "ours", "float32", "full", 0))
    b16 = got.get((n, "ours", "bfloat16", "full", 0))
    hf16 = got.get((n, "hf", "bfloat16", "full", 0))
    if b16 and f32 and n >= 4096:
      line(f"{n}: our bf16 prefill / our fp32 prefill", b16[0], f32[0], 0.5)
    if b16 and hf16:
      line(f"{n}: our bf16 prefill / transformers bf16 prefill", b16[0], hf16[0], 0.7)
    for budget in budgets:
      method = "full" if budget == 0 else "rocketkv"
      a = got.get((n, "ours", "bfloat16", method, budget))
      b = got.get((n, "ours", "float32", method, budget))
      if a and b:
        line(f"{n}: our bf16 decode / fp32 decode ({method}{'@' + str(budget) if budget else ''})"
             , a[1], b[1], 1.0)
  return out


def _hf_version() -> str:
  try:
    import importlib.metadata as md

    return md.version("transformers")
  except Exception:  # pylint: disable=broad-except
    return ""


if __name__ == "__main__":
  main()

"""End to end on one GPU: a Llama-3.1-8B-shaped model (random bf16 weights) through `generate`.

    python benchmarks/gpu_e2e.py --deadline-s 400 --out results/gpu_e2e   # H200: <= 8 min
    python benchmarks/gpu_e2e.py --tiny --out /tmp/gpu_e2e                # CPU: toy shapes (CI)

The model has Llama-3.1-8B's shapes (32 layers, hidden 4096, 32 / 8 heads, head dim 128, FFN
14336, vocab 128256, llama3 RoPE, context 131072) and random normal(0, 0.02) bf16 weights made on
the device (no checkpoint: decode speed does not depend on the weights' values). For each
(context, batch) -- 32K and 128K prompts, batch 1 and 8 -- and each method -- full KV,
`rocketkv` at B=256 and the recommended configuration `SMALL_HEADS` at B=256 -- it calls the
public `rocketkv.generate` on random prompt ids (no EOS: every row decodes `--new-tokens`) and
reports prefill s, decode tok/s (and ms per step), compile s, and the peak device memory
(`device.memory_stats()["peak_bytes_in_use"]`). The 128K prompt is 131072 - new tokens long
(the model's context).

Rows run in priority order (batch 1 before batch 8, 32K before 128K), each in a subprocess of
its own on a GPU (`--isolate`, the default there): the allocator's peak is then that row's, and
an out-of-memory row fails alone. A row whose estimated memory (`estimate_gb`: weights, their
stacked copy in the prefill scan, the KV cache, the prefill's largest activations) exceeds the
device's limit is skipped and says so; `--deadline-s` skips rows that would start past it.
Speed-ups are against full KV at the same (context, batch), next to the paper's (A100) and
TensorRT-LLM's (B200) published figures (`REFERENCE`). Writes `<out>/gpu_e2e.json` and
`<out>/gpu_e2e.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

T0 = time.perf_counter()
SMALL_HEADS = ("rocketkv:stage2=quant,quant_capacity=equal_read,window_reduce=max,"
               "group_dims=normalized")  # the README's recommended configuration
METHODS = ("full", "rocketkv", SMALL_HEADS)
BUDGET = 256
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=131072)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, max_position_embeddings=4096)
REFERENCE = (
    "Published figures (other hardware, other software; for scale only): the RocketKV paper "
    "(arXiv 2502.14051) reports up to 3.7x end-to-end decode speed-up and 32.6% lower peak "
    "memory than full KV on an A100; TensorRT-LLM's RocketKV on a B200 with Llama-3.1-8B, "
    "32K input / 4K output, reports 2.26x max throughput and 3.40x min latency over full KV.")


def _elapsed() -> float:
  return time.perf_counter() - T0


def model_config(tiny: bool):
  from rocketkv_jax.models.config import ModelConfig, RopeScaling
  if tiny:
    return ModelConfig(**TINY)
  return ModelConfig(**LLAMA_8B, rope_scaling=RopeScaling(
      "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
      original_max_position_embeddings=8192))


def random_model(config, dtype="bfloat16", seed: int = 0):
  """A `rocketkv.models.Model` with normal(0, 0.02) weights (norms 1), made on the device."""
  import functools

  import jax
  import jax.numpy as jnp

  from rocketkv_jax.models import Model, llama

  dtype = jnp.dtype(dtype)

  @functools.partial(jax.jit, static_argnums=(1,))
  def normal(key, shape):
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

  key = jax.random.PRNGKey(seed)
  count = iter(range(1 << 30))

  def make(path, shape):
    if path[-1].key.endswith("norm"):
      return jnp.ones(shape, dtype)
    return normal(jax.random.fold_in(key, next(count)), shape)

  params = jax.tree_util.tree_map_with_path(
      make, llama.param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
  return Model(config, params)


def estimate_gb(config, prompt: int, batch: int, method: str) -> float:
  """Lower-bound estimate of a row's peak device memory, GB (bf16): weights twice (the prefill
  scan stacks a copy), the K/V of every layer for full KV (RocketKV keeps ~1%), and the prompt
  pass's largest live activations (hidden x ~4, FFN gate/up x 2, one layer's K/V)."""
  c = config
  weights = 2 * (2 * c.vocab_size * c.hidden_size + c.num_layers * (
      c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
      + c.num_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size))
  kv_layer = 2 * 2 * batch * c.num_kv_heads * prompt * c.head_dim
  kv = kv_layer * c.num_layers if method == "full" else kv_layer * 1.1
  acts = 2 * batch * prompt * (4 * c.hidden_size + 2 * c.intermediate_size)
  return (2 * weights + kv + acts) / 1e9


def run_row(config, ctx: int, batch: int, method: str, new_tokens: int, impl: str,
            budget: int = BUDGET, seed: int = 0) -> dict:
  """One `generate` call; the row's numbers."""
  import jax
  import numpy as np

  import rocketkv_jax as rocketkv
  from rocketkv_jax.eval import variants

  prompt = min(ctx, config.max_position_embeddings - new_tokens)
  model = random_model(config, "bfloat16", seed)
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(0, config.vocab_size, prompt, dtype=np.int32) for _ in range(batch)]
  rcfg = None if method == "full" else variants.rocket_config(method, budget)
  res = rocketkv.generate(model, prompts, method="full", rocket_config=rcfg,
                          max_new_tokens=new_tokens, eos_token_ids=(), impl=impl)
  s = res.stats
  mem = jax.devices()[0].memory_stats() or {}
  peak = mem.get("peak_bytes_in_use")
  return dict(ctx=ctx, prompt=prompt, batch=batch, method=method,
              budget=None if method == "full" else budget,
              prefill_s=s["prefill_s"], decode_tok_s=s["decode_tokens_per_s"],
              decode_ms_per_step=s["decode_ms_per_token"], decode_steps=s["decode_steps"],
              compile_s=s["compile_s"], kv_cache_gb=s["kv_cache_bytes"] / 1e9,
              xla_peak_gb=s["peak_bytes"] / 1e9,
              peak_gb=None if peak is None else peak / 1e9,
              limit_gb=None if mem.get("bytes_limit") is None else mem["bytes_limit"] / 1e9)


def _row_in_subprocess(args, ctx, batch, method, timeout) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), "--row", json.dumps([ctx, batch, method]),
         "--new-tokens", str(args.new_tokens), "--impl", args.impl,
         "--budget", str(args.budget)] + (["--tiny"] if args.tiny else [])
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=min(max(timeout, 1), 1e6))
  except subprocess.TimeoutExpired:
    return dict(error=f"killed after {timeout:.0f} s (past --deadline-s + --grace-s)")
  for line in reversed(p.stdout.splitlines()):
    if line.startswith("ROW "):
      return json.loads(line[4:])
  tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
  return dict(error=f"exit {p.returncode}: " + " | ".join(tail)[-600:])


def _fmt(x, spec):
  return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
  full = {(r["ctx"], r["batch"]): r for r in rows if r["method"] == "full" and "error" not in r
          and "skipped" not in r}
  out = ["| prompt | batch | method | prefill s | decode tok/s | ms/step | speed-up vs full "
         "| peak GB | vs full peak | KV GB | compile s |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    name = r["method"] if r["method"] == "full" else f"{r['method']} @{r['budget']}"
    head = f"| {r.get('prompt', r['ctx'])} | {r['batch']} | `{name}` |"
    if "skipped" in r or "error" in r:
      out.append(f"{head} {r.get('skipped') or 'error: ' + r['error']} |||||||||")
      continue
    f = full.get((r["ctx"], r["batch"]))
    speed = f and r["decode_tok_s"] / f["decode_tok_s"]
    mem = f and r["peak_gb"] and f["peak_gb"] and 1 - r["peak_gb"] / f["peak_gb"]
    out.append(f"{head} {r['prefill_s']:.2f} | {r['decode_tok_s']:.1f} | "
               f"{r['decode_ms_per_step']:.2f} | {'-' if not speed else f'{speed:.2f}x'} | "
               f"{_fmt(r['peak_gb'], '.1f')} "
               f"| {'-' if not mem else f'{-100 * mem:+.1f}%'} | {r['kv_cache_gb']:.3f} | "
               f"{r['compile_s']:.0f} |")
  return "\n".join(out)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tiny", action="store_true", help="toy shapes on any backend (CI)")
  p.add_argument("--contexts", type=int, nargs="+", default=None,
                 help="prompt lengths (default 32768 131072; --tiny: 512)")
  p.add_argument("--batches", type=int, nargs="+", default=None,
                 help="default 1 8 (--tiny: 2)")
  p.add_argument("--budget", type=int, default=None, help="token budget B (default 256; --tiny: 64)")
  p.add_argument("--methods", nargs="+", default=list(METHODS))
  p.add_argument("--new-tokens", type=int, default=None, help="default 64 (--tiny: 4)")
  p.add_argument("--impl", default="auto", choices=["auto", "xla", "pallas", "interpret"])
  p.add_argument("--deadline-s", type=float, default=1e9,
                 help="skip rows that would start this many seconds after the script started")
  p.add_argument("--grace-s", type=float, default=75.0,
                 help="a row still running this long after --deadline-s is killed")
  p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                 help="each row in its own process (default: on a GPU)")
  p.add_argument("--out", default="results/gpu_e2e", help="folder for gpu_e2e.json / .md")
  p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # [ctx, batch, method]: one row
  args = p.parse_args(argv)
  args.new_tokens = args.new_tokens or (4 if args.tiny else 64)
  contexts = args.contexts or ([512] if args.tiny else [32768, 131072])
  args.batches = args.batches or ([2] if args.tiny else [1, 8])
  args.budget = args.budget or (64 if args.tiny else BUDGET)

  # the parent holds no more than its context: each row's process allocates what it needs, up
  # to 97% of the device (jax's default limit is 75%: 106 of an H200's 141 GB)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.97")
  import jax
  import rocketkv_jax  # noqa: F401  (its XLA:CPU flag before the backend starts)
  config = model_config(args.tiny)
  if args.row is not None:
    ctx, batch, method = json.loads(args.row)
    print("ROW " + json.dumps(run_row(config, ctx, batch, method, args.new_tokens, args.impl,
                                      args.budget)), flush=True)
    return 0

  dev = jax.devices()[0]
  isolate = args.isolate if args.isolate is not None else jax.default_backend() == "gpu"
  limit = (dev.memory_stats() or {}).get("bytes_limit")
  limit_gb = None if limit is None else limit / 1e9
  print(f"jax {jax.__version__}, {dev.device_kind} ({jax.default_backend()}), "
        f"limit {_fmt(limit_gb, '.1f')} GB, isolate={isolate}", flush=True)
  rows: list[dict] = []
  for batch in sorted(args.batches):
    for ctx in contexts:
      for method in args.methods:
        prompt = min(ctx, config.max_position_embeddings - args.new_tokens)
        row = dict(ctx=ctx, prompt=prompt, batch=batch, method=method,
                   budget=None if method == "full" else args.budget,
                   estimate_gb=round(estimate_gb(config, prompt, batch, method), 1))
        if _elapsed() > args.deadline_s:
          row["skipped"] = "skipped: past --deadline-s"
        elif limit_gb is not None and row["estimate_gb"] > limit_gb:
          row["skipped"] = f"skipped: needs >= {row['estimate_gb']:.0f} GB of {limit_gb:.0f}"
        elif isolate:
          row.update(_row_in_subprocess(args, ctx, batch, method,
                                        args.deadline_s + args.grace_s - _elapsed()))
        else:
          try:
            row.update(run_row(config, ctx, batch, method, args.new_tokens, args.impl,
                               args.budget))
          except Exception as e:  # pylint: disable=broad-except
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)

  os.makedirs(args.out, exist_ok=True)
  meta = dict(jax=jax.__version__, device=dev.device_kind, backend=jax.default_backend(),
              limit_gb=limit_gb, argv=sys.argv[1:] if argv is None else argv, tiny=args.tiny,
              new_tokens=args.new_tokens, total_s=_elapsed(), isolate=isolate)
  with open(os.path.join(args.out, "gpu_e2e.json"), "w") as f:
    json.dump(dict(meta=meta, rows=rows, reference=REFERENCE), f, indent=1)
  md = (f"# gpu_e2e: Llama-3.1-8B-shaped model, random bf16 weights"
        f"{' (--tiny: toy shapes)' if args.tiny else ''}\n\n"
        f"jax {jax.__version__}, {dev.device_kind} ({jax.default_backend()}), "
        f"{args.new_tokens} new tokens per row, impl={args.impl}, total {_elapsed():.0f} s.\n"
        f"Command: `python benchmarks/gpu_e2e.py {' '.join(meta['argv'])}`\n\n"
        f"{table(rows)}\n\n{REFERENCE}\n")
  with open(os.path.join(args.out, "gpu_e2e.md"), "w") as f:
    f.write(md)
  print(md, flush=True)
  return 0 if not any("error" in r for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())

"""Roofline of generate's decode step: each measured step next to the floor the machine allows.

    python benchmarks/roofline.py                      # SmolLM2, 4000 / 8000 x batch 1/4/8/16
    python benchmarks/roofline.py --prefill            # + batch-1 prefill at each length
    python benchmarks/roofline.py --lengths 8000 --batches 8 --methods snapkv --profile \\
        --layout layers
    python benchmarks/roofline.py --quick              # a tiny random model, seconds (CI)

First it measures this machine once: memory bandwidth (a jitted sum over a large fp32 buffer,
best of --repeats) and the matmul rate (a jitted square matmul, fp32 and bf16, best of
--repeats). Then for each (prompt length, batch, method spec) it builds the decode step as
`generate` runs it (benchmarks/decode_steps.py: random per-layer K/V through the method's own
`rocketkv.prefill`, the cache stacked per run of like layers, the step jitted with the cache
donated), times it (median of --steps steps after --warmup), and prints it beside its floor:

    floor = max(bytes read per step / bandwidth, FLOPs per step / matmul rate)

with the bytes and FLOPs counted from the model's parameters and the method's `Plan`
(`decode_accounting`; docs/roofline.md says what is counted and why). --prefill adds the prompt
pass (`llama.prefill`, full KV, batch 1) at each length next to its FLOP floor, causal attention
counted once. --profile (one row only) adds the step's per-op XLA:CPU profile. --json OUT writes
the machine rates and every row. --quant-logits auto,products times each stage2="quant" row
with the library's form of its slot logits (`quant.slot_logits_xla`) and with the per-plane
batched products (its form before the fused sum), side by side in one run.

Method specs are `rocketkv_jax.eval.variants` specs ("rocketkv:stage2=quant,quant_bits=4"), `B`
standing for --budget; several are separated by ';' (a spec holds commas).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import bench_common

DEFAULT_METHODS = ("full", "snapkv", "rocketkv",
                   "rocketkv:stage2=quant,quant_capacity=equal_read,window_reduce=max")
QUANT_LOGITS = ("auto", "products")  # --quant-logits forms
QUANT_STEP_BYTES = 4  # the per-channel fp32 grid step a "quant" score reads per dim


# --------------------------------------------------------------------------- accounting
def quant_bits(plan) -> int:
  """Bits per key code of a stage2="quant" plan (`Quant.bits`), 0 for any other plan."""
  return int(getattr(plan.stage2, "bits", 0) or 0)


def stage2_kind(plan) -> str:
  """"quant", "minmax" (chunk bounds), "dense" (no selection) or the name of a stage 2 whose
  read is not counted here."""
  if not plan.top_k:
    return "dense"
  if quant_bits(plan):
    return "quant"
  s2 = getattr(plan.stage2, "name", "")
  if s2 == "minmax" and plan.chunk_size > 0:
    return "minmax"
  return s2 or type(plan.stage2).__name__


def _nbytes(x) -> int:
  return math.prod(x.shape) * x.dtype.itemsize


def weight_bytes(params: dict, batch: int) -> int:
  """Bytes of parameters one decode step reads: every parameter once. The embedding matrix is
  read whole only as a tied unembedding (counted once); untied, the lookup reads `batch` rows."""
  import jax
  embed = params["embed"]
  rest = sum(_nbytes(x) for k, v in params.items() if k != "embed"
             for x in jax.tree.leaves(v))
  if "lm_head" in params:
    return rest + batch * embed.shape[1] * embed.dtype.itemsize
  return rest + _nbytes(embed)


def matmul_params(params: dict) -> int:
  """Parameters that multiply each token in a matmul: every matrix (ndim >= 2), the embedding
  only as the tied unembedding (a lookup otherwise)."""
  import jax
  n = 0
  for k, v in params.items():
    if k == "embed" and "lm_head" in params:
      continue
    n += sum(math.prod(x.shape) for x in jax.tree.leaves(v) if len(x.shape) >= 2)
  return n


def kv_read(plan, *, num_heads: int, num_kv_heads: int, head_dim: int, itemsize: int,
            dense: bool) -> tuple[int, int]:
  """(bytes, FLOPs) of one layer's attention for one sequence at the plan's first decode step.

  n = the valid slots after the step's append (kept prompt tokens + 1). Per KV head:
    dense (full, snapkv, a method's dense layers): K and V of all n slots;
    minmax: the chunk bounds on r dims over the capacity (r rows when chunk_size is 1, where
      min = max = the key; 2r otherwise), then K and V of min(top_k, n) slots;
    quant: r rows of packed codes (ceil(capacity / (8 / bits)) bytes each) and r fp32 grid
      steps, then K and V of min(top_k, n) slots.
  FLOPs per query head: 2 * D per slot for q.k and as many for p.v over the slots read, and
  2 per code or bound value scored."""
  n = (plan.prompt_len if dense else min(plan.prompt_budget, plan.prompt_len)) + 1
  kind = "dense" if dense else stage2_kind(plan)
  if kind == "dense":
    rows, score_bytes, score_flops = n, 0, 0
  else:
    rows = min(plan.top_k, n)
    c, r = plan.capacity, plan.r
    if kind == "quant":
      per = 8 // quant_bits(plan)
      nb = -(-c // per)
      score_bytes, score_flops = r * nb + r * QUANT_STEP_BYTES, 2 * r * nb * per
    elif kind == "minmax":
      nc = -(-c // plan.chunk_size)
      dims = r if plan.chunk_size == 1 else 2 * r
      score_bytes, score_flops = dims * nc * itemsize, 2 * dims * nc
    else:
      raise ValueError(f"stage2 {kind!r}: its read per step is not counted by roofline.py "
                       f"(full, snapkv, rocketkv minmax and quant are)")
  kv_bytes = num_kv_heads * (2 * rows * head_dim * itemsize + score_bytes)
  flops = num_heads * (4 * rows * head_dim + score_flops)
  return kv_bytes, flops


def decode_accounting(params: dict, config, plan, batch: int, kv_itemsize: int) -> dict:
  """Bytes read and FLOPs of one decode step of `batch` sequences: weights (`weight_bytes`),
  2 FLOPs per matmul parameter per sequence, and every layer's `kv_read` (the method's
  `dense_layers` read whole)."""
  from rocketkv_jax import methods
  dense_layers = set(methods.get(plan.method).dense_layers(plan))
  kv, attn = 0, 0
  for i in range(config.num_layers):
    b, f = kv_read(plan, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
                   head_dim=config.head_dim, itemsize=kv_itemsize, dense=i in dense_layers)
    kv, attn = kv + b, attn + f
  w = weight_bytes(params, batch)
  flops = batch * (2 * matmul_params(params) + attn)
  return dict(weight_bytes=w, kv_bytes=batch * kv, bytes=w + batch * kv, flops=flops)


def prefill_flops(config, n: int) -> float:
  """Matmul FLOPs of one n-token prompt pass, causal attention counted once
  (`bench_common.prefill_gflop`, as end_to_end.py's floor rows)."""
  return bench_common.prefill_gflop(config, n) * 1e9


def floor_s(nbytes: float, flops: float, bandwidth: float, rate: float) -> tuple[float, float]:
  """(bytes / bandwidth, FLOPs / rate) in seconds; the floor is their max."""
  return nbytes / bandwidth, flops / rate


# --------------------------------------------------------------------------- measurement
def bandwidth_bps(mbytes: int, repeats: int) -> float:
  """Bytes per second of a jitted sum over an fp32 buffer of `mbytes` MB, best of `repeats`."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones((mbytes * 2**20 // 4,), jnp.float32)
  return x.nbytes / bench_common.time_calls(jax.jit(jnp.sum), x, repeats=repeats).best


def matmul_flops(n: int, dtype: str, repeats: int) -> float:
  """FLOP/s of a jitted n x n x n matmul in `dtype`, best of `repeats`."""
  import jax
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.dtype(dtype))
  return 2 * n**3 / bench_common.time_calls(jax.jit(lambda a: a @ a), a, repeats=repeats).best


def cpu_model() -> str:
  """The CPU's model name from /proc/cpuinfo ("unknown" where there is none)."""
  try:
    with open("/proc/cpuinfo") as f:
      names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
  except OSError:
    names = []
  return names[0] if names else "unknown"


def _tiny_model(dtype):
  """--quick's model: 2 layers of a random Llama (GQA 4:2, head dim 16)."""
  import rocketkv_jax as rocketkv
  from rocketkv_jax.models import llama
  from rocketkv_jax.models.config import ModelConfig
  c = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
                  tie_word_embeddings=True)
  return rocketkv.models.Model(config=c, params=llama.init_params(c, dtype=dtype),
                               source="tiny")


def _prefill_s(model, n: int, repeats: int) -> float:
  """Best wall seconds of the jitted prompt pass (full KV) of one n-token prompt."""
  import jax
  import jax.numpy as jnp
  import rocketkv_jax as rocketkv
  from rocketkv_jax.models import llama
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=n, method="full"), n, 1,
                       model.config.head_dim)
  f = jax.jit(lambda p, t, ln: llama.prefill(p, t, ln, config=model.config, plan=plan,
                                             stacked=True))
  tokens = jnp.ones((1, n), jnp.int32)
  lengths = jnp.full((1,), n, jnp.int32)
  return bench_common.time_calls(f, model.params, tokens, lengths, repeats=repeats).best


# --------------------------------------------------------------------------- CLI
def _ints(s: str) -> list[int]:
  try:
    vals = [int(x) for x in s.split(",") if x.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {s!r}") from None
  if not vals or min(vals) < 1:
    raise argparse.ArgumentTypeError(f"must be integers >= 1, got {s!r}")
  return vals


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="smollm2",
                  help="smollm2 (the embedded SmolLM2-135M), gemma3 (Gemma 3 270M), an HF "
                       "directory or a .gguf")
  ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ap.add_argument("--lengths", default=None, help="prompt lengths (default 4000,8000)")
  ap.add_argument("--batches", default=None, help="batch sizes (default 1,4,8,16)")
  ap.add_argument("--methods", default=None,
                  help="';'-separated method specs (default: " + "; ".join(DEFAULT_METHODS) + ")")
  ap.add_argument("--budget", type=int, default=256, help="token budget B")
  ap.add_argument("--steps", type=int, default=10, help="decode steps timed per row")
  ap.add_argument("--warmup", type=int, default=3, help="steps run first (compile included)")
  ap.add_argument("--repeats", type=int, default=10, help="runs of each machine measurement")
  ap.add_argument("--bandwidth-mb", type=int, default=256, help="buffer of the bandwidth sum")
  ap.add_argument("--matmul-n", type=int, default=2048, help="size of the square matmul")
  ap.add_argument("--prefill", action="store_true",
                  help="also time the batch-1 prompt pass at each length (slow)")
  ap.add_argument("--profile", action="store_true",
                  help="per-op profile of the step (one row: one length, batch and method)")
  ap.add_argument("--top", type=int, default=25, help="--profile: ops shown")
  ap.add_argument("--quant-logits", default="auto", metavar="FORMS",
                  help="stage2='quant' rows: comma-separated forms of the slot logits, each a "
                       "row: auto (the library's choice) and / or products")
  ap.add_argument("--layout", default="stack", choices=("stack", "layers"),
                  help="the cache stacked per run of like layers (generate's, default) or one "
                       "buffer per layer (unrolled layers: a flat --profile op list)")
  ap.add_argument("--quick", action="store_true",
                  help="a tiny random 2-layer model, short prompts, small measurements (CI)")
  ap.add_argument("--json", default=None, metavar="OUT", help="also write the results here")
  return ap


def _args(argv) -> argparse.Namespace:
  """Parsed and checked arguments; ValueError (one line) for a bad value."""
  a = _parser().parse_args(argv)
  if a.quick:
    a.lengths = a.lengths or "256"
    a.batches = a.batches or "2"
    a.methods = a.methods or f"full;{DEFAULT_METHODS[-1]}"  # a dense read and a coded one
    a.budget = 64 if a.budget == 256 else a.budget
    a.steps, a.warmup, a.repeats = min(a.steps, 3), min(a.warmup, 2), min(a.repeats, 3)
    a.bandwidth_mb, a.matmul_n = min(a.bandwidth_mb, 16), min(a.matmul_n, 256)
  try:
    a.lengths = _ints(a.lengths or "4000,8000")
    a.batches = _ints(a.batches or "1,4,8,16")
  except argparse.ArgumentTypeError as e:
    raise ValueError(f"--lengths / --batches {e}") from None
  a.methods = [m.strip() for m in (a.methods.split(";") if a.methods else DEFAULT_METHODS)
               if m.strip()]
  for name in ("budget", "steps", "repeats", "bandwidth_mb", "matmul_n", "top"):
    if getattr(a, name) < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
  if a.warmup < 1:
    raise ValueError(f"--warmup must be >= 1 (the first step compiles), got {a.warmup}")
  if not a.methods:
    raise ValueError("--methods is empty")
  a.quant_logits = [f.strip() for f in a.quant_logits.split(",") if f.strip()]
  bad = [f for f in a.quant_logits if f not in QUANT_LOGITS]
  if bad or not a.quant_logits:
    raise ValueError(f"--quant-logits must be forms from {list(QUANT_LOGITS)}, got "
                     f"{','.join(a.quant_logits) or repr('')}")
  if a.profile and len(a.lengths) * len(a.batches) * len(a.methods) != 1:
    raise ValueError("--profile profiles one row: give one --lengths, --batches and --methods")
  return a


def _check_rows(a, model) -> list:
  """Every (length, batch, spec) row with its RocketConfig; ValueError for a bad spec or a row
  that does not fit the model."""
  from rocketkv_jax.eval.variants import rocket_config
  import rocketkv_jax as rocketkv
  free = a.warmup + a.steps + 1
  rows = []
  for spec in a.methods:
    cfg = rocket_config(spec, a.budget)
    for n in a.lengths:
      if n + free > model.config.max_position_embeddings:
        raise ValueError(f"--lengths {n} + {free} steps exceed the model's context of "
                         f"{model.config.max_position_embeddings}")
      plan = rocketkv.plan(cfg, n, free, model.config.head_dim)
      kv_read(plan, num_heads=1, num_kv_heads=1, head_dim=1, itemsize=1, dense=False)
      rows += [(n, b, spec, cfg) for b in a.batches]
  rows.sort(key=lambda r: (r[0], r[1]))
  return rows


def _fmt(x: float) -> str:
  return f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def main(argv=None) -> int:
  try:
    a = _args(argv)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if a.profile:  # XLA:CPU emits per-op trace events only with this flag, set before jax loads
    flag = "--xla_cpu_enable_xprof_traceme=true"  # decode_steps.TRACEME_FLAG, which imports jax
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
  import jax
  import jax.numpy as jnp
  import rocketkv_jax as rocketkv
  from rocketkv_jax.models.precision import native_bf16_cpu
  import decode_steps  # benchmarks/decode_steps.py, which imports jax: after the flag above

  dtype = jnp.dtype(a.dtype)
  try:
    if a.quick:
      model = _tiny_model(dtype)
    else:
      model = rocketkv.models.load(rocketkv.models.resolve(a.model), dtype=dtype)
    rows = _check_rows(a, model)
  except (ValueError, FileNotFoundError) as e:  # FileNotFoundError: gemma3 not installed
    print(f"error: {e}", file=sys.stderr)
    return 2

  bw = bandwidth_bps(a.bandwidth_mb, a.repeats)
  rates = {d: matmul_flops(a.matmul_n, d, a.repeats) for d in ("float32", "bfloat16")}
  # a bf16 model computes in fp32 where the CPU has no bf16 dots (models/precision.py)
  native = a.dtype == "bfloat16" and (jax.default_backend() != "cpu" or native_bf16_cpu())
  rate = rates["bfloat16" if native else "float32"]
  machine = dict(backend=jax.default_backend(), device=str(jax.devices()[0]),
                 bandwidth_gbps=bw / 1e9, fp32_gflops=rates["float32"] / 1e9,
                 bf16_gflops=rates["bfloat16"] / 1e9, rate_used="bfloat16" if native else "float32",
                 cpus=os.cpu_count(), cpu_model=cpu_model(), load_avg=os.getloadavg()[0])
  c = model.config
  print(f"model {model.source} {a.dtype} ({c.num_layers} layers, {c.num_heads}/{c.num_kv_heads} "
        f"heads x {c.head_dim}), budget {a.budget}{', QUICK (tiny shapes)' if a.quick else ''}")
  print(f"machine: {machine['backend']}, {machine['cpus']} CPUs ({machine['cpu_model']}), load "
        f"{machine['load_avg']:.1f}; "
        f"bandwidth {bw / 1e9:.1f} GB/s (sum over {a.bandwidth_mb} MB), matmul "
        f"{machine['fp32_gflops']:.1f} GFLOP/s fp32, {machine['bf16_gflops']:.1f} bf16 "
        f"({a.matmul_n}^3); FLOP floor at the {machine['rate_used']} rate")
  print(f"decode step: median of {a.steps} after {a.warmup}, cache as {a.layout}\n")
  print("| prompt | batch | method | measured ms | bytes floor ms | FLOP floor ms | floor ms "
        "| measured/floor | MB read | GFLOP |")
  print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
  out = []
  free = a.warmup + a.steps + 1
  from rocketkv_jax.methods.stage2 import Quant, quant
  fused_max = quant.FUSED_TERMS_MAX
  rows = [(n, b, spec, cfg, form) for n, b, spec, cfg in rows
          for form in (a.quant_logits if isinstance(cfg.stage2, Quant) else [None])]
  for n, b, spec, cfg, form in rows:
    # read when the step is traced (its first run): "products" never takes the fused sum
    quant.FUSED_TERMS_MAX = 0 if form == "products" else fused_max
    label = spec if form in (None, "auto") else f"{spec} [logits: {form}]"
    run, state, plan, params = decode_steps.model_step(model, cfg, n, b, free, a.layout)
    acc = decode_accounting(params, c, plan, b, dtype.itemsize)
    t = bench_common.time_calls(run, state, repeats=a.steps, warmup=a.warmup,
                                chain=lambda args, out: (out,))
    med, cpu, state = t.median, t.cpu_mean, t.out
    tb, tf = floor_s(acc["bytes"], acc["flops"], bw, rate)
    fl = max(tb, tf)
    row = dict(prompt=n, batch=b, method=spec, quant_logits=form, measured_ms=med * 1e3,
               cpu_ms=cpu * 1e3, bytes_floor_ms=tb * 1e3, flop_floor_ms=tf * 1e3, floor_ms=fl * 1e3,
               ratio=med / fl, **acc)
    out.append(row)
    print(f"| {n} | {b} | {label} | {_fmt(med * 1e3)} | {_fmt(tb * 1e3)} | {_fmt(tf * 1e3)} | "
          f"{_fmt(fl * 1e3)} | {med / fl:.1f} | {acc['bytes'] / 1e6:.1f} | "
          f"{acc['flops'] / 1e9:.3f} |", flush=True)
    if a.profile:
      us, threads, state = decode_steps.op_profile(run, state, a.steps)
      print(f"\nper-op profile, mean us per step over {a.steps} traced steps (profiling adds "
            f"overhead: compare ops with each other; with --layout stack the layer scan's "
            f"while op encloses the per-layer ops, so they count twice in the sum):")
      print("\n".join(decode_steps.profile_lines(us, threads, a.top)))
      kinds = decode_steps.op_kinds(run.hlo(state), us)
      print(f"\nthe same, by what each op computes (the {a.top} largest):")
      for k, t in kinds.most_common(a.top):
        print(f"{t:11.1f}  {k}")
    del run, state
  quant.FUSED_TERMS_MAX = fused_max

  pre = []
  if a.prefill:
    print("\n| prompt | batch | prefill measured ms | FLOP floor ms | measured/floor | GFLOP |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in sorted(set(a.lengths)):
      s, f = _prefill_s(model, n, min(a.repeats, 2)), prefill_flops(c, n)
      pre.append(dict(prompt=n, batch=1, measured_ms=s * 1e3, flop_floor_ms=f / rate * 1e3,
                      ratio=s * rate / f, flops=f))
      print(f"| {n} | 1 | {_fmt(s * 1e3)} | {_fmt(f / rate * 1e3)} | {s * rate / f:.1f} | "
            f"{f / 1e9:.1f} |", flush=True)
  if a.json:
    with open(a.json, "w") as fh:
      json.dump(dict(machine=machine, args=dict(model=a.model, dtype=a.dtype, budget=a.budget,
                                                steps=a.steps, warmup=a.warmup, quick=a.quick),
                     decode=out, prefill=pre), fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""One decode step of one attention layer: full attention vs `rocketkv.decode_step`.

Llama-3.1-8B attention shapes (Hq 32, Hkv 8, D 128), batch 1. For each (dtype, context,
budget): the median per-step time of the dense full-attention step (measured once per context,
right before that context's budgets) and of RocketKV's `decode_step`, side by side in one run, their ratio, the bytes each reads per step, and
each one's bandwidth floor: the time of a measured read-only pass (a jitted sum) over the same
number of bytes.

Both steps append the new token to a donated cache and attend. The dense step is the fastest dense
decode we found in XLA on this CPU (GQA without repeating K/V, fp32 accumulation, attention
read-only on the cache and the write in its own donated jit; for bf16 the faster of plain and
bit (uint16) storage; see `dense_step`).

    python benchmarks/decode_attention.py                      # the table in docs/cpu_performance.md
    python benchmarks/decode_attention.py --contexts 32768 --budgets 256 --dtypes bfloat16

With `--stage2 minmax rerank lowrank quant quant_equal_read` it also times RocketKV's stage-2
variants side by side (`RocketConfig.stage2`; `quant_equal_read` is "quant" with
`Quant(capacity="equal_read")`; the variants' steps interleaved round by round, so that load on
the machine hits them alike) and prints each one's step time, bytes read per step and bytes
held (one layer's decode state: K/V plus bounds or codes) as ratios to minmax (issue #13's
targets: <= 1.3x the time, <= 1.2x the bytes read):

    python benchmarks/decode_attention.py --contexts 32768 --budgets 256 --dtypes bfloat16 \\
        --stage2 minmax rerank lowrank quant quant_equal_read

With `--skip-layers N` (`RocketConfig.skip_layers`, an ablation) the first N of `--num-layers`
layers (default 32, Llama-3.1-8B) attend densely to their whole cache: the table adds the step
time and bytes per layer averaged over the model's layers, N dense steps and the rest
RocketKV's, from the two steps measured above (`layer_mean_read_bytes`).
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp

import rocketkv_jax as rocketkv
from rocketkv_jax.eval import read_cost

import bench_common

HQ, HKV, D = 32, 8, 128


def _next_cache(args, out):
  """A step's arguments (q, k_new, v_new, cache, ...) with the cache it returned (donated)."""
  return args[:3] + (out[1],) + args[4:]


def dense_attend(q, k_new, v_new, k, v, length):
  """Full attention of the new token over cache slots [0, length) plus itself. Read-only on the
  cache: on XLA:CPU any read of a donated buffer in the jit that updates it in place makes XLA
  copy the whole buffer first (seen in the compiled HLO), so the write is a second jit."""
  b, hq, d = q.shape
  hkv = k.shape[1]
  qg = q.reshape(b, hkv, hq // hkv, d)
  scale = 1.0 / jnp.sqrt(jnp.float32(d))
  s_old = jnp.einsum("bhgd,bhkd->bhgk", qg, k, preferred_element_type=jnp.float32) * scale
  s_old = jnp.where(jnp.arange(k.shape[2]) < length, s_old, -jnp.inf)
  s_new = jnp.einsum("bhgd,bhkd->bhgk", qg, k_new, preferred_element_type=jnp.float32) * scale
  m = jnp.maximum(jnp.max(s_old, -1, keepdims=True), s_new)
  p_old, p_new = jnp.exp(s_old - m), jnp.exp(s_new - m)
  num = (jnp.einsum("bhgk,bhkd->bhgd", p_old.astype(v.dtype), v,
                    preferred_element_type=jnp.float32)
         + jnp.einsum("bhgk,bhkd->bhgd", p_new, v_new.astype(jnp.float32)))
  out = num / (jnp.sum(p_old, -1, keepdims=True) + p_new)
  return out.reshape(b, hq, d).astype(q.dtype)


def dense_write(k, v, k_new, v_new, length):
  """Write-only append (in place on the donated cache)."""
  return (jax.lax.dynamic_update_slice(k, k_new, (0, 0, length, 0)),
          jax.lax.dynamic_update_slice(v, v_new, (0, 0, length, 0)))


_DENSE_ATTEND = jax.jit(dense_attend)
_DENSE_WRITE = jax.jit(dense_write, donate_argnums=(0, 1))
# 16-bit caches kept as their bits (as `KVCache` does): XLA:CPU computes a bf16
# dynamic_update_slice in f32, a pass over the whole buffer; on uint16 it is a row write.
_bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)
_DENSE_ATTEND_BITS = jax.jit(
    lambda q, kn, vn, k, v, n: dense_attend(q, kn, vn, *(jax.lax.bitcast_convert_type(x, q.dtype)
                                                         for x in (k, v)), n))
_DENSE_WRITE_BITS = jax.jit(lambda k, v, kn, vn, n: dense_write(k, v, _bits(kn), _bits(vn), n),
                            donate_argnums=(0, 1))


def dense_step(q, k_new, v_new, kv, length):
  """The dense full-attention decode step: attend (read-only), then write the token. `kv`
  holds uint16 buffers for a 16-bit q (the faster variant on XLA:CPU, see `bench_dense`)."""
  bits = kv[0].dtype == jnp.uint16
  attend, write = (_DENSE_ATTEND_BITS, _DENSE_WRITE_BITS) if bits else (_DENSE_ATTEND,
                                                                         _DENSE_WRITE)
  out = attend(q, k_new, v_new, kv[0], kv[1], length)
  return out, write(kv[0], kv[1], k_new, v_new, length)


def _read_pass_time(nbytes, dtype, repeats):
  """Time of a jitted read-only pass (sum) over `nbytes` of `dtype`."""
  n = max(int(nbytes // jnp.dtype(dtype).itemsize), 1)
  x = jnp.ones((n,), dtype)
  f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
  # small passes are noisy: many repeats
  return bench_common.time_calls(f, x, repeats=max(repeats, 100)).median


def _inputs(dtype, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(k1, (1, HQ, D), dtype)
  kn = jax.random.normal(k2, (1, HKV, 1, D), dtype)
  vn = jax.random.normal(k3, (1, HKV, 1, D), dtype)
  return q, kn, vn


def bench_dense(context, dtype, repeats):
  """Median ms of the dense step over a cache of `context` slots, and its floor."""
  q, kn, vn = _inputs(dtype)
  k1, k2 = jax.random.split(jax.random.PRNGKey(1))
  kf = jax.random.normal(k1, (1, HKV, context, D), dtype)
  vf = jax.random.normal(k2, (1, HKV, context, D), dtype)
  t = bench_common.time_calls(dense_step, q, kn, vn, (kf, vf), jnp.int32(context - 1),
                              repeats=repeats, chain=_next_cache).median
  if dtype.itemsize == 2:  # the fastest dense step we can write: also try bit storage
    kf = _bits(jax.random.normal(k1, (1, HKV, context, D), dtype))
    vf = _bits(jax.random.normal(k2, (1, HKV, context, D), dtype))
    t = min(t, bench_common.time_calls(dense_step, q, kn, vn, (kf, vf), jnp.int32(context - 1),
                                       repeats=repeats, chain=_next_cache).median)
  nbytes = 2 * HKV * context * D * jnp.dtype(dtype).itemsize
  return t, nbytes, _read_pass_time(nbytes, dtype, repeats)


def bench_rocketkv(context, budget, dtype, repeats, skip_layers=0):
  """Median ms of `rocketkv.decode_step` on the stage-1 cache planned for `context` (a layer
  past the `skip_layers` dense ones)."""
  q, kn, vn = _inputs(dtype)
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=budget, skip_layers=skip_layers),
                       context - 100, 100, D)
  k1, k2 = jax.random.split(jax.random.PRNGKey(2))
  kc = jax.random.normal(k1, (1, HKV, plan.prompt_budget, D), dtype)
  vc = jax.random.normal(k2, (1, HKV, plan.prompt_budget, D), dtype)
  cache = rocketkv.full_cache(kc, vc, plan.capacity, plan.chunk_size)
  step = jax.jit(lambda q, kn, vn, c: rocketkv.decode_step(q, kn, vn, c, plan,
                                                           layer=skip_layers),
                 donate_argnums=3)
  # The plan leaves 100 free slots, so the 90 repeats never fill the cache.
  t = bench_common.time_calls(step, q, kn, vn, cache, repeats=90, chain=_next_cache).median
  item = jnp.dtype(dtype).itemsize
  # Bytes the step must read: per KV head, one bound (kmax where the group-summed q_d > 0, else
  # kmin) on each of the r dims for every chunk, + top_k K and V rows.
  nbytes = stage2_read_bytes(plan, item)
  return t, nbytes, _read_pass_time(nbytes, dtype, repeats), plan


def layer_mean_read_bytes(plan, itemsize: int, num_layers: int, cached_tokens: int,
                          num_kv_heads: int = HKV) -> float:
  """Bytes one decode step reads per layer, averaged over a model's `num_layers` layers (per
  batch row): the first `plan.skip_layers` are dense and read the K and V of all
  `cached_tokens`, the others `stage2_read_bytes`."""
  n = min(plan.skip_layers, num_layers)
  dense = 2 * cached_tokens * plan.head_dim * num_kv_heads * itemsize
  sparse = stage2_read_bytes(plan, itemsize, num_kv_heads)
  return (n * dense + (num_layers - n) * sparse) / num_layers


def stage2_read_bytes(plan, itemsize: int, num_kv_heads: int = HKV) -> int:
  """Bytes one decode step of `plan` must read in one of its sparse layers (per batch row; a
  dense layer of `plan.skip_layers` reads its whole cache: `layer_mean_read_bytes`). What is
  counted per variant: `rocketkv_jax.eval.read_cost.head_read_bytes`."""
  return read_cost.head_read_bytes(plan, itemsize) * num_kv_heads


# `--stage2` names: RocketConfig.stage2's values, "quant_equal_read" for
# Quant(capacity="equal_read") (stage 1 keeps the slots the codes' saved bytes pay for), and
# "quant_equal_read_mean" with mean_value=True as well (SparQ's mean-value fill).
QUANT_NAMED = {"quant_equal_read": dict(capacity="equal_read"),
               "quant_equal_read_mean": dict(capacity="equal_read", mean_value=True)}
STAGE2_CHOICES = list(rocketkv.STAGE2) + list(QUANT_NAMED)


def stage2_config(budget: int, name: str) -> rocketkv.RocketConfig:
  """The RocketConfig of a `--stage2` name (`STAGE2_CHOICES`) at `budget`."""
  if name in QUANT_NAMED:
    return rocketkv.RocketConfig(token_budget=budget, stage2=rocketkv.Quant(**QUANT_NAMED[name]))
  return rocketkv.RocketConfig(token_budget=budget, stage2=name)


def bench_stage2(context, budget, dtype, variants, rounds, steps, impl):
  """Median wall and process-CPU seconds per step of each stage-2 variant's `decode_step`,
  interleaved in `rounds` rounds of `steps` steps (rounds * steps + 1 <= 100, the plan's free
  slots). CPU time is the steadier number on a machine shared with other jobs. Returns
  {variant: (wall s, cpu s, bytes, plan)}."""
  q, kn, vn = _inputs(dtype)
  k1, k2 = jax.random.split(jax.random.PRNGKey(2))
  runs = {}
  for s2 in variants:
    plan = rocketkv.plan(stage2_config(budget, s2), context - 100, 100, D)
    kc = jax.random.normal(k1, (1, HKV, plan.prompt_budget, D), dtype)
    vc = jax.random.normal(k2, (1, HKV, plan.prompt_budget, D), dtype)
    state = plan.stage2.prefill(rocketkv.full_cache(kc, vc, plan.capacity, plan.chunk_size), plan)
    step = jax.jit(lambda q, kn, vn, c, plan=plan: rocketkv.decode_step(q, kn, vn, c, plan,
                                                                        impl=impl),
                   donate_argnums=3)
    held = sum(x.nbytes for x in jax.tree.leaves(state))  # K/V + summaries / codes + lengths
    out = step(q, kn, vn, state)  # compile + warm-up
    jax.block_until_ready(out)
    runs[s2] = [step, out[1], plan, [], held]
  for _ in range(rounds):
    for s2 in variants:
      step, state, plan, times, _ = runs[s2]
      t = bench_common.time_calls(step, q, kn, vn, state, repeats=steps, warmup=0,
                                  chain=_next_cache)
      times.extend(zip(t.wall, t.cpu))
      runs[s2][1] = t.out[1]
  item = jnp.dtype(dtype).itemsize
  return {s2: (statistics.median(t for t, _ in times), statistics.median(c for _, c in times),
                stage2_read_bytes(plan, item), plan, held)
          for s2, (_, _, plan, times, held) in runs.items()}


def main_stage2(args):
  print(f"backend={jax.default_backend()} devices={jax.devices()} impl={args.impl}")
  print("| dtype | context | budget | stage2 | C / chunk / r / top_k | extra | ms / step | "
        "time / minmax | CPU ms / step | CPU time / minmax | KiB read | bytes / minmax | "
        "KiB held | held / minmax |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  variants = ["minmax"] + [v for v in args.stage2 if v != "minmax"]
  for dt in args.dtypes:
    dtype = jnp.dtype(dt)
    for ctx in args.contexts:
      for b in args.budgets:
        res = bench_stage2(ctx, b, dtype, variants, args.rounds, args.steps, args.impl)
        t0, c0, b0, _, h0 = res["minmax"]
        for s2, (t, ct, nb, p, held) in res.items():
          extra = _extra(s2, p)
          print(f"| {dtype.name} | {ctx // 1024}K | {b} | {s2} | {p.capacity} / {p.chunk_size} / "
                f"{p.r} / {p.top_k} | {extra} | {t * 1e3:.3f} | {t / t0:.2f}x | "
                f"{ct * 1e3:.3f} | {ct / c0:.2f}x | {nb / 1024:.1f} | {nb / b0:.3f}x | "
                f"{held / 1024:.0f} | {held / h0:.3f}x |",
                flush=True)


def _extra(name: str, p) -> str:
  """The table's "extra" cell: the variant's own settings."""
  s = p.stage2
  if name == "rerank":
    return f"M={min(s.candidates(p.top_k), p.capacity)}"
  if name == "lowrank":
    return f"P={s.page_size} R={s.rank}"
  if name.startswith("quant"):
    return f"bits={s.bits}" + ", equal read" * (s.capacity == "equal_read") + \
        ", mean value" * s.mean_value
  return "-"


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
  ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
  ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
  ap.add_argument("--repeats", type=int, default=15)
  ap.add_argument("--stage2", nargs="+", choices=STAGE2_CHOICES, default=None,
                  help="time these stage-2 variants next to minmax instead of the dense table")
  ap.add_argument("--rounds", type=int, default=6, help="--stage2: interleaved rounds")
  ap.add_argument("--steps", type=int, default=14, help="--stage2: steps per round")
  ap.add_argument("--impl", default="auto", choices=["auto", "xla", "pallas", "interpret"],
                  help="--stage2: rocketkv.decode_step's impl")
  ap.add_argument("--skip-layers", type=int, default=0,
                  help="RocketConfig.skip_layers: add the per-layer mean over --num-layers")
  ap.add_argument("--num-layers", type=int, default=32)
  args = ap.parse_args()
  if not 0 <= args.skip_layers <= args.num_layers:
    ap.error("--skip-layers must be in [0, --num-layers]")
  if args.skip_layers and args.stage2:
    ap.error("--skip-layers applies to the dense comparison table, not --stage2")
  if args.stage2:
    if args.rounds * args.steps + 1 > 100:
      ap.error("--rounds * --steps + 1 must be <= 100 (the plan's free slots)")
    main_stage2(args)
    return
  print(f"backend={jax.default_backend()} devices={jax.devices()}")
  n_skip, n_layers = args.skip_layers, args.num_layers
  skip_head = (f" skip {n_skip}/{n_layers}: layer-mean ms | layer-mean MiB | speedup |"
               if n_skip else "")
  print("| dtype | context | budget | C / chunk / r / top_k | full ms | rocketkv ms | speedup "
        "| full MiB | rkv MiB | full floor ms | rkv floor ms | rkv / floor |" + skip_head)
  print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" * 3 if n_skip else ""))
  for dt in args.dtypes:
    dtype = jnp.dtype(dt)
    for ctx in args.contexts:
      t_full, b_full, f_full = bench_dense(ctx, dtype, args.repeats)
      for b in args.budgets:
        t_rkv, b_rkv, f_rkv, p = bench_rocketkv(ctx, b, dtype, args.repeats, n_skip)
        skip = ""
        if n_skip:  # N dense layers (the dense step's time and bytes) + the rest RocketKV's
          t_mean = (n_skip * t_full + (n_layers - n_skip) * t_rkv) / n_layers
          b_mean = layer_mean_read_bytes(p, dtype.itemsize, n_layers, ctx)
          skip = f" {t_mean * 1e3:.2f} | {b_mean / 2**20:.2f} | {t_full / t_mean:.1f}x |"
        print(f"| {dtype.name} | {ctx // 1024}K | {b} | {p.capacity} / {p.chunk_size} / {p.r} / "
              f"{p.top_k} | {t_full * 1e3:.1f} | {t_rkv * 1e3:.2f} | {t_full / t_rkv:.0f}x | "
              f"{b_full / 2**20:.0f} | {b_rkv / 2**20:.2f} | {f_full * 1e3:.1f} | "
              f"{f_rkv * 1e3:.3f} | {t_rkv / f_rkv:.0f}x |" + skip, flush=True)


if __name__ == "__main__":
  main()

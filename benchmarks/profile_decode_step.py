"""Per-op profile of one jitted, donated decode step (XLA:CPU thunks).

Two steps can be traced:
  * the attention core (default): `rocketkv.decode_step` on the shapes of
    `benchmarks/decode_attention.py` (Llama-3.1-8B attention), the step the "what is left" list
    of docs/cpu_performance.md was made from;
  * the whole model (`--model`): `models.llama.decode_step` of a checkpoint (`smollm2` for the
    embedded SmolLM2-135M) at `--batch` sequences of `--context` cached tokens, over random
    per-layer K/V built by the method's own `rocketkv.prefill`, with the cache laid out as
    one buffer per layer (`--layout layers`, what `generate` gives full KV) or stacked per run
    of like layers (`--layout stack`, what it gives the other methods). That is how issue #16's
    8K x 4 full-KV step was traced (results/throughput/README.md).

    python benchmarks/profile_decode_step.py --dtype bfloat16 --context 32768 --budget 256
    python benchmarks/profile_decode_step.py --stage2 quant      # a stage-2 variant's step
    python benchmarks/profile_decode_step.py --model smollm2 --method full --context 8000 \\
        --batch 4 --layout stack

It prints the step's wall and CPU ms (the mean of --steps untraced steps, each waited for), then
the mean microseconds per step of the most expensive ops and how many threads ran each. The
trace events exist only with --xla_cpu_enable_xprof_traceme=true, which this script adds to
XLA_FLAGS before importing jax. Profiling adds its own overhead: compare ops with each other,
not with the benchmark's wall times.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_xprof_traceme=true").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import rocketkv_jax as rocketkv  # noqa: E402

import bench_common  # noqa: E402
import decode_steps  # noqa: E402

HQ, HKV, D = 32, 8, 128


def _attention_step(a):
  """(step(state) -> state, state, title) for the attention core alone."""
  dt = jnp.dtype(a.dtype)
  free = 5 + 2 * a.steps  # slots the plan leaves for the steps run
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=a.budget, stage2=a.stage2),
                       a.context - free, free, D)
  k = jax.random.normal(jax.random.PRNGKey(0), (1, HKV, plan.prompt_budget, D), dt)
  cache = plan.stage2.prefill(rocketkv.full_cache(k, k, plan.capacity, plan.chunk_size), plan)
  q = jax.random.normal(jax.random.PRNGKey(1), (1, HQ, D), dt)
  kn = jnp.ones((1, HKV, 1, D), dt)
  # The state carries the inputs (so XLA cannot fold them, as in a model's step, where they
  # are computed) and the attention output (a step that dropped it would let XLA remove the
  # selection and the attention, and profile the append alone).
  def one(s):
    q, kn, _, cache = s
    return (q, kn) + rocketkv.decode_step(q, kn, kn, cache, plan)

  step = jax.jit(one, donate_argnums=0)
  state = (q, kn, jnp.zeros((1, HQ, D), dt), cache)
  return step, state, f"{a.dtype} context {a.context} budget {a.budget} stage2 {a.stage2}"


def _model_step(a):
  """(step(state) -> state, state, title) for a checkpoint's whole decode step."""
  model = rocketkv.models.load(rocketkv.models.resolve(a.model), dtype=jnp.dtype(a.dtype))
  free = 5 + 2 * a.steps  # slots the plan leaves for the steps run
  config = rocketkv.RocketConfig(token_budget=a.budget, method=a.method, stage2=a.stage2)
  run, state, _, _ = decode_steps.model_step(model, config, a.context, a.batch, free, a.layout)
  title = (f"{a.model} {a.dtype} {a.method}@{a.budget} context {a.context} x batch {a.batch}, "
           f"cache as {a.layout}")
  return run, state, title


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  ap.add_argument("--context", type=int, default=32768)
  ap.add_argument("--budget", type=int, default=256)
  ap.add_argument("--stage2", default="minmax", choices=list(rocketkv.STAGE2),
                  help="RocketConfig.stage2: the stage-2 variant whose step is profiled")
  ap.add_argument("--model", default=None,
                  help="trace a checkpoint's whole decode step: smollm2 (the embedded "
                       "SmolLM2-135M), gemma3 (Gemma 3 270M), an HF directory or a .gguf")
  ap.add_argument("--method", default="rocketkv", choices=list(rocketkv.METHODS),
                  help="--model: the KV method")
  ap.add_argument("--batch", type=int, default=1, help="--model: sequences")
  ap.add_argument("--layout", default="stack", choices=("stack", "layers"),
                  help="--model: the cache stacked per run of like layers, or one per layer")
  ap.add_argument("--steps", type=int, default=50,
                  help="steps timed, then as many traced (the plan leaves room for them)")
  ap.add_argument("--top", type=int, default=25)
  a = ap.parse_args(argv)
  if a.model is None and (a.method, a.batch, a.layout) != ("rocketkv", 1, "stack"):
    print("error: --method, --batch and --layout need --model", file=sys.stderr)
    return 2
  if a.steps < 1:
    print(f"error: --steps must be >= 1, got {a.steps}", file=sys.stderr)
    return 2
  try:
    step, state, title = (_model_step if a.model else _attention_step)(a)
  except (ValueError, FileNotFoundError) as e:  # --model: not a model; gemma3 not installed
    print(f"error: {e}", file=sys.stderr)
    return 2
  # 5 steps compile and warm up; each timed step is waited for
  t = bench_common.time_calls(step, state, repeats=a.steps, warmup=5,
                              chain=lambda args, out: (out,))
  wall, cpu, state = t.mean, t.cpu_mean, t.out
  us, threads, state = decode_steps.op_profile(step, state, a.steps)
  print(f"{title}: {wall * 1e3:.1f} ms / step wall, {cpu * 1e3:.1f} ms CPU (untraced); "
        f"traced, mean us per step over {a.steps} steps:")
  print("\n".join(decode_steps.profile_lines(us, threads, a.top)))
  return 0


if __name__ == "__main__":
  sys.exit(main())

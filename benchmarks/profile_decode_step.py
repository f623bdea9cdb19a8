"""Per-op profile of one jitted, donated decode step (XLA:CPU thunks).

Two steps can be traced:
  * the attention core (default): `rocketkv.decode_step` on the shapes of
    `benchmarks/decode_attention.py` (Llama-3.1-8B attention), the step the README's "what is
    left" list was made from;
  * the whole model (`--model`): `models.llama.decode_step` of a checkpoint (`smollm2` for the
    embedded SmolLM2-135M) at `--batch` sequences of `--context` cached tokens, over random
    per-layer K/V built by the method's own `rocketkv.prefill`, with the cache laid out as
    one buffer per layer (`--layout layers`, what `generate` gives full KV) or stacked per run
    of like layers (`--layout stack`, what it gives the other methods). That is how issue #16's
    8K x 4 full-KV step was traced (README, "Batched throughput").

    python benchmarks/profile_decode_step.py --dtype bfloat16 --context 32768 --budget 256
    python benchmarks/profile_decode_step.py --stage2 quant      # a stage-2 variant's step
    python benchmarks/profile_decode_step.py --model smollm2 --method full --context 8000 \\
        --batch 4 --layout stack

It prints the step's wall and CPU ms (the mean of --steps untraced steps), then
the mean microseconds per step of the most expensive ops and how many threads ran each. The
trace events exist only with --xla_cpu_enable_xprof_traceme=true, which this script adds to
XLA_FLAGS before importing jax. Profiling adds its own overhead: compare ops with each other,
not with the benchmark's wall times.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_xprof_traceme=true").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import rocketkv_jax as rocketkv  # noqa: E402
from rocketkv_jax.stage2_state import attach  # noqa: E402

HQ, HKV, D = 32, 8, 128
_SKIP = ("Thunk", "Pjit", "PjRt", "$")  # runtime / Python frames, not ops


def _attention_step(a):
  """(step(state) -> state, state, title) for the attention core alone."""
  dt = jnp.dtype(a.dtype)
  free = 5 + 2 * a.steps  # slots the plan leaves for the steps run
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=a.budget, stage2=a.stage2),
                       a.context - free, free, D)
  k = jax.random.normal(jax.random.PRNGKey(0), (1, HKV, plan.prompt_budget, D), dt)
  cache = attach(rocketkv.full_cache(k, k, plan.capacity, plan.chunk_size), plan)
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
  from rocketkv_jax.models import llama
  from rocketkv_jax.models.precision import compute_params

  model = rocketkv.models.load(rocketkv.models.smollm2_path() if a.model == "smollm2"
                               else a.model, dtype=jnp.dtype(a.dtype))
  c = model.config
  free = 5 + 2 * a.steps  # slots the plan leaves for the steps run
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=a.budget, method=a.method,
                                             stage2=a.stage2), a.context, free, c.head_dim)
  lengths = jnp.full((a.batch,), a.context, jnp.int32)
  states = []
  for i in range(c.num_layers):
    k = jax.random.normal(jax.random.PRNGKey(i), (a.batch, c.num_kv_heads, a.context,
                                                  c.head_dim), model.params["embed"].dtype)
    qw = jax.random.normal(jax.random.PRNGKey(1000 + i), (a.batch, c.num_heads,
                                                          plan.window_size, c.head_dim), k.dtype)
    states.append(rocketkv.prefill(k, k, qw, plan, lengths=lengths, layer=i))
  cache = tuple(states) if a.layout == "layers" else llama.stack_cache(tuple(states), plan)
  params = compute_params(model.params)
  tokens = jnp.zeros((a.batch,), jnp.int32)

  def one(state):  # (cache, steps taken, logits): the new token's position advances on device;
    cache, t, _ = state  # the logits are carried so that XLA keeps the last layer and the head
    logits, cache = llama.decode_step(params, cache, tokens, lengths + t, config=c, plan=plan)
    return cache, t + 1, logits

  title = (f"{a.model} {a.dtype} {a.method}@{a.budget} context {a.context} x batch {a.batch}, "
           f"cache as {a.layout}")
  logits = jnp.zeros((a.batch, model.params["embed"].shape[0]), jnp.float32)
  return jax.jit(one, donate_argnums=0), (cache, jnp.int32(0), logits), title


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  ap.add_argument("--context", type=int, default=32768)
  ap.add_argument("--budget", type=int, default=256)
  ap.add_argument("--stage2", default="minmax", choices=list(rocketkv.STAGE2),
                  help="RocketConfig.stage2: the stage-2 variant whose step is profiled")
  ap.add_argument("--model", default=None,
                  help="trace a checkpoint's whole decode step: an HF directory, a .gguf, or "
                       "smollm2 (the embedded SmolLM2-135M)")
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
  step, state, title = (_model_step if a.model else _attention_step)(a)
  for _ in range(5):  # compile and warm up
    state = step(state)
  jax.block_until_ready(state)
  t0, c0 = time.perf_counter(), time.process_time()
  for _ in range(a.steps):
    state = step(state)
  jax.block_until_ready(state)
  wall, cpu = (time.perf_counter() - t0) / a.steps, (time.process_time() - c0) / a.steps
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(a.steps):
        state = step(state)
      jax.block_until_ready(state)
    path = sorted(glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True))[-1]
    events = json.load(gzip.open(path))
  events = events["traceEvents"] if isinstance(events, dict) else events
  total, threads = collections.Counter(), collections.defaultdict(set)
  for e in events:
    if e.get("ph") == "X" and not any(s in e["name"] for s in _SKIP):
      total[e["name"]] += e.get("dur", 0)
      threads[e["name"]].add(e.get("tid"))
  print(f"{title}: {wall * 1e3:.1f} ms / step wall, {cpu * 1e3:.1f} ms CPU (untraced); "
        f"traced, mean us per step over {a.steps} steps:")
  shown = 0.0
  for name, t in total.most_common(a.top):
    print(f"{t / a.steps:11.1f}  {len(threads[name])} threads  {name}")
    shown += t / a.steps
  print(f"{shown:11.1f}  (sum of the {a.top} above; all ops: "
        f"{sum(total.values()) / a.steps:.1f})")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Shared by benchmarks/profile_decode_step.py and benchmarks/roofline.py: a model's decode step
built the way `generate` runs it and its XLA:CPU per-op profile (timed with
`bench_common.time_calls`).

The step is `models.llama.decode_step` over random per-layer K/V built by the method's own
`rocketkv.prefill` (no real prompt pass, so an 8K x 16 step needs no 8K prefill), jitted with
the cache donated and the parameters as an argument (as in `generate`'s decode program). The
per-op profile needs XLA_FLAGS to hold --xla_cpu_enable_xprof_traceme=true before jax is
imported (`TRACEME_FLAG`): the caller sets it.
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp

import rocketkv_jax as rocketkv
from rocketkv_jax import methods
from rocketkv_jax.models import llama
from rocketkv_jax.models.precision import compute_params

import bench_common

TRACEME_FLAG = "--xla_cpu_enable_xprof_traceme=true"
_SKIP = ("Thunk", "Pjit", "PjRt", "$")  # runtime / Python frames, not ops


def model_step(model, config, context: int, batch: int, free: int, layout: str = "stack"):
  """(run(state) -> state, state, plan, params) for one decode step of `model`.

  `config` is a `RocketConfig`; `free` the new tokens the plan leaves room for (the steps run).
  The state is (cache, steps taken, logits): the new token's position advances on device, and
  the logits are carried so that XLA keeps the last layer and the head. `params` are the ones
  the step reads (`compute_params`: a bf16 model's fp32 copy on a CPU without bf16 dots)."""
  c = model.config
  plan = rocketkv.plan(config, context, free, c.head_dim)
  dense = methods.get(plan.method).dense_layers(plan)
  lengths = jnp.full((batch,), context, jnp.int32)
  states = []
  for i in range(c.num_layers):
    k = jax.random.normal(jax.random.PRNGKey(i), (batch, c.num_kv_heads, context, c.head_dim),
                          model.params["embed"].dtype)
    qw = jax.random.normal(jax.random.PRNGKey(1000 + i),
                           (batch, c.num_heads, plan.window_size, c.head_dim), k.dtype)
    states.append(rocketkv.prefill(k, k, qw, plan, lengths=lengths,
                                   layer=i if i in dense else None))
  # "stack": as `generate` holds it (`llama.prefill(stacked=True)`): runs of like layers
  # stacked, except for a method that reads every slot (full KV), whose layers stand alone.
  alone = tuple(range(c.num_layers)) if methods.get(plan.method).dense else ()
  cache = (tuple(states) if layout == "layers"
           else llama.stack_cache(tuple(states), plan, alone=alone))
  params = compute_params(model.params)
  tokens = jnp.zeros((batch,), jnp.int32)

  def one(params, state):
    cache, t, _ = state
    logits, cache = llama.decode_step(params, cache, tokens, lengths + t, config=c, plan=plan)
    return cache, t + 1, logits

  step = jax.jit(one, donate_argnums=1)
  logits = jnp.zeros((batch, c.vocab_size), jnp.float32)
  run = lambda state: step(params, state)
  # the optimized HLO of the step (`op_kinds`); a compile of its own, for --profile only
  run.hlo = lambda state: step.lower(params, state).compile().as_text()
  return run, (cache, jnp.int32(0), logits), plan, params


def op_profile(run, state, steps: int):
  """(us per step by op name, thread ids by op name, state) over `steps` traced steps."""
  def traced():
    nonlocal state
    for _ in range(steps):
      state = run(state)
    jax.block_until_ready(state)

  events = bench_common.trace_events(traced, create_perfetto_trace=True)
  total, threads = collections.Counter(), collections.defaultdict(set)
  for e in events:
    if not any(s in e["name"] for s in _SKIP):
      total[e["name"]] += e.get("dur", 0)
      threads[e["name"]].add(e.get("tid"))
  return collections.Counter({k: v / steps for k, v in total.items()}), threads, state


_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) ([\w\-]+)\((.*)$")


def op_kinds(hlo: str, us: collections.Counter) -> collections.Counter:
  """Profiled op times grouped by what the op computes, from the step's optimized `hlo` text:
  "dot f32[8,1536]" for an op whose fused computation holds a dot of that shape, "TopK" for
  a custom call, else the op (or its fused computation's root) and its shape, without layout."""
  bodies, name = {}, None
  for line in hlo.splitlines():
    if line.endswith("{") and not line.startswith(" "):
      name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      bodies[name] = []
    elif name is not None and line.startswith(" "):
      bodies[name].append(line)
  kind = {}
  for line in hlo.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    op_name, shape, op, rest = m.groups()
    shape = re.sub(r"\{[^}]*\}", "", shape)
    called = re.search(r"calls=%?([\w.\-]+)", rest)
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    body = bodies.get(called.group(1), []) if called else []
    dots = [d.group(1) for d in (re.search(r"= (\S+) dot\(", b) for b in body) if d]
    if target:
      kind[op_name] = target.group(1)
    elif op == "dot" or dots:
      kind[op_name] = "dot " + re.sub(r"\{[^}]*\}", "", dots[-1] if dots else shape)
    else:
      root = [r for r in body if r.lstrip().startswith("ROOT ")]
      rm = _INSTR.match(root[0]) if root else None
      kind[op_name] = f"{rm.group(3) if rm else op} {shape}"
  out = collections.Counter()
  for op_name, t in us.items():
    out[kind.get(op_name, op_name)] += t
  return out


def profile_lines(us: collections.Counter, threads, top: int) -> list[str]:
  """The `top` most expensive ops, one line each (us per step, threads, name), and their sum."""
  lines, shown = [], 0.0
  for name, t in us.most_common(top):
    lines.append(f"{t:11.1f}  {len(threads[name])} threads  {name}")
    shown += t
  lines.append(f"{shown:11.1f}  (sum of the {top} above; all ops: {sum(us.values()):.1f})")
  return lines

"""Storage dtype vs compute dtype: when bf16 parameters are computed in bf16, and when in fp32.

A bf16 model stores its weights and its K/V caches in bf16 (half the memory of fp32). Whether its
matmuls also *run* in bf16 depends on the hardware and on XLA: XLA:CPU can keep bf16 dots in
bf16 only where the CPU has bf16 dot instructions (AVX512-BF16 or AMX-BF16), and even there it
may not: jaxlib 0.10.2 on an AVX512-BF16 AMD EPYC (no AMX) still wraps every bf16 dot in
converts (bf16 -> fp32 inputs, an fp32 `__ynn_fusion` dot, fp32 -> bf16 output), as it does on
CPUs without the instructions, and runs the elementwise ops the same way, so bf16 computes
no faster than fp32 there (docs/cpu_performance.md#bf16-on-cpu-issue-15-item-7).
`native_bf16_cpu` therefore asks the compiler: the CPU must list the instructions *and* XLA:CPU
must compile a small bf16 dot without any fp32 value in it (`_native_bf16_dot`, once per
process).

So on such a CPU a bf16 model computes in fp32: `compute_params` upcasts the weights once at the
top of each compiled program (before the decode loop, not in every step), activations are fp32,
and K/V are rounded to bf16 only where they enter the cache. The cache keeps its bf16 size; the
weights take an fp32 copy for the life of the program (2x the bf16 weights). On GPUs and on CPUs
with bf16 dot instructions nothing changes: compute follows the parameters.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

# /proc/cpuinfo flags of CPUs whose bf16 dot products XLA:CPU runs natively
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=None)
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
  """The CPU feature flags of the first processor in `path` (empty where it cannot be read)."""
  try:
    with open(path, encoding="ascii", errors="replace") as f:
      for line in f:
        if line.startswith("flags"):
          return frozenset(line.split(":", 1)[1].split())
  except OSError:
    pass
  return frozenset()


def native_bf16_cpu(path: str = "/proc/cpuinfo") -> bool:
  """True where bf16 matmuls run as bf16 on this CPU: it advertises bf16 dot instructions
  (AVX512-BF16 or AMX-BF16) and XLA:CPU compiles a bf16 dot natively (`_native_bf16_dot`).

  `ROCKETKV_NATIVE_BF16=0/1` overrides the detection (e.g. a VM that hides the flags).
  """
  env = os.environ.get("ROCKETKV_NATIVE_BF16")
  if env in ("0", "1"):
    return env == "1"
  return any(flag in cpu_flags(path) for flag in BF16_CPU_FLAGS) and _native_bf16_dot()


def bf16_dot_hlo_is_native(hlo: str) -> bool:
  """Whether the compiled HLO text of a bf16 x bf16 -> bf16 matmul holds no fp32 value (XLA
  did not convert its operands to fp32 around an fp32 dot)."""
  return "f32[" not in hlo


@functools.lru_cache(maxsize=None)
def _native_bf16_dot() -> bool:
  """Compiles a 64 x 64 bf16 matmul for the CPU backend and reads its HLO (once per process)."""
  cpu = jax.devices("cpu")[0]
  x = jax.ShapeDtypeStruct((64, 64), jnp.bfloat16,
                           sharding=jax.sharding.SingleDeviceSharding(cpu))
  return bf16_dot_hlo_is_native(jax.jit(jnp.matmul).lower(x, x).compile().as_text())


def compute_dtype(dtype) -> jnp.dtype:
  """The dtype activations run in for parameters of `dtype` on the default backend."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.bfloat16 and jax.default_backend() == "cpu" and not native_bf16_cpu():
    return jnp.dtype(jnp.float32)
  return dtype


def compute_params(params):
  """`params` in their compute dtype: bf16 floating leaves upcast to fp32 where bf16 would not
  run natively (see the module docstring); otherwise `params` itself. Trace-time decision."""
  leaves = jax.tree_util.tree_leaves(params)
  if not leaves or compute_dtype(leaves[0].dtype) == leaves[0].dtype:
    return params
  target = compute_dtype(leaves[0].dtype)
  return jax.tree.map(
      lambda a: a.astype(target) if a.dtype == jnp.bfloat16 else a, params)

"""Kernels are chosen where the program runs: a decode step traced on this CPU host and exported
for CUDA carries the Triton kernels; exported for CPU it does not."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import rocketkv_jax as rocketkv

TRITON = "__gpu$xla.gpu.triton"


def _exported(impl, platform):
  rng = np.random.default_rng(0)
  b, hkv, g, l, d = 1, 2, 2, 64, 16
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=16, window_size=4), l, 4, d)
  k = jnp.asarray(rng.standard_normal((b, hkv, l, d)), jnp.float32)
  qw = jnp.asarray(rng.standard_normal((b, hkv * g, 4, d)), jnp.float32)
  state = rocketkv.prefill(k, k, qw, plan, impl="xla")
  q = jnp.zeros((b, hkv * g, d), jnp.float32)
  kn = jnp.zeros((b, hkv, 1, d), jnp.float32)
  step = jax.jit(functools.partial(rocketkv.decode_step, plan=plan, impl=impl))
  exp = export.export(step, platforms=[platform],
                      disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])
  return exp(q, kn, kn, state).mlir_module()


@pytest.mark.parametrize("impl", ["pallas", "auto"])
def test_exported_for_cuda_has_the_triton_kernels(impl):
  text = _exported(impl, "cuda")
  assert text.count(TRITON) == 2  # the fused stage 2: chunk scores, then select + attend
  assert "rocketkv_fused_chunk_scores" in text and "rocketkv_fused_select_attend" in text


@pytest.mark.parametrize("impl", ["pallas", "auto", "xla"])
def test_exported_for_cpu_has_none(impl):
  assert TRITON not in _exported(impl, "cpu")


def test_xla_exported_for_cuda_has_none():
  assert TRITON not in _exported("xla", "cuda")

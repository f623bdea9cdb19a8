"""Kernels are chosen where the program runs: a decode step traced on this CPU host and exported
for CUDA carries the Triton kernels; exported for CPU it does not. `rocketkv.export_decode_step`
sets the safety checks the kernels need; `impl="pallas"` is checked against the platforms."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import rocketkv_jax as rocketkv
from rocketkv_jax.export import disabled_checks

TRITON = "__gpu$xla.gpu.triton"


def _inputs():
  rng = np.random.default_rng(0)
  b, hkv, g, l, d = 1, 2, 2, 64, 16
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=16, window_size=4), l, 4, d)
  k = jnp.asarray(rng.standard_normal((b, hkv, l, d)), jnp.float32)
  qw = jnp.asarray(rng.standard_normal((b, hkv * g, 4, d)), jnp.float32)
  state = rocketkv.prefill(k, k, qw, plan, impl="xla")
  q = jnp.zeros((b, hkv * g, d), jnp.float32)
  kn = jnp.zeros((b, hkv, 1, d), jnp.float32)
  return plan, q, kn, state


def _exported(impl, platform):
  plan, q, kn, state = _inputs()
  exp = rocketkv.export_decode_step(plan, q, kn, kn, state, platforms=(platform,), impl=impl)
  return exp.mlir_module()


@pytest.mark.parametrize("impl", ["pallas", "auto"])
def test_exported_for_cuda_has_the_triton_kernels(impl):
  text = _exported(impl, "cuda")
  assert text.count(TRITON) == 2  # the fused stage 2: chunk scores, then select + attend
  assert "rocketkv_fused_chunk_scores" in text and "rocketkv_fused_select_attend" in text


@pytest.mark.parametrize("impl", ["auto", "xla"])
def test_exported_for_cpu_has_none(impl):
  text = _exported(impl, "cpu")
  assert TRITON not in text and "tpu_custom_call" not in text


def test_xla_exported_for_cuda_has_none():
  assert TRITON not in _exported("xla", "cuda")


def test_plain_jax_export_needs_the_triton_check_disabled():
  """What `export_decode_step` saves a user: a bare `jax.export` for CUDA refuses the Triton
  call; `disabled_checks(["cuda"])` is the list it needs (none for cpu / tpu)."""
  plan, q, kn, state = _inputs()
  step = jax.jit(functools.partial(rocketkv.decode_step, plan=plan))
  with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
    export.export(step, platforms=["cuda"])(q, kn, kn, state)
  exp = export.export(step, platforms=["cuda"], disabled_checks=disabled_checks(["cuda"]))
  assert TRITON in exp(q, kn, kn, state).mlir_module()
  assert disabled_checks(["tpu"]) == [] and disabled_checks(["cpu"]) == []


def test_pallas_needs_a_platform_with_kernels():
  """impl="pallas" names the compiled kernels: on this CPU host, or exported for CPU, it is a
  ValueError when traced, naming the platforms that have them (never a silent interpret mode)."""
  plan, q, kn, state = _inputs()
  with pytest.raises(ValueError, match=r"impl='pallas' needs a platform in \('cuda', 'tpu'\)"):
    rocketkv.decode_step(q, kn, kn, state, plan, impl="pallas")
  with pytest.raises(ValueError, match="got 'cpu'"):
    _exported("pallas", "cpu")


def test_bad_export_arguments_raise():
  plan, q, kn, state = _inputs()
  with pytest.raises(ValueError, match="platforms must be"):
    rocketkv.export_decode_step(plan, q, kn, kn, state, platforms=("gpu",))
  with pytest.raises(ValueError, match="one per call"):
    rocketkv.export_decode_step(plan, q, kn, kn, state, platforms=("cuda", "tpu"))
  with pytest.raises(ValueError, match="impl must be one of"):
    rocketkv.export_decode_step(plan, q, kn, kn, state, impl="triton")

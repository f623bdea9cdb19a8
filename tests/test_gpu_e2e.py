"""benchmarks/gpu_e2e.py: its --tiny run on CPU, and the Llama-3.1-8B-shaped decode step it
times on a GPU exported for CUDA from this CPU (shapes only, nothing allocated), carrying the
Pallas kernels."""

import functools
import json
import pathlib
import runpy
import types

import jax
import jax.numpy as jnp
import pytest
from jax import export

import rocketkv_jax as rocketkv
from rocketkv_jax.eval import variants
from rocketkv_jax.models import llama

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_e2e.py"
TRITON = "__gpu$xla.gpu.triton"


def _module():
  """The script's functions and constants, run afresh (its deadline clock starts now)."""
  return types.SimpleNamespace(**runpy.run_path(str(SCRIPT)))


def test_tiny_run_writes_json_and_table(tmp_path):
  mod = _module()
  assert mod.main(["--tiny", "--out", str(tmp_path)]) == 0
  data = json.loads((tmp_path / "gpu_e2e.json").read_text())
  rows = data["rows"]
  assert [r["method"] for r in rows] == list(mod.METHODS)
  for r in rows:
    assert "error" not in r and "skipped" not in r, r
    assert r["decode_steps"] == data["meta"]["new_tokens"] - 1
    assert r["prefill_s"] > 0 and r["decode_tok_s"] > 0
  table = (tmp_path / "gpu_e2e.md").read_text()
  assert "speed-up vs full" in table and "3.7x" in table and "2.26x" in table
  assert table.count("| 512 | 2 |") == 3


def test_deadline_skips_rows(tmp_path):
  mod = _module()
  assert mod.main(["--tiny", "--deadline-s", "0", "--out", str(tmp_path)]) == 0
  rows = json.loads((tmp_path / "gpu_e2e.json").read_text())["rows"]
  assert all(r["skipped"] == "skipped: past --deadline-s" for r in rows)


def test_small_heads_is_the_recommended_config():
  assert _module().SMALL_HEADS == variants.RECOMMENDED_SPEC


def test_memory_estimate_of_the_8b_rows():
  mod = _module()
  config = mod.model_config(tiny=False)
  est = functools.partial(mod.estimate_gb, config)
  # full KV at 128K x 8: the K/V alone are 32 layers x 2 x 8 x 8 heads x 131008 x 128 x 2 B
  assert est(131008, 8, "full") > 137 + 32
  assert est(32768, 1, "rocketkv") < 50


@pytest.mark.parametrize("spec, kernels", [
    ("rocketkv", ("rocketkv_fused_chunk_scores", "rocketkv_fused_select_attend")),
    (_module().SMALL_HEADS, ("rocketkv_fused_quant_scores", "rocketkv_fused_select_attend")),
])
def test_8b_decode_step_exports_for_cuda_with_the_kernels(spec, kernels, monkeypatch):
  # bf16 weights compute in bf16 on a GPU; this CPU would trace an fp32 upcast (precision.py)
  monkeypatch.setenv("ROCKETKV_NATIVE_BF16", "1")
  config = _module().model_config(tiny=False)
  params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.bfloat16),
                        llama.param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
  b, length = 1, 32768
  plan = rocketkv.plan(variants.rocket_config(spec, 256), length, 64, config.head_dim)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  _, cache = jax.eval_shape(
      functools.partial(llama.prefill, config=config, plan=plan, stacked=True),
      params, jax.ShapeDtypeStruct((b, length), jnp.int32), lengths)
  step = jax.jit(functools.partial(llama.decode_step, config=config, plan=plan, impl="auto"))
  exp = export.export(step, platforms=["cuda"],
                      disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(
                          params, cache, lengths, lengths)
  text = exp.mlir_module()
  assert text.count(TRITON) >= 2
  assert all(name in text for name in kernels)
  assert exp.in_avals[0].dtype == jnp.bfloat16 and exp.out_avals[0].shape == (b, 128256)

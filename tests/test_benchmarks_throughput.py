"""benchmarks/throughput.py: one fast grid on a tiny checkpoint (our full KV and transformers,
each in its own subprocess), its KV bytes against the caches' shapes, and the target lines."""

import json

import pytest

import bench_scripts
from model_fixtures import TINY, hf_checkpoint


def _module():
  return bench_scripts.load("throughput")


def test_grid_on_a_tiny_checkpoint(tmp_path):
  pytest.importorskip("transformers")
  path, _ = hf_checkpoint("llama31")
  length, batch, new = 48, 2, 4
  out = tmp_path / "out"
  rc = _module().main(["--model", path, "--lengths", str(length), "--batches", str(batch),
                       "--methods", "full,transformers", "--new-tokens", str(new),
                       "--out", str(out)])
  assert rc == 0
  rows = json.loads((out / "throughput.json").read_text())["rows"]
  assert [r["method"] for r in rows] == ["full", "transformers"]
  prompts = json.loads((out / "prompts.json").read_text())[f"{length}x{batch}"]
  assert [len(p) for p in prompts] == [48, 46]  # ragged: L - floor(0.1 L i / B)
  layers, hkv, d = TINY["num_hidden_layers"], TINY["num_key_value_heads"], TINY["head_dim"]
  for r in rows:
    assert "error" not in r, r
    assert r["new_tokens"] == [new] * batch and r["decode_steps"] == new - 1
    assert r["decode_tokens_per_s"] == pytest.approx((new - 1) * batch / r["decode_s"])
    assert r["prefill_s"] > 0 and r["prefill_cpu_s"] > 0
    assert 100 < r["peak_decode_mb"] <= r["peak_process_mb"]
    assert 100 < r["peak_prefill_mb"] <= r["peak_process_mb"]
  ours, hf = rows
  # ours: per layer K and V [B, Hkv, L + N, D] fp32, pos [B, Hkv, C] int32, length and seen
  # int32 and overflow bool per sequence; full KV keeps no chunk summaries.
  c = length + new
  assert ours["kv_bytes"] == layers * (2 * batch * hkv * c * d * 4 + batch * hkv * c * 4
                                       + batch * (4 + 4 + 1))
  # transformers: K and V of every token but the last generated one, left-padded to L
  assert hf["kv_bytes"] == layers * 2 * batch * hkv * (length + new - 1) * d * 4
  table = (out / "throughput.md").read_text()
  assert "| 48 / 94 | 2 | float32 | full |" in table
  assert "our full-KV decode tok/s / transformers'" in table


def test_recommended_rows_run_the_recommended_config(tmp_path):
  """`--methods recommended` runs `RocketConfig.recommended(B)` beside the paper's rocketkv."""
  path, _ = hf_checkpoint("llama31")
  out = tmp_path / "out"
  rc = _module().main(["--model", path, "--lengths", "64", "--batches", "1", "--budgets", "32",
                       "--methods", "rocketkv,recommended", "--new-tokens", "3",
                       "--out", str(out)])
  assert rc == 0
  rows = json.loads((out / "throughput.json").read_text())["rows"]
  assert [(r["method"], r["budget"]) for r in rows] == [("rocketkv", 32), ("recommended", 32)]
  assert all("error" not in r and r["decode_steps"] == 2 for r in rows), rows
  assert rows[0]["rocket_config"] is None
  import rocketkv_jax as rocketkv
  assert rows[1]["rocket_config"] == repr(rocketkv.RocketConfig.recommended(32))
  assert "| 64 / 64 | 1 | float32 | recommended@32 |" in (out / "throughput.md").read_text()


def _row(method, budget, tps, peak, prefill, cpu_tps=None):
  return dict(length=8000, dtype="float32", batch=8, method=method, budget=budget,
              decode_tokens_per_s=tps, decode_steps=63,
              decode_cpu_s=63 * 8 / (cpu_tps or tps), peak_decode_mb=peak, prefill_s=prefill,
              prefill_cpu_s=prefill)


def test_target_lines():
  rows = [_row("full", None, 10.0, 4000.0, 100.0),
          _row("rocketkv", 256, 41.0, 2100.0, 104.0, cpu_tps=30.0),
          _row("rocketkv", 512, 20.0, 2500.0, 106.0),
          _row("transformers", None, 9.0, 4500.0, 90.0)]
  got = _module().targets(rows)
  want = [
      "RocketKV@256 decode tok/s / our full KV's: 41.00 / 10.00 = 4.10 (target >= 4): met "
      "(CPU time: 3.00)",
      "RocketKV@256 decode tok/s / transformers': 41.00 / 9.00 = 4.56 (target >= 5): NOT met",
      "our full-KV decode tok/s / transformers': 10.00 / 9.00 = 1.11 (target >= 1): met",
      "decode peak RSS (MB): 2100.00 / 4000.00 = 0.53 (target <= 0.5): NOT met",
      "rocketkv@256 prefill s / our full KV's: 104.00 / 100.00 = 1.04 (target <= 1.05): met",
      "rocketkv@512 prefill s / our full KV's: 106.00 / 100.00 = 1.06 (target <= 1.05): NOT met",
  ]
  assert len(got) == len(want)
  for w in want:
    assert any(w in line and line.startswith("- 8000 x 8 float32: ") for line in got), w


def test_user_errors_exit_2(tmp_path, capsys):
  path, _ = hf_checkpoint("llama31")
  mod = _module()
  assert mod.main(["--model", path, "--methods", "full,h2o"]) == 2
  assert "error: --methods must be a subset of" in capsys.readouterr().err
  (tmp_path / "old.md").write_text("x")
  assert mod.main(["--model", path, "--out", str(tmp_path)]) == 2
  assert "already holds files" in capsys.readouterr().err


def test_profile_attributes_ops_to_source_lines():
  import inspect

  import jax
  import jax.numpy as jnp

  def f(x):
    return jnp.exp(x) * 2.0

  line = inspect.getsourcelines(f)[1] + 1  # the line of `jnp.exp`
  exe = jax.jit(f).lower(jnp.ones(8)).compile()
  src = _module()._hlo_sources(exe.as_text())
  assert any(v.startswith(f"test_benchmarks_throughput.py:{line} ") and "test_profile" in v
             for v in src.values()), src

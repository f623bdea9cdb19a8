"""Issue #14's output check: a re-run of a committed eval sweep slice gives identical records.

    python examples/evaluate.py --tasks niah_single --lengths 2048 \\
        --methods full exact_topk rocketkv rocketkv:r=35 snapkv quest sparq streamingllm \\
        --budgets 256 --samples 10 --batch-size 10 --max-new-tokens 48 --seed 0 \\
        --no-gold-score --out /tmp/slice --name slice
    python results/refactor_check/compare_records.py /tmp/slice/slice.json

Compares every field the committed records of `results/results.json` hold (niah_single, 2K,
samples 0-9: the first batch of 10 of the committed run, so the shapes are the same) with the
re-run's. `rocketkv:r=35` is rocketkv with the r the committed run derived (rounding); today's
`rocketkv` derives r = 34 by truncation (issue #13 item 4, a deliberate change).
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(path):
  new = json.load(open(path))
  old = json.load(open(os.path.join(HERE, "..", "results.json")))
  committed = {(r["method"], r["budget"], r["index"]): r for r in old["records"]
               if r["task"] == "niah_single" and r["context_len"] == 2048}
  rows = {}
  for r in new["records"]:
    o = committed[("rocketkv" if r["method"] == "rocketkv:r=35" else r["method"], r["budget"],
                   r["index"])]
    fields = [k for k in o if k != "method"]
    n, same = rows.get(r["method"], (0, 0))
    rows[r["method"]] = (n + 1, same + all(o[k] == r.get(k) for k in fields))
  print("| method | records identical to the committed ones |\n|---|---|")
  for m, (n, same) in rows.items():
    print(f"| {m} | {same} / {n} |")


if __name__ == "__main__":
  main(sys.argv[1])

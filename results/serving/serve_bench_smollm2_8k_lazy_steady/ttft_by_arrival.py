"""TTFT by arrival from this folder's guidellm reports (run from the repository root):

    python3 results/serving/serve_bench_smollm2_8k_lazy_steady/ttft_by_arrival.py --first 46

Per method: `serve_bench._ttft_all` (TTFT p50 over every request sent, with bounds for the ones
cut off before a first token), each request's wait for its first token in arrival order (None:
none by the cutoff), and the median over the first `--first` arrivals (a lower bound when one
of them had no first token: it waited at least until the cutoff)."""

import argparse
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, "benchmarks")
import serve_bench  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--first", type=int, default=46)
ap.add_argument("--dir", default=os.path.dirname(os.path.abspath(__file__)))
a = ap.parse_args()
for path in sorted(glob.glob(os.path.join(a.dir, "guidellm_*.json"))):
  gl = json.load(open(path))
  waits = serve_bench.first_token_waits(gl)
  first = waits[:a.first]
  cut = sum(not ok for _, ok in first)
  print(os.path.basename(path), serve_bench._ttft_all(gl))
  print("  first-token waits in arrival order, s:",
        [round(w) if ok else None for w, ok in waits])
  print(f"  median over the first {len(first)} arrivals: {statistics.median(w for w, _ in first):.1f} s"
        + (f" (a lower bound: {cut} had no first token)" if cut else ""))

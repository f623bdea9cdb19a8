"""Scripts of benchmarks/ imported in-process, as `python3 benchmarks/x.py` runs them: with
benchmarks/ on sys.path, where they import their shared `bench_common`. It is appended, so a
name there never hides an installed package (none does: benchmarks/kernel_bench.py is named so
that it does not shadow PyPI's `kernels`)."""

import importlib
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
  """The module of benchmarks/<name>.py."""
  if str(BENCHMARKS) not in sys.path:
    sys.path.append(str(BENCHMARKS))
  return importlib.import_module(name)

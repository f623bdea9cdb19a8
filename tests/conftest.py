import os
import sys

# `python -m pytest` puts the repo root on sys.path, where our top-level kernels/ would shadow
# the PyPI package `kernels` that transformers imports; the project is imported as installed.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from xla_env import with_fast_compile  # noqa: E402  (tests/ is on sys.path)

os.environ["XLA_FLAGS"] = with_fast_compile(os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
import pytest  # noqa: E402

import rocketkv_jax  # noqa: E402,F401  (sets its XLA:CPU flag before any backend starts)

jax.config.update("jax_default_matmul_precision", "highest")


# Memory for one test worker: the largest process of a 2-worker run peaked at 5.9 GB
# (docs/cpu_performance.md, "The tests and CI").
WORKER_GIB = 6


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
  """`-n auto` (pytest-xdist): one worker per core this process may use, but no more than the
  memory holds at WORKER_GIB each; PYTEST_XDIST_AUTO_NUM_WORKERS overrides, as in xdist."""
  if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").isdigit():
    return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  try:
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
  except (ValueError, OSError, AttributeError):  # no sysconf for it on this platform
    return max(1, cores or 1)
  return max(1, min(cores or 1, int(memory_gib // WORKER_GIB)))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops every compiled program after each test module. XLA:CPU maps each program's machine
  code into memory mappings of its own, and a process has at most `vm.max_map_count` (65530 by
  default; `Runner.release_compiled` has the story): test_stage2 + test_eval_harness left 25.4K
  mappings in one process, 5.7K with this, and a full-suite run (beside two evals) crashed with
  a segfault in a compile in its last module."""
  yield
  jax.clear_caches()

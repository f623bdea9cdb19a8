import runpy
from pathlib import Path

import numpy as np


def test_core_api_example_runs():
  mod = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "core_api.py"))
  out, cache = mod["main"](prompt_len=512, new_tokens=3, budget=64)
  assert out.shape == (2, 32, 128) and np.isfinite(np.asarray(out, np.float32)).all()
  plan_kept = int(cache.length[0])
  assert plan_kept < 512 and int(cache.length[1]) <= plan_kept

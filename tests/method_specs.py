"""Every registered method and stage-2 variant as a spec string, and its plan at the tiny sizes
the layer-loop tests use (tests/test_layer_scan.py, tests/test_runner_programs.py)."""

import rocketkv_jax as rocketkv
from rocketkv_jax import methods
from rocketkv_jax.methods import stage2

NAMES = sorted(methods.REGISTRY)
SPECS = NAMES + [f"{n}:{s}" for n in NAMES for s in methods.get(n).stage2_variants
                 if s != "minmax"] + ["rocketkv:skip_layers"]


def stage2_of(name: str) -> "stage2.Stage2":
  """The stage-2 variant `name` ("" for the default) at the tiny test sizes: small lowrank pages,
  so that several are summarised; every other variant with its defaults."""
  if name == "lowrank":
    return stage2.LowRank(page_size=8, rank=3)
  return stage2.get(name or "minmax")


def spec_plan(spec: str, length: int, new: int, head_dim: int, *, window: int = 4,
              page_size: int = 4) -> "rocketkv.Plan":
  """`method[:stage2 variant | :skip_layers]` at budget 16 (skip_layers: the first 2 dense)."""
  name, _, extra = spec.partition(":")
  kw = dict(token_budget=16, window_size=window, page_size=page_size, sink_size=2, method=name)
  if extra == "skip_layers":
    kw["skip_layers"] = 2
  elif extra:
    kw["stage2"] = stage2_of(extra)
  return rocketkv.plan(rocketkv.RocketConfig(**kw), length, new, head_dim)

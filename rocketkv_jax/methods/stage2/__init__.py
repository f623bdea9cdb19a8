"""RocketKV's stage-2 variants, by name: one file per variant, one registry line each.

    RocketConfig(token_budget=256, stage2=Quant(bits=4, capacity="equal_read"))
    RocketConfig(token_budget=256, stage2="quant")      # a name: that variant's defaults

`RocketConfig.stage2` and `Plan.stage2` hold the variant object (frozen, hashable); the methods
with variants (`Method.stage2_variants`: rocketkv, rocketkv_mt) ask it for their split changes,
their decode state and each step's read. To add a variant, write `methods/stage2/<name>.py`
with a `Stage2` subclass (base.py documents what it may override) and register it below;
tests/test_methods.py then runs it through the contract every method meets.
"""

from __future__ import annotations

from typing import Any

from rocketkv_jax._checks import require
from rocketkv_jax.methods.stage2.base import Stage2, cache_of
from rocketkv_jax.methods.stage2.lowrank import LowRank
from rocketkv_jax.methods.stage2.minmax import MinMax
from rocketkv_jax.methods.stage2.quant import Quant
from rocketkv_jax.methods.stage2.rerank import Rerank

REGISTRY: dict[str, type[Stage2]] = {}


def register(cls: type[Stage2]) -> type[Stage2]:
  """Adds the variant class `cls` under `cls.name` (a new name only)."""
  require(isinstance(cls, type) and issubclass(cls, Stage2) and cls.name
          and cls.name not in REGISTRY, f"stage2 variant must be a Stage2 class with a new "
          f"name, got {cls!r}")
  REGISTRY[cls.name] = cls
  return cls


register(MinMax)
register(Rerank)
register(LowRank)
register(Quant)


def get(stage2: str | Stage2) -> Stage2:
  """The variant `stage2` names (with its defaults), or `stage2` itself if it is one."""
  if isinstance(stage2, Stage2):
    return stage2
  require(isinstance(stage2, str) and stage2 in REGISTRY,
          f"stage2 must be one of {list(REGISTRY)} or a Stage2 variant, got {stage2!r}")
  return REGISTRY[stage2]()


def spec_keys() -> dict[str, tuple[type[Stage2], str]]:
  """Every variant's spec key (`quant_bits`, ...) -> (its class, the field it sets)."""
  return {k: (cls, f) for cls in REGISTRY.values() for k, f in cls.spec_keys().items()}


def from_spec(name: str, keys: dict[str, Any]) -> Stage2:
  """The variant `name` with the fields its spec keys set (`{"quant_bits": 2}` -> Quant(bits=2)).

  ValueError for a key of another variant, naming the variant it needs."""
  cls = get(name).__class__
  fields = {}
  for key, val in keys.items():
    owner, field = spec_keys().get(key, (None, None))
    require(owner is cls, f"{key}={val!r} needs stage2={owner.name if owner else None!r}, "
            f"got {name!r}")
    fields[field] = val
  return cls(**fields)


__all__ = ["LowRank", "MinMax", "Quant", "REGISTRY", "Rerank", "Stage2", "cache_of", "from_spec",
           "get", "register", "spec_keys"]

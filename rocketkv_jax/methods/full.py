"""Full KV: no compression; every cached token is read each step (the accuracy reference)."""

from __future__ import annotations

import dataclasses

from rocketkv_jax.methods.base import Method


@dataclasses.dataclass(frozen=True)
class Full(Method):
  """Every default of `Method`: dense over an uncompressed cache; B is ignored."""

  name = "full"
  summary = "no compression; B is ignored; every token is read each step"
  uses_budget = False

"""`Stage2`: what a RocketKV stage-2 variant is, and the behaviour the variants share.

A variant is a small frozen dataclass whose fields are its own settings (`Rerank(factor=1.5)`),
checked when it is made (one-line ValueError naming the field). Hashable: it travels in
`RocketConfig.stage2` and `Plan.stage2` as a static jit argument. It owns

    check_config(config)                 its rules across RocketConfig fields (before tracing)
    split(split, prompt_len, new, D)     its changes to the paper's split (`budget.paper_split`)
    prefill(cache, plan)                 its decode state around the stage-1 cache
    after_append(state, new)             the state once `cache.append` made `new` of its cache
    select(q, state, plan)               the top_k slots of one decode query
    attend(q, state, plan)               one step's attention (default: attend over `select`)

The default state is the `KVCache` itself ("minmax", "rerank"); a variant with summaries beside
the cache ("lowrank", "quant") keeps them in a flax struct whose `cache` field is the `KVCache`
(`cache_of`).

`spec_keys` names its fields in method specs and eval records (`rocketkv:stage2=quant,
quant_bits=2`): `<name>_<field>` unless the variant says otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax

from rocketkv_jax.attend import attend
from rocketkv_jax.budget import Plan
from rocketkv_jax.cache import KVCache


@dataclasses.dataclass(frozen=True)
class Stage2:
  """Base of every stage-2 variant (see the module docstring)."""

  name: ClassVar[str] = ""
  # The class of its decode state (`prefill`'s result): checked before each decode step.
  state_type: ClassVar[type] = KVCache
  # Spec key -> field, where a field's key is not `<name>_<field>` (Quant's "mean_value").
  key_overrides: ClassVar[dict[str, str]] = {}
  # Its scores use the r query dims of `ops.top_r_dims` (so `RocketConfig.group_dims` applies).
  picks_dims: ClassVar[bool] = True

  # ---------------------------------------------------------------- configuration
  @classmethod
  def spec_keys(cls) -> dict[str, str]:
    """Spec / record key -> field name, for every field."""
    keys = {f"{cls.name}_{f.name}": f.name for f in dataclasses.fields(cls)}
    keys = {k: v for k, v in keys.items() if v not in cls.key_overrides.values()}
    return dict(keys, **cls.key_overrides)

  def record(self) -> dict[str, Any]:
    """Its fields under their spec keys (what eval records store beside `stage2=<name>`)."""
    return {k: getattr(self, f) for k, f in self.spec_keys().items()}

  def check_config(self, config) -> None:
    """ValueError (one line) if the rest of `config` (a `RocketConfig`) does not fit it."""

  def split(self, split: dict, prompt_len: int, max_new_tokens: int, head_dim: int) -> dict:
    """The Plan fields of the paper's `split` as this variant changes them (default: none)."""
    del prompt_len, max_new_tokens, head_dim
    return split

  # ---------------------------------------------------------------- state
  def prefill(self, cache: KVCache, plan: Plan) -> Any:
    """Its decode state around a freshly prefilled (stage-1) `cache`."""
    del plan
    return cache

  def after_append(self, state, new: KVCache):
    """The state whose cache `cache.append` turned into `new`, summaries kept current."""
    del state
    return new

  # ---------------------------------------------------------------- decoding
  def select(self, q: jax.Array, state, plan: Plan, *, sliding_window: int | None = None,
             impl: str = "auto") -> jax.Array:
    """int32 `[B, Hkv, min(top_k, C)]` slots of `cache_of(state)` (holding q's token)."""
    raise NotImplementedError

  def attend(self, q: jax.Array, state, plan: Plan, *, sliding_window: int | None = None,
             impl: str = "auto") -> jax.Array:
    """One decode step's attention `[B, Hq, D]` over `state` (after the step's append)."""
    idx = self.select(q, state, plan, sliding_window=sliding_window, impl=impl)
    return attend(q, cache_of(state), idx, sliding_window=sliding_window, impl=impl)


def cache_of(state) -> KVCache:
  """The `KVCache` inside a stage-2 state (the state itself for a cache)."""
  return state if isinstance(state, KVCache) else state.cache

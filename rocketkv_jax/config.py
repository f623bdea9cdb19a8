"""`RocketConfig` (what the user asks for) and `plan` (the static budget split it implies).

Each method owns its rules and its split (rocketkv_jax/methods/); this module checks what every
method shares and asks the method for the rest. RocketKV's split is the paper's
(`budget.paper_split`, where the formula and its edge-case decisions are written down). Every
method shares the same budget meaning, "about B tokens' worth of K/V read per decode step" (see
`METHODS`).
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np

from rocketkv_jax import methods
from rocketkv_jax._checks import require, require_int
from rocketkv_jax.budget import Plan
from rocketkv_jax.evict import WINDOW_REDUCE
from rocketkv_jax.methods import METHODS, STAGE2
from rocketkv_jax.methods import stage2 as stage2_lib
from rocketkv_jax.methods.stage2 import Quant, Stage2
from rocketkv_jax.ops import GROUP_DIMS

__all__ = ["GROUP_DIMS", "METHODS", "Plan", "RECOMMENDED", "RocketConfig", "STAGE2",
           "WINDOW_REDUCE", "check_num_layers", "plan"]

# The fields `RocketConfig.recommended` sets: per-token key codes read at the paper's bytes,
# the window's max in stage 1, every query head weighed the same in the choice of r dims.
# Why these: docs/stage2_variants.md.
RECOMMENDED = types.MappingProxyType({
    "method": "rocketkv", "stage2": Quant(capacity="equal_read"), "window_reduce": "max",
    "group_dims": "normalized"})


@dataclasses.dataclass(frozen=True)
class RocketConfig:
  """What the user asks for. Frozen and hashable: usable as a static jit argument.

  Attributes:
    token_budget: B, tokens' worth of K/V read per decode step.
    method: one of `METHODS`.
    window_size: stage-1 observation window (the last W prompt queries), always kept.
    kernel_size: stage-1 max-pooling kernel (odd).
    window_reduce: how stage 1 reduces the window's attention probabilities to one score per
      key, over the W window queries and the G query heads of a KV head's group: "sum" (SnapKV
      and the paper) or "max" (the largest probability any of them gives the key, so one sharp
      query is not outweighed by the others' diffuse mass). Every method with a SnapKV stage 1
      (rocketkv, rocketkv_mt, snapkv) honours it.
    group_dims: how the G query heads of a KV head's group weigh in stage 2's choice of the r
      query dims its approximate scores use (`GROUP_DIMS`): "sum" (SparQ and the paper: the r
      dims with the largest |q| summed over the group) or "normalized" (each head's |q| divided
      by its own sum over the dims first: every head counts the same, as the group-summed
      softmax of the scores counts them, so a head with a small query norm still gets its
      dims). The same bytes read either way. For the methods that pick dims
      (`Method.picks_dims`: rocketkv, rocketkv_mt, sparq; not with `stage2="lowrank"`);
      others reject a value other than "sum". Why: docs/stage2_variants.md.
    alpha, capacity, prompt_budget, top_k, chunk_size, r: optional overrides of the split.
      A fixed `alpha` reproduces the paper's ablations.
    page_size: Quest page size (tokens per min/max summary).
    sink_size: StreamingLLM attention-sink tokens.
    stage2: the stage-2 variant, a `Stage2` object from rocketkv_jax/methods/stage2/ (its own
      settings are its fields), or a name of `STAGE2` for that variant with its defaults
      (stored as the object). For the methods that have variants (`Method.stage2_variants`:
      rocketkv, rocketkv_mt): `MinMax()` (the paper: chunk min/max bounds), `Rerank(factor)`
      (the bounds shortlist `factor * top_k` slots, per-token scores on the same r dims keep
      `top_k`), `LowRank(page_size, rank)` (page-local low-rank key summaries, per-token
      scores), `Quant(bits, capacity, mean_value)` (per-token low-bit key codes on per-channel
      grids, scored on the same r dims). Their defaults keep the bytes read per step close to
      minmax's (docs/stage2_variants.md#defaults-and-step-cost).
    skip_layers: the first `skip_layers` layers keep their whole cache (no stage-1 eviction) and
      attend densely at every decode step, for the methods that accept it
      (`Method.accepts_skip_layers`: rocketkv, rocketkv_mt; others reject a value other than 0).
      An ablation: each dense layer reads its full cache every step, so the read per step grows
      by about skip_layers / num_layers of full KV's. At most the model's number of layers
      (checked where it is known: `check_num_layers`); equal to it, every layer is dense.
    read_mass: for `exact_topp` only (an oracle): each KV head reads the fewest rows that hold
      this share of its exact attention mass, in (0, 1].
  """

  token_budget: int
  method: str = "rocketkv"
  window_size: int = 32
  kernel_size: int = 63
  window_reduce: str = "sum"
  group_dims: str = "sum"
  alpha: float | None = None
  capacity: int | None = None
  prompt_budget: int | None = None
  top_k: int | None = None
  chunk_size: int | None = None
  r: int | None = None
  page_size: int = 16
  sink_size: int = 4
  stage2: Stage2 | str = "minmax"
  skip_layers: int = 0
  read_mass: float | None = None

  @classmethod
  def recommended(cls, token_budget: int, **fields) -> "RocketConfig":
    """The recommended configuration (`RECOMMENDED`) at budget B; `fields`
    override it, e.g. `method="rocketkv_mt"` for multi-turn. The default config stays the
    paper's, which loses needles on small heads and on Gemma 3 (docs/stage2_variants.md)."""
    return cls(token_budget=token_budget, **{**RECOMMENDED, **fields})

  def __post_init__(self):
    for f in _INT_FIELDS:  # a NumPy integer (a length read off an array) is stored as an int
      object.__setattr__(self, f, _as_int(getattr(self, f)))
    method = methods.get(self.method)
    require_int("token_budget", self.token_budget, 1)
    require_int("window_size", self.window_size, 1)
    require_int("kernel_size", self.kernel_size, 1)
    require(self.kernel_size % 2 == 1, f"kernel_size must be odd, got {self.kernel_size}")
    require(self.window_reduce in WINDOW_REDUCE, f"window_reduce must be one of "
            f"{list(WINDOW_REDUCE)}, got {self.window_reduce!r}")
    require(self.group_dims in GROUP_DIMS, f"group_dims must be one of {list(GROUP_DIMS)}, "
            f"got {self.group_dims!r}")
    # A name becomes its variant object: configs are equal whichever way they were asked for.
    object.__setattr__(self, "stage2", stage2_lib.get(self.stage2))
    s2 = self.stage2.name
    require(s2 in method.stage2_variants, f"stage2={s2!r} needs method in "
            f"{sorted(n for n, m in methods.REGISTRY.items() if s2 in m.stage2_variants)}"
            f", got {self.method!r}")
    require_int("skip_layers", self.skip_layers, 0)
    require(self.skip_layers == 0 or method.accepts_skip_layers,
            f"skip_layers={self.skip_layers} needs method in "
            f"{sorted(n for n, m in methods.REGISTRY.items() if m.accepts_skip_layers)}"
            f", got {self.method!r}")
    require(self.group_dims == "sum" or (method.picks_dims and self.stage2.picks_dims),
            f"group_dims={self.group_dims!r} needs method in "
            f"{sorted(n for n, m in methods.REGISTRY.items() if m.picks_dims)} and a stage2 "
            f"other than 'lowrank', got method={self.method!r}, stage2={s2!r}")
    require(self.read_mass is None or method.reads_by_mass,
            f"read_mass needs method in "
            f"{sorted(n for n, m in methods.REGISTRY.items() if m.reads_by_mass)}"
            f", got {self.method!r}")
    method.check_config(self)
    require_int("page_size", self.page_size, 1)
    if self.alpha is not None:
      require(isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0,
              f"alpha must be a float in [0, 1], got {self.alpha!r}")
    for name in ("capacity", "prompt_budget", "top_k", "chunk_size", "r"):
      val = getattr(self, name)
      if val is not None:
        require_int(name, val, 1)


_INT_FIELDS = ("token_budget", "window_size", "kernel_size", "capacity", "prompt_budget", "top_k",
               "chunk_size", "r", "page_size", "sink_size", "skip_layers")


def _as_int(x):
  """A NumPy integer as a Python int (hashable, JSON-able, equal); anything else as it is."""
  return int(x) if isinstance(x, np.integer) else x


def plan(config: RocketConfig, prompt_len: int, max_new_tokens: int, head_dim: int) -> Plan:
  """Splits `config.token_budget` for a prompt of `prompt_len` tokens and `max_new_tokens` more.

  Example (the paper's setting): prompt 32668, 100 new, budget 256, D 128 ->
  capacity 1618, prompt_budget 1518, top_k 128, chunk_size 3, r 60.
  """
  require(isinstance(config, RocketConfig), f"config must be a RocketConfig, got {type(config)}")
  prompt_len, max_new_tokens, head_dim = map(_as_int, (prompt_len, max_new_tokens, head_dim))
  require_int("prompt_len", prompt_len, 1)
  require_int("max_new_tokens", max_new_tokens, 0)
  require_int("head_dim", head_dim, 1)
  require(config.r is None or config.r <= head_dim,
          f"r must be in [1, head_dim={head_dim}], got {config.r}")
  split = methods.get(config.method).split(config, prompt_len, max_new_tokens, head_dim)
  split.setdefault("stage2", config.stage2)  # MinMax() for the methods without variants
  if config.capacity is not None:
    split["capacity"] = config.capacity
  kept = min(split["prompt_budget"], prompt_len)
  require(split["capacity"] >= kept + max_new_tokens,
          f"capacity must be >= kept prompt tokens + max_new_tokens = {kept + max_new_tokens}, "
          f"got {split['capacity']}")
  require(split["r"] <= head_dim, f"r must be in [1, head_dim={head_dim}], got {split['r']}")
  return Plan(method=config.method, window_size=config.window_size,
              kernel_size=config.kernel_size, window_reduce=config.window_reduce,
              group_dims=config.group_dims,
              sink_size=config.sink_size, head_dim=head_dim,
              prompt_len=prompt_len, max_new_tokens=max_new_tokens,
              token_budget=config.token_budget, **split)


def check_num_layers(plan: Plan, num_layers: int) -> None:
  """ValueError unless `plan` fits a model of `num_layers` layers (`skip_layers` <= it).

  `RocketConfig` cannot know the model; `generate`, the eval runner and the model's prefill
  call this before tracing."""
  require(isinstance(plan, Plan), f"plan must be a Plan from rocketkv.plan(), got {type(plan)}")
  require(plan.skip_layers <= num_layers,
          f"skip_layers must be an int in [0, num_layers={num_layers}], got {plan.skip_layers}")

"""`Plan`: the static budget split of one method for one (prompt length, new tokens, head dim).

Every method shares the same budget meaning, "about B tokens' worth of K/V read per decode
step"; each method turns B into a `Plan` with its `split` (rocketkv_jax/methods/). RocketKV's
split follows the paper (`paper_split`): from one token budget B and the total length
T = prompt_len + max_new_tokens,

    cr = T / B
    alpha = max(min(0.2 + 0.06 * log2(cr), 0.8), 0)      (clamped at 0: below)
    capacity = max(int(T / cr**alpha), min(2 * max_new_tokens, T))
    prompt_budget = capacity - max_new_tokens
    top_k = B // 2, or capacity once everything fits (T <= B)
    cr2 = max(1, capacity / B)
    chunk_size = min(floor(cr2), ceil(sqrt(cr2)))
    r = int(D * chunk_size / cr2), clamped to [1, D]   (truncated, as the original code does)

How the formula is clamped (docs/reliability.md, "Budget split"): alpha goes below 0 once B is
more than about 10x T (log2(cr) < -3.33), and T / cr**alpha then falls *below* T: without the
clamp a larger budget keeps fewer tokens (at B = 100000 a 300-token prompt kept 47). alpha >= 0
makes cr <= 1 mean "no compression" (capacity = T), and capacity is then non-decreasing in B
(for cr >= 1, alpha and log(cr) both shrink as B grows). Likewise top_k: once T <= B every slot
can be read exactly within the budget, so top_k = capacity (not B // 2, which would read fewer
rows than a smaller budget's plan that had nothing to skip); the step is then exact attention.
Every other method's split follows the same rule: kept and read tokens are non-decreasing in B,
equal T once B >= T, and top_k <= capacity (tests/test_plan.py checks it for every method).

Decisions where the formula is silent (documented here and in docs/design.md):
- capacity never exceeds T (no compression is ever an expansion).
- prompt_budget is at least the window (stage 1 always keeps the window) and at most the prompt:
  when the prompt fits, everything is kept and capacity = prompt_len + max_new_tokens.
- The cache always has room for every new token: capacity = prompt_budget + max_new_tokens
  unless `capacity` is overridden (then it must be at least that).

This module imports nothing from the package, so every layer (cache, evict, select, methods)
can name `Plan` without an import cycle.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Plan:
  """The static split for one (config, prompt_len, max_new_tokens, head_dim). Python ints only.

  Frozen and hashable: a static jit argument; its fields (the stage-2 variant flattened:
  eval/harness.py `_plan_dict`) are what eval records store. A method-specific static knob is
  a field with a default (see README, "Adding a method").

  Attributes:
    method: the method name (a key of `rocketkv.METHODS`).
    capacity: cache slots C (kept prompt tokens + room for every new token).
    prompt_budget: prompt tokens kept by stage 1 (== prompt_len: nothing evicted).
    top_k: slots attended per decode step (0: dense attention over every valid slot).
    chunk_size: consecutive slots summarised by one min/max pair (pages for Quest); 0 for
      methods that read no summaries.
    r: head dims used by the approximate score.
    full_capacity: slots of the uncompressed cache kept by `rocketkv_mt` (0 otherwise).
    stage2: RocketKV's stage-2 variant, the `Stage2` object of `RocketConfig.stage2` with its
      own settings as fields (rocketkv_jax/methods/stage2/); `MinMax()` for methods without
      variants (None only in a Plan made by hand).
    skip_layers: the first layers that keep their whole cache and attend densely (rocketkv,
      rocketkv_mt: `RocketConfig.skip_layers`; 0 otherwise).
    window_reduce: stage 1's reduction of the window's probabilities, "sum" | "max"
      (`RocketConfig.window_reduce`).
    group_dims: how stage 2's r query dims weigh the group's heads, "sum" | "normalized"
      (`RocketConfig.group_dims`, `ops.top_r_dims`).
    read_mass: `exact_topp`'s share of each head's attention mass to read (0.0 otherwise).
  """

  method: str
  capacity: int
  prompt_budget: int
  top_k: int
  chunk_size: int
  r: int
  window_size: int
  kernel_size: int
  sink_size: int
  head_dim: int
  prompt_len: int
  max_new_tokens: int
  token_budget: int
  full_capacity: int = 0
  stage2: object = None  # a methods.stage2.Stage2 (not imported: see the module docstring)
  skip_layers: int = 0
  window_reduce: str = "sum"
  group_dims: str = "sum"
  read_mass: float = 0.0

  @property
  def num_chunks(self) -> int:
    return -(-self.capacity // self.chunk_size) if self.chunk_size else 0


def paper_split(config, prompt_len: int, max_new: int, head_dim: int) -> dict:
  """RocketKV's split (module docstring) of `config` (a `RocketConfig`), with its overrides.

  Returns:
    dict(capacity, prompt_budget, top_k, chunk_size, r).
  """
  b = config.token_budget
  t = prompt_len + max_new
  cr = t / b
  if config.alpha is not None:
    alpha = float(config.alpha)
  else:
    alpha = max(min(0.2 + 0.06 * math.log2(cr), 0.8), 0.0)  # >= 0: module docstring
  capacity = max(int(t / cr**alpha), min(2 * max_new, t))
  capacity = min(capacity, t)
  if config.capacity is not None:
    capacity = config.capacity
  if config.prompt_budget is not None:
    prompt_budget = config.prompt_budget
  else:
    prompt_budget = capacity - max_new
  prompt_budget = min(max(prompt_budget, config.window_size), prompt_len)
  if config.capacity is None:
    capacity = prompt_budget + max_new
  if config.top_k is not None:
    top_k = min(config.top_k, capacity)
  else:  # B // 2, or the whole cache once it fits in the budget (module docstring)
    top_k = capacity if t <= b else max(b // 2, 1)
  cr2 = max(1.0, capacity / b)
  chunk = config.chunk_size or max(1, min(math.floor(cr2), math.ceil(math.sqrt(cr2))))
  # Truncation, as the original RocketKV code derives r (`int(D * chunk / cr2)`).
  r = config.r if config.r is not None else min(max(int(head_dim * chunk / cr2), 1), head_dim)
  return dict(capacity=capacity, prompt_budget=prompt_budget, top_k=top_k, chunk_size=chunk,
              r=r)

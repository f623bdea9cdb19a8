"""`RocketConfig` (what the user asks for) and `plan` (the static budget split it implies).

The split follows the RocketKV paper: from one token budget B and the total length
T = prompt_len + max_new_tokens,

    cr = T / B
    alpha = min(0.2 + 0.06 * log2(cr), 0.8)
    capacity = max(int(T / cr**alpha), min(2 * max_new_tokens, T))
    prompt_budget = capacity - max_new_tokens
    top_k = B // 2
    cr2 = max(1, capacity / B)
    chunk_size = min(floor(cr2), ceil(sqrt(cr2)))
    r = int(D * chunk_size / cr2), clamped to [1, D]   (truncated, as the original code does)

Decisions where the formula is silent (documented here and in the README):
- capacity never exceeds T (no compression is ever an expansion).
- prompt_budget is at least the window (stage 1 always keeps the window) and at most the prompt:
  when the prompt fits, everything is kept and capacity = prompt_len + max_new_tokens.
- The cache always has room for every new token: capacity = prompt_budget + max_new_tokens
  unless `capacity` is overridden (then it must be at least that).

Every method shares the same budget meaning, "about B tokens' worth of K/V read per decode
step" (see `METHODS`).
"""

from __future__ import annotations

import dataclasses
import math

from rocketkv_jax._checks import require, require_int

# name -> one-line description of what B means for it.
METHODS: dict[str, str] = {
    "full": "no compression; B is ignored; every token is read each step",
    "exact_topk": "oracle: exact scores over the whole cache, attend to the top B tokens",
    "snapkv": "stage 1 only: keep B prompt tokens (window included), dense attention over them"
              " plus the generated tokens",
    "quest": "no eviction; per-page (page_size) min/max bounds pick pages holding B tokens",
    "sparq": "no eviction; r = D*B/T dims score every token, attend to the top B/2",
    "streamingllm": "sink_size sink tokens + the most recent B - sink_size tokens",
    "rocketkv": "stage 1 eviction to the planned capacity + hybrid sparse attention (top_k=B/2)",
    "rocketkv_mt": "rocketkv that keeps the full cache so each turn re-runs stage 1",
}

DENSE_METHODS = ("full", "snapkv")

# Stage-2 scorers of `rocketkv` / `rocketkv_mt` (RocketConfig.stage2); see `plan`'s docstring.
STAGE2 = ("minmax", "rerank", "lowrank")
STAGE2_METHODS = ("rocketkv", "rocketkv_mt")


@dataclasses.dataclass(frozen=True)
class RocketConfig:
  """What the user asks for. Frozen and hashable: usable as a static jit argument.

  Attributes:
    token_budget: B, tokens' worth of K/V read per decode step.
    method: one of `METHODS`.
    window_size: stage-1 observation window (the last W prompt queries), always kept.
    kernel_size: stage-1 max-pooling kernel (odd).
    alpha, capacity, prompt_budget, top_k, chunk_size, r: optional overrides of the split.
      A fixed `alpha` reproduces the paper's ablations.
    page_size: Quest page size (tokens per min/max summary).
    sink_size: StreamingLLM attention-sink tokens.
    stage2: the stage-2 scorer of rocketkv / rocketkv_mt, one of `STAGE2`:
      "minmax" (the paper: chunk min/max bounds), "rerank" (chunk bounds pick
      `rerank_factor * top_k` candidate slots, per-token scores on the same r dims keep
      `top_k`; stage2_rerank.py), "lowrank" (page-local rank-`lowrank_rank` key summaries over
      pages of `lowrank_page_size` slots, per-token scores; stage2_lowrank.py).
    rerank_factor: candidates per selected slot for "rerank" (>= 1).
    lowrank_page_size, lowrank_rank: page size P and rank R for "lowrank" (R <= P, R <= D).
  """

  token_budget: int
  method: str = "rocketkv"
  window_size: int = 32
  kernel_size: int = 63
  alpha: float | None = None
  capacity: int | None = None
  prompt_budget: int | None = None
  top_k: int | None = None
  chunk_size: int | None = None
  r: int | None = None
  page_size: int = 16
  sink_size: int = 4
  stage2: str = "minmax"
  # Defaults keep the bytes read per step <= 1.2x minmax at 32K / B=256 / D=128 (counted in
  # benchmarks/decode_attention.py): rerank 1.13x, lowrank 1.10x (README, "Stage-2 variants").
  rerank_factor: float = 1.5
  lowrank_page_size: int = 128
  lowrank_rank: int = 8

  def __post_init__(self):
    require(self.method in METHODS,
            f"method must be one of {sorted(METHODS)}, got {self.method!r}")
    require_int("token_budget", self.token_budget, 1)
    require_int("window_size", self.window_size, 1)
    require_int("kernel_size", self.kernel_size, 1)
    require(self.kernel_size % 2 == 1, f"kernel_size must be odd, got {self.kernel_size}")
    if self.method in ("rocketkv", "rocketkv_mt", "snapkv"):
      require(self.token_budget >= self.window_size,
              f"token_budget must be >= window_size={self.window_size} for method "
              f"{self.method!r}, got {self.token_budget}")
    if self.method in ("rocketkv", "rocketkv_mt", "sparq"):
      require(self.token_budget >= 2 or self.top_k is not None,
              f"token_budget must be >= 2 (top_k = B//2), got {self.token_budget}")
    if self.method == "streamingllm":
      require_int("sink_size", self.sink_size, 0)
      require(self.token_budget > self.sink_size,
              f"token_budget must be > sink_size={self.sink_size}, got {self.token_budget}")
    require_int("page_size", self.page_size, 1)
    if self.alpha is not None:
      require(isinstance(self.alpha, (int, float)) and 0.0 <= self.alpha <= 1.0,
              f"alpha must be a float in [0, 1], got {self.alpha!r}")
    for name in ("capacity", "prompt_budget", "top_k", "chunk_size", "r"):
      val = getattr(self, name)
      if val is not None:
        require_int(name, val, 1)
    require(self.stage2 in STAGE2, f"stage2 must be one of {list(STAGE2)}, got {self.stage2!r}")
    require(self.stage2 == "minmax" or self.method in STAGE2_METHODS,
            f"stage2={self.stage2!r} needs method in {list(STAGE2_METHODS)}, got {self.method!r}")
    require(isinstance(self.rerank_factor, (int, float)) and not isinstance(
        self.rerank_factor, bool) and self.rerank_factor >= 1,
            f"rerank_factor must be a number >= 1, got {self.rerank_factor!r}")
    require_int("lowrank_page_size", self.lowrank_page_size, 1)
    require_int("lowrank_rank", self.lowrank_rank, 1, self.lowrank_page_size)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The static split for one (config, prompt_len, max_new_tokens, head_dim). Python ints only.

  Attributes:
    method: the method name.
    capacity: cache slots C (kept prompt tokens + room for every new token).
    prompt_budget: prompt tokens kept by stage 1 (== prompt_len: nothing evicted).
    top_k: slots attended per decode step (0: dense attention over every valid slot).
    chunk_size: consecutive slots summarised by one min/max pair (pages for Quest); 0 for
      methods that read no summaries.
    r: head dims used by the approximate score.
    full_capacity: slots of the uncompressed cache kept by `rocketkv_mt` (0 otherwise).
    stage2: "minmax" | "rerank" | "lowrank" (always "minmax" for other methods).
    rerank_candidates: slots the chunk bounds pick for "rerank" (ceil(factor * top_k); 0
      otherwise); capped at the cache capacity when selecting.
    lowrank_page_size, lowrank_rank: P and R for "lowrank" (0 otherwise).
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
  stage2: str = "minmax"
  rerank_candidates: int = 0
  lowrank_page_size: int = 0
  lowrank_rank: int = 0

  @property
  def num_chunks(self) -> int:
    return -(-self.capacity // self.chunk_size) if self.chunk_size else 0


def _rocket_split(config: RocketConfig, prompt_len: int, max_new: int, head_dim: int):
  """The paper's split; returns (capacity, prompt_budget, top_k, chunk_size, r)."""
  b = config.token_budget
  t = prompt_len + max_new
  cr = t / b
  if config.alpha is not None:
    alpha = float(config.alpha)
  else:
    alpha = min(0.2 + 0.06 * math.log2(cr), 0.8)
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
  top_k = config.top_k if config.top_k is not None else max(b // 2, 1)
  cr2 = max(1.0, capacity / b)
  chunk = config.chunk_size or max(1, min(math.floor(cr2), math.ceil(math.sqrt(cr2))))
  # Truncation, as the original RocketKV code derives r (`int(D * chunk / cr2)`).
  r = config.r if config.r is not None else min(max(int(head_dim * chunk / cr2), 1), head_dim)
  return capacity, prompt_budget, top_k, chunk, r


def _stage2_fields(config: RocketConfig, top_k: int, head_dim: int) -> dict:
  """The Plan fields of `config.stage2` (rocketkv / rocketkv_mt only)."""
  if config.stage2 == "rerank":
    return dict(stage2="rerank",
                rerank_candidates=max(top_k, math.ceil(config.rerank_factor * top_k)))
  if config.stage2 == "lowrank":
    require(config.lowrank_rank <= head_dim,
            f"lowrank_rank must be in [1, head_dim={head_dim}], got {config.lowrank_rank}")
    # No chunk min/max summaries: the cache keeps none and `append` updates none.
    return dict(stage2="lowrank", chunk_size=0, lowrank_page_size=config.lowrank_page_size,
                lowrank_rank=config.lowrank_rank)
  return {}


def plan(config: RocketConfig, prompt_len: int, max_new_tokens: int, head_dim: int) -> Plan:
  """Splits `config.token_budget` for a prompt of `prompt_len` tokens and `max_new_tokens` more.

  Example (the paper's setting): prompt 32668, 100 new, budget 256, D 128 ->
  capacity 1618, prompt_budget 1518, top_k 128, chunk_size 3, r 60.
  """
  require(isinstance(config, RocketConfig), f"config must be a RocketConfig, got {type(config)}")
  require_int("prompt_len", prompt_len, 1)
  require_int("max_new_tokens", max_new_tokens, 0)
  require_int("head_dim", head_dim, 1)
  require(config.r is None or config.r <= head_dim,
          f"r must be in [1, head_dim={head_dim}], got {config.r}")
  m, b, t = config.method, config.token_budget, prompt_len + max_new_tokens
  # chunk_size 0: the method never reads chunk summaries, so the cache keeps none.
  full = dict(capacity=t, prompt_budget=prompt_len, top_k=0, chunk_size=0, r=head_dim)
  if m == "full":
    split = full
  elif m == "exact_topk":
    split = dict(full, top_k=config.top_k or b)
  elif m == "quest":
    split = dict(full, top_k=config.top_k or b, chunk_size=config.chunk_size or config.page_size)
  elif m == "sparq":
    r = config.r or min(max(round(head_dim * b / t), 1), head_dim)
    split = dict(full, top_k=config.top_k or max(b // 2, 1), chunk_size=1, r=r)
  elif m in ("snapkv", "streamingllm"):
    pb = config.prompt_budget or b
    floor = config.window_size if m == "snapkv" else 1
    pb = min(max(pb, floor), prompt_len)
    top_k = 0 if m == "snapkv" else (config.top_k or b)
    split = dict(capacity=pb + max_new_tokens, prompt_budget=pb, top_k=top_k,
                 chunk_size=0, r=head_dim)
  else:  # rocketkv, rocketkv_mt
    capacity, pb, top_k, chunk, r = _rocket_split(config, prompt_len, max_new_tokens, head_dim)
    split = dict(capacity=capacity, prompt_budget=pb, top_k=top_k, chunk_size=chunk, r=r)
    split.update(_stage2_fields(config, top_k, head_dim))
  if config.capacity is not None and m not in ("rocketkv", "rocketkv_mt"):
    split["capacity"] = config.capacity
  kept = min(split["prompt_budget"], prompt_len)
  require(split["capacity"] >= kept + max_new_tokens,
          f"capacity must be >= kept prompt tokens + max_new_tokens = {kept + max_new_tokens}, "
          f"got {split['capacity']}")
  require(split["r"] <= head_dim, f"r must be in [1, head_dim={head_dim}], got {split['r']}")
  return Plan(method=m, window_size=config.window_size, kernel_size=config.kernel_size,
              sink_size=config.sink_size, head_dim=head_dim, prompt_len=prompt_len,
              max_new_tokens=max_new_tokens, token_budget=b,
              full_capacity=t if m == "rocketkv_mt" else 0, **split)

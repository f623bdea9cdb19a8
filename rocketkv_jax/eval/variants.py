"""Method variants for ablations: `"rocketkv:chunk_size=1,r=64"` = rocketkv with split overrides.

A method spec is a name from `rocketkv.METHODS`, optionally followed by `:` and comma-separated
`field=value` overrides of `RocketConfig` (see its docstring):

    rocketkv                        the paper's split
    rocketkv:chunk_size=1,r=64      stage 2 scores every kept token exactly (D = 64)
    rocketkv:top_k=B                stage 2 reads B tokens instead of B/2
    rocketkv:stage2=rerank          stage 2 re-ranks the chunk bounds' candidates per token
    rocketkv:stage2=lowrank,lowrank_rank=4   page-local low-rank key summaries, LowRank(rank=4)
    rocketkv:stage2=quant,quant_bits=4      per-token 4-bit key codes, Quant(bits=4)
    rocketkv:stage2=quant,quant_capacity=equal_read   the codes' saved bytes spent on stage 1
    rocketkv:stage2=quant,mean_value=1      SparQ's mean-value fill for the unread slots
    rocketkv:skip_layers=2          layers 0 and 1 keep their whole cache and attend densely
    rocketkv:window_reduce=max      stage 1 keeps the keys some window query attends to most
    rocketkv:group_dims=normalized  stage 2's r dims weigh every query head of a group the same
    snapkv:window_size=16
    exact_topp:read_mass=0.9        the oracle reading 90% of each head's attention mass
    recommended                     `RocketConfig.recommended(B)` (an alias of its spec)

A stage-2 variant's own fields (rocketkv_jax/methods/stage2/) are set by their spec keys,
`<variant>_<field>` (`rerank_factor`, `lowrank_page_size`, `lowrank_rank`, `quant_bits`,
`quant_capacity`; Quant's `mean_value` is `mean_value`), and need `stage2=<that variant>`:
`rocket_config` turns them into the `RocketConfig.stage2` object. These are the keys the eval
records' plan dicts store too (`harness`), so committed results keep their spec strings.

Values are integers, floats (`alpha`, `rerank_factor`), names (`stage2`: one of
`rocketkv.STAGE2`; `quant_capacity`: a `Quant.capacity`; `window_reduce`: one of
`rocketkv.WINDOW_REDUCE`; `group_dims`: one of `rocketkv.GROUP_DIMS`), 0 / 1 (`mean_value`), or
`B` for the sweep's token budget (so one spec works at every budget). The spec string is the
method's name everywhere in the results (records, tables, plots), so a variant sits next to the
methods it is compared with. The sweep's defaults use no overrides: variants exist to find out
*why* a method scores what it scores, never to tune it to a test set.
"""

from __future__ import annotations

import dataclasses
import typing

import rocketkv_jax as rocketkv
from rocketkv_jax.config import GROUP_DIMS, WINDOW_REDUCE
from rocketkv_jax.methods import stage2 as stage2_lib

_STAGE2_KEYS = stage2_lib.spec_keys()  # e.g. "quant_bits" -> (Quant, "bits")
OVERRIDABLE = ("alpha", "capacity", "prompt_budget", "top_k", "chunk_size", "r", "window_size",
               "kernel_size", "page_size", "sink_size", "stage2", "skip_layers",
               "window_reduce", "group_dims", "read_mass") + tuple(_STAGE2_KEYS)


def _kind(key: str) -> type:
  """The value type of a key: a stage-2 field's annotation; float for `alpha`, `read_mass`;
  else int."""
  if key in _STAGE2_KEYS:
    cls, field = _STAGE2_KEYS[key]
    return typing.get_type_hints(cls)[field]
  return float if key in ("alpha", "read_mass") else int


def parse(spec: str) -> tuple[str, dict[str, int | float | str]]:
  """`"rocketkv:top_k=B,r=32"` -> ("rocketkv", {"top_k": "B", "r": 32}); ValueError if bad.
  An alias (`ALIASES`) parses as the spec it names."""
  if not isinstance(spec, str) or not spec:
    raise ValueError(f"method must be a non-empty string, got {spec!r}")
  spec = canonical(spec)
  base, sep, rest = spec.partition(":")
  if base not in rocketkv.METHODS:
    raise ValueError(f"unknown method {base!r} in {spec!r}; allowed: {sorted(rocketkv.METHODS)}")
  overrides: dict[str, int | float | str] = {}
  for item in filter(None, rest.split(",")):
    key, eq, val = item.partition("=")
    if not eq or key not in OVERRIDABLE:
      raise ValueError(f"method override {item!r} in {spec!r} must be field=value with field "
                       f"one of {OVERRIDABLE}")
    if key in overrides:
      raise ValueError(f"method override {key!r} appears twice in {spec!r}")
    overrides[key] = _value(spec, key, val)
  if sep and not overrides:
    raise ValueError(f"method {spec!r}: nothing after ':'")
  _stage2(spec, overrides)  # the variant's own checks, before any model work
  return base, overrides


def _stage2(spec: str, overrides: dict):
  """The `Stage2` object of the spec's `stage2` and its variant keys (ValueError naming the key
  if they do not fit it)."""
  keys = {k: v for k, v in overrides.items() if k in _STAGE2_KEYS and v != "B"}
  try:
    return stage2_lib.from_spec(overrides.get("stage2", "minmax"), keys)
  except ValueError as e:
    raise ValueError(f"method {spec!r}: {e}") from None


def _value(spec: str, key: str, val: str) -> int | float | str:
  names = {"stage2": tuple(stage2_lib.REGISTRY), "window_reduce": WINDOW_REDUCE,
           "group_dims": GROUP_DIMS}.get(key)
  if names is not None:
    if val not in names:
      raise ValueError(f"method override {key}={val!r} in {spec!r} must be one of "
                       f"{list(names)}")
    return val
  kind = _kind(key)
  if kind is str:  # a variant's name field: its own check names the allowed values
    return val
  if kind is bool:
    if val not in ("0", "1"):
      raise ValueError(f"method override {key}={val!r} in {spec!r} must be 0 or 1")
    return val == "1"
  if val == "B" and kind is int:
    return val
  try:
    return kind(val)
  except ValueError:
    what = "a float" if kind is float else "an integer or B"
    raise ValueError(f"method override {key}={val!r} in {spec!r} must be {what}") from None


def rocket_config(spec: str, token_budget: int, **defaults) -> "rocketkv.RocketConfig":
  """The `RocketConfig` of a method spec at one budget; `defaults` (window_size, page_size...)
  apply first, the spec's overrides after. Invalid values raise `RocketConfig`'s ValueError."""
  base, overrides = parse(spec)
  overrides = {k: (int(token_budget) if v == "B" else v) for k, v in overrides.items()}
  fields = dict(defaults)
  fields.update({k: v for k, v in overrides.items() if k not in _STAGE2_KEYS})
  if "stage2" in overrides:
    fields["stage2"] = _stage2(spec, overrides)
  # One construction with every field: checks that depend on several fields (token_budget >=
  # window_size) see the values asked for, not the defaults.
  return rocketkv.RocketConfig(token_budget=int(token_budget), method=base, **fields)


def spec(config: "rocketkv.RocketConfig") -> str:
  """The method spec of a `RocketConfig`, the inverse of `rocket_config`: its method, then the
  fields that differ from their defaults (stage 2 and its variant keys first, the others in
  `OVERRIDABLE` order). `rocket_config(spec(c), c.token_budget) == c`."""
  defaults = {f.name: f.default for f in dataclasses.fields(rocketkv.RocketConfig)}
  items = []
  stage2 = config.stage2
  if stage2 != stage2_lib.get(defaults["stage2"]):
    items.append(f"stage2={stage2.name}")
    fresh = type(stage2)()
    items += [f"{key}={_text(getattr(stage2, field))}"
              for key, field in stage2.spec_keys().items()
              if getattr(stage2, field) != getattr(fresh, field)]
  items += [f"{key}={_text(getattr(config, key))}" for key in OVERRIDABLE
            if key in defaults and key != "stage2" and getattr(config, key) != defaults[key]]
  return config.method + (":" + ",".join(items) if items else "")


def _text(val) -> str:
  return str(int(val)) if isinstance(val, bool) else str(val)


# `RocketConfig.recommended(B)` as a spec: the name its records carry in results/.
RECOMMENDED_SPEC = spec(rocketkv.RocketConfig.recommended(256))
# Short names for specs; sweeps store the spec (`canonical`), so records pair with older runs.
ALIASES = {"recommended": RECOMMENDED_SPEC}


def canonical(spec: str) -> str:
  """The spec an alias names (`"recommended"` -> `RECOMMENDED_SPEC`); any other spec as is."""
  return ALIASES.get(spec, spec)


def base_method(spec: str) -> str:
  return parse(spec)[0]

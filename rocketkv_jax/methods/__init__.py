"""The KV methods, by name: one file per method, one registry line each.

    method = methods.get(plan.method)
    state = method.prefill(k, v, q_window, plan)

`rocketkv.METHODS`, `RocketConfig`, `plan`, `prefill`, `decode_step`, `select`, `generate`, the
model's decode step and the eval harness all look methods up here; nothing outside this package
compares a method name to a string. To add a method, write `methods/<name>.py` with a
`Method` subclass (methods/base.py documents what it may override) and register it below;
tests/test_methods.py then runs it through the contract every method meets.
"""

from __future__ import annotations

from rocketkv_jax._checks import require
from rocketkv_jax.methods.base import Method
from rocketkv_jax.methods.exact_topk import ExactTopK
from rocketkv_jax.methods.exact_topk_heads import ExactTopKHeads
from rocketkv_jax.methods.exact_topp import ExactTopP
from rocketkv_jax.methods.full import Full
from rocketkv_jax.methods.quest import Quest
from rocketkv_jax.methods.rocketkv import STAGE2, RocketKV
from rocketkv_jax.methods.rocketkv_mt import RocketKVMT
from rocketkv_jax.methods.snapkv import SnapKV
from rocketkv_jax.methods.sparq import SparQ
from rocketkv_jax.methods.streamingllm import StreamingLLM

REGISTRY: dict[str, Method] = {}
# name -> one-line description of what the token budget B means for it.
METHODS: dict[str, str] = {}


def register(method: Method) -> Method:
  """Adds `method` under `method.name` (a new name only)."""
  require(isinstance(method, Method) and method.name and method.name not in REGISTRY,
          f"method must be a Method with a new name, got {method!r}")
  REGISTRY[method.name] = method
  METHODS[method.name] = method.summary
  return method


register(Full())
register(ExactTopK())
register(ExactTopKHeads())
register(ExactTopP())
register(SnapKV())
register(Quest())
register(SparQ())
register(StreamingLLM())
register(RocketKV())
register(RocketKVMT())


def get(name: str) -> Method:
  """The registered method called `name`; ValueError naming the allowed ones otherwise."""
  require(name in REGISTRY, f"method must be one of {sorted(REGISTRY)}, got {name!r}")
  return REGISTRY[name]


__all__ = ["METHODS", "Method", "REGISTRY", "STAGE2", "get", "register"]

"""Method variant specs (`eval.variants`): parsing, errors, and that a variant's plan is the
base plan with exactly the overridden fields changed."""

import dataclasses

import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax.eval import harness, variants


def test_parse_and_config():
  assert variants.parse("rocketkv") == ("rocketkv", {})
  assert variants.parse("rocketkv:top_k=B,r=32") == ("rocketkv", {"top_k": "B", "r": 32})
  assert variants.parse("rocketkv:alpha=0.5") == ("rocketkv", {"alpha": 0.5})
  cfg = variants.rocket_config("rocketkv:top_k=B,chunk_size=1", 256, window_size=16)
  assert cfg == rocketkv.RocketConfig(token_budget=256, top_k=256, chunk_size=1, window_size=16)
  # the spec's overrides win over the defaults
  assert variants.rocket_config("snapkv:window_size=8", 64, window_size=32).window_size == 8


@pytest.mark.parametrize("spec, match", [
    ("nope", "unknown method"),
    ("rocketkv:", "nothing after"),
    ("rocketkv:foo=1", "field one of"),
    ("rocketkv:top_k", "field=value"),
    ("rocketkv:r=1,r=2", "appears twice"),
    ("rocketkv:r=x", "integer or B"),
    ("rocketkv:alpha=B", "float"),
])
def test_bad_specs(spec, match):
  with pytest.raises(ValueError, match=match):
    variants.parse(spec)
  with pytest.raises(ValueError, match=match):
    harness.SweepConfig(methods=("full", spec))


def test_variant_plan_changes_only_the_overridden_fields():
  p, n, d = 4000, 24, 64
  base = rocketkv.plan(variants.rocket_config("rocketkv", 256), p, n, d)
  var = rocketkv.plan(variants.rocket_config("rocketkv:chunk_size=1,r=64,top_k=B", 256), p, n, d)
  assert (base.top_k, base.chunk_size) == (128, 3) and base.r < d
  assert (var.top_k, var.chunk_size, var.r) == (256, 1, 64)
  same = {f.name for f in dataclasses.fields(base)} - {"top_k", "chunk_size", "r"}
  assert all(getattr(base, f) == getattr(var, f) for f in same)
  with pytest.raises(ValueError, match="r must be"):
    rocketkv.plan(variants.rocket_config("rocketkv:r=65", 256), p, n, d)

"""Method variant specs (`eval.variants`): parsing, errors, and that a variant's plan is the
base plan with exactly the overridden fields changed."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


@st.composite
def _configs(draw):
  """RocketConfigs of the methods with variants, with some fields off their defaults."""
  stage2 = draw(st.sampled_from([
      rocketkv.MinMax(), rocketkv.Rerank(factor=draw(st.sampled_from([2.0, 3.5]))),
      rocketkv.LowRank(rank=draw(st.sampled_from([2, 4]))),
      rocketkv.Quant(bits=draw(st.sampled_from([2, 4])),
                     capacity=draw(st.sampled_from(["equal_read", "paper"])),
                     mean_value=draw(st.booleans()))]))
  some = st.none() | st.integers(8, 64)
  return rocketkv.RocketConfig(
      token_budget=draw(st.integers(64, 4096)),
      method=draw(st.sampled_from(["rocketkv", "rocketkv_mt"])), stage2=stage2,
      window_size=draw(st.sampled_from([16, 32])),
      window_reduce=draw(st.sampled_from(rocketkv.WINDOW_REDUCE)),
      group_dims=("sum" if stage2.name == "lowrank"
                  else draw(st.sampled_from(rocketkv.GROUP_DIMS))),
      alpha=draw(st.none() | st.sampled_from([0.25, 0.5])), top_k=draw(some),
      chunk_size=draw(st.none() | st.integers(1, 8)), skip_layers=draw(st.integers(0, 2)))


@given(_configs())
@settings(max_examples=60, deadline=None)
def test_spec_is_the_inverse_of_rocket_config(cfg):
  text = variants.spec(cfg)
  assert variants.rocket_config(text, cfg.token_budget) == cfg
  assert variants.spec(variants.rocket_config(text, cfg.token_budget)) == text


def test_spec_examples():
  """Defaults are left out; the recommended spec is the name its committed records carry."""
  assert variants.spec(rocketkv.RocketConfig(256)) == "rocketkv"
  assert variants.spec(rocketkv.RocketConfig(64, method="snapkv", window_size=16)) == (
      "snapkv:window_size=16")
  assert variants.spec(rocketkv.RocketConfig(512, stage2=rocketkv.Quant(bits=2, mean_value=True),
                                             top_k=64)) == (
      "rocketkv:stage2=quant,quant_bits=2,mean_value=1,top_k=64")
  assert variants.RECOMMENDED_SPEC == ("rocketkv:stage2=quant,quant_capacity=equal_read,"
                                       "window_reduce=max,group_dims=normalized")
  for b in (128, 256, 1024):
    assert variants.rocket_config(variants.RECOMMENDED_SPEC, b) == (
        rocketkv.RocketConfig.recommended(b)) == variants.rocket_config("recommended", b)


def test_recommended_alias_is_stored_as_its_spec():
  """Sweeps name the alias's records by the spec, so they pair with committed results."""
  assert variants.parse("recommended") == variants.parse(variants.RECOMMENDED_SPEC)
  cfg = harness.SweepConfig(methods=("full", "recommended"), multiturn_methods=("recommended",))
  assert cfg.methods == ("full", variants.RECOMMENDED_SPEC)
  assert cfg.multiturn_methods == (variants.RECOMMENDED_SPEC,)
  assert variants.canonical("rocketkv:r=8") == "rocketkv:r=8"


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

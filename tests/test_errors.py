"""Every bad input gets a ValueError naming the argument and the allowed range."""

import jax.numpy as jnp
import pytest

import rocketkv_jax as rocketkv


def _arrays(b=1, hq=4, hkv=2, l=64, w=8, d=16, dtype=jnp.float32):
  k = jnp.zeros((b, hkv, l, d), dtype)
  return k, k, jnp.zeros((b, hq, w, d), dtype)


CFG = rocketkv.RocketConfig(token_budget=32, window_size=8)
PLAN = rocketkv.plan(CFG, 64, 4, 16)


@pytest.mark.parametrize("kwargs,match", [
    (dict(token_budget=16, window_size=32), "token_budget must be >= window_size"),
    (dict(token_budget=0), "token_budget must be an int"),
    (dict(token_budget=-5), "token_budget must be an int"),
    (dict(token_budget=64, method="h2o"), "method must be one of"),
    (dict(token_budget=64, kernel_size=4), "kernel_size must be odd"),
    (dict(token_budget=64, top_k=0), "top_k must be an int"),
    (dict(token_budget=64, alpha=1.5), "alpha must be a float"),
    (dict(token_budget=4, method="streamingllm", sink_size=4), "token_budget must be > sink"),
])
def test_config_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    rocketkv.RocketConfig(**kwargs)


@pytest.mark.parametrize("args,match", [
    ((0, 10, 64), "prompt_len must be an int"),
    ((100, -1, 64), "max_new_tokens must be an int"),
    ((100, 10, 0), "head_dim must be an int"),
])
def test_plan_errors(args, match):
  with pytest.raises(ValueError, match=match):
    rocketkv.plan(CFG, *args)


def test_r_larger_than_head_dim():
  with pytest.raises(ValueError, match="r must be in"):
    rocketkv.plan(rocketkv.RocketConfig(token_budget=64, r=65), 1000, 4, 64)


def test_capacity_override_too_small():
  with pytest.raises(ValueError, match="capacity must be >="):
    rocketkv.plan(rocketkv.RocketConfig(token_budget=64, capacity=20), 1000, 4, 64)


def test_prefill_errors():
  k, v, qw = _arrays()
  with pytest.raises(ValueError, match="multiple of the KV heads"):
    rocketkv.prefill(k, v, jnp.zeros((1, 3, 8, 16)), PLAN)
  with pytest.raises(ValueError, match="same shape"):
    rocketkv.prefill(k, v[:, :, :10], qw, PLAN)
  with pytest.raises(ValueError, match="same dtype"):
    rocketkv.prefill(k, v.astype(jnp.bfloat16), qw, PLAN)
  with pytest.raises(ValueError, match="window longer than the prompt"):
    rocketkv.prefill(k[:, :, :4], v[:, :, :4], qw, PLAN)
  with pytest.raises(ValueError, match="head dim"):
    rocketkv.prefill(k[..., :8], v[..., :8], qw[..., :8], PLAN)
  with pytest.raises(ValueError, match="q_window must have shape"):
    rocketkv.prefill(k, v, qw[0], PLAN)
  with pytest.raises(ValueError, match="lengths must have shape"):
    rocketkv.prefill(k, v, qw, PLAN, lengths=jnp.array([3, 4]))
  with pytest.raises(ValueError, match="plan must be a Plan"):
    rocketkv.prefill(k, v, qw, CFG)
  with pytest.raises(ValueError, match="L=64 must be <= plan.prompt_len=50"):
    # a plan for a shorter prompt (here: keep all 50) would keep 50 of these 64 tokens
    rocketkv.prefill(k, v, qw, rocketkv.plan(rocketkv.RocketConfig(64, window_size=8), 50, 4, 16))
  with pytest.raises(ValueError, match=r"lengths must be in \[1, L=64\], got \[65\]"):
    rocketkv.prefill(k, v, qw, PLAN, lengths=[65])  # a list is read as an array
  with pytest.raises(ValueError, match="impl must be one of"):
    rocketkv.evict(k, v, qw, PLAN, impl="cuda")


def test_decode_errors():
  k, v, qw = _arrays()
  cache = rocketkv.prefill(k, v, qw, PLAN)
  q = jnp.zeros((1, 4, 16))
  kn = jnp.zeros((1, 2, 1, 16))
  with pytest.raises(ValueError, match="k_new must have shape"):
    rocketkv.decode_step(q, kn[:, :1], kn, cache, PLAN)
  with pytest.raises(ValueError, match="dtype"):
    rocketkv.decode_step(q, kn.astype(jnp.bfloat16), kn, cache, PLAN)
  with pytest.raises(ValueError, match="multiple of the KV heads"):
    rocketkv.decode_step(jnp.zeros((1, 3, 16)), kn, kn, cache, PLAN)
  with pytest.raises(ValueError, match="q must have shape"):
    rocketkv.decode_step(jnp.zeros((1, 4, 8)), kn, kn, cache, PLAN)
  with pytest.raises(ValueError, match="sliding_window"):
    rocketkv.decode_step(q, kn, kn, cache, PLAN, sliding_window=0)
  with pytest.raises(ValueError, match="idx must have shape"):
    rocketkv.attend(q, cache, jnp.zeros((1, 3, 4), jnp.int32))


def test_prefill_rejects_float_lengths_and_mixed_dtypes():
  k, v, qw = _arrays()
  with pytest.raises(ValueError, match="lengths must be an integer array") as e:
    rocketkv.prefill(k, v, qw, PLAN, lengths=jnp.array([60.0]))
  assert "\n" not in str(e.value)
  kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  with pytest.raises(ValueError, match="q_window must have the dtype of k and v") as e:
    rocketkv.prefill(kb, vb, qw, PLAN)  # float32 window queries, bf16 keys
  assert "bfloat16" in str(e.value) and "float32" in str(e.value)
  rocketkv.prefill(kb, vb, qw.astype(jnp.bfloat16), PLAN, lengths=jnp.array([60], jnp.int32))


def test_begin_turn_rejects_float_turn_lengths():
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=32, window_size=8,
                                             method="rocketkv_mt"), 64, 4, 16)
  k, v, qw = _arrays()
  state = rocketkv.prefill(k, v, qw, plan)
  plan2 = rocketkv.plan(rocketkv.RocketConfig(token_budget=32, window_size=8,
                                              method="rocketkv_mt"), 80, 4, 16)
  with pytest.raises(ValueError, match="lengths must be an integer array"):
    rocketkv.begin_turn(state, k[:, :, :16], v[:, :, :16], qw, plan2,
                        turn_lengths=jnp.array([16.0]))


def test_generate_method_typo_lists_the_names():
  with pytest.raises(ValueError) as e:
    rocketkv.generate(None, "hi", method="rocket")  # checked before the model is touched
  msg = str(e.value)
  assert "\n" not in msg and len(msg) < 200, msg
  for name in rocketkv.METHODS:
    assert repr(name) in msg
  assert "'rocket'" in msg


def test_loader_errors_name_the_file(tmp_path):
  from rocketkv_jax import models

  bad = tmp_path / "model.gguf"
  bad.write_bytes(b"PK\x03\x04 not a gguf file")
  for fn in (models.load, models.load_config):
    with pytest.raises(models.CheckpointError, match="': expected a GGUF file") as e:
      fn(str(bad))
    assert str(bad) in str(e.value) and "GGUF" in str(e.value)
  empty = tmp_path / "empty.gguf"
  empty.write_bytes(b"")
  with pytest.raises(ValueError, match="empty.gguf': expected a GGUF file"):
    models.load(str(empty))
  truncated = tmp_path / "truncated.gguf"
  truncated.write_bytes(b"GGUF\x03\x00")
  with pytest.raises(ValueError, match="truncated.gguf': expected a GGUF file, cannot read it"):
    models.load(str(truncated))
  with pytest.raises(FileNotFoundError, match="no config.json in .*model.safetensors"):
    models.load_config(str(tmp_path))
  (tmp_path / "config.json").write_text("{not json")
  with pytest.raises(ValueError, match="config.json': expected a JSON object .* invalid JSON"):
    models.load(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="missing.*does not exist"):
    models.load(str(tmp_path / "missing"))
  other = tmp_path / "weights.bin"
  other.write_bytes(b"0")
  with pytest.raises(ValueError, match="must be a Hugging Face directory or a .gguf file"):
    models.load(str(other))


def _without(module: str, code: str):
  """Runs `code` in a fresh interpreter where importing `module` fails as if not installed."""
  import subprocess
  import sys

  prelude = f"import sys; sys.modules[{module!r}] = None\n"
  return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True,
                        timeout=300)


def test_missing_optional_extras_say_what_to_install():
  r = _without("lm_eval", "import rocketkv_jax.eval.lm_eval")
  assert r.returncode == 1
  assert r.stderr.strip().splitlines()[-1] == (
      'ImportError: rocketkv_jax.eval.lm_eval needs lm-eval: pip install -e ".[lm-eval]"')
  r = _without("lm_eval", "import runpy; runpy.run_module('rocketkv_jax.eval.lm_eval', "
                          "run_name='__main__')")
  assert r.returncode == 2
  assert r.stderr.strip().splitlines()[-1] == (
      'error: rocketkv_jax.eval.lm_eval needs lm-eval: pip install -e ".[lm-eval]"')
  r = _without("matplotlib", "from rocketkv_jax.eval import report; report._pyplot()")
  assert r.returncode == 1
  assert r.stderr.strip().splitlines()[-1] == (
      'ImportError: the plots need matplotlib: pip install -e ".[eval]"')


@pytest.mark.parametrize("lengths", [[-5], [0], [65], [500]])
def test_prefill_rejects_lengths_out_of_range(lengths):
  """Issue 41: -5 gave cache.length -4, 500 > L wrote the new token at position 500."""
  k, v, qw = _arrays()
  with pytest.raises(ValueError, match=r"lengths must be in \[1, L=64\]") as e:
    rocketkv.prefill(k, v, qw, PLAN, lengths=jnp.array(lengths, jnp.int32))
  assert "\n" not in str(e.value)


def test_traced_lengths_are_clamped():
  """Under jit the values cannot be checked without a host sync: they are clamped to [1, L]."""
  import jax
  import numpy as np
  rng = np.random.default_rng(0)
  k = jnp.asarray(rng.standard_normal((2, 2, 64, 16)), jnp.float32)
  qw = jnp.asarray(rng.standard_normal((2, 4, 8, 16)), jnp.float32)
  f = jax.jit(lambda ln: rocketkv.prefill(k, k, qw, PLAN, lengths=ln))
  cache = f(jnp.array([-5, 500], jnp.int32))
  np.testing.assert_array_equal(np.asarray(cache.seen), [1, 64])
  np.testing.assert_array_equal(np.asarray(cache.length), [1, PLAN.prompt_budget])


@pytest.mark.parametrize("w", [4, 16])
def test_prefill_rejects_q_window_not_the_plans_window(w):
  k, v, _ = _arrays()
  with pytest.raises(ValueError, match=r"q_window length W=\d+ must equal min\(plan.window_size"):
    rocketkv.prefill(k, v, jnp.zeros((1, 4, w, 16)), PLAN)


@pytest.mark.parametrize("made,used", [("rocketkv", "snapkv"), ("snapkv", "rocketkv"),
                                       ("rocketkv", "rocketkv_mt"), ("quest", "sparq")])
def test_state_of_another_method_is_rejected(made, used):
  k, v, qw = _arrays()
  plans = {m: rocketkv.plan(rocketkv.RocketConfig(token_budget=32, window_size=8, method=m),
                            64, 4, 16) for m in (made, used)}
  state = rocketkv.prefill(k, v, qw, plans[made], layer=2)  # not one of Quest's dense layers
  q, kn = jnp.zeros((1, 4, 16)), jnp.zeros((1, 2, 1, 16))
  with pytest.raises(ValueError, match=f"cache must come from a '{used}' prefill") as e:
    rocketkv.decode_step(q, kn, kn, state, plans[used], layer=2)
  assert "\n" not in str(e.value)
  if used != "rocketkv_mt":
    with pytest.raises(ValueError, match=f"cache must come from a '{used}' prefill"):
      rocketkv.select(q, state, plans[used])


def test_last_valid_window_takes_each_rows_last_valid_queries():
  """Issue 41 item 3: the padded array's last W columns are padding for a shorter row."""
  import numpy as np
  q = np.arange(2 * 1 * 10 * 2, dtype=np.float32).reshape(2, 1, 10, 2)
  got = np.asarray(rocketkv.last_valid_window(jnp.asarray(q), jnp.array([10, 6]), 4))
  np.testing.assert_array_equal(got[0], q[0, :, 6:10])
  np.testing.assert_array_equal(got[1], q[1, :, 2:6])
  got = np.asarray(rocketkv.last_valid_window(jnp.asarray(q), jnp.array([10, 2]), 4))
  np.testing.assert_array_equal(got[1], q[1, :, [0, 0, 0, 1]].transpose(1, 0, 2))
  with pytest.raises(ValueError, match=r"lengths must be in \[1, L=10\]"):
    rocketkv.last_valid_window(jnp.asarray(q), jnp.array([10, 11]), 4)


def test_numpy_integers_are_ints():
  """A length read off an array (np.int64) is an int to the config and the plan, stored as a
  Python int (so configs compare, hash and serialise as their int forms); bools and floats
  are not."""
  import numpy as np
  cfg = rocketkv.RocketConfig(np.int64(32), window_size=np.int32(8))
  assert cfg == CFG and hash(cfg) == hash(CFG) and type(cfg.token_budget) is int
  plan = rocketkv.plan(cfg, np.int64(64), np.int64(4), np.int64(16))
  assert plan == PLAN and type(plan.prompt_len) is int
  for bad in (np.float64(32.0), True, np.bool_(True)):
    with pytest.raises(ValueError, match="token_budget must be an int"):
      rocketkv.RocketConfig(bad)


@pytest.mark.parametrize("dtype", ["bf16", None, "float16", 3])
def test_load_names_a_bad_dtype_as_given(dtype):
  """Checked before the path is read: a ValueError naming the value passed, not numpy's."""
  with pytest.raises(ValueError, match=r"^dtype must be jnp.float32 or jnp.bfloat16 .*got "
                     + repr(dtype).replace("(", r"\(")):
    rocketkv.models.load("/nonexistent", dtype=dtype)


def _one_line(e) -> str:
  msg = str(e.value)
  assert "\n" not in msg, msg
  return msg


def test_reported_layout_mistakes_name_the_layout():
  """Keys as [B, L, Hkv, D] were reported as a heads mismatch; the whole q as q_window as a
  budget overrun (while W must equal the window size)."""
  import numpy as np
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=64), 256, 8, 16)
  rng = np.random.default_rng(0)
  k = jnp.asarray(rng.standard_normal((1, 2, 256, 16)), jnp.float32)
  q = jnp.asarray(rng.standard_normal((1, 4, 256, 16)), jnp.float32)
  qw = rocketkv.last_valid_window(q, None, plan.window_size)
  kt = k.transpose(0, 2, 1, 3)
  with pytest.raises(ValueError) as e:
    rocketkv.prefill(kt, kt, qw, plan)
  assert _one_line(e) == ("k must be [B, Hkv, L, D]; got shape (1, 256, 2, 16): it looks like "
                          "[B, L, Hkv, D], transpose with k.transpose(0, 2, 1, 3) (and v)")
  with pytest.raises(ValueError) as e:
    rocketkv.prefill(k, k, q, plan)
  msg = _one_line(e)
  assert "W=256 must equal min(plan.window_size, L) = 32" in msg
  assert "rocketkv.last_valid_window(q, lengths, plan.window_size)" in msg
  with pytest.raises(ValueError, match=r"got all L=256 prompt queries: pass rocketkv.last_valid"):
    rocketkv.evict(k, k, q, plan)  # evict takes shorter windows, never the whole prompt's
  rocketkv.prefill(k, k, qw, plan)  # the right layouts pass


def _decode_setup():
  k, v, qw = _arrays()
  cache = rocketkv.prefill(k, v, qw, PLAN)
  return cache, jnp.zeros((1, 4, 16)), jnp.zeros((1, 2, 1, 16))


@pytest.mark.parametrize("call,match", [
    # prefill / evict: heads and tokens swapped in the keys or the window queries
    (lambda: rocketkv.prefill(*(x.transpose(0, 2, 1, 3) for x in _arrays()[:2]), _arrays()[2],
                              PLAN), r"k must be \[B, Hkv, L, D\]; got shape \(1, 64, 2, 16\): "
     r"it looks like \[B, L, Hkv, D\], transpose with k.transpose\(0, 2, 1, 3\)"),
    (lambda: rocketkv.evict(*(x.transpose(0, 2, 1, 3) for x in _arrays()[:2]), _arrays()[2],
                            PLAN), r"it looks like \[B, L, Hkv, D\]"),
    (lambda: rocketkv.prefill(*_arrays(hkv=3)[:2], jnp.zeros((1, 8, 6, 16)), PLAN),
     r"q_window must be \[B, Hq, W, D\]; got shape \(1, 8, 6, 16\): it looks like "
     r"\[B, W, Hq, D\], transpose with q_window.transpose\(0, 2, 1, 3\)"),
    (lambda: rocketkv.prefill(*_arrays()[:2], jnp.zeros((1, 8, 4, 16)), PLAN),
     r"W=4 must equal min\(plan.window_size, L\) = 8 .*: it looks like \[B, W, Hq, D\], "
     r"transpose with q_window.transpose\(0, 2, 1, 3\)"),
    (lambda: rocketkv.prefill(*_arrays()[:2], jnp.zeros((1, 4, 64, 16)), PLAN),
     r"W=64 must equal .* = 8 .*pass rocketkv.last_valid_window\(q, lengths, plan.window_size\)"),
    # decode_step / select / attend: the query of one token, the new token's key and value
    (lambda: rocketkv.decode_step(jnp.zeros((1, 4, 1, 16)), *_decode_setup()[2:] * 2,
                                  _decode_setup()[0], PLAN),
     r"q must be \[B, Hq, D\] \(one token per row\); got shape \(1, 4, 1, 16\): it looks like "
     r"\[B, Hq, 1, D\], take the token with q\[:, :, 0\]"),
    (lambda: rocketkv.select(jnp.zeros((1, 1, 4, 16)), _decode_setup()[0], PLAN),
     r"it looks like \[B, 1, Hq, D\], take the token with q\[:, 0\]"),
    (lambda: rocketkv.attend(jnp.zeros((1, 4, 1, 16)), _decode_setup()[0]),
     r"take the token with q\[:, :, 0\]"),
    (lambda: rocketkv.decode_step(_decode_setup()[1], jnp.zeros((1, 2, 16)), jnp.zeros((1, 2, 16)),
                                  _decode_setup()[0], PLAN),
     r"k_new must be \[B, Hkv, 1, D\]; got shape \(1, 2, 16\): it looks like \[B, Hkv, D\], "
     r"add the token axis with k_new\[:, :, None\]"),
    (lambda: rocketkv.decode_step(_decode_setup()[1], jnp.zeros((1, 1, 2, 16)),
                                  jnp.zeros((1, 1, 2, 16)), _decode_setup()[0], PLAN),
     r"k_new must be \[B, Hkv, 1, D\]; got shape \(1, 1, 2, 16\): it looks like "
     r"\[B, 1, Hkv, D\], transpose with k_new.transpose\(0, 2, 1, 3\)"),
    (lambda: rocketkv.attend(_decode_setup()[1], _decode_setup()[0],
                             jnp.zeros((1, 5, 2), jnp.int32)),
     r"idx must be \[B, Hkv, K\]; got shape \(1, 5, 2\): it looks like \[B, K, Hkv\], "
     r"transpose with idx.transpose\(0, 2, 1\)"),
    (lambda: rocketkv.attend(_decode_setup()[1], {"cache": _decode_setup()[0]}),
     r"cache must be a KVCache, got dict \(a method's state: read its cache with "
     r"methods.get\(plan.method\).view\(state\)\)"),
    # append / full_cache / last_valid_window
    (lambda: rocketkv.append(_decode_setup()[0], jnp.zeros((1, 2, 16)), jnp.zeros((1, 2, 16))),
     r"add the token axis with k_new\[:, :, None\]"),
    (lambda: rocketkv.append(rocketkv.prefill(*_arrays(), rocketkv.plan(
        rocketkv.RocketConfig.recommended(32, window_size=8), 64, 4, 16)),
        jnp.zeros((1, 2, 1, 16)), jnp.zeros((1, 2, 1, 16))),
     r"cache must be a KVCache, got QuantState \(a method's state: rocketkv.decode_step "
     r"appends to it\)"),
    (lambda: rocketkv.full_cache(jnp.zeros((1, 64, 2, 16)), jnp.zeros((1, 64, 2, 16)), 80, 4,
                                 jnp.array([40])),
     r"k must be \[B, Hkv, L, D\]; got shape \(1, 64, 2, 16\): it looks like \[B, L, Hkv, D\], "
     r"lengths reach 40 > L=2: transpose with k.transpose\(0, 2, 1, 3\)"),
    (lambda: rocketkv.full_cache(jnp.zeros((1, 2, 64, 16)), jnp.zeros((1, 2, 64, 16)), 80, 4,
                                 jnp.array([-1])), r"lengths must be in \[0, L=64\], got \[-1\]"),
    (lambda: rocketkv.full_cache(jnp.zeros((2, 64, 16)), jnp.zeros((2, 64, 16)), 80, 4),
     r"k must have shape \[B, Hkv, L, D\] \(rank 4\)"),
    (lambda: rocketkv.last_valid_window(jnp.zeros((1, 64, 4, 16)), jnp.array([40]), 8),
     r"q must be \[B, Hq, L, D\]; got shape \(1, 64, 4, 16\): it looks like \[B, L, Hq, D\], "
     r"lengths reach 40 > L=4: transpose with q.transpose\(0, 2, 1, 3\)"),
])
def test_layout_mistakes_name_the_expected_layout(call, match):
  with pytest.raises(ValueError, match=match) as e:
    call()
  _one_line(e)

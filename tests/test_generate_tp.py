"""Tensor parallelism over KV heads on a 4-device "tp" mesh (CPU, forced host devices):
same tokens as one device. Runs in a subprocess because the device count is fixed at
JAX start-up."""

import os
import subprocess
import sys
import textwrap

from model_fixtures import hf_checkpoint

_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, {tests!r})
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    import numpy as np
    import rocketkv_jax as rocketkv
    import rocketkv_jax.models as M
    from rocketkv_jax.models import sharding
    from model_fixtures import random_tokens

    assert len(jax.devices()) == 4
    path = {path!r}
    single = M.load(path)
    mesh = sharding.make_mesh(4)
    tp = M.load(path, mesh=mesh)
    wk = tp.params["layers"][1]["wk"]
    assert len(wk.sharding.device_set) == 4
    assert wk.addressable_shards[0].data.shape == (64, 8)  # one KV head (of 4) per device
    prompts = [random_tokens(1, 48, seed=9)[0].tolist(), random_tokens(1, 33, seed=10)[0].tolist()]
    for method in ("rocketkv",):
      a = rocketkv.generate(single, prompts, method=method, token_budget=32, max_new_tokens=12,
                            eos_token_ids=()).tokens
      seen = []  # streamed from the sharded program too: the per-call id reaches the host
      b = rocketkv.generate(tp, prompts, method=method, token_budget=32, max_new_tokens=12,
                            eos_token_ids=(), stream=lambda s, t, d: seen.append(t.tolist())
                            ).tokens
      assert a == b == [list(r) for r in zip(*seen)], (method, a, b, seen)
    np.testing.assert_allclose(np.asarray(tp.logits(prompts[0])),
                               np.asarray(single.logits(prompts[0])), atol=1e-4)
    print("TP-OK")
""")


def test_tensor_parallel_matches_single_device():
  tests = os.path.dirname(os.path.abspath(__file__))
  path, _ = hf_checkpoint("llama_tp")  # written here: the child never imports torch
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  out = subprocess.run([sys.executable, "-c", _SCRIPT.format(tests=tests, path=path)], env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0 and "TP-OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


_GEMMA_SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path.insert(0, {tests!r})
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    import numpy as np
    import rocketkv_jax as rocketkv
    import rocketkv_jax.models as M
    from rocketkv_jax.models import sharding
    from model_fixtures import random_tokens

    path = {path!r}
    single = M.load(path)
    tp = M.load(path, mesh=sharding.make_mesh(2))
    assert len(tp.params["layers"][1]["wk"].sharding.device_set) == 2
    prompts = [random_tokens(1, 40, seed=3)[0].tolist(), random_tokens(1, 27, seed=4)[0].tolist()]
    for method in ("full", "rocketkv"):
      cfg = rocketkv.RocketConfig(token_budget=16, method=method, window_size=4)
      a = rocketkv.generate(single, prompts, rocket_config=cfg, max_new_tokens=10,
                            eos_token_ids=()).tokens
      b = rocketkv.generate(tp.module, prompts, rocket_config=cfg, max_new_tokens=10,
                            eos_token_ids=()).tokens
      assert a == b, (method, a, b)
    np.testing.assert_allclose(np.asarray(tp.logits(prompts[0])),
                               np.asarray(single.logits(prompts[0])), atol=1e-4)
    print("TP-OK")
""")


def test_tensor_parallel_gemma3_hybrid_through_its_module():
  """Gemma 3 (sliding and full layers) on a 2-device "tp" mesh, driven through the NNX module:
  the tokens of one device."""
  from model_fixtures import gemma3_checkpoint

  tests = os.path.dirname(os.path.abspath(__file__))
  path, _ = gemma3_checkpoint()
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  out = subprocess.run([sys.executable, "-c", _GEMMA_SCRIPT.format(tests=tests, path=path)],
                       env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0 and "TP-OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]

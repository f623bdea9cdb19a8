"""Tensor parallelism over KV heads on a 4-device "tp" mesh (CPU, forced host devices):
same tokens as one device. Runs in a subprocess because the device count is fixed at
JAX start-up."""

from model_fixtures import hf_checkpoint, run_on_host_devices

_SCRIPT = """
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
"""


def test_tensor_parallel_matches_single_device():
  path, _ = hf_checkpoint("llama_tp")  # written here: the child never imports torch
  out = run_on_host_devices(_SCRIPT.format(path=path), devices=4)
  assert out.returncode == 0 and "TP-OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


_GEMMA_SCRIPT = """
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
"""


def test_tensor_parallel_gemma3_hybrid_through_its_module():
  """Gemma 3 (sliding and full layers) on a 2-device "tp" mesh, driven through the NNX module:
  the tokens of one device."""
  from model_fixtures import gemma3_checkpoint

  path, _ = gemma3_checkpoint()
  out = run_on_host_devices(_GEMMA_SCRIPT.format(path=path), devices=2)
  assert out.returncode == 0 and "TP-OK" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]

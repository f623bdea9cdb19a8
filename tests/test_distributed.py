"""Multi-process generation with JAX's distributed runtime: 2 local processes x 2 CPU devices
(gloo collectives) on a ("dp", "tp") = (2, 2) mesh give every process the same tokens as one
device in this process, for a ragged batch of 4 prompts with RocketKV and full KV and for a
two-turn RocketKV-MT `Conversation`, and the same `Model.logits`.

Each child runs the same program (SPMD): `distributed.initialize`, `make_mesh(tp=2, dp=2)`,
`models.load(path, mesh=...)`, `rocketkv.generate(...)`. The checkpoint is written here with
NumPy + safetensors (no torch import), 8 query / 4 KV heads so "tp" splits KV heads 2 / 2.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
from safetensors.numpy import save_file

from model_fixtures import random_tokens
from xla_env import child_env

# A hang guard (a deadlocked collective never returns), from the children's start: the test
# takes ~77 s of CPU in all (3 processes), and far longer than that on a loaded machine.
TIMEOUT_S = 900
METHODS = ("rocketkv", "full")
GEN = dict(token_budget=32, max_new_tokens=12, eos_token_ids=())
LENGTHS = (48, 33, 40, 21)  # ragged: each dp shard holds a long and a short prompt
CONV = dict(method="rocketkv_mt", token_budget=32, max_new_tokens=6, eos_token_ids=(),
            turn_pad=8)

_CHILD = textwrap.dedent("""
    import json, sys
    import jax
    import numpy as np
    jax.config.update("jax_default_matmul_precision", "highest")
    from rocketkv_jax.models import distributed, sharding
    coordinator, process_id, path, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    distributed.initialize(coordinator, num_processes=2, process_id=process_id)
    import rocketkv_jax as rocketkv
    assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 4, 2)
    mesh = sharding.make_mesh(tp=2, dp=2)
    model = rocketkv.models.load(path, mesh=mesh)
    wk = model.params["layers"][0]["wk"]  # [64, 4 KV heads x 8]: 2 KV heads per device
    assert wk.shape == (64, 32) and not wk.is_fully_addressable
    assert [s.data.shape for s in wk.addressable_shards] == [(64, 16), (64, 16)]
    turns = lambda prompts: [prompts, [p[-5:] for p in prompts]]
    out = {{}}
    for method in {methods!r}:
      res = rocketkv.generate(model, json.loads(prompts), method=method, **{gen!r})
      out[method] = res.tokens
    conv = rocketkv.Conversation(model, **{conv!r})  # two turns over one KV state
    out["conversation"] = [conv.send(m).tokens for m in turns(json.loads(prompts))]
    logits = model.logits([p[:{short}] for p in json.loads(prompts)])  # replicated: readable
    out["logits"] = np.asarray(logits).tolist()
    print("TOKENS " + json.dumps(out), flush=True)
""")


def _checkpoint(path: str) -> None:
  """A tiny random Llama (HF layout: config.json + model.safetensors, [out, in] weights)."""
  hidden, inter, layers, heads, kv_heads, head_dim, vocab = 64, 128, 2, 8, 4, 8, 256
  config = dict(
      model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab,
      hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
      max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, hidden_act="silu")
  rng = np.random.default_rng(0)
  w = lambda *shape: rng.normal(0.0, 0.08, shape).astype(np.float32)
  tensors = {"model.embed_tokens.weight": w(vocab, hidden), "lm_head.weight": w(vocab, hidden),
             "model.norm.weight": np.ones(hidden, np.float32)}
  for i in range(layers):
    p = f"model.layers.{i}."
    tensors.update({
        p + "input_layernorm.weight": 1 + w(hidden), p + "post_attention_layernorm.weight":
        1 + w(hidden), p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
        p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
        p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
        p + "mlp.down_proj.weight": w(hidden, inter)})
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  save_file(tensors, os.path.join(path, "model.safetensors"))


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_processes(path: str, prompts, logs: str) -> list[subprocess.Popen]:
  """Starts the 2 children, their stdout / stderr in files under `logs` (a pipe nobody reads
  while they run could fill up and block them)."""
  coordinator = f"127.0.0.1:{_free_port()}"
  env = child_env(devices=2)
  script = _CHILD.format(methods=METHODS, gen=GEN, short=min(LENGTHS), conv=CONV)
  procs = []
  for i in range(2):
    with open(os.path.join(logs, f"out{i}"), "w") as out, \
         open(os.path.join(logs, f"err{i}"), "w") as err:
      procs.append(subprocess.Popen([sys.executable, "-c", script, coordinator, str(i), path,
                                     json.dumps(prompts)], env=env, stdout=out, stderr=err))
  return procs


def _wait(procs: list[subprocess.Popen], logs: str, deadline: float) -> list[dict]:
  """Waits for both children (a failed one stops the other at once); their TOKENS lines."""
  try:
    while any(p.poll() is None for p in procs):
      failed = any(p.poll() not in (None, 0) for p in procs)
      if failed or time.monotonic() > deadline:
        break
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p in procs:
    p.wait()
  read = lambda name: open(os.path.join(logs, name), errors="replace").read()
  logs = [(read(f"out{i}"), read(f"err{i}")) for i in range(len(procs))]
  report = "\n".join(f"--- process {i} (exit {p.returncode}) stdout:\n{out[-3000:]}\n"
                     f"--- process {i} stderr:\n{err[-6000:]}"
                     for i, (p, (out, err)) in enumerate(zip(procs, logs)))
  assert all(p.returncode == 0 for p in procs), "a process failed or timed out\n" + report
  results = []
  for out, _ in logs:
    line = [l for l in out.splitlines() if l.startswith("TOKENS ")]
    assert line, "no TOKENS line\n" + report
    results.append(json.loads(line[-1][len("TOKENS "):]))
  return results


def test_two_processes_dp2_tp2_match_one_device(tmp_path):
  import rocketkv_jax as rocketkv

  path = str(tmp_path / "tiny_llama")
  _checkpoint(path)
  prompts = [random_tokens(1, n, seed=20 + i)[0].tolist() for i, n in enumerate(LENGTHS)]
  deadline = time.monotonic() + TIMEOUT_S
  procs = _start_processes(path, prompts, str(tmp_path))
  try:  # the reference runs while the children start: one device, no mesh
    single = rocketkv.models.load(path)
    want = {m: rocketkv.generate(single, prompts, method=m, **GEN).tokens for m in METHODS}
    conv = rocketkv.Conversation(single, **CONV)
    want["conversation"] = [conv.send(m).tokens for m in (prompts, [p[-5:] for p in prompts])]
    logits = np.asarray(single.logits([p[:min(LENGTHS)] for p in prompts]))
  finally:
    per_process = _wait(procs, str(tmp_path), deadline)
  assert [[len(t) for t in turn] for turn in want["conversation"]] == [[6] * len(prompts)] * 2
  for method in METHODS + ("conversation",):
    if method != "conversation":
      assert [len(t) for t in want[method]] == [GEN["max_new_tokens"]] * len(prompts)
    for i, got in enumerate(per_process):
      assert got[method] == want[method], (method, i, got[method], want[method])
  for got in per_process:  # Model.logits on the mesh: the batch over dp, heads over tp
    np.testing.assert_allclose(np.asarray(got["logits"]), logits, atol=1e-4, rtol=0)


def test_bad_mesh_and_process_arguments_are_one_line_value_errors():
  """Checked before anything is traced (an abstract mesh stands in for missing devices)."""
  import jax
  from jax.sharding import AbstractMesh
  import pytest

  from rocketkv_jax.models import distributed, sharding
  from rocketkv_jax.models.config import ModelConfig

  n = len(jax.devices())
  cases = [
      (lambda: sharding.make_mesh(tp=1, dp=0), "dp must be an int >= 1, got 0"),
      (lambda: sharding.make_mesh(tp=0), "tp must be an int >= 1, got 0"),
      (lambda: sharding.make_mesh(tp=n + 1), f"needs more devices than the {n} available"),
      (lambda: sharding.make_mesh(dp=n + 1), f"dp ({n + 1}) must divide the number of devices"),
      (lambda: distributed.check_args("localhost", 2, 0), "coordinator must be HOST:PORT"),
      (lambda: distributed.check_args("localhost:0", 2, 0), "coordinator must be HOST:PORT"),
      (lambda: distributed.check_args("h:1", 0, 0), "num_processes must be an int >= 1, got 0"),
      (lambda: distributed.check_args("h:1", 2, 2), "process_id must be in [0, 1]"),
  ]
  config = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                       num_heads=8, num_kv_heads=4, head_dim=8)
  cases += [
      (lambda: sharding.param_shardings(config, AbstractMesh((2, 3), ("dp", "tp"))),
       "num_kv_heads (4) must be divisible by the tp mesh size (3)"),
      (lambda: sharding.param_shardings(config, AbstractMesh((2,), ("x",))),
       "mesh axes must be ('tp',) or ('dp', 'tp'), got ('x',)"),
  ]
  for fn, want in cases:
    with pytest.raises(ValueError) as e:
      fn()
    assert want in str(e.value) and "\n" not in str(e.value), (want, str(e.value))
  assert distributed.check_args("10.0.0.1:1234", 2, 1) == ("10.0.0.1", 1234)
  mesh = sharding.make_mesh(tp=1, dp=1)
  assert mesh.axis_names == ("dp", "tp") and mesh.devices.shape == (1, 1)

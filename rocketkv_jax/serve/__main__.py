"""The OpenAI-compatible server's command line (docs/serving.md).

    python -m rocketkv_jax.serve --model smollm2 --method recommended --budget 256 \\
        --kv-cache-mb 2048 --port 8000

Flags take vLLM's names where vLLM has one. User errors (a bad flag, model path, method or
engine setting) print one line, `error: ...`, and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys


DEFAULT_BLOCK_SIZE = 128
# A long prompt's prefill runs in this many layer groups, a decode call between two: SmolLM2's
# ~24 s for a 7K prompt on a 2-core CPU becomes stalls of ~3 s (docs/serving.md, "Prefill in
# layer groups"); at most the model's layers.
DEFAULT_PREFILL_LAYER_GROUPS = 8


class UsageError(ValueError):
  """A bad command line: printed as one `error: ...` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
  def error(self, message):
    raise UsageError(f"{message} (see --help)")


def parser() -> argparse.ArgumentParser:
  p = _Parser(prog="python -m rocketkv_jax.serve", description=__doc__,
              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="smollm2",
                 help="smollm2 (the default), gemma3, a Hugging Face checkpoint directory or a "
                      ".gguf file")
  p.add_argument("--method", default="recommended",
                 help="a KV method (rocketkv_jax.METHODS) or recommended (the default: "
                      "RocketConfig.recommended)")
  p.add_argument("--budget", type=int, default=256,
                 help="token budget B of the one budget split every request shares (default 256)")
  p.add_argument("--kv-cache-mb", type=float, default=None,
                 help="the KV pool in MiB: with --block-size, pages for as many tokens as fit "
                      "beside the --max-num-seqs slots; with --block-size 0, as many whole "
                      "slots as fit, at most --max-num-seqs (default: room for --max-num-seqs "
                      "requests of the plan's capacity)")
  p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                 help=f"tokens per KV page (rounded up to whole chunks of the method's "
                      f"summaries), taken as --page-allocation says. "
                      f"0: no pages, each slot reserves the plan's whole capacity (default "
                      f"{DEFAULT_BLOCK_SIZE})")
  p.add_argument("--page-allocation", default="reserve", choices=["reserve", "lazy"],
                 help="with --block-size: reserve: a request takes the pages of its kept prompt "
                      "+ max_tokens when admitted (never preempted); lazy: the pages of its "
                      "prompt, then more as it generates, and the most recently admitted "
                      "request is preempted (later recomputed, its output unchanged) when the "
                      "pool runs dry (default reserve)")
  p.add_argument("--max-num-seqs", type=int, default=8,
                 help="decode slots: requests decoding at once, at most (default 8)")
  p.add_argument("--max-model-len", type=int, default=None,
                 help="prompt + generated tokens of one request (default: min(4096, the "
                      "model's context))")
  p.add_argument("--max-new-tokens", type=int, default=256,
                 help="new tokens the budget split plans for, and the default max_tokens; "
                      "prompts hold up to max-model-len minus this (default 256)")
  p.add_argument("--max-waiting", type=int, default=256,
                 help="requests that may wait for a slot; beyond it the server answers 503 "
                      "(default 256)")
  p.add_argument("--steps-per-call", type=int, default=1,
                 help="decode steps per compiled call (default 1: a token per call, the "
                      "smoothest streaming)")
  p.add_argument("--prefill-tokens-per-step", type=int, default=2048,
                 help="admissions between two decode calls stop once their prompts reach this "
                      "many tokens, at least one admitted: a burst of long prompts stalls the "
                      "running requests one prompt at a time; 0: fill every free slot first "
                      "(default 2048)")
  p.add_argument("--prefill-layer-groups", type=int, default=None,
                 help="a prompt's prefill runs as this many calls over groups of consecutive "
                      "layers, the running requests decoding between two: a long prompt "
                      "stalls them ~1/groups of its prefill at a time; 1: one call; in [1, the "
                      f"model's layers] (default min({DEFAULT_PREFILL_LAYER_GROUPS}, the "
                      "model's layers))")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="parameter and KV-cache dtype (default float32)")
  p.add_argument("--tensor-parallel-size", type=int, default=1,
                 help="devices the KV heads (and the model's attention heads and MLP columns) "
                      "are split over; must divide the model's KV heads (default 1)")
  p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
  p.add_argument("--port", type=int, default=8000, help="default 8000")
  p.add_argument("--served-model-name", default=None,
                 help="the model name clients send (default: --model's last path component)")
  p.add_argument("--api-key", default=os.environ.get("ROCKETKV_API_KEY"),
                 help="require `Authorization: Bearer <key>` on /v1 (default: $ROCKETKV_API_KEY, "
                      "else no key)")
  p.add_argument("--shutdown-timeout", type=float, default=10.0,
                 help="on SIGTERM / Ctrl-C, seconds running requests may take to finish before "
                      "they are aborted (default 10)")
  p.add_argument("--uvicorn-log-level", default="info",
                 choices=["critical", "error", "warning", "info", "debug", "trace"])
  p.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
  return p


def check(args: argparse.Namespace) -> None:
  """The checks that need no model; UsageError names the flag."""
  import rocketkv_jax as rocketkv

  if args.method != "recommended" and args.method not in rocketkv.METHODS:
    raise UsageError(f"--method must be recommended or one of {list(rocketkv.METHODS)}, got "
                     f"{args.method!r}")
  for flag in ("budget", "max_num_seqs", "max_new_tokens", "steps_per_call",
               "tensor_parallel_size"):
    if getattr(args, flag) < 1:
      raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
  if args.prefill_tokens_per_step < 0:
    raise UsageError(f"--prefill-tokens-per-step must be >= 0 (0: no limit), got "
                     f"{args.prefill_tokens_per_step}")
  if args.prefill_layer_groups is not None and args.prefill_layer_groups < 1:
    raise UsageError(f"--prefill-layer-groups must be >= 1 (1: one call), got "
                     f"{args.prefill_layer_groups}")
  if args.block_size < 0:
    raise UsageError(f"--block-size must be >= 0 (0: no pages), got {args.block_size}")
  if args.max_waiting < 0:
    raise UsageError(f"--max-waiting must be >= 0, got {args.max_waiting}")
  if not 0 < args.port < 65536:
    raise UsageError(f"--port must be in [1, 65535], got {args.port}")
  if args.api_key == "":
    raise UsageError("--api-key must not be empty")


def build_engine(args: argparse.Namespace):
  """Loads the model and makes the engine (not started); ValueError / OSError are user errors."""
  import jax.numpy as jnp

  import rocketkv_jax as rocketkv
  from rocketkv_jax.runtime.engine import Engine, EngineConfig

  path = rocketkv.models.resolve(args.model)
  mesh = None
  if args.tensor_parallel_size > 1:
    from rocketkv_jax.models import sharding

    mesh = sharding.make_mesh(tp=args.tensor_parallel_size)
    config, _ = rocketkv.models.load_config(path)
    sharding.check_mesh(config, mesh)
  model = rocketkv.models.load(path, dtype=getattr(jnp, args.dtype), mesh=mesh)
  if args.method == "recommended":
    rocket_config = rocketkv.RocketConfig.recommended(args.budget)
  else:
    rocket_config = rocketkv.RocketConfig(token_budget=args.budget, method=args.method)
  max_model_len = args.max_model_len or min(4096, model.config.max_position_embeddings)
  layers = model.config.num_layers
  groups = args.prefill_layer_groups or min(DEFAULT_PREFILL_LAYER_GROUPS, layers)
  if groups > layers:
    raise UsageError(f"--prefill-layer-groups must be in [1, {layers}] (at most the model's "
                     f"{layers} layers), got {groups}")
  return Engine(model, EngineConfig(
      rocket_config, max_model_len=max_model_len, max_new_tokens=args.max_new_tokens,
      max_num_seqs=args.max_num_seqs, kv_cache_mb=args.kv_cache_mb,
      max_waiting=args.max_waiting, steps_per_call=args.steps_per_call,
      prefill_tokens_per_step=args.prefill_tokens_per_step or None,
      prefill_layer_groups=groups, page_size=args.block_size or None,
      page_allocation=args.page_allocation))


def main(argv=None) -> None:
  debug = "--debug" in (sys.argv[1:] if argv is None else argv)
  try:
    args = parser().parse_args(argv)
    check(args)
    from rocketkv_jax.serve import build_app, serve  # the extra's ImportError names it

    engine = build_engine(args)
  except (ValueError, OSError, ImportError) as e:
    if debug:
      raise
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
  st = engine.stats()
  if engine.paged:
    pool = (f"{st.num_slots} slots, {engine.num_pages - 1} pages of {engine.page_size} tokens "
            f"({engine.page_bytes / 2**20:.2f} MiB each, {engine.config.page_allocation})")
  else:
    pool = f"{st.num_slots} slots of {st.slot_bytes / 2**20:.1f} MiB"
  print(f"rocketkv serve: {name}, {engine.plan.method} B={engine.plan.token_budget}, {pool}, "
        f"max_model_len {engine.config.max_model_len}, prefill in "
        f"{engine.config.prefill_layer_groups} layer group(s); compiling ...", file=sys.stderr,
        flush=True)
  print(f"rocketkv serve: compiled in {engine.warmup():.1f} s; serving "
        f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
  engine.start()
  serve(build_app(engine, name, args.api_key), engine, host=args.host, port=args.port,
        shutdown_timeout=args.shutdown_timeout, log_level=args.uvicorn_log_level)


if __name__ == "__main__":
  main()

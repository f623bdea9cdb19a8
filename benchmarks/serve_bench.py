"""Serving benchmark: each KV method behind the same `--kv-cache-mb`, driven by guidellm.

    python3 -m venv .gl && .gl/bin/pip install guidellm      # its own venv: its pins differ
    python3 benchmarks/serve_bench.py --model smollm2 --methods full,rocketkv --budget 256 \\
        --kv-cache-mb 2048 --prompt-tokens 8192 --output-tokens 1024 --rates 0.02,0.05,0.1 \\
        --requests 16 --guidellm .gl/bin/guidellm --out runs/serve_bench

For each method it starts `python -m rocketkv_jax.serve` (same model, pool, lengths), and for
each request rate runs guidellm (constant rate, `--requests` requests of real text: windows of
`--text` files, by default the licence texts Debian ships in /usr/share/common-licenses) while
it polls the server's /metrics and RSS. Per (method, rate), side by side: requests running at
once (peak, mean), output tokens/s, requests/s, TTFT p50 / p99, inter-token latency p50 / p99,
KV usage (peak, mean), the server's peak RSS, and the engine's prefill vs decode seconds; TTFT
p50 over every request sent (`ttft_all_*`: bounds, a request cut off before its first token
waited at least until the cutoff); requests at once, pool use and generated tokens/s over the
window's second half (`*_late`: past the ramp from an empty server, the steady state at
saturation).
guidellm's rates count only the requests that completed; `--max-seconds` stops a rate's run
(guidellm's max_duration) and the requests still running then count as incomplete, so the
table also gives the server's generated tokens per second over the run (gen_tok_s).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from rocketkv_jax import models

DEFAULT_TEXT = "/usr/share/common-licenses/*"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> str:
  with urllib.request.urlopen(url, timeout=timeout) as r:
    return r.read().decode()


def _metrics(base: str) -> dict[str, float]:
  """The unlabelled samples of /metrics."""
  out = {}
  for line in _get(f"{base}/metrics").splitlines():
    m = re.match(r"^(rocketkv:[a-z_]+) ([0-9.eE+-]+)$", line)
    if m:
      out[m.group(1)] = float(m.group(2))
  return out


def _rss_mb(pid: int) -> tuple[float, float]:
  """(current, peak) resident memory of process `pid` in MiB."""
  vals = {}
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith(("VmRSS:", "VmHWM:")):
        vals[line.split(":")[0]] = int(line.split()[1]) / 1024
  return vals.get("VmRSS", 0.0), vals.get("VmHWM", 0.0)


class Poller(threading.Thread):
  """Samples /metrics and the server's RSS every `period` seconds."""

  def __init__(self, base: str, pid: int, period: float = 0.25):
    super().__init__(daemon=True)
    self.base, self.pid, self.period = base, pid, period
    self.samples: list[dict] = []
    self.stop = threading.Event()

  def run(self):
    while not self.stop.is_set():
      try:
        m = _metrics(self.base)
        m["rss_mb"], m["peak_rss_mb"] = _rss_mb(self.pid)
        m["t"] = time.monotonic()
        self.samples.append(m)
      except OSError:
        pass
      self.stop.wait(self.period)


def _prompts(tokenizer, files: list[str], n: int, length: int, out_tokens: int,
             path: str) -> None:
  """`n` prompts of `length` tokens: windows of the concatenated `files`, as guidellm JSONL."""
  text = "\n\n".join(open(f, errors="ignore").read() for f in files)
  ids = tokenizer.encode(text, add_special_tokens=False)
  if len(ids) < length + n:
    raise ValueError(f"--text holds {len(ids)} tokens; --prompt-tokens {length} needs more")
  stride = max(1, (len(ids) - length) // max(n, 1))
  with open(path, "w") as f:
    for i in range(n):
      window = ids[i * stride: i * stride + length]
      f.write(json.dumps({"prompt": tokenizer.decode(window),
                          "output_tokens_count": out_tokens}) + "\n")


def _tokenizer_dir(tokenizer, path: str) -> None:
  """The model's tokenizer where guidellm's `AutoTokenizer` reads it."""
  os.makedirs(path, exist_ok=True)
  tokenizer.backend.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.bos_token,
               "eos_token": tokenizer.eos_token}, f)


def _pct(stats: dict, key: str, p: str) -> float:
  return float(stats[key]["successful"]["percentiles"][p])


def _summary(gl: dict, window: list[dict], before: dict, after: dict) -> dict:
  """One row: guidellm's numbers and the server's during the run."""
  m = gl["benchmarks"][0]["metrics"]
  running = [s["rocketkv:num_requests_running"] for s in window] or [0.0]
  usage = [s["rocketkv:kv_cache_usage_perc"] for s in window] or [0.0]
  delta = lambda k: after.get(k, 0.0) - before.get(k, 0.0)
  totals = m.get("request_totals", {})
  wall = (window[-1]["t"] - window[0]["t"]) if len(window) > 1 else 0.0
  return dict(
      completed=totals.get("successful"), incomplete=totals.get("incomplete"),
      errored=totals.get("errored"), wall_s=wall,
      running_peak=max(running), running_mean=statistics.fmean(running),
      output_tok_s=float(m["output_tokens_per_second"]["successful"]["mean"]),
      requests_s=float(m["requests_per_second"]["successful"]["mean"]),
      gen_tok_s=delta("rocketkv:generation_tokens_total") / wall if wall else 0.0,
      ttft_p50_ms=_pct(m, "time_to_first_token_ms", "p50"),
      ttft_p99_ms=_pct(m, "time_to_first_token_ms", "p99"),
      itl_p50_ms=_pct(m, "inter_token_latency_ms", "p50"),
      itl_p99_ms=_pct(m, "inter_token_latency_ms", "p99"),
      kv_usage_peak=max(usage), kv_usage_mean=statistics.fmean(usage),
      peak_rss_mb=max([s["peak_rss_mb"] for s in window] or [0.0]),
      prefill_s=delta("rocketkv:prefill_seconds_total"),
      decode_s=delta("rocketkv:decode_seconds_total"),
      preempted=delta("rocketkv:num_preemptions_total"),
      recomputed_tokens=delta("rocketkv:recomputed_tokens_total"),
      **_late(window), **_ttft_all(gl))


def first_token_waits(gl: dict) -> list[tuple[float, bool]]:
  """Every request sent, in arrival order: (its wait for a first token, True), or (its wait
  until it was cut off without one, False)."""
  b = gl["benchmarks"][0].get("requests") or {}
  out = []
  for r in (b.get("successful") or []) + (b.get("incomplete") or []) + (b.get("errored") or []):
    t = r["info"]["timings"]
    start = t.get("request_start")
    if start is None:  # never sent
      continue
    if t.get("first_token_iteration") is not None:
      out.append((start, t["first_token_iteration"] - start, True))
    elif t.get("resolve_end") is not None:
      out.append((start, t["resolve_end"] - start, False))
  return [(w, ok) for _, w, ok in sorted(out)]


def _ttft_all(gl: dict) -> dict:
  """TTFT p50 over every request sent, not only the completed ones (guidellm's percentiles
  favour the method that completes fewer, the earliest arrivals): a request with no first token
  by the cutoff counts as its wait until then (`_lo`: a lower bound of the median) or as
  infinite (`_hi`: an upper bound; None when it falls on such a request)."""
  waits = first_token_waits(gl)
  if not waits:
    return {}
  lo = statistics.median(w for w, _ in waits)
  hi = sorted(w if ok else float("inf") for w, ok in waits)[len(waits) // 2]
  return dict(sent=len(waits), no_first_token=sum(not ok for _, ok in waits),
              ttft_all_p50_lo_s=lo, ttft_all_p50_hi_s=None if hi == float("inf") else hi)


def _late(window: list[dict]) -> dict:
  """The second half of the window: past the ramp from an empty server, so at saturation the
  steady state's requests at once, pool use, generated tokens/s and preemptions."""
  if len(window) < 4:
    return {}
  mid = (window[0]["t"] + window[-1]["t"]) / 2
  late = [s for s in window if s["t"] >= mid]
  wall = late[-1]["t"] - late[0]["t"]
  delta = lambda k: late[-1].get(k, 0.0) - late[0].get(k, 0.0)
  return dict(
      running_mean_late=statistics.fmean(s["rocketkv:num_requests_running"] for s in late),
      kv_usage_mean_late=statistics.fmean(s["rocketkv:kv_cache_usage_perc"] for s in late),
      gen_tok_s_late=delta("rocketkv:generation_tokens_total") / wall if wall else 0.0,
      preempted_late=delta("rocketkv:num_preemptions_total"))


COLS = ["method", "rate", "slots", "completed", "incomplete", "running_peak", "running_mean",
        "running_mean_late", "output_tok_s", "gen_tok_s", "gen_tok_s_late", "requests_s",
        "ttft_p50_ms", "ttft_p99_ms", "ttft_all_p50_lo_s", "ttft_all_p50_hi_s", "itl_p50_ms",
        "itl_p99_ms", "kv_usage_peak", "kv_usage_mean", "peak_rss_mb", "prefill_s", "decode_s",
        "preempted"]


def _write(out: str, command: str, files: list[str], rows: list[dict]) -> str:
  """serve_bench.json and serve_bench.md (the command on top, then the table); the table."""
  with open(os.path.join(out, "serve_bench.json"), "w") as f:
    json.dump(dict(command=command, text=files, rows=rows), f, indent=1)
  table = "| " + " | ".join(COLS) + " |\n|" + "---|" * len(COLS) + "\n" + "".join(
      "| " + " | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                        for c in COLS) + " |\n" for r in rows)
  with open(os.path.join(out, "serve_bench.md"), "w") as f:
    f.write(f"    {command}\n\n{table}")
  return table


def _slots_only(a, path: str) -> int:
  """Prints and writes each method's slot size and slots in the pool (no load)."""
  from rocketkv_jax.eval.variants import rocket_config  # as the server's --method reads it
  from rocketkv_jax.runtime.engine import Engine, EngineConfig

  model = models.load(path)
  rows = []
  for method in a.methods.split(","):
    cfg = EngineConfig(rocket_config(method, a.budget), max_new_tokens=a.output_tokens,
                       max_model_len=min(a.prompt_tokens + a.output_tokens + 64,
                                         model.config.max_position_embeddings),
                       max_num_seqs=1)
    eng = Engine(model, cfg)
    rows.append(dict(method=method, budget=a.budget, max_prompt_len=cfg.max_prompt_len,
                     max_new_tokens=a.output_tokens, capacity=eng.plan.capacity,
                     slot_mib=eng.slot_bytes / 2**20, kv_cache_mb=a.kv_cache_mb,
                     slots=int(a.kv_cache_mb * 2**20 // eng.slot_bytes)))
    print(json.dumps(rows[-1]), flush=True)
  os.makedirs(a.out, exist_ok=True)
  with open(os.path.join(a.out, "slots.json"), "w") as f:
    json.dump(dict(command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
                   model=a.model, rows=rows), f, indent=1)
  return 0


def _serve(a, method: str, port: int, log):
  cmd = [sys.executable, "-m", "rocketkv_jax.serve", "--model", a.model, "--method", method,
         "--budget", str(a.budget), "--kv-cache-mb", str(a.kv_cache_mb),
         "--max-num-seqs", str(a.max_num_seqs), "--max-model-len",
         str(a.prompt_tokens + a.output_tokens + 64), "--max-new-tokens",
         str(a.output_tokens), "--port", str(port), "--served-model-name", "model",
         "--page-allocation", a.page_allocation]
  return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="smollm2", help="smollm2, gemma3, an HF dir or a .gguf")
  ap.add_argument("--methods", default="full,rocketkv",
                  help="comma-separated serve --method values (a METHODS name or recommended)")
  ap.add_argument("--budget", type=int, default=256)
  ap.add_argument("--kv-cache-mb", type=float, default=2048)
  ap.add_argument("--max-num-seqs", type=int, default=64)
  ap.add_argument("--prompt-tokens", type=int, default=8192)
  ap.add_argument("--output-tokens", type=int, default=1024)
  ap.add_argument("--rates", default="0.02,0.05,0.1", help="requests/s, comma-separated")
  ap.add_argument("--endpoint", choices=("chat/completions", "completions"),
                  default="chat/completions",
                  help="the API guidellm sends to: chat (the model's chat template) or plain "
                       "completions (a base model without a chat template)")
  ap.add_argument("--page-allocation", choices=("reserve", "lazy"), default="reserve",
                  help="the server's --page-allocation: pages of max_tokens at admission, or as "
                       "tokens fill them (preempting when the pool runs dry)")
  ap.add_argument("--requests", type=int, default=16, help="requests per rate")
  ap.add_argument("--max-seconds", type=float, default=None,
                  help="stop each rate's run after this many seconds (guidellm's max_duration); "
                       "requests still running then count as incomplete")
  ap.add_argument("--text", nargs="+", default=None,
                  help=f"real text files the prompts are cut from (default {DEFAULT_TEXT})")
  ap.add_argument("--guidellm", default="guidellm", help="the guidellm executable")
  ap.add_argument("--startup-timeout", type=float, default=1800)
  ap.add_argument("--slots-only", action="store_true",
                  help="only each method's slots in --kv-cache-mb (requests running at once at "
                       "saturation), from the engine's plan; no server, no load")
  ap.add_argument("--out", default="runs/serve_bench")
  a = ap.parse_args(argv)
  try:
    path = models.resolve(a.model)
    rates = [float(r) for r in a.rates.split(",")]
    if min(rates) <= 0 or min(a.requests, a.prompt_tokens, a.output_tokens) < 1 or (
        a.max_seconds is not None and a.max_seconds <= 0):
      raise ValueError("--rates, --requests, --prompt-tokens, --output-tokens, --max-seconds "
                       "must be > 0")
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if a.slots_only:
    return _slots_only(a, path)
  files = a.text or sorted(f for f in glob.glob(DEFAULT_TEXT) if os.path.isfile(f))
  if not files or not all(os.path.isfile(f) for f in files):
    print(f"error: --text: not text files: {files}", file=sys.stderr)
    return 2
  gl_exe = a.guidellm if os.path.exists(a.guidellm) else None
  if gl_exe is None:
    from shutil import which
    gl_exe = which(a.guidellm)
  if gl_exe is None:
    print(f"error: --guidellm: {a.guidellm!r} not found; python3 -m venv .gl && "
          f".gl/bin/pip install guidellm", file=sys.stderr)
    return 2

  os.makedirs(a.out, exist_ok=True)
  work = tempfile.mkdtemp(prefix="serve_bench_")
  config, tokenizer = models.load_config(path)
  fit = config.max_position_embeddings - a.output_tokens - 64
  if a.prompt_tokens > fit:  # the model's context bounds prompt + output
    print(f"note: --prompt-tokens {a.prompt_tokens} -> {fit} (the model's context is "
          f"{config.max_position_embeddings})", file=sys.stderr)
    a.prompt_tokens = fit
  data = os.path.join(work, "prompts.jsonl")
  _prompts(tokenizer, files, a.requests, a.prompt_tokens, a.output_tokens, data)
  _tokenizer_dir(tokenizer, os.path.join(work, "tokenizer"))
  command = " ".join(["python3", "benchmarks/serve_bench.py"] + sys.argv[1:])
  rows = []
  for method in a.methods.split(","):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(os.path.join(a.out, f"server_{method}.log"), "w")
    server = _serve(a, method, port, log)
    try:
      t0 = time.monotonic()
      while True:
        try:
          if _get(f"{base}/health", 2.0) == "":
            break
        except OSError:
          pass
        if server.poll() is not None or time.monotonic() - t0 > a.startup_timeout:
          print(f"error: the {method} server did not start (see {log.name})", file=sys.stderr)
          return 1
        time.sleep(2)
      startup = time.monotonic() - t0
      slots = _metrics(base)["rocketkv:num_slots"]
      poller = Poller(base, server.pid)
      poller.start()
      for rate in rates:
        before, start = _metrics(base), time.monotonic()
        out = os.path.join(a.out, f"guidellm_{method}_{rate}.json")
        cmd = [gl_exe, "run", "--backend",
               f"kind=openai_http,target={base},request_format=/v1/{a.endpoint}",
               "--profile", f"kind=constant,rate={rate}",
               "--constraint", f"kind=max_requests,count={a.requests}",
               "--data", f"kind=json_file,path={data}",
               "--tokenizer", f"kind=huggingface_auto,model={os.path.join(work, 'tokenizer')}",
               "--output", f"kind=json,path={out}", "--disable-console-interactive"]
        if a.max_seconds is not None:
          cmd += ["--constraint", f"kind=max_duration,seconds={a.max_seconds:g}"]
        subprocess.run(cmd, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"),
                       stdout=subprocess.DEVNULL)
        after = _metrics(base)
        window = [s for s in poller.samples if s["t"] >= start]
        with open(out) as f:
          row = dict(method=method, rate=rate, slots=slots, startup_s=startup,
                     **_summary(json.load(f), window, before, after))
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(a.out, command, files, rows)  # each row as it lands
      poller.stop.set()
    finally:
      server.terminate()
      server.wait(60)
      log.close()
  print(_write(a.out, command, files, rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""benchmarks/serve_bench.py without a server: its prompts and its user errors."""

import json

import pytest

import bench_scripts
import rocketkv_jax.models as M

serve_bench = bench_scripts.load("serve_bench")


def test_prompts_are_windows_of_the_text(tmp_path):
  _, tok = M.load_config(M.smollm2_path())
  text = tmp_path / "doc.txt"
  words = [f"word{i}" for i in range(3000)]
  text.write_text(" ".join(words))
  out = tmp_path / "p.jsonl"
  serve_bench._prompts(tok, [str(text)], 3, 200, 17, str(out))
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(rows) == 3 and all(r["output_tokens_count"] == 17 for r in rows)
  for r in rows:  # a window of the text, about the asked length once re-encoded
    assert r["prompt"].strip() in " ".join(words)
    assert abs(len(tok.encode(r["prompt"], add_special_tokens=False)) - 200) <= 2
  assert len({r["prompt"] for r in rows}) == 3


@pytest.mark.parametrize("argv,message", [
    (["--rates", "0"], "must be > 0"),
    (["--max-seconds", "0"], "must be > 0"),
    (["--model", "nope"], "model must be one of"),
    (["--guidellm", "/nonexistent/guidellm"], "--guidellm"),
    (["--text", "/nonexistent.txt"], "--text"),
])
def test_user_errors_exit_2(capsys, argv, message):
  assert serve_bench.main(argv) == 2
  assert message in capsys.readouterr().err


def test_summary_and_table_count_the_cut_off_requests(tmp_path):
  dist = lambda v: {"successful": {"mean": v, "percentiles": {"p50": v, "p99": 2 * v}}}
  gl = {"benchmarks": [{"metrics": {
      "request_totals": {"successful": 3, "incomplete": 2, "errored": 0, "total": 5},
      "output_tokens_per_second": dist(30.0), "requests_per_second": dist(0.1),
      "time_to_first_token_ms": dist(900.0), "inter_token_latency_ms": dist(40.0)}}]}
  window = [{"t": 10.0 + i, "rocketkv:num_requests_running": r, "rocketkv:kv_cache_usage_perc": u,
             "peak_rss_mb": 100.0 + i} for i, (r, u) in enumerate([(1, 0.1), (4, 0.5), (3, 0.4)])]
  before = {"rocketkv:generation_tokens_total": 10.0, "rocketkv:prefill_seconds_total": 1.0}
  after = {"rocketkv:generation_tokens_total": 110.0, "rocketkv:prefill_seconds_total": 1.5,
           "rocketkv:decode_seconds_total": 1.25, "rocketkv:num_preemptions_total": 2.0}
  row = serve_bench._summary(gl, window, before, after)
  assert (row["completed"], row["incomplete"], row["running_peak"]) == (3, 2, 4)
  assert row["running_mean"] == pytest.approx(8 / 3) and row["wall_s"] == 2.0
  assert row["gen_tok_s"] == 50.0 and row["ttft_p99_ms"] == 1800.0
  assert (row["prefill_s"], row["decode_s"], row["peak_rss_mb"]) == (0.5, 1.25, 102.0)
  assert (row["preempted"], row["recomputed_tokens"]) == (2.0, 0.0)
  table = serve_bench._write(str(tmp_path), "python3 benchmarks/serve_bench.py --x", [],
                             [dict(method="full", rate=0.05, slots=5.0, **row)])
  md = (tmp_path / "serve_bench.md").read_text()
  assert md.startswith("    python3 benchmarks/serve_bench.py --x\n") and md.endswith(table)
  assert "| full | 0.05 | 5 | 3 | 2 | 4 |" in table
  assert json.loads((tmp_path / "serve_bench.json").read_text())["rows"][0]["incomplete"] == 2


def test_late_half_is_the_windows_second_half():
  # 9 samples 1 s apart: the second half is t >= 4 (samples 4..8)
  window = [{"t": float(i), "rocketkv:num_requests_running": float(i),
             "rocketkv:kv_cache_usage_perc": i / 10, "rocketkv:generation_tokens_total": i * i,
             "rocketkv:num_preemptions_total": float(i >= 6)} for i in range(9)]
  late = serve_bench._late(window)
  assert late["running_mean_late"] == pytest.approx(6.0)
  assert late["kv_usage_mean_late"] == pytest.approx(0.6)
  assert late["gen_tok_s_late"] == pytest.approx((64 - 16) / 4)
  assert late["preempted_late"] == 1.0
  assert serve_bench._late(window[:3]) == {}


def test_ttft_over_every_request_sent_bounds_the_cut_off_ones():
  def req(start, first=None, end=None):
    return {"info": {"timings": {"request_start": start, "first_token_iteration": first,
                                 "resolve_end": end}}}
  # waits 2, 4, 6 s; two cut off after 3 s and 10 s without a first token
  gl = {"benchmarks": [{"requests": {
      "successful": [req(0.0, 2.0), req(10.0, 14.0)], "incomplete": [req(20.0, 26.0),
      req(30.0, None, 33.0), req(40.0, None, 50.0)], "errored": []}}]}
  row = serve_bench._ttft_all(gl)
  assert (row["sent"], row["no_first_token"]) == (5, 2)
  assert row["ttft_all_p50_lo_s"] == 4.0  # median of 2, 3, 4, 6, 10
  assert row["ttft_all_p50_hi_s"] == 6.0  # median of 2, 4, 6, inf, inf
  gl["benchmarks"][0]["requests"]["incomplete"].append(req(60.0, None, 61.0))
  assert serve_bench._ttft_all(gl)["ttft_all_p50_hi_s"] is None  # 2, 4, 6, inf x 3

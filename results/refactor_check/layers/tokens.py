"""Greedy tokens of every method spec on tiny Llama / Mistral / Gemma 3 and SmolLM2 (refactor check)."""
import json, sys, os
sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]
sys.path.insert(0, os.environ["PKG"])
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests"))
import numpy as np
import rocketkv_jax as rocketkv
print(rocketkv.__file__, file=sys.stderr)
from rocketkv_jax.eval import tasks, variants
import model_fixtures as mf
SPECS = ("full", "exact_topk", "snapkv", "quest", "sparq", "streamingllm", "rocketkv", "rocketkv_mt",
    "rocketkv:stage2=rerank", "rocketkv:stage2=lowrank", "rocketkv:stage2=quant",
    "rocketkv:stage2=quant,quant_capacity=equal_read,window_reduce=max,group_dims=normalized",
    "rocketkv:skip_layers=1")
out = {}
models = [("llama31", mf.hf_checkpoint("llama31")[0]), ("mistral_sw", mf.hf_checkpoint("mistral_sw")[0]), ("gemma3", mf.gemma3_checkpoint()[0])]
for name, path in models:
  model = rocketkv.models.load(path)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 256, size=n).tolist() for n in (150, 97)]
  for spec in SPECS:
    cfg = variants.rocket_config(spec, 64)
    res = rocketkv.generate(model, prompts, rocket_config=cfg, max_new_tokens=12, eos_token_ids=())
    out[f"{name}/{spec}"] = res.tokens
    print(name, spec, res.tokens[0][:6], file=sys.stderr, flush=True)
model = rocketkv.models.load(rocketkv.models.smollm2_path())
sample = tasks.make_sample(model.tokenizer, "niah_multikey", 1024, 0)
prompt = tasks.prompt_ids(model.tokenizer, sample)
for spec in SPECS:
  cfg = variants.rocket_config(spec, 64)
  res = rocketkv.generate(model, [prompt], rocket_config=cfg, max_new_tokens=12)
  out[f"smollm2/{spec}"] = res.tokens
  print("smollm2", spec, res.tokens[0][:6], file=sys.stderr, flush=True)
json.dump(out, open(os.environ["OUT"], "w"), indent=0)

"""decode ms per token of generate on SmolLM2 (2K prompt x 2, 32 new), full and rocketkv@256."""
import json, os, sys
sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]
sys.path.insert(0, os.environ["PKG"])
import rocketkv_jax as rocketkv
from rocketkv_jax.eval import tasks
model = rocketkv.models.load(rocketkv.models.smollm2_path())
s = tasks.make_sample(model.tokenizer, "niah_single", 2048, 0)
ids = tasks.prompt_ids(model.tokenizer, s)
out = {"pkg": rocketkv.__file__}
for m in ("full", "rocketkv"):
  for rep in range(2):
    r = rocketkv.generate(model, [ids, ids[:-100]], method=m, token_budget=256, max_new_tokens=33, eos_token_ids=())
  out[m] = r.stats["decode_ms_per_token"]
print(json.dumps(out), flush=True)

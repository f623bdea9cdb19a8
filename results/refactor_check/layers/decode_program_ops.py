import json, os, sys, re, hashlib
sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]
sys.path.insert(0, os.environ["PKG"])
import rocketkv_jax as rocketkv
try:
  from rocketkv_jax.runtime import generate as G
except ImportError:
  from rocketkv_jax import generate as G0; import importlib; G = importlib.import_module("rocketkv_jax.generate")
model = rocketkv.models.load(rocketkv.models.smollm2_path())
progs = G.ProgramCache()
r = rocketkv.generate(model, [[5]*2000, [6]*1900], method="rocketkv", token_budget=256, max_new_tokens=33, eos_token_ids=(), programs=progs)
for sig, ex in progs._exes.items():
  txt = ex.as_text()
  ops = re.findall(r"= \w+\[[^\]]*\][^ ]* (\w+)\(", txt)
  from collections import Counter
  c = Counter(ops)
  print(sig[0], len(txt), sum(c.values()), dict(c.most_common(8)))

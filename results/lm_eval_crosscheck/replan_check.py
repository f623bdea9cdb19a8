"""Re-decode the differing rocketkv samples with rocketkv.generate, planned as the harness plans
them (split of a prompt padded to 2048, passed as RocketConfig overrides)."""
import json, sys
import rocketkv_jax as rocketkv, rocketkv_jax.models as M
from rocketkv_jax.eval import harness, tasks as tasks_lib
rows = json.load(open(sys.argv[1]))["rows"]
diff = [r for r in rows if not r["same_text"]]
model = M.load(M.smollm2_path())
cfg = harness.SweepConfig(tasks=("niah_single",), context_lengths=(2048,), samples=10, seed=0, methods=("full",))
(ss, mn, p), = harness.build_samples(model, cfg).values()
hp = rocketkv.plan(rocketkv.RocketConfig(token_budget=256), p, mn, model.config.head_dim)
print("harness plan", p, mn, hp)
rc = rocketkv.RocketConfig(token_budget=256, capacity=hp.capacity, prompt_budget=hp.prompt_budget,
                           top_k=hp.top_k, chunk_size=hp.chunk_size, r=hp.r)
ids = [tasks_lib.prompt_ids(model.tokenizer, ss[r["index"]]) for r in diff]
print("lengths", [len(i) for i in ids])
res = rocketkv.generate(model, ids, rocket_config=rc, max_new_tokens=mn)
print("generate plan", res.stats["plan"])
for r, t in zip(diff, res.text):
  print(r["index"], repr(t), "== harness:", t == r["harness"])

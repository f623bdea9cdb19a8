#!/bin/bash
# Issue #38 item 1 (models as Flax NNX modules), side by side in one sitting: before = bd92033
# (the last commit before Model held an nnx module), after = main; each installed editable into
# its own venv:
#   git worktree add --detach /work/wt/before bd92033
#   python3 -m venv --system-site-packages /work/venvs/before
#   /work/venvs/before/bin/pip install --no-deps -e /work/wt/before
# (and the same for main as /work/venvs/main). Greedy tokens first, then decode speed in rounds
# alternating before / after so that load on the machine hits both alike.
out=$(cd "$(dirname "$0")" && pwd)
[ -f "$out/tokens_before_bd92033.json" ] || (cd /tmp && /work/venvs/before/bin/python \
    /work/wt/before/benchmarks/token_check.py --out "$out/tokens_before_bd92033.json")
[ -f "$out/tokens_after.json" ] || (cd /tmp && /work/venvs/main/bin/python \
    /work/main/benchmarks/token_check.py --out "$out/tokens_after.json")
diff "$out/tokens_before_bd92033.json" "$out/tokens_after.json" && echo "tokens identical"
for round in 1 2 3; do
  for side in before after; do
    if [ $side = before ]; then src=/work/wt/before; py=/work/venvs/before/bin/python
    else src=/work/main; py=/work/venvs/main/bin/python; fi
    echo "=== round $round $side end_to_end $(date +%T)"
    (cd /tmp && $py $src/benchmarks/end_to_end.py --lengths 4096 --budgets 256 \
        --no-transformers --dtypes float32 2>&1 | grep -v Warn)
  done
done

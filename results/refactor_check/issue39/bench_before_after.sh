#!/bin/bash
# Issue #39 item 5, side by side in one sitting: before = b0419af (the last commit before the
# issue's refactors), after = main; each installed editable into its own venv:
#   git worktree add --detach /work/wt/before b0419af
#   python3 -m venv --system-site-packages /work/venvs/before
#   /work/venvs/before/bin/pip install --no-deps -e /work/wt/before
# (and the same for main as /work/venvs/main). Runs alternate before / after so that load on
# the machine hits both alike.
for round in 1 2 3 4; do
  for side in before after; do
    if [ $side = before ]; then src=/work/wt/before; py=/work/venvs/before/bin/python
    else src=/work/main; py=/work/venvs/main/bin/python; fi
    echo "=== round $round $side end_to_end $(date +%T)"
    (cd /tmp && $py $src/benchmarks/end_to_end.py --lengths 4096 --budgets 256 \
        --no-transformers --dtypes float32 2>&1 | grep -v Warn)
  done
done

#!/bin/bash
# Issue #14, side by side in one sitting: before = f681e88 (the last commit before the
# registry), after = main at c57d5e6; each installed (not editable) into its own folder:
#   git worktree add /work/wt-before f681e88
#   pip install --no-deps --no-build-isolation --target /tmp/before_pkg /work/wt-before
#   pip install --no-deps --no-build-isolation --target /tmp/after_pkg .
# Runs alternate before / after so that load on the machine hits both alike.
cd /tmp/i14bench
for round in 1 2 3; do  # rounds 4-7: end_to_end only
  for side in before after; do
    if [ $side = before ]; then src=/work/wt-before; pkg=/tmp/before_pkg; dt=""; else src=/work/main; pkg=/tmp/after_pkg; dt="--dtypes float32"; fi
    echo "=== round $round $side decode_attention $(date +%T)"
    PYTHONPATH=$pkg python3 $src/benchmarks/decode_attention.py --contexts 32768 --budgets 256 2>&1 | grep -v Warn
    echo "=== round $round $side end_to_end $(date +%T)"
    PYTHONPATH=$pkg python3 $src/benchmarks/end_to_end.py --lengths 4096 --budgets 256 --no-transformers $dt 2>&1 | grep -v Warn
  done
done
echo "=== done $(date +%T)"

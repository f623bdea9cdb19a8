#!/usr/bin/env bash
# The prepared GPU session (docs/gpu.md "Next GPU session"): one command, under 10 minutes on
# one H200 once the machine is up. Each step has its own time limit and the steps run in order
# of value, so a slow step costs only the later ones. Writes everything under $OUT.
#   bash benchmarks/gpu_session.sh            # in the repository root, on the GPU machine
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results/gpu_session}"
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
py=python3
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; \
  $py -c "import jax; print('jax', jax.__version__, jax.devices())"; git log -1 --oneline; } \
  > "$OUT/env.txt" 2>&1
$py -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$OUT/pip.log" 2>&1
# 1. compiled kernels vs XLA: the fused stage 2 over 20 decode steps and inside generate (<= 100 s)
# (-P: the repo root off sys.path, so its kernels/ cannot shadow the `kernels` package transformers
# may import; Python >= 3.11, the H200 had 3.12)
JAX_PLATFORMS=cuda timeout 100 $py -P -m pytest -q -x -p no:cacheprovider tests/test_kernels.py \
  -k "decode_step or generate_with_pallas" > "$OUT/pytest.log" 2>&1
rc=$?; echo "pytest rc=$rc" >> "$OUT/rc.txt"
# compiled kernels that fail their checks must not cost the end-to-end rows: XLA path then
impl=auto; [ "$rc" -eq 0 ] || impl=xla
# 2. fused step: same slots, error, launches per call, us per call vs the chain and XLA (<= 100 s)
timeout 100 $py benchmarks/fused_step.py --deadline-s 70 --json "$OUT/fused_step.json" \
  > "$OUT/fused_step.log" 2>&1; echo "fused_step rc=$?" >> "$OUT/rc.txt"
# 3. end to end, Llama-3.1-8B shapes: rows in priority order until the deadline (<= 270 s)
timeout 270 $py benchmarks/gpu_e2e.py --deadline-s 200 --grace-s 60 --impl "$impl" --out "$OUT/gpu_e2e" \
  > "$OUT/gpu_e2e.log" 2>&1; echo "gpu_e2e rc=$?" >> "$OUT/rc.txt"
# 4. the per-kernel sweep at 32K (<= 90 s)
timeout 90 $py benchmarks/kernel_bench.py --checks e2e --lengths 32768 --budgets 256 1024 \
  --batches 1 4 --deadline-s 60 --json "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
echo "kernels rc=$?" >> "$OUT/rc.txt"
cat "$OUT/rc.txt"; tail -5 "$OUT/pytest.log"; tail -20 "$OUT/gpu_e2e/gpu_e2e.md" 2>/dev/null

#!/usr/bin/env bash
# One device call: the Triton R kernel tests, the kernel benchmark and the all-R vs all-P step
# comparison (issue 14), each stage's full log under $OUT. Usage: scripts/gpu-r-kernels.sh [stages]
# stages: any of tests,bench,sweep,profile,compare,matrix (default: tests,bench,compare).
set -u
STAGES=${1:-tests,bench,compare}
. "$(dirname "$0")/device_env.sh"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton",
    triton.__version__, torch.cuda.get_device_name(0))'
} 2>&1 | tee "$OUT/env.log"
if [[ $STAGES == *tests* ]]; then
  python3 -m pytest -q -p no:cacheprovider -p no:rlkernel_matrix -m gpu -rs --durations=12 \
    tests/workload/test_triton_kernels.py tests/workload/test_kernels.py 2>&1 | tee "$OUT/tests.log" \
    | tail -30
fi
if [[ $STAGES == *bench* ]]; then
  python3 -m pytest -q -p no:cacheprovider -p no:rlkernel_matrix -s --benchmark-only \
    --benchmark-columns=median,iqr,rounds benchmarks/test_kernels_bench.py 2>&1 \
    | tee "$OUT/kernel-bench.log"
fi
if [[ $STAGES == *sweep* ]]; then
  python3 benchmarks/matmul_configs.py 2>&1 | tee "$OUT/matmul-configs.log"
fi
if [[ $STAGES == *profile* ]]; then
  for c in R/R P/P; do
    python3 benchmarks/profile_step.py --case $c 2>&1 | tee "$OUT/profile-${c:0:1}.log" | tail -45
  done
fi
if [[ $STAGES == *compare* ]]; then
  python3 benchmarks/step_compare.py --out /tmp/cmp --configs "${CONFIGS:-R,P,P-eager}" 2>&1 \
    | tee "$OUT/step-compare.log"
  cp /tmp/cmp/summary.json "$OUT/step-compare.json" 2>/dev/null
  for c in /tmp/cmp/*/; do n=$(basename "$c"); grep -v "^$" "$c/run.log" | head -60 \
    > "$OUT/run-$n.log"; done
fi
if [[ $STAGES == *matrix* ]]; then
  python3 -m pytest -p pytest_rlkernel_matrix.plugin \
    --rlk-matrix=${MATRIX_TOML:-docs/examples/h200-r-kernels-matrix.toml} --rlk-hardware=h200 \
    --rlk-matrix-root=/tmp/matrix 2>&1 | tail -60 | tee "$OUT/matrix.log"
  cp /tmp/matrix/matrix-report.json "$OUT/" 2>/dev/null
fi
date -u

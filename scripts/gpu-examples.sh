#!/usr/bin/env bash
# One device call for this wave's H200 examples (issues 21-24), each stage's log under $OUT and
# each matrix root's small artifacts (no .pt sidecars) as one tar.gz.
# Usage: scripts/gpu-examples.sh [stages]; stages: any of tests,compare,profile,probe,example,steps,factors.
set -u
STAGES=${1:-tests,compare,probe}
. "$(dirname "$0")/device_env.sh"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem \
    --format=csv; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton",
    triton.__version__, torch.cuda.get_device_name(0))'
} 2>&1 | tee "$OUT/env.log"
matrix() {  # name toml extra-args...
  local name=$1 toml=$2; shift 2
  local t0=$SECONDS
  timeout -s INT "${MATRIX_TIMEOUT:-540}" python3 -m pytest -p pytest_rlkernel_matrix.plugin -p no:cacheprovider --rlk-matrix="$toml" \
    --rlk-hardware=h200 --rlk-matrix-root=/tmp/m-$name "$@" > "$OUT/$name.log" 2>&1
  echo "[$name] exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
  tail -40 "$OUT/$name.log"
  tar -C /tmp -czf "$OUT/$name-root.tar.gz" --exclude='*.pt' "m-$name" 2>/dev/null
}
if [[ $STAGES == *tests* ]]; then
  python3 -m pytest -q -p no:cacheprovider -p no:rlkernel_matrix -m gpu -rs --durations=8 \
    tests/workload/test_triton_kernels.py tests/workload/test_kernels.py \
    tests/workload/test_sampling.py tests/workload/test_native.py tests/test_probe.py 2>&1 | tee "$OUT/tests.log" | tail -15
fi
if [[ $STAGES == *compare* ]]; then
  python3 benchmarks/step_compare.py --out /tmp/cmp --configs "${CONFIGS:-R,P,P-unfused,R-sort}" \
    > "$OUT/step-compare.log" 2>&1; tail -14 "$OUT/step-compare.log"
  cp /tmp/cmp/summary.json "$OUT/step-compare.json" 2>/dev/null
fi
if [[ $STAGES == *profile* ]]; then  # PROFILE_ENV="RLK_REF_P_COMPILE=1 ..." picks P's routes
  env ${PROFILE_ENV:-} python3 benchmarks/profile_step.py --case "${PROFILE_CASE:-P/P}" \
    > "$OUT/profile.log" 2>&1; tail -45 "$OUT/profile.log"
fi
if [[ $STAGES == *probe* ]]; then
  matrix probe docs/examples/h200-probe-lite.toml --rlk-probe -k "attention and (R/R or P/R)"
fi
if [[ $STAGES == *example* ]]; then  # docs/examples/h200: the example report's matrix
  matrix h200 docs/examples/h200-matrix.toml
fi
if [[ $STAGES == *steps* ]]; then
  matrix steps docs/examples/h200-steps-matrix.toml -m rlk_baseline -k attention
fi
if [[ $STAGES == *factors* ]]; then
  matrix factors examples/factors.toml ${FACTORS_ARGS:-}  # e.g. FACTORS_ARGS="-k rollout_batch"
fi
date -u

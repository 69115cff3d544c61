#!/usr/bin/env bash
# Issue 36 on one H200 (one device call): the R backward's GPU tests, the per-module training
# profile (P, R with the Triton backward, R with the native recompute), the all-R vs all-P step
# in interleaved processes, and the 20-step run-to-run claims matrix. Each stage's log under $OUT.
# Usage: scripts/gpu-r-backward.sh [stages]; stages: any of tests,profile,compare,steps,quick20
# (quick20: the small preset's 20 steps twice, in parallel, judged by judge/steps.py).
set -u
STAGES=${1:-tests,profile,compare}
. "$(dirname "$0")/device_env.sh"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem \
    --format=csv; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton",
    triton.__version__, torch.cuda.get_device_name(0))'
} 2>&1 | tee "$OUT/env.log"
if [[ $STAGES == *tests* ]]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:rlkernel_matrix -m gpu -rs ${TESTS_K:+-k "$TESTS_K"} \
    --durations=6 tests/workload/test_triton_backward.py tests/workload/test_autograd.py \
    tests/workload/test_triton_kernels.py > "$OUT/tests.log" 2>&1; tail -12 "$OUT/tests.log"
fi
if [[ $STAGES == *profile* ]]; then
  timeout 150 python3 benchmarks/profile_train.py --impls production,rl_kernel,rl_kernel:recompute \
    --json "$OUT/profile-train.json" > "$OUT/profile-train.log" 2>&1
  grep -A18 "^| module" "$OUT/profile-train.log"
fi
if [[ $STAGES == *compare* ]]; then
  timeout ${COMPARE_TIMEOUT:-330} python3 benchmarks/step_compare.py --out /tmp/cmp \
    --configs "${CONFIGS:-R,P}" --rounds "${ROUNDS:-2}" --steps "${STEPS:-3}" \
    > "$OUT/step-compare.log" 2>&1; tail -22 "$OUT/step-compare.log"
  cp /tmp/cmp/summary.json "$OUT/step-compare.json" 2>/dev/null
fi
if [[ $STAGES == *quick20* ]]; then  # 20 steps twice (small preset, in parallel), judged
  for r in a b; do
    RL_KERNEL_MODE=audit RL_KERNEL_ARTIFACT_DIR=/tmp/q20-$r RL_KERNEL_RUN_ID=$r \
    RL_KERNEL_ATTENTION_CASE=R/R RL_KERNEL_FFN_CASE=R/R RL_KERNEL_LOGP_CASE=R/R \
      timeout 150 python3 -m pytest_rlkernel_matrix.workload --preset small --num-prompts 32 \
      --max-new-tokens 64 --lr 1e-5 --steps 20 > "$OUT/quick20-$r.log" 2>&1 &
  done
  wait
  python3 - <<'PY' 2>&1 | tee "$OUT/quick20.log"
import json
from pathlib import Path
from pytest_rlkernel_matrix.judge.steps import compare_runs, read_steps
a, b = Path("/tmp/q20-a"), Path("/tmp/q20-b")
st = read_steps(a)
print("steps", len(st.series), "versions", len(st.weights))
print("backward", json.loads((a / "manifest.json").read_text())["learning"]["backward_method"])
for c in (st.bitwise_claim(), st.weights_claim(), compare_runs(a, b)):
    print(c)
PY
fi
if [[ $STAGES == *steps* ]] && [[ $STAGES != *quick20* ]]; then
  t0=$SECONDS
  timeout -s INT 560 python3 -m pytest -p pytest_rlkernel_matrix.plugin -p no:cacheprovider \
    --rlk-matrix=docs/examples/h200-steps-matrix.toml --rlk-hardware=h200 \
    --rlk-matrix-root=/tmp/m-steps -m rlk_baseline -k attention > "$OUT/steps.log" 2>&1
  echo "[steps] exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/steps.log"; tail -12 "$OUT/steps.log"
  tar -C /tmp -czf "$OUT/steps-root.tar.gz" --exclude='*.pt' m-steps 2>/dev/null
fi
date -u

#!/usr/bin/env bash
# Wave 9 on one H200 (one device call): issue 33's ffn row with three processes per cell and a
# profile run of each cell (docs/examples/h200-perf-matrix.toml; stopped with SIGINT at
# ROW_TIMEOUT, the report keeps what ran), then issue 36's 20 steps twice with the Triton
# backward and AdamW (run-to-run and train/rollout bitwise judged).
set -u
. "$(dirname "$0")/device_env.sh"
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv; } 2>&1 | tee "$OUT/env.log"
t0=$SECONDS
timeout -s INT ${ROW_TIMEOUT:-400} python3 -m pytest -p pytest_rlkernel_matrix.plugin \
  -p no:cacheprovider --rlk-matrix=docs/examples/h200-perf-matrix.toml --rlk-hardware=h200 \
  --rlk-matrix-root=/tmp/m-perf --rlk-profile -k ffn > "$OUT/perf-row.log" 2>&1
echo "[perf-row] exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/perf-row.log"
grep -E "^(h200|verdicts|claims|profile)|performance:|profile," "$OUT/perf-row.log" | cut -c1-900
cp /tmp/m-perf/matrix-report.json "$OUT/perf-matrix-report.json" 2>/dev/null
cp /tmp/m-perf/matrix-report.html "$OUT/perf-matrix-report.html" 2>/dev/null
STAGES=quick20 bash scripts/gpu-r-backward.sh quick20 > /dev/null 2>&1
cat "$OUT/quick20.log"
date -u

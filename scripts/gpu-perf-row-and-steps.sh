#!/usr/bin/env bash
# Wave 10 on one H200, two device calls (each under the 600 s a call may run):
#   perf:  issue 33's ffn row with three processes per cell (1 correctness + 2 measured runs,
#          interleaved) and profile runs of ffn R/R and P/P (docs/examples/h200-perf-matrix.toml);
#   steps: issue 36's qwen3-0.6b 20-step claims matrix (docs/examples/h200-steps-matrix.toml,
#          run twice), then the profile runs of attention R/R and P/P (one process per cell).
# A stage stopped with SIGINT at its timeout keeps what ran in its report. Usage:
#   bash scripts/gpu-perf-row-and-steps.sh perf|steps
set -u
. "$(dirname "$0")/device_env.sh"
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv; } 2>&1 \
  | tee "$OUT/env.log"
matrix() {  # name timeout matrix-file extra pytest args...
  local name=$1 limit=$2 file=$3 t0=$SECONDS; shift 3
  timeout -s INT "$limit" python3 -m pytest -p pytest_rlkernel_matrix.plugin -p no:cacheprovider \
    --rlk-matrix="$file" --rlk-hardware=h200 --rlk-matrix-root="/tmp/m-$name" "$@" \
    > "$OUT/$name.log" 2>&1
  echo "[$name] exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
  grep -E "^(h200 |verdicts|claims|profile)|performance|unattributed" "$OUT/$name.log" | cut -c1-600
  cp "/tmp/m-$name/matrix-report.json" "$OUT/$name-matrix-report.json" 2>/dev/null
  cp "/tmp/m-$name/matrix-report.html" "$OUT/$name-matrix-report.html" 2>/dev/null
}
case ${1:-perf} in
  perf) matrix perf "${ROW_TIMEOUT:-540}" docs/examples/h200-perf-matrix.toml --rlk-profile -k ffn ;;
  steps)
    matrix steps "${STEPS_TIMEOUT:-400}" docs/examples/h200-steps-matrix.toml -m rlk_baseline \
      -k attention
    matrix attn "${ATTN_TIMEOUT:-170}" docs/examples/h200-perf-matrix.toml --rlk-profile \
      --rlk-processes=1 -k "attention[R/R] or attention[P/P]" ;;
esac
date -u

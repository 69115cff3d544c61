#!/usr/bin/env bash
# Issue 52 on one GPU (H200): the ffn row of docs/examples/h200-perf-matrix.toml with
# --rlk-processes=auto --rlk-perf-budget=8 for (a) no drill, (b) RLK_REF_FAULT=slow:ffn:rollout:1.5,
# (c) RLK_REF_FAULT=slow:ffn:rollout:4, and the drill's true rollout-phase ratio measured directly
# (benchmarks/bench_drill_ratio.py: the all-R cell's processes with factors 1, 1.5 and 4,
# interleaved). One device call per stage (each under the 600 s a call may run), in this order
# on one warm machine (the compile caches live in ./.device/, kept between calls while warm):
#   bash scripts/gpu-perf-drill.sh warm     # fills the inductor/triton caches (R/R and P/P)
#   bash scripts/gpu-perf-drill.sh truth    # the drill's true ratio per factor
#   bash scripts/gpu-perf-drill.sh a        # no drill
#   bash scripts/gpu-perf-drill.sh b        # slow:ffn:rollout:1.5
#   bash scripts/gpu-perf-drill.sh c        # slow:ffn:rollout:4
# Every process of a session shares the caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, the
# FX graph and autograd caches), so a process after the first costs little more than its steps;
# no profile or probe run is asked for (--rlk-profile / --rlk-probe off), so no debug work runs
# in a measured process. A session stopped with SIGINT at its timeout keeps what ran in its
# report. HW=h100 runs docs/examples/h100-perf-matrix.toml; PERF_BUDGET (default 8) and
# FACTORS (default "1 1.5 4") as named. Outputs under $OUT: <stage>.log, <stage>-matrix-report.json/.html, truth.md, env.log.
set -u
. "$(dirname "$0")/device_env.sh"
CACHE=$PWD/.device/compile-cache
mkdir -p "$CACHE"
export TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor TRITON_CACHE_DIR=$CACHE/triton \
  TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
ROW="--preset qwen3-0.6b --num-prompts 128 --max-new-tokens 64"  # the matrix file's command
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee -a "$OUT/env.log"
session() {  # name drill-or-empty
  local name=$1 drill=$2 t0=$SECONDS
  env ${drill:+RLK_REF_FAULT=$drill} timeout -s INT "${SESSION_TIMEOUT:-580}" \
    python3 -m pytest -p pytest_rlkernel_matrix.plugin -p no:cacheprovider \
    --rlk-matrix="docs/examples/${HW:-h200}-perf-matrix.toml" --rlk-hardware="${HW:-h200}" \
    --rlk-matrix-root="/tmp/m-$name" --rlk-processes=auto --rlk-perf-budget="${PERF_BUDGET:-8}" -k ffn \
    > "$OUT/$name.log" 2>&1
  echo "[$name] exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
  grep -E "^(h200 |verdicts)|rlk: auto|performance|refused|remedy|R on the" "$OUT/$name.log" \
    | cut -c1-400
  cp "/tmp/m-$name/matrix-report.json" "$OUT/$name-matrix-report.json" 2>/dev/null
  cp "/tmp/m-$name/matrix-report.html" "$OUT/$name-matrix-report.html" 2>/dev/null
}
warm() {  # one short process per side's implementation: R's kernels and P's compiled decode
  local case
  for case in R/R P/P; do
    t0=$SECONDS
    RL_KERNEL_ARTIFACT_DIR=/tmp/rlk-warm-${case/\//} RL_KERNEL_ATTENTION_CASE=$case \
      RL_KERNEL_FFN_CASE=$case RL_KERNEL_LOGP_CASE=$case \
      python3 -m pytest_rlkernel_matrix.workload $ROW --device cuda --steps 2 \
      > "$OUT/warm-${case/\//}.log" 2>&1
    echo "[warm $case] exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/env.log"
  done
}
case ${1:-a} in
  warm) warm ;;
  truth)
    timeout -s INT "${TRUTH_TIMEOUT:-580}" python3 benchmarks/bench_drill_ratio.py \
      --device cuda --preset qwen3-0.6b --rounds "${ROUNDS:-3}" --factors ${FACTORS:-1 1.5 4} --steps 6 \
      --threads 4 -- --num-prompts 128 --max-new-tokens 64 2>&1 | tee "$OUT/truth.md" ;;
  a) session a-no-drill "" ;;
  b) session b-slow-1.5 slow:ffn:rollout:1.5 ;;
  c) session c-slow-4 slow:ffn:rollout:4 ;;
  *) echo "usage: $0 warm|truth|a|b|c" >&2; exit 2 ;;
esac
date -u

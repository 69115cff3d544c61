#!/usr/bin/env bash
# One device call for issue 21's probe on an H200: the GPU probe tests (the Triton R path taps
# every operator; R/R bitwise; the drill named first), then the attention R/R and P/R cells of
# docs/examples/h200-probe-lite.toml with --rlk-probe. Under $OUT (8 files, flat): env.log,
# tests.log, matrix.log, matrix-report.json, matrix-report.html, preflight.json,
# pr-localisation.json and pr-probe-run.log (the P/R probe run's log tail).
# Usage: scripts/gpu-probe.sh [stages]   stages: any of tests,matrix (default: tests,matrix).
# PROBE_MATRIX / PROBE_HARDWARE run another matrix (e.g. a cpu-backend variant as a CPU check).
set -u
STAGES=${1:-tests,matrix}
MATRIX=${PROBE_MATRIX:-docs/examples/h200-probe-lite.toml}
HW=${PROBE_HARDWARE:-h200}
ROOT=${PROBE_ROOT:-/tmp/rlk-probe-matrix-$(date -u +%Y%m%dT%H%M%S)}  # a fresh root every call
. "$(dirname "$0")/device_env.sh"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv 2>/dev/null || echo "no nvidia-smi"
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
  python3 -c 'import triton; print("triton", triton.__version__)' 2>/dev/null || echo "no triton"
} 2>&1 | tee "$OUT/env.log"
if [[ $STAGES == *tests* ]]; then
  python3 -m pytest -q -p no:cacheprovider -p no:rlkernel_matrix -m gpu -rs --durations=12 \
    tests/test_probe.py tests/workload/test_triton_kernels.py 2>&1 | tee "$OUT/tests.log" \
    | tail -30
fi
if [[ $STAGES == *matrix* ]]; then
  # The plugin by its entry point where it is installed, else by module (PYTHONPATH checkout).
  PLUGIN=(-p pytest_rlkernel_matrix.plugin)
  python3 -c 'import importlib.metadata as m, sys; sys.exit(not any(e.name == "rlkernel_matrix"
    for e in m.entry_points(group="pytest11")))' 2>/dev/null && PLUGIN=()
  python3 -m pytest "${PLUGIN[@]}" -p no:cacheprovider --rlk-matrix="$MATRIX" \
    --rlk-hardware="$HW" --rlk-probe --rlk-matrix-root="$ROOT" -k "attention and (R/R or P/R)" \
    2>&1 | tee "$OUT/matrix.log" | tail -40
  for f in matrix-report.json matrix-report.html preflight.json; do
    cp "$ROOT/$f" "$OUT/" 2>/dev/null || echo "no $f under $ROOT" | tee -a "$OUT/matrix.log"
  done
  pr=$(ls -d "$ROOT/$HW"/attention-pr/probe* 2>/dev/null | sort -V | tail -1)
  if [[ -n $pr ]]; then
    cp "$pr/localisation.json" "$OUT/pr-localisation.json" 2>/dev/null
    tail -120 "$pr/run.log" > "$OUT/pr-probe-run.log" 2>/dev/null
  else
    echo "no probe run under $ROOT/$HW/attention-pr" | tee -a "$OUT/matrix.log"
    cp "$ROOT/$HW/attention-pr/probe-note.json" "$OUT/pr-localisation.json" 2>/dev/null
  fi
fi
date -u

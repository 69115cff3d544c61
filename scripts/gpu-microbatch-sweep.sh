#!/usr/bin/env bash
# Issue 55 on one GPU (one device call per stage list): R's training cost per token against the
# micro-batch, per kernel, and probes of the suspects; the long-length decode's kernels; the
# issue's table. Each stage's full log under $OUT. Usage: scripts/gpu-microbatch-sweep.sh [stages]
# stages: any of sweep,before,probe,decode,tests,lengths (default: sweep,before,lengths).
# The device tool runs the session's main checkout: merge first.
#
# One device call is 600 s at most. The defaults fit it: sweep 140 s + before 110 s + lengths
# 280 s = 530 s (the 2026-12-06 H100 call: the sweep and the before finished inside 140 s and
# 110 s; bench_lengths at 160 and 1,024 new tokens took 205 s of process wall time, and 4,096 did
# not fit after them). So the lengths stage runs 160 and 1,024 by default; 4,096 goes in a call
# of its own:   LENGTHS=4096:32 scripts/gpu-microbatch-sweep.sh lengths
# Environment: LENGTHS (new:prompts,...), SWEEP_TIMEOUT, BEFORE_TIMEOUT, LENGTHS_TIMEOUT,
# TESTS_TIMEOUT (seconds), SIZES, KERNELS, TOKENS, ROUNDS, STEPS. A warning is printed when the
# chosen stages' timeouts add up to more than 560 s.
set -u
STAGES=${1:-sweep,before,lengths}
SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-140} BEFORE_TIMEOUT=${BEFORE_TIMEOUT:-110}
LENGTHS_TIMEOUT=${LENGTHS_TIMEOUT:-280} TESTS_TIMEOUT=${TESTS_TIMEOUT:-150}
LENGTHS=${LENGTHS:-160:448,1024:128}
budget=0
[[ $STAGES == *sweep* ]] && budget=$((budget + SWEEP_TIMEOUT))
[[ $STAGES == *before* ]] && budget=$((budget + BEFORE_TIMEOUT))
[[ $STAGES == *probe* ]] && budget=$((budget + 120))
[[ $STAGES == *decode* ]] && budget=$((budget + 180))
[[ $STAGES == *tests* ]] && budget=$((budget + TESTS_TIMEOUT))
[[ $STAGES == *lengths* ]] && budget=$((budget + LENGTHS_TIMEOUT))
if ((budget > 560)); then
  echo "[gpu-microbatch-sweep] warning: the stages' timeouts add up to ${budget} s, over 560 s: one 600 s" \
    "device call may end before the last stage does; split the stages over calls" >&2
fi
. "$(dirname "$0")/device_env.sh"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total \
    --format=csv; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton",
    triton.__version__, torch.cuda.get_device_name(0))'
} 2>&1 | tee "$OUT/env.log"
if [[ $STAGES == *sweep* ]]; then
  timeout "$SWEEP_TIMEOUT" python3 benchmarks/profile_microbatch.py --out "$OUT/mb" \
    --sizes "${SIZES:-160:8,16,32,44,64;1024:2,4,8,12;4096:1,2,3}" \
    --kernels "${KERNELS:-160:32,44;4096:1,2}" --tokens "${TOKENS:-17000}" \
    > "$OUT/mb.log" 2>&1; echo "[sweep] exit $?"; grep -A200 "^| new tokens" "$OUT/mb.log" | head -90
fi
if [[ $STAGES == *before* ]]; then  # the same sweep, R's weight gradients unpadded (before)
  timeout "$BEFORE_TIMEOUT" python3 benchmarks/profile_microbatch.py --out "$OUT/mb-before" \
    --sides R --unpadded-dw --sizes "${SIZES:-160:8,16,32,44,64;1024:2,4,8,12;4096:1,2,3}" \
    --kernels "${KERNELS:-160:32,44;4096:1,2}" --tokens "${TOKENS:-17000}" \
    > "$OUT/mb-before.log" 2>&1; echo "[before] exit $?"; grep -A200 "^| new tokens" "$OUT/mb-before.log" | head -60
fi
if [[ $STAGES == *probe* ]]; then
  for p in "--r-chunk 1024" "--no-fill"; do
    n=$(echo $p | tr -d ' -')
    timeout 60 python3 benchmarks/profile_microbatch.py --sides R --lengths 160:448 \
      --sizes 160:32,44 --kernels "" --tokens 17000 $p --out "$OUT/probe-$n" \
      > "$OUT/probe-$n.log" 2>&1; echo "[probe $p] exit $?"; grep -A4 "^| new tokens" "$OUT/probe-$n.log"
  done
fi
if [[ $STAGES == *decode* ]]; then
  for c in R/R P/P; do
    timeout 90 python3 benchmarks/profile_decode.py --case $c --batch 32 --filled 4000 \
      --max-seq 4128 --top 12 $([[ $c == R/R ]] && echo --attn-sweep) \
      > "$OUT/decode-${c:0:1}.log" 2>&1; echo "[decode $c] exit $?"
    grep -E "decode attention|R triton|flash varlen|P triton \(64, 4, 2, 1\)|^graph replay|whole step|ms of kernels" "$OUT/decode-${c:0:1}.log" | head -14
  done
fi
if [[ $STAGES == *tests* ]]; then
  timeout "$TESTS_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -p no:rlkernel_matrix -m gpu -rs \
    tests/workload/test_triton_kernels.py tests/workload/test_triton_backward.py \
    > "$OUT/tests.log" 2>&1; echo "[tests] exit $?"; tail -6 "$OUT/tests.log"
fi
if [[ $STAGES == *lengths* ]]; then  # a fresh folder: bench_lengths never overwrites one
  lengths_dir=$(mktemp -d /tmp/lengths.XXXXXX)
  timeout "$LENGTHS_TIMEOUT" python3 benchmarks/bench_lengths.py --out "$lengths_dir" \
    --lengths "$LENGTHS" --rounds "${ROUNDS:-1}" --steps "${STEPS:-3}" > "$OUT/lengths.log" 2>&1
  echo "[lengths $LENGTHS] exit $?"; tail -8 "$OUT/lengths.log"
  cp "$lengths_dir/summary.json" "$OUT/lengths.json" 2>/dev/null
  for d in "$lengths_dir"/*/; do
    [[ -f $d/run.log ]] || continue
    grep -E "micro|perf/(train|rollout|step)_time" "$d/run.log" | head -20 > "$OUT/run-$(basename "$d").log"
  done
fi
date -u

#!/usr/bin/env bash
# The 2-GPU figures of docs/benchmarks.md (multi-rank section), in one command on nvidia-h200-x2.
# Needs pydantic wheels under .whl (the device image lacks them). Results: $OUT/results.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHON_BIN=python3 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
R=/tmp/rlk; mkdir -p $R
P="python3 -m pytest -p pytest_rlkernel_matrix.plugin -p no:cacheprovider -q"
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee $R/gpus.txt
t0=$(date +%s.%N); $P --rlk-matrix=docs/examples/h200x2-1gpu.toml --rlk-matrix-root=$R/n0 -n 0 > $R/n0.log 2>&1; t1=$(date +%s.%N)
$P --rlk-matrix=docs/examples/h200x2-1gpu.toml --rlk-matrix-root=$R/n2 -n 2 > $R/n2.log 2>&1; t2=$(date +%s.%N)
echo "n0_wall $(python3 -c "print(round($t1-$t0,2))") n2_wall $(python3 -c "print(round($t2-$t1,2))")" | tee $R/walls.txt
for t in tp2 cp2; do
  s=$(date +%s.%N); $P --rlk-matrix=docs/examples/h200x2-$t.toml --rlk-matrix-root=$R/$t -k "attention and R/R" > $R/$t.log 2>&1; e=$(date +%s.%N)
  echo "${t}_wall $(python3 -c "print(round($e-$s,2))")" | tee -a $R/walls.txt
done
cd /tmp && tar czf $OUT/results.tgz --exclude='*.pt' rlk && ls -la $OUT
tail -n 25 $R/*.log

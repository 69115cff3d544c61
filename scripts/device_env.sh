# Sourced by the scripts/gpu-*.sh device calls: $OUT, the environment the plugin and the
# reference workload need on the GPU image, and pydantic from carried wheels (.whl, absent from
# that image; docs/examples/README.md says how they are fetched).
OUT=${OUT:-/tmp/rlk-out}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHON_BIN=${PYTHON_BIN:-python3}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

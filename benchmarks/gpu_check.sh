#!/usr/bin/env bash
# Every GPU test and GPU benchmark, in under 8 minutes on one H200; results in $OUT (or ./gpu-results).
#   bash benchmarks/gpu_check.sh
# Installs what it needs into .venv-gpu (torch with CUDA, CuPy, NIXL, the package) unless
# TRANSPORT_GPU_PYTHON names a Python that has them.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-gpu-results}
mkdir -p "$RESULTS"
PY=${TRANSPORT_GPU_PYTHON:-}
if [ -z "$PY" ]; then
    python3 -m venv .venv-gpu
    .venv-gpu/bin/pip install -q torch cupy-cuda13x nixl-cu13 msgpack redis pytest pytest-timeout hypothesis \
        >"$RESULTS/install.log" 2>&1 || { echo "gpu_check: install failed (see install.log)"; exit 2; }
    .venv-gpu/bin/pip install -q -e . --no-deps >>"$RESULTS/install.log" 2>&1
    PY=.venv-gpu/bin/python
fi
export PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR
"$PY" -c 'import torch, cupy; print("gpu_check:", torch.__version__, torch.cuda.get_device_name(), "cupy", cupy.__version__)' \
    | tee "$RESULTS/summary.txt"
timeout 300 "$PY" -m pytest tests/gpu tests/core/test_stream.py -q -p no:cacheprovider -rs 2>&1 \
    | tee "$RESULTS/gpu-tests.txt" | tail -20
tests=${PIPESTATUS[0]}
timeout 200 "$PY" benchmarks/gpu_bench.py --json "$RESULTS/gpu-bench.json" 2>&1 | tee -a "$RESULTS/summary.txt"
bench=${PIPESTATUS[0]}
# lanes on a host with more cores (host memory; 4 lanes is the default at 8+ cores)
timeout 60 "$PY" -m transport.cli bench put --sizes 4K,1G --op write --baselines raw,memcpy --lanes 4,2,1 --budget 0.5 \
    --batch none --no-progress --json "$RESULTS/lanes.json" 2>&1 | tail -25 | tee -a "$RESULTS/summary.txt"
echo "gpu_check: tests exit $tests, bench exit $bench" | tee -a "$RESULTS/summary.txt"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]

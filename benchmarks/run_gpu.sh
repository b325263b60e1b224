#!/usr/bin/env bash
# Runs the GPU tests and the GPU benchmark of the Pallas block-sparse kernels on a CUDA machine
# (the device tool's H100 or H200: `run` with command `bash benchmarks/run_gpu.sh`). Logs go to $OUT (or
# ./gpu_logs), the benchmark table to $OUT/gpu_block_sparse.md.
#
#   bash benchmarks/run_gpu.sh            # tests, then the table (default configs) + torch BSR
#   bash benchmarks/run_gpu.sh tests      # only the GPU tests
#   bash benchmarks/run_gpu.sh bench ARGS # only the benchmark, with its ARGS (e.g. --sweep --breakdown)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_logs}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
what="${1:-all}"
[ $# -gt 0 ] && shift

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
"$py" -c 'import jax; print("jax", jax.__version__, jax.devices())' | tee -a "$out/gpu.txt"

status=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  "$py" -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/test_pallas_block_sparse.py \
    2>&1 | tee "$out/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "$what" = all ]; then
  set -- --table --torch
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  "$py" benchmarks/gpu_block_sparse.py "$@" --out "$out/gpu_block_sparse.md" 2>&1 | tee "$out/gpu_bench.log"
  status=$(( status || PIPESTATUS[0] ))
fi
exit "$status"

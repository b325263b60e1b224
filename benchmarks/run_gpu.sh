#!/usr/bin/env bash
# Runs the GPU tests (block-sparse, N:M, cuSPARSELt, CUDA kernels, grad of grad; then every cell of the composition
# matrix, tests/test_composition.py, on the GPU's kernels) and the block-sparse GPU benchmark
# on a CUDA machine (the device tool's H100 or H200: `run` with command `bash benchmarks/run_gpu.sh`). Logs go to
# $OUT (or ./gpu_logs), the benchmark table to $OUT/gpu_block_sparse.md.
#
#   bash benchmarks/run_gpu.sh            # tests, then the table (default configs) + torch BSR
#   bash benchmarks/run_gpu.sh tests      # only the GPU tests
#   bash benchmarks/run_gpu.sh tests ARGS # only the GPU tests: ARGS are test files and pytest options (--shard, -k)
#   bash benchmarks/run_gpu.sh composition # only the composition matrix's cells
#   bash benchmarks/run_gpu.sh bench ARGS # only the benchmark, with its ARGS (e.g. --sweep --mosaic-sweep)
#
# The whole set of tests does not fit one 10-minute device call (2026-11-27, H100, 15 workers: 140 of the 144 GPU
# tests of test_pallas_block_sparse.py in 560 s; 107 of the 116 of its sdd_mgpu / nm / cusparselt / higher_order
# files in 280 s). Split it over calls with `--shard I/N` (conftest.py: every N-th test from the I-th, by node id):
#   bash benchmarks/run_gpu.sh tests --shard 1/3     # then 2/3 and 3/3, one call each; then `composition`
# (2026-11-27, H100, 15 workers: 166 + 162 + 165 tests in 375-425 s a shard; the composition cells in 87 s.)
#
# TEST_TIMEOUT / BENCH_TIMEOUT (seconds) bound each part so that a device call keeps the logs of both;
# the tests run in PYTEST_WORKERS processes (pytest-xdist, if installed): compiling dominates them.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_logs}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false
py="${PYTHON:-python3}"
what="${1:-all}"
[ $# -gt 0 ] && shift
nargs=$#
case "$what" in
  all | tests | composition | bench) ;;
  *) echo "run_gpu.sh: unknown part '$what' (all, tests, composition or bench)" >&2; exit 2 ;;
esac

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
"$py" -c 'import jax; print("jax", jax.__version__, jax.devices())' | tee -a "$out/gpu.txt"

status=0
workers=()
if "$py" -c 'import xdist' 2>/dev/null; then workers=(-n "${PYTEST_WORKERS:-4}"); fi
if [ "$what" = all ] || [ "$what" = tests ]; then
  files=(tests/test_pallas_block_sparse.py tests/test_pallas_block_sparse_sdd_mgpu.py tests/test_pallas_nm.py
    tests/test_cusparselt.py tests/test_cuda_kernels.py tests/test_higher_order.py tests/test_tuning.py)
  # ARGS: test files replace the list above; options (`--shard 1/3`, `-k ...`) go to pytest with it.
  given=() opts=()
  while [ "$what" = tests ] && [ $# -gt 0 ]; do
    case "$1" in
      --shard | -k) opts+=("$1" "$2"); shift 2 ;;
      -*) opts+=("$1"); shift ;;
      *) given+=("$1"); shift ;;
    esac
  done
  [ ${#given[@]} -gt 0 ] && files=("${given[@]}")
  timeout "${TEST_TIMEOUT:-3600}" "$py" -m pytest -q -m gpu -p no:cacheprovider -o addopts="" "${workers[@]}" \
    "${opts[@]}" "${files[@]}" 2>&1 | tee "$out/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
# The composition matrix's cells (tests/test_composition.py) on the GPU's kernels: with the whole set of tests, or
# alone.
if { [ "$what" != bench ] && [ "$nargs" -eq 0 ]; } || [ "$what" = composition ]; then
  timeout "${TEST_TIMEOUT:-3600}" "$py" -m pytest -q -p no:cacheprovider -o addopts="" "${workers[@]}" \
    tests/test_composition.py 2>&1 | tee "$out/gpu_composition.log"
  status=$(( status || PIPESTATUS[0] ))
fi
if [ "$what" = all ]; then
  set -- --table --torch
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  timeout "${BENCH_TIMEOUT:-3600}" "$py" benchmarks/gpu_block_sparse.py "$@" --out "$out/gpu_block_sparse.md" 2>&1 \
    | grep -v "Triton backend is deprecated\|warnings.warn" | tee "$out/gpu_bench.log"
  status=$(( status || PIPESTATUS[0] ))
fi
exit "$status"

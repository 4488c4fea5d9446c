#!/usr/bin/env bash
# The GPU host job (docs/gpu.md): conformance + golden + CUDA graphs + torch.compile on CUDA,
# `check --device cuda`, and the benchmark.  Results go to $OUT (default ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export DSV41_CACHE_DIR=${DSV41_CACHE_DIR:-/tmp/dsv41-cache}
if [[ -f .device/vllm-sm90.tar.xz ]]; then export DSV41_VECTORS=$PWD/.device/vllm-sm90.tar.xz; fi
if ! python -m pip install -q --no-deps --no-build-isolation . > "$OUT/install.txt" 2>&1; then
  # no usable setuptools there: lay the package out as an install would
  rm -rf /tmp/dsv41-src && mkdir -p /tmp/dsv41-src && cp -r dsv41 /tmp/dsv41-src/ && cp -r backends /tmp/dsv41-src/dsv41/backends
  export PYTHONPATH=/tmp/dsv41-src${PYTHONPATH:+:$PYTHONPATH}
  echo "pip install failed; using PYTHONPATH=/tmp/dsv41-src" >> "$OUT/install.txt"
fi
# python -P: import the installed package, not the checkout (backends/ installs as dsv41.backends)
python -P -m dsv41 info --json > "$OUT/info.json" 2> "$OUT/info.err"
python -P -m pytest -q -p no:cacheprovider -m "not slow" tests/test_conformance.py tests/test_golden.py tests/test_gpu.py \
  ${GPU_PYTEST_ARGS:-} > "$OUT/pytest.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/pytest.txt"
python -P -m dsv41 check --device cuda --all > "$OUT/check.txt" 2>&1; echo "check rc=$?" >> "$OUT/check.txt"
if [[ -z "${SKIP_BENCH:-}" ]]; then
  python -P -m dsv41 bench --device cuda ${BENCH_ARGS:-} --json "$OUT/bench.json" --plot "$OUT/bench.png" > "$OUT/bench.txt" 2> "$OUT/bench.err"
  echo "bench rc=$?" >> "$OUT/bench.txt"
fi
tail -3 "$OUT/pytest.txt"; tail -2 "$OUT/check.txt"; tail -40 "$OUT/bench.txt" 2>/dev/null

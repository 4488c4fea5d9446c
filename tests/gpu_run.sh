#!/usr/bin/env bash
# The GPU host job (docs/gpu.md).  Results go to $OUT (default ./gpu-out).
#
#   STEPS   which steps, in order (default: "tests check bench sanitize"):
#     tests     conformance matrix, golden vectors, CUDA graphs, torch.compile, interchange
#               and the hypothesis profile for every CUDA implementation (cuda:triton,
#               cuda:cutedsl, and the rocm / xpu Triton kernels run natively: rocm@cuda,
#               xpu@cuda)
#     check     python -m dsv41 check --device cuda --all
#     bench     python -m dsv41 bench --device cuda (BENCH_ARGS adds arguments)
#     sweep     launch-shape sweep of the Triton kernels (python -m dsv41.backends.triton.sweep)
#     profile   Nsight Compute sections of one call per CUDA implementation (PROFILE_ARGS)
#     sanitize  compute-sanitizer memcheck and racecheck over the conformance and fuzz inputs
#     hostile   the hostile-index matrix (tests/hostile.py: every op x index argument x
#               out-of-range value) for every CUDA implementation under compute-sanitizer
#               memcheck, one process per implementation (HOSTILE_IMPLS narrows)
#     baseline  the current code against an earlier commit's, benched in turn on this machine
#               (docs/performance.md "Against the last table"): BASELINE_ARCHIVE (default
#               .device/baseline.txz) is `git archive REV dsv41 backends pyproject.toml
#               README.md | xz`, carried to the host; BASELINE_RUNS the order of the runs
#               (default "new old new old"); BENCH_ARGS the bench's arguments (e.g.
#               "--no-reference --tokens 1 8 64 --op fused_indexer_q_rope_quant"); the rows
#               compared by tools/bench_compare.py in baseline-compare.txt
#     vllm      vLLM 0.33.0's own DeepSeek V4/V4.1 kernels and the dsv41 ops its plugin routes
#               to, side by side through the same vLLM names: bytes and time
#               (tests/vllm_gpu/side_by_side.py; needs .device/vllm033-ops.tar.xz from
#               tools/vllm_gpu_pack.sh, carried to the host; VLLM_OPS_ARCHIVE names another;
#               VLLM_SBS_ARGS adds arguments, e.g. "--tokens 1 64 --only gather")
#   STEP_LIMIT  seconds per step before it is stopped (default 540)
#   PACK    a file: when the job ends, everything under $OUT also goes into this one gzipped
#           tar (a device call brings back at most eight files of its output folder: run with
#           OUT outside that folder and PACK inside it: PACK=$OUT/r.tgz OUT=/tmp/gpu-out bash ...,
#           PACK first so that it reads the device's OUT)
#   GPU_PYTEST_K / FUZZ_K / SANITIZE_K  narrow the tests / fuzz / sanitizer runs (pytest -k)
#   MEMCHECK_FILES / RACECHECK_FILES    the test files each sanitizer runs
#   GPU_TEST_FILES  the pytest files of the tests step (default: all eleven GPU test files; the
#               whole set takes more than 330 s on the H200, so a suite run may span two calls)
#   SKIP_FUZZ=1     no hypothesis profile in the tests step
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
STEPS=${STEPS:-"tests check bench sanitize"}
LIMIT=${STEP_LIMIT:-540}
export DSV41_CACHE_DIR=${DSV41_CACHE_DIR:-/tmp/dsv41-cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/dsv41-triton-cache}
# CuTe DSL asks the driver for the GPU's arch unless told; under compute-sanitizer that probe's
# cuGetProcAddress call fails (handled by CuTe, reported by the sanitizer as an API error), so
# name the arch of GPU 0 (e.g. sm_90a) unless the caller did.
if [[ -z ${CUTE_DSL_ARCH:-} ]] && cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader -i 0 2>/dev/null); then
  export CUTE_DSL_ARCH="sm_${cap//./}a"
fi
# The golden vectors ship in tests/vectors (DSV41_VECTORS may point elsewhere).
if ! python -m pip install -q --no-deps --no-build-isolation . > "$OUT/install.txt" 2>&1; then
  # no usable setuptools there: lay the package out as an install would
  rm -rf /tmp/dsv41-src && mkdir -p /tmp/dsv41-src && cp -r dsv41 /tmp/dsv41-src/ && cp -r backends /tmp/dsv41-src/dsv41/backends
  export PYTHONPATH=/tmp/dsv41-src${PYTHONPATH:+:$PYTHONPATH}
  echo "pip install failed; using PYTHONPATH=/tmp/dsv41-src" >> "$OUT/install.txt"
fi
# python -P: import the installed package, not the checkout (backends/ installs as dsv41.backends)
PY="python -P"
T0=$SECONDS
stamp() { echo "[$((SECONDS - T0)) s] $*" | tee -a "$OUT/steps.txt"; }
if [[ -n ${PACK:-} ]]; then
  trap 'tar -czf "$PACK" -C "$OUT" . && echo "packed $OUT into $PACK"' EXIT
fi
$PY -m dsv41 info --json > "$OUT/info.json" 2> "$OUT/info.err"
for step in $STEPS; do
  stamp "start $step"
  case $step in
    tests)
      files=${GPU_TEST_FILES:-"tests/test_conformance.py tests/test_golden.py tests/test_gpu.py tests/test_interchange.py
        tests/test_transcode.py tests/test_launch_shapes.py tests/test_nvfp4_quotient.py tests/test_gpu_exhaustive.py
        tests/test_triton_cache_kernels.py tests/test_bound_launch.py tests/test_row_sum_sq.py"}
      timeout "$LIMIT" $PY -m pytest -q -p no:cacheprovider -m "not slow" $files \
        ${GPU_PYTEST_K:+-k "$GPU_PYTEST_K"} ${GPU_PYTEST_ARGS:-} > "$OUT/pytest.txt" 2>&1
      echo "pytest rc=$?" >> "$OUT/pytest.txt"
      if [[ ${SKIP_FUZZ:-0} != 1 ]]; then
        timeout "$LIMIT" $PY -m pytest -q -p no:cacheprovider tests/test_fuzz.py -k "impl_matches and cuda${FUZZ_K:+ and ($FUZZ_K)}" \
          > "$OUT/fuzz.txt" 2>&1
        echo "fuzz rc=$?" >> "$OUT/fuzz.txt"
      else
        echo "fuzz skipped (SKIP_FUZZ=1)" > "$OUT/fuzz.txt"
      fi
      # the failing test names in one small file (a call brings back only a few files)
      { tail -n 2 "$OUT/pytest.txt" "$OUT/fuzz.txt"; grep -h -E "^(FAILED|ERROR) " "$OUT/pytest.txt" "$OUT/fuzz.txt"; } > "$OUT/failed.txt" || true
      tail -n 3 "$OUT/pytest.txt"; tail -n 3 "$OUT/fuzz.txt"; echo "failed tests: $(grep -c -E "^(FAILED|ERROR) " "$OUT/failed.txt")" ;;
    check)
      timeout "$LIMIT" $PY -m dsv41 check --device cuda --all > "$OUT/check.txt" 2>&1
      echo "check rc=$?" >> "$OUT/check.txt"; tail -2 "$OUT/check.txt" ;;
    bench)
      nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >> "$OUT/clocks.txt" 2>&1
      timeout "$LIMIT" $PY -m dsv41 bench --device cuda ${BENCH_ARGS:-} --json "$OUT/bench.json" \
        > "$OUT/bench.txt" 2> "$OUT/bench.err"
      echo "bench rc=$?" >> "$OUT/bench.txt"; tail -50 "$OUT/bench.txt" ;;
    sweep)
      timeout "$LIMIT" $PY -m dsv41.backends.triton.sweep --out "$OUT" ${SWEEP_ARGS:-} \
        > "$OUT/sweep.out" 2>&1
      echo "sweep rc=$?" >> "$OUT/sweep.out"; tail -25 "$OUT/sweep.out" ;;
    profile)
      # Nsight Compute over one call of every CUDA implementation (bench --profile); the CSV
      # lists one block of metrics per kernel launch, in the order bench --profile prints
      timeout "$LIMIT" ncu --profile-from-start off --clock-control none \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        --section MemoryWorkloadAnalysis --section WarpStateStats --csv --page details \
        --log-file "$OUT/ncu.csv" \
        $PY -m dsv41 bench --device cuda --profile ${PROFILE_ARGS:---tokens 8 65536} > "$OUT/profile.txt" 2>&1
      echo "profile rc=$?" >> "$OUT/profile.txt"; tail -3 "$OUT/profile.txt" ;;
    sanitize)
      # Triton's and CuTe's kernels only (the C++ CPU backend and the reference run on the host)
      # (memcheck: conformance + fuzz inputs; racecheck, much slower: conformance inputs)
      for tool in memcheck racecheck; do
        files=${MEMCHECK_FILES:-tests/test_conformance.py tests/test_fuzz.py}
        [[ $tool == racecheck ]] && files=${RACECHECK_FILES:-tests/test_conformance.py}
        timeout "$LIMIT" compute-sanitizer --tool $tool --print-limit 50 --error-exitcode 99 \
          $PY -m pytest -q -p no:cacheprovider $files \
          -k "${SANITIZE_K:-cuda and not reference_self_check}" ${SANITIZE_ARGS:-} > "$OUT/$tool.txt" 2>&1
        echo "$tool rc=$?" >> "$OUT/$tool.txt"; tail -4 "$OUT/$tool.txt"
      done ;;
    hostile)
      # PYTORCH_NO_CUDA_MEMORY_CACHING (set by hostile.py): each tensor its own allocation, so
      # memcheck sees an access past any of them
      : > "$OUT/hostile.txt"
      for impl in ${HOSTILE_IMPLS:-cuda:triton cuda:cutedsl rocm@cuda xpu@cuda}; do
        timeout "$LIMIT" compute-sanitizer --tool memcheck --print-limit 20 --error-exitcode 99 \
          $PY tests/hostile.py --device cuda --impl "$impl" --quiet > "$OUT/hostile-$impl.txt" 2>&1
        echo "hostile $impl rc=$?" | tee -a "$OUT/hostile.txt"
        grep -E "^FAIL|== summary|ERROR SUMMARY" "$OUT/hostile-$impl.txt" | tee -a "$OUT/hostile.txt"
        rm -f "$OUT/hostile-$impl.txt"
      done ;;
    baseline)
      # The baseline is installed beside the current code and put ahead of it on PYTHONPATH
      # for its runs; its CPU kernels build in a cache of their own.
      base=/tmp/dsv41-baseline
      rm -rf "$base" && mkdir -p "$base/src"
      if ! { tar -C "$base/src" -xJf "${BASELINE_ARCHIVE:-.device/baseline.txz}" &&
             python -m pip install -q --no-deps --no-build-isolation --target "$base/site" "$base/src"; } \
           > "$OUT/baseline-install.txt" 2>&1; then
        echo "baseline: install failed"; tail -5 "$OUT/baseline-install.txt"; continue
      fi
      declare -A nth=([new]=0 [old]=0)
      for side in ${BASELINE_RUNS:-new old new old}; do
        [[ $side == new || $side == old ]] || { echo "baseline: run '$side' is neither new nor old"; continue; }
        nth[$side]=$(( ${nth[$side]} + 1 )); name=$side-${nth[$side]}
        nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader \
          | sed "s/^/$name: /" >> "$OUT/clocks.txt" 2>&1
        if [[ $side == old ]]; then
          env PYTHONPATH="$base/site" DSV41_CACHE_DIR="$base/cache" timeout "$LIMIT" \
            $PY -m dsv41 bench --device cuda ${BENCH_ARGS:-} --json "$OUT/baseline-$name.json" > /dev/null 2> "$OUT/baseline-$name.err"
        else
          timeout "$LIMIT" $PY -m dsv41 bench --device cuda ${BENCH_ARGS:-} --json "$OUT/baseline-$name.json" \
            > /dev/null 2> "$OUT/baseline-$name.err"
        fi
        echo "baseline $name rc=$?"
      done
      python tools/bench_compare.py --base "$OUT"/baseline-old-*.json --new "$OUT"/baseline-new-*.json \
        > "$OUT/baseline-compare.txt" 2>&1
      echo "compare rc=$? (1: a row slower by more than the limit)" >> "$OUT/baseline-compare.txt"
      tail -40 "$OUT/baseline-compare.txt" ;;
    vllm)
      # vLLM is not installed here: the harness lays vLLM's op files from the archive and
      # tests/vllm_gpu/shims out as a stand-in package in a temporary directory
      timeout "$LIMIT" $PY tests/vllm_gpu/side_by_side.py --archive "${VLLM_OPS_ARCHIVE:-.device/vllm033-ops.tar.xz}" \
        --out "$OUT" ${VLLM_SBS_ARGS:-} > "$OUT/vllm.out" 2>&1
      echo "vllm rc=$?" >> "$OUT/vllm.out"; tail -50 "$OUT/vllm.out" ;;
    *) echo "unknown step $step" ;;
  esac
done
stamp "done"

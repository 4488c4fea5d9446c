#!/usr/bin/env bash
# The project's test command (README): every suite that runs without a GPU.
#
#   bash tests/run.sh          fast tier: every op on every implementation that runs here,
#                              a slice of the matrix (2-5 minutes on 2 cores)
#   bash tests/run.sh --full   everything (what CI runs; 20-35 minutes on 2 cores)
#
# Steps: (1) pytest over tests/ -- reference vs vLLM's golden vectors, the conformance matrix
# (cpu + reference), the hostile-index matrix (cpu + reference), registry/CLI, torch.library,
# validation, hypothesis, AOT builds;
# (2) input validation again under `python -O`; (3) the Triton kernels of the cuda, rocm and
# xpu backends in Triton's interpreter (made bit-exact by tests/triton_interp.py) over the
# conformance matrix and the golden vectors (full tier: and the hostile-index matrix);
# (4) kernel checks that need Triton to run.
# Every step runs even if one before it failed; a summary and the exit status come at the end.
set -uo pipefail
cd "$(dirname "$0")/.."

TIER=fast
for arg in "$@"; do
  case "$arg" in
    --full) TIER=full ;;
    --fast) TIER=fast ;;
    -h|--help) sed -n 2,14p "$0"; exit 0 ;;
    *) echo "tests/run.sh: unknown argument $arg (use --full or --fast)" >&2; exit 2 ;;
  esac
done
export DSV41_TEST_TIER=$TIER
export DSV41_CACHE_DIR="${DSV41_CACHE_DIR:-$PWD/.cache-dsv41}"
if [[ $TIER == fast ]]; then
  echo "dsv41 tests, fast tier: expect 2-5 minutes on 2 cores (bash tests/run.sh --full: 20-35)"
else
  echo "dsv41 tests, full tier: expect 20-35 minutes on 2 cores"
fi

PYTEST=(python -m pytest -q -p no:cacheprovider)
declare -a NAMES RESULTS SECS CODES
run_step() {  # name, command...
  local name=$1; shift
  local log; log=$(mktemp)
  local t0=$SECONDS
  echo "== $name"
  "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  NAMES+=("$name"); SECS+=($((SECONDS - t0))); CODES+=("$rc")
  RESULTS+=("$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|deselected|error)' "$log" | tail -1 | sed -E 's/^=+ //; s/ =+$//')")
  rm -f "$log"
}

# Which Triton the interpreter steps can use (one line, printed once, if none).
INTERP_WHY=$(python - <<'PY'
import sys
sys.path.insert(0, "tests")
from triton_interp import interpreter_unsupported_reason
print(interpreter_unsupported_reason() or "")
PY
)

run_step "1 pytest tests/" "${PYTEST[@]}" tests
run_step "2 validation under python -O" python -O -m pytest -q -p no:cacheprovider tests/test_validation.py
if [[ -z $INTERP_WHY ]]; then
  # the hostile-index matrix of the interpreted kernels (2-6 minutes) in the full tier only;
  # its cpu / reference columns run in step 1 of both tiers
  HOSTILE=()
  [[ $TIER == full ]] && HOSTILE=(tests/test_hostile_indices.py)
  run_step "3 Triton kernels in the interpreter" env TRITON_INTERPRET=1 "${PYTEST[@]}" \
    tests/test_conformance.py tests/test_golden.py tests/test_transcode.py tests/test_interchange.py \
    tests/test_launch_shapes.py "${HOSTILE[@]}" -k "interp"
  run_step "4 kernel checks in the interpreter" env TRITON_INTERPRET=1 "${PYTEST[@]}" tests/test_nvfp4_quotient.py \
    tests/test_row_sum_sq.py
else
  echo "== steps 3-4 skipped: $INTERP_WHY"
fi

echo
echo "== summary ($TIER tier)"
status=0; passed=0; failed=0; skipped=0
for i in "${!NAMES[@]}"; do
  r=${RESULTS[$i]:-"no pytest summary (exit ${CODES[$i]})"}
  printf '%-40s %5ss  %s\n' "${NAMES[$i]}" "${SECS[$i]}" "$r"
  [[ ${CODES[$i]} == 0 ]] || status=1
  p=$(grep -oE '[0-9]+ passed' <<<"$r" | cut -d' ' -f1); passed=$((passed + ${p:-0}))
  f=$(grep -oE '[0-9]+ (failed|errors?)' <<<"$r" | awk '{s += $1} END {print s + 0}'); failed=$((failed + f))
  [[ ${CODES[$i]} == 0 || $f -gt 0 ]] || failed=$((failed + 1))  # a step that failed without a count
  s=$(grep -oE '[0-9]+ skipped' <<<"$r" | cut -d' ' -f1); skipped=$((skipped + ${s:-0}))
done
[[ -z $INTERP_WHY ]] || printf '%-40s %5s   %s\n' "3-4 interpreter steps" "-" "skipped: $INTERP_WHY"
echo "wall time: $((SECONDS / 60)) min $((SECONDS % 60)) s"
echo "total: $passed passed, $failed failed, $skipped skipped"
exit $status

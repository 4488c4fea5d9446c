#!/usr/bin/env bash
# The project's test command (README): every suite that runs without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export DSV41_CACHE_DIR="${DSV41_CACHE_DIR:-$PWD/.cache-dsv41}"
# 1. Everything: reference vs golden vectors, the conformance matrix (cpu + reference),
#    registry/CLI, torch.library, validation, hypothesis profile "ci", AOT builds.
python -m pytest -q -p no:cacheprovider tests
# 2. Input validation with asserts stripped.
python -O -m pytest -q -p no:cacheprovider tests/test_validation.py
# 3. The Triton kernels of the cuda, rocm and xpu backends in Triton's interpreter
#    (made bit-exact by tests/triton_interp.py), over the conformance matrix and
#    the golden vectors.
TRITON_INTERPRET=1 python -m pytest -q -p no:cacheprovider tests/test_conformance.py tests/test_golden.py tests/test_transcode.py tests/test_interchange.py tests/test_launch_shapes.py -k "interp"
# 4. Kernel-level checks that need Triton to run (interpreter here).
TRITON_INTERPRET=1 python -m pytest -q -p no:cacheprovider tests/test_nvfp4_quotient.py

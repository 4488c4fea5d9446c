#!/usr/bin/env bash
# Pack the vLLM 0.33.0 op sources that tests/vllm_gpu/side_by_side.py runs on the GPU host,
# where vLLM cannot be installed (no network; a device call carries ~55 MB besides the tree).
#
#   bash tools/vllm_gpu_pack.sh [WHEEL]   -> .device/vllm033-ops.tar.xz (git-ignored)
#
# WHEEL: the vllm-0.33.0 wheel; default /work/vllm033/wheel/*.whl if present, else
# `pip download vllm==0.33.0 --no-deps` into a temporary directory.  Only the Python files
# the DeepSeek V4 / V4.1 ops and their kernel launcher import are taken (plus MANIFEST with
# the wheel's name and each file's sha256); the modules they import beyond these are small
# shims in tests/vllm_gpu/shims.  vLLM's files are never committed: .device/ is ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=${1:-}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
if [[ -z $wheel ]]; then
  wheel=$(ls /work/vllm033/wheel/vllm-0.33.0-*.whl 2>/dev/null | head -1 || true)
fi
if [[ -z $wheel ]]; then
  python -m pip download -q vllm==0.33.0 --no-deps -d "$tmp/dl"
  wheel=$(ls "$tmp"/dl/vllm-0.33.0-*.whl | head -1)
fi
mkdir -p .device
python - "$wheel" "$tmp/tree" <<'PY'
import hashlib, pathlib, sys, zipfile

wheel, out = sys.argv[1], pathlib.Path(sys.argv[2])
FILES = [
    # the V4.1 ops package and the V4 modules it imports
    *(f"vllm/models/deepseek_v41/common/ops/{m}.py" for m in
      ("__init__", "cache_utils", "fused_compress_quant_cache", "fused_layout", "indexer_k_store", "query_quant")),
    *(f"vllm/models/deepseek_v4/common/ops/{m}.py" for m in
      ("__init__", "cache_utils", "fused_indexer_q", "fused_inv_rope_fp8_quant", "fused_compress_quant_cache")),
    # the launcher every kernel class goes through, and the helpers the kernels call
    "vllm/model_executor/warmup/jit_warmup.py",
    "vllm/model_executor/warmup/jit_warmup_triton_helper.py",
    "vllm/v1/attention/ops/common.py",
    "vllm/utils/math_utils.py",
    "vllm/transformers_utils/deepseek_v4_utils.py",
    # plugin discovery (vllm.plugins.load_general_plugins)
    "vllm/plugins/__init__.py",
]
manifest = [f"wheel {pathlib.Path(wheel).name}"]
with zipfile.ZipFile(wheel) as z:
    for name in FILES:
        data = z.read(name)
        dst = out / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
        manifest.append(f"{hashlib.sha256(data).hexdigest()}  {name}")
(out / "MANIFEST").write_text("\n".join(manifest) + "\n")
print(f"{len(FILES)} files from {pathlib.Path(wheel).name}")
PY
tar -C "$tmp/tree" -cJf .device/vllm033-ops.tar.xz MANIFEST vllm
ls -l .device/vllm033-ops.tar.xz

#!/usr/bin/env bash
# CI step: dsv41's vLLM plugin against the released vLLM 0.33.0, on a CPU-only machine.
#
# Its own venv: torch 2.13.0 (the local CPU wheel; nothing here may pull a CUDA torch), Triton
# 3.9 (its interpreter runs vLLM's Triton kernels, made bit-exact by tests/triton_interp.py),
# vLLM 0.33.0 with --no-deps plus the small packages its DeepSeek V4/V4.1 op modules import on a
# CPU, every one pinned and installed with --no-deps (so no resolver can swap torch), then dsv41
# (editable, which registers the entry point) and `pytest tests/vllm`.
#
#   bash .ci/vllm_plugin.sh            fresh venv in a temporary directory
#   VLLM_PLUGIN_VENV=DIR bash ...      use (or create) the venv at DIR
#
# About 3 minutes here (venv 1.7 min incl. the 336 MB vLLM wheel from the pip cache, tests 1 min);
# budget 5-6 on 2 cores with a cold download.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$SECONDS

if [[ -n ${VLLM_PLUGIN_VENV:-} ]]; then
  venv=$VLLM_PLUGIN_VENV
else
  # A venv of our own is about 3 GB (torch, Triton, the vLLM wheel): removed when the step ends.
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  venv=$tmp/venv
fi
[[ -x $venv/bin/python ]] || python3 -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"

python -m pip install -q "setuptools>=64" "torch==2.13.0" "triton==3.9.0" "numpy==2.4.6" "pytest>=7" "ml_dtypes==0.7.0"
python -m pip install -q --no-deps "vllm==0.33.0"

# What `import vllm.models.deepseek_v41.common.ops` (and the V4 package, the compressor and the
# attention modules) needs on a CPU, found by trial; versions inside vLLM 0.33.0's own ranges.
python -m pip install -q --no-deps \
  regex==2026.11.19 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing_extensions==4.16.0 cbor2==6.3.0 psutil==7.2.2 pyzmq==27.3.0 \
  transformers==5.20.2 huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 \
  hf-xet==1.8.0 httpx2==2.16.2 httpcore2==2.16.2 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 \
  idna==3.20 certifi==2026.10.19.post1 truststore==0.10.5 click==8.5.1 typer==0.29.2 \
  rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 shellingham==1.5.4 PyYAML==6.0.4 tqdm==4.70.1 \
  packaging==26.4 filelock==4.3.2 fsspec==2026.9.0 \
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 \
  multidict==7.2.1 propcache==0.5.4 yarl==1.25.1 requests==2.34.2 urllib3==2.8.0 \
  charset-normalizer==3.5.3 openai==3.60.0 jiter==0.19.0 oss-harmony==0.0.11 pillow==13.0.0 \
  pybase64==1.5.1 cachetools==8.0.2 msgspec==0.23.0 cloudpickle==3.1.3 uvloop==0.23.0 \
  py-cpuinfo==9.0.0 prometheus_client==0.26.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11 \
  fastapi==0.136.1 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 \
  partial-json-parser==0.2.1.1.post7 llguidance==1.7.6 einops==0.8.2
python -m pip install -q --no-deps --no-build-isolation -e .
python - <<'PY'
import torch
assert torch.version.cuda is None and torch.__version__.startswith("2.13.0"), torch.__version__
PY
echo "vllm_plugin: venv ready after $((SECONDS - t0)) s"

# The interpreter runs vLLM's kernels on the CPU; no device may be visible to torch or vLLM.
export CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1
export DSV41_CACHE_DIR="${DSV41_CACHE_DIR:-$PWD/.cache-dsv41}"
# (the interpreter's numpy warnings on NaN/Inf inputs are expected noise)
python -m pytest tests/vllm -q -p no:cacheprovider -W ignore::RuntimeWarning
echo "vllm_plugin: done after $((SECONDS - t0)) s"

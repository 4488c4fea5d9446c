"""Stand-in for ``vllm.envs``: the two settings the packed files read."""

import os

# vllm.plugins: which general plugins to load (comma list; unset = all)
VLLM_PLUGINS = [p for p in os.environ["VLLM_PLUGINS"].split(",") if p] if "VLLM_PLUGINS" in os.environ else None
# the kernel launcher: compile warmup keys on one thread (no warmup runs here anyway)
VLLM_TRITON_JIT_WARMUP_NUM_THREADS = 1

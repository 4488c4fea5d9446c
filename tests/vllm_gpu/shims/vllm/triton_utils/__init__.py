"""Stand-in for ``vllm.triton_utils``."""

import triton
import triton.language as tl

HAS_TRITON = True

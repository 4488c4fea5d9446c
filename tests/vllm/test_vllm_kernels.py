"""(d) Plugin off: vLLM 0.33's own Triton kernels, run in Triton's interpreter
(``CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1``, made bit-exact by tests/triton_interp.py),
against dsv41's functions on the same inputs: byte-equal.

Inputs: every set-D case's arguments, and the same arguments with fresh random values in
every floating-point input (shapes, strides, slots and tables kept), so the comparison is
not limited to the bytes the golden vectors hold.  vLLM 0.33.0's kernels need no platform
patch for this: on a machine without a GPU they launch on CPU tensors as they are.

The interpreter runs with the exact fp32 ``rsqrt``/``exp2`` of dsv41's contract
(conftest.py ``exact_rsqrt_exp2``).  Where vLLM's kernel in the interpreter and dsv41 still
disagree on a set-D input, the golden bytes decide: if dsv41 wrote vLLM's H200 bytes, the
interpreter is what differs (xfail, saying so); a case golden.py lists as a known difference
is an xfail with that reason.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm.plugins", reason="tests/vllm needs vLLM installed (bash .ci/vllm_plugin.sh)")

from dsv41.integrations import vllm_plugin as vp  # noqa: E402
from golden import clone_value, load_set  # noqa: E402
from vllm_calls import differences, dsv41_function, outputs, vllm_function  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("CUDA_VISIBLE_DEVICES") != "",
    reason='runs vLLM\'s Triton kernels in the interpreter: CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1',
)

CASES = load_set("D")

# vLLM's e2m1 (FP4) conversion is PTX inline assembly (tl.inline_asm_elementwise), which the
# interpreter cannot execute: these kernels are compared on the GPU only (tests/gpu_run.sh).
INLINE_ASM = {
    "rope_quant_insert, 288 B NVFP4 record": "vLLM's NVFP4 writer packs e2m1 with inline PTX",
    "indexer_k_norm_rope_store, MXFP4": "vLLM's MXFP4 indexer key packs e2m1 with inline PTX",
    "fused_indexer_q_rope_quant, MXFP4": "vLLM's MXFP4 indexer query packs e2m1 with inline PTX",
}


@pytest.fixture(autouse=True)
def plugin_off(exact_rsqrt_exp2):
    vp._unregister()
    yield


def _fresh(args: dict, written, seed: int) -> dict:
    """The arguments with new random values in every floating-point input tensor."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in args.items():
        v = clone_value(v)
        if isinstance(v, torch.Tensor) and v.is_floating_point() and k not in written and v.numel():
            fresh = torch.randn(v.shape, generator=g) * 4
            v.copy_(fresh.to(v.dtype))
        out[k] = v
    return out


def _run(fn, base: dict, golden_out: dict):
    args = {k: clone_value(v) for k, v in base.items()}
    return outputs(golden_out, args, fn(**args))


def _has_float_input(g) -> bool:
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() and k not in g.out
               for k, v in g.args.items())


def _params():
    ps = []
    for g in CASES:
        ps.append(pytest.param(g, None, id=f"{g.name}-setD"))
        if _has_float_input(g):
            ps.append(pytest.param(g, 1000 + len(ps), id=f"{g.name}-fresh"))
    for what, why in INLINE_ASM.items():
        ps.append(pytest.param(None, why, id=what, marks=pytest.mark.skip(reason=f"{why}; the interpreter cannot run it")))
    return ps


@pytest.mark.parametrize("golden, seed", _params())
def test_vllm_kernel_equals_dsv41(golden, seed):
    vfn, dfn = vllm_function(golden.op), dsv41_function(golden.op)
    assert vfn.__module__.startswith("vllm."), "the plugin is on: this test needs vLLM's own function"
    base = golden.args if seed is None else _fresh(golden.args, golden.out, seed)
    theirs = _run(vfn, base, golden.out)
    ours = _run(dfn, base, golden.out)
    problems = differences(ours, theirs)
    if problems and seed is None:
        if not differences(ours, golden.out):
            pytest.xfail("Triton's interpreter does not reproduce vLLM's H200 bytes here; dsv41 writes them: "
                         + "; ".join(differences(theirs, golden.out)))
        if golden.known_difference:
            pytest.xfail(f"known difference from vLLM's H200 bytes: {golden.known_difference}")
    assert not problems, f"{golden.op}: dsv41 vs vLLM's kernel in the interpreter: " + "; ".join(problems)

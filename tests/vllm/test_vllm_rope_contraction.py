"""The RoPE contraction dsv41 implements per op (docs/kernel_contract.md, "RoPE contraction") is
the one vLLM 0.33's kernels compile to: their PTX, built for NVIDIA targets on this CPU
(tests/vllm/rope_contraction.py). A vLLM release whose kernels fuse the other product shows up
here before its bytes do (they differ in about one bf16 in 55 000 odd lanes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm.plugins", reason="tests/vllm needs vLLM installed (bash .ci/vllm_plugin.sh)")

# what the odd lane's fma multiplies by in dsv41 (reference, cpu, Triton, CuTe): "sin" is
# fma(e, s, RN(o*c)), "cos" the canonical fma(o, c, RN(e*s))
DSV41_RULE = {
    "fused_indexer_q_rope_quant FP8": "sin",
    "fused_indexer_q_rope_quant MXFP4": "sin",
    "indexer_k_norm_rope_store FP8": "cos",
    "rope_quant_insert 584": "cos",
    "rope_quant_insert 528": "cos",
    "rope_quant_insert 288": "cos",
    "rope_quant_insert bf16": "cos",
}


@pytest.fixture(scope="module")
def vllm_rule():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    script = Path(__file__).with_name("rope_contraction.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", sorted(DSV41_RULE))
def test_dsv41_fuses_what_vllm_compiles_to(kernel, vllm_rule):
    assert vllm_rule[kernel] == DSV41_RULE[kernel], (
        f"vLLM's {kernel} fuses the product with {vllm_rule[kernel]} in its odd RoPE lane; dsv41 "
        f"fuses the one with {DSV41_RULE[kernel]}"
    )


def test_the_reference_implements_the_rule():
    """dsv41's reference: the indexer Q with odd lanes fused on sin, the indexer K and the cache
    writers on cos (a pair where the two forms round to different fp32 values)."""
    import torch

    from dsv41.core.codecs import fma32
    from dsv41.reference import compress, indexer

    e, o = torch.tensor([1.125]), torch.tensor([2.28125])
    c, s = torch.tensor([0.7729571461677551]), torch.tensor([0.6344582438468933])
    assert fma32(o, c, e * s) != fma32(e, s, o * c)  # the two forms differ here
    x = torch.stack((e, o), dim=-1).reshape(1, 2)
    q_odd = indexer._rope_pairs(x, c, s, odd_fuses_sin=True)[0, 1]
    k_odd = indexer._rope_pairs(x, c, s)[0, 1]
    assert q_odd == fma32(e, s, o * c) and k_odd == fma32(o, c, e * s)
    xs = torch.zeros(1, 512)
    xs[0, 448], xs[0, 449] = e, o  # the first RoPE pair of a latent row
    w = compress._rope_all_pairs(xs, c.expand(1, 32), s.expand(1, 32))
    assert w[0, 449] == fma32(o, c, e * s)

"""A V4.1 K cache written by one side and read by the other (plugin off: vLLM 0.33's own functions,
its Triton kernels in the interpreter with the H200 rules of conftest.py ``h200_interp_rules``).

For records 528 (interleaved, dsv41's default layout) and 584: a cache written by dsv41's
``quantize_and_insert_k_cache`` / ``rope_quant_insert`` and read by vLLM's
``dequantize_and_gather_k_cache`` gives the same bf16 bytes as vLLM writing and reading it, and a
cache vLLM wrote reads the same through dsv41 as through vLLM.

Record 288: vLLM's NVFP4 writer packs e2m1 with inline PTX, which the interpreter cannot run.  Its
caches come from the interp vectors (tests/vectors/vllm-interp-0.33.0.tar.xz, written by that
writer): dsv41's gather must give the bf16 vLLM's gather stored there.  The other direction runs
here: dsv41 writes a 288 cache, vLLM's gather (no inline asm) reads it as dsv41's does.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm.plugins", reason="tests/vllm needs vLLM installed (bash .ci/vllm_plugin.sh)")

import dsv41  # noqa: E402
from dsv41.integrations import vllm_plugin as vp  # noqa: E402
from golden import clone_value, load_set  # noqa: E402
from vllm_calls import differences, vllm_function  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("CUDA_VISIBLE_DEVICES") != "",
    reason='runs vLLM\'s Triton kernels in the interpreter: CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1',
)

BLOCK = 16
SEQS = [21, 9]
TABLE = [[3, 0], [2, -1]]  # page 1 is never written or read; -1 is never read
PAGES, PAD = 4, 64
CANARY_U8, CANARY_BF16 = 0xA5, -8531  # bf16 0xDEAD


@pytest.fixture(autouse=True)
def plugin_off(h200_interp_rules):
    vp._unregister()
    yield


def _cache(width: int) -> torch.Tensor:
    """[PAGES, BLOCK, width] uint8 view of padded pages (page stride BLOCK*width + PAD), canary-filled."""
    store = torch.full((PAGES, BLOCK * width + PAD), CANARY_U8, dtype=torch.uint8)
    return store[:, : BLOCK * width].view(PAGES, BLOCK, width)


def _inputs(seed: int):
    """Rows, slots and positions for SEQS through TABLE, written in a scrambled order."""
    g = torch.Generator().manual_seed(seed)
    slots, positions = [], []
    for r, n in enumerate(SEQS):
        for j in range(n):
            slots.append(TABLE[r][j // BLOCK] * BLOCK + j % BLOCK)
            positions.append(j)
    perm = torch.randperm(len(slots), generator=g)
    slots = torch.tensor(slots)[perm]
    positions = torch.tensor(positions)[perm]
    T = len(slots)
    scale = torch.exp2(torch.randint(-10, 10, (T, 1), generator=g).float())
    rows = torch.randn(T, 512, generator=g) * scale
    rows[3] = 0.0
    rows[5] = -0.0
    rows[7, :32] = 0.0  # a whole zero scale block in a normal row
    angles = torch.arange(64, dtype=torch.float32)[:, None] * torch.logspace(0, -4, 32)[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1)
    return rows.to(torch.bfloat16), slots, positions, cos_sin


def _write(side: str, writer: str, width: int, seed: int) -> torch.Tensor:
    rows, slots, positions, cos_sin = _inputs(seed)
    cache = _cache(width)
    fn = getattr(dsv41, writer) if side == "dsv41" else vllm_function(writer)
    if writer == "quantize_and_insert_k_cache":
        fn(rows, cache, slots, BLOCK, bytes_per_token=width)
    else:
        fn(rows, positions, cos_sin, cache, slots, 1)
    return cache


def _read(side: str, cache: torch.Tensor) -> torch.Tensor:
    out = torch.full((len(SEQS), max(SEQS) + 3, 512), CANARY_BF16, dtype=torch.int16).view(torch.bfloat16)
    fn = dsv41.dequantize_and_gather_k_cache if side == "dsv41" else vllm_function("dequantize_and_gather_k_cache")
    fn(out, clone_value(cache), torch.tensor(SEQS, dtype=torch.int32), None,
       torch.tensor(TABLE, dtype=torch.int32), BLOCK, 0)
    return out


@pytest.mark.parametrize("writer, width", [
    ("quantize_and_insert_k_cache", 528), ("quantize_and_insert_k_cache", 584),
    ("rope_quant_insert", 528), ("rope_quant_insert", 584),
])
def test_cache_written_by_one_side_reads_the_same_on_the_other(writer, width):
    seed = width + len(writer)
    by_dsv41, by_vllm = _write("dsv41", writer, width, seed), _write("vllm", writer, width, seed)
    vllm_only = {"out": _read("vllm", by_vllm)}
    dsv41_only = {"out": _read("dsv41", by_dsv41)}
    problems = [f"dsv41 write, vLLM read vs vLLM write+read: {p}"
                for p in differences({"out": _read("vllm", by_dsv41)}, vllm_only)]
    problems += [f"vLLM write, dsv41 read vs dsv41 write+read: {p}"
                 for p in differences({"out": _read("dsv41", by_vllm)}, dsv41_only)]
    problems += [f"dsv41 write+read vs vLLM write+read: {p}" for p in differences(dsv41_only, vllm_only)]
    assert not problems, "; ".join(problems)


INTERP = {g.name: g for g in load_set("E") if g.name.startswith("gather_288")}


@pytest.mark.parametrize("name", sorted(INTERP))
def test_288_cache_written_by_vllm_reads_the_same_through_dsv41(name):
    g = INTERP[name]
    args = {k: clone_value(v) for k, v in g.args.items()}
    dsv41.dequantize_and_gather_k_cache(**args)
    problems = differences({"out": args["out"]}, g.out)
    assert not problems, "dsv41 read of vLLM's 288 cache vs vLLM's read: " + "; ".join(problems)


def test_288_cache_written_by_dsv41_reads_the_same_through_vllm():
    cache = _write("dsv41", "rope_quant_insert", 288, 288)
    problems = differences({"out": _read("vllm", cache)}, {"out": _read("dsv41", cache)})
    assert not problems, "vLLM read of dsv41's 288 cache vs dsv41's read: " + "; ".join(problems)

"""The helpers vLLM 0.33's model code imports from its V4.1 ops package, as dsv41 provides them
(same names, signatures and results; docs/vllm_0.33.md).  Ops with kernels are checked byte for
byte by the golden vectors (set D) and the conformance matrix; these are the host-side helpers."""

from __future__ import annotations

import inspect

import pytest
import torch

import dsv41
from dsv41 import cache_utils, fused_compress_quant_cache, fused_layout, query_quant
from dsv41.reference.output_quant import _f8_128x4_offsets

BF16 = torch.bfloat16


def test_vllm_names_exist_with_vllm_parameters():
    """Parameter names and defaults of vLLM 0.33's public functions (read from its wheel);
    dsv41 may add keyword-only parameters after them."""
    want = {
        cache_utils.quantize_and_insert_k_cache: ["k", "k_cache", "slot_mapping", "block_size", "is_ue8m0", "use_fnuz", "bytes_per_token"],
        cache_utils.dequantize_and_gather_k_cache: ["out", "k_cache", "seq_lens", "gather_lens", "block_table", "block_size", "offset", "use_fnuz", "max_gather_len"],
        cache_utils.dequantize_and_gather_k_cache_triton: ["out", "k_cache", "seq_lens", "gather_lens", "block_table", "block_size", "offset", "use_fnuz", "max_gather_len"],
        cache_utils.gather_num_workers: ["max_gather_len"],
        fused_compress_quant_cache.fused_save_compress_norm: ["kv_score", "positions", "state_cache", "slot_mapping", "query_start_loc", "token_to_req_indices", "rms_norm_weight", "rms_norm_eps", "compress_ratio", "latent_out", "prev_rows", "prev_row_indices"],
        fused_compress_quant_cache.save_ring_rows: ["rows", "slot_mapping", "state_cache"],
        fused_compress_quant_cache.rope_quant_insert: ["latent", "positions", "cos_sin_cache", "kv_cache", "slot_mapping", "compress_ratio", "fp8_scale"],
        query_quant.fused_q_kv_rmsnorm_quant: ["qr", "kv", "q_weight", "kv_weight", "eps"],
        query_quant.mxfp8_scale_bytes: ["tokens", "width"],
        query_quant.can_fuse_query_quant: ["linears"],
        fused_layout.permute_q_to_fused: ["q"],
        fused_layout.permute_on_load: ["param", "perm", "dim"],
    }
    for fn, names in want.items():
        params = list(inspect.signature(fn).parameters.values())
        positional = [p.name for p in params if p.kind is not p.KEYWORD_ONLY]
        assert positional == names, fn.__name__
    assert (cache_utils.V41_QUANT_BLOCK, cache_utils.V41_NUM_SCALES) == (32, 16)
    assert (cache_utils.V41_NVFP4_QUANT_BLOCK, cache_utils.V41_NVFP4_NUM_SCALES) == (16, 32)
    assert (cache_utils.V4_BYTES_PER_TOKEN, cache_utils.V41_BYTES_PER_TOKEN, cache_utils.V41_NVFP4_BYTES_PER_TOKEN) == (584, 528, 288)
    assert fused_layout.WV_GROUP_SIZE == 8


@pytest.mark.parametrize("n,want", [(None, 128), (0, 128), (1024, 128), (1032, 129), (65536, 8192), (10**7, 8192)])
def test_gather_num_workers(n, want):
    assert cache_utils.gather_num_workers(n) == want


def test_gather_num_workers_rejects_non_int():
    with pytest.raises(TypeError, match="max_gather_len"):
        cache_utils.gather_num_workers(3.0)


@pytest.mark.parametrize("tokens,width", [(0, 7168), (1, 1536), (130, 1536), (257, 512), (5, 96)])
def test_mxfp8_scale_bytes_matches_the_buffer_fused_q_kv_rmsnorm_quant_returns(tokens, width):
    g = torch.Generator().manual_seed(tokens)
    qr = torch.randn(tokens, width, generator=g).to(BF16)
    kv = torch.randn(tokens, 64, generator=g).to(BF16)
    q, kv_out = dsv41.fused_q_kv_rmsnorm_quant(qr, kv, torch.ones(width, dtype=BF16), torch.ones(64, dtype=BF16), 1e-6)
    assert q.scale.numel() == query_quant.mxfp8_scale_bytes(tokens, width)
    assert isinstance(q, dsv41.QuantizedActivation)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == (tokens, width)
    assert q.orig_dtype == BF16 and q.orig_shape == qr.shape
    assert q.quant_key == query_quant.MXFP8_DYNAMIC
    assert kv_out.shape == kv.shape


@pytest.mark.parametrize("rows,groups", [(130, 48), (5, 3), (256, 16)])
def test_mxfp8_scale_offset_is_the_f8_128x4_swizzle(rows, groups):
    from triton_interp import interpreter_unsupported_reason, load_interpreted

    why = interpreter_unsupported_reason()
    if why:
        pytest.skip(why)
    probe = load_interpreted("swizzle_probe", also=("dsv41.backends.triton.scale_swizzle",))
    gp = (groups + 3) // 4 * 4
    out = torch.empty(rows, gp, dtype=torch.int32)
    probe.offsets_kernel[(rows,)](out, rows, groups, gp, 1 << (gp - 1).bit_length())
    tp = (rows + 127) // 128 * 128
    assert torch.equal(out.long(), _f8_128x4_offsets(tp, gp, "cpu")[:rows])


def test_permute_q_to_fused_matches_the_weight_permutation():
    q = torch.randn(3, 4, 512).to(BF16)
    fused = fused_layout.permute_q_to_fused(q)
    perm = fused_layout.q_fused_permutation(4)
    assert fused.shape == q.shape
    assert torch.equal(fused.reshape(3, -1).view(torch.int16), q.reshape(3, -1)[:, perm].view(torch.int16))
    fp8 = q.to(torch.float8_e4m3fn)
    assert torch.equal(fused_layout.permute_q_to_fused(fp8).view(torch.uint8), fused.to(torch.float8_e4m3fn).view(torch.uint8))
    with pytest.raises(ValueError, match="q"):
        fused_layout.permute_q_to_fused(q[0])


def test_permute_on_load_permutes_after_the_original_loader():
    param = torch.nn.Parameter(torch.zeros(4, 256), requires_grad=False)
    calls = []

    def loader(p, w):
        calls.append(w.shape)
        p.data.copy_(w)

    param.weight_loader = loader
    perm = fused_layout.o_fused_permutation(heads_per_group=2, head_dim=128)
    fused_layout.permute_on_load(param, perm, 1)
    w = torch.randn(4, 256)
    param.weight_loader(param, w)
    assert calls == [w.shape]
    assert torch.equal(param.data, w[:, perm])
    bad = torch.nn.Parameter(torch.zeros(4, 256), requires_grad=False)
    with pytest.raises(TypeError, match="weight_loader"):
        fused_layout.permute_on_load(bad, perm, 1)
    bad.weight_loader = loader
    with pytest.raises(ValueError, match="perm"):
        fused_layout.permute_on_load(bad, perm, 0)


class _Key:  # duck type of vLLM's QuantKey / ScaleDesc
    def __init__(self, dtype, group, static=False):
        self.dtype, self.scale2 = dtype, None
        self.scale = type("Scale", (), {"dtype": torch.uint8, "static": static, "group_shape": group})()


def _layer(kernel_name, key):
    layer = torch.nn.Module()
    layer._input_quant_key = key
    layer.quant_method = type("Method", (), {"kernel": type(kernel_name, (), {})()})()
    return layer


def test_can_fuse_query_quant(monkeypatch):
    good = _layer("FlashInferCutlassMxfp8LinearKernel", _Key(torch.float8_e4m3fn, (1, 32)))
    good2 = _layer("FlashInferCutedslMxfp8LinearKernel", query_quant.MXFP8_DYNAMIC)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    assert query_quant.can_fuse_query_quant([good, good2])
    assert not query_quant.can_fuse_query_quant([good, _layer("CutlassFp8LinearKernel", _Key(torch.float8_e4m3fn, (1, 32)))])
    assert not query_quant.can_fuse_query_quant([_layer("FlashInferCutlassMxfp8LinearKernel", _Key(torch.float8_e4m3fn, (1, 128)))])
    assert not query_quant.can_fuse_query_quant([_layer("FlashInferCutlassMxfp8LinearKernel", None)])
    unquantized = _layer("FlashInferCutlassMxfp8LinearKernel", _Key(torch.float8_e4m3fn, (1, 32)))
    unquantized.requires_unquantized_input = True
    assert not query_quant.can_fuse_query_quant([unquantized])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not query_quant.can_fuse_query_quant([good])


def test_dequantize_and_gather_k_cache_triton_same_bytes():
    k = torch.randn(20, 512).to(BF16)
    cache = torch.zeros(2, 16, 528, dtype=torch.uint8)
    dsv41.quantize_and_insert_k_cache(k, cache, torch.arange(20), 16, bytes_per_token=528)
    seq, table = torch.tensor([20], dtype=torch.int32), torch.tensor([[0, 1]], dtype=torch.int32)
    a, b = torch.zeros(1, 20, 512, dtype=BF16), torch.zeros(1, 20, 512, dtype=BF16)
    dsv41.dequantize_and_gather_k_cache(a, cache, seq, None, table, 16, 0)
    dsv41.dequantize_and_gather_k_cache_triton(b, cache, seq, None, table, 16, 0)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_save_ring_rows_validation():
    rows, state = torch.zeros(3, 1024), torch.zeros(2, 4, 1024)
    with pytest.raises(ValueError, match="slot_mapping"):
        dsv41.save_ring_rows(rows, torch.zeros(2, dtype=torch.int64), state)
    with pytest.raises(ValueError, match="rows"):
        dsv41.save_ring_rows(torch.zeros(3, 512), torch.zeros(3, dtype=torch.int64), state)
    with pytest.raises(TypeError, match="state_cache"):
        dsv41.save_ring_rows(rows, torch.zeros(3, dtype=torch.int64), None)

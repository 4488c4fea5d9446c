"""The measured launch shapes for large launches write the reference's bytes too.

The conformance cases are small, so their launches take the ``decode`` shapes of
``backends/triton`` (<= ``launch.DECODE_T`` tokens or rows).  Here it is 0, so the same
cases run with the shapes chosen for prefill sizes (other tile sizes, other masks at the
tile edges).  Runs wherever a Triton implementation runs: on a GPU, or in the interpreter
(``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from dsv41.backends.triton import launch
from dsv41.tools.conformance import CASES, _on, clone_args, written_bytes
from dsv41.reference import ReferenceBackend
from impls import implementations

SHAPED_OPS = {
    "quantize_and_insert_k_cache", "dequantize_and_gather_k_cache", "rope_quant_insert",
    "indexer_k_norm_rope_store", "fused_save_compress_norm", "fused_indexer_q_rope_quant",
    "fused_inv_rope_fp8_quant", "fused_q_kv_rmsnorm_quant", "combine_topk_swa_indices",
    "build_flashinfer_mixed_sparse_indices",
}
SHAPE_CASES = [c for c in CASES if c.op in SHAPED_OPS]
TRITON_IMPLS = [i for i in implementations() if getattr(i.backend, "triton_source", False) and i.device is not None]


def _run_and_compare(impl, case, args, want, label=""):
    """Run ``impl``'s kernel on a copy of ``args`` and assert every output it writes has the
    reference's bytes (``want``)."""
    got = _on(impl.device, clone_args(args))
    impl.kernel(case.op)(*got)
    if impl.device != "cpu":
        getattr(torch, impl.device).synchronize()
    for i in case.writes:
        if want[i] is None:
            continue
        w, g = written_bytes(want[i]), written_bytes(got[i])
        assert w.numel() == g.numel() and torch.equal(w, g), \
            f"{label}arg {i}: {int((w != g).sum())} bytes differ"



@pytest.mark.parametrize("case", SHAPE_CASES, ids=[c.id for c in SHAPE_CASES])
@pytest.mark.parametrize("impl", TRITON_IMPLS or [None], ids=[i.name for i in TRITON_IMPLS] or ["none"])
def test_large_launch_shapes(case, impl, monkeypatch):
    if impl is None:
        pytest.skip("no Triton implementation runs here (GPU or TRITON_INTERPRET=1)")
    why = impl.skip_reason(case.op)
    if why:
        pytest.skip(why)
    monkeypatch.setattr(launch, "DECODE_T", 0)
    args = case.build("cpu")
    want = clone_args(args)
    ReferenceBackend().load(case.op)(*want)
    _run_and_compare(impl, case, args, want)


RQI_288 = [c for c in CASES if c.op == "rope_quant_insert" and c.id.split("[")[-1].startswith("288")]
CUDA_TRITON = [i for i in TRITON_IMPLS if i.device == "cuda"]


def _rope_288_shapes():
    from dsv41.backends.triton.sweep import SPACES

    return [(s["bt"], s["nw"]) for s in SPACES["rope_quant_insert [288]"][1]]


@pytest.mark.parametrize("shape", _rope_288_shapes(), ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("case", RQI_288, ids=[c.id for c in RQI_288])
@pytest.mark.parametrize("impl", CUDA_TRITON or [None], ids=[i.name for i in CUDA_TRITON] or ["none"])
def test_rope_288_every_swept_shape(impl, case, shape, monkeypatch):
    """Every launch shape the sweep may pick for the 288 record's rope writer (its NVIDIA
    path tiles the row per launch shape) writes the reference's bytes, so the sweep's choice
    needs no second GPU run."""
    if impl is None:
        pytest.skip("needs the CUDA Triton implementation")
    why = impl.skip_reason(case.op)
    if why:
        pytest.skip(why)
    from dsv41.backends.triton import tuning

    monkeypatch.setitem(tuning.OVERRIDES, "rope:288", {"BLOCK_T": shape[0], "num_warps": shape[1]})
    args = case.build("cpu")
    want = clone_args(args)
    ReferenceBackend().load(case.op)(*want)
    _run_and_compare(impl, case, args, want)


QKV = [c for c in CASES if c.op == "fused_q_kv_rmsnorm_quant" and c.id.endswith(("[t5]", "[t130-two-tiles]"))]
NVIDIA_TRITON = [i for i in TRITON_IMPLS if i.name.startswith("cuda:triton")]


def _q_kv_decode_shapes():
    from dsv41.backends.triton.sweep import SPACES

    # and tiles of several Q rows (a tile part real, part padding; tiles of padding only)
    return SPACES["fused_q_kv_rmsnorm_quant [decode]"][1] + [
        dict(BLOCK_T=bt, num_warps=1, BLOCK_TKV=bt) for bt in (2, 8)]


@pytest.mark.parametrize("shape", _q_kv_decode_shapes(),
                         ids=lambda s: f"{s['BLOCK_T']}x{s['num_warps']}w-kv{s['BLOCK_TKV']}")
@pytest.mark.parametrize("case", QKV, ids=[c.id for c in QKV])
@pytest.mark.parametrize("impl", NVIDIA_TRITON or [None], ids=[i.name for i in NVIDIA_TRITON] or ["none"])
def test_q_kv_norm_every_swept_decode_shape(impl, case, shape, monkeypatch):
    """Every decode shape the sweep may pick for the Q / KV norm (Q rows per program, KV rows
    per program, warps: the sum of squares is taken from the tile in each shape's layout, and
    tiles of padding rows only take their own branch) writes the reference's bytes."""
    if impl is None:
        pytest.skip("needs the NVIDIA Triton implementation (GPU or TRITON_INTERPRET=1)")
    from dsv41.backends.triton import tuning

    monkeypatch.setitem(tuning.OVERRIDES, "fused_q_kv_rmsnorm_quant", dict(shape))
    args = case.build("cpu")
    want = clone_args(args)
    ReferenceBackend().load(case.op)(*want)
    _run_and_compare(impl, case, args, want)


def test_pdl_only_on_cuda_and_switchable(monkeypatch):
    """Programmatic dependent launch is a CUDA (SM90+) launch attribute: never for other
    devices, and ``DSV41_PDL=0`` turns it off (the kernels then run in plain stream order)."""
    assert launch.pdl(torch.device("cpu")) is False
    assert launch.pdl_kwargs(False) == {}
    assert launch.pdl_kwargs(True) == {"launch_pdl": True}
    monkeypatch.setenv("DSV41_PDL", "0")
    launch._pdl_capable.cache_clear()  # read once per device
    assert launch.pdl(torch.device("cuda", 0)) is False
    if torch.cuda.is_available() and torch.version.hip is None:
        monkeypatch.setenv("DSV41_PDL", "1")
        launch._pdl_capable.cache_clear()
        assert launch.pdl(torch.device("cuda", 0)) == (torch.cuda.get_device_capability(0)[0] >= 9)
    monkeypatch.undo()
    launch._pdl_capable.cache_clear()


def test_pdl_only_for_decode_launches_and_native_kernels(monkeypatch):
    """Only launches of at most DECODE_T tokens take PDL, and never the portable (ROCm / XPU)
    kernels, even on an NVIDIA GPU."""
    from dsv41.backends.triton import conversions

    monkeypatch.setattr(launch, "pdl", lambda device: True)  # as on an SM90+ GPU
    assert launch.decode_pdl(torch.device("cuda", 0), launch.DECODE_T) is True
    assert launch.decode_pdl(torch.device("cuda", 0), launch.DECODE_T + 1) is False
    monkeypatch.undo()
    monkeypatch.delenv("DSV41_PDL", raising=False)
    launch._pdl_capable.cache_clear()
    with conversions.portable():
        assert not conversions.pdl_allowed()
        assert launch.pdl(torch.device("cuda", 0)) is False
        assert conversions.integer_path(torch.device("cuda", 0))
    assert conversions.pdl_allowed()


def test_host_integer_helpers_and_span():
    """The launchers' host math: ``cdiv`` / ``pow2`` equal Triton's, and ``launch.span`` /
    ``launch.layout_span`` (int32 vs int64 offsets) are the largest element offset a tensor
    view reaches (from its storage's start / from its first element)."""
    import triton

    for a in range(0, 300):
        for b in (1, 2, 3, 7, 64, 128):
            assert launch.cdiv(a, b) == triton.cdiv(a, b)
        assert launch.pow2(a) == triton.next_power_of_2(max(a, 1))
    base = torch.zeros(6, 10, 4)
    views = [base, base.transpose(0, 2), base[2:, 3:7, ::2], base[:, 5], base[1:1], base.view(-1)[7:30]]
    for v in views:
        if v.numel() == 0:
            want = 0
        else:
            idx = torch.arange(base.numel()).view(base.shape).as_strided(v.shape, v.stride(), v.storage_offset())
            want = int(idx.max())
        assert launch.span(v) == want, (v.shape, v.stride())
        first = v.storage_offset() if v.numel() else 0
        assert launch.layout_span((v.shape, v.stride())) == want - first, (v.shape, v.stride())
    assert launch.span(None, *views) == base.numel() - 1


INV_ROPE = [c for c in CASES if c.op == "fused_inv_rope_fp8_quant"]


def _inv_rope_split_shapes():
    from dsv41.backends.triton.sweep import SPACES

    return SPACES["fused_inv_rope_fp8_quant [split rows]"][1]


@pytest.mark.parametrize("case", INV_ROPE, ids=[c.id for c in INV_ROPE])
@pytest.mark.parametrize("impl", TRITON_IMPLS or [None], ids=[i.name for i in TRITON_IMPLS] or ["none"])
def test_inv_rope_split_rows(impl, case, monkeypatch):
    """Every launch shape of the sweep's split-row space (programs of one quant chunk or half
    a row, so only the window with the RoPE dims loads position and cos/sin) writes the
    reference's bytes: scales per window, the NoPE-only windows' rows untouched by RoPE,
    quant groups of 32 (windows of several chunks) and bf16 rows (no chunks)."""
    if impl is None:
        pytest.skip("no Triton implementation runs here (GPU or TRITON_INTERPRET=1)")
    why = impl.skip_reason(case.op)
    if why:
        pytest.skip(why)
    from dsv41.backends.triton import rope_kernels, tuning

    args = case.build("cpu")
    want = clone_args(args)
    ReferenceBackend().load(case.op)(*want)
    # both windows x tiles of one and four rows (each shape is its own build; the shape the
    # sweep picks for decode sizes runs the whole conformance matrix anyway)
    shapes = [s for s in _inv_rope_split_shapes() if s["num_warps"] == 1 and s["BLOCK_T"] == s["BLOCK_H"] < 4]
    assert len(shapes) == 4
    # and the decode shapes in force (the conformance cases have at most 8 tokens)
    shapes += [tuning.TABLE["fused_inv_rope_fp8_quant:" + k].shape for k in ("tiny", "decode")]
    for shape in shapes:
        monkeypatch.setitem(rope_kernels.TUNE, "fused_inv_rope_fp8_quant", shape)
        _run_and_compare(impl, case, args, want, f"{shape} ")


def test_measured_shape_tiers():
    """``launch.measured``: ":tiny" up to TINY_T tokens, ":decode" up to DECODE_T, the plain
    key beyond (and for None), each falling back to the next broader entry."""
    tiers = {"op": "big", "op:decode": "decode", "op:tiny": "tiny"}
    T, D = launch.TINY_T, launch.DECODE_T
    assert [launch.measured(tiers, "op", n) for n in (1, T, T + 1, D, D + 1, None)] == \
        ["tiny", "tiny", "decode", "decode", "big", "big"]
    no_tiny = {"op": "big", "op:decode": "decode"}
    assert [launch.measured(no_tiny, "op", n) for n in (1, D, D + 1)] == ["decode", "decode", "big"]
    assert launch.measured({"op:tiny": "tiny"}, "op", T + 1) is None
    assert launch.measured({}, "op", 1) is None


def test_cache_kernel_shapes_kept_per_size_class(monkeypatch):
    """``cache_kernels._shape`` keeps the measured answer per size class: at every size it
    equals a fresh lookup, a tuning override takes effect at once, and the defaults it falls
    back to are read per call."""
    pytest.importorskip("triton")
    from dsv41.backends.triton import cache_kernels as CK
    from dsv41.backends.triton import tuning

    def fresh(kernel, variant, tokens):
        hit = tuning.shape(f"{kernel}:{variant}", tokens)
        if hit is not None:
            return int(hit["BLOCK_T"]), int(hit["num_warps"])
        return CK.CONFIG["block_t"][kernel], CK.CONFIG["num_warps"][kernel]

    T, D = launch.TINY_T, launch.DECODE_T
    keys = {tuple(k.split(":")[:2]) for k in tuning.TABLE if k.split(":")[0] in CK.CONFIG["block_t"]}
    assert keys
    for _ in range(2):  # the second pass reads what the first kept
        for kernel, variant in keys:
            variant = None if variant == "None" else int(variant) if variant.isdigit() else variant
            for n in (1, T, T + 1, D, D + 1, 65536, None):
                assert CK._shape(kernel, variant, n) == fresh(kernel, variant, n), (kernel, variant, n)
    monkeypatch.setitem(tuning.OVERRIDES, "insert:528", {"BLOCK_T": 2, "num_warps": 1})
    assert CK._shape("insert", 528, 1) == (2, 1)
    monkeypatch.undo()
    monkeypatch.setitem(CK.CONFIG["block_t"], "norm1", 3)
    assert CK._shape("norm1", "other", 1)[0] == 3


def test_every_measured_shape_cites_its_measurement():
    """Each entry of the one tuning table names the measurement it came from: a file under
    docs/measurements/ that exists, or says that none was kept."""
    import pathlib

    from dsv41.backends.triton import tuning

    root = pathlib.Path(__file__).resolve().parents[1] / "docs" / "measurements"
    for key, m in tuning.TABLE.items():
        assert m.shape and all(isinstance(v, int) for v in m.shape.values()), key
        assert (root / m.source).is_file() or "no file kept" in m.source, (key, m.source)


def _row_builder_shapes():
    from dsv41.backends.triton.sweep import SPACES

    spaces = {name: op for op in ("compute_global_topk_indices_and_lens", "combine_topk_swa_indices",
                                  "build_flashinfer_mixed_sparse_indices")
              for name in SPACES if name.split(" [")[0] == op}
    return [(op, shape) for name, op in spaces.items() for shape in SPACES[name][1]]


@pytest.mark.parametrize("op,shape", _row_builder_shapes(),
                         ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v.values())))
@pytest.mark.parametrize("impl", TRITON_IMPLS[:1] or [None], ids=[i.name for i in TRITON_IMPLS[:1]] or ["none"])
def test_row_builder_swept_shapes(impl, op, shape, monkeypatch):
    """Every launch shape the sweep may pick for the index builders (tiles, the FlashInfer
    kernel's early first compressed step, 64-bit offsets) writes the reference's bytes on every
    conformance case of the op (one Triton implementation: the index kernels have no vendor
    switch)."""
    from dsv41.backends.triton import tuning

    if impl is None:
        pytest.skip("no Triton implementation runs here (GPU or TRITON_INTERPRET=1)")
    monkeypatch.setattr(launch, "DECODE_T", 0)
    monkeypatch.setitem(tuning.OVERRIDES, op, dict(shape))
    for case in (c for c in CASES if c.op == op):
        args = case.build("cpu")
        want = clone_args(args)
        ReferenceBackend().load(case.op)(*want)
        _run_and_compare(impl, case, args, want, f"{case.id} {shape}: ")


def test_conversion_paths_in_one_look(monkeypatch):
    """``conversions.paths`` answers what ``integer_path`` and ``ptx`` answer, for every device
    kind, forced path and PyTorch flavour (a ROCm build names its GPUs "cuda" too)."""
    pytest.importorskip("triton")
    from dsv41.backends.triton import conversions

    devices = [torch.device("cpu"), torch.device("cuda", 0), torch.device("xpu", 0)]
    for rocm in (False, True):
        monkeypatch.setattr(conversions, "_ROCM_TORCH", rocm)
        for forced in (None, "integer", "hardware"):
            ctx = conversions.forced(forced) if forced else contextlib.nullcontext()
            with ctx:
                for d in devices:
                    assert conversions.paths(d) == (conversions.integer_path(d), conversions.ptx(d)), (rocm, forced, d)
    monkeypatch.setattr(conversions, "_ROCM_TORCH", False)
    assert conversions.paths(torch.device("cuda", 0)) == (False, True)
    assert conversions.paths(torch.device("cpu")) == (True, False)


def test_index_kernels_32bit_offsets_only_where_every_offset_fits():
    """The index kernels' launch plans choose 32-bit address arithmetic only when the largest
    element offset of every tensor involved is below ``launch.I32_SAFE`` (views with large
    strides included)."""
    pytest.importorskip("triton")
    from dsv41.backends.triton import index_kernels as ik

    safe = launch.I32_SAFE
    # top-k: a block table whose rows lie far apart (a view of a larger allocation)
    _, kw = ik._topk_plan(8, 64, (64, 1), (64, 1), (3, 4, safe // 2, 1), False, False)
    assert kw["OFF32"] is False  # 2 * (safe // 2) + 3 >= safe
    _, kw = ik._topk_plan(8, 64, (64, 1), (64, 1), (2, 4, safe // 2, 1), False, False)
    assert kw["OFF32"] is True
    _, kw = ik._topk_plan(8, 64, (64, 1), (1, safe), (2, 4, 4, 1), False, False)
    assert kw["OFF32"] is False  # the output's column stride
    # FlashInfer indices: the output's rows decide as well
    t = (4, 8, 8, 1)
    rows = safe // 1024 + 1  # (rows - 1) * 1024 + 1023 >= safe
    *_, kw = ik._flashinfer_plan(0, rows, 128, 896, 512, (1024, 1), (512, 1), t, t, False)
    assert kw["OFF32"] is False
    *_, kw = ik._flashinfer_plan(0, rows - 1, 128, 896, 512, (1024, 1), (512, 1), t, t, False)
    assert kw["OFF32"] is True
    # an empty tensor addresses nothing
    assert launch.layout_span(((0, 5), (2**40, 1)), ((2, 3), (3, 1))) == 5


def _plant_nope_nonfinite(q: torch.Tensor, nope: int) -> None:
    """Heads of token 0 whose NoPE half holds NaNs (both signs, the smallest and the default
    payload) beside its largest finite or infinite magnitude: an amax that let a NaN win, or
    that dropped the values beside it, changes the scale."""
    bits = q[0].view(torch.int16)
    bits[0, 3], q[0, 0, 7] = 0x7FC0, 100.0                    # +NaN beside the NoPE maximum
    bits[1, 5], q[0, 1, 10] = -64, -300.0                     # -NaN (0xFFC0)
    bits[2, 1], q[0, 2, 0] = 0x7F81, float("inf")             # smallest NaN payload, +inf
    bits[3, :nope] = 0x7FC0                                   # every NoPE value NaN
    bits[4, :] = -64                                          # the whole head NaN
    bits[5, 11], q[0, 5, 12] = 0x7F81, -3.3895e38             # the largest bf16 magnitude


def _indexer_q_nope_shapes():
    from dsv41.backends.triton.sweep import SPACES

    return SPACES["fused_indexer_q_rope_quant [FP8] nope"][1]


@pytest.mark.parametrize("shape", _indexer_q_nope_shapes(), ids=lambda s: f"{s['nope']}-maxnreg{s.get('maxnreg')}")
@pytest.mark.parametrize("impl", TRITON_IMPLS or [None], ids=[i.name for i in TRITON_IMPLS] or ["none"])
def test_indexer_q_nope_modes(impl, shape, monkeypatch):
    """The FP8 indexer Q in every NoPE mode of the sweep's ``nope`` shapes
    (``rope_kernels.INDEXER_Q_FP8_NOPE``: held as fp32, loaded a second time for its codes, held
    as bf16 pair words) writes the reference's bytes on every conformance case of the op, OCP and
    FNUZ, and with NaNs planted in the NoPE half (MXFP4 cases and unaligned rows run their own
    path)."""
    from dsv41.backends.triton import rope_kernels, tuning

    if impl is None:
        pytest.skip("no Triton implementation runs here (GPU or TRITON_INTERPRET=1)")
    op = "fused_indexer_q_rope_quant"
    monkeypatch.setitem(tuning.OVERRIDES, op, dict(shape))
    taken = 0
    for case in (c for c in CASES if c.op == op):
        args = case.build("cpu")
        q = args[1]
        t, h, d = q.shape  # index_q [T, H, D]; cos_sin_cache [., R]
        mode = rope_kernels._indexer_q_config(t, h, d, args[2].shape[-1], False)[7]
        aligned = q.stride(0) % 2 == 0 and q.stride(1) % 2 == 0 and q.storage_offset() % 2 == 0
        taken += mode == shape["nope"] and (mode != "words" or aligned) and not args[6]
        inputs = [("", args)]
        if not args[6]:  # FP8: the modes' amax
            planted = clone_args(args)
            _plant_nope_nonfinite(planted[1], d - args[2].shape[-1])
            inputs.append((" NoPE NaNs", planted))
        for label, a in inputs:
            want = clone_args(a)
            ReferenceBackend().load(case.op)(*want)
            _run_and_compare(impl, case, a, want, f"{case.id}{label} {shape}: ")
    assert taken, f"no case takes the FP8 path's NoPE mode {shape['nope']!r}"

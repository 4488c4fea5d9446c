"""Cache record formats and the layout descriptor every cache op works from.

A paged cache is ``[num_blocks, block_size, width]`` uint8 (or a flattened
``[num_blocks, page_bytes]`` view); bytes from ``block_size * width`` to
``stride(0)`` are allocator padding, never touched.  The record width
(``shape[-1]``) names the format; the fp8 flavour (OCP or FNUZ), the ROCm
tiling and the place of the scales are properties of the *cache*, not of the
machine, so they live here.

Where a token's scales live (``v41_layout``, V4.1 records 528 and 288 only):

* ``"interleaved"`` (the default; what the released vLLM 0.33 writes): each
  token's record is contiguous — its value bytes at ``width * t``, its own
  scale bytes right after them, at ``width * t + value_bytes``.
* ``"paged"`` (vLLM's development snapshot, spec cache_ops.md §1): the value
  region of all ``block_size`` tokens first, then the scale region of all
  tokens — values at ``value_bytes * t``, scales at
  ``block_size * value_bytes + scale_bytes * t``.

The V4 584 record and the indexer records are always ``"paged"`` (both vLLM
versions agree on them).  ``transcode_k_cache`` converts between the layouts.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

__all__ = [
    "Fp8Flavour",
    "Record",
    "RECORDS",
    "V4_FP8",
    "V41_MXFP8",
    "V41_NVFP4",
    "INDEXER_FP8",
    "INDEXER_MXFP4",
    "V4_BYTES_PER_TOKEN",
    "V41_BYTES_PER_TOKEN",
    "V41_NVFP4_BYTES_PER_TOKEN",
    "MXFP4_BLOCK_SIZE",
    "scale_byte_strides",
    "CacheLayout",
    "V41_LAYOUTS",
    "DEFAULT_V41_LAYOUT",
    "interleaved_for",
    "record_for_width",
    "flavour_of",
    "TILE",
]


class Fp8Flavour(enum.Enum):
    """The two e4m3 encodings a cache may hold.

    ``max`` is the clamp the quantizers use: 448 for OCP, 224 (not 240) for
    FNUZ, as vLLM's ``get_fp8_min_max`` does on gfx942.
    """

    OCP = "e4m3fn"
    FNUZ = "e4m3fnuz"

    @property
    def max(self) -> float:
        return 448.0 if self is Fp8Flavour.OCP else 224.0

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Fp8Flavour.OCP else torch.float8_e4m3fnuz

    @property
    def fnuz(self) -> bool:
        return self is Fp8Flavour.FNUZ


def flavour_of(use_fnuz: bool) -> Fp8Flavour:
    return Fp8Flavour.FNUZ if use_fnuz else Fp8Flavour.OCP


@dataclasses.dataclass(frozen=True)
class Record:
    """One token's bytes in a paged cache.

    value_bytes: bytes of the token in the page's value region.
    scale_bytes: bytes of the token in the page's scale region.
    quant_dims:  leading dims stored quantized (the rest, ``bf16_dims``, raw bf16).
    group:       dims sharing one scale.
    element:     ``e4m3`` or ``e2m1`` (two per byte, even dim in the low nibble).
    scale:       ``ue8m0`` (biased exponent byte), ``e4m3`` (NVFP4) or ``fp32``.
    """

    name: str
    width: int
    value_bytes: int
    scale_bytes: int
    head_dim: int
    quant_dims: int
    bf16_dims: int
    group: int
    element: str
    scale: str

    @property
    def n_groups(self) -> int:
        return self.quant_dims // self.group

    @property
    def holds_fp8(self) -> bool:
        return self.element == "e4m3"


V4_FP8 = Record("v4_fp8_ds_mla", 584, 576, 8, 512, 448, 64, 64, "e4m3", "ue8m0")
V41_MXFP8 = Record("v41_mxfp8", 528, 512, 16, 512, 512, 0, 32, "e4m3", "ue8m0")
V41_NVFP4 = Record("v41_nvfp4", 288, 256, 32, 512, 512, 0, 16, "e2m1", "e4m3")
INDEXER_FP8 = Record("indexer_fp8", 132, 128, 4, 128, 128, 0, 128, "e4m3", "fp32")
INDEXER_MXFP4 = Record("indexer_mxfp4", 68, 64, 4, 128, 128, 0, 32, "e2m1", "ue8m0")

RECORDS = {r.width: r for r in (V4_FP8, V41_MXFP8, V41_NVFP4, INDEXER_FP8, INDEXER_MXFP4)}

V4_BYTES_PER_TOKEN = V4_FP8.width
V41_BYTES_PER_TOKEN = V41_MXFP8.width
V41_NVFP4_BYTES_PER_TOKEN = V41_NVFP4.width
MXFP4_BLOCK_SIZE = 32


def scale_byte_strides(q_scale_out) -> tuple[int, int]:
    """(token, head) strides in bytes of the MXFP4 indexer-Q scale output: ``uint8 [T, H, D/32]``
    ue8m0 codes, or the same bytes as int32 words (``[T, H]`` for D = 128, ``[T, H, D/128]``),
    the form vLLM's API returns.  Each (token, head)'s D/32 bytes are contiguous in both."""
    es = q_scale_out.element_size()
    return q_scale_out.stride(0) * es, q_scale_out.stride(1) * es
# ROCm's tiled ("SHUFFLE") indexer layout: tiles of 16 tokens x 16 bytes.
TILE = 16


# Scale placement of the V4.1 records (module docstring).  The default follows the
# released vLLM, so dsv41 used as a drop-in for vLLM 0.33 writes and reads its caches.
V41_LAYOUTS = ("interleaved", "paged")
DEFAULT_V41_LAYOUT = "interleaved"
_INTERLEAVABLE = (528, 288)


def interleaved_for(width: int, v41_layout: str) -> bool:
    """Whether a record of ``width`` bytes is stored interleaved under ``v41_layout``."""
    return v41_layout == "interleaved" and int(width) in _INTERLEAVABLE


def record_for_width(width: int) -> Record:
    try:
        return RECORDS[int(width)]
    except KeyError:
        raise ValueError(
            f"unsupported paged KV record width {width}; expected one of "
            f"{sorted(RECORDS)}"
        ) from None


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Where each byte of a token lives in a paged cache.

    page_bytes is the cache's ``stride(0)`` in bytes and may exceed
    ``block_size * record.width`` (allocator padding, never touched).
    ``tiled`` selects ROCm's 16x16-tiled indexer FP8 values, or, for the
    MXFP4 indexer record, aiter's preshuffled layout with ``n_per_tile``
    tokens per tile (spec rope_quant_ops.md §3.4).  ``interleaved`` keeps each
    token's scales right after its values (V4.1 records; module docstring).
    """

    record: Record
    block_size: int
    page_bytes: int
    flavour: Fp8Flavour = Fp8Flavour.OCP
    tiled: bool = False
    n_per_tile: int = 0
    interleaved: bool = False

    @property
    def scale_base(self) -> int:
        """Byte offset of the scale region within a page (of token 0's scales if interleaved)."""
        if self.interleaved:
            return self.record.value_bytes
        return self.block_size * self.record.value_bytes

    @property
    def used_bytes(self) -> int:
        return self.block_size * self.record.width

    def value_index(self, token: torch.Tensor, byte: torch.Tensor) -> torch.Tensor:
        """Byte offset within a page of value byte ``byte`` of page token ``token``."""
        vb = self.record.value_bytes
        if self.interleaved:
            return token * self.record.width + byte
        if not self.tiled:
            return token * vb + byte
        if self.record is INDEXER_FP8:
            return (token // TILE) * (TILE * vb) + (byte // TILE) * (TILE * TILE) + (
                token % TILE
            ) * TILE + byte % TILE
        n = self.n_per_tile
        return (token // n) * (n * vb) + (byte // 16) * (n * 16) + (token % n) * 16 + byte % 16

    def scale_index(self, token: torch.Tensor, byte: torch.Tensor) -> torch.Tensor:
        """Byte offset within a page of scale byte ``byte`` of page token ``token``."""
        sb = self.record.scale_bytes
        if self.interleaved:
            return self.scale_base + token * self.record.width + byte
        if self.tiled and self.record is INDEXER_MXFP4:
            n = self.n_per_tile
            s_lo = 64 // n
            s_hi = 4 // s_lo
            return (
                self.scale_base
                + (token // n) * (n * 4)
                + (byte % s_lo) * (n * s_hi)
                + (token % n) * s_hi
                + byte // s_lo
            )
        return self.scale_base + token * sb + byte

"""Weight permutations for FlashMLA's mega-attention kernel; computed once at load time, so they are plain PyTorch (not dispatched).

The V4.1 fused attention kernel reads Q in 16-element head-dim chunks interleaved
across heads and writes O in 32-element chunks interleaved across the heads of one
``wo_a`` group (spec rope_quant_ops.md §6).  Every permutation here satisfies

    fused = standard[perm]

so the rows of ``wq_b`` (Q, §6.1) and the input columns of ``wo_a`` (O, §6.2) are
permuted once at load time and the GEMMs produce / consume the fused layouts.
The weight permutations move raw bits (integer views of the same width), so fp8
and ue8m0 storage is allowed and no value is ever converted.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = [
    "HEAD_DIM",
    "Q_CHUNK",
    "O_CHUNK",
    "O_HEADS_PER_GROUP",
    "WV_GROUP_SIZE",
    "q_fused_permutation",
    "o_fused_permutation",
    "o_fused_chunk_permutation",
    "apply_q_fused_permutation",
    "apply_o_fused_permutation",
    "permute_q_to_fused",
    "permute_on_load",
]

HEAD_DIM = 512  # FlashMLA head dim of V4.1
Q_CHUNK = 16  # §6.1: Q is stored as 32 chunks of [H, 16]
O_CHUNK = 32  # §6.2: O chunks of 32 = the MXFP8 scale block
O_HEADS_PER_GROUP = 8  # §6.2: heads per wo_a group
WV_GROUP_SIZE = O_HEADS_PER_GROUP  # vLLM 0.33's name for it


# --------------------------------------------------------------------------- validation


def _check_int(fn: str, name: str, value, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{fn}: {name} must be >= {minimum}, got {value}")
    return value


def _check_divides(fn: str, head_dim: int, chunk: int) -> None:
    if head_dim % chunk != 0:
        raise ValueError(
            f"{fn}: head_dim must be a multiple of chunk={chunk}, got head_dim={head_dim}"
        )


def _check_tensor(fn: str, name: str, value, ndim_min: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() < ndim_min:
        raise ValueError(
            f"{fn}: {name} must have at least {ndim_min} dims, got shape {tuple(value.shape)}"
        )
    return value


# Same-width integer dtypes: indexing through them moves bits verbatim (fp8, e8m0, bf16, ...).
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _permute_bits(t: torch.Tensor, dim: int, perm: torch.Tensor) -> torch.Tensor:
    """``t`` indexed by ``perm`` along ``dim``, bit for bit, as a new tensor of t's dtype."""
    bits_dtype = _BITS_DTYPE[t.element_size()]
    raw = t.view(bits_dtype) if t.dtype != bits_dtype else t
    out = raw.index_select(dim, perm.to(t.device))
    return out.view(t.dtype) if t.dtype != bits_dtype else out


# --------------------------------------------------------------------------- permutations


def _chunk_major(fn: str, heads_name: str, heads: int, head_dim: int, chunk: int, device) -> torch.Tensor:
    """Standard index ``h·D + c·chunk + j`` enumerated in fused order ``(c, h, j)``: Q (§6.1,
    all heads) and O (§6.2, the heads of one group) interleave their chunks the same way."""
    _check_int(fn, heads_name, heads)
    _check_int(fn, "head_dim", head_dim)
    _check_int(fn, "chunk", chunk)
    _check_divides(fn, head_dim, chunk)
    c = torch.arange(head_dim // chunk, device=device).view(-1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1)
    j = torch.arange(chunk, device=device).view(1, 1, -1)
    return (h * head_dim + c * chunk + j).reshape(-1)


def q_fused_permutation(
    num_heads: int,
    head_dim: int = HEAD_DIM,
    chunk: int = Q_CHUNK,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """§6.1: ``perm`` with ``fused = standard[perm]`` for a Q vector of ``num_heads`` heads.

    Standard index ``h·D + d`` lands at fused index ``(d // chunk)·(H·chunk) + h·chunk + d % chunk``;
    so fused index ``f = c·(H·chunk) + h·chunk + j`` reads standard ``h·D + c·chunk + j``.
    """
    return _chunk_major("q_fused_permutation", "num_heads", num_heads, head_dim, chunk, device)


def o_fused_permutation(
    heads_per_group: int = O_HEADS_PER_GROUP,
    head_dim: int = HEAD_DIM,
    chunk: int = O_CHUNK,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """§6.2: ``perm`` with ``fused = standard[perm]`` for one wo_a group row (G heads).

    Standard index ``h·D + c·chunk + j`` lands at fused index ``(c·G + h)·chunk + j``.
    """
    return _chunk_major(
        "o_fused_permutation", "heads_per_group", heads_per_group, head_dim, chunk, device
    )


def o_fused_chunk_permutation(
    heads_per_group: int = O_HEADS_PER_GROUP,
    head_dim: int = HEAD_DIM,
    chunk: int = O_CHUNK,
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """§6.2 on whole chunks (per-32 scale columns): ``chunk_perm[p] = perm[chunk·p] // chunk``.

    Fused chunk ``p = c·G + h`` comes from standard chunk ``h·(D/chunk) + c``.
    """
    perm = o_fused_permutation(heads_per_group, head_dim, chunk, device)
    return perm[::chunk] // chunk


def apply_q_fused_permutation(
    weight: torch.Tensor,
    scale: Optional[torch.Tensor],
    num_heads: int,
    head_dim: int = HEAD_DIM,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """§6.1: permute the output **rows** of ``wq_b`` and of its per-32 scale tensor.

    ``weight`` is ``[num_heads·head_dim, K]`` (any dtype, fp8 included), ``scale`` has the
    same number of rows (one scale row per weight row) or is None.  Returns new tensors
    ``(weight[perm], scale[perm])``; bits are copied, never converted.
    """
    fn = "apply_q_fused_permutation"
    _check_int(fn, "num_heads", num_heads)
    _check_int(fn, "head_dim", head_dim)
    _check_divides(fn, head_dim, Q_CHUNK)
    _check_tensor(fn, "weight", weight, 2)
    rows = num_heads * head_dim
    if weight.shape[0] != rows:
        raise ValueError(
            f"{fn}: weight.shape[0] must be num_heads*head_dim = {rows}, got {weight.shape[0]}"
        )
    if scale is not None:
        _check_tensor(fn, "scale", scale, 2)
        if scale.shape[0] != rows:
            raise ValueError(
                f"{fn}: scale.shape[0] must be num_heads*head_dim = {rows}, got {scale.shape[0]}"
            )
    perm = q_fused_permutation(num_heads, head_dim, Q_CHUNK, device=weight.device)
    new_weight = _permute_bits(weight, 0, perm)
    new_scale = None if scale is None else _permute_bits(scale, 0, perm)
    return new_weight, new_scale


def apply_o_fused_permutation(
    weight: torch.Tensor,
    scale: Optional[torch.Tensor],
    heads_per_group: int = O_HEADS_PER_GROUP,
    head_dim: int = HEAD_DIM,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """§6.2: permute the **input columns** (last dim) of ``wo_a`` and of its per-32 scales.

    ``weight`` is ``[..., heads_per_group·head_dim]`` (the same permutation for every
    group's rows), ``scale`` is ``[..., heads_per_group·head_dim / 32]`` or None; scale
    columns move by :func:`o_fused_chunk_permutation`.  Returns new tensors; bits are
    copied, never converted.
    """
    fn = "apply_o_fused_permutation"
    _check_int(fn, "heads_per_group", heads_per_group)
    _check_int(fn, "head_dim", head_dim)
    _check_divides(fn, head_dim, O_CHUNK)
    _check_tensor(fn, "weight", weight, 1)
    cols = heads_per_group * head_dim
    if weight.shape[-1] != cols:
        raise ValueError(
            f"{fn}: weight.shape[-1] must be heads_per_group*head_dim = {cols}, "
            f"got {weight.shape[-1]}"
        )
    if scale is not None:
        _check_tensor(fn, "scale", scale, 1)
        if scale.shape[-1] != cols // O_CHUNK:
            raise ValueError(
                f"{fn}: scale.shape[-1] must be heads_per_group*head_dim/{O_CHUNK} = "
                f"{cols // O_CHUNK}, got {scale.shape[-1]}"
            )
    perm = o_fused_permutation(heads_per_group, head_dim, O_CHUNK, device=weight.device)
    new_weight = _permute_bits(weight, weight.dim() - 1, perm)
    new_scale = None
    if scale is not None:
        chunk_perm = perm[::O_CHUNK] // O_CHUNK
        new_scale = _permute_bits(scale, scale.dim() - 1, chunk_perm)
    return new_weight, new_scale


# --------------------------------------------------------------------------- vLLM 0.33 helpers


def permute_q_to_fused(q: torch.Tensor) -> torch.Tensor:
    """``[N, H, D]`` Q in the standard layout -> a new tensor of the same shape in the fused
    layout of §6.1 (bits moved, never converted)."""
    fn = "permute_q_to_fused"
    _check_tensor(fn, "q", q, 3)
    if q.dim() != 3:
        raise ValueError(f"{fn}: q must be [N, H, D], got shape {tuple(q.shape)}")
    n, h, d = q.shape
    _check_divides(fn, d, Q_CHUNK)
    perm = q_fused_permutation(h, d, Q_CHUNK, device=q.device)
    return _permute_bits(q.reshape(n, h * d), 1, perm).view(n, h, d)


def permute_on_load(param: torch.Tensor, perm: torch.Tensor, dim: int) -> None:
    """Make ``param``'s ``weight_loader`` permute what it loaded: after the original loader
    has filled ``param``, ``param`` becomes ``param.index_select(dim, perm)`` (bits moved, so
    fp8 and ue8m0 parameters are fine).  ``perm`` is one of this module's permutations."""
    fn = "permute_on_load"
    _check_tensor(fn, "param", param, 1)
    _check_tensor(fn, "perm", perm, 1)
    dim = _check_int(fn, "dim", dim, minimum=-param.dim())
    if not -param.dim() <= dim < param.dim():
        raise ValueError(f"{fn}: dim must be in [{-param.dim()}, {param.dim()}), got {dim}")
    if perm.numel() != param.shape[dim]:
        raise ValueError(f"{fn}: perm has {perm.numel()} entries, param.shape[{dim}] is {param.shape[dim]}")
    loader = getattr(param, "weight_loader", None)
    if not callable(loader):
        raise TypeError(f"{fn}: param has no callable weight_loader attribute")
    axis = dim % param.dim()

    def load_then_permute(p, loaded_weight, *args, **kwargs):
        loader(p, loaded_weight, *args, **kwargs)
        p.data.copy_(_permute_bits(p.data, axis, perm))

    param.weight_loader = load_then_permute

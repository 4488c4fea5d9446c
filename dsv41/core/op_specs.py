"""Every dispatched op, declared once.

An ``OpSpec`` holds what the rest of the package derives its tables from:

* the op's name (``registry.OPS``, ``DSV41_BACKEND_<OP>``, the backends' sheets);
* the kernel contract's signature (docs/kernel_contract.md): argument names, types and
  defaults, and which tensors the kernel writes (``Tensor!`` / ``Tensor?!``).  From it come the
  ``torch.ops.dsv41.<name>`` schema and mutation declaration (``dsv41.core._library``), the
  arguments a conformance case compares by default (``dsv41.tools.conformance``) and the named
  access to kernel arguments (``OpSpec.position``);
* its index contract: the ``dsv41.core.index_checks`` function that checks the indices, called
  with the kernel arguments it names, and whether the reference and the CPU kernels enforce
  the bounds on every call (``enforced``; docs/bad_input.md).

The public functions keep vLLM's signatures (they are not derived: they are the API) and
end in one call of the op with kernel-contract arguments.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

__all__ = ["OpSpec", "SPECS", "OPS", "spec"]

_WRITTEN = re.compile(r"Tensor(\?)?!")


@dataclasses.dataclass(frozen=True)
class OpSpec:
    name: str
    # "(Tensor k, Tensor! k_cache, SymInt block_size, ...)": a torch.library schema's argument
    # list where a written tensor is spelled ``Tensor!`` (``Tensor?!`` when optional).
    signature: str
    # function of dsv41.core.index_checks taking kernel arguments by their names; None: the op
    # takes no index whose range needs checking
    index_check: str | None = None
    # the reference and the CPU kernels enforce the index bounds on every call (not only
    # under DSV41_VALIDATE)
    enforced: bool = False

    @functools.cached_property
    def schema(self) -> str:
        """The torch.library schema: each written tensor gets its own alias set."""
        count = iter(range(1, 1000))

        def alias(m):
            n = next(count)
            return f"Tensor(a{n}!){'?' if m.group(1) else ''}"

        return _WRITTEN.sub(alias, self.signature) + " -> ()"

    @functools.cached_property
    def _args(self) -> tuple:
        import torch

        parsed = torch._C.parse_schema(f"dsv41::{self.name}{self.schema}")
        return tuple(parsed.arguments)

    @functools.cached_property
    def arg_names(self) -> tuple:
        return tuple(a.name for a in self._args)

    @functools.cached_property
    def mutated(self) -> tuple:
        """Names of the arguments the kernel writes."""
        return tuple(a.name for a in self._args if a.alias_info is not None and a.alias_info.is_write)

    @functools.cached_property
    def writes(self) -> tuple:
        """Positions of the arguments the kernel writes."""
        return tuple(self.arg_names.index(n) for n in self.mutated)

    @functools.cached_property
    def _bound(self):
        defaults = [a.default_value for a in self._args if a.has_default_value()]
        return collections.namedtuple(self.name, self.arg_names, defaults=defaults or None)

    def bind(self, *args, **kwargs):
        """The kernel arguments by name (a named tuple in the declared order, defaults filled):
        for a kernel whose parameter list would otherwise repeat the declaration's."""
        return self._bound(*args, **kwargs)

    def position(self, name: str) -> int:
        """Position of the kernel argument ``name``."""
        try:
            return self.arg_names.index(name)
        except ValueError:
            raise KeyError(f"{self.name} has no kernel argument {name!r}; it has {self.arg_names}") from None


# In pipeline order.
SPECS = (
    OpSpec(
        "quantize_and_insert_k_cache",
        "(Tensor k, Tensor! k_cache, Tensor slot_mapping, SymInt block_size, bool use_fnuz, "
        "SymInt bytes_per_token, bool interleaved=False)",
        "check_quantize_and_insert_k_cache", enforced=True,
    ),
    OpSpec(
        "dequantize_and_gather_k_cache",
        "(Tensor! out, Tensor k_cache, Tensor seq_lens, Tensor? gather_lens, Tensor block_table, "
        "SymInt block_size, SymInt offset, bool use_fnuz, bool interleaved=False)",
        "check_dequantize_and_gather_k_cache", enforced=True,
    ),
    OpSpec(
        "compute_global_topk_indices_and_lens",
        "(Tensor topk_indices, Tensor token_to_req_indices, Tensor block_table, SymInt block_size, "
        "Tensor is_valid_token, Tensor! global_topk_indices, Tensor! topk_lens, bool compact=False)",
        "check_compute_global_topk_indices_and_lens",
    ),
    OpSpec(
        "combine_topk_swa_indices",
        "(Tensor topk_indices, Tensor query_start_loc, Tensor seq_lens, Tensor gather_lens, "
        "SymInt window_size, SymInt compress_ratio, SymInt topk, SymInt M, SymInt N, "
        "Tensor! combined_indices, Tensor! combined_lens)",
        "check_combine_topk_swa_indices",
    ),
    OpSpec(
        "build_flashinfer_mixed_sparse_indices",
        "(Tensor decode_swa_indices, Tensor? decode_compressed_indices, Tensor? decode_compressed_topk_lens, "
        "Tensor prefill_topk_indices, Tensor query_start_loc, Tensor seq_lens, Tensor token_to_req_indices, "
        "Tensor swa_block_table, SymInt swa_block_size, Tensor compressed_block_table, "
        "SymInt compressed_block_size, SymInt window_size, SymInt compress_ratio, SymInt topk, "
        "bool decode_compressed_indices_are_local, Tensor? decode_is_valid_token, SymInt swa_block_span, "
        "SymInt compressed_block_span, Tensor replay_start, Tensor! sparse_indices, Tensor! sparse_topk_lens)",
        "check_build_flashinfer_mixed_sparse_indices",
    ),
    OpSpec(
        "fused_save_compress_norm",
        "(Tensor kv_score, Tensor positions, Tensor?! state_cache, Tensor slot_mapping, "
        "Tensor? query_start_loc, Tensor? token_to_req_indices, Tensor rms_norm_weight, float rms_norm_eps, "
        "SymInt compress_ratio, Tensor! latent_out, Tensor? prev_rows=None, Tensor? prev_row_indices=None)",
        "check_fused_save_compress_norm", enforced=True,
    ),
    OpSpec(
        "save_ring_rows",
        "(Tensor rows, Tensor slot_mapping, Tensor! state_cache)",
        "check_save_ring_rows", enforced=True,
    ),
    OpSpec(
        "rope_quant_insert",
        "(Tensor latent, Tensor positions, Tensor cos_sin_cache, Tensor! kv_cache, Tensor slot_mapping, "
        "SymInt compress_ratio, Tensor? fp8_scale, bool sanitize_nans, bool interleaved=False)",
        "check_rope_quant_insert", enforced=True,
    ),
    OpSpec(
        "indexer_k_norm_rope_store",
        "(Tensor k_pre, Tensor positions, Tensor cos_sin_cache, Tensor rms_norm_weight, float rms_norm_eps, "
        "Tensor! k_cache, Tensor kv_slot_mapping, SymInt compress_ratio, bool use_fp4_cache, "
        "SymInt mxfp4_n_per_tile, bool tiled)",
        "check_indexer_k_norm_rope_store", enforced=True,
    ),
    OpSpec(
        "fused_indexer_q_rope_quant",
        "(Tensor positions, Tensor index_q, Tensor index_q_cos_sin_cache, Tensor index_weights, float softmax_scale, "
        "float head_scale, bool use_fp4, bool use_fnuz, Tensor! q_out, Tensor! q_scale_out, Tensor! weights_out)",
        "check_fused_indexer_q_rope_quant", enforced=True,
    ),
    OpSpec(
        "fused_inv_rope_fp8_quant",
        "(Tensor o, Tensor positions, Tensor cos_sin_cache, SymInt n_groups, SymInt heads_per_group, "
        "SymInt nope_dim, SymInt rope_dim, SymInt quant_group_size, bool tma_aligned_scales, bool quantize, "
        "bool permuted_output, Tensor! out_buf, Tensor! scale_buf)",
        "check_fused_inv_rope_fp8_quant", enforced=True,
    ),
    OpSpec(
        "fused_q_kv_rmsnorm_quant",
        "(Tensor qr, Tensor kv, Tensor q_weight, Tensor kv_weight, float eps, Tensor! q_out, "
        "Tensor! q_scale_out, Tensor! kv_out)",
    ),
    OpSpec("pad_fused_q_heads", "(Tensor q, Tensor! out)"),
    OpSpec(
        "transcode_k_cache",
        "(Tensor src, Tensor! dst, Tensor block_ids, SymInt block_size, SymInt width, bool src_fnuz, "
        "bool dst_fnuz, bool tiled)",
        "check_transcode_k_cache",
    ),
)

OPS = tuple(s.name for s in SPECS)
_BY_NAME = {s.name: s for s in SPECS}


def spec(op: str) -> OpSpec:
    """The declaration of ``op``."""
    try:
        return _BY_NAME[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; ops are {', '.join(OPS)}") from None

"""Which product vLLM 0.33's RoPE kernels fuse, read off their PTX (no GPU needed).

vLLM writes every forward rotation as ``e' = e*c - o*s``, ``o' = o*c + e*s`` and leaves the
contraction to LLVM, which fuses one product of each lane into an ``fma`` and rounds the other.
Which one decides the last bit (docs/kernel_contract.md, "RoPE contraction"). This compiles each
kernel with Triton for an NVIDIA target, finds the rotation's ``fma.rn.f32`` instructions whose
addend is a rounded ``mul.f32`` (negated in the even lane), and reports, per kernel, whether the
odd lane's fma multiplies by the same value as the even lane's (``cos``: the canonical
``fma(o, c, RN(e*s))``) or by the other (``sin``: ``fma(e, s, RN(o*c))``).

Run as a script (``python tests/vllm/rope_contraction.py``) it prints ``{kernel: "cos" | "sin"}``
as JSON; the plugin-step test runs it in a child process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import json
import re
import sys

_FMA = re.compile(r"fma\.rn\.f32\s+(%\w+),\s*(%\w+),\s*(%\w+),\s*(%\w+)")
_DEF = re.compile(r"(?:@!?%p\w+\s+)?[a-z][\w.]*\s+(?:\{\s*)?(%\w+)")


def _definitions(ptx: str) -> dict:
    """register -> the last instruction that writes it."""
    defs = {}
    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        m = _DEF.match(line)
        if m:  # stores name an address first and do not match
            defs[m.group(1)] = line
    return defs


def _is_trig(line: str) -> bool:
    """A value loaded as fp32 from memory (cos / sin; the query and latent are bf16 loads)."""
    return "ld.global" in line and ".b32" in line


def fused_odd_operand(ptx: str) -> str:
    """"cos" or "sin": what the odd lane's fma multiplies by (see the module docstring)."""
    defs = _definitions(ptx)
    even_trig, odd_trig = set(), set()
    for line in ptx.splitlines():
        m = _FMA.search(line)
        if not m:
            continue
        _, a, b, addend = m.groups()
        src = defs.get(addend, "")
        negated = src.startswith("neg.f32")
        if negated:
            src = defs.get(src.split(",")[-1].strip(), "")
        if not src.startswith("mul.f32"):
            continue  # not a rotation lane (a polynomial, a scale)
        trig = [r for r in (a, b) if _is_trig(defs.get(r, ""))]
        if len(trig) != 1:
            continue
        (even_trig if negated else odd_trig).add(trig[0])
    if not even_trig or not odd_trig:
        raise ValueError("no rotation fma pairs found in the PTX")
    if odd_trig <= even_trig:
        return "cos"
    if not odd_trig & even_trig:
        return "sin"
    raise ValueError(f"mixed contraction: even lanes fuse {sorted(even_trig)}, odd lanes {sorted(odd_trig)}")


def _compile_ptx(kernel, pointers: dict, constexprs: dict, floats=(), target: str = "sm90") -> str:
    import triton
    from triton.compiler import ASTSource

    from dsv41.backends.triton import aot

    cx = aot.constexpr_params(kernel)
    sig = {a: "constexpr" if a in cx else ("fp32" if a in floats else pointers.get(a, "i32"))
           for a in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=aot._gpu_target(target), options={"num_warps": 4}).asm["ptx"]


def kernels() -> dict:
    """name -> (kernel, pointer types, constexprs, fp32 scalars, target), vLLM 0.33.0's."""
    from vllm.models.deepseek_v4.common.ops import fused_indexer_q as q
    from vllm.models.deepseek_v41.common.ops import fused_compress_quant_cache as fc
    from vllm.models.deepseek_v41.common.ops import indexer_k_store as ks

    q_ptrs = {"pos_ptr": "*i64", "index_q_ptr": "*bf16", "index_q_cos_sin_ptr": "*fp32",
              "index_q_fp8_ptr": "*fp8e4nv", "index_q_mxfp4_ptr": "*u8", "index_q_scale_ptr": "*u8",
              "index_weights_ptr": "*bf16", "index_weights_out_ptr": "*fp32"}
    q_floats = ("index_weights_softmax_scale", "index_weights_head_scale")
    w_ptrs = {"latent": "*bf16", "positions": "*i64", "cos_sin": "*fp32", "cache": "*u8",
              "cache_slots": "*i64", "fp8_scale": "*fp32"}
    w_cx = dict(COS_STRIDE=64, CACHE_BLOCK=64, COMPRESS_RATIO=4)
    return {
        "fused_indexer_q_rope_quant FP8": (
            q.FusedIndexerQRopeQuantTritonKernel.kernel, q_ptrs,
            dict(INDEX_Q_HALF_ROT_DIM=32, INDEX_Q_HEAD_DIM=128, FP8_MAX=448.0, USE_FNUZ=False,
                 USE_EXPLICIT_FMA=False), q_floats, "sm90"),
        "fused_indexer_q_rope_quant MXFP4": (
            q.FusedIndexerQRopeMxFp4TritonKernel.kernel, q_ptrs,
            dict(INDEX_Q_HALF_ROT_DIM=32, INDEX_Q_HEAD_DIM=128, MXFP4_BLOCK=32), q_floats, "sm100"),
        "indexer_k_norm_rope_store FP8": (
            ks._indexer_k_norm_rope_quant_store_kernel,
            {"k_pre_ptr": "*bf16", "positions_ptr": "*i64", "rms_norm_weight_ptr": "*bf16",
             "cos_sin_cache_ptr": "*fp32", "k_cache_ptr": "*u8", "kv_slot_mapping_ptr": "*i64"},
            dict(HEAD_SIZE=128, ROPE_HEAD_DIM=64, COMPRESS_RATIO=1, TOKEN_STRIDE=128, SCALE_DIM=4,
                 KV_BLOCK_STRIDE=64 * 132, FP8_MAX=448.0, USE_FP4=False, MX_SCALE=False, SHUFFLE=False,
                 BLOCK_TILE_SIZE=128, HEAD_TILE_SIZE=128), ("rms_norm_eps",), "sm90"),
        "rope_quant_insert 584": (fc._rope_quant_insert_kernel, w_ptrs,
                                  dict(w_cx, CACHE_STRIDE=64 * 584, SANITIZE_CACHE_NANS=False), (), "sm90"),
        "rope_quant_insert 528": (fc._rope_quant_insert_mxfp8_kernel, w_ptrs,
                                  dict(w_cx, CACHE_STRIDE=64 * 528, SANITIZE_CACHE_NANS=False), (), "sm90"),
        "rope_quant_insert 288": (fc._rope_quant_insert_nvfp4_kernel, w_ptrs,
                                  dict(w_cx, CACHE_STRIDE=64 * 288, SANITIZE_CACHE_NANS=False), (), "sm100"),
        "rope_quant_insert bf16": (fc._rope_plain_insert_kernel, w_ptrs,
                                   dict(w_cx, CACHE_STRIDE=64 * 1024, ROW_STRIDE=512, STORE_FP8=False), (), "sm90"),
    }


def main() -> int:
    out = {}
    for name, (kernel, pointers, cx, floats, target) in kernels().items():
        out[name] = fused_odd_operand(_compile_ptx(kernel, pointers, cx, floats, target))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

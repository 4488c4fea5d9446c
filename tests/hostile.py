"""Hostile-index matrix: no index may crash the process, hang, or touch memory outside the
tensors it was given.

Every op is called in kernel-contract form (``impl.kernel(op)(*args)``, docs/kernel_contract.md)
on the arguments of one conformance case (``dsv41.tools.conformance``), with ONE element of one
index-like argument replaced by a hostile value:

    bound, bound + 100, 10**6, 2**31 - 1, -2, -10**6, -2**31   (+ 2**32 + 5 for int64 tensors)

where ``bound`` is the first invalid value of that argument (``num_blocks * block_size`` for a
slot, ``num_blocks`` for a block id, ``cos_sin_cache.shape[0]`` for a position, ...).  Values the
tensor's dtype cannot hold are skipped; Python-int arguments (the gather's ``offset``) get the
non-negative values only.  The element is one the kernel actually uses (the first token that
writes, a block-table entry that is read, ...); ``tests/test_hostile_indices.py`` checks that
by showing that an in-range change of that element changes the reference's output.

Pieces:

* ``SITES`` / ``hostile_cases()``: the enumeration: one ``Site`` per (op, case, argument) says
  which element is hostile, its bound, what a value outside the range *means* (``invalid``, the
  documented ``skip`` of a negative slot, or ``defined`` behaviour of the index builders and of
  ``transcode_k_cache``) and how the Triton kernels must treat it.
* canaries: ``Rehomed`` moves every tensor argument into a larger buffer filled with 0xA5, with
  ``PAD`` (256 KiB) of canary before and after the tensor's storage, keeping its view (shape,
  strides, storage offset relative to its storage); ``check_canaries()`` finds any changed byte
  and names the argument whose surroundings changed.
* ``execute(job)``: runs one job (one implementation, one case, one hostile value) in this
  process and returns its record: returned / raised (type, message), canaries intact or which
  tensor's canary changed, the sha1 of each written argument's storage (before and after),
  read-only arguments modified.
* ``ForkServer``: process isolation.  A server process (a fresh interpreter, never the pytest
  process) imports torch / dsv41 / triton once, loads the CPU kernel libraries (dlopen only)
  and builds every case once with ONE torch thread: it runs no OpenMP region and no kernel, so
  it has a single thread when it forks and a child starts with no thread pool to inherit
  (checked: the server reports its thread count).  It forks one child per job (``parallel`` at
  a time) with a timeout (60 s in the interpreter, 20 s otherwise) and an address-space limit
  (``DSV41_HOSTILE_MEM_GB``, default 4 GiB over the server's size: a 16 GiB allocation fails
  instead of swamping the machine); the child restores the torch thread count, runs the job and
  sends its record through a pipe.  A crash (killed by a signal, nonzero exit: the innermost
  project frame of faulthandler's dump is reported) or a hang (timeout: the child's process
  group is killed) is recorded for that job; the server and pytest go on.
* ``evaluate()``: the expected outcomes (docs/bad_input.md, the contract being implemented):
  every implementation: no crash, no hang, canaries intact, read-only arguments unchanged, no
  exception but ValueError / TypeError.  ``reference`` and ``cpu``: an invalid value raises a
  ValueError naming the argument (``'<arg>'`` in the message) and writes nothing; a skip value
  gives the bytes of the same call with -1 there; defined behaviour gives the reference's
  bytes.  GPU kernels (Triton, CuTe DSL): no exception, the same bytes on two runs, and for
  slot-type arguments of writers the bytes of the call with -1 there.

CLI (the GPU host; one process, no fork after CUDA init, fit for
``compute-sanitizer --tool memcheck``)::

    python tests/hostile.py --device cuda --impl all [--op OP] [--json OUT] [--quiet]
    compute-sanitizer --tool memcheck python tests/hostile.py --device cuda --impl cuda:triton
    python tests/hostile.py --device cpu --impl cpu,reference   # here: through the fork server
    TRITON_INTERPRET=1 python tests/hostile.py --impl cuda:triton@interp
    python tests/hostile.py --list                              # the sites and the cases

prints a ``RUN`` line before each job (in one process: the last one names the job a hard
crash or a hang happened in), one ``PASS``/``FAIL`` line per outcome and a summary; exit status
1 when an outcome fails.  On CUDA the caching allocator is off (``PYTORCH_NO_CUDA_MEMORY_CACHING
=1``, every tensor its own allocation, so the sanitizer sees accesses past the canary buffers).
A CUDA error poisons the context: the later jobs are reported ``not-run``; ``--isolate`` runs
each (impl, op) in a fresh process and resumes after a poisoning (or process-killing) case.
A hang in one process ends it with faulthandler's dump (``--hang-timeout``, default 300 s there).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import inspect
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import torch

PAD = 256 * 1024  # canary bytes before and after every tensor storage
CANARY = 0xA5
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
I64_EXTRA = 2**32 + 5
INTERP_TIMEOUT, NATIVE_TIMEOUT = 60.0, 20.0
HOST_IMPLS = ("reference", "cpu")  # validate always; everything else is a GPU kernel


def positions_past_the_table(rows: int) -> torch.Tensor:
    """int64 positions at and past both ends of a ``rows``-row cos/sin table and of int32 /
    uint32, for the kernels' clamp into the table (a position outside it reads the nearest row,
    docs/bad_input.md): one that clamps only a position's low word, or compares in int32,
    reads another row for some of them."""
    return torch.tensor([-2**63, -2**32 - 5, -2**32, -2**31 - 1, -2**31, -1, 0, 1, rows - 1, rows,
                         rows + 7, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 3, 2**63 - 1])


# ============================================================================ the enumeration
#
# Classes of a hostile value (what the value means for the op):
#   invalid       outside the documented range: reference/cpu raise ValueError naming the arg
#   skip          documented "skip" (a negative slot, a negative prev_row index = read the
#                 ring): exactly the bytes of the same call with -1 there, on every backend
#   valid         inside the documented range (an argument with no upper bound): no error,
#                 the reference's bytes
#   marker        CR 1's slot only marks a valid token: any value >= 0 gives the unmodified
#                 call's bytes
#   defined       out of range but defined (index builders: reads outside a table give -1):
#                 no error on any backend, the reference's bytes
#   defined-skip  defined as a skip (transcode ids outside a cache, negative top-k indices):
#                 no error, the reference's bytes and the bytes of the call with -1 there


@dataclasses.dataclass(frozen=True)
class Site:
    op: str
    case: str  # conformance case name (dsv41.tools.conformance: Case.name)
    arg: str  # argument name as in docs/kernel_contract.md (the reference's parameter name)
    index: int  # position in the kernel-contract argument list
    element: Callable | None  # args -> index tuple of the hostile element (None: a Python int)
    bound: Callable  # args -> first invalid value (None: no upper bound)
    alt: Callable  # (args, value) -> an in-range value of the element that changes the output (liveness)
    neg: str = "invalid"  # class of values < 0
    pos: str = "invalid"  # class of values >= bound
    inrange: str = "valid"  # class of values in [0, bound) (or >= 0 when bound is None)
    gpu_minus1: bool = False  # slot-type argument of a writer: GPU kernels treat out-of-range as -1
    tight: bool = True  # bound - 1 is valid (the bound is the first invalid value)
    # other arguments an error may name instead (a relational bound: a length that reaches a
    # garbage table entry is reported on the entry)
    also_named: tuple = ()
    # GPU: an invalid value may aim two writers at one element (in bounds, a write race like
    # duplicate slots), so two runs need not agree
    gpu_racy: bool = False
    note: str = ""

    @property
    def id(self) -> str:
        return f"{self.op}[{self.case}].{self.arg}"

    def classify(self, value: int, bound: int | None) -> str:
        if value < 0:
            return self.neg
        if bound is not None and value >= bound:
            return self.pos
        return self.inrange

    def needs_minus1(self, gpu: bool) -> bool:
        """Whether some value is compared with the call that has -1 in the element."""
        if self.element is None:
            return False
        return "skip" in (self.neg + self.pos) or (gpu and self.gpu_minus1)


def _nz(mask: torch.Tensor) -> tuple:
    """Index tuple of the first True element of ``mask``."""
    w = mask.nonzero()
    if w.shape[0] == 0:
        raise LookupError("no element satisfies the site's condition (case changed?)")
    return tuple(int(i) for i in w[0])


def _first_writer(slots, positions=None, cr=1):
    s = slots.reshape(-1).to(torch.int64)
    m = s >= 0
    if positions is not None and cr > 1:
        p = positions.reshape(-1)[: s.shape[0]].to(torch.int64)
        m &= (p + 1) % cr == 0
    return _nz(m)


def _int32_lim(block_size: int) -> int:
    """First table entry whose ``entry * block_size`` leaves int32 (index builders)."""
    return (I32_MAX - (block_size - 1)) // block_size + 1


def _gather_req0(a):
    """(L, n, B, width, num_blocks, rows, offset) of request 0 of a gather case."""
    L = int(a[2][0])
    n = L if a[3] is None else int(a[3][0])
    return L, n, a[5], a[4].shape[1], a[1].shape[0], a[0].shape[1], a[6]


def _gather_len_bound(a, which: str) -> int:
    """First value of seq_lens[0] (``which`` 'seq') above the current one whose gather reads
    outside the table, the cache or ``out``."""
    L0, n0, B, width, nb, rows, off = _gather_req0(a)
    table = a[4]
    for L in range(L0 + 1, width * B + 2):
        n = L if a[3] is None else n0
        if off + n > rows or n > L:
            return L
        if n > 0:
            for j in range((L - n) // B, (L - 1) // B + 1):
                if j >= width or not (0 <= int(table[0, j]) < nb):
                    return L
    return width * B + 1


def _gather_table_elem(a):
    L, n, B, *_ = _gather_req0(a)
    return (0, (L - 1) // B)


def _gather_offset_bound(a):
    L = a[2].to(torch.int64)
    n = L if a[3] is None else a[3].to(torch.int64)
    return a[0].shape[1] - int(n.max()) + 1


def _topk_present(a):
    """(row, column) of the first x >= 0 in a token row whose request index is in range."""
    x, t2r, table = a[0], a[1], a[2]
    ok = (x >= 0) & ((t2r[: x.shape[0]] >= 0) & (t2r[: x.shape[0]] < table.shape[0])).unsqueeze(1)
    return _nz(ok)


def _topk_table_elem(a):
    r, j = _topk_present(a)
    return (int(a[1][r]), int(a[0][r, j]) // a[3])


def _combine_topk_elem(a):
    # token 0 (request 0): columns j < k_len = min((pos + 1) // cr, topk) are read
    qsl, L = a[1], int(a[2][0])
    ql = int(qsl[1] - qsl[0])
    k_len = min((L - ql + 1) // a[5], a[6])
    assert k_len > 0
    return (0, 0)


def _fi_prefill_row(a):
    """First prefill row (index D) and its request, position, k_len (flashinfer global case)."""
    D = a[0].shape[0]
    req = int(a[6][D])
    qs, qe = int(a[4][req]), int(a[4][req + 1])
    pos = int(a[5][req]) - (qe - qs) + (D - qs)
    k_len = min((pos + 1) // a[12], a[13])
    return D, req, pos, k_len


def _fi_pre_elem(a):
    *_, k_len = _fi_prefill_row(a)
    pre = a[3]
    for j in range(min(k_len, pre.shape[1])):
        if int(pre[0, j]) >= 0:
            return (0, j)
    raise LookupError("no prefill top-k index read in row D")


def _fi_comp_table_elem(a):
    _, req, *_ = _fi_prefill_row(a)
    _, j = _fi_pre_elem(a)
    return (req, int(a[3][0, j]) // a[10])


def _fi_swa_table_elem(a):
    # the last row of the first prefill request reads the block of its position L - 1
    _, req, *_ = _fi_prefill_row(a)
    return (req, (int(a[5][req]) - 1) // a[8])


def _fi_local_elem(a):
    return _nz(a[1][:1] >= 0)


def _save_first_closing_req(a):
    """Request whose first token closes a group (odd position, slot >= 0): it reads the ring."""
    qsl, pos, slot = a[4], a[1], a[3]
    for r in range(qsl.shape[0] - 1):
        t = int(qsl[r])
        if t < int(qsl[r + 1]) and int(pos[t]) % 2 == 1 and int(slot[t]) >= 0:
            return r
    raise LookupError("no request whose first token closes a group")


def _save_last_of_req0(a):
    return (int(a[4][1]) - 1,)


def _alt_plus(delta, mod=None):
    def f(a, v):
        return (v + delta) % mod(a) if mod else v + delta
    return f


def _alt_const(c):
    return lambda a, v: c


def _sites() -> list[Site]:
    S = []
    A = S.append
    # ---- quantize_and_insert_k_cache: slot_mapping (negative = skip)
    A(Site("quantize_and_insert_k_cache", "528-ocp-interleaved", "slot_mapping", 2,
           lambda a: _first_writer(a[2]), lambda a: a[1].shape[0] * a[3], _alt_const(-1),
           neg="skip", gpu_minus1=True))
    # ---- dequantize_and_gather_k_cache
    G = "dequantize_and_gather_k_cache"
    A(Site(G, "528-interleaved-partial", "block_table", 4, _gather_table_elem,
           lambda a: a[1].shape[0], lambda a, v: (v + 1) % a[1].shape[0],
           note="an entry request 0 reads"))
    A(Site(G, "528-interleaved-partial", "seq_lens", 2, lambda a: (0,),
           lambda a: _gather_len_bound(a, "seq"), _alt_plus(-1), also_named=("block_table",),
           note="with gather_lens: the first length whose last n positions leave the table"))
    A(Site(G, "528-interleaved-full", "seq_lens", 2, lambda a: (0,),
           lambda a: _gather_len_bound(a, "seq"), _alt_plus(-1),
           note="gather_lens None: n = L, bounded by out rows and the table"))
    A(Site(G, "528-interleaved-partial", "gather_lens", 3, lambda a: (0,),
           lambda a: int(a[2][0]) + 1, _alt_plus(-1), note="bound: seq_lens[0] + 1"))
    A(Site(G, "528-interleaved-partial", "offset", 6, None, _gather_offset_bound, _alt_plus(1),
           note="bound: out.shape[1] - max(n) + 1"))
    # ---- compute_global_topk_indices_and_lens (defined: reads outside the table give -1)
    T5 = "compute_global_topk_indices_and_lens"
    A(Site(T5, "basic", "token_to_req_indices", 1, lambda a: (_topk_present(a)[0],),
           lambda a: a[2].shape[0], lambda a, v: (v + 1) % a[2].shape[0],
           neg="defined", pos="defined", inrange="defined"))
    A(Site(T5, "basic", "block_table", 2, _topk_table_elem, lambda a: _int32_lim(a[3]), _alt_plus(1),
           neg="defined", pos="defined", inrange="defined", note="bound: entry * block_size leaves int32"))
    A(Site(T5, "basic", "topk_indices", 0, _topk_present, lambda a: a[2].shape[1] * a[3], _alt_const(-1),
           neg="defined-skip", pos="defined", inrange="defined", note="bound: table width * block_size"))
    # ---- combine_topk_swa_indices (defined)
    C6 = "combine_topk_swa_indices"
    D = dict(neg="defined", pos="defined", inrange="defined")
    A(Site(C6, "cr4", "query_start_loc", 1, lambda a: (1,), lambda a: int(a[1][2]) + 1, _alt_plus(-1),
           note="bound: query_start_loc[2] + 1 (non-decreasing)", **D))
    A(Site(C6, "cr4", "seq_lens", 2, lambda a: (0,), lambda a: None, _alt_plus(1),
           note="no upper bound (>= the query length and >= gather_lens)", **D))
    A(Site(C6, "cr4", "gather_lens", 3, lambda a: (0,),
           lambda a: min(int(a[2][0]), a[7] - a[8]) + 1, _alt_plus(-1),
           note="bound: min(seq_lens[0], M - N) + 1", **D))
    A(Site(C6, "cr4", "topk_indices", 0, _combine_topk_elem, lambda a: a[8], _alt_const(-1),
           neg="defined-skip", pos="defined", inrange="defined", note="bound: N (values >= N give -1)"))
    # ---- build_flashinfer_mixed_sparse_indices (defined)
    F7 = "build_flashinfer_mixed_sparse_indices"
    A(Site(F7, "global", "token_to_req_indices", 6, lambda a: (a[0].shape[0],),
           lambda a: a[5].shape[0], lambda a, v: (v + 1) % a[5].shape[0],
           note="the first prefill row; bound: number of requests", **D))
    A(Site(F7, "global", "query_start_loc", 4, lambda a: (int(a[6][a[0].shape[0]]) + 1,),
           lambda a: int(a[4][int(a[6][a[0].shape[0]]) + 1]) + 1, _alt_plus(-1),
           note="the end of the first prefill request; bound: a row of the next request leaves it", **D))
    A(Site(F7, "global", "seq_lens", 5, lambda a: (_fi_prefill_row(a)[1],),
           lambda a: a[7].shape[1] * a[8] + 1, _alt_plus(1),
           note="bound: the SWA window leaves the table width", **D))
    A(Site(F7, "global", "swa_block_table", 7, _fi_swa_table_elem, lambda a: _int32_lim(a[8]), _alt_plus(1),
           note="bound: entry * block_size leaves int32", **D))
    A(Site(F7, "global", "compressed_block_table", 9, _fi_comp_table_elem, lambda a: _int32_lim(a[10]),
           _alt_plus(1), note="bound: entry * block_size leaves int32", **D))
    A(Site(F7, "global", "prefill_topk_indices", 3, _fi_pre_elem, lambda a: a[9].shape[1] * a[10],
           _alt_const(-1), neg="defined-skip", pos="defined", inrange="defined",
           note="bound: compressed table width * block size"))
    A(Site(F7, "global", "decode_compressed_topk_lens", 2, lambda a: (0,), lambda a: a[1].shape[1] + 1,
           lambda a, v: v + 1 if v < a[1].shape[1] else v - 1, note="bound: K_dec + 1", **D))
    A(Site(F7, "local-span", "decode_compressed_indices", 1, _fi_local_elem,
           lambda a: a[9].shape[1] * a[10], _alt_const(-1), neg="defined-skip", pos="defined",
           inrange="defined", note="local indices through the compressed table"))
    A(Site(F7, "local-span", "token_to_req_indices", 6, lambda a: (0,), lambda a: a[9].shape[0],
           lambda a, v: (v + 1) % a[9].shape[0], note="a decode row (local indices)", **D))
    # ---- fused_save_compress_norm
    S8 = "fused_save_compress_norm"
    A(Site(S8, "cr2-ring", "slot_mapping", 3, _save_last_of_req0, lambda a: a[2].shape[0] * a[2].shape[1],
           _alt_const(-1), neg="skip", gpu_minus1=True, note="the last token of request 0 (closes, saves a ring row)"))
    A(Site(S8, "cr2-ring", "positions", 1, _save_last_of_req0, lambda a: 2**31, _alt_plus(1),
           note="positions index nothing; bound: int32 positions, [0, 2^31) for a token with a slot"))
    A(Site(S8, "cr2-ring", "query_start_loc", 4, lambda a: (1,), lambda a: a[3].shape[0] + 1, _alt_plus(-1),
           tight=False, gpu_racy=True,
           note="bound: past the token count T (offsets in [0, T] are in bounds; their consistency with "
                "token_to_req_indices is DSV41_VALIDATE's)"))
    A(Site(S8, "cr2-ring", "token_to_req_indices", 5, lambda a: (int(a[4][_save_first_closing_req(a)]),),
           lambda a: a[4].shape[0] - 1, lambda a, v: (v + 1) % (a[4].shape[0] - 1), tight=False,
           note="the first token of a request that closes a group at once; bound: number of requests"))
    A(Site(S8, "cr2-prev-rows", "prev_row_indices", 11, lambda a: (_save_first_closing_req(a),),
           lambda a: a[10].shape[0], _alt_const(0), neg="skip",
           note="the request whose first token pools with a previous row; negative = read the ring"))
    A(Site(S8, "cr1", "slot_mapping", 3, lambda a: _first_writer(a[3]), lambda a: None, _alt_const(-1),
           neg="skip", inrange="marker", note="CR 1: a slot >= 0 only marks a valid token"))
    # ---- save_ring_rows
    A(Site("save_ring_rows", "basic", "slot_mapping", 1, lambda a: _first_writer(a[1]),
           lambda a: a[2].shape[0] * a[2].shape[1], _alt_const(-1), neg="skip", gpu_minus1=True))
    # ---- rope_quant_insert
    A(Site("rope_quant_insert", "528-interleaved-cr2", "slot_mapping", 4,
           lambda a: _first_writer(a[4], a[1], a[5]), lambda a: a[3].shape[0] * a[3].shape[1],
           _alt_const(-1), neg="skip", gpu_minus1=True, note="the first group-closing token"))
    A(Site("rope_quant_insert", "528-cr1", "positions", 1, lambda a: _first_writer(a[4]),
           lambda a: a[2].shape[0], _alt_plus(-1), note="bound: cos_sin_cache.shape[0]"))
    # ---- indexer_k_norm_rope_store
    A(Site("indexer_k_norm_rope_store", "fp8-rows-cr2", "kv_slot_mapping", 6,
           lambda a: _first_writer(a[6], a[1], a[7]), lambda a: a[5].shape[0] * a[5].shape[1],
           _alt_const(-1), neg="skip", gpu_minus1=True, note="the first group-closing token"))
    A(Site("indexer_k_norm_rope_store", "fp8-rows-cr1", "positions", 1, lambda a: _first_writer(a[6]),
           lambda a: a[2].shape[0], lambda a, v: (v + 1) % a[2].shape[0], note="bound: cos_sin_cache.shape[0]"))
    # ---- fused_indexer_q_rope_quant / fused_inv_rope_fp8_quant: positions (no skip value)
    A(Site("fused_indexer_q_rope_quant", "fp8-ocp", "positions", 0, lambda a: (0,), lambda a: a[2].shape[0],
           lambda a, v: (v + 1) % a[2].shape[0]))
    A(Site("fused_inv_rope_fp8_quant", "t1-decode", "positions", 1, lambda a: (0,), lambda a: a[2].shape[0],
           lambda a, v: (v + 1) % a[2].shape[0]))
    # ---- transcode_k_cache: ids outside either cache are skipped
    A(Site("transcode_k_cache", "528-fnuz-to-ocp-b5-nopad-i64", "block_ids", 2, lambda a: (0,),
           lambda a: min(a[0].shape[0], a[1].shape[0]), _alt_const(-1), neg="defined-skip",
           pos="defined-skip", inrange="defined", gpu_minus1=True, note="bound: min(num_blocks)"))
    return S


SITES = _sites()
SITE_BY_ID = {s.id: s for s in SITES}
NO_INDEX_OPS = ("fused_q_kv_rmsnorm_quant", "pad_fused_q_heads")  # no index-like argument


def ops_with_sites() -> list[str]:
    out = []
    for s in SITES:
        if s.op not in out:
            out.append(s.op)
    return out


def _case(op: str, name: str):
    from dsv41.tools.conformance import CASES

    for c in CASES:
        if c.op == op and c.name == name:
            return c
    raise LookupError(f"no conformance case {op}[{name}]")


def build_site_args(site: Site):
    """The case's kernel arguments (CPU) and (element, bound, dtype) of the site."""
    args = _fresh_args(_case(site.op, site.case))
    elem = site.element(args) if site.element is not None else None
    bound = site.bound(args)
    dtype = None if site.element is None else args[site.index].dtype
    return args, elem, bound, dtype


def hostile_values(bound, dtype) -> list[int]:
    vals = []
    if bound is not None:
        vals += [bound, bound + 100]
    vals += [10**6, I32_MAX]
    if dtype is not None:
        vals += [-2, -(10**6), I32_MIN]
    if dtype is None or dtype == torch.int64:
        vals.append(I64_EXTRA)
    lo, hi = (I32_MIN, I32_MAX) if dtype == torch.int32 else (-(2**63), 2**63 - 1)
    out = []
    for v in vals:
        if lo <= v <= hi and v not in out:
            out.append(v)
    return out


@dataclasses.dataclass(frozen=True)
class HostileCase:
    site: str  # Site.id
    value: int
    klass: str  # invalid / skip / valid / marker / defined / defined-skip
    element: tuple | None
    bound: int | None
    orig: int  # the element's value in the unmodified case

    @property
    def id(self) -> str:
        return f"{self.site}={self.value}"


def hostile_cases(op: str | None = None) -> list[HostileCase]:
    """Every (site, hostile value) of ``op`` (or of every op)."""
    out = []
    for s in SITES:
        if op is not None and s.op != op:
            continue
        args, elem, bound, dtype = build_site_args(s)
        orig = int(args[s.index]) if elem is None else int(args[s.index][elem])
        for v in hostile_values(bound, dtype):
            out.append(HostileCase(s.id, v, s.classify(v, bound), elem, bound, orig))
    return out


def apply_value(site: Site, args: list, value: int) -> list:
    """Put ``value`` into the site's element (in place on the CPU arguments); returns args."""
    if site.element is None:
        args[site.index] = int(value)
    else:
        elem = site.element(args)
        args[site.index][elem] = value
        if int(args[site.index][elem]) != value:
            raise ValueError(f"{site.id}: {value} does not fit {args[site.index].dtype}")
    return args


def arg_names(op: str) -> list[str]:
    """The kernel-contract argument names of ``op`` (the reference's parameters, in order)."""
    from dsv41.reference import ReferenceBackend

    return list(inspect.signature(ReferenceBackend().load(op)).parameters)


# ============================================================================ canaries


class Rehomed:
    """Arguments moved into canary-padded buffers on ``device`` (views kept).

    Every distinct storage among the tensor arguments gets one buffer ``[PAD canary | the
    storage's bytes | PAD canary]`` (storage start 64-byte aligned); each tensor is re-viewed
    there with its shape, strides and storage offset.  On the CPU the buffers are numpy
    arrays (filling, copying and checking them runs no torch/OpenMP work)."""

    def __init__(self, args: list, device: str, use_numpy: bool | None = None):
        self.device = device
        self.use_numpy = device == "cpu" if use_numpy is None else use_numpy
        self.args = []
        self.buffers = []  # (buffer uint8 tensor, nbytes, [arg indices])
        by_storage = {}
        for i, x in enumerate(args):
            if not isinstance(x, torch.Tensor):
                self.args.append(x)
                continue
            st = x.untyped_storage()
            key = (st.data_ptr(), st.nbytes()) if st.nbytes() else ("empty", i)
            if key not in by_storage:
                by_storage[key] = len(self.buffers)
                self.buffers.append((self._buffer(st), st.nbytes(), []))
            buf, n, users = self.buffers[by_storage[key]]
            users.append(i)
            item = x.element_size()
            new = torch.empty(0, dtype=x.dtype, device=device)
            new.set_(buf.untyped_storage(), PAD // item + x.storage_offset(), x.shape, x.stride())
            self.args.append(new)
        self.arg_buffer = {i: b for b, (_, _, users) in enumerate(self.buffers) for i in users}

    def _buffer(self, st) -> torch.Tensor:
        import numpy as np

        n = st.nbytes()
        src = torch.empty(0, dtype=torch.uint8).set_(st) if n else None  # bytes of the (CPU) storage
        if self.use_numpy:
            raw = np.full(PAD + n + PAD + 64, CANARY, dtype=np.uint8)
            off = (-raw.ctypes.data) % 64
            arr = raw[off:off + PAD + n + PAD]
            if n:
                arr[PAD:PAD + n] = src.numpy()
            return torch.from_numpy(arr)
        buf = torch.full((PAD + n + PAD,), CANARY, dtype=torch.uint8, device=self.device)
        if n:
            buf[PAD:PAD + n].copy_(src)
        return buf

    def _bytes(self, b: int):
        """numpy copy (CUDA) or view (CPU) of buffer ``b``."""
        buf = self.buffers[b][0]
        return buf.numpy() if buf.device.type == "cpu" else buf.cpu().numpy()

    def sha(self, i: int) -> str:
        b = self.arg_buffer[i]
        n = self.buffers[b][1]
        return hashlib.sha1(self._bytes(b)[PAD:PAD + n].tobytes()).hexdigest()[:16]

    def storage_bytes_equal(self, i: int, t: torch.Tensor) -> bool:
        """Whether argument ``i``'s storage holds exactly the bytes of ``t``'s whole storage."""
        from dsv41.tools.conformance import written_bytes

        b = self.arg_buffer[i]
        n = self.buffers[b][1]
        return self._bytes(b)[PAD:PAD + n].tobytes() == written_bytes(t).numpy().tobytes()

    def check_canaries(self) -> dict:
        """{arg index: description} for every buffer whose canary bytes changed."""
        import numpy as np

        bad = {}
        for b, (buf, n, users) in enumerate(self.buffers):
            a = self._bytes(b)
            msgs = []
            for name, region, base in (("before", a[:PAD], -PAD), ("after", a[PAD + n:], n)):
                ch = np.flatnonzero(region != CANARY)
                if ch.size:
                    lo, hi = int(ch[0]) + base, int(ch[-1]) + base
                    msgs.append(f"{ch.size} canary bytes {name} the storage changed "
                                f"(byte offsets {lo}..{hi} from the storage start, storage {n} bytes)")
            if msgs:
                for i in users:
                    bad[i] = "; ".join(msgs)
        return bad


# ============================================================================ running one job
#
# job = {"impl", "op", "case", "site" (Site.id or None), "value" (int or None: unmodified),
#        "repeat" (runs on fresh identical arguments), "validate" (check_kernel_args first,
#        DSV41_VALIDATE=1), "timeout", "selftest" (harness self-tests, see _selftest)}

_IMPLS = None


def implementations(device: str = "cpu") -> dict:
    """name -> tests.impls.Impl, for the implementations whose tensors live on ``device``."""
    global _IMPLS
    if _IMPLS is None:
        from impls import implementations as _all

        _IMPLS = {im.name: im for im in _all(include_reference=True)}
    return {n: im for n, im in _IMPLS.items() if im.device == device or (n == "reference" and device != "cpu")}


def _impl(name: str, device: str):
    impls = implementations(device)
    if name not in impls:
        raise LookupError(f"implementation {name!r} does not run on {device} here (have {sorted(impls)})")
    return impls[name]


def _first_line(x) -> str:
    lines = str(x).strip().splitlines()
    return lines[0][:300] if lines else ""


def _sync(device):
    if device not in ("cpu", None):
        getattr(torch, device).synchronize()


_BUILT: dict = {}  # (op, case name) -> CPU arguments built once by the fork server (children clone)


def _fresh_args(case) -> list:
    """A deep copy (views kept) of the case's CPU arguments, built once per process."""
    from dsv41.tools.conformance import clone_args

    key = (case.op, case.name)
    if key not in _BUILT:
        _BUILT[key] = case.build("cpu")
    return clone_args(_BUILT[key])


def _one_run(fn, op, case, site, value, device, writes, validate) -> dict:
    args = _fresh_args(case)
    if site is not None and value is not None:
        apply_value(site, args, value)
    rh = Rehomed(args, device)
    tensors = [i for i, x in enumerate(rh.args) if isinstance(x, torch.Tensor)]
    pre = {i: rh.sha(i) for i in tensors}
    run = {"outcome": "returned"}
    t0 = time.perf_counter()
    try:
        if validate:
            from dsv41.core import index_checks

            index_checks.check_kernel_args(op, rh.args)
        fn(*rh.args)
        _sync(device)
    except Exception as exc:  # noqa: BLE001 - the outcome is what we record
        run = {"outcome": "raised", "exc": type(exc).__name__, "msg": str(exc)[:600]}
        if device != "cpu":
            try:
                _sync(device)
            except Exception as exc2:  # noqa: BLE001
                run["device_error"] = f"{type(exc2).__name__}: {_first_line(exc2)}"
    run["seconds"] = round(time.perf_counter() - t0, 4)
    if "device_error" in run:
        return run  # nothing can be read back from a poisoned device context
    run["canary"] = {str(i): m for i, m in rh.check_canaries().items()}
    post = {i: rh.sha(i) for i in tensors}
    run["written"] = {str(i): post[i] for i in writes if i in post}
    run["pre_written"] = {str(i): pre[i] for i in writes if i in pre}
    run["inputs_modified"] = [i for i in tensors if i not in writes and pre[i] != post[i]]
    return run


def execute(job: dict, device: str = "cpu", progress=None) -> dict:
    """Run one job in this process; returns its record (never raises for a kernel's error)."""
    progress = progress or (lambda phase: None)
    if job.get("selftest"):
        return _selftest(job, device, progress)
    device = job.get("device", device)
    saved = os.environ.get("DSV41_VALIDATE")
    try:
        progress("setup")
        if job.get("validate"):
            from dsv41.core import index_checks

            os.environ["DSV41_VALIDATE"] = "1"
            index_checks.refresh()
        case = _case(job["op"], job["case"])
        site = SITE_BY_ID[job["site"]] if job.get("site") else None
        fn = _impl(job["impl"], device).kernel(job["op"])
        runs = []
        for r in range(job.get("repeat", 1)):
            progress(f"run{r}")
            runs.append(_one_run(fn, job["op"], case, site, job.get("value"), device, case.writes,
                                 job.get("validate", False)))
            if "device_error" in runs[-1]:
                break
        return {"status": "ok", "runs": runs}
    except Exception as exc:  # noqa: BLE001 - a harness error (case build, import, ...)
        return {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-2000:]}
    finally:
        if job.get("validate"):
            from dsv41.core import index_checks

            if saved is None:
                os.environ.pop("DSV41_VALIDATE", None)
            else:
                os.environ["DSV41_VALIDATE"] = saved
            index_checks.refresh()


_SELFTEST_CASES = (("quantize_and_insert_k_cache", "528-ocp-interleaved"), ("dequantize_and_gather_k_cache", "584-ocp-full"))


def _selftest(job, device, progress) -> dict:
    """Harness self-tests: a hang, a crash, an abort, an out-of-bounds write, an OpenMP kernel."""
    what = job["selftest"]
    progress(what)
    if what == "sleep":
        time.sleep(10**6)
    if what == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    if what == "abort":
        os.abort()
    if what == "exit3":
        os._exit(3)
    if what == "oob_write":
        # write 8 bytes just past the end of argument 0's storage (and 8 before): the canaries
        # must catch both, attributed to argument 0
        import ctypes

        x = torch.zeros(100, dtype=torch.int32)
        rh = Rehomed([x, torch.ones(3)], device)
        buf, n, _ = rh.buffers[rh.arg_buffer[0]]
        assert rh.args[0].data_ptr() == buf.data_ptr() + PAD
        ctypes.memset(buf.data_ptr() + PAD + n + 16, 0x11, 8)
        ctypes.memset(buf.data_ptr() + PAD - 40, 0x22, 8)
        return {"status": "ok", "runs": [{"outcome": "returned", "canary": {str(i): m for i, m in rh.check_canaries().items()},
                                          "written": {}, "pre_written": {}, "inputs_modified": []}]}
    if what == "oob_kernel":
        # the CPU insert kernel's C entry point, called without the wrapper's bounds scan, with
        # the first slot past the cache: it writes a record past the cache's storage
        from dsv41.backends.cpu import cache_ops

        args = _fresh_args(_case("quantize_and_insert_k_cache", "528-ocp-interleaved"))
        k, cache, _, B, fnuz, width = args[:6]
        inter = bool(args[6]) if len(args) > 6 else False
        slots = torch.tensor([cache.shape[0] * B], dtype=torch.int64)
        rh = Rehomed([k, cache, slots], device)
        k2, c2, s2 = rh.args
        rc = cache_ops.library().dsv41_quantize_insert_k(
            k2.data_ptr(), k2.stride(0), c2.data_ptr(), c2.stride(0), s2.data_ptr(), 1, int(B),
            int(bool(fnuz)), int(width), int(inter))
        return {"status": "ok", "rc": rc, "runs": [{"outcome": "returned", "written": {}, "pre_written": {},
                                                    "inputs_modified": [],
                                                    "canary": {str(i): m for i, m in rh.check_canaries().items()}}]}
    if what == "openmp":
        # torch's intra-op pool and the CPU kernels' OpenMP regions, in the forked child
        t0 = time.perf_counter()
        x = torch.randn(4_000_000)
        y = (x * 2 + 1).sum()  # parallel over 2 threads
        runs = []
        for c in _SELFTEST_CASES:
            case = _case(*c)
            fn = _impl("cpu", "cpu").kernel(case.op)
            runs.append(_one_run(fn, case.op, case, None, None, "cpu", case.writes, False))
        return {"status": "ok", "runs": runs, "threads": torch.get_num_threads(), "value": float(y),
                "seconds": time.perf_counter() - t0}
    if what == "cuda_fault":
        # a kernel storing 1 TiB past its tensor: an illegal address that poisons the context
        import triton
        import triton.language as tl

        @triton.jit
        def _wild_store(p):
            tl.store(p + (1 << 38), 1.0)

        case = _case("save_ring_rows", "basic")
        run = _one_run(lambda *a: _wild_store[(1,)](a[2]), case.op, case, None, None, device, case.writes, False)
        return {"status": "ok", "runs": [run]}
    if what == "threads":
        return {"status": "ok", "runs": [], "threads_in_child": len(os.listdir("/proc/self/task"))}
    raise ValueError(f"unknown selftest {what!r}")


# ============================================================================ the fork server


def _server_preload(device: str) -> dict:
    """Import everything and load every kernel library without running any kernel."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton_interp import enable_exact_interpreter, interpreter_unsupported_reason

        if interpreter_unsupported_reason() is None:
            enable_exact_interpreter()
    from dsv41.core import platform
    from dsv41.tools.conformance import CASES  # noqa: F401
    from dsv41.core.registry import OPS

    impls = implementations(device)
    plat = platform.probe()
    # Build every case the matrix uses once, single-threaded (torch runs no OpenMP region with
    # one thread, so no thread pool exists to be lost by fork); children clone these.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for s in SITES:
        c = _case(s.op, s.case)
        if (c.op, c.name) not in _BUILT:
            _BUILT[(c.op, c.name)] = c.build("cpu")
    for c in _SELFTEST_CASES:
        if c not in _BUILT:
            _BUILT[c] = _case(*c).build("cpu")
    loaded = {}
    for name, im in impls.items():
        for op in OPS:
            if op not in im.backend.kernels:
                continue
            try:
                im.backend.reasons(op, plat)  # the cpu sheet builds / dlopens its library here
                im.kernel(op)
                loaded[f"{name}:{op}"] = "ok"
            except Exception as exc:  # noqa: BLE001 - reported by the jobs that need it
                loaded[f"{name}:{op}"] = f"{type(exc).__name__}: {exc}"[:300]
    try:  # the CPU kernels' bound scans, where the tree has them (dlopen, nothing run)
        from dsv41.backends.cpu import bounds

        bounds._library()
    except Exception:  # noqa: BLE001
        pass
    return {"impls": sorted(impls), "loaded": loaded, "torch_threads": threads}


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


class _Child:
    def __init__(self, jid, pid, rfd, errpath, timeout):
        self.jid, self.pid, self.rfd, self.errpath, self.timeout = jid, pid, rfd, errpath, timeout
        self.start = time.monotonic()
        self.buf = b""
        self.eof = False
        self.status = None


_CHILD_THREADS = None  # torch threads to restore in a child (the server runs with one)


def _start_child(jid, job, device, mem_bytes) -> _Child:
    import tempfile

    r, w = os.pipe()
    fd, errpath = tempfile.mkstemp(prefix="hostile-", suffix=".err")
    pid = os.fork()
    if pid == 0:  # ---- child
        t_fork = time.perf_counter()
        try:
            os.setpgid(0, 0)
            os.close(r)
            os.dup2(fd, 2)
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(fd, 1)
            import faulthandler

            faulthandler.enable(file=sys.stderr, all_threads=True)
            if _CHILD_THREADS:
                torch.set_num_threads(_CHILD_THREADS)
            if mem_bytes:
                import resource

                lim = _vm_size() + mem_bytes
                resource.setrlimit(resource.RLIMIT_AS, (lim, lim))

            def progress(phase):
                os.write(w, (json.dumps({"phase": phase}) + "\n").encode())

            rec = execute(job, device, progress)
            rec["child_seconds"] = round(time.perf_counter() - t_fork, 4)
            data = (json.dumps({"record": rec}) + "\n").encode()
            while data:
                data = data[os.write(w, data):]
        except BaseException:  # noqa: BLE001
            try:
                os.write(w, (json.dumps({"record": {"status": "error", "error": traceback.format_exc()[-2000:]}}) + "\n").encode())
            except Exception:  # noqa: BLE001
                pass
        finally:
            os._exit(0)
    os.close(w)
    os.close(fd)
    return _Child(jid, pid, r, errpath, job.get("timeout") or NATIVE_TIMEOUT)


def crash_where(stderr: str) -> str:
    """'Fatal Python error: ...' and the innermost project frame of the crashing thread
    (faulthandler's dump: most recent call first), from a child's stderr."""
    import re

    fatal = next((ln.strip() for ln in stderr.splitlines() if ln.startswith("Fatal Python error")), "")
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', stderr)
    mine = next((f for f in frames if ("/backends/" in f[0] or "/dsv41/" in f[0])), None)
    where = f"{Path(mine[0]).parent.name}/{Path(mine[0]).name}:{mine[1]} in {mine[2]}" if mine else ""
    return "; ".join(x for x in (fatal, f"at {where}" if where else "") if x)


def _finish_child(ch: _Child, status, hung: bool) -> dict:
    while not ch.eof:
        data = os.read(ch.rfd, 1 << 16)
        if not data:
            break
        ch.buf += data
    os.close(ch.rfd)
    try:
        with open(ch.errpath, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 20000))
            err = f.read().decode(errors="replace")
        os.unlink(ch.errpath)
    except OSError:
        err = ""
    phase, rec = None, None
    for line in ch.buf.decode(errors="replace").splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if "phase" in msg:
            phase = msg["phase"]
        if "record" in msg:
            rec = msg["record"]
    secs = round(time.monotonic() - ch.start, 3)
    if hung:
        return {"status": "hang", "phase": phase, "timeout": ch.timeout, "stderr": err[-1500:], "wall": secs}
    where = crash_where(err)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return {"status": "crash", "signal": signal.Signals(sig).name, "phase": phase, "where": where,
                "stderr": err[-1500:], "wall": secs}
    code = os.WEXITSTATUS(status)
    if code != 0 or rec is None:
        return {"status": "crash", "exit": code, "phase": phase, "where": where, "stderr": err[-1500:], "wall": secs}
    rec["wall"] = secs
    return rec


def run_jobs_forked(jobs: list, device: str, parallel: int, mem_bytes: int, emit) -> None:
    """Fork one child per job (``parallel`` at a time); ``emit(index, record)`` as they finish."""
    pending = collections.deque(enumerate(jobs))
    running: dict = {}
    while pending or running:
        while pending and len(running) < parallel:
            jid, job = pending.popleft()
            ch = _start_child(jid, job, device, mem_bytes)
            running[ch.pid] = ch
        now = time.monotonic()
        wait = min([max(0.0, ch.start + ch.timeout - now) for ch in running.values()] + [0.2])
        rl = [ch.rfd for ch in running.values() if not ch.eof]
        if rl:
            ready, _, _ = select.select(rl, [], [], wait)
        else:
            ready = []
            time.sleep(min(wait, 0.02))
        for ch in running.values():
            if ch.rfd in ready:
                data = os.read(ch.rfd, 1 << 16)
                if data:
                    ch.buf += data
                else:
                    ch.eof = True
        for pid, ch in list(running.items()):
            # EOF on the pipe: the child is in os._exit (nothing else holds the write end)
            done, status = os.waitpid(pid, 0 if ch.eof else os.WNOHANG)
            if done:
                del running[pid]
                emit(ch.jid, _finish_child(ch, status, False))
            elif time.monotonic() - ch.start > ch.timeout:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                del running[pid]
                emit(ch.jid, _finish_child(ch, status, True))


def serve(device: str = "cpu") -> None:
    """The fork server: JSON lines on stdin ({"jobs": [...], "parallel": n, "mem_gb": g}),
    JSON lines on stdout ({"i": index, "record": ...} then {"done": true})."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything printed by imported code goes to stderr, not into the protocol
    global _CHILD_THREADS
    info = _server_preload(device)
    _CHILD_THREADS = info["torch_threads"]
    import gc

    gc.collect()
    gc.freeze()  # a child's collections then skip the server's objects (no copy-on-write storm)
    info["threads"] = len(os.listdir("/proc/self/task"))  # must be 1: nothing to inherit by fork
    info["pid"] = os.getpid()
    info["torch_threads_setting"] = torch.get_num_threads()
    out.write(json.dumps({"hello": info}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        mem = int(float(req.get("mem_gb", 4)) * 2**30)

        def emit(i, rec):
            out.write(json.dumps({"i": i, "record": rec}) + "\n")

        run_jobs_forked(req["jobs"], device, int(req.get("parallel", 2)), mem, emit)
        out.write(json.dumps({"done": True, "threads": len(os.listdir("/proc/self/task"))}) + "\n")
    out.flush()
    os._exit(0)  # skip interpreter teardown (Triton's bindings print leak reports there)


class ForkServer:
    """Client of ``serve()`` in a fresh interpreter (never the pytest process itself, which may
    have run OpenMP work already: a child forked from it could hang in a dead thread pool)."""

    def __init__(self, device: str = "cpu", parallel: int | None = None, env: dict | None = None,
                 mem_gb: float | None = None):
        self.parallel = parallel or max(1, min(4, os.cpu_count() or 1))
        self.mem_gb = mem_gb if mem_gb is not None else float(os.environ.get("DSV41_HOSTILE_MEM_GB", "4"))
        e = dict(os.environ)
        e.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's OpenBLAS starts no thread at import
        e.update(env or {})
        e["PYTHONPATH"] = os.pathsep.join([str(HERE)] + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", "--device", device],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=e, text=True, bufsize=1)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"hostile fork server died at start (exit {self.proc.wait()})")
        self.hello = json.loads(line)["hello"]
        self.cache: dict = {}
        self.last_threads = self.hello["threads"]

    def run(self, jobs: list) -> list:
        """Records of ``jobs`` (cached by job)."""
        keys = [json.dumps(j, sort_keys=True) for j in jobs]
        todo = [k for k in dict.fromkeys(keys) if k not in self.cache]
        if todo:
            req = {"jobs": [json.loads(k) for k in todo], "parallel": self.parallel, "mem_gb": self.mem_gb}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            while True:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"hostile fork server died (exit {self.proc.wait()})")
                msg = json.loads(line)
                if msg.get("done"):
                    self.last_threads = msg.get("threads")
                    break
                self.cache[todo[msg["i"]]] = msg["record"]
        return [self.cache[k] for k in keys]

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class InProcess:
    """The same interface in one process (the GPU CLI: no fork after CUDA init).  A CUDA error
    poisons the context: every later job is reported as not run."""

    def __init__(self, device: str, verbose=None, hang_timeout: float | None = None):
        self.device = device
        self.cache: dict = {}
        self.poisoned = None
        self.verbose = verbose
        self.hang_timeout = hang_timeout

    def run(self, jobs: list) -> list:
        import faulthandler

        out = []
        for j in jobs:
            k = json.dumps(j, sort_keys=True)
            if k not in self.cache:
                if self.poisoned:
                    self.cache[k] = {"status": "not-run", "error": f"device context poisoned by {self.poisoned}"}
                else:
                    if self.verbose:
                        self.verbose(f"RUN {j['impl']} {job_case_id(j)}")
                    # a hang aborts the process with every thread's stack; the '...' line above names the job
                    faulthandler.dump_traceback_later(self.hang_timeout or j.get("timeout") or NATIVE_TIMEOUT, exit=True)
                    try:
                        rec = execute(j, self.device)
                    finally:
                        faulthandler.cancel_dump_traceback_later()
                    for r in rec.get("runs", []):
                        if "device_error" in r:
                            self.poisoned = _job_label(j)
                            rec = {"status": "crash", "error": r["device_error"], "phase": "kernel", "runs": rec["runs"]}
                    self.cache[k] = rec
            out.append(self.cache[k])
        return out

    def close(self):
        pass


def _job_label(j) -> str:
    return f"{j['impl']} {job_case_id(j)}"


def job_case_id(j) -> str:
    """The Outcome.case_id a job belongs to (HostileCase.id, '<site>=-1' or '<op>[<case>]')."""
    if j.get("site"):
        return f"{j['site']}={j['value']}"
    return f"{j['op']}[{j['case']}]"


# ============================================================================ expectations


def is_gpu_kernel(impl: str) -> bool:
    return impl not in HOST_IMPLS


def timeout_for(impl: str) -> float:
    return INTERP_TIMEOUT if impl.endswith("@interp") else NATIVE_TIMEOUT


def _job(impl, op, case, site=None, value=None, repeat=1, validate=False, device=None):
    j = {"impl": impl, "op": op, "case": case, "timeout": timeout_for(impl), "repeat": repeat}
    if site is not None:
        j["site"], j["value"] = site, value
    if validate:
        j["validate"] = True
    if device is not None:
        j["device"] = device
    return j


def _ref_job(op, case, site=None, value=None):
    """The reference on CPU tensors (the expected bytes; its bytes are the same on any device)."""
    return _job("reference", op, case, site, value, device="cpu")


def _needs_ref(impl: str, klass: str) -> bool:
    return impl != "reference" and klass in ("defined", "defined-skip", "valid")


@dataclasses.dataclass
class Outcome:
    impl: str
    case_id: str  # HostileCase.id or "<op>[<case>]" (baseline)
    klass: str
    summary: str  # what happened
    failures: list  # why it is wrong (empty: pass)

    @property
    def ok(self) -> bool:
        return not self.failures


def _describe(rec) -> str:
    st = rec.get("status")
    if st == "hang":
        return f"hang (killed after {rec.get('timeout')} s, in {rec.get('phase')})"
    if st == "crash":
        how = rec.get("signal") or (f"exit {rec.get('exit')}" if "exit" in rec else _first_line(rec.get("error", "")))
        return f"crash ({how}, in {rec.get('phase')})"
    if st in ("error", "not-run"):
        return f"{st}: {_first_line(rec.get('error', ''))}"
    r = rec["runs"][0]
    s = "returned" if r["outcome"] == "returned" else f"raised {r['exc']}: {_first_line(r['msg'])[:200]}"
    if r.get("canary"):
        s += " | CANARY " + "; ".join(f"arg {i}: {m}" for i, m in r["canary"].items())
    return s


def _written(rec, run=0):
    if rec.get("status") != "ok" or len(rec.get("runs", [])) <= run:
        return None
    r = rec["runs"][run]
    return r["written"] if r["outcome"] == "returned" else None


def _basic_failures(rec, impl, names) -> list:
    """The rules of every implementation: ran to the end, canaries, inputs, exception types."""
    f = []
    st = rec.get("status")
    if st == "hang":
        return [f"hang: no result after {rec.get('timeout')} s (in {rec.get('phase')})"]
    if st == "crash":
        how = rec.get("signal") or (f"exit {rec.get('exit')}" if "exit" in rec else _first_line(rec.get("error", "")))
        return [f"crash: {how} (in {rec.get('phase')})" + (f" -- {rec['where']}" if rec.get("where") else "")]
    if st != "ok":
        return [f"{st}: {rec.get('error', '')[:400]}"]
    for k, r in enumerate(rec["runs"]):
        tag = "" if k == 0 else f" (run {k + 1})"
        for i, m in r.get("canary", {}).items():
            f.append(f"canary around arg {i} '{names[int(i)] if int(i) < len(names) else i}' changed{tag}: {m}")
        for i in r.get("inputs_modified", []):
            f.append(f"read-only arg {i} '{names[i] if i < len(names) else i}' was modified{tag}")
        if r["outcome"] == "raised":
            if is_gpu_kernel(impl):
                f.append(f"raised {r['exc']}{tag} (a GPU kernel must not raise): {r['msg'][:200]}")
            elif r["exc"] not in ("ValueError", "TypeError"):
                f.append(f"raised {r['exc']}{tag}, expected ValueError/TypeError at most: {r['msg'][:200]}")
    return f


def evaluate(impl: str, hc: HostileCase, rec: dict, base: dict, names: list) -> list:
    """Failures of one hostile case.  ``base``: records keyed 'orig' (unmodified call, same
    impl), 'minus1' (-1 in the element, same impl), 'ref' (the reference, same hostile input)."""
    site = SITE_BY_ID[hc.site]
    f = _basic_failures(rec, impl, names)
    if rec.get("status") != "ok":
        return f
    r0 = rec["runs"][0]
    k = hc.klass
    gpu = is_gpu_kernel(impl)
    got = _written(rec)

    def same_as(key, what):
        b = base.get(key)
        want = _written(b) if b is not None else None
        if b is None:
            return
        if want is None:
            f.append(f"cannot compare with {what}: it did not return ({_describe(b)})")
        elif got is not None and got != want:
            diff = [i for i in got if got[i] != want.get(i)]
            f.append(f"written bytes differ from {what} (args {', '.join(diff)})")

    if gpu:
        if (len(rec["runs"]) >= 2 and r0["outcome"] == "returned" and rec["runs"][1]["outcome"] == "returned"
                and not (site.gpu_racy and k == "invalid")):
            if rec["runs"][0]["written"] != rec["runs"][1]["written"]:
                f.append("not deterministic: two runs on identical inputs wrote different bytes")
        if k in ("skip", "defined-skip") or (k == "invalid" and site.gpu_minus1):
            same_as("minus1", "the call with -1 there")
        if k in ("defined", "defined-skip", "valid"):
            same_as("ref", "the reference on the same input")
        if k == "marker":
            same_as("orig", "the unmodified call")
        return f
    # reference / cpu
    if k == "invalid":
        if r0["outcome"] == "returned":
            f.append(f"returned; expected ValueError naming '{site.arg}'")
        elif r0["exc"] == "ValueError" and not any(f"'{a}'" in r0["msg"] for a in (site.arg, *site.also_named)):
            f.append(f"the ValueError does not name '{site.arg}'")
        elif r0["exc"] == "TypeError":
            f.append(f"raised {r0['exc']}, expected ValueError naming '{site.arg}'")
        if r0["written"] != r0["pre_written"]:
            diff = [i for i in r0["written"] if r0["written"][i] != r0["pre_written"].get(i)]
            f.append(f"wrote into args {', '.join(diff)} (an invalid call must write nothing)")
        return f
    if r0["outcome"] == "raised":
        f.append(f"raised {r0['exc']} for a {k} value: {r0['msg'][:200]}")
        return f
    if k in ("skip", "defined-skip"):
        same_as("minus1", "the call with -1 there")
    if k in ("defined", "defined-skip") or (k == "valid" and impl != "reference"):
        if impl != "reference":
            same_as("ref", "the reference on the same input")
    if k == "marker":
        same_as("orig", "the unmodified call")
    return f


def evaluate_baseline(impl: str, rec: dict, ref: dict | None, names: list) -> list:
    f = _basic_failures(rec, impl, names)
    if rec.get("status") == "ok" and rec["runs"][0]["outcome"] == "raised":
        f.append(f"an in-range call raised {rec['runs'][0]['exc']}: {rec['runs'][0]['msg'][:200]}")
    if not f and ref is not None and impl != "reference":
        got, want = _written(rec), _written(ref)
        if want is not None and got != want:
            f.append("in-range call: written bytes differ from the reference (a conformance failure)")
    return f


# ============================================================================ the matrix of one (impl, op)


def plan(impl: str, op: str, cases: list | None = None):
    """(jobs, cases) of the matrix of ``op`` on ``impl``: the hostile calls (twice for a GPU
    kernel), the unmodified call, the call with -1 in the element where a value is compared
    with it, and the reference's calls the comparisons need."""
    cases = hostile_cases(op) if cases is None else cases
    gpu = is_gpu_kernel(impl)
    jobs = []
    for c in cases:
        s = SITE_BY_ID[c.site]
        jobs.append(_job(impl, s.op, s.case))  # orig (baseline)
        if impl != "reference":
            jobs.append(_ref_job(s.op, s.case))
        if s.needs_minus1(gpu):
            jobs.append(_job(impl, s.op, s.case, s.id, -1))
        jobs.append(_job(impl, s.op, s.case, s.id, c.value, 2 if gpu else 1))
        if _needs_ref(impl, c.klass):
            jobs.append(_ref_job(s.op, s.case, s.id, c.value))
    jobs = list({json.dumps(j, sort_keys=True): j for j in jobs}.values())
    # baselines and the reference's calls first: in one process (the GPU CLI) a hostile call
    # that poisons the device context then leaves every comparison it needs already done
    hostile = [j for j in jobs if j["impl"] == impl and j.get("site") and j["value"] != -1]
    return [j for j in jobs if j not in hostile] + hostile, cases


def run_matrix(runner, impl: str, op: str, cases: list | None = None) -> list[Outcome]:
    """Run the hostile matrix of ``op`` on ``impl`` through ``runner`` (ForkServer / InProcess);
    one Outcome per baseline (unmodified call, -1 call) and per hostile case."""
    jobs, cases = plan(impl, op, cases)
    recs = dict(zip([json.dumps(j, sort_keys=True) for j in jobs], runner.run(jobs)))

    def get(j):
        return recs.get(json.dumps(j, sort_keys=True))

    gpu = is_gpu_kernel(impl)
    names = arg_names(op)
    out = []
    seen = set()
    for c in cases:
        s = SITE_BY_ID[c.site]
        orig = get(_job(impl, s.op, s.case))
        if s.case not in seen:
            seen.add(s.case)
            ref_orig = get(_ref_job(s.op, s.case)) if impl != "reference" else None
            out.append(Outcome(impl, f"{s.op}[{s.case}]", "baseline", _describe(orig),
                               evaluate_baseline(impl, orig, ref_orig, names)))
        m1 = get(_job(impl, s.op, s.case, s.id, -1)) if s.needs_minus1(gpu) else None
        if m1 is not None and s.id not in seen:
            seen.add(s.id)
            out.append(Outcome(impl, f"{s.id}=-1", "baseline", _describe(m1),
                               evaluate_baseline(impl, m1, None, names)))
        base = {"orig": orig, "minus1": m1,
                "ref": get(_ref_job(s.op, s.case, s.id, c.value)) if _needs_ref(impl, c.klass) else None}
        rec = get(_job(impl, s.op, s.case, s.id, c.value, 2 if gpu else 1))
        out.append(Outcome(impl, c.id, c.klass, _describe(rec), evaluate(impl, c, rec, base, names)))
    return out


def validate_sample(op: str | None = None) -> list[HostileCase]:
    """A sample of invalid cases (the bound and -2 where invalid) of the ops index_checks covers."""
    out = []
    for c in hostile_cases(op):
        if c.klass == "invalid" and (c.value == c.bound or c.value == -2):
            out.append(c)
    return out


def format_outcome(o: Outcome) -> str:
    head = "PASS" if o.ok else "FAIL"
    s = f"{head} {o.impl:20s} {o.case_id} ({o.klass}): {o.summary}"
    if o.failures:
        s += "\n      -> " + "\n      -> ".join(o.failures)
    return s


# ============================================================================ CLI


def _isolated(a, impls, ops) -> list[Outcome]:
    """--isolate: every (impl, op) in a fresh process of this CLI (never a fork).  A case that
    poisons the device context: the process ends its run (later cases not run) and a new one
    resumes after that case.  A case that kills the process (the 'RUN' line printed before each
    job names it): a new one runs everything but that case."""
    import tempfile

    out = []
    for impl in impls:
        for op in ops:
            done: dict = {}
            resume, skip = None, []
            for _ in range(100):
                fd, tmp = tempfile.mkstemp(suffix=".json")
                os.close(fd)
                cmd = [sys.executable, str(Path(__file__).resolve()), "--device", a.device, "--impl", impl,
                       "--op", op, "--json", tmp, "--quiet", "--child"]
                cmd += ["--resume-after", resume] if resume else []
                cmd += ["--in-process"] if a.device == "cpu" else []
                for c in skip:
                    cmd += ["--skip-case", c]
                if a.hang_timeout:
                    cmd += ["--hang-timeout", str(a.hang_timeout)]
                last = None
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
                for line in proc.stdout:
                    if line.startswith("RUN "):
                        last = line.split(" ", 2)[2].strip()
                    elif not line.startswith("PASS"):
                        print(line, end="", flush=True)
                rc = proc.wait()
                try:
                    with open(tmp) as f:
                        got = [Outcome(**o) for o in json.load(f)]
                except (OSError, ValueError):
                    got = None
                os.unlink(tmp)
                if got is None:  # the process died: blame the job it was running, run the rest again
                    how = f"signal {-rc}" if rc < 0 else f"exit {rc}"
                    if last is None or last in skip or "=" not in last:
                        done.setdefault(f"{op} (process)", Outcome(impl, f"{op} (process)", "?", f"died ({how})",
                                                                   [f"the process died ({how}) outside a hostile case"]))
                        break
                    done[last] = Outcome(impl, last, "?", f"crash (process {how})",
                                         [f"crash: the process died ({how}) while running it"])
                    print(format_outcome(done[last]), flush=True)
                    skip.append(last)
                    continue
                for o in got:
                    if not o.summary.startswith("not-run"):
                        done.setdefault(o.case_id, o)
                if not any(o.summary.startswith("not-run") for o in got):
                    break
                nxt = next((o.case_id for o in got if o.summary.startswith("crash") and "=" in o.case_id
                            and not o.case_id.endswith("=-1")), None)
                if nxt is None or nxt == resume:
                    done.update({o.case_id: o for o in got if o.summary.startswith("not-run")})
                    break
                resume = nxt
            out.extend(done.values())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "xpu"))
    p.add_argument("--impl", default="all", help="implementation name(s), comma-separated (tests/impls.py), or 'all'")
    p.add_argument("--op", action="append", help="only this op (repeatable)")
    p.add_argument("--json", help="write every outcome here")
    p.add_argument("--parallel", type=int, default=None, help="children at a time (cpu)")
    p.add_argument("--hang-timeout", type=float, default=None,
                   help="seconds before a case counts as a hang (default 20; 60 in the interpreter)")
    p.add_argument("--in-process", action="store_true",
                   help="cpu: run in this process like the GPU path (no fork: a crash ends the run)")
    p.add_argument("--isolate", action="store_true",
                   help="one fresh process per (impl, op), restarted after a case that kills it or "
                        "poisons the device context (default: everything in one process)")
    p.add_argument("--resume-after", help="skip the op's hostile cases up to this case id")
    p.add_argument("--skip-case", action="append", default=[], help="skip this hostile case id (repeatable)")
    p.add_argument("--quiet", action="store_true", help="print failing outcomes only")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a process of --isolate
    p.add_argument("--list", action="store_true", help="list the hostile cases and exit")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    global INTERP_TIMEOUT, NATIVE_TIMEOUT
    if a.hang_timeout:
        INTERP_TIMEOUT = NATIVE_TIMEOUT = a.hang_timeout
    if a.serve:
        serve(a.device)
        return 0
    if a.list:
        print("sites (negative: what a value < 0 means; >= bound: what a value past the bound means):")
        for s in SITES:
            _, elem, bound, _ = build_site_args(s)
            past = f">= bound {s.pos:12s}" if bound is not None else f">= 0     {s.inrange:12s}"
            neg = s.neg if elem is not None else "-"
            print(f"  {s.id:75s} element {elem!s:8s} bound {bound!s:11s} negative {neg:12s} "
                  f"{past}{' gpu:-1' if s.gpu_minus1 else ''}  {s.note}")
        print(f"ops without an index argument: {', '.join(NO_INDEX_OPS)}\ncases:")
        for c in hostile_cases():
            print(f"  {c.id:85s} {c.klass:13s} (element {c.element} was {c.orig})")
        return 0
    if a.device == "cuda":
        # every tensor its own cudaMalloc: compute-sanitizer then sees accesses past a buffer
        os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    t0 = time.time()
    ops = a.op or ops_with_sites()
    forked = a.device == "cpu" and not a.in_process and not a.isolate
    names = list(implementations(a.device))
    if a.impl == "all":
        # the reference on a GPU reports bad indices with device-side asserts, which poison the
        # context: name it explicitly to run it there
        impls = [n for n in names if a.device == "cpu" or n != "reference"]
    else:
        impls = a.impl.split(",")
    bad = [n for n in impls if n not in names]
    if bad:
        print(f"implementations not available on {a.device}: {bad}; available: {names}", file=sys.stderr)
        return 2
    allout = []
    if a.isolate:
        allout = _isolated(a, impls, ops)
    else:
        # in one process a hang ends the run (faulthandler): allow for JIT compiles and sanitizers
        runner = ForkServer("cpu", parallel=a.parallel) if forked else \
            InProcess(a.device, verbose=lambda m: print(m, flush=True), hang_timeout=a.hang_timeout or 300)
        for impl in impls:
            for op in ops:
                why = implementations(a.device)[impl].skip_reason(op)
                if why:
                    print(f"SKIP {impl:20s} {op}: {why}", flush=True)
                    continue
                cases = hostile_cases(op)
                if a.resume_after:
                    ids = [c.id for c in cases]
                    if a.resume_after in ids:
                        cases = cases[ids.index(a.resume_after) + 1:]
                cases = [c for c in cases if c.id not in a.skip_case]
                for o in run_matrix(runner, impl, op, cases):
                    allout.append(o)
                    if not (a.quiet and o.ok):
                        print(format_outcome(o), flush=True)
        runner.close()
    nfail = sum(not o.ok for o in allout)
    if a.json:
        with open(a.json, "w") as f:
            json.dump([dataclasses.asdict(o) for o in allout], f, indent=1)
    if not a.child:
        print(f"\n== summary: {len(allout)} outcomes, {len(allout) - nfail} passed, {nfail} failed "
              f"({time.time() - t0:.0f} s)")
        by = collections.Counter((o.impl, o.case_id.split("=")[0]) for o in allout if not o.ok)
        for (impl, site), n in sorted(by.items()):
            print(f"   {impl:20s} {site}: {n} failing")
        notrun = [o for o in allout if o.summary.startswith("not-run")]
        if notrun:
            print(f"   {len(notrun)} outcomes not run: {notrun[0].summary}; rerun with --isolate "
                  f"(a fresh process per op, resumed after a poisoning case) to cover them")
    return 1 if nfail else 0


if __name__ == "__main__":
    sys.exit(main())

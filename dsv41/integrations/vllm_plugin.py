"""vLLM general plugin: route vLLM's DeepSeek V4 / V4.1 op names to dsv41.

Installed as the ``vllm.general_plugins`` entry point ``dsv41`` (``pip install "dsv41[vllm]"``);
vLLM calls ``register()`` once in every process, before any model loads.  For each target name
of the installed vLLM version (``KNOWN`` below) it compares vLLM's signature with dsv41's and,
when they agree and the op is selected, rebinds the name on vLLM's defining module, its package
and every loaded ``vllm.*`` module holding the old function.  The defining modules are imported
here, so model code imported later picks up dsv41's function.  One log line per op (logger
``dsv41.vllm``): ``routed <vllm name> -> dsv41 <implementation>`` or ``kept <vllm name>: <why>``.

``DSV41_VLLM_OPS`` chooses: unset = the version's default (everything compatible except the ops
the table marks as byte-different), ``all``, ``none``, or a comma list of names (the function
name, which selects it in both the V4 and the V4.1 package, or the full dotted vLLM name).
On a vLLM version not in ``KNOWN`` nothing is routed unless the variable says ``all`` or names
ops; those are then routed with a WARNING.  docs/vllm_plugin.md explains the choices.

vLLM is imported only inside ``register()``; importing this module imports neither vLLM nor
anything that touches a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import os
import sys
import threading

__all__ = ["register", "routed", "decisions", "signature_problem", "KNOWN", "Target", "Version", "Decision", "ENV"]

log = logging.getLogger("dsv41.vllm")

ENV = "DSV41_VLLM_OPS"

V41 = "vllm.models.deepseek_v41.common.ops"
V4 = "vllm.models.deepseek_v4.common.ops"


@dataclasses.dataclass(frozen=True)
class Target:
    """One vLLM function and the dsv41 function that can take its place.

    module: the vLLM module that defines the function; name: its attribute there (dsv41's
    function has the same name); dsv41: the dsv41 module holding it; op: the registry op it
    dispatches through (None: a host-side helper without kernels); adapt: a name in
    ``_ADAPTERS`` when dsv41's return value must be turned into vLLM's class.
    """

    module: str
    name: str
    dsv41: str
    op: str | None = None
    adapt: str | None = None

    @property
    def vllm_name(self) -> str:
        return f"{self.module}.{self.name}"


@dataclasses.dataclass(frozen=True)
class Version:
    targets: tuple
    # name (short or dotted) -> why its bytes may differ from this vLLM version's kernels:
    # kept unless DSV41_VLLM_OPS names it (or says all).
    differs: dict = dataclasses.field(default_factory=dict)
    # name -> why routing it is not wanted even though it is compatible: kept unless named.
    keep: dict = dataclasses.field(default_factory=dict)


def _v41(sub: str, name: str, dsv41: str, op: str | None = None, adapt: str | None = None) -> Target:
    return Target(f"{V41}.{sub}", name, dsv41, op, adapt)


def _v4(sub: str, name: str, dsv41: str, op: str | None = None) -> Target:
    return Target(f"{V4}.{sub}", name, dsv41, op)


# Every function vLLM 0.33.0's model code imports from the V4.1 ops package (and its submodules
# cache_utils, fused_compress_quant_cache, fused_layout, indexer_k_store, query_quant), the two
# cache_utils helpers its gather calls through module globals, and the public functions of the
# V4 ops package.  Listed from the wheel with an ast pass over vllm/ (docs/vllm_plugin.md).
_TARGETS_0_33 = (
    _v41("cache_utils", "quantize_and_insert_k_cache", "dsv41.cache_utils", "quantize_and_insert_k_cache"),
    _v41("cache_utils", "dequantize_and_gather_k_cache", "dsv41.cache_utils", "dequantize_and_gather_k_cache"),
    _v41("cache_utils", "dequantize_and_gather_k_cache_triton", "dsv41.cache_utils", "dequantize_and_gather_k_cache"),
    _v41("cache_utils", "gather_num_workers", "dsv41.cache_utils"),
    _v41("cache_utils", "compute_global_topk_indices_and_lens", "dsv41.cache_utils", "compute_global_topk_indices_and_lens"),
    _v41("cache_utils", "combine_topk_swa_indices", "dsv41.cache_utils", "combine_topk_swa_indices"),
    _v41("cache_utils", "build_flashinfer_mixed_sparse_indices", "dsv41.cache_utils", "build_flashinfer_mixed_sparse_indices"),
    _v41("fused_compress_quant_cache", "fused_save_compress_norm", "dsv41.fused_compress_quant_cache", "fused_save_compress_norm"),
    _v41("fused_compress_quant_cache", "save_ring_rows", "dsv41.fused_compress_quant_cache", "save_ring_rows"),
    _v41("fused_compress_quant_cache", "rope_quant_insert", "dsv41.fused_compress_quant_cache", "rope_quant_insert"),
    _v41("fused_layout", "q_fused_permutation", "dsv41.fused_layout"),
    _v41("fused_layout", "o_fused_permutation", "dsv41.fused_layout"),
    _v41("fused_layout", "o_fused_chunk_permutation", "dsv41.fused_layout"),
    _v41("fused_layout", "permute_on_load", "dsv41.fused_layout"),
    _v41("indexer_k_store", "indexer_k_norm_rope_store", "dsv41.indexer_k_store", "indexer_k_norm_rope_store"),
    _v41("query_quant", "fused_q_kv_rmsnorm_quant", "dsv41.query_quant", "fused_q_kv_rmsnorm_quant", "quantized_activation"),
    _v41("query_quant", "mxfp8_scale_bytes", "dsv41.query_quant"),
    _v41("query_quant", "mxfp8_scale_offset", "dsv41.query_quant"),
    _v41("query_quant", "can_fuse_query_quant", "dsv41.query_quant"),
    # V4 package (the V4.1 package re-exports these two: the same function objects)
    _v4("fused_indexer_q", "fused_indexer_q_rope_quant", "dsv41.indexer_q", "fused_indexer_q_rope_quant"),
    _v4("fused_inv_rope_fp8_quant", "fused_inv_rope_fp8_quant", "dsv41.inv_rope", "fused_inv_rope_fp8_quant"),
    # V4 package's own cache_utils (584 B records; the index builders take image-token arguments)
    _v4("cache_utils", "quantize_and_insert_k_cache", "dsv41.cache_utils", "quantize_and_insert_k_cache"),
    _v4("cache_utils", "dequantize_and_gather_k_cache", "dsv41.cache_utils", "dequantize_and_gather_k_cache"),
    _v4("cache_utils", "compute_global_topk_indices_and_lens", "dsv41.cache_utils", "compute_global_topk_indices_and_lens"),
    _v4("cache_utils", "combine_topk_swa_indices", "dsv41.cache_utils", "combine_topk_swa_indices"),
    _v4("cache_utils", "build_flashinfer_mixed_sparse_indices", "dsv41.cache_utils", "build_flashinfer_mixed_sparse_indices"),
)

# Per vLLM release: the targets, and what is kept by default.  Edit here when dsv41 or vLLM
# changes; a release not listed routes nothing unless DSV41_VLLM_OPS says so.
KNOWN = {
    "0.33.0": Version(
        targets=_TARGETS_0_33,
        # every op writes vLLM 0.33.0's bytes on NVIDIA GPUs, the norms and the CR-2 softmax
        # included (the GPU's approximate rsqrt / ex2 / div.full: dsv41.core.gpu_approx)
        differs={},
        keep={
            "can_fuse_query_quant": (
                "decides from vLLM's own layer and kernel classes; vLLM's answer is authoritative"
            ),
        },
    ),
}


def _return_quantized_activation(vmod, dfn):
    """dsv41's ``(QuantizedActivation, kv)`` with the first turned into vLLM's class."""
    qa_cls = getattr(vmod, "QuantizedActivation", None)
    key = getattr(vmod, "kMxfp8Dynamic", None)
    if qa_cls is None or key is None:
        raise LookupError(f"{vmod.__name__} has no QuantizedActivation / kMxfp8Dynamic to return")

    @functools.wraps(dfn)
    def fused_q_kv_rmsnorm_quant(qr, kv, q_weight, kv_weight, eps):
        q, kv_out = dfn(qr, kv, q_weight, kv_weight, eps)
        return qa_cls(q.data, q.scale, q.orig_dtype, q.orig_shape, key), kv_out

    return fused_q_kv_rmsnorm_quant


_ADAPTERS = {"quantized_activation": _return_quantized_activation}


# --------------------------------------------------------------------------- decisions


@dataclasses.dataclass
class Decision:
    target: Target
    routed: bool
    detail: str  # routed: the dsv41 implementation; kept: why
    warn: bool = False
    new: object = None  # what replaces vLLM's function (dsv41's, or its adapter)
    old: object = None  # vLLM's function

    @property
    def line(self) -> str:
        if self.routed:
            return f"routed {self.target.vllm_name} -> dsv41 {self.detail}"
        return f"kept {self.target.vllm_name}: {self.detail}"


def _vllm_version() -> str:
    import vllm

    v = getattr(vllm, "__version__", None)
    if not v:
        from importlib.metadata import version

        v = version("vllm")
    return str(v)


def _release(version: str) -> str:
    """``0.33.0+cu130`` -> ``0.33.0``: a local build tag changes the binary, not the ops' source."""
    return version.split("+", 1)[0]


def _selection(raw: str | None):
    """DSV41_VLLM_OPS -> (mode, names): mode is "default", "all", "none" or "list"."""
    if raw is None or not raw.strip():
        return "default", frozenset()
    value = raw.strip()
    if value.lower() in ("all", "none"):
        return value.lower(), frozenset()
    return "list", frozenset(n.strip() for n in value.split(",") if n.strip())


def _named(t: Target, names) -> bool:
    return t.name in names or t.vllm_name in names


def _lookup(table: dict, t: Target) -> str | None:
    return table.get(t.vllm_name) or table.get(t.name)


def _is_plain_function(obj) -> bool:
    return inspect.isfunction(obj) or inspect.isbuiltin(obj)


def _same_default(a, b) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def signature_problem(vllm_fn, dsv41_fn) -> str | None:
    """Why a call written for ``vllm_fn`` might not mean the same to ``dsv41_fn`` (None: it does).

    Every vLLM parameter must exist in dsv41 with the same name, kind and default (positional
    ones at the same position); dsv41's extra parameters must have defaults and come after
    vLLM's positional ones, so no call valid for vLLM can reach them.  Annotations are not
    compared (vLLM's name its own classes)."""
    try:
        vs = inspect.signature(vllm_fn).parameters
        ds = inspect.signature(dsv41_fn).parameters
    except (TypeError, ValueError) as exc:
        return f"signature unreadable ({exc})"
    P = inspect.Parameter
    positional = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
    vpos = [p for p in vs.values() if p.kind in positional]
    dpos = [p for p in ds.values() if p.kind in positional]
    for i, vp in enumerate(vpos):
        if i >= len(dpos):
            return f"dsv41 lacks parameter {vp.name!r}"
        dp = dpos[i]
        if dp.name != vp.name:
            return f"parameter {i + 1} is {vp.name!r} in vLLM, {dp.name!r} in dsv41"
        if dp.kind != vp.kind:
            return f"parameter {vp.name!r} is {vp.kind.description} in vLLM, {dp.kind.description} in dsv41"
        if not _same_default(vp.default, dp.default):
            return f"parameter {vp.name!r} defaults to {vp.default!r} in vLLM, {dp.default!r} in dsv41"
    for dp in dpos[len(vpos):]:
        if dp.default is P.empty:
            return f"dsv41 requires parameter {dp.name!r}, which vLLM does not have"
    for vp in vs.values():
        if vp.kind in positional:
            continue
        if vp.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            if not any(dp.kind == vp.kind for dp in ds.values()):
                return f"vLLM takes {'*' if vp.kind == P.VAR_POSITIONAL else '**'}{vp.name}, dsv41 does not"
            continue
        dp = ds.get(vp.name)
        if dp is None:
            return f"dsv41 lacks keyword-only parameter {vp.name!r}"
        if dp.kind != P.KEYWORD_ONLY:
            return f"parameter {vp.name!r} is keyword-only in vLLM, {dp.kind.description} in dsv41"
        if not _same_default(vp.default, dp.default):
            return f"parameter {vp.name!r} defaults to {vp.default!r} in vLLM, {dp.default!r} in dsv41"
    for dp in ds.values():
        if dp.kind == P.KEYWORD_ONLY and dp.name not in vs and dp.default is P.empty:
            return f"dsv41 requires keyword-only parameter {dp.name!r}, which vLLM does not have"
    return None


def _device():
    """(vendor, torch device type, arch or None) as vLLM sees the machine.

    dsv41's own probe would create a CUDA context, and a plugin runs in vLLM's front-end
    process before workers fork; vLLM's platform answers from NVML instead."""
    try:
        from vllm.platforms import current_platform as p
    except Exception:
        return "cpu", "cpu", "cpu"
    if p.is_cuda():
        cap = p.get_device_capability()
        return "nvidia", "cuda", (f"sm_{cap.major}{cap.minor}" if cap is not None else None)
    if p.is_rocm():
        return "amd", "cuda", None
    if p.is_xpu():
        return "intel", "xpu", "xpu"
    return "cpu", "cpu", "cpu"


def _implementation(op: str, device) -> tuple[str | None, str]:
    """(name, note) of what dsv41's registry selects for ``op`` on ``device`` (name None: nothing
    runs there).  Uses the registry's own resolution when dsv41 has probed the machine already
    (or it is a CPU); otherwise the same walk over the candidates on the platform vLLM reports."""
    from dsv41.core import platform as dplat
    from dsv41.core import registry
    from dsv41.core.formats import Fp8Flavour

    vendor, device_type, arch = device
    if dplat._cached is not None or device_type == "cpu" or os.environ.get("DSV41_PLATFORM"):
        res = registry.resolve(op)
        sel = res.selected_for(dplat.probe().device_type)
        if sel is None:
            return None, "; ".join(f"{n}: {', '.join(r)}" for n, r in res.rejected.items())
        return sel[0], " (forced)" if res.forced else ""
    if arch is None:
        return "(chosen on the first call; python -m dsv41 info)", ""
    if arch in dplat.INJECTABLE:
        native = dplat.INJECTABLE[arch][2]
    else:
        major_minor = tuple(int(x) for x in arch[3:5]) if vendor == "nvidia" and arch[3:].isdigit() else (0, 0)
        native = (Fp8Flavour.OCP,) if major_minor >= (8, 9) else ()
    packages = {name: dplat.package_status(mod) for name, mod in dplat.PACKAGES.items()}
    plat = dplat.Platform(vendor, device_type, arch, native, "vllm", packages)
    forced = (os.environ.get(f"DSV41_BACKEND_{op.upper()}") or os.environ.get("DSV41_BACKEND") or "").strip()
    why = []
    for b in registry.candidates(op, plat):
        if forced and forced not in (b.name, b.family):
            continue
        reasons = b.reasons(op, plat)
        if reasons:
            why.append(f"{b.name}: {', '.join(reasons)}")
        elif b.device_type in (None, device_type):
            return b.name, " (forced)" if forced else ""
    return None, "; ".join(why) or "no candidate"


def decisions(version: str | None = None, env: str | None = None, resolve_device: bool = True) -> list[Decision]:
    """What ``register()`` would do: one Decision per target (imports vLLM's op modules)."""
    version = _vllm_version() if version is None else version
    mode, names = _selection(os.environ.get(ENV) if env is None else env)
    spec = KNOWN.get(_release(version))
    targets = spec.targets if spec else KNOWN[max(KNOWN)].targets
    known_names = {t.name for t in targets} | {t.vllm_name for t in targets}
    for n in sorted(names - known_names):
        log.warning("%s names %r, which is no vLLM op dsv41 can route (names: %s)", ENV, n, ", ".join(sorted({t.name for t in targets})))

    out: list[Decision] = []
    device = None
    for t in targets:
        try:
            vmod = importlib.import_module(t.module)
        except Exception as exc:
            out.append(Decision(t, False, f"vLLM module does not import ({type(exc).__name__}: {exc})"))
            continue
        old = getattr(vmod, t.name, None)
        if old is None:
            out.append(Decision(t, False, f"vLLM {version} has no {t.name} in {t.module}"))
            continue
        if not _is_plain_function(old):
            out.append(Decision(t, False, f"vLLM's is a Triton device function ({type(old).__name__}) called inside vLLM's own kernels, not a host function", old=old))
            continue
        try:
            new = getattr(importlib.import_module(t.dsv41), t.name)
        except (ImportError, AttributeError):
            out.append(Decision(t, False, f"dsv41 has no {t.dsv41}.{t.name}", old=old))
            continue
        if not _is_plain_function(new):
            out.append(Decision(t, False, f"dsv41's {t.name} is a {type(new).__name__}, vLLM's a host function", old=old))
            continue
        problem = signature_problem(old, new)
        if problem:
            out.append(Decision(t, False, f"signature differs: {problem}", old=old))
            continue

        named = _named(t, names)
        warn = False
        if mode == "none":
            out.append(Decision(t, False, f"{ENV}=none", old=old))
            continue
        if mode == "list" and not named:
            out.append(Decision(t, False, f"not named in {ENV}", old=old))
            continue
        if spec is None:
            if mode == "default":
                out.append(Decision(t, False, f"vLLM {version} is not a version dsv41 was checked against (known: {', '.join(KNOWN)}); set {ENV}=all or name ops to route", old=old))
                continue
            warn = True
        else:
            differs = _lookup(spec.differs, t)
            keep = _lookup(spec.keep, t)
            if mode == "default" and (differs or keep):
                out.append(Decision(t, False, f"{differs or keep}; name it in {ENV} to route it", old=old))
                continue
            warn = bool(differs) and mode == "all" and not named

        if t.adapt:
            try:
                new = _ADAPTERS[t.adapt](vmod, new)
            except Exception as exc:
                out.append(Decision(t, False, f"cannot adapt dsv41's return value ({exc})", old=old))
                continue

        detail = "host-side helper"
        if t.op is not None and resolve_device:
            device = device or _device()
            try:
                impl, note = _implementation(t.op, device)
            except Exception as exc:  # a forced backend that cannot run, a bad DSV41_PLATFORM
                out.append(Decision(t, False, f"dsv41 cannot run {t.op} here ({type(exc).__name__}: {exc})", old=old))
                continue
            if impl is None:
                out.append(Decision(t, False, f"no dsv41 implementation of {t.op} runs on {device[2] or device[1]}: {note}", old=old))
                continue
            detail = f"{t.name} [{impl}{note}]"
        elif t.op is not None:
            detail = t.name
        else:
            detail = f"{t.name} [host-side helper]"
        if spec is None:
            detail += f" (vLLM {version} is not a version dsv41 was checked against)"
        elif warn:
            detail += f" ({_lookup(spec.differs, t)})"
        out.append(Decision(t, True, detail, warn=warn, new=new, old=old))
    return out


# --------------------------------------------------------------------------- rebinding

_lock = threading.Lock()
_registered = False
_bindings: list = []  # (module, attribute, vLLM's object, dsv41's object), in order of rebinding
_decisions: list = []


def _rebind(pairs: dict) -> list:
    """Replace each old object (id -> (old, new)) wherever a loaded vllm.* module holds it."""
    done = []
    for modname, mod in list(sys.modules.items()):
        if mod is None or not (modname == "vllm" or modname.startswith("vllm.")):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for attr, value in items:
            hit = pairs.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(mod, attr, hit[1])
                done.append((mod, attr, hit[0], hit[1]))
    return done


def register() -> None:
    """The ``vllm.general_plugins`` entry point: route what matches, log one line per op.

    A second call in the same process does nothing."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
        version = _vllm_version()
        for pkg in (V41, V4):
            try:
                importlib.import_module(pkg)
            except Exception as exc:
                log.warning("dsv41: vLLM's %s does not import (%s: %s)", pkg, type(exc).__name__, exc)
        found = decisions(version)
        pairs = {id(d.old): (d.old, d.new) for d in found if d.routed}
        _bindings.extend(_rebind(pairs))
        _decisions[:] = found
        for d in found:
            log.log(logging.WARNING if d.warn else logging.INFO, "%s", d.line)
        routed = sum(d.routed for d in found)
        log.info("dsv41 %s on vLLM %s: %d routed, %d kept (%s=%s)", _dsv41_version(), version, routed,
                 len(found) - routed, ENV, os.environ.get(ENV, "<unset>"))


def _dsv41_version() -> str:
    import dsv41

    return dsv41.__version__


def routed() -> list[Decision]:
    """The decisions of this process's ``register()`` (empty before it ran)."""
    return list(_decisions)


def _unregister() -> None:
    """Put vLLM's functions back and allow ``register()`` again (tests)."""
    global _registered
    with _lock:
        for mod, attr, old, new in reversed(_bindings):
            if getattr(mod, attr, None) is new:
                setattr(mod, attr, old)
        _bindings.clear()
        _decisions.clear()
        _registered = False

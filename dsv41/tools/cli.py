"""Command line: ``python -m dsv41 info|check|bench``."""

from __future__ import annotations

import argparse
import json
import sys

from ..core import env, platform, registry


def _family_of() -> dict:
    return {b.name: b.family for b in registry._backends()}


def _info(args) -> int:
    plat = platform.probe()
    ops = {}
    try:
        for op in registry.OPS:
            res = registry.resolve(op)
            sel = res.selected_for(plat.device_type)
            ops[op] = {
                "selected": sel[0] if sel else None,
                "forced": res.forced,
                "candidates": {n: r for n, r in res.rejected.items()},
            }
    except (registry.BackendUnavailable, ValueError) as exc:
        print(f"dsv41: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"platform": plat.to_json(), "ops": ops}, indent=2))
        return 0
    p = plat.to_json()
    print(f"platform: {p['vendor']} {p['arch']} ({p['device_type']}, {p['source']}), "
          f"native fp8: {', '.join(p['native_fp8']) or 'none'}, torch {p['torch']}")
    for name, st in p["packages"].items():
        print(f"  {name}: {st['version'] or 'available' if st['available'] else 'unavailable: ' + (st['error'] or '')}")
    family = _family_of()
    for op, o in ops.items():
        print(f"{op}: {o['selected']}" + (f"  (forced {o['forced']})" if o["forced"] else ""))
        if args.verbose:
            for n, reasons in o["candidates"].items():
                print(f"    {n}: {'; '.join(reasons)}")
            continue
        # one line per rejected family: its members and their distinct reasons, first one shown
        by_family: dict = {}
        for n, reasons in o["candidates"].items():
            names, why = by_family.setdefault(family.get(n, n), ([], []))
            names.append(n)
            why.extend(r for r in reasons if r not in why)
        for fam, (names, why) in by_family.items():
            why.sort(key=lambda r: "has no implementation" in r)  # the platform's reason first
            label = fam if names == [fam] else f"{fam} ({', '.join(names)})"
            more = f" (+{len(why) - 1} more)" if len(why) > 1 else ""
            print(f"    not {label}: {why[0]}{more}")
    if not args.verbose:
        print("(python -m dsv41 info --verbose lists every reason)")
    return 0


def _check(args) -> int:
    """Run a V4.1-shaped pipeline through the selected implementations and compare with the reference."""
    import torch

    from .conformance import CASES, PIPELINE, _on, clone_args, written_bytes
    from ..reference import ReferenceBackend

    device = args.device
    ref = ReferenceBackend()
    by_id = {c.id: c for c in CASES}
    ids = list(PIPELINE) if not args.all else [c.id for c in CASES]
    failed = 0
    rows = []
    for cid in ids:
        case = by_id[cid]
        try:
            res = registry.resolve(case.op)
            name, kern = res.selected_for(torch.device(device).type) or (None, None)
        except registry.BackendUnavailable as exc:
            rows.append((cid, "-", "ERROR", str(exc)))
            failed += 1
            continue
        args_ = case.build("cpu")
        want = clone_args(args_)
        ref.load(case.op)(*want)
        got = _on(device, clone_args(args_))
        try:
            kern(*got)
            bad = sum(int((written_bytes(got[i]) != written_bytes(want[i])).sum()) for i in case.writes if want[i] is not None)
            status, note = ("PASS", "") if bad == 0 else ("FAIL", f"{bad} bytes differ")
        except Exception as exc:  # report, keep going
            status, note = "ERROR", f"{type(exc).__name__}: {exc}"
        failed += status != "PASS"
        rows.append((cid, name, status, note))
    w = max(len(r[0]) for r in rows) + 2
    print(f"{'case'.ljust(w)}{'implementation'.ljust(16)}result")
    for cid, name, status, note in rows:
        print(f"{cid.ljust(w)}{str(name).ljust(16)}{status} {note}")
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _device_error(device: str) -> str | None:
    """Why ``--device`` cannot be used here (one line), or None."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"--device {device!r} is not a device; use cpu, cuda or xpu"
    if dev.type == "cpu":
        return None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else (
                f"ROCm {torch.version.hip}" if torch.version.hip else "a CPU-only build")
            return (f"--device cuda: no CUDA/ROCm device is available here (torch {torch.__version__} is "
                    f"{build}; no GPU or no driver found); use --device cpu")
        return None
    if dev.type == "xpu":
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            return "--device xpu: no Intel XPU is available here; use --device cpu"
        return None
    return f"--device {device!r}: dsv41 runs on cpu, cuda and xpu tensors"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="platform fingerprint and, per op, the selected implementation and why others were rejected")
    p.add_argument("--json", action="store_true")
    p.add_argument("--verbose", "-v", action="store_true", help="every rejected implementation with every reason")
    p = sub.add_parser("check", help="run a V4.1 pipeline through the selected implementations; non-zero exit on any byte mismatch")
    p.add_argument("--device", default="cpu", help="device of the tensors (cpu, cuda, xpu); default cpu")
    p.add_argument("--all", action="store_true", help="every conformance case, not just the pipeline")
    sub.add_parser("bench", help="benchmark (see python -m dsv41 bench --help)", add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    env.check()
    if argv and argv[0] in ("info", "check", "bench") and "-h" not in argv and "--help" not in argv:
        try:
            platform.probe()
        except ValueError as exc:  # DSV41_PLATFORM names no platform
            print(f"dsv41: {exc}", file=sys.stderr)
            return 2
    if argv and argv[0] == "bench":
        from . import bench

        return bench.main(argv[1:])
    args = ap.parse_args(argv)
    if args.cmd == "check":
        why = _device_error(args.device)
        if why:
            print(f"dsv41 check: {why}", file=sys.stderr)
            return 2
    return {"info": _info, "check": _check}[args.cmd](args)

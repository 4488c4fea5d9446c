"""Command line: ``python -m dsv41 info|check|bench``."""

from __future__ import annotations

import argparse
import json
import sys

from . import platform, registry


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
    for op, o in ops.items():
        print(f"{op}: {o['selected']}" + (f"  (forced {o['forced']})" if o["forced"] else ""))
        for n, reasons in o["candidates"].items():
            print(f"    {n}: {'; '.join(reasons)}")
    return 0


def _check(args) -> int:
    """Run a V4.1-shaped pipeline through the selected implementations and compare with the reference."""
    import torch

    from .conformance import CASES, PIPELINE, _on, clone_args, written_bytes
    from .reference import ReferenceBackend

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv41", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="platform fingerprint and, per op, the selected implementation and why others were rejected")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("check", help="run a V4.1 pipeline through the selected implementations; non-zero exit on any byte mismatch")
    p.add_argument("--device", default="cpu", help="device of the tensors (cpu, cuda, xpu); default cpu")
    p.add_argument("--all", action="store_true", help="every conformance case, not just the pipeline")
    sub.add_parser("bench", help="benchmark (see python -m dsv41 bench --help)", add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from . import bench

        return bench.main(argv[1:])
    args = ap.parse_args(argv)
    return {"info": _info, "check": _check}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

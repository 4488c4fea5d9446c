"""Two sets of ``python -m dsv41 bench --json`` records side by side: a baseline (an earlier
commit's code, benched on the same machine in the same lease) and the current code.

    python tools/bench_compare.py --base old1.json old2.json --new new1.json new2.json [--limit 0.03]

Rows are matched on (op, variant, backend, tokens); where a side has several files, each
figure is the median over them.  Printed per row: cold-L2 µs (sizes above the bench's decode
sizes) and CUDA-graph replay µs (decode sizes), baseline -> current and the change, with the
same-run copy figures beside them for scale.  A change above ``--limit`` is marked ``!``, or
``?`` where the same-size copy's replay moved by more than ``--limit`` between the two sides as
well (graph replay on a noisy host: the change is not resolved); the exit status is 1 when any
row is marked ``!`` (2 when nothing matched).

Bench figures from different machines are not comparable: bench the baseline on the machine
that benches the current code (docs/performance.md, "Against the last table").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def _key(r: dict) -> tuple:
    return (r["op"], r.get("variant"), r["backend"], r["tokens"])


def load(paths) -> dict:
    """(op, variant, backend, tokens) -> {field: median over the files} for the timed fields."""
    runs: dict = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f):
                if r.get("backend") == "reference":
                    continue
                runs.setdefault(_key(r), []).append(r)
    fields = ("seconds", "graph_seconds", "copy_graph_seconds", "copy_gbps", "fraction_of_copy")
    out = {}
    for k, rs in runs.items():
        row = {}
        for f in fields:
            vals = [r[f] for r in rs if r.get(f) is not None]
            row[f] = statistics.median(vals) if vals else None
        out[k] = row
    return out


def compare(base: dict, new: dict, limit: float) -> tuple[list, int, int]:
    """(lines, rows over the limit, rows over it whose same-run copy moved as much)."""
    lines, over, unresolved = [], 0, 0
    for k in sorted(set(base) & set(new), key=lambda k: (k[0], str(k[1]), k[2], k[3])):
        b, n = base[k], new[k]
        head = f"{k[0][:36]:36s} {k[1] or '-'!s:6s} {k[2]:12s} {k[3]:6d}"
        for field, label, copy in (("graph_seconds", "graph", "copy_graph_seconds"), ("seconds", "cold", None)):
            if field == "seconds" and n.get("graph_seconds") is not None:
                continue  # decode sizes: the replay figure is the one that counts
            if b.get(field) and n.get(field):
                change = n[field] / b[field] - 1
                mark = "!" if change > limit else " "
                extra = ""
                if copy and b.get(copy) and n.get(copy):
                    extra = f"  copy {b[copy] * 1e6:.2f} / {n[copy] * 1e6:.2f}"
                    if mark == "!" and abs(n[copy] / b[copy] - 1) > limit:
                        mark = "?"  # the same-size copy moved as much: below this host's noise
                        unresolved += 1
                elif b.get("fraction_of_copy") and n.get("fraction_of_copy"):
                    extra = f"  of copy {b['fraction_of_copy']:.2f} / {n['fraction_of_copy']:.2f}"
                over += mark == "!"
                lines.append(f"{mark} {head} {label:5s} {b[field] * 1e6:9.2f} -> {n[field] * 1e6:9.2f} us "
                             f"{change:+7.1%}{extra}")
                break
    for k in sorted(set(base) ^ set(new), key=lambda k: (k[0], str(k[1]), k[2], k[3])):
        lines.append(f"  {k[0][:36]:36s} {k[1] or '-'!s:6s} {k[2]:12s} {k[3]:6d} only in "
                     f"{'the baseline' if k in base else 'the current run'}")
    return lines, over, unresolved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", nargs="+", required=True, help="the baseline's bench JSON files")
    p.add_argument("--new", nargs="+", required=True, help="the current code's bench JSON files")
    p.add_argument("--limit", type=float, default=0.03, help="largest slowdown not marked (default 0.03)")
    a = p.parse_args(argv)
    base, new = load(a.base), load(a.new)
    lines, over, unresolved = compare(base, new, a.limit)
    print("\n".join(lines))
    matched = len(set(base) & set(new))
    print(f"{matched} rows matched, {over} slower by more than {a.limit:.0%} (!), {unresolved} more whose "
          f"same-size copy moved by more than that too (?)")
    return 2 if not matched else 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())

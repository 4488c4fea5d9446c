"""Summarise the Nsight Compute CSV of ``tests/gpu_run.sh``'s profile step: one line per kernel
launch (in launch order, which is the order ``bench --profile`` prints), with the figures that
tell a memory-bound kernel's story: duration, DRAM / SM throughput (% of peak), registers,
theoretical / achieved occupancy, L2 hit rate and warp cycles per issued instruction.

    python tests/ncu_summary.py gpu-out/ncu.csv[.gz]
"""

from __future__ import annotations

import csv
import gzip
import sys

COLUMNS = (  # (header, section, metric)
    ("us", "GPU Speed Of Light Throughput", "Duration"),
    ("dram%", "GPU Speed Of Light Throughput", "DRAM Throughput"),
    ("sm%", "GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    ("mem%", "GPU Speed Of Light Throughput", "Memory Throughput"),
    ("MHz", "GPU Speed Of Light Throughput", "SM Frequency"),
    ("regs", "Launch Statistics", "Registers Per Thread"),
    ("smem", "Launch Statistics", "Static Shared Memory Per Block"),
    ("occ_th", "Occupancy", "Theoretical Occupancy"),
    ("occ", "Occupancy", "Achieved Occupancy"),
    ("waves", "Launch Statistics", "Waves Per SM"),
    ("l2hit", "Memory Workload Analysis", "L2 Hit Rate"),
    ("cpi", "Warp State Statistics", "Warp Cycles Per Issued Instruction"),
)
SCALE = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "hz": 1e-6}


def _num(value: str, unit: str) -> float | None:
    try:
        v = float(value.replace(",", ""))
    except ValueError:
        return None
    return v * SCALE.get(unit, 1.0)


def summarise(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        lines = [ln for ln in f if not ln.startswith("==")]
    launches: dict[str, dict] = {}
    for row in csv.DictReader(lines):
        k = launches.setdefault(row["ID"], {"name": row["Kernel Name"], "grid": row["Grid Size"],
                                            "block": row["Block Size"]})
        k[(row["Section Name"], row["Metric Name"])] = _num(row["Metric Value"], row["Metric Unit"])
    head = ["id", "kernel", "grid", "block"] + [c[0] for c in COLUMNS]
    out = ["\t".join(head)]
    for i, k in sorted(launches.items(), key=lambda kv: int(kv[0])):
        cells = [i, k["name"][:40], k["grid"].replace(" ", ""), k["block"].replace(" ", "")]
        for _, sec, met in COLUMNS:
            v = k.get((sec, met))
            cells.append("-" if v is None else f"{v:.4g}")
        out.append("\t".join(cells))
    return "\n".join(out)


if __name__ == "__main__":
    print(summarise(sys.argv[1]))

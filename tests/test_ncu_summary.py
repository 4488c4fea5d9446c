"""tests/ncu_summary.py: one line per profiled launch, units normalised (ns -> us, Hz -> MHz)."""

from __future__ import annotations

import gzip

import ncu_summary  # tests/ is on sys.path (rootdir import)

CSV = '''==PROF== Connected to process 1
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python","h","_quant_insert_kernel","1","7","(128, 1, 1)","(2, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","ns","3,136"
"0","1","python","h","_quant_insert_kernel","1","7","(128, 1, 1)","(2, 1, 1)","0","9.0","GPU Speed Of Light Throughput","SM Frequency","hz","1,956,000,000"
"0","1","python","h","_quant_insert_kernel","1","7","(128, 1, 1)","(2, 1, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","40"
"1","1","python","h","_gather_kernel","1","7","(256, 1, 1)","(4, 512, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","us","31.52"
"1","1","python","h","_gather_kernel","1","7","(256, 1, 1)","(4, 512, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","53.43"
==PROF== Disconnected from process 1
'''


def test_summary_lines_and_units(tmp_path):
    path = tmp_path / "ncu.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(CSV)
    lines = ncu_summary.summarise(str(path)).splitlines()
    head = lines[0].split("\t")
    assert head[:4] == ["id", "kernel", "grid", "block"]
    rows = [dict(zip(head, ln.split("\t"))) for ln in lines[1:]]
    assert [r["kernel"] for r in rows] == ["_quant_insert_kernel", "_gather_kernel"]
    assert rows[0]["us"] == "3.136" and rows[0]["MHz"] == "1956" and rows[0]["regs"] == "40"
    assert rows[0]["grid"] == "(2,1,1)" and rows[0]["dram%"] == "-"
    assert rows[1]["us"] == "31.52" and rows[1]["dram%"] == "53.43"

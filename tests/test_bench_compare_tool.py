"""``tools/bench_compare.py`` on made-up bench records: which rows it marks slower, which it
leaves unresolved because the same-size copy moved as much, medians over several files, and
its exit status."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "tools" / "bench_compare.py")
bench_compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_compare)


def _rec(op, tokens, us=None, graph_us=None, copy_graph_us=None, backend="cuda:triton"):
    return {"op": op, "variant": None, "backend": backend, "tokens": tokens,
            "seconds": None if us is None else us * 1e-6, "fraction_of_copy": 0.9,
            "graph_seconds": None if graph_us is None else graph_us * 1e-6,
            "copy_graph_seconds": None if copy_graph_us is None else copy_graph_us * 1e-6}


def _write(path, records):
    path.write_text(json.dumps(records))
    return str(path)


def test_marks_slower_rows_and_unresolved_ones(tmp_path, capsys):
    base = [_rec("a", 65536, us=100.0), _rec("b", 65536, us=100.0), _rec("c", 1, graph_us=1.00, copy_graph_us=1.2),
            _rec("d", 1, graph_us=1.00, copy_graph_us=1.2), _rec("e", 8, graph_us=1.0, copy_graph_us=1.2),
            _rec("a", 65536, us=1.0, backend="reference"), _rec("only_old", 64, graph_us=1.0, copy_graph_us=1.0)]
    new = [_rec("a", 65536, us=102.9), _rec("b", 65536, us=103.5), _rec("c", 1, graph_us=1.10, copy_graph_us=1.21),
           _rec("d", 1, graph_us=1.10, copy_graph_us=1.40), _rec("e", 8, graph_us=0.5, copy_graph_us=1.2),
           _rec("only_new", 4096, us=5.0)]
    rc = bench_compare.main(["--base", _write(tmp_path / "b.json", base), "--new", _write(tmp_path / "n.json", new)])
    out = capsys.readouterr().out
    marks = {line[2:].split()[0]: line[0] for line in out.splitlines() if " us " in line}
    assert marks["a"] == " " and marks["b"] == "!"  # +2.9 % within, +3.5 % over the default 3 %
    assert marks["c"] == "!" and marks["d"] == "?"  # d's copy moved by 17 %: not resolved
    assert marks["e"] == " "
    assert "only in the baseline" in out and "only in the current run" in out
    assert "5 rows matched, 2 slower by more than 3% (!), 1 more" in out
    assert rc == 1


def test_medians_over_files_and_exit_status(tmp_path, capsys):
    base = [_write(tmp_path / f"b{i}.json", [_rec("x", 65536, us=us)]) for i, us in enumerate((100.0, 100.0, 500.0))]
    new = [_write(tmp_path / f"n{i}.json", [_rec("x", 65536, us=us)]) for i, us in enumerate((101.0, 90.0, 102.0))]
    assert bench_compare.main(["--base", *base, "--new", *new]) == 0  # medians 100 -> 101
    assert "+1.0%" in capsys.readouterr().out
    assert bench_compare.main(["--base", *base, "--new", *new, "--limit", "0.005"]) == 1
    nothing = _write(tmp_path / "other.json", [_rec("y", 1, graph_us=1.0, copy_graph_us=1.0)])
    assert bench_compare.main(["--base", *base, "--new", nothing]) == 2

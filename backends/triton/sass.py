"""Instruction mix of the Triton kernels' ahead-of-time builds, no GPU needed.

``python -m dsv41.backends.triton.sass [--top N] [--dump DIR] [--set K=V ...] [--one P,...]
[--num-warps N] [--from-label L] NAME_SUBSTRING ...``

Builds every AOT spec (``backends/triton/aot.py``) whose name contains one of the given
substrings for sm_90, disassembles the cubin with the ``nvdisasm`` that ships with Triton and
prints the number of SASS instructions (straight-line count: a loop body counts once), the
warp-instructions issued per token where the program handles ``BLOCK_T`` tokens, and the most
frequent opcodes.  ``--set`` / ``--num-warps`` build the specs with other constexprs / warps
(e.g. a launch shape the sweep times); ``--one`` builds integer parameters as the constant 1,
which is what Triton's JIT does with an argument equal to 1 (a contiguous tensor's last
stride), so the count is that of the build a launch runs; ``--from-label`` counts only the instructions from a
SASS label to the end (e.g. ``.L_x_0``, the branch of a kernel that one kind of launch runs).
Most of the cache kernels are issue-bound on the H200 rather than DRAM-bound (Nsight Compute: SM throughput
~80 % at 50 % DRAM), so the instruction count per element is the number to push down;
docs/performance.md quotes these counts.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

from . import aot

_OPCODE = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def _nvdisasm() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(path):
        raise SystemExit(f"nvdisasm not found at {path}")
    return path


def mix(spec, target: str = "sm90", from_label: str | None = None) -> tuple[collections.Counter, str]:
    """(opcode counts, SASS text) of one AOT spec built for ``target``; with ``from_label``,
    the counts of the instructions from that label (``.L_x_0``) to the end only."""
    kernel = aot._compile(spec, aot._gpu_target(target))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([_nvdisasm(), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    lines = sass.splitlines()
    if from_label is not None:
        start = next((i for i, line in enumerate(lines) if line.strip() == from_label + ":"), None)
        if start is None:
            raise ValueError(f"label {from_label!r} not in the SASS of {spec.name}")
        lines = lines[start:]
    ops = collections.Counter(m.group(1) for m in map(_OPCODE.match, lines) if m)
    ops.pop("NOP", None)  # alignment padding
    return ops, sass


def _setting(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--set takes NAME=VALUE, got {text!r}")
    low = value.lower()
    if low in ("true", "false"):
        return name, low == "true"
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--set {name}: an integer or true/false, got {value!r}") from None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv41.backends.triton.sass",
                                description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="+", help="substrings of AOT spec names, e.g. _quant_insert_kernel[528")
    p.add_argument("--target", default="sm90", choices=("sm90", "sm100"))
    p.add_argument("--top", type=int, default=8, help="opcodes listed per kernel")
    p.add_argument("--dump", metavar="DIR", help="also write each kernel's SASS there")
    p.add_argument("--set", type=_setting, action="append", default=[], metavar="NAME=VALUE",
                   help="build with this constexpr value instead (repeatable)")
    p.add_argument("--one", action="append", default=[], metavar="P,...",
                   help="integer parameters passed as 1, built as the JIT builds them (repeatable)")
    p.add_argument("--num-warps", type=int, metavar="N", help="build for N warps instead")
    p.add_argument("--from-label", metavar="LABEL", help="count from this SASS label on, e.g. .L_x_0")
    a = p.parse_args(argv)
    aot.discover()
    specs = [s for s in aot.AOT_SPECS if a.target in s.targets and any(n in s.name for n in a.names)]
    if not specs:
        print("no AOT spec matches", file=sys.stderr)
        return 2
    changes = dict(a.set)
    ones = [n for arg in a.one for n in arg.split(",") if n]
    for spec in specs:
        unknown = sorted(set(changes) - set(spec.constexprs) - {k for k, t in spec.signature.items() if t == "constexpr"})
        if unknown:
            p.error(f"--set: {spec.name} has no constexpr {', '.join(unknown)}")
        unknown = sorted(n for n in ones if spec.signature.get(n) not in aot.INT_TYPES)
        if unknown:
            p.error(f"--one: {spec.name} has no integer parameter {', '.join(unknown)}")
    for spec in specs:
        if changes or ones or a.num_warps:
            tag = ",".join([*(f"{k}={v}" for k, v in changes.items()), *(f"{n}=1" for n in ones)])
            if a.num_warps:
                tag += f"{',' if tag else ''}{a.num_warps} warps"
            spec = aot.as_ones(spec, ones) if ones else spec
            spec = dataclasses.replace(spec, name=f"{spec.name.removesuffix('[ints=1]')}{{{tag}}}",
                                       constexprs={**spec.constexprs, **changes},
                                       num_warps=a.num_warps or spec.num_warps)
        try:
            ops, sass = mix(spec, a.target, a.from_label)
        except ValueError as exc:  # the label is not in this build
            p.error(str(exc))
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(a.top))
        total = sum(ops.values())
        bt = spec.constexprs.get("BLOCK_T")
        # every warp runs the whole program: warp-instructions issued per token (row)
        per = f", {total * spec.num_warps / bt:.0f} warp-instructions per token" if bt else ""
        print(f"{spec.name} [{spec.num_warps} warps, BLOCK_T {bt}]: {total} instructions{per} ({top})")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            with open(os.path.join(a.dump, re.sub(r"[^\w.,-]", "_", spec.name) + ".sass"), "w") as f:
                f.write(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
